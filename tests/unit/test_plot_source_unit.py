"""`ftbundle plot` and `ftbundle runs` of a run that wrote no metrics.jsonl nor summary.json (a detached run: no launcher writes one;
one still running; one whose launcher was lost) reads its trainer's own log, output_dir's
trainer_log.jsonl: it said "its trainer logged no step". A week's log at a record a second is
about 180 MB: at most RECORDS_MAX records come back, evenly spaced, its first and last kept, the
same whether read here or through a host (bash and awk there: run here for real, through a
local host of the Cluster, as on a remote one over SSH). `runs` showed such a run's loss and
tokens/s as "-": now its trainer log's first and last records say them, as the closing summary
counts them."""

from __future__ import annotations

import json

from ftbundle.cluster import Cluster
from ftbundle.history import RunRow, list_runs, read_trainer_ends, read_trainer_logs
from ftbundle.inventory import Host
from ftbundle.ui.progress import RECORDS_MAX


def row(run_id: str, output_dir: str | None) -> RunRow:
    return RunRow(run_id, "j", ["node0"], "2026-12-02T10:00:00", None, "running?", None, None, output_dir)


def write_log(path, count: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for step in range(1, count + 1):
            f.write(json.dumps({"current_steps": step, "loss": 2.0 - step / count, "lr": 1e-4}) + "\n")
        f.write("not json: a half-written line\n")  # (the trainer writing its next record now)


def test_a_run_without_metrics_is_plotted_from_its_trainer_log_evenly_thinned_here_and_through_a_host(tmp_path):
    out = tmp_path / "out"
    write_log(out / "trainer_log.jsonl", 50_001)
    rows = [row("j-20261202-100000-aaaa", str(out))]
    here = read_trainer_logs(rows, [rows[0].run_id], str(tmp_path / "runs"))
    with Cluster([Host("local", "localhost", local=True)]) as cluster:
        there = read_trainer_logs(rows, [rows[0].run_id], str(tmp_path / "runs"), cluster, cluster.hosts[0])
    for found in (here, there):
        [(path, records)] = found.values()
        assert path == str(out / "trainer_log.jsonl")
        steps = [r["current_steps"] for r in records]
        assert len(steps) <= RECORDS_MAX + 2 and steps[0] == 1 and steps[-1] == 50_001, (len(steps), steps[-3:])
        gaps = {b - a for a, b in zip(steps[1:-1], steps[2:-1])}
        assert gaps == {3}, gaps  # (50,001 lines // 20,000 + 1: every 3rd)
    assert here == there


def test_only_the_newest_run_writing_to_an_output_dir_gets_its_log_and_a_short_one_whole(tmp_path):
    shared, own = tmp_path / "out", tmp_path / "own"
    write_log(shared / "trainer_log.jsonl", 40)
    write_log(own / "trainer_log.jsonl", 7)
    rows = [row("j-20261201-100000-aaaa", str(shared)), row("j-20261202-100000-bbbb", str(shared)),
            row("j-20261202-110000-cccc", str(own)), row("j-20261202-120000-dddd", None),
            row("j-20261202-130000-eeee", str(tmp_path / "none"))]
    found = read_trainer_logs(rows, [r.run_id for r in rows], str(tmp_path / "runs"))
    # the first run's output_dir was written by the second since: its records are not the first's
    assert sorted(found) == ["j-20261202-100000-bbbb", "j-20261202-110000-cccc"]
    assert [r["current_steps"] for r in found["j-20261202-110000-cccc"][1]] == list(range(1, 8))
    assert len(found["j-20261202-100000-bbbb"][1]) == 40
    assert read_trainer_logs(rows, ["j-20261201-100000-aaaa"], str(tmp_path / "runs")) == {}


def lf_record(step: int, loss: float | None, tokens: int, seconds: int, throughput: float) -> dict:
    record = {"current_steps": step, "total_steps": 100, "lr": 1e-4, "epoch": step / 100, "percentage": step,
              "elapsed_time": f"0:{seconds // 60:02d}:{seconds % 60:02d}", "remaining_time": "0:01:00",
              "throughput": throughput, "total_tokens": tokens}
    return record if loss is None else {**record, "loss": loss}


def make_run(shared, run_id: str, output_dir, *, summary: dict | None = None) -> None:
    run = shared / "runs" / run_id
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"job": "j", "nodes": [{"host": "node0"}, {"host": "node1"}],
                                               "world_size": 4, "checkpoint_dir": str(output_dir)}))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))


