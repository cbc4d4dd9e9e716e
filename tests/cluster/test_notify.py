"""A word when a run ends (issue 47 item 3) on real hosts: a run that finishes and one that
fails each POST their summary to a local webhook exactly once (the failed host and its line
in it), and a webhook that hangs does not hold the run's end beyond its limit."""

from __future__ import annotations

import json
import re
import time

import pytest

from ftbundle import notify as N
from tests.cluster.test_launcher_core import command_job
from tests.support.helpers import ftbundle
from tests.unit.test_notify_unit import Hook

pytestmark = pytest.mark.cluster


@pytest.fixture
def hooks():
    made: list[Hook] = []
    yield lambda **kw: made.append(Hook(**kw)) or made[-1]
    for h in made:
        h.close()


def test_each_end_is_told_once_with_the_summary(make_cluster, tmp_path, hooks):
    cluster = make_cluster(2)
    h = hooks()
    job = command_job(cluster, tmp_path, "told", "true", notify={"webhook": h.url})
    result = ftbundle("run", str(job), timeout=120)
    assert result.returncode == 0, result.stderr
    [(path, summary)] = h.posts
    assert summary["state"] == "finished" and summary["hosts"] == ["node0", "node1"] and summary["failure"] is None
    assert f"notify: webhook {N.shown(h.url)} told (finished)" in result.stderr
    assert "SECRETTOKEN" not in result.stderr + result.stdout

    h2 = hooks()
    (tmp_path / "b").mkdir()
    job = command_job(cluster, tmp_path / "b", "fails", '[ "$NODE_RANK" = 1 ] && { echo disk on fire >&2; exit 3; }; '
                      "sleep 30", notify={"webhook": h2.url})
    result = ftbundle("run", str(job), timeout=120)
    assert result.returncode == 3, result.stderr
    [(_, summary)] = h2.posts
    assert summary["state"] == "failed" and summary["failed_host"] == "node1"
    assert summary["failure"]["host"] == "node1" and summary["failure"]["code"] == 3, summary


def test_a_hanging_webhook_does_not_hold_the_runs_end_beyond_its_limit(make_cluster, tmp_path, hooks):
    cluster = make_cluster(2)
    job = command_job(cluster, tmp_path, "quick", "true")
    began = time.monotonic()
    assert ftbundle("run", str(job), timeout=120).returncode == 0
    plain = time.monotonic() - began
    h = hooks(hang=True)
    (tmp_path / "h").mkdir()
    job = command_job(cluster, tmp_path / "h", "hung", "true", notify={"webhook": h.url})
    began = time.monotonic()
    result = ftbundle("run", str(job), timeout=120)
    took = time.monotonic() - began
    assert result.returncode == 0, result.stderr
    assert len(h.posts) == 1 and took < plain + N.LIMIT_S + 3, (took, plain)
    assert f"notify: webhook {N.shown(h.url)} " in result.stderr and "SECRETTOKEN" not in result.stderr


