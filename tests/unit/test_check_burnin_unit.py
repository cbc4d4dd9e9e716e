"""`ftbundle check --burn-in`: the comparison with the fleet's median, a pure function (made-up
figures), and the burn-in for real on this machine alone (one host, the CPU GEMM). On three
containerized hosts: tests/cluster/test_check_burnin.py; the GPU half: tests/gpu/test_gpu.py."""

from __future__ import annotations

import io
import json
import subprocess
import time

import pytest

from ftbundle.check.burnin import (METRICS, BurninReport, Figure, burnin_plan, compare, crowded, figures_of,
                                   format_burnin_report, late_notes, lib_notes)
from ftbundle.commands.common import load_layout, open_cluster
from ftbundle.plan import make_plan
from tests.support.helpers import ftbundle


# ---------------------------------------------------------------------------------------
# the comparison (pure)


def cpu(host: str, value: float) -> Figure:
    return Figure(host, "cpu", "cpu_gemm_gflops", value)


def test_a_healthy_fleet_names_nobody():
    figures = [cpu(f"node{i}", v) for i, v in enumerate([40.1, 41.7, 39.4, 40.9, 38.2])]
    medians, slow = compare(figures)
    assert medians == {"cpu_gemm_gflops": 40.1} and slow == []


def test_a_host_at_a_third_is_named_with_its_figure_and_the_median():
    figures = [cpu("node0", 40.0), cpu("node1", 42.0), cpu("node2", 13.0), cpu("node3", 41.0)]
    medians, slow = compare(figures)
    assert medians["cpu_gemm_gflops"] == 40.5
    assert [s.figure.host for s in slow] == ["node2"]
    assert slow[0].line() == ("node2 is slow: CPU GEMM 13.0 GFLOP/s, 0.32x the fleet's median 40.5 GFLOP/s")


def test_slow_below_decides_and_the_edge_is_not_slow():
    figures = [cpu("a", 100.0), cpu("b", 100.0), cpu("c", 90.0)]
    assert compare(figures, 0.9)[1] == []  # exactly 0.9x: not below
    assert [s.figure.host for s in compare(figures, 0.95)[1]] == ["c"]
    assert compare(figures, 0.5)[1] == []


def test_one_host_compares_with_itself_and_two_hosts_with_their_mean():
    assert compare([cpu("only", 5.0)])[1] == []
    medians, slow = compare([cpu("fast", 30.0), cpu("slow", 10.0)])
    assert medians["cpu_gemm_gflops"] == 20.0 and [s.figure.host for s in slow] == ["slow"]


def test_gpus_are_compared_per_metric_and_named_by_host_gpu_and_uuid():
    figures = []
    for h in range(4):
        for g in range(8):
            slow_gemm = (h, g) == (2, 5)
            figures.append(Figure(f"gpu-{h:03d}", f"GPU {g}", "gemm_bf16_tflops", 520.0 if slow_gemm else 780.0 + g,
                                  f"GPU-{h}{g}"))
            figures.append(Figure(f"gpu-{h:03d}", f"GPU {g}", "hbm_copy_gbps", 2990.0 - h))
    medians, slow = compare(figures)
    assert [(s.figure.host, s.figure.device, s.figure.metric) for s in slow] == [
        ("gpu-002", "GPU 5", "gemm_bf16_tflops")]
    assert slow[0].line() == ("gpu-002 GPU 5 (GPU-25) is slow: bf16 GEMM 520 TFLOP/s, 0.66x the fleet's median "
                              "783 TFLOP/s")
    report = BurninReport(check_dir="/s/checks/x", seconds=20, figures=figures, medians=medians, slow=slow)

    class P:
        job_name, nprocs = "j", (8, 8, 8, 8)
    text = "\n".join(format_burnin_report(report, P()))
    assert "bf16 GEMM   median 783 TFLOP/s; gpu-[000-003] (GPUs 0-7): 780-787 TFLOP/s" in text
    assert "HBM copy    median 2988 GB/s; gpu-[000-003] (GPUs 0-7): 2987-2990 GB/s" in text
    assert "warning: gpu-002 GPU 5 (GPU-25) is slow" in text and "no host is slow" not in text
    assert text.endswith("figures in /s/checks/x/burnin.json")


