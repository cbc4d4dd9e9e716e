"""Stragglers during training (ui.stragglers, pure), the ranks' step clock (shims/steptimes.py),
and what the live line, the summary and `ftbundle runs --json` say of them."""

import json

import pytest

from ftbundle.ui import stragglers
from ftbundle.ui.progress import Progress, status_line
from ftbundle.protocol import RankSteps, parse_steps
from ftbundle.ui.stragglers import NodeSteps
from ftbundle.ui.summary import closing_summary


def fleet(*medians, steps=20):
    return [NodeSteps(f"node{i}", steps, m, m * 1.2) for i, m in enumerate(medians)]


def test_median_and_p90():
    assert stragglers.median([3, 1, 2]) == 2 and stragglers.median([4, 1, 2, 3]) == 2.5
    assert stragglers.median([]) is None and stragglers.p90([]) is None
    assert stragglers.p90(range(1, 11)) == 9 and stragglers.p90(range(1, 101)) == 90 and stragglers.p90([5]) == 5


def test_a_line_of_several_local_ranks_parses_and_garbage_is_skipped():
    assert parse_steps("0 12 0.031 0.040;1 11 0.050 0.061") == [
        RankSteps(0, 12, 0.031, 0.040), RankSteps(1, 11, 0.050, 0.061)]
    assert parse_steps("0 12 0.03;x 1 2 3;1 0 0.1 0.1;;2 5 0.02 0.03") == [RankSteps(2, 5, 0.02, 0.03)]
    assert parse_steps("") == []


def test_a_node_is_as_slow_as_its_slowest_local_rank():
    node = stragglers.node_steps("n1", parse_steps("0 12 0.031 0.040;1 11 0.050 0.045"))
    assert node == NodeSteps("n1", 11, 0.050, 0.045, local_rank=1)
    assert stragglers.node_steps("n1", []) is None


def test_the_slow_node_is_named_and_nobody_else():
    nodes = fleet(0.030, 0.031, 0.042)  # median 0.031: node2 1.35x
    [(node, ratio)] = stragglers.stragglers(nodes)
    assert node.host == "node2" and ratio == pytest.approx(0.042 / 0.031)
    assert stragglers.live_field(nodes) == "node2 1.4x"


def test_a_healthy_fleet_names_nobody():
    nodes = fleet(0.030, 0.031, 0.033, 0.029)
    assert stragglers.stragglers(nodes) == [] and stragglers.live_field(nodes) is None
    assert stragglers.summary_lines(nodes)[0] == "  stragglers   none (every node within 1.15x the fleet's median)"


def test_the_factor_decides():
    nodes = fleet(0.030, 0.030, 0.036)  # 1.2x
    assert stragglers.live_field(nodes, 1.15) == "node2 1.2x"
    assert stragglers.live_field(nodes, 1.25) is None


def test_several_stragglers_slowest_first():
    nodes = fleet(0.030, 0.030, 0.030, 0.040, 0.060)
    assert [n.host for n, _ in stragglers.stragglers(nodes)] == ["node4", "node3"]
    assert stragglers.live_field(nodes) == "node4 2.0x (+1)"


def test_nothing_is_judged_too_early():
    assert stragglers.stragglers(fleet(0.03, 0.09, steps=2)) == []  # the first steps warm up
    assert stragglers.stragglers(fleet(0.03)) == []  # one node: no fleet
    assert stragglers.summary_lines(fleet(0.03)) == []  # (one node: no fleet, nothing to say)
    assert stragglers.summary_lines(fleet(0.03, 0.03, steps=2))[0].startswith("  stragglers   not judged")
    assert stragglers.summary_lines([]) == [] and stragglers.as_record([]) is None


def test_summary_lines_show_every_node():
    lines = stragglers.summary_lines(fleet(0.030, 0.031, 0.042))
    assert lines[0] == "  stragglers   node2 1.35x the fleet's median (straggler_factor 1.15)"
    assert "fleet median 31.0 ms" in lines[1]
    assert lines[2].split() == ["node0", "30.0", "ms", "36.0", "ms", "20"]
    assert lines[4].split()[:5] == ["node2", "42.0", "ms", "50.4", "ms"]