def test_a_detached_runs_end_is_told_by_rank_0s_watcher(make_cluster, tmp_path, hooks):
    """No launcher stays: rank 0's watcher tells the end, once, with the same sender; the job
    itself never sees the webhook (its environment holds it empty)."""
    cluster = make_cluster(2)
    h = hooks(address=str(cluster.subnet.network_address + 1))  # (the hosts reach this machine there)
    job = command_job(cluster, tmp_path, "told-detached",
                      'echo "seen: [${FTB_NOTIFY_WEBHOOK:-}]" > "$FTB_RUN_DIR/seen-$NODE_RANK"; sleep 3',
                      notify={"webhook": h.url})
    result = ftbundle("run", "--detach", str(job), timeout=120)
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 60
    while not h.posts and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # (a second POST would come now)
    [(_, summary)] = h.posts
    assert summary["state"] == "finished" and summary["detached"] and summary["exit_code"] == 0, summary
    assert summary["run_id"].startswith("told-detached-") and summary["failure"] is None
    # its hosts, as an attached run's summary; a command job has no trainer log: no loss, no tokens/s
    assert summary["hosts"] == ["node0", "node1"] and (summary["final_loss"], summary["tokens_per_s"]) == (None, None)
    run = next((cluster.shared_dir / "runs").iterdir())
    assert (run / "seen-0").read_text() == "seen: []\n" and (run / "seen-1").read_text() == "seen: []\n"
    log = (run / "node-0-node0.a1.log").read_text()
    assert "notify: webhook" in log and "told (finished)" in log and "SECRETTOKEN" not in log, log

    # a node's job fails: the failed host and its code, as an attached run's summary says them
    # (a detached one said only the referee's `node-1.a1.exit says exit 3`)
    h2 = hooks(address=str(cluster.subnet.network_address + 1))
    (tmp_path / "f").mkdir()
    job = command_job(cluster, tmp_path / "f", "fails-detached", '[ "$NODE_RANK" = 1 ] && exit 3; sleep 60',
                      notify={"webhook": h2.url})
    assert ftbundle("run", "--detach", str(job), timeout=120).returncode == 0
    deadline = time.monotonic() + 60
    while not h2.posts and time.monotonic() < deadline:
        time.sleep(0.5)
    [(_, summary)] = h2.posts
    assert summary["state"] == "failed" and summary["failed_host"] == "node1", summary
    assert summary["failure"] == {"host": "node1", "code": 3, "line": "node-1.a1.exit says exit 3"}, summary
    # `runs` says the end the watcher judged (it gave no duration and no failed host: no launcher wrote
    # summary.json); the hosts' exit files say the same state and code
    [row] = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
    assert (row["state"], row["exit_code"], row["failed_host"]) == ("failed", 3, "node1"), row
    assert row["duration_s"] == summary["duration_s"] and row["duration_s"] < 60, row
    status = ftbundle("status", str(job), timeout=60)
    assert status.returncode == 1 and re.search(
        r"^ended: failed after 00:\d\d: node1 \(node-1\.a1\.exit says exit 3\); judged by node0's watcher$",
        status.stdout, re.M), status.stdout + status.stderr
    # its end is on record: `stop` has nothing to stop (it said "no record of its end" and wrote a stop request)
    stop = ftbundle("stop", str(job), timeout=60)
    assert stop.returncode == 0 and "is not running (state: failed): nothing to stop" in stop.stderr, stop.stderr
    run = next(d for d in (cluster.shared_dir / "runs").iterdir() if d.name.startswith("fails-detached-"))
    assert not (run / "stop-requested").exists()


def test_a_detached_run_whose_rank_0_host_dies_is_told_once_by_another_node(make_cluster, tmp_path, hooks):
    """Rank 0's watcher tells a detached run's end; with its host dead nobody did: the others
    stopped their jobs (rank 0's verdict frozen) and the webhook heard nothing, the one word a
    week-long run's owner waits for. Now the others' watchers are given the notify too, and the
    first to find rank 0's watcher silent tells (an O_EXCL claim in the run directory: two of them
    find it at the same beat here, one POST comes), naming rank 0's host."""
    from ftbundle.launch.node import DETACHED_STALE_S

    cluster = make_cluster(3)
    h = hooks(address=str(cluster.subnet.network_address + 1))
    job = command_job(cluster, tmp_path, "rank0-lost", "sleep 300", notify={"webhook": h.url})
    result = ftbundle("run", "--detach", str(job), timeout=120)
    assert result.returncode == 0, result.stderr
    time.sleep(3)  # (every watcher's first beats)
    cluster.kill("node0")
    deadline = time.monotonic() + DETACHED_STALE_S + 30
    while not h.posts and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(5)  # (the other follower finds it silent at about the same beat: a second POST would come now)
    [(_, summary)] = h.posts
    assert summary["state"] == "failed" and summary["detached"] and summary["failed_host"] == "node0", summary
    assert summary["failure"]["host"] == "node0" and "rank 0's watcher silent" in summary["failure"]["line"], summary
    assert summary["told_by"] in ("node1", "node2") and summary["run_id"].startswith("rank0-lost-"), summary
    run = next((cluster.shared_dir / "runs").iterdir())
    assert json.loads((run / "ended.a1").read_text()) == summary  # (the end told is the end `runs` reads)
    teller = 1 if summary["told_by"] == "node1" else 2
    log = (run / f"node-{teller}-{summary['told_by']}.a1.log").read_text()
    assert "notify: webhook" in log and "told (failed)" in log and "SECRETTOKEN" not in log, log