def test_cpu_figures_from_different_libraries_are_compared_each_with_its_own():
    numpy = [Figure(f"np{i}", "cpu", "cpu_gemm_gflops", v, lib="numpy 2.4.6") for i, v in enumerate([60, 61, 20, 59])]
    torch = [Figure(f"pt{i}", "cpu", "cpu_gemm_gflops", v, lib="torch 2.13.0") for i, v in enumerate([100, 98])]
    medians, slow = compare(numpy + torch)
    # against one median of all six (60.5) the torch hosts would hide nothing and np2 would be 0.33x;
    # each against its own: np2 at 20/59.5, and no torch host is slow
    assert [(s.figure.host, round(s.median, 1)) for s in slow] == [("np2", 59.5)]
    assert medians == {"cpu_gemm_gflops": 59.5}  # the larger group's
    assert lib_notes(numpy + torch) == ["the CPU GEMM ran on different libraries (numpy 2.4.6 on np[0-3]; "
                                        "torch 2.13.0 on pt[0-1]): each host is compared only with those that "
                                        "used the same one"]
    assert lib_notes(numpy) == []


def test_a_cpu_crowded_out_for_a_while_is_a_note_and_a_capped_one_is_named():
    """CI's case (3 hosts on 2 shared cores, other tests running): node0 averaged 0.88x the
    median, but ran at the fleet's speed in its fastest slice. A host under a CPU quota is slow
    in every slice, and named; a GPU slow on average is named whatever its fastest slice."""
    median = 23.9
    fleet = [Figure("node0", "cpu", "cpu_gemm_gflops", 21.0, best=24.6),
             Figure("node1", "cpu", "cpu_gemm_gflops", 23.9, best=26.0),
             Figure("node2", "cpu", "cpu_gemm_gflops", 24.2, best=25.1)]
    assert compare(fleet)[1] == []
    (note,) = crowded(fleet)
    assert note.figure.host == "node0" and note.crowded_line() == (
        "node0's CPU GEMM was 0.88x the fleet's median on average but 1.03x in its fastest slice: other work on "
        "its CPU crowded it out for a while; not named slow")
    capped = fleet[1:] + [Figure("node3", "cpu", "cpu_gemm_gflops", 9.1, best=10.1),
                          Figure("node4", "cpu", "cpu_gemm_gflops", 24.0, best=24.3),
                          Figure("node5", "cpu", "cpu_gemm_gflops", 24.1, best=24.4)]
    medians, slow = compare(capped)
    assert medians["cpu_gemm_gflops"] == 24.0 and [s.figure.host for s in slow] == ["node3"]
    assert slow[0].line() == ("node3 is slow: CPU GEMM 9.10 GFLOP/s, 0.38x the fleet's median 24.0 GFLOP/s, "
                              "0.42x in its fastest slice")
    assert crowded(capped) == []
    # the edge: a fastest slice at exactly the line is crowded, not slow; just under it, slow
    edge = [Figure(h, "cpu", "cpu_gemm_gflops", 100.0) for h in "ab"]
    assert compare(edge + [Figure("c", "cpu", "cpu_gemm_gflops", 80.0, best=90.0)])[1] == []
    assert len(compare(edge + [Figure("c", "cpu", "cpu_gemm_gflops", 80.0, best=89.9)])[1]) == 1
    # a GPU that throttles now and then: at speed in some slice, slow on average, named
    gpus = [Figure(f"g{i}", "GPU 0", "gemm_bf16_tflops", 780.0, best=790.0) for i in range(3)]
    gpus.append(Figure("g3", "GPU 0", "gemm_bf16_tflops", 600.0, best=785.0))
    assert [s.figure.host for s in compare(gpus)[1]] == ["g3"] and crowded(gpus) == []
    report = BurninReport(check_dir="/s/checks/x", seconds=5, figures=fleet, medians={"cpu_gemm_gflops": median},
                          crowded=crowded(fleet))

    class P:
        job_name, nprocs = "j", (1, 1, 1)
    text = "\n".join(format_burnin_report(report, P()))
    assert "note: node0's CPU GEMM was 0.88x" in text and "no host is slow" in text and "warning" not in text
    assert report.to_dict()["crowded"][0]["host"] == "node0"


