"""`ftbundle check`'s pure parts: grouping, parsers, the probe script, the checks, the report.

The nvidia-smi samples in tests/data/nvidia-smi/ are format samples written in the exact
format of `nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap
--format=csv,noheader,nounits`; they were not captured in this repository's CI (no GPU
there). The probe script is run for real with bash against local files.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ftbundle import check as C
from ftbundle import netcheck as N
from ftbundle.errors import UserError
from ftbundle.inventory import Host
from ftbundle.job import parse_job
from ftbundle.plan import make_plan
from ftbundle.cluster import Result

SMI = Path(__file__).resolve().parent / "data" / "nvidia-smi"


def smi(name: str) -> list[C.Gpu]:
    return C.parse_nvidia_smi((SMI / name).read_text())


def job_of(tmp_path: Path, **extra):
    data = {"name": "j", "shared_dir": "/shared", "train": {"script": "train.py"}, **extra}
    return parse_job(data, tmp_path / "job.yaml")


def hosts(n: int) -> list[Host]:
    return [Host(f"node{i}", f"10.0.0.{10 + i}") for i in range(n)]


def facts(host: str, rank: int = 0, **kw) -> C.HostFacts:
    kw.setdefault("versions", {"python": "3.11.7", "torch": "2.14.1", "transformers": "5.6.0",
                               "llamafactory": "0.9.5"})
    kw.setdefault("hostname", host)
    return C.HostFacts(host, rank, **kw)


# ---------------------------------------------------------------------------------------
# grouping


def test_group_by_value_puts_the_majority_first_and_keeps_rank_order():
    groups = C.group_by_value({"node0": "a", "node1": "b", "node2": "b", "node3": "c", "node4": "b"})
    assert groups == [("b", ["node1", "node2", "node4"]), ("a", ["node0"]), ("c", ["node3"])]
    assert C.group_by_value({"n0": "x", "n1": "x"}) == [("x", ["n0", "n1"])]
    assert C.group_by_value({}) == []
    assert C.describe_groups(groups[:2]) == "b on node1, node2, node4; a on node0"


# ---------------------------------------------------------------------------------------
# nvidia-smi


def test_parse_nvidia_smi_h100_box():
    gpus = smi("h100-x8.csv")
    assert len(gpus) == 8
    assert gpus[0] == C.Gpu("NVIDIA H100 80GB HBM3", "550.54.15", 81559, "9.0")
    assert C.bf16_capable(gpus) is True
    assert C.describe_gpus(gpus) == "8x NVIDIA H100 80GB HBM3 (81559 MiB, compute 9.0, driver 550.54.15)"


def test_parse_nvidia_smi_v100_box_is_not_bf16_capable():
    gpus = smi("v100-x8.csv")
    assert len(gpus) == 8 and gpus[0].compute_cap_tuple == (7, 0)
    assert C.bf16_capable(gpus) is False
    assert C.bf16_capable(smi("a100-x4.csv")) is True  # 8.0 is the threshold


def test_parse_nvidia_smi_old_driver_without_compute_cap():
    gpus = smi("t4-x2-no-compute-cap.csv")
    assert gpus == [C.Gpu("Tesla T4", "470.82.01", 15109, None)] * 2
    assert C.bf16_capable(gpus) is False  # unknown is not capable


def test_parse_nvidia_smi_mixed_host_and_odd_values():
    gpus = smi("mixed-h100-a100.csv")
    assert C.describe_gpus(gpus).startswith("2x NVIDIA H100 80GB HBM3 (")
    assert " + 1x NVIDIA A100-SXM4-80GB (81920 MiB, compute 8.0" in C.describe_gpus(gpus)
    assert C.bf16_capable(gpus) is True
    assert C.bf16_capable([]) is False
    odd = C.parse_nvidia_smi("Some GPU, Rev 2, 535.1, [N/A], [N/A]\n\n")
    assert odd == [C.Gpu("Some GPU, Rev 2", "535.1", None, None)]
    with pytest.raises(ValueError):
        C.parse_nvidia_smi("No devices were found")


# ---------------------------------------------------------------------------------------
# probe output


def test_parse_route_remote_local_and_missing():
    assert C.parse_route("10.0.0.10 dev eth0 src 10.0.0.11 uid 0 \\    cache ") == C.Route("eth0", "10.0.0.11", False)
    assert C.parse_route("local 10.0.0.10 dev lo src 10.0.0.10 uid 0 \\    cache <local> ").local
    bad = C.parse_route("RTNETLINK answers: Network is unreachable")
    assert bad.dev is None and "unreachable" in bad.error


def test_parse_sections():
    text = "junk\n@@ftb a\n\none\ntwo\n\n@@ftb b\n@@ftb end\n"
    assert C.parse_sections(text) == {"a": "one\ntwo", "b": "", "end": ""}


def spec(tmp_path: Path, **kw) -> C.ProbeSpec:
    kw.setdefault("python", sys.executable)
    kw.setdefault("dataset_dir", None)
    kw.setdefault("image", None)
    return C.ProbeSpec(host="localhost", rank=0, master_addr="127.0.0.1",
                       workdir=str(tmp_path), shared_dir=str(tmp_path), sentinel_dir=None,
                       env_file=None, **kw)


def run_probe(s: C.ProbeSpec) -> C.HostFacts:
    proc = subprocess.run(["bash", "-c", C.probe_script(s)], capture_output=True, text=True, timeout=60, check=False)
    return C.parse_probe(s, Result(proc.returncode, proc.stdout, proc.stderr))


def write_datasets(d: Path, info: dict, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "dataset_info.json").write_text(json.dumps(info))
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)


def test_probe_script_reports_this_machine(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("NCCL_SOCKET_IFNAME=lo\n")
    f = run_probe(C.ProbeSpec(host="localhost", rank=0, python=sys.executable, image=None,
                              master_addr="127.0.0.1", workdir=str(tmp_path), shared_dir=str(tmp_path / "nope"),
                              sentinel_dir=str(tmp_path / "s"), env_file=str(env_file), dataset_dir=None))
    assert f.error is None
    assert f.hostname == socket.gethostname()
    assert f.versions["python"] == sys.version.split()[0]
    assert set(f.versions) == {"python", "torch", "transformers", "llamafactory"}
    assert f.route.dev == "lo" and f.route.local
    assert "lo" in f.links
    assert f.workdir_ok and not f.shared_dir_ok
    assert f.sentinel_ok is False  # no shared_dir: no sentinel (and nothing created)
    assert not (tmp_path / "nope").exists() and not (tmp_path / "s").exists()
    assert f.ifname_env == {"NCCL_SOCKET_IFNAME": "lo"}
    assert f.gpus == [] and f.gpu_error is None  # no nvidia-smi here


def test_probe_script_hashes_datasets_and_names_what_is_missing(tmp_path):
    d = tmp_path / "data"
    write_datasets(d, {"a": {"file_name": "a.json"}, "b": {"file_name": "gone.json"},
                       "dir": {"file_name": "parts"}, "hub": {"hf_hub_url": "org/ds"}},
                   {"a.json": "[1]", "parts/x.json": "[2]", "parts/y.json": "[3]"})
    f = run_probe(spec(tmp_path, dataset_dir=str(d), datasets=("a", "b", "dir", "hub", "nope")))
    by_name = {e["dataset"]: e for e in f.datasets}
    import hashlib
    assert by_name["a"]["sha256"] == hashlib.sha256(b"[1]").hexdigest()
    assert by_name["b"] == {"dataset": "b", "file": str(d / "gone.json"), "error": "missing"}
    assert len(by_name["dir"]["sha256"]) == 64
    assert by_name["hub"] == {"dataset": "hub", "remote": "hf_hub_url"}
    assert by_name["nope"]["error"] == "not defined"

    (d / "parts" / "y.json").write_text("[4]")  # a directory's hash follows its files
    assert {e["dataset"]: e for e in run_probe(spec(tmp_path, dataset_dir=str(d), datasets=("dir",))).datasets}[
        "dir"]["sha256"] != by_name["dir"]["sha256"]

    f = run_probe(spec(tmp_path, dataset_dir=str(tmp_path / "elsewhere"), datasets=("a",)))
    assert f.datasets == [{"file": str(tmp_path / "elsewhere" / "dataset_info.json"), "error": "missing"}]


def test_probe_with_a_missing_interpreter_is_a_runtime_error(tmp_path):
    f = run_probe(spec(tmp_path, python="/nonexistent/bin/python"))
    assert f.versions is None and "/nonexistent/bin/python" in f.runtime_error


def test_probe_reads_the_image_id_and_nvidia_smi(tmp_path):
    image = "reg/train@sha256:" + "a" * 64
    s = spec(tmp_path, python=None, image=image)
    smi_text = (SMI / "h100-x8.csv").read_text()
    body = f"@@ftb image\nsha256:{'b' * 64}\n@@ftb gpus\n{smi_text}@@ftb workdir\nok\n@@ftb end\n"
    f = C.parse_probe(s, Result(0, body, ""))
    assert f.image_id == "sha256:" + "b" * 64 and f.runtime_error is None
    assert len(f.gpus) == 8 and f.gpu_error is None
    missing = C.parse_probe(s, Result(0, "@@ftb image\nERROR: Error: No such image: x\n"
                                         "@@ftb gpus\nERROR: NVIDIA-SMI has failed because it couldn't "
                                         "communicate with the NVIDIA driver.\n@@ftb end\n", ""))
    assert missing.runtime_error.startswith(f"image {image} not on host (ERROR: Error: No such image")
    assert missing.gpu_error.startswith("NVIDIA-SMI has failed")


def test_probe_cut_short_is_the_hosts_failure(tmp_path):
    s = spec(tmp_path)
    f = C.parse_probe(s, Result(137, "@@ftb hostname\nnode0\n", "Killed"))
    assert f.error == "probe did not finish: Killed"


# ---------------------------------------------------------------------------------------
# what the probe is asked, from the plan


def test_probe_spec_from_a_llamafactory_plan(tmp_path):
    job = job_of(tmp_path, workdir="/work", runtime={"python": "/opt/venv/bin/python"},
                 train={"llamafactory": {"dataset": "alpaca, support", "eval_dataset": "support",
                                         "dataset_dir": "data", "output_dir": "/shared/out"}})
    plan = make_plan(job, hosts(2), "r1")
    s = C.probe_spec(job, plan, plan.nodes[1], "/shared/.ftb-check-x")
    assert s.python == "/opt/venv/bin/python"
    assert s.dataset_dir == "/work/data" and s.datasets == ("alpaca", "support")
    assert s.master_addr == "10.0.0.10" and s.workdir == "/work" and s.rank == 1
    script = C.probe_script(s)
    assert "/shared/.ftb-check-x/rank-1" in script and "/opt/venv/bin/python" in script

    default_dir = make_plan(job_of(tmp_path, train={"llamafactory": {"dataset": "x"}}), hosts(2), "r2")
    assert C.llamafactory_datasets(default_dir, "/shared") == ("/shared/data", ("x",))
    online = make_plan(job_of(tmp_path, train={"llamafactory": {"dataset": "x", "dataset_dir": "ONLINE"}}),
                       hosts(1), "r3")
    assert C.llamafactory_datasets(online, "/shared") == (None, ())
    assert C.llamafactory_datasets(make_plan(job_of(tmp_path), hosts(1), "r4"), "/shared") == (None, ())


def test_probe_spec_docker_runtime_asks_for_the_image(tmp_path):
    image = "reg/train@sha256:" + "a" * 64
    job = job_of(tmp_path, runtime={"kind": "docker", "image": image})
    plan = make_plan(job, hosts(2), "r1")
    s = C.probe_spec(job, plan, plan.nodes[0], None)
    assert s.image == image and s.python is None and s.helper_python == "python3"
    assert "docker image inspect" in C.probe_script(s)
    bare = job_of(tmp_path)
    bare_plan = make_plan(bare, hosts(1), "r")
    assert C.probe_spec(bare, bare_plan, bare_plan.nodes[0], None).python == "python3"


# ---------------------------------------------------------------------------------------
# the checks


def test_versions_that_differ_fail_naming_the_host():
    other = {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.6.0", "llamafactory": "0.9.5"}
    fs = [facts("node0"), facts("node1", 1), facts("node2", 2, versions=other)]
    c = C.check_runtime(fs, docker=False)
    assert c.failure == "versions differ"
    assert c.groups[-1] == ("python=3.11.7 torch=2.13.0 transformers=5.6.0 llamafactory=0.9.5", ["node2"])
    assert "torch=2.13.0 transformers=5.6.0 llamafactory=0.9.5 on node2" in c.messages()[0]
    assert C.check_runtime(fs[:2], docker=False).ok
    broken = C.check_runtime([facts("node0"), facts("node1", 1, versions=None, runtime_error="python: not found")],
                             docker=False)
    assert broken.failure == "versions unavailable" and broken.details == ["node1: python: not found"]


def test_image_ids_compared_for_docker():
    fs = [facts("node0", image_id="sha256:aa"), facts("node1", 1, image_id="sha256:bb")]
    c = C.check_runtime(fs, docker=True)
    assert c.failure == "image differ" and c.groups == [("sha256:aa", ["node0"]), ("sha256:bb", ["node1"])]


def test_gpus_must_match_nproc_per_node(tmp_path):
    h100, v100 = smi("h100-x8.csv"), smi("v100-x8.csv")
    eight = job_of(tmp_path, nproc_per_node=8)
    assert C.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=h100)], eight, 8).ok
    four = C.check_gpus([facts("node0", gpus=h100)], job_of(tmp_path, nproc_per_node=4), 4)
    assert four.failure == "GPUs do not fit nproc_per_node"
    assert four.details == ["nproc_per_node is 4 but node0 has 8 GPU(s)"]
    visible = job_of(tmp_path, nproc_per_node=4, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert C.check_gpus([facts("node0", gpus=h100)], visible, 4).ok
    mixed = C.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=v100)], eight, 8)
    assert mixed.failure == "GPUs differ" and mixed.groups[1][1] == ["node1"]
    missing = C.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=[])], eight, 8)
    assert missing.failure == "GPUs differ"
    assert "nproc_per_node is 8 but node1 has 0 GPU(s)" in missing.details
    broken = C.check_gpus([facts("node0", gpu_error="NVIDIA-SMI has failed")], eight, 8)
    assert broken.failure == "nvidia-smi failed" and "node0" in broken.details[0]
    cpu = C.check_gpus([facts("node0"), facts("node1", 1)], job_of(tmp_path, nproc_per_node=2), 2)
    assert cpu.ok and cpu.groups == [("none", ["node0", "node1"])] and "CPU" in cpu.notes[0]


def test_gpus_auto(tmp_path):
    auto = job_of(tmp_path, nproc_per_node="auto")
    h100 = smi("h100-x8.csv")
    assert C.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=h100)], auto, 1).ok
    assert not C.check_gpus([facts("node0")], auto, 1).ok
    report = C.CheckReport([], gpu_counts={"node0": 8, "node1": 8}, bf16_capable=True)
    assert C.resolve_nproc(report, auto) == 8
    with pytest.raises(UserError, match="8 GPU\\(s\\) on node0; 4 GPU\\(s\\) on node1"):
        C.resolve_nproc(C.CheckReport([], gpu_counts={"node0": 8, "node1": 4}, bf16_capable=True), auto)
    with pytest.raises(UserError):
        C.resolve_nproc(C.CheckReport([], gpu_counts={"node0": 0}, bf16_capable=None), auto)


def test_bf16_of_hosts():
    assert C.bf16_of([facts("a"), facts("b")]) is None
    assert C.bf16_of([facts("a", gpus=smi("h100-x8.csv")), facts("b", gpus=smi("a100-x4.csv"))]) is True
    assert C.bf16_of([facts("a", gpus=smi("h100-x8.csv")), facts("b", gpus=smi("v100-x8.csv"))]) is False


def test_duplicate_hostnames_fail():
    c = C.check_hostnames([facts("node0", hostname="gpu1"), facts("node1", 1, hostname="gpu1"),
                           facts("node2", 2, hostname="gpu2")])
    assert c.failure == "hosts are the same machine" and c.details == ["node0, node1 all have hostname gpu1"]


def test_datasets_differing_or_missing_name_host_file_and_dataset():
    ok = {"dataset": "support", "file": "/w/data/support.json", "sha256": "a" * 64}
    c = C.check_datasets([facts("node0", datasets=[ok]), facts("node1", 1, datasets=[ok]),
                          facts("node2", 2, datasets=[dict(ok, sha256="b" * 64)]),
                          facts("node3", 3, datasets=[{"dataset": "support", "file": "/w/data/support.json",
                                                        "error": "missing"}]),
                          facts("node4", 4, datasets=[{"file": "/w/data/dataset_info.json", "error": "missing"}])])
    assert c.failure == "dataset files differ or are missing"
    assert "node3: /w/data/support.json missing (needed for dataset 'support')" in c.details
    assert "node4: /w/data/dataset_info.json missing (needed for the datasets)" in c.details
    differs = [d for d in c.details if "differs" in d]
    assert differs == [(f"dataset 'support' file /w/data/support.json differs: "
                        f"{'a' * 16} on node0, node1; {'b' * 16} on node2")]
    assert C.check_datasets([facts("node0"), facts("node1", 1)]) is None
    assert C.check_datasets([facts("node0", datasets=[ok]), facts("node1", 1, datasets=[ok])]).ok


def test_route_and_socket_interface(tmp_path):
    job = job_of(tmp_path, env={"GLOO_SOCKET_IFNAME": "eth0"})
    plan = make_plan(job, hosts(3), "r")
    fs = [facts("node0", route=C.Route("lo", "10.0.0.10", True), links=("lo", "eth0")),
          facts("node1", 1, route=C.Route("eth0", "10.0.0.11", False), links=("lo", "eth0")),
          facts("node2", 2, route=C.Route("ib0", "10.0.0.12", False), links=("lo", "ib0"))]
    c = C.check_route(fs, job, plan)
    assert c.failure == "interfaces wrong"
    assert c.details == ["GLOO_SOCKET_IFNAME=eth0 matches no interface on node2 (it has lo, ib0)"]
    fs[2] = facts("node2", 2, route=C.Route("ib0", None, False), links=("lo", "eth0", "ib0"))
    c = C.check_route(fs, job, plan)
    assert c.ok and c.notes == ["node2 routes to rank 0 through ib0, not GLOO_SOCKET_IFNAME=eth0"]
    fs[1] = facts("node1", 1, route=C.Route(None, None, False, "Network is unreachable"))
    assert "no route from node1 to 10.0.0.10: Network is unreachable" in C.check_route(fs, job, plan).details
    # the env file's value counts when the job does not set one
    nccl = facts("node1", 1, route=C.Route("eth0", None, False), links=("lo", "eth0"),
                 ifname_env={"NCCL_SOCKET_IFNAME": "^docker,lo"})
    assert C.check_route([nccl], job_of(tmp_path), plan).ok
    assert C._ifname_matches("=eth0", "eth0") and not C._ifname_matches("=eth", "eth0")
    assert C._ifname_matches("eth,ib", "ib0") and not C._ifname_matches("^eth", "eth1")


def test_shared_dir_not_shared_names_the_host():
    writers = {"rank-0": "node0", "rank-1": "node1", "rank-2": "node2"}
    seen_all = "rank-0\nrank-1\nrank-2"
    c = C.check_shared({"node0": "rank-0\nrank-1", "node1": "rank-0\nrank-1", "node2": "rank-2"}, writers, "/s")
    assert c.failure == "shared_dir /s is not shared by all hosts"
    assert c.groups == [("sees node0, node1", ["node0", "node1"]), ("sees node2", ["node2"])]
    assert "node2 does not see the sentinel of node0, node1 in /s" in c.details
    assert C.check_shared({h: seen_all for h in writers.values()}, writers, "/s").ok


def test_master_port_busy_or_unreachable():
    busy = C.check_port("node0", 29500, "busy Address already in use\nLISTEN 0 128 *:29500 *:* "
                        'users:(("python",pid=7,fd=3))\n', {"node1": "reachable"}, remote=True)
    assert busy.failure == "master port 29500 in use on node0 (rank 0)"
    assert busy.details == [("port 29500 is already in use on node0 (rank 0): Address already in use; "
                             "held by: python (pid 7) (a previous run still alive? another job?)")]
    ok = C.check_port("node0", 29500, "listening\naccepted 10.0.0.11\n", {"node1": "reachable"}, remote=True)
    assert ok.ok and ok.groups == [("free on node0 (rank 0), reachable from", ["node1"])]
    cut = C.check_port("node0", 29500, "listening\naccepted\n", {"node1": "reachable", "node2": "unreachable"}, True)
    assert cut.failure == "master port 29500 on node0 not reachable" and "node2 cannot connect" in cut.details[0]
    local = C.check_port("localhost", 29500, "listening\naccepted\n", {}, remote=False)
    assert local.ok and "local only" in local.notes[0]


def test_listener_really_detects_a_busy_port():
    def listen(port: int) -> str:
        script = C.listen_script(sys.executable, port, 0)
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=False).stdout

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        assert listen(port).startswith("busy")
    finally:
        s.close()
    assert listen(port).splitlines()[:2] == ["listening", "accepted"]


def test_report_format_groups_hosts_and_fails_once():
    fs = [facts("node0"), facts("node1", 1), facts("node2", 2, versions={"python": "3.11.7", "torch": "2.13.0"})]
    report = C.CheckReport([C.check_ssh(fs), C.check_runtime(fs, docker=False)], gpu_counts={}, bf16_capable=None,
                           seconds=1.25, title="ftbundle check: job j")
    lines = C.format_report(report)
    assert lines == [
        "ftbundle check: job j",
        "ssh         reachable: node0, node1, node2",
        "FAIL versions differ:",
        "  python=3.11.7 torch=2.14.1 transformers=5.6.0 llamafactory=0.9.5: node0, node1",
        "  python=3.11.7 torch=2.13.0: node2",
        "1 of 2 checks failed in 1.2s: versions",
    ]
    assert not report.ok and report.failures == [
        ("versions differ: python=3.11.7 torch=2.14.1 transformers=5.6.0 llamafactory=0.9.5 on node0, node1; "
         "python=3.11.7 torch=2.13.0 on node2")]
    down = C.check_ssh([facts("node0"), C.HostFacts("node1", 1, error="No route to host")])
    assert down.messages() == ["ssh: node1 (rank 1): No route to host"]


# ---------------------------------------------------------------------------------------
# --net


# trimmed from `iperf3 -c ... -J` (iperf 3.12) between two test hosts
IPERF3_JSON = json.dumps({
    "start": {"version": "iperf 3.12", "system_info": "Linux node1"},
    "end": {
        "sum_sent": {"start": 0, "end": 1.000266, "seconds": 1.000266, "bytes": 4478599168,
                     "bits_per_second": 35819265419.39844, "retransmits": 2, "sender": True},
        "sum_received": {"start": 0, "end": 1.0009, "seconds": 1.0009, "bytes": 4478599168,
                         "bits_per_second": 35796576425.2173, "sender": True},
    },
})


def test_parse_iperf3_json():
    assert N.parse_iperf3_json(IPERF3_JSON) == pytest.approx(35.7965764e9)
    refused = json.dumps({"start": {"connected": []}, "intervals": [], "end": {},
                          "error": "unable to connect to server: Connection refused"})
    with pytest.raises(ValueError, match="Connection refused"):
        N.parse_iperf3_json(refused)
    with pytest.raises(ValueError, match="command not found"):
        N.parse_iperf3_json("bash: iperf3: command not found\n")


def test_parse_bench_line_and_slow_warnings():
    out = ("[node0 r0] noise\n[node0 r0] ftb-allreduce backend=gloo world=4 size_mib=16 iters=10 "
           "time_ms=36.7 algbw_gbps=3.66 busbw_gbps=5.49\n")
    line = N.parse_bench_line(out)
    assert line["backend"] == "gloo" and line["busbw_gbps"] == "5.49" and line["world"] == "4"
    assert N.parse_bench_line("nothing\n") is None
    warnings = N.slow_warnings({"node1": 18.5, "node2": 0.9}, "node0", 5.49, 10)
    assert len(warnings) == 2 and warnings[0].startswith("node2 -> node0: 0.90 Gbit/s is under 10 Gbit/s")
    assert "bus bandwidth 5.49" in warnings[1]
    assert N.slow_warnings({"node1": 18.5}, "node0", None, 10) == []


def test_bench_plan_is_the_job_with_the_bench_as_script(tmp_path):
    job = job_of(tmp_path, nproc_per_node=2, master_port=29600, env={"GLOO_SOCKET_IFNAME": "eth0"},
                 runtime={"python": "/opt/venv/bin/python"},
                 train={"llamafactory": {"dataset": "x", "output_dir": "/shared/o"}})
    plan = make_plan(job, hosts(2), "r1")
    bench = N.bench_plan(job, plan, "j-netcheck-1", size_mib=4, iters=3)
    assert bench.run_dir == "/shared/runs/j-netcheck-1" and bench.files == {}
    node = bench.nodes[1]
    assert node.argv[:4] == ("timeout", "-k", "5", str(N.BENCH_LIMIT_S))
    assert node.argv[4:7] == ("/opt/venv/bin/python", "-m", "torch.distributed.run")
    assert "/shared/runs/j-netcheck-1/ftb_allreduce_bench.py" in node.argv
    assert node.argv[-6:] == ("--size-mib", "4", "--iters", "3", "--timeout", "60")
    assert node.env["GLOO_SOCKET_IFNAME"] == "eth0" and node.env["MASTER_PORT"] == "29600"
    assert bench.nproc_per_node == 2 and bench.master_addr == "10.0.0.10"
    assert "ftb-allreduce" in N.bench_source()
