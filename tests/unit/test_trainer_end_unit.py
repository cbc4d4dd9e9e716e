"""A run's figures from its trainer log's ends (ftbundle/remote/trainer_end.py), where no launcher
counted them: `runs` of a run without summary.json, and a detached run's end as its watcher tells
the webhook. The told summary of a detached LlamaFactory run said no loss, no tokens/s and no
hosts (an attached run's summary.json has them all); `runs` gave such a run no MFU.

- The ends fold to the launcher's own figures (ui.progress.Progress fed the whole log): recorded
  LlamaFactory records, day-long clocks, records without LlamaFactory's throughput, none counting
  tokens, a half-written last line.
- MFU from the speed basis plan.json now keeps (ftbundle.speed SpeedBasis.record): the same
  figure as SpeedBasis.mfu.
- The shipped watcher (python3 -I -S, as node.sh starts it), rank 0 of a one-node detached run,
  tells its `notify: command` the hosts, final loss, tokens/s, per rank and MFU, the same as
  `runs` says of that run; a trainer log left in output_dir by an earlier run, unchanged during
  this one (a job that failed before its trainer began), is not this run's: no figures.
A real detached LoRA: tests/train/test_quickstart.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from ftbundle.history import list_runs
from ftbundle.launch import stall
from ftbundle.remote.trainer_end import ends_figures, log_mark, read_ends, speed_figures
from ftbundle.speed import SpeedBasis
from ftbundle.ui.progress import Progress
from tests.unit.test_plot_source_unit import lf_record, make_run

RECORDED = os.path.join(os.path.dirname(__file__), "..", "data", "llamafactory", "cpu-3steps.trainer_log.jsonl")


def launcher_figures(records: list[dict]) -> dict:
    progress = Progress()
    for record in records:
        progress.feed_record(record)
    tokens = progress.tokens_per_s()
    return {"final_loss": progress.final_loss, "tokens_per_s": None if tokens is None else round(tokens, 1)}


def day_clock(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days} day{'s' if days > 1 else ''}, {clock}" if days else clock


def random_log(rng: random.Random) -> list[dict]:
    kind = rng.choice(["throughput", "no-throughput", "no-tokens", "days"])
    records, tokens, seconds = [], 0, 0
    for step in range(1, rng.randint(2, 300)):
        tokens += rng.randint(500, 5000)
        seconds += rng.randint(1, 4000 if kind == "days" else 30)
        record = {"current_steps": step, "total_steps": 300, "loss": round(rng.uniform(0.1, 3.0), 4),
                  "lr": 1e-4, "elapsed_time": day_clock(seconds), "remaining_time": "0:01:00"}
        if kind != "no-tokens":
            record["total_tokens"] = tokens
        if kind in ("throughput", "days"):
            record["throughput"] = round(tokens / seconds, 2)
        records.append(record)
    if rng.random() < 0.5:  # LlamaFactory's closing record: no loss
        records.append({k: v for k, v in records[-1].items() if k != "loss"})
    return records


def test_the_logs_ends_fold_to_the_launchers_own_figures(tmp_path):
    rng = random.Random(47)
    logs = [random_log(rng) for _ in range(200)]
    logs.append([json.loads(line) for line in open(RECORDED)])  # (a real one: shorter than a logging step)
    seen = set()
    for i, records in enumerate(logs):
        path = tmp_path / f"log{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"current_steps": 9, "lo')
        ends = read_ends(str(path))
        assert len(ends) <= 4 and ends[0] == records[0] and ends[-1] == records[-1]
        assert ends_figures(ends) == launcher_figures(records), (i, records[-2:])
        seen.add((ends_figures(ends)["final_loss"] is None, ends_figures(ends)["tokens_per_s"] is None))
    assert seen == {(False, False), (False, True), (True, True)}, seen  # (each kind was met)
    # a week-long clock: 6 days, 23:59:59 and 1,000,000 tokens without LlamaFactory's throughput
    week = [{"current_steps": 1, "loss": 1.0, "total_tokens": 1_000_000, "elapsed_time": "6 days, 23:59:59"}]
    assert ends_figures(week)["tokens_per_s"] == round(1_000_000 / (7 * 86400 - 1), 1)


def test_a_log_unchanged_since_the_run_began_is_an_earlier_runs(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    assert log_mark(str(log)) is None and read_ends(str(log)) == []
    log.write_text(json.dumps(lf_record(5, 0.5, 5000, 5, 999.0)) + "\n")
    mark = log_mark(str(log))
    assert read_ends(str(log), mark) == []  # (the earlier run's, left there)
    with open(log, "a") as f:  # a resumed trainer appends
        f.write(json.dumps(lf_record(6, 0.4, 6000, 6, 1000.0)) + "\n")
    assert [r["current_steps"] for r in read_ends(str(log), mark)] == [5, 6]
    mark = log_mark(str(log))
    log.unlink()  # a fresh trainer removes it and writes its own
    log.write_text(json.dumps(lf_record(1, 0.7, 500, 1, 500.0)) + "\n")
    assert [r["loss"] for r in read_ends(str(log), mark)] == [0.7]


H100_1B = SpeedBasis(ranks=16, gpus=16, gpu="H100 SXM", peak_tflops=989.0, params=1_235_814_400, padding=False)


def test_runs_gives_a_summary_less_gpu_run_its_mfu_from_the_plans_speed_basis(tmp_path):
    shared, out = tmp_path / "shared", tmp_path / "out"
    out.mkdir()
    records = [lf_record(step, 2.0 - step / 100, 400_000 * step, step, 400_000.0) for step in range(1, 50)]
    (out / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    make_run(shared, "j-20261203-100000-aaaa", out)
    plan = json.loads((shared / "runs/j-20261203-100000-aaaa/plan.json").read_text())
    plan["speed"] = json.loads(json.dumps(H100_1B.record()))  # (as plan.json keeps it)
    (shared / "runs/j-20261203-100000-aaaa/plan.json").write_text(json.dumps(plan))
    [row] = list_runs("j", str(shared))
    assert row.tokens_per_s == 400_000.0 and row.tokens_per_s_per_rank == 25_000.0  # (16 GPUs, not world_size 4)
    assert row.mfu == round(H100_1B.mfu(400_000.0), 4) and 0.18 < row.mfu < 0.19, row.mfu
    # a plan.json from before (no "speed"): per rank by world_size, MFU not known
    del plan["speed"]
    (shared / "runs/j-20261203-100000-aaaa/plan.json").write_text(json.dumps(plan))
    [row] = list_runs("j", str(shared))
    assert (row.tokens_per_s_per_rank, row.mfu) == (100_000.0, None)
    assert speed_figures(None, 16, 1e-9) == {"tokens_per_s_per_rank": None, "mfu": None}


def run_shipped_referee(tmp_path, name: str, trainer_log, write_records: list[dict], speed: str, *,
                        run=None, notify: bool = True, job_code: int = 0) -> dict | None:
    """The staged watcher as rank 0 of a one-node detached run (in ``run``, else a new folder
    ``name``) whose job writes ``write_records`` into ``trainer_log`` and ends ``job_code``; what its
    notify command was given (None: not told)."""
    run = run or tmp_path / name
    run.mkdir(parents=True, exist_ok=True)
    program_file = run / "watch.py"
    program_file.write_text(stall.watcher_source())
    told = run / "told.json"
    marker = f"ftb-test-told-{time.time_ns()}"
    lines = "".join(json.dumps(r) + "\n" for r in write_records)
    # (its exit file as node.sh writes it when the job ends: here before the process is gone)
    job = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.5); "
                            "open(sys.argv[1], 'a').write(sys.argv[2]) if sys.argv[2] else None; time.sleep(0.5); "
                            "open(sys.argv[3], 'w').write(sys.argv[4])",
                            str(trainer_log), lines, str(run / "node-0.a1.exit"), f"{job_code}\n"],
                           env={**os.environ, "FTB_JOB": marker})
    env = {"PATH": os.environ["PATH"], "FTB_MARKER": marker, "FTB_CONTAINER": "", "FTB_STOP_GRACE": "1",
           "FTB_HEARTBEAT": "0.2", "FTB_STALE": "600", "FTB_STALL_TIMEOUT": "0", "FTB_REFEREE": "1",
           "NODE_RANK": "0", "NNODES": "1", "FTB_RUN_DIR": str(run), "FTB_RUN_ID": name,
           "FTB_LOG": str(run / "node-0-h.a1.log"), "FTB_EXIT": str(run / "node-0.a1.exit"),
           "FTB_HBFILE": str(run / "node-0.a1.hb"), "FTB_VERDICT_FILE": str(run / "watch.a1"),
           "FTB_PEER_EXIT_GLOB": str(run / "node-*.a1.exit"), "FTB_PEER_HB_GLOB": str(run / "node-*.a1.hb"),
           "FTB_STOP_REQUEST": str(run / "stop-requested"), "FTB_KEPT_STEPS_FILE": str(run / "node-0.a1.steps"),
           "FTB_XIDS_FILE": str(run / "node-0.a1.xids"), "FTB_ENDED_FILE": str(run / "ended.a1"),
           "FTB_DIVERGED_FILE": str(run / "diverged.a1"),
           "FTB_NOTIFY_WEBHOOK": "", "FTB_NOTIFY_COMMAND": f"cat > {told}" if notify else "", "FTB_NODE_HOSTS": "gpu-a",
           "FTB_TRAINER_LOG": str(trainer_log), "FTB_SPEED": speed}
    from ftbundle.launch.node import program
    watcher = subprocess.Popen([sys.executable, "-I", "-S", str(program_file), str(job.pid), "", program()], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        job.wait(timeout=20)
        out, err = watcher.communicate(timeout=30)
    finally:
        job.kill()
        watcher.kill()
    assert watcher.returncode == 0, err
    ended = json.loads((run / "ended.a1").read_text())  # (written whether or not anyone is told)
    if not told.exists():
        return None
    assert json.loads(told.read_text()) == ended  # (what was told is what `runs` reads)
    return ended


def test_a_detached_runs_told_end_carries_its_hosts_loss_tokens_and_mfu_as_runs_counts_them(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    log = out / "trainer_log.jsonl"
    records = [lf_record(step, 2.0 - step / 100, 400_000 * step, step, 400_000.0 + step) for step in range(1, 40)]
    told = run_shipped_referee(tmp_path, "j-20261203-110000-bbbb", log, records,
                               f"{H100_1B.ranks} {H100_1B.mfu_per_token_s!r}")
    assert told is not None and told["state"] == "finished" and told["hosts"] == ["gpu-a"], told
    assert (told["final_loss"], told["tokens_per_s"], told["tokens_per_s_per_rank"]) == (2.0 - 39 / 100, 400_039.0, 25_002.4)
    assert told["mfu"] == round(H100_1B.mfu(400_039.0), 4), told
    # `runs` of the same run (no summary.json: detached) says the same figures
    shared = tmp_path / "shared"
    make_run(shared, "j-20261203-110000-bbbb", out)
    plan_file = shared / "runs/j-20261203-110000-bbbb/plan.json"
    plan_file.write_text(json.dumps({**json.loads(plan_file.read_text()), "speed": H100_1B.record()}))
    [row] = list_runs("j", str(shared))
    assert (row.final_loss, row.tokens_per_s, row.tokens_per_s_per_rank, row.mfu) == \
        (told["final_loss"], told["tokens_per_s"], told["tokens_per_s_per_rank"], told["mfu"])


def test_an_earlier_runs_trainer_log_left_in_output_dir_is_not_told_as_this_runs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    log = out / "trainer_log.jsonl"
    log.write_text(json.dumps(lf_record(5, 0.5, 5000, 5, 999.0)) + "\n")  # (yesterday's run)
    told = run_shipped_referee(tmp_path, "j-20261203-120000-cccc", log, [], "4 0")
    assert told is not None and told["state"] == "finished", told
    assert (told["final_loss"], told["tokens_per_s"], told["tokens_per_s_per_rank"], told["mfu"]) == \
        (None, None, None, None), told
    # a CPU run's figures: per rank, no MFU
    told = run_shipped_referee(tmp_path, "j-20261203-120000-dddd", out / "fresh.jsonl",
                               [lf_record(1, 0.9, 1000, 2, 500.0)], "4 0")
    assert (told["final_loss"], told["tokens_per_s"], told["tokens_per_s_per_rank"], told["mfu"]) == \
        (0.9, 500.0, 125.0, None), told


@pytest.mark.parametrize("speed", ["", "x y", "4"])
def test_a_malformed_speed_setting_gives_no_figures_not_a_dead_watcher(tmp_path, speed):
    out = tmp_path / "out"
    out.mkdir()
    told = run_shipped_referee(tmp_path, "j-20261203-130000-eeee", out / "trainer_log.jsonl",
                               [lf_record(1, 0.9, 1000, 2, 500.0)], speed)
    assert told is not None and told["final_loss"] == 0.9 and told["mfu"] is None, told


def test_status_says_where_training_is_from_the_trainer_logs_last_records():
    """`ftbundle status` of a detached run (no live line anywhere): the live line's figures from
    the trainer log's last records, its tokens/s per GPU and MFU against plan.json's basis, the
    trainer's clock past a day and its ETA, and the last record's age (a trainer gone quiet)."""
    from ftbundle.ui.progress import status_training

    records = [lf_record(step, 2.0 - step / 100, 400_000 * step, step, 400_000.0) for step in range(1, 50)]
    records[-1].update(elapsed_time="1 day, 2:03:04", remaining_time="3 days, 0:00:01")
    log = "\n".join(json.dumps(r) for r in records) + '\n{"current_steps": 50, "lo'
    basis = SpeedBasis.from_record(json.loads(json.dumps(H100_1B.record())))
    assert basis == H100_1B
    assert status_training(log, basis, 12) == [
        "training: step 49/100  epoch 0.49  loss 1.5100  lr 1.00e-04  400,000 tokens/s (25,000 per GPU, padding not "
        "counted)  mfu 18.7%  trainer's clock 1d 02:03:04  eta 3d 00:00:01  (its last record 12 s ago)"]
    # no basis (a plan.json from before): tokens/s alone; an hour-old record said in hours
    assert status_training(log, None, 3725)[0].endswith(
        "400,000 tokens/s  trainer's clock 1d 02:03:04  eta 3d 00:00:01  (its last record 1:02:05 ago)")
    assert status_training("", basis, 1) == [] and status_training("not json\n", basis, 1) == []
    # a malformed basis is no basis
    assert SpeedBasis.from_record({"ranks": "16"}) is None and SpeedBasis.from_record(None) is None
    assert SpeedBasis.from_record({"ranks": 2, "peak_tflops": "fast", "params": 1.5}).mfu(1000.0) is None


def test_a_detached_runs_end_is_kept_in_its_run_directory_for_runs_whether_or_not_anyone_is_told(tmp_path):
    """`runs` of a detached run said no duration and judged its state from the exit files alone: its
    watcher knew the end (state, exit code, duration, the failed host) and told only a webhook,
    when there was one. Now the watcher that judges the end writes it into the run directory
    (ended.aN, claimed first with O_EXCL), notify or not, and `runs` reads it."""
    from ftbundle.history import ended_lines, format_runs

    shared, out = tmp_path / "shared", tmp_path / "out"
    out.mkdir()
    run_id = "j-20261203-140000-ffff"
    make_run(shared, run_id, out)
    run = shared / "runs" / run_id
    told = run_shipped_referee(tmp_path, run_id, out / "trainer_log.jsonl", [lf_record(3, 0.75, 3000, 3, 600.0)],
                               "4 0", run=run, notify=False)
    assert told is None  # (no notify: nobody told)
    ended = json.loads((run / "ended.a1").read_text())
    assert ended["state"] == "finished" and ended["exit_code"] == 0 and ended["told_by"], ended
    assert 1.5 <= ended["duration_s"] < 30 and abs(ended["started"] - time.time()) < 60, ended
    [row] = list_runs("j", str(shared))
    assert (row.state, row.exit_code, row.duration_s, row.final_loss, row.tokens_per_s, row.failed_host) == \
        ("finished", 0, ended["duration_s"], 0.75, 600.0, None), row
    assert f"0:0{int(ended['duration_s'])}" in format_runs([row]), format_runs([row])

    # a failed one: its failed host and code, as an attached run's summary.json says them (picked by its
    # id: `runs` sorts by each run's real start, and these ids' clock times may be before or after it)
    run_id = "j-20261203-150000-ffff"
    make_run(shared, run_id, out)
    told = run_shipped_referee(tmp_path, run_id, out / "other.jsonl", [], "4 0", run=shared / "runs" / run_id,
                               job_code=3)
    assert told["state"] == "failed" and told["exit_code"] == 3 and told["failed_host"] == "gpu-a", told
    # (the referee reads the exit file while the job still runs, or the job ended first: the same node, code)
    assert told["failure"] in [{"host": "gpu-a", "code": 3, "line": line}
                               for line in ("node-0.a1.exit says exit 3", "rank 0 exited 3")], told
    [row] = [r for r in list_runs("j", str(shared)) if r.run_id == run_id]
    assert (row.state, row.exit_code, row.failed_host, row.duration_s) == ("failed", 3, "gpu-a", told["duration_s"])
    # `runs`' table says why under the run (not only --json); a finished run has no such line
    table = format_runs(list_runs("j", str(shared))).splitlines()
    said = f"  failed on gpu-a: {told['failure']['line']}"
    assert said in table and table[table.index(said) - 1].startswith(run_id), table
    assert sum(line.startswith("  failed on ") for line in table) == 1, table
    # `status` says it in a line (read with the nodes' kept step times)
    assert ended_lines({**told, "duration_s": 3725.4}) == [
        f"ended: failed after 1:02:05: gpu-a ({told['failure']['line']}); judged by {told['told_by']}'s watcher"]
    assert ended_lines(ended) == [f"ended: finished after 00:0{int(ended['duration_s'])}; judged by "
                                  f"{ended['told_by']}'s watcher"]
    assert ended_lines({}) == [] and ended_lines({"state": "stopped"}) == ["ended: stopped"]

    # a node that stopped its own job says why (its reason is the cause); the duration stays the watcher's
    (shared / "runs" / run_id / "node-1.a1.stopped").write_text("shared storage /x on node1 not answering for 30s\n")
    [row] = [r for r in list_runs("j", str(shared)) if r.run_id == run_id]
    assert row.state.startswith("stopped: shared storage /x") and row.duration_s == told["duration_s"], row

    # only the teller's claim there yet (its host's name: the record is being written): judged as before
    (shared / "runs" / run_id / "node-1.a1.stopped").unlink()
    (shared / "runs" / run_id / "ended.a1").write_text("gpu-a\n")
    [row] = [r for r in list_runs("j", str(shared)) if r.run_id == run_id]
    assert (row.state, row.exit_code, row.duration_s, row.failed_host) == ("failed", 3, None, None), row


def test_a_detached_run_its_ranks_stopped_says_what_they_said_not_which_node_exited_first(tmp_path):
    """Every rank raises at the same logged step when the loss went nan (shims/steptimes.py): which
    node's exit file the referee reads first is chance; the end record says what the ranks said
    (global rank 0's diverged.a1), and a warning (the run went on) changes nothing."""
    said = "training diverged at step 30: in 3 logged steps in a row since step 28 the loss is nan"
    run = tmp_path / "runs" / "j-20261203-160000-dddd"
    run.mkdir(parents=True)
    (run / "diverged.a1").write_text(json.dumps({"step": 30, "since": 28, "kind": "nan", "action": "stop",
                                                 "said": said}))
    told = run_shipped_referee(tmp_path, run.name, tmp_path / "none.jsonl", [], "4 0", run=run, job_code=1)
    assert told["state"] == "failed" and told["exit_code"] == 1 and told["failed_host"] == "gpu-a", told
    assert told["failure"] == {"host": "gpu-a", "code": 1, "line": f"its ranks stopped the run: {said}"}, told
    warned = tmp_path / "runs" / "j-20261203-160000-eeee"
    warned.mkdir()
    (warned / "diverged.a1").write_text(json.dumps({"action": "warn", "said": said}))
    told = run_shipped_referee(tmp_path, warned.name, tmp_path / "none.jsonl", [], "4 0", run=warned, job_code=1)
    assert said not in told["failure"]["line"], told