def test_runs_says_a_detached_runs_loss_and_tokens_from_its_trainer_log(tmp_path):
    shared, out, old = tmp_path / "shared", tmp_path / "out", tmp_path / "old"
    out.mkdir()
    old.mkdir()
    records = [lf_record(step, 2.0 - step / 100, 1000 * step, step, 1000.0 + step) for step in range(1, 60)]
    records.append(lf_record(60, 1.25, 60_000, 60, 1010.5))
    text = "".join(json.dumps(r) + "\n" for r in records)
    (out / "trainer_log.jsonl").write_text(text + '{"current_steps": 61, "lo')  # (the next one being written)
    (old / "trainer_log.jsonl").write_text(json.dumps(lf_record(5, 0.5, 5000, 5, 999.0)) + "\n")
    make_run(shared, "j-20261202-100000-aaaa", old, summary={"state": "finished", "exit_code": 0, "final_loss": 0.7,
                                                             "tokens_per_s": 42.0, "duration_s": 10.0})
    make_run(shared, "j-20261202-110000-bbbb", out)  # detached, or running: no summary.json
    recorded, detached = list_runs("j", str(shared))
    assert (recorded.final_loss, recorded.tokens_per_s) == (0.7, 42.0)  # (its summary's, not its log's)
    assert detached.state == "running?" and detached.final_loss == 1.25, detached
    assert (detached.tokens_per_s, detached.tokens_per_s_per_rank) == (1010.5, 252.6), detached
    # the same first and last records through a host (bash there, one round trip for every run)
    rows = [recorded, detached]
    with Cluster([Host("local", "localhost", local=True)]) as cluster:
        there = read_trainer_ends(rows, [detached.run_id], str(shared / "runs"), cluster, cluster.hosts[0])
    assert there == read_trainer_ends(rows, [detached.run_id], str(shared / "runs"))
    assert [r["current_steps"] for r in there[detached.run_id]] == [1, 59, 60]


def test_a_trainer_log_last_written_before_the_run_began_is_an_earlier_runs_not_its(tmp_path):
    """The newest run of a job that has not logged a step yet (loading its model; failed before
    its trainer began) found output_dir's log of the run before it and showed that run's loss and
    tokens/s as its own in `runs`, and its curve in `plot`. A log last changed more than
    EARLIER_SLACK_S before the run's plan.json is not this run's: here and through a host."""
    import os

    from ftbundle.remote.trainer_end import EARLIER_SLACK_S

    shared, out = tmp_path / "shared", tmp_path / "out"
    out.mkdir()
    log = out / "trainer_log.jsonl"
    log.write_text("".join(json.dumps(lf_record(step, 1.0, 100 * step, step, 100.0)) + "\n" for step in range(1, 9)))
    make_run(shared, "j-20261203-100000-aaaa", out)
    plan = shared / "runs" / "j-20261203-100000-aaaa" / "plan.json"
    runs_at = str(shared / "runs")

    def seen() -> list:
        rows = list_runs("j", str(shared))
        with Cluster([Host("local", "localhost", local=True)]) as cluster:
            return [rows[0].final_loss, read_trainer_logs(rows, [rows[0].run_id], runs_at) != {},
                    read_trainer_logs(rows, [rows[0].run_id], runs_at, cluster, cluster.hosts[0]) != {},
                    read_trainer_ends(rows, [rows[0].run_id], runs_at) != {},
                    read_trainer_ends(rows, [rows[0].run_id], runs_at, cluster, cluster.hosts[0]) != {}]

    assert seen() == [1.0, True, True, True, True]  # (written after its plan: this run's)
    began = plan.stat().st_mtime
    os.utime(log, (began - EARLIER_SLACK_S - 5, began - EARLIER_SLACK_S - 5))
    assert seen() == [None, False, False, False, False]
    os.utime(log, (began - EARLIER_SLACK_S + 5, began - EARLIER_SLACK_S + 5))  # (within the clocks' slack)
    assert seen() == [1.0, True, True, True, True]
