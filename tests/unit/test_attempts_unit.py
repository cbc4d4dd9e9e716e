"""A lost host (issue 36 item 3), the pure part: (job, previous layout, lost hosts, spares) ->
the next attempt's hosts, MASTER_ADDR, rescaled LlamaFactory config and the line that says
why (ftbundle.launch.attempts.next_attempt), and the job keys that choose it. No hosts."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from ftbundle.errors import UserError
from ftbundle.inventory import Host
from ftbundle.job import load_job
from ftbundle.launch.attempts import Batch, next_attempt, rescale, short_reason
from ftbundle.layout import make_layout
from ftbundle.plan import make_plan


def hosts(*names: str) -> list[Host]:
    return [Host(name=n, address=f"10.9.0.{i + 10}") for i, n in enumerate(names)]


def job_file(tmp_path: Path, train: dict | None = None, **keys) -> Path:
    body = {"name": "j", "shared_dir": "/shared", "restarts": 1, "train": train or {"script": "train.py"}, **keys}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def lf(per_device: int = 2, accumulation: int = 2) -> dict:
    return {"llamafactory": {"model_name_or_path": "/m", "output_dir": "/shared/out", "stage": "sft",
                             "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation}}


def layout_of(tmp_path: Path, names=("node0", "node1", "node2"), **job):
    loaded = load_job(job_file(tmp_path, **job))
    return loaded, make_layout(loaded, hosts(*names), "r1")


def lost_after(job, layout, lost, nprocs=None, spares=(), first_world=None):
    nprocs = nprocs or {h.name: 1 for h in layout.hosts}
    first = first_world if first_world is not None else sum(nprocs.values())
    return next_attempt(job, layout, nprocs, lost, attempt=2, first_world=first, spares=list(spares))


def test_exclude_keeps_rank_order_renumbers_and_says_why(tmp_path):
    job, layout = layout_of(tmp_path, names=("node0", "node1", "node2", "node3"), on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node2": "no heartbeat 15 s, host unreachable"})
    assert nxt.stop is None and nxt.hosts == ("node0", "node1", "node3")
    assert nxt.line == "attempt 2 on node[0-1,3]: node2 lost (no heartbeat 15 s, host unreachable)"
    plan = make_plan(nxt.layout)
    assert [(n.rank, n.host.name) for n in plan.nodes] == [(0, "node0"), (1, "node1"), (2, "node3")]
    assert plan.master_addr == "10.9.0.10" and plan.nnodes == 3
    env = plan.nodes[2].env
    assert env["NODE_RANK"] == "2" and env["NNODES"] == "3" and env["FTB_EXCLUDED_HOSTS"] == "node2"
    assert "--nnodes" in plan.nodes[2].torchrun and plan.nodes[2].torchrun[plan.nodes[2].torchrun.index("--nnodes") + 1] == "3"
    assert "FTB_EXCLUDED_HOSTS" not in make_plan(layout).nodes[0].env  # (the first attempt: none)


def test_rank0_lost_moves_master_addr_to_the_next_host(tmp_path):
    job, layout = layout_of(tmp_path, on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node0": "host unreachable"})
    plan = make_plan(nxt.layout)
    assert nxt.hosts == ("node1", "node2")
    assert plan.master_addr == "10.9.0.11"
    assert {n.env["MASTER_ADDR"] for n in plan.nodes} == {"10.9.0.11"}
    assert plan.nodes[0].host.name == "node1" and plan.nodes[0].env["NODE_RANK"] == "0"


def test_a_second_loss_names_every_excluded_host(tmp_path):
    job, layout = layout_of(tmp_path, names=("node0", "node1", "node2", "node3"), on_node_loss="exclude")
    first = lost_after(job, layout, {"node3": "host unreachable"})
    second = next_attempt(job, first.layout, {h.name: 1 for h in first.layout.hosts}, {"node1": "host unreachable"},
                          attempt=3, first_world=4)
    assert second.hosts == ("node0", "node2")
    assert make_plan(second.layout).nodes[0].env["FTB_EXCLUDED_HOSTS"] == "node3,node1"


def test_spare_takes_the_lost_hosts_place(tmp_path):
    job, layout = layout_of(tmp_path, on_node_loss="spare")
    spare = Host(name="spare0", address="10.9.0.50")
    nxt = lost_after(job, layout, {"node1": "host unreachable"}, spares=[(spare, 1)])
    assert nxt.hosts == ("node0", "spare0", "node2")
    assert nxt.replaced == {"node1": "spare0"}
    assert nxt.line == "attempt 2 on node[0,2],spare0: node1 lost (host unreachable); spare0 in place of node1"
    plan = make_plan(nxt.layout)
    assert plan.nodes[1].host.name == "spare0" and plan.nodes[1].env["NODE_RANK"] == "1"


def test_a_spare_brings_its_own_rank_count_and_gpus(tmp_path):
    """A 4-GPU spare (ftb_nproc_per_node, ftb_gpus in the inventory) in an 8-GPU host's place
    runs 4 ranks on its GPUs; the host it replaced takes its settings with it."""
    job, layout = layout_of(tmp_path, on_node_loss="spare", nproc_per_node=2)
    layout = dataclasses.replace(layout, host_nprocs={"node1": 8})
    spare = Host(name="spare0", address="10.9.0.50", vars={"ftb_nproc_per_node": 4, "ftb_gpus": "0,1,2,3"})
    nxt = lost_after(job, layout, {"node1": "host unreachable"}, nprocs={"node0": 2, "node1": 8, "node2": 2},
                     spares=[(spare, 4)])
    assert nxt.layout.host_nprocs == {"spare0": 4} and nxt.layout.host_gpus == {"spare0": ("0", "1", "2", "3")}
    plan = make_plan(nxt.layout)
    assert [(n.host.name, n.nproc) for n in plan.nodes] == [("node0", 2), ("spare0", 4), ("node2", 2)]
    assert plan.world_size == 8 and plan.nodes[1].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_no_spare_left_excludes(tmp_path):
    job, layout = layout_of(tmp_path, on_node_loss="spare", spares="standby")
    spare = Host(name="spare0", address="10.9.0.50")
    nxt = lost_after(job, layout, {"node0": "host unreachable", "node2": "host unreachable"}, spares=[(spare, 1)])
    assert nxt.hosts == ("spare0", "node1")  # (node0's place: the spare, now rank 0)
    assert "no spare left in group standby: node2 left out" in nxt.line
    assert make_plan(nxt.layout).master_addr == "10.9.0.50"
    none = lost_after(job, layout, {"node2": "host unreachable"})
    assert none.hosts == ("node0", "node1") and "no spare left in group standby: node2 left out" in none.line


def test_exclude_takes_no_spare(tmp_path):
    job, layout = layout_of(tmp_path, on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node1": "host unreachable"}, spares=[(Host(name="s", address="10.9.0.9"), 1)])
    assert nxt.hosts == ("node0", "node2") and not nxt.replaced


def test_below_min_nodes_stops_with_255_naming_every_lost_host(tmp_path):
    job, layout = layout_of(tmp_path, names=("node0", "node1", "node2", "node3"), on_node_loss="exclude",
                            min_nodes=3)
    first = lost_after(job, layout, {"node3": "host unreachable"})
    assert first.stop is None and len(first.hosts) == 3  # 3 left: not below
    second = next_attempt(job, first.layout, {h.name: 1 for h in first.layout.hosts},
                          {"node0": "no heartbeat 5 s, host unreachable"}, attempt=3, first_world=4)
    assert second.stop == 255 and second.layout is None
    assert second.line == ("stopping: node0 lost (no heartbeat 5 s, host unreachable); 2 host(s) left, fewer "
                           "than min_nodes 3 (lost: node[0,3])")


def test_every_host_lost_stops(tmp_path):
    job, layout = layout_of(tmp_path, names=("node0",), on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node0": "host unreachable"})
    assert nxt.stop == 255 and "no host left" in nxt.line


def test_keep_global_batch_when_it_divides(tmp_path):
    # 2 per device x 2 accumulation x 3 ranks = 12; on 2 ranks: accumulation 3
    job, layout = layout_of(tmp_path, train=lf(2, 2), on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node2": "no heartbeat 15 s, host unreachable"})
    assert nxt.line == ("attempt 2 on node[0-1]: node2 lost (no heartbeat 15 s, host unreachable); "
                        "global batch 12 kept: accumulation 2 -> 3")
    assert nxt.batch == Batch(2, 3, 2)
    staged = yaml.safe_load(nxt.layout.files["llamafactory.yaml"])
    assert staged["gradient_accumulation_steps"] == 3 and staged["per_device_train_batch_size"] == 2
    plan = make_plan(nxt.layout)
    assert plan.effective_batch == 12
    assert "effective batch size 12 = 2 per device x 3 accumulation x 1 rank(s) per node x 2 node(s)" in plan.notes
    # the job as asked is left alone (a later loss rescales from it, not from this attempt)
    assert job.train.llamafactory["gradient_accumulation_steps"] == 2


def test_keep_global_batch_nearest_when_it_does_not_divide(tmp_path):
    # 1 x 3 x 4 = 12; on 3 ranks: 4 exactly; on 5 ranks (uneven 2+2+1 after a loss of 2 ranks ... )
    job, layout = layout_of(tmp_path, names=("node0", "node1", "node2", "node3"), train=lf(1, 3),
                            on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node1": "host unreachable"}, nprocs={"node0": 2, "node1": 2, "node2": 2,
                                                                          "node3": 1})
    # asked: 1 x 3 x 7 = 21; left 5 ranks: 21 / 5 = 4.2 -> 4, global batch 20
    assert nxt.batch == Batch(1, 4, 5)
    assert nxt.line.endswith("global batch 21 cannot be kept on 5 rank(s) x 1 per device: accumulation 3 -> 4, "
                             "global batch 20; an epoch is now a different number of steps, so the step total "
                             "changes (max_steps: it does not)")
    assert yaml.safe_load(nxt.layout.files["llamafactory.yaml"])["gradient_accumulation_steps"] == 4


def test_rescale_rounds_to_the_nearest_never_below_one():
    assert rescale(Batch(2, 2, 3), 2) == (Batch(2, 3, 2), "global batch 12 kept: accumulation 2 -> 3")
    assert rescale(Batch(1, 1, 4), 3)[0].accumulation == 1  # 4 on 3 ranks: 3 (1 off) beats 6
    assert rescale(Batch(1, 1, 8), 3)[0].accumulation == 3  # 8 on 3: 9 (1 off) beats 6 (2 off)
    assert rescale(Batch(1, 1, 3), 2)[0].accumulation == 1  # 3 on 2: 2 and 4 tie: the smaller
    assert rescale(Batch(1, 1, 2), 5)[0].accumulation == 1  # more ranks than the batch: 1


def test_keep_global_batch_false_keeps_the_accumulation_and_says_the_new_batch(tmp_path):
    job, layout = layout_of(tmp_path, train=lf(2, 2), on_node_loss="exclude", keep_global_batch=False)
    nxt = lost_after(job, layout, {"node2": "host unreachable"})
    # the step total the live line shows changes with it, and is said to (issue 45: `step 21/114`, then `22/96`)
    assert nxt.line.endswith("global batch 12 -> 8 (keep_global_batch: false; accumulation 2 kept); an epoch is "
                             "now a different number of steps, so the step total changes (max_steps: it does not)")
    assert yaml.safe_load(nxt.layout.files["llamafactory.yaml"])["gradient_accumulation_steps"] == 2
    assert make_plan(nxt.layout).effective_batch == 8


def test_script_mode_has_no_batch_line(tmp_path):
    job, layout = layout_of(tmp_path, on_node_loss="exclude")
    nxt = lost_after(job, layout, {"node1": "host unreachable"})
    assert "batch" not in nxt.line and nxt.batch is None


def test_short_reason():
    assert short_reason("no heartbeat for 15s and its host does not answer (host down or network cut?)") \
        == "no heartbeat 15 s"
    assert short_reason("connection lost (EOF)") == "connection lost"


@pytest.mark.parametrize("keys, key, words", [
    ({"on_node_loss": "drop"}, "on_node_loss", "must be one of stop, exclude, spare"),
    ({"on_node_loss": "exclude", "restarts": 0}, "on_node_loss", "set restarts: N"),
    ({"on_node_loss": "exclude", "min_nodes": 0}, "min_nodes", "between 1 and"),
    ({"on_node_loss": "exclude", "min_nodes": "two"}, "min_nodes", "must be an integer"),
    ({"on_node_loss": "exclude", "keep_global_batch": "yes"}, "keep_global_batch", "true or false"),
    ({"on_node_loss": "exclude", "spares": "standby"}, "spares", "only applies to on_node_loss: spare"),
    ({"min_nodes": 2}, "min_nodes", "only applies to on_node_loss: exclude or spare"),
    ({"on_node_loss": "spare", "spares": ""}, "spares", "non-empty string"),
])
def test_bad_policy_keys_exit_2_naming_key_and_valid_values(tmp_path, keys, key, words):
    body = {"restarts": 1, **keys}
    with pytest.raises(UserError) as info:
        load_job(job_file(tmp_path, **body))
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_policy_defaults(tmp_path):
    job = load_job(job_file(tmp_path))
    assert (job.on_node_loss, job.spares, job.min_nodes, job.keep_global_batch) == ("stop", "spares", 1, True)
    job = load_job(job_file(tmp_path, on_node_loss="spare", spares="standby", min_nodes=2))
    assert (job.on_node_loss, job.spares, job.min_nodes) == ("spare", "standby", 2)


LINE = "attempt 2 on node[0-1]: node2 lost (no heartbeat 5 s, host unreachable); global batch 12 kept: accumulation 2 -> 3"


def test_runs_and_status_say_which_hosts_each_attempt_ran_on_and_why():
    import json

    from ftbundle.history import format_runs, run_row
    from ftbundle.plan import NodePlan
    from ftbundle.runs import RunRef, format_status

    plan = json.dumps({"job": "j", "nodes": [{"host": "node0"}, {"host": "node1"}]})
    record = [{"attempt": 1, "hosts": ["node0", "node1", "node2"], "why": ""},
              {"attempt": 2, "hosts": ["node0", "node1"], "why": LINE}]
    finished = run_row("j-20261127-080000-abcd", {"plan.json": plan, "summary.json": json.dumps(
        {"state": "finished", "exit_code": 0, "started": 0, "attempts": record})})
    running = run_row("j-20261127-090000-abcd", {"plan.json": plan, "attempt": "2\n",
                                                 "attempts.json": json.dumps(record)})
    assert finished.attempts == running.attempts == [LINE]
    table = format_runs([finished, running]).splitlines()
    assert table[2] == f"  {LINE}" and table[4] == f"  {LINE}" and table[3].startswith("j-20261127-090000")
    assert run_row("x", {"plan.json": plan, "attempts.json": "not json"}).attempts == []

    nodes = tuple(NodePlan(rank=r, host=Host(f"node{r}", f"10.0.0.{r}"), program=("true",), env={}, workdir="/w",
                           log_path=f"/s/node-{r}.log", env_file=None) for r in range(2))
    ref = RunRef("r1", "/s/runs/r1", {}, nodes, 2, (LINE,))
    lines = format_status(ref, [(n, "running", "") for n in nodes])
    assert lines[0].startswith("run r1  (2 node(s) x 1 rank(s), attempt 2)") and lines[1] == f"  {LINE}"


def test_the_attempt_fence_of_a_llamafactory_rank(tmp_path, monkeypatch):
    """A rank of attempt 1 sees the run on attempt 2 (its host was lost, maybe only cut off):
    it stops before writing. Its own attempt, or no run directory: it goes on."""
    from ftbundle.shims import llamafactory_entry as entry

    monkeypatch.setenv("FTB_ATTEMPT_FILE", str(tmp_path / "attempt"))  # (rundir.py's name, given by the launcher)
    monkeypatch.setenv("FTB_ATTEMPT", "1")
    assert entry.fenced() is None  # (no attempt file)
    (tmp_path / "attempt").write_text("1\n")
    assert entry.fenced() is None
    (tmp_path / "attempt").write_text("2\n")
    assert entry.fenced() == "2"
    monkeypatch.setenv("FTB_ATTEMPT", "2")
    assert entry.fenced() is None
    monkeypatch.delenv("FTB_ATTEMPT_FILE")
    assert entry.fenced() is None


def test_where_the_time_from_a_loss_to_the_next_first_step_went():
    """The launcher's monotonic marks -> the recovery's parts, each between two marks, in order;
    they add up to the total; a part whose end was never seen is None, and so is the total
    then; the line says each known part."""
    from ftbundle.launch.attempts import recovery
    from ftbundle.recovery import RECOVERY_PARTS, attempts_said, recovery_said

    marks = {"loss": 100.0, "failed": 106.5, "stopped": 107.0, "fenced": 108.0, "planned": 109.25,
             "waited": 118.0, "begin": 119.0, "up": 121.5, "first_step": 140.0}
    parts = recovery(marks, wall_offset=1_000_000.0)
    assert [parts[p] for p in RECOVERY_PARTS] == [6.5, 1.5, 1.25, 8.75, 3.5, 18.5]
    assert parts["total"] == 40.0 == sum(parts[p] for p in RECOVERY_PARTS)
    assert parts["loss_at"] == 1_000_100.0 and parts["failed_at"] == 1_000_106.5 and parts["first_step_at"] == 1_000_140.0
    said = recovery_said(2, parts)
    assert said == ("attempt 2 trained again 40 s after the failure: detection 6 s, teardown 2 s, preflight 1 s, "
                    "fence wait 9 s, start 4 s, resume 18 s"), said

    no_step = recovery({k: v for k, v in marks.items() if k != "first_step"})
    assert no_step["resume"] is None and no_step["total"] is None and no_step["start"] == 3.5
    assert recovery_said(2, no_step) is None  # (a command job: no step is ever seen)
    assert recovery({"loss": 1.0}) is None  # (nothing failed: no restart)
    assert recovery_said(2, {"total": "40", "detection": 6}) is None  # (a record hand-edited or cut: not said)

    record = [{"attempt": 1, "hosts": ["node0", "node1", "node2"], "why": ""},
              {"attempt": 2, "hosts": ["node0", "node1"], "why": LINE, "recovery": parts}]
    assert attempts_said(record) == [LINE, "  " + said]


def test_a_restart_starts_from_the_failed_attempts_loss_and_teardown_only():
    """The failed attempt's own begin, up and first_step never stand in for the next one's: a
    next attempt that failed before its first step has no resume part and no total, never a
    negative one made of the previous attempt's step."""
    from ftbundle.launch.attempts import recovery, restart_marks
    from ftbundle.launch.supervisor import Failure, Outcome

    failed = Outcome(255, Failure(2, "node2", "no heartbeat for 5s", 255, at=100.0),
                     marks={"begin": 10.0, "up": 12.0, "first_step": 30.0, "failed": 106.0})
    assert restart_marks(failed) == {"loss": 100.0, "failed": 106.0}
    pending = {**restart_marks(failed), "fenced": 108.0, "planned": 108.0, "waited": 118.0}
    parts = recovery({**pending, "begin": 119.0, "up": 121.0})  # (attempt 2 failed before a step)
    assert parts["resume"] is None and parts["total"] is None and parts["start"] == 3.0
    assert restart_marks(Outcome(1, marks={"failed": 50.0})) == {"loss": 50.0, "failed": 50.0}
