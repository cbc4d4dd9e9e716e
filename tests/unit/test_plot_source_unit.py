"""`ftbundle plot` of a run that wrote no metrics.jsonl (a detached run: no launcher writes one;
one still running; one whose launcher was lost) reads its trainer's own log, output_dir's
trainer_log.jsonl: it said "its trainer logged no step". A week's log at a record a second is
about 180 MB: at most RECORDS_MAX records come back, evenly spaced, its first and last kept, the
same whether read here or through a host (bash and awk there: run here for real, through a
local host of the Cluster, as on a remote one over SSH)."""

from __future__ import annotations

import json

from ftbundle.cluster import Cluster
from ftbundle.history import RunRow, read_trainer_logs
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
    here = read_trainer_logs(rows, [rows[0].run_id])
    with Cluster([Host("local", "localhost", local=True)]) as cluster:
        there = read_trainer_logs(rows, [rows[0].run_id], cluster, cluster.hosts[0])
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
    found = read_trainer_logs(rows, [r.run_id for r in rows])
    # the first run's output_dir was written by the second since: its records are not the first's
    assert sorted(found) == ["j-20261202-100000-bbbb", "j-20261202-110000-cccc"]
    assert [r["current_steps"] for r in found["j-20261202-110000-cccc"][1]] == list(range(1, 8))
    assert len(found["j-20261202-100000-bbbb"][1]) == 40
    assert read_trainer_logs(rows, ["j-20261201-100000-aaaa"]) == {}