def test_an_attached_run_whose_launcher_dies_is_told_once_by_rank_0(make_cluster, tmp_path, hooks):
    """The launcher's machine dies (SIGKILL here): every node stops its job (launcher lost) and
    nobody was left to say the run ended: no summary.json, no webhook, no duration in `runs`. Now
    rank 0's node program starts remote/tell.py as its job is stopped; after its grace (a launcher
    cut off from rank 0 alone lives, and says the end itself) it writes ended.a1 and POSTs once.
    A stop its launcher asked for starts no word of its own."""
    from ftbundle.remote.tell import GRACE_S
    from tests.support.helpers import read_stdout_until, start_ftbundle

    cluster = make_cluster(2)
    h = hooks(address=str(cluster.subnet.network_address + 1))
    job = command_job(cluster, tmp_path, "laptop", "echo started; sleep 300", notify={"webhook": h.url})
    proc = start_ftbundle("run", "-v", str(job))
    read_stdout_until(proc, "started")
    time.sleep(2)
    ran = time.monotonic()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + GRACE_S + 30
    while not h.posts and time.monotonic() < deadline:
        time.sleep(0.5)
    told_after = time.monotonic() - ran
    time.sleep(3)  # (a second POST would come now)
    [(_, summary)] = h.posts
    assert summary["state"] == "stopped: launcher lost" and summary["detached"] is False, summary
    assert summary["failure"] == {"host": "node0", "line": "launcher lost: the launcher's connection closed"}, summary
    assert summary["hosts"] == ["node0", "node1"] and summary["told_by"] == "node0", summary
    assert summary["run_id"].startswith("laptop-") and summary["exit_code"] is None
    # the run's duration: up to the kill (about 2 s after "started"), not the grace after it
    assert 2 <= summary["duration_s"] < 20, summary
    print(f"launcher SIGKILLed -> told {told_after:.1f}s later (grace {GRACE_S:g}s), duration {summary['duration_s']}s")
    run = next((cluster.shared_dir / "runs").iterdir())
    assert json.loads((run / "ended.a1").read_text()) == summary and not (run / "summary.json").exists()
    log = (run / "node-0-node0.a1.log").read_text()
    assert "notify: webhook" in log and "told (stopped: launcher lost)" in log and "SECRETTOKEN" not in log, log
    [row] = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
    assert (row["state"], row["duration_s"]) == ("stopped: launcher lost", summary["duration_s"]), row
    status = ftbundle("status", str(job), timeout=60)
    assert re.search(r"^ended: stopped: launcher lost after 00:\d\d: node0 \(launcher lost: the launcher's connection "
                     r"closed\); said by node0 \(rank 0\), its launcher gone$", status.stdout, re.M), status.stdout

    # a run its launcher stops (a node failed): the launcher tells it, rank 0's teller says nothing
    h2 = hooks(address=str(cluster.subnet.network_address + 1))
    (tmp_path / "f").mkdir()
    job = command_job(cluster, tmp_path / "f", "fails", '[ "$NODE_RANK" = 1 ] && exit 3; sleep 60',
                      notify={"webhook": h2.url})
    assert ftbundle("run", str(job), timeout=120).returncode == 3
    time.sleep(1)
    assert not cluster.exec("node0", "pgrep -f '[t]ell.py' || true").stdout.strip()  # (it read no 'launcher lost')
    [(_, summary)] = h2.posts
    assert summary["state"] == "failed" and summary["failed_host"] == "node1", summary


