"""State that tells the truth (issue 45, item 4), on this machine (a local host: the node program
runs as a process here): `stop` on a run that is over says so, exits 0 and writes nothing into its
run directory (it printed "stopped" and wrote stop-requested); the run's state in words is one rule
for `status` and `stop`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from ftbundle.rundir import STOP_REQUEST
from ftbundle.runs import run_state
from tests.support.helpers import REPO


def ftb(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftbundle", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_runs_state_in_words():
    assert run_state(["exited 0", "exited 0"]) == ("finished", False)
    assert run_state(["running", "exited 3"]) == ("failing", True)
    assert run_state(["stopped: launcher lost: no ping for 10s", "exited 143"]) == ("failed", True)
    assert run_state(["stopped: shared storage /x on n1 not answering for 30s", "stopped"]) == (
        "stopped: shared storage /x on n1 not answering for 30s", False)
    assert run_state(["running", "unreachable"]) == ("running", False)
    assert run_state([]) == ("stopped", False)


def test_stop_on_a_finished_run_says_so_and_writes_nothing(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "over", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"), "check": False,
        "train": {"command": "echo done"}}))
    run = ftb(tmp_path, "run", "job.yaml")
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = next((tmp_path / "shared" / "runs").iterdir())
    before = sorted(p.name for p in run_dir.iterdir())
    stop = ftb(tmp_path, "stop", "job.yaml")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert f"run {run_dir.name} is not running (state: finished): nothing to stop" in stop.stderr, stop.stderr
    assert "stopped" not in stop.stderr.replace("not running", "")
    assert not (run_dir / STOP_REQUEST).exists()
    assert sorted(p.name for p in run_dir.iterdir()) == before
    status = ftb(tmp_path, "status", "job.yaml")
    assert status.returncode == 0 and "state: finished" in status.stdout, status.stdout + status.stderr


def test_a_run_directory_without_a_plan_is_passed_over_and_named(tmp_path):
    """An empty run directory and one with a broken plan.json, both newer than the good run:
    `status` and `logs` without --run say they pass them over and show the good run; `runs`
    lists them as what they are; --run naming one is refused with why (exit 2, no traceback)."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "kept", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"), "check": False,
        "train": {"command": "echo the good run"}}))
    assert ftb(tmp_path, "run", "job.yaml").returncode == 0
    runs = tmp_path / "shared" / "runs"
    good = next(runs.iterdir()).name
    (runs / "kept-20991231-235958-aaaa").mkdir()
    (runs / "kept-20991231-235959-bbbb").mkdir()
    (runs / "kept-20991231-235959-bbbb" / "plan.json").write_text('{"nodes": [')
    status = ftb(tmp_path, "status", "job.yaml")
    assert status.returncode == 0 and f"run {good}" in status.stdout and "state: finished" in status.stdout, \
        status.stdout + status.stderr
    assert "passing over kept-20991231-235959-bbbb: its plan.json is not valid JSON" in status.stderr, status.stderr
    assert "passing over kept-20991231-235958-aaaa: no plan.json there" in status.stderr, status.stderr
    logs = ftb(tmp_path, "logs", "job.yaml")
    assert logs.returncode == 0 and "the good run" in logs.stdout, logs.stdout + logs.stderr
    named = ftb(tmp_path, "status", "job.yaml", "--run", "kept-20991231-235959-bbbb")
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr
    assert "its plan.json is not valid JSON" in named.stderr, named.stderr
    listing = ftb(tmp_path, "runs", "job.yaml")
    assert listing.returncode == 0 and good in listing.stdout, listing.stdout + listing.stderr
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert "no run: no plan.json" in lines["kept-20991231-235958-aaaa"], listing.stdout
    assert "no run: plan.json is not valid JSON" in lines["kept-20991231-235959-bbbb"], listing.stdout
    assert "finished" in lines[good], listing.stdout
    # --last N: the newest N (by start), as a table and as JSON; a count that is not one is refused
    last = ftb(tmp_path, "runs", "job.yaml", "--last", "2")
    assert [line.split()[0] for line in last.stdout.splitlines()[1:]] == [
        "kept-20991231-235958-aaaa", "kept-20991231-235959-bbbb"], last.stdout
    rows = json.loads(ftb(tmp_path, "runs", "job.yaml", "--last", "1", "--json").stdout)
    assert [r["run_id"] for r in rows] == ["kept-20991231-235959-bbbb"], rows
    assert len(json.loads(ftb(tmp_path, "runs", "job.yaml", "--last", "9", "--json").stdout)) == 3
    for bad in ("0", "-1", "two"):
        refused = ftb(tmp_path, "runs", "job.yaml", "--last", bad)
        assert refused.returncode == 2 and "--last: must be a number of runs, 1 or more" in refused.stderr, \
            refused.stderr