def test_a_node_result_becomes_figures_and_a_failed_gpu_an_error():
    result = {"devices": [{"device": "GPU 0", "uuid": "GPU-a", "gemm_bf16_tflops": 780.0, "hbm_copy_gbps": 2990.0},
                          {"device": "GPU 1", "error": "CUDA error: uncorrectable ECC error encountered"}]}
    figures, errors = figures_of("gpu-001", result)
    assert [(f.device, f.metric) for f in figures] == [("GPU 0", "gemm_bf16_tflops"), ("GPU 0", "hbm_copy_gbps")]
    assert errors == ["gpu-001 GPU 1: not measured: CUDA error: uncorrectable ECC error encountered"]
    assert set(METRICS) == {"gemm_bf16_tflops", "hbm_copy_gbps", "cpu_gemm_gflops"}


def test_a_host_that_stopped_waiting_for_others_is_said_to_have_measured_alone():
    names = ["node0", "node1", "node2", "node3"]
    waited = {"devices": [{"device": "cpu", "barrier": {"waited_s": 60.0, "not_ready": [2, 3]}}]}
    assert late_notes("node0", waited, names) == [
        "node0 measured without waiting any longer for node[2-3] (not ready in time): its figures are not "
        "from the same moment as theirs"]
    assert late_notes("node1", {"devices": [{"device": "cpu", "barrier": {"waited_s": 0.4, "not_ready": []}}]},
                      names) == []
    assert late_notes("node1", {"devices": [{"device": "GPU 0", "error": "x"}]}, names) == []
    # everyone ready, but this host saw the last ready file only 2.3 s after the agreed start
    behind = {"devices": [{"device": "cpu", "barrier": {"waited_s": 9.1, "not_ready": [], "late_s": 2.3}}]}
    assert late_notes("node3", behind, names) == [
        "node3 began measuring 2.3s after the others (it saw the last host ready only then): its figures are not "
        "from quite the same moment as theirs"]
    assert late_notes("node3", {"devices": [{"device": "cpu", "barrier": {"not_ready": [], "late_s": 0.2}}]},
                      names) == []


def test_the_burnin_plan_runs_once_per_node_with_the_jobs_interpreter_in_the_checks_directory(tmp_path):
    from tests.unit.test_check_local_unit import local_job

    _, layout = load_layout(str(local_job(tmp_path, train={"command": "true"})), None)
    plan = make_plan(layout)
    bench = burnin_plan(plan, 7)
    node = bench.nodes[0]
    assert bench.run_dir == f"{plan.shared_dir}/checks/{plan.run_id}"
    assert node.per_node and node.argv[:4] == ("timeout", "-k", "5", "195")  # 2 x 7 + 60 + 1.02 + 120
    assert node.program == (plan.nodes[0].torchrun[0], f"{bench.run_dir}/ftb_burnin.py", "--seconds", "7",
                            "--out-dir", bench.run_dir, "--nodes", "1", "--barrier-s", "60", "--go-after", "1.02")
    assert node.log_path.startswith(bench.run_dir + "/")


def test_the_burnin_plan_on_the_docker_runtime_runs_in_containers_of_its_own(tmp_path):
    from tests.unit.test_check_local_unit import local_job

    job = local_job(tmp_path, train={"command": "true"}, runtime={"kind": "docker", "image": "reg/img@sha256:" + "0" * 64})
    _, layout = load_layout(str(job), None)
    plan = make_plan(layout)
    node = burnin_plan(plan, 5).nodes[0]
    assert node.container == plan.nodes[0].container + "-burnin" and node.stop_argv[-1] == node.container
    argv = list(node.argv)
    assert argv[argv.index("--name") + 1] == node.container and argv.index("docker") == 4
    assert argv[argv.index("reg/img@sha256:" + "0" * 64) + 1] == "python3"