def paused_run(job, asleep, timeout: float = 120) -> tuple[int, str]:
    """`ftbundle run -v JOB` stopped (SIGSTOP: a laptop's lid) once its job said "started", for
    as long as ``asleep()`` takes, then woken; its exit code and stderr."""
    import signal

    from tests.support.helpers import read_stdout_until, start_ftbundle

    proc = start_ftbundle("run", "-v", str(job))
    read_stdout_until(proc, "started")
    proc.send_signal(signal.SIGSTOP)
    try:
        asleep()
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def test_a_launcher_woken_after_rank_0_told_the_end_says_so_and_tells_nothing(make_cluster, tmp_path, hooks):
    """The laptop's lid: the launcher is suspended (SIGSTOP) past the nodes' watchdog and rank 0's
    teller's grace, so rank 0 told the end (stopped: launcher lost). Woken (SIGCONT), the launcher
    finds the nodes gone: it says why (its own pause, not a node's SIGTERM), records the run as
    stopped: launcher lost, and does not tell the end a second time (it claims ended.a1 as the
    teller does: one of them tells)."""
    from ftbundle.launch.node import WATCHDOG_S
    from ftbundle.remote.tell import GRACE_S

    cluster = make_cluster(2)
    h = hooks(address=str(cluster.subnet.network_address + 1))
    job = command_job(cluster, tmp_path, "lid", "echo started; sleep 300", notify={"webhook": h.url})

    def until_told():
        deadline = time.monotonic() + WATCHDOG_S + GRACE_S + 40
        while not h.posts and time.monotonic() < deadline:
            time.sleep(0.5)
        assert h.posts, "rank 0 told nothing while its launcher slept"

    code, err = paused_run(job, until_told)
    time.sleep(3)  # (a second POST would come now)
    [(_, told)] = h.posts
    assert told["state"] == "stopped: launcher lost" and told["told_by"] == "node0", told
    assert re.search(rf"ftbundle itself was paused for \d+\.\ds, longer than the nodes' watchdog \({WATCHDOG_S}s\)",
                     err), err
    assert "every node stopped its job by itself while ftbundle was paused: the run is recorded as stopped: " \
           "launcher lost" in err, err
    assert "notify: not told again: node0 (rank 0) told the run's end, its launcher lost to it " \
           "(ended.a1: stopped: launcher lost)" in err, err
    assert "failed first" not in err and "told (" not in err, err
    assert code == 255
    [row] = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
    assert row["state"] == "stopped: launcher lost", row
    run = next((cluster.shared_dir / "runs").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "stopped: launcher lost" and re.fullmatch(
        rf"launcher lost: ftbundle was paused for \d+\.\ds, longer than the nodes' watchdog \({WATCHDOG_S}s\)",
        summary["failure"]["line"]), summary

    # paused past the watchdog but woken within the teller's grace: the launcher tells, rank 0 does not
    h2 = hooks(address=str(cluster.subnet.network_address + 1))
    (tmp_path / "b").mkdir()
    job = command_job(cluster, tmp_path / "b", "nap", "echo started; sleep 300", notify={"webhook": h2.url})
    _, err = paused_run(job, lambda: time.sleep(WATCHDOG_S + 4))
    time.sleep(GRACE_S + 5)  # (rank 0's teller, had it told, would have by now)
    [(_, told)] = h2.posts
    assert told["state"] == "stopped: launcher lost" and "told_by" not in told, told
    assert "notify: webhook" in err and "told (stopped: launcher lost)" in err, err


def test_a_run_that_restarts_after_its_launchers_pause_is_not_told_as_ended(make_cluster, tmp_path, hooks):
    """A job with restarts: paused past the watchdog (within the teller's grace), the launcher wakes
    and restarts the run. Rank 0's teller must not tell 'stopped: launcher lost' while attempt 2
    runs: the launcher claims ended.a1 before it restarts; the run's one word is its real end."""
    from ftbundle.launch.node import WATCHDOG_S
    from ftbundle.remote.tell import GRACE_S

    cluster = make_cluster(2)
    h = hooks(address=str(cluster.subnet.network_address + 1))
    job = command_job(cluster, tmp_path, "again", f'[ "$FTB_ATTEMPT" = 2 ] && {{ sleep {GRACE_S + 10:g}; exit 0; }}; '
                      "echo started; sleep 300", notify={"webhook": h.url}, restarts=1)
    code, err = paused_run(job, lambda: time.sleep(WATCHDOG_S + 4), timeout=180)
    assert code == 0, err
    assert "every node stopped its job by itself while ftbundle was paused" in err, err
    assert "restarting all nodes (restart 1 of 1)" in err, err
    [(_, told)] = h.posts
    assert told["state"] == "finished" and told["attempt"] == 2, told
    run = next((cluster.shared_dir / "runs").iterdir())
    assert (run / "ended.a1").read_text().startswith("the launcher ("), (run / "ended.a1").read_text()
    assert "told (" not in (run / "node-0-node0.a1.log").read_text()