def test_a_large_fleets_summary_names_the_slow_and_folds_the_rest_into_ranges():
    """256 nodes: not 256 lines. The straggler and the three slowest others a line each, every
    other node in one folded line with the ranges of their figures (which expands back to exactly
    those nodes); up to 16 nodes, every node a line, in natural order (node2 before node10)."""
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet

    nodes = [NodeSteps(f"node{i}", 40 + i % 2, 0.090 if i == 7 else 0.030 + (i % 5) * 0.0005,
                       0.036 + (i % 3) * 0.001) for i in range(256)]
    lines = stragglers.summary_lines(nodes)
    assert lines[0] == "  stragglers   node7 2.90x the fleet's median (straggler_factor 1.15)"
    assert len(lines) == 8 and [line.split()[0] for line in lines[2:6]] == ["node7", "node4", "node9", "node14"]
    folded, count = lines[6].split()[:2]
    assert count == "(252" and sorted(NodeSet(folded, resolver=RESOLVER_NOGROUP)) == sorted(
        f"node{i}" for i in range(256) if i not in (4, 7, 9, 14))
    assert lines[6].split()[3:] == ["30.0-32.0", "ms", "36.0-38.0", "ms", "40-41"]
    assert "`ftbundle runs --json`" in lines[7]
    few = stragglers.summary_lines(nodes[:16])
    assert [line.split()[0] for line in few[2:]] == [f"node{i}" for i in range(16)]


def test_record_is_json():
    record = json.loads(json.dumps(stragglers.as_record(fleet(0.030, 0.031, 0.042))))
    assert record["fleet_median_s"] == 0.031 and record["straggler_factor"] == 1.15
    assert record["nodes"]["node2"] == {"steps": 20, "median_s": 0.042, "p90_s": pytest.approx(0.0504),
                                        "local_rank": 0}
    assert record["stragglers"] == [{"host": "node2", "ratio": pytest.approx(1.355, abs=1e-3)}]


def test_progress_live_line_and_closing_summary():
    p = Progress()
    assert p.feed_steps("node0", "0 20 0.030 0.036", now=0) is False  # (one node: nobody to name yet)
    assert p.feed_steps("node1", "0 20 0.031 0.037", now=1) is False
    assert "slowest" not in status_line(p, 3, 3)
    assert p.feed_steps("node2", "0 20 0.045 0.050", now=2) is True
    assert status_line(p, 3, 3).endswith("nodes 3/3  slowest node2 1.5x")
    assert p.feed_steps("node2", "garbage", now=3) is False
    lines = closing_summary(run_id="r", run_dir="/d", duration_s=9, progress=p, output_dir=None, adapter=None,
                            nnodes=3)
    assert "  stragglers   node2 1.45x the fleet's median (straggler_factor 1.15)" in lines


def test_the_fleet_is_judged_at_most_once_a_second_however_many_nodes_speak():
    p = Progress()
    for i in range(1024):  # (a thousand nodes, each saying its figure within the same second)
        p.feed_steps(f"node{i}", f"0 20 {0.090 if i == 7 else 0.030} 0.04", now=100 + i / 2048)
    assert p.slowest is None and len(p.node_steps) == 1024  # (judged at the first line only)
    assert p.feed_steps("node0", "0 21 0.030 0.04", now=101.0) is True
    assert p.slowest == "node7 3.0x"
    # the summary judges every node's latest figure, whenever the live line last looked
    assert "node7 3.00x" in stragglers.summary_lines(p.node_steps.values())[0]


def test_run_summary_and_runs_json_carry_the_step_times():
    from types import SimpleNamespace

    from ftbundle.history import run_row, run_summary, runs_json

    p = Progress()
    for host, med in (("node0", 0.030), ("node1", 0.031), ("node2", 0.045)):
        p.feed_steps(host, f"0 20 {med} {med * 1.1}")
    plan = SimpleNamespace(run_id="j-20261127-080000-abc123", job_name="j", nodes=[], nproc_per_node=1,
                           checkpoint_dir=None)
    summary = run_summary(plan, exit_code=0, interrupted=False, attempt=1, started=0, duration_s=1, progress=p,
                          failed_host=None)
    row = run_row(plan.run_id, {"plan.json": json.dumps({"job": "j", "nodes": []}),
                                "summary.json": json.dumps(summary)})
    [out] = json.loads(runs_json([row]))
    assert out["step_times"]["stragglers"][0]["host"] == "node2"
    assert set(out["step_times"]["nodes"]) == {"node0", "node1", "node2"}
    assert out["step_times"]["nodes"]["node1"]["p90_s"] == pytest.approx(0.0341)