# ---------------------------------------------------------------------------------------
# for real: this machine alone


@pytest.mark.timeout(120)
def test_local_burnin_measures_the_cpu_and_keeps_the_figures(tmp_path):
    from ftbundle.check.burnin import run_burnin
    from tests.unit.test_check_local_unit import local_job

    (tmp_path / ".shared").mkdir()
    _, layout = load_layout(str(local_job(tmp_path, train={"command": "true"})), None)
    out = io.StringIO()
    with open_cluster(layout.hosts) as cluster:
        report = run_burnin(make_plan(layout), cluster, seconds=2, out=out)
    text = out.getvalue()
    assert report.ok and not report.slow, text
    assert [(f.host, f.metric) for f in report.figures] == [("localhost", "cpu_gemm_gflops")]
    assert report.figures[0].value > 0.1
    # ten slices of the measured time, each a rate in the figure's unit; the fastest kept with the figure
    slices = report.nodes["localhost"]["devices"][0]["cpu_gemm_gflops_slices"]
    assert 5 <= len(slices) <= 11 and all(v > 0 for v in slices), slices
    assert report.figures[0].best == max(slices) >= report.figures[0].value * 0.95
    (check_dir,) = (tmp_path / ".shared" / "checks").iterdir()
    kept = json.loads((check_dir / "burnin.json").read_text())
    assert kept["figures"][0]["value"] == report.figures[0].value and kept["slow"] == []
    node = kept["nodes"]["localhost"]
    assert node["devices"][0]["threads"] == 1
    # no GPU here: numpy's GEMM, and torch never imported (20 MB a host, not 300: 128 hosts fit)
    assert node["devices"][0]["lib"].startswith("numpy ") and "torch" not in node
    assert report.figures[0].lib == node["devices"][0]["lib"]
    assert sorted(p.name for p in check_dir.iterdir()) == ["burnin.json", "node-0-localhost.a1.log", "node-0.json",
                                                          "plan.json"]
    assert "no host is slow" in text and f"figures in {check_dir}/burnin.json" in text


def test_hosts_ready_at_different_times_begin_measuring_at_one_moment(tmp_path):
    """The shim itself, two "hosts" (processes) started 1.5 s apart: each begins at the later
    one's ready time + --go-after, not when it happens to see the other's ready file."""
    import os
    import sys

    from ftbundle.check.burnin import burnin_source

    script = tmp_path / "ftb_burnin.py"
    script.write_text(burnin_source())

    def host(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), "--seconds", "1", "--out-dir", str(tmp_path),
                                 "--nodes", "2", "--go-after", "0.7", "--cpu-size", "64"],
                                env={**os.environ, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE)

    first = host(0)
    time.sleep(1.5)
    second = host(1)
    assert first.wait(60) == 0 and second.wait(60) == 0
    barriers = [json.loads((tmp_path / f"node-{r}.json").read_text())["devices"][0]["barrier"] for r in (0, 1)]
    ready = sorted(float((tmp_path / "ready" / f"node-{r}").read_text().split()[0]) for r in (0, 1))
    assert ready[1] - ready[0] > 1.0  # (they were ready far apart)
    assert barriers[0]["go"] == barriers[1]["go"] == round(ready[1] + 0.7, 3)
    assert abs(barriers[0]["began"] - barriers[1]["began"]) < 0.15, barriers
    assert all(0 <= b["began"] - b["go"] < 0.15 for b in barriers), barriers  # at the agreed moment, not before
    assert all(b["late_s"] == 0 and b["not_ready"] == [] for b in barriers), barriers


def test_burn_in_seconds_and_slow_below_are_checked_before_anything_runs():
    for args, words in ((["--burn-in", "0"], "must be 1 to 3600 seconds"),
                        (["--burn-in", "5", "--slow-below", "1.5"], "above 0 and at most 1"),
                        (["--burn-in", "job.yaml"], "the job file goes first")):
        proc = ftbundle("check", *args, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