def test_runs_json_says_a_broken_summary(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "sums", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"), "check": False,
        "train": {"command": "true"}}))
    assert ftb(tmp_path, "run", "job.yaml").returncode == 0
    run_dir = next((tmp_path / "shared" / "runs").iterdir())
    (run_dir / "summary.json").write_text("{not json")
    import json
    rows = json.loads(ftb(tmp_path, "runs", "job.yaml", "--json").stdout)
    assert rows[0]["state"] == "summary.json is not valid JSON", rows


def test_plot_of_a_run_without_metrics_blames_no_flag_never_given(tmp_path):
    """The newcomer walk: `plot` after a run that logged no step said "key '--run'" (never given)."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "quiet", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"), "check": False,
        "train": {"command": "true"}}))
    assert ftb(tmp_path, "run", "job.yaml").returncode == 0
    plot = ftb(tmp_path, "plot", "job.yaml", "-o", "loss.png")
    assert plot.returncode == 2 and "--run" not in plot.stderr and "has no training metrics" in plot.stderr, \
        plot.stderr
    assert "logging_steps" in plot.stderr


def test_status_shows_rank_0s_last_words_not_the_model_cards_dict(tmp_path):
    """`status` printed {'task': {'name': 'Causal Language Modeling', ...}} as rank 0's state (the
    trainer's last line, recorded in tests/data/llamafactory/cpu-3steps.node-0.log): the node
    program's `state` passes over it, and the model card's words before it, to the closing figures."""
    recorded = (REPO / "tests/data/llamafactory/cpu-3steps.node-0.log").read_text().splitlines()
    end = next(i for i, line in enumerate(recorded) if line.startswith("{'task': "))
    log = tmp_path / "node-0.a1.log"
    log.write_text("\n".join(recorded[:end + 1]) + "\n")
    argv = ["bash", str(REPO / "ftbundle/remote/node.sh"), "state", "no-such-marker", str(tmp_path / "exit"), str(log),
            str(tmp_path / "stopped")]
    said = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert said == ["stopped", "  train_steps_per_second   =     28.745"], said
    assert not said[1].startswith("{'task'")


def test_a_runs_curve_keeps_every_attempt_and_plot_draws_each(tmp_path):
    """metrics.jsonl held only the last attempt's records: after a lost host the first attempt's
    curve was gone (issue 45). Records carry their attempt; read_metrics gives one curve per
    attempt of a run that had several, and the run's single curve otherwise."""
    import json

    from ftbundle.history import read_metrics

    runs = tmp_path / "runs"
    for run_id, records in {"j-20261128-100000-aaaa": [(1, 1, 2.0), (1, 2, 1.8), (2, 2, 1.9), (2, 3, 1.6)],
                            "j-20261128-110000-bbbb": [(1, 1, 2.1), (1, 2, 1.7)]}.items():
        (runs / run_id).mkdir(parents=True)
        (runs / run_id / "metrics.jsonl").write_text("".join(
            json.dumps({"current_steps": step, "loss": loss, "attempt": attempt}) + "\n"
            for attempt, step, loss in records))
    got = read_metrics(["j-20261128-100000-aaaa", "j-20261128-110000-bbbb"], str(tmp_path))
    assert sorted(got) == ["j-20261128-100000-aaaa attempt 1", "j-20261128-100000-aaaa attempt 2",
                           "j-20261128-110000-bbbb"]
    assert [r["current_steps"] for r in got["j-20261128-100000-aaaa attempt 2"]] == [2, 3]


def run_in_background(cwd: Path):
    """`ftbundle run job.yaml` started, its output read as it comes: (the process, its lines so far,
    the reading thread)."""
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", "job.yaml"], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    return proc, out, reader