def test_a_detached_runs_step_times_come_from_the_files_its_watchers_kept():
    """No summary.json (a detached run): `runs --json` reads node-R.aN.steps of the newest
    attempt, with the hosts and straggler_factor plan.json names."""
    from ftbundle.history import run_row, runs_json

    plan = {"job": "j", "straggler_factor": 2.5,
            "nodes": [{"rank": 0, "host": "gpu-a"}, {"rank": 1, "host": "gpu-b"}, {"rank": 2, "host": "gpu-c"}]}
    files = {"plan.json": json.dumps(plan), "attempt": "2\n",
             "node-0.a2.steps": "0 30 0.100 0.120;1 30 0.110 0.130\n", "node-1.a2.steps": "0 30 0.250 0.300\n",
             "node-2.a2.steps": "0 30 0.100 0.110\n", "node-1.a1.steps": "0 30 0.100 0.110\n"}
    [out] = json.loads(runs_json([run_row("j-20261127-080000-abc123", files)]))
    assert out["step_times"]["stragglers"] == []  # 0.25 / 0.11 = 2.27x, but the job's factor is 2.5 ...
    assert out["step_times"]["straggler_factor"] == 2.5 and out["step_times"]["fleet_median_s"] == 0.11
    assert out["step_times"]["nodes"]["gpu-a"] == {"steps": 30, "median_s": 0.11, "p90_s": 0.13, "local_rank": 1}
    plan["straggler_factor"] = 1.15  # ... and with the default, gpu-b is named
    [out] = json.loads(runs_json([run_row("j-1", {**files, "plan.json": json.dumps(plan)})]))
    assert out["step_times"]["stragglers"] == [{"host": "gpu-b", "ratio": 2.273}]
    del files["node-0.a2.steps"], files["node-1.a2.steps"], files["node-2.a2.steps"]
    [out] = json.loads(runs_json([run_row("j-1", files)]))  # the newest attempt timed nothing: no figures
    assert out["step_times"] is None


def test_the_rank_clock_writes_its_line(tmp_path):
    from ftbundle.shims.steptimes import StepClock

    clock = StepClock(str(tmp_path / "ftb-x.steps"), local_rank="1")
    for t in (0.010, 0.020, 0.030):
        clock.step_begins()
        clock._step = t  # (the forward passes' time of that step)
        clock.step_done()
    clock.write()
    rank, steps, med, p90 = (tmp_path / "ftb-x.steps.1").read_text().split()
    assert (rank, steps) == ("1", "3") and float(med) == pytest.approx(0.020) and float(p90) == pytest.approx(0.030)
    assert not (tmp_path / "ftb-x.steps.1.tmp").exists()
    assert StepClock(None).path is None or "FTB_STEPS_FILE" in __import__("os").environ


def test_the_trainer_callback_times_forward_to_last_gradient(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ftbundle.shims.steptimes import StepClock, StepTimes

    clock = StepClock(str(tmp_path / "s"), local_rank="0")
    callback = StepTimes(clock)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)  # (a frozen base, as under LoRA)
    callback.on_train_begin(None, None, None, model=model)
    for _ in range(3):
        callback.on_step_begin(None, None, None)
        for _ in range(2):  # two micro-batches: one step
            model(torch.ones(2, 4)).sum().backward()
        callback.on_step_end(None, None, None)
    with torch.no_grad():
        model(torch.ones(2, 4))  # an evaluation's forward: no gradient, not a step
    callback.on_step_begin(None, None, None)
    callback.on_step_end(None, None, None)
    callback.on_train_end(None, None, None)
    assert len(clock.times) == 3 and all(t > 0 for t in clock.times)
    assert (tmp_path / "s.0").read_text().split()[:2] == ["0", "3"]


@pytest.mark.parametrize("value", ["1", "fast", "true", "0.9", "101"])
def test_job_straggler_factor_must_be_a_number_above_one(tmp_path, value):
    from ftbundle.errors import UserError
    from ftbundle.job import load_job

    path = tmp_path / "job.yaml"
    path.write_text(f"name: j\ntrain: {{command: x}}\nstraggler_factor: {value}\n")
    with pytest.raises(UserError) as info:
        load_job(path)
    assert info.value.key == "straggler_factor" and str(path) in str(info.value)
    assert "must be a number above 1" in str(info.value)


def test_job_straggler_factor_reaches_the_plan(tmp_path):
    from ftbundle.inventory import load_hosts
    from ftbundle.job import load_job
    from tests.support.helpers import plan_of

    (tmp_path / "hosts.yml").write_text("all:\n  hosts:\n    a: {ansible_host: 10.9.0.1}\n    b: {ansible_host: 10.9.0.2}\n")
    (tmp_path / "default.yaml").write_text("name: j\ninventory: hosts.yml\nshared_dir: /s\ntrain: {command: x}\n")
    (tmp_path / "job.yaml").write_text("name: j\ninventory: hosts.yml\nshared_dir: /s\ntrain: {command: x}\n"
                                       "straggler_factor: 1.3\n")
    hosts = load_hosts(tmp_path / "hosts.yml")
    assert plan_of(load_job(tmp_path / "default.yaml"), hosts).straggler_factor == 1.15
    assert plan_of(load_job(tmp_path / "job.yaml"), hosts).straggler_factor == 1.3


def test_cuda_steps_are_read_once_the_gpu_has_passed_them_never_waited_for(tmp_path):
    from ftbundle.shims.steptimes import StepClock

    class Event:  # (a CUDA event's stand-in: done when the test says)
        def __init__(self, ms: float = 0.0):
            self.ms, self.done = ms, False

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, stop) -> float:
            return stop.ms - self.ms

        def synchronize(self):
            raise AssertionError("waited for the GPU")

    clock = StepClock(str(tmp_path / "s"), local_rank="0")
    first, second = (Event(0), Event(30)), (Event(0), Event(50))
    clock._events = [first]
    clock.step_done()
    assert clock.times == []  # the GPU is not there yet: read later
    first[1].done = True
    clock._events = [second]
    clock.step_done()
    assert clock.times == [0.030]
    second[1].done = True
    clock.step_done()
    assert clock.times == [0.030, 0.050]


def test_the_step_files_folder_is_the_hosts_own_and_mounted_into_a_container(tmp_path):
    from ftbundle.launch.node import node_env
    from ftbundle.rundir import NodeFiles
    from ftbundle.runtimes import docker_prefix, steps_dir
    from ftbundle.shims.steptimes import StepClock

    assert steps_dir("j-1", 2) == "/tmp/ftb-steps-j-1-2"
    argv = docker_prefix(image="img@sha256:0", name="c", shared_dir="/s", workdir="/s/w", env_names=[],
                         env_file=None, gpus=None, steps="/tmp/ftb-steps-j-1-2")
    assert argv[argv.index("/tmp/ftb-steps-j-1-2:/tmp/ftb-steps-j-1-2") - 1] == "-v"
    assert argv[argv.index("FTB_STEPS_FILE") - 1] == "-e" and argv[-1] == "img@sha256:0"
    assert "FTB_STEPS_FILE" not in docker_prefix(image="i", name="c", shared_dir="/s", workdir="/s", env_names=[],
                                                 env_file=None, gpus=None)
    from ftbundle.inventory import load_hosts
    from ftbundle.job import load_job
    from tests.support.helpers import plan_of

    (tmp_path / "hosts.yml").write_text("all:\n  hosts:\n    a: {ansible_host: 10.9.0.1}\n    b: {ansible_host: 10.9.0.2}\n")
    (tmp_path / "job.yaml").write_text("name: j\ninventory: hosts.yml\nshared_dir: /s\ntrain: {command: x}\n")
    plan = plan_of(load_job(tmp_path / "job.yaml"), load_hosts(tmp_path / "hosts.yml"))
    node = plan.nodes[1]
    env = node_env(node, plan, NodeFiles.of(plan.run_dir, plan.run_id, 1, node.host.name, 3), 3, detach=False)
    assert env["FTB_STEPS_FILE"] == f"/tmp/ftb-steps-{plan.run_id}-1/a3.steps"
    # the rank makes the folder on a host runtime (docker's mount makes it for a container)
    clock = StepClock(str(tmp_path / "new" / "a1.steps"), local_rank="0")
    clock.times = [0.01]
    clock.write()
    assert (tmp_path / "new" / "a1.steps.0").read_text().startswith("0 1 ")