def wait_for_attempt_log(cwd: Path, proc, out: list[str], text: str = "") -> Path:
    """Attempt 1's node log holding ``text`` (60 s at most); the run directory."""
    import time

    deadline = time.monotonic() + 60
    while not any(text in p.read_text() for p in (cwd / "shared").glob("runs/*/node-0-*.a1.log")):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
        time.sleep(0.1)
    return next((cwd / "shared" / "runs").iterdir())


def test_stop_on_an_attached_run_stops_it_for_good_and_not_as_a_failure(tmp_path):
    """`ftbundle stop` from another terminal on a run attached to its launcher, with restarts left:
    the launcher said "failed: exit code 143 (SIGTERM)" with a traceback's place, restarted the
    run (`stop` had said "stopped"), and told its notifier a failure. It is a stop: said as one,
    no restart, exit 130, state "stopped" in summary.json, `runs` and the notifier's word."""
    told = tmp_path / "told.json"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "attached", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"), "check": False,
        "restarts": 2, "notify": {"command": f"cat > {told}"},
        "train": {"command": "echo started; sleep 120"}}))
    proc, out, reader = run_in_background(tmp_path)
    try:
        run_dir = wait_for_attempt_log(tmp_path, proc, out, "started")
        stop = ftb(tmp_path, "stop", "job.yaml")
        assert stop.returncode == 0 and "rank 0 localhost: stopped" in stop.stderr, stop.stderr
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    text = "".join(out)
    assert code == 130, text
    assert f"stopped by `ftbundle stop` ({run_dir / STOP_REQUEST}): every node stopped in " in text, text
    assert "restarting" not in text and "failed" not in text and "143" not in text, text
    assert not list(run_dir.glob("*.a2.*")), sorted(p.name for p in run_dir.iterdir())  # (no second attempt)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["state"], summary["exit_code"], summary["failed_host"]) == ("stopped", 130, None)
    word = json.loads(told.read_text())
    assert word["state"] == "stopped" and word["failure"] is None, word
    runs = ftb(tmp_path, "runs", "job.yaml", "--json")
    assert json.loads(runs.stdout)[0]["state"] == "stopped", runs.stdout


def test_a_stop_between_two_attempts_starts_no_other(tmp_path):
    """`ftbundle stop` while the launcher is between attempts (no node running: the restart's teardown,
    a lost host's wait) said "not running: nothing to stop", and the launcher then started the next
    attempt. Now `stop` writes its request into a failed run with no record of its end, and the
    launcher reads it before each restart: the failure is reported as what it was, no attempt 2."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "between", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"), "check": False,
        "restarts": 2, "train": {"command": "echo started; sleep 3; exit 3"}}))
    proc, out, reader = run_in_background(tmp_path)
    try:
        run_dir = wait_for_attempt_log(tmp_path, proc, out)
        # (the request as `stop` writes it, while attempt 1 runs: it fails by itself, exit 3, after)
        (run_dir / STOP_REQUEST).write_text("stop requested\n")
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    text = "".join(out)
    assert code == 130, text
    assert "exit code 3" in text and "stopped by `ftbundle stop` (" in text and "attempt 2 not started" in text, text
    assert "restarting" not in text and not list(run_dir.glob("*.a2.*")), text
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "stopped"

    # `stop` on a failed run with no record of its end writes the request (its launcher may be
    # between attempts); on one with a record it writes nothing (the finished run's test above)
    (run_dir / STOP_REQUEST).unlink()
    (run_dir / "summary.json").rename(run_dir / "kept.json")
    stop = ftb(tmp_path, "stop", "job.yaml")
    assert stop.returncode == 0 and "has no node running (state: failed) and no record of its end: if its launcher " \
        "is between attempts, it starts no other (stop-requested written)" in stop.stderr, stop.stderr
    assert (run_dir / STOP_REQUEST).exists()
    (run_dir / STOP_REQUEST).unlink()
    (run_dir / "kept.json").rename(run_dir / "summary.json")
    stop = ftb(tmp_path, "stop", "job.yaml")
    assert "is not running (state: failed): nothing to stop" in stop.stderr and not (run_dir / STOP_REQUEST).exists()
