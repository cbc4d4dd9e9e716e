"""`ftbundle check`'s parts without hosts: the probe run for real on this machine, the facts
parsed from it, the rules, the report, and the pure parts of `--net`.

The nvidia-smi samples in tests/data/nvidia-smi/ are hand-made format samples, written in
the exact format nvidia-smi prints for the probe's queries; they were not captured in this
repository's CI (no GPU there; real outputs are recorded into tests/data/nvidia-smi/recorded/
by tests/gpu/test_gpu.py where a GPU is present). tests/assets/nvidia-smi-replay replays them, so the probe's
whole GPU path runs, hung driver included.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftbundle.check import net as N
from ftbundle.check import probe_source, probe_spec
from ftbundle.check import rules as R
from ftbundle.check.report import CheckReport, format_report
from ftbundle.errors import UserError
from ftbundle.facts import (ClusterFacts, Gpu, HostFacts, Route, Storage, bf16_capable, describe_gpus,
                            parse_compute_apps, parse_facts, parse_nvidia_smi, visible)
from ftbundle.inventory import Host
from ftbundle.job import parse_job
from ftbundle.layout import make_layout
from ftbundle.plan import make_plan
from tests.support.helpers import free_port

SMI = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi"
REPLAY = Path(__file__).resolve().parents[1] / "assets" / "nvidia-smi-replay"


def smi(name: str) -> list[Gpu]:
    from ftbundle.facts import add_gpu_ids

    gpus = parse_nvidia_smi((SMI / name).read_text())
    ids = SMI / name.replace(".csv", ".ids.csv")
    return add_gpu_ids(gpus, ids.read_text()) if ids.exists() else gpus


def job_of(tmp_path: Path, **extra):
    data = {"name": "j", "shared_dir": "/shared", "train": {"script": "train.py"}, **extra}
    return parse_job(data, tmp_path / "job.yaml")


def hosts(n: int) -> list[Host]:
    return [Host(f"node{i}", f"10.0.0.{10 + i}") for i in range(n)]


def layout_of(tmp_path, n=2, **extra):
    return make_layout(job_of(tmp_path, **extra), hosts(n), "r1")


def facts(host: str, rank: int = 0, **kw) -> HostFacts:
    kw.setdefault("versions", {"python": "3.11.7", "torch": "2.14.1", "transformers": "5.6.0",
                               "llamafactory": "0.9.5"})
    kw.setdefault("hostname", host)
    return HostFacts(host, rank, **kw)


# ---------------------------------------------------------------------------------------
# grouping


def test_group_by_value_puts_the_majority_first_and_keeps_rank_order():
    groups = R.group_by_value({"node0": "a", "node1": "b", "node2": "b", "node3": "c", "node4": "b"})
    assert groups == [("b", ["node1", "node2", "node4"]), ("a", ["node0"]), ("c", ["node3"])]
    assert R.group_by_value({"n0": "x", "n1": "x"}) == [("x", ["n0", "n1"])]
    assert R.group_by_value({}) == []
    assert R.describe_groups(groups[:2]) == "b on node[1-2,4]; a on node0"


# ---------------------------------------------------------------------------------------
# nvidia-smi


def test_parse_nvidia_smi_h100_box():
    gpus = smi("h100-x8.csv")
    assert len(gpus) == 8
    assert gpus[0].kind == ("NVIDIA H100 80GB HBM3", "550.54.15", 81559, "9.0")
    assert gpus[3].index == "3" and gpus[3].uuid.startswith("GPU-5c1e8a23") and gpus[0].memory_used_mib == 1
    assert bf16_capable(gpus) is True
    assert describe_gpus(gpus) == "8x NVIDIA H100 80GB HBM3 (81559 MiB, compute 9.0, driver 550.54.15)"


def test_recorded_h100_output_reads_as_the_hand_made_h100_sample():
    """A real nvidia-smi's output for the probe's queries (recorded on a lent H100 machine by
    tests/gpu/test_gpu.py, driver 580): read by the same parsers, and in the same format as the
    hand-made h100-x8 sample the other tests use (the same name and fields, the same layout)."""
    real = smi("recorded/nvidia-h100-80gb-hbm3-x1.csv")
    assert len(real) == 1 and real[0].uuid == "GPU-26e1fd83-ae97-4776-3917-dfa324281244"
    assert real[0].kind == ("NVIDIA H100 80GB HBM3", "580.159.04", 81559, "9.0")
    assert real[0].index == "0" and real[0].memory_used_mib == 0
    assert bf16_capable(real) is True
    assert describe_gpus(real) == "1x NVIDIA H100 80GB HBM3 (81559 MiB, compute 9.0, driver 580.159.04)"
    made = smi("h100-x8.csv")
    assert (made[0].name, made[0].memory_mib, made[0].compute_cap) == (real[0].name, real[0].memory_mib, real[0].compute_cap)
    shape = lambda text: [re.sub(r"[^, \n]+", "x", line) for line in text.splitlines()][:1]  # noqa: E731
    for suffix in (".csv", ".ids.csv"):
        recorded = (SMI / "recorded" / f"nvidia-h100-80gb-hbm3-x1{suffix}").read_text()
        assert shape(recorded) == shape((SMI / f"h100-x8{suffix}").read_text()), suffix
    assert parse_compute_apps((SMI / "recorded" / "nvidia-h100-80gb-hbm3-x1.apps.csv").read_text()) == []  # idle: empty


def test_parse_nvidia_smi_v100_box_is_not_bf16_capable():
    gpus = smi("v100-x8.csv")
    assert len(gpus) == 8 and gpus[0].compute_cap_tuple == (7, 0)
    assert bf16_capable(gpus) is False
    assert bf16_capable(smi("a100-x4.csv")) is True  # 8.0 is the threshold


def test_parse_nvidia_smi_old_driver_without_compute_cap():
    gpus = smi("t4-x2-no-compute-cap.csv")
    assert gpus == [Gpu("Tesla T4", "470.82.01", 15109, None)] * 2
    assert bf16_capable(gpus) is False  # unknown is not capable


def test_parse_nvidia_smi_mixed_host_and_odd_values():
    gpus = smi("mixed-h100-a100.csv")
    assert describe_gpus(gpus).startswith("2x NVIDIA H100 80GB HBM3 (")
    assert " + 1x NVIDIA A100-SXM4-80GB (81920 MiB, compute 8.0" in describe_gpus(gpus)
    assert bf16_capable(gpus) is True
    assert bf16_capable([]) is False
    odd = parse_nvidia_smi("Some GPU, Rev 2, 535.1, [N/A], [N/A]\n\n")
    assert odd == [Gpu("Some GPU, Rev 2", "535.1", None, None)]
    with pytest.raises(ValueError):
        parse_nvidia_smi("No devices were found")


def test_cuda_visible_devices_by_index_uuid_and_cut_at_the_first_unknown():
    gpus = smi("h100-x8.csv")
    assert visible(gpus, None) == gpus
    assert [g.index for g in visible(gpus, "0,2")] == ["0", "2"]
    assert [g.index for g in visible(gpus, f"{gpus[5].uuid},1")] == ["5", "1"]
    assert [g.index for g in visible(gpus, "GPU-5c1e8a27")] == ["7"]  # a unique prefix, as CUDA takes it
    assert [g.index for g in visible(gpus, "3,9,4")] == ["3"]  # CUDA stops at an unknown device
    assert visible(gpus, "") == [] and visible(gpus, "-1") == []


def test_compute_apps():
    [app] = parse_compute_apps((SMI / "a100-x4.apps.csv").read_text())
    assert app.pid == "48213" and app.used_memory_mib == 30712 and app.gpu_uuid.endswith("a4b1")
    assert parse_compute_apps("") == []


# ---------------------------------------------------------------------------------------
# the probe, run for real on this machine (python3 - SPEC)


def run_probe(spec: dict, env: dict | None = None, timeout: float = 60) -> dict:
    proc = subprocess.run([sys.executable, "-", json.dumps(spec)], input=probe_source(), capture_output=True,
                          timeout=timeout, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def local_spec(tmp_path: Path, **kw) -> dict:
    spec = {"rank": 0, "master_addr": "127.0.0.1", "workdir": str(tmp_path), "env_file": None, "docker": False,
            "python": sys.executable, "packages": ["torch", "transformers", "llamafactory"], "token": None,
            "expect": [0], "storage": [{"name": "shared_dir", "path": str(tmp_path / "nope"), "create": False}],
            "sentinel_wait_s": 1}
    spec.update(kw)
    return spec


def write_datasets(d: Path, info: dict, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "dataset_info.json").write_text(json.dumps(info))
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)


def test_probe_reports_this_machine(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("NCCL_SOCKET_IFNAME=lo\nCUDA_VISIBLE_DEVICES=0,1\n")
    f = parse_facts("localhost", 0, run_probe(local_spec(tmp_path, env_file=str(env_file))))
    assert f.hostname == socket.gethostname() and f.problems == []
    assert f.versions["python"] == sys.version.split()[0]
    assert set(f.versions) == {"python", "torch", "transformers", "llamafactory"}
    assert f.route.dev == "lo" and f.route.local
    assert "lo" in f.links
    assert f.workdir_ok and not f.shared.exists and f.shared.written is None
    assert not (tmp_path / "nope").exists()  # nothing created where it was not asked
    assert f.env == {"NCCL_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "0,1"}  # as the job will see it
    assert f.gpus == [] and f.gpu_error is None  # no nvidia-smi here


def test_probe_values_are_data_never_shell(tmp_path):
    """Paths holding quotes, $(...) and backticks are used as they are: nothing runs."""
    odd = tmp_path / "a'b \"c\" $(touch PWNED) `touch PWNED2`"
    odd.mkdir()
    env_file = odd / "nccl.env"
    env_file.write_text("GLOO_SOCKET_IFNAME=lo\n")
    f = parse_facts("localhost", 0, run_probe(local_spec(
        odd, env_file=str(env_file), storage=[{"name": "shared_dir", "path": str(odd / "s $(id)"), "create": True}])))
    assert f.workdir_ok and f.shared.created and (odd / "s $(id)").is_dir()
    assert f.env == {"GLOO_SOCKET_IFNAME": "lo"}
    assert not list(tmp_path.rglob("PWNED*")) and not Path("PWNED").exists()


def test_probe_hashes_datasets_and_names_what_is_missing(tmp_path):
    import hashlib

    d = tmp_path / "data"
    write_datasets(d, {"a": {"file_name": "a.json"}, "b": {"file_name": "gone.json"},
                       "dir": {"file_name": "parts"}, "hub": {"hf_hub_url": "org/ds"}},
                   {"a.json": "[1]", "parts/x.json": "[2]", "parts/y.json": "[3]"})
    spec = local_spec(tmp_path, datasets={"dir": str(d), "names": ["a", "b", "dir", "hub", "nope"]})
    by_name = {e["dataset"]: e for e in run_probe(spec)["datasets"]}
    assert by_name["a"]["sha256"] == hashlib.sha256(b"[1]").hexdigest()
    assert by_name["b"] == {"dataset": "b", "file": str(d / "gone.json"), "error": "missing"}
    assert len(by_name["dir"]["sha256"]) == 64
    assert by_name["hub"] == {"dataset": "hub", "remote": "hf_hub_url"}
    assert by_name["nope"]["error"] == "not defined"
    (d / "parts" / "y.json").write_text("[4]")  # a directory's hash follows its files
    spec["datasets"]["names"] = ["dir"]
    assert run_probe(spec)["datasets"][0]["sha256"] != by_name["dir"]["sha256"]
    spec["datasets"] = {"dir": str(tmp_path / "elsewhere"), "names": ["a"]}
    assert run_probe(spec)["datasets"] == [{"file": str(tmp_path / "elsewhere" / "dataset_info.json"),
                                            "error": "missing"}]


def test_probe_with_a_missing_interpreter_is_a_runtime_error(tmp_path):
    f = parse_facts("h", 0, run_probe(local_spec(tmp_path, python="/nonexistent/bin/python")))
    assert f.versions is None and "/nonexistent/bin/python" in f.runtime_error


def smi_env(tmp_path: Path, sample: str) -> dict:
    """PATH with the replaying stand-in as nvidia-smi, fed ``sample``."""
    bin_dir, data = tmp_path / "bin", tmp_path / "smi"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(REPLAY, bin_dir / "nvidia-smi")
    if data.exists():
        shutil.rmtree(data)
    shutil.copytree(SMI, data)
    (data / "sample").write_text(sample)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FTB_SMI_DIR": str(data)}


def test_probe_reads_gpus_their_ids_and_busy_processes_through_nvidia_smi(tmp_path):
    f = parse_facts("h", 0, run_probe(local_spec(tmp_path), env=smi_env(tmp_path, "a100-x4")))
    assert len(f.gpus) == 4 and f.gpu_error is None and f.gpus[1].uuid.endswith("a4b1")
    assert [a.pid for a in f.compute_apps] == ["48213"]
    old = parse_facts("h", 0, run_probe(local_spec(tmp_path), env=smi_env(tmp_path, "t4-x2-no-compute-cap")))
    assert len(old.gpus) == 2 and old.gpus[0].compute_cap is None  # asked again without compute_cap


def test_probe_reports_a_hung_driver_as_such_within_its_timeout(tmp_path):
    started = time.monotonic()
    f = parse_facts("h", 0, run_probe(local_spec(tmp_path, nvidia_smi_timeout_s=1), env=smi_env(tmp_path, "hang")))
    assert time.monotonic() - started < 10
    assert f.gpu_hung and "did not answer within 1s" in f.gpu_error
    check = R.check_gpus([f], layout_of(tmp_path, nproc_per_node=1), 1)
    assert check.failure == "nvidia-smi failed" and check.details[0].startswith("h: GPU driver hung: ")


def test_probe_storage_round_sees_every_sentinel_and_rank0_creates_a_fresh_dir(tmp_path):
    """Two probes at once, as two hosts: rank 0 creates the missing directory, rank 1 waits
    for it, both write a sentinel and see each other's."""
    fresh = tmp_path / "shared" / "ftbundle"
    (tmp_path / "shared").mkdir()
    out = {}

    def probe(rank):
        out[rank] = parse_facts(f"n{rank}", rank, run_probe(local_spec(
            tmp_path, rank=rank, token="t1", expect=[0, 1], sentinel_wait_s=5,
            storage=[{"name": "shared_dir", "path": str(fresh), "create": rank == 0, "wait": rank != 0}])))

    threads = [threading.Thread(target=probe, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # rank 1 starts first and must wait for rank 0's mkdir
    for t in threads:
        t.join()
    assert out[0].shared.created and out[1].shared.exists and not out[1].shared.created
    assert out[0].shared.seen == (0, 1) and out[1].shared.seen == (0, 1)
    assert ClusterFacts([out[0], out[1]], token="t1").storage_shared("shared_dir") is True
    run_probe({"mode": "clean", "token": "t1", "paths": [str(fresh)]})
    assert list(fresh.iterdir()) == []


def test_probe_output_dir_sentinel_goes_under_its_nearest_existing_parent(tmp_path):
    spec = local_spec(tmp_path, token="t2", storage=[
        {"name": "output_dir", "path": str(tmp_path / "saves" / "run1"), "nearest": True}])
    f = parse_facts("h", 0, run_probe(spec))
    s = f.storage["output_dir"]
    assert not s.exists and s.where == str(tmp_path) and s.written and s.seen == (0,)
    assert (tmp_path / ".ftb-check-t2" / "rank-0").exists()
    run_probe({"mode": "clean", "token": "t2", "paths": [str(tmp_path / "saves" / "run1")]})
    assert not (tmp_path / ".ftb-check-t2").exists() and not (tmp_path / "saves").exists()


def test_probe_port_free_busy_and_connect(tmp_path):
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        busy = run_probe(local_spec(tmp_path, port={"role": "listen", "port": port, "peers": 0}))["port"]
        assert busy["busy"]
        reach = run_probe(local_spec(tmp_path, port={"role": "connect", "addr": "127.0.0.1", "port": port,
                                                      "connect_s": 1}))["port"]
        assert reach == {"role": "connect", "reachable": True}
    finally:
        s.close()
    free = run_probe(local_spec(tmp_path, port={"role": "listen", "port": port, "peers": 0}))["port"]
    assert free == {"role": "listen", "accepted": []}


def test_rank_0_counts_only_its_own_checks_knocks(tmp_path):
    """Two runs checked at once: the other check's host connecting to the master port is not one
    of ours (it satisfied the count and ours then found the port closed: 'not reachable')."""
    import threading

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    got = {}
    listener = threading.Thread(target=lambda: got.update(run_probe(local_spec(tmp_path, port={
        "role": "listen", "port": port, "peers": 1, "listen_s": 6, "token": "run-a"}))["port"]))
    listener.start()
    knock = {"role": "connect", "addr": "127.0.0.1", "port": port, "connect_s": 5}
    other = run_probe(local_spec(tmp_path, port={**knock, "token": "run-b"}))["port"]
    ours = run_probe(local_spec(tmp_path, port={**knock, "token": "run-a"}))["port"]
    listener.join(10)
    assert other == ours == {"role": "connect", "reachable": True}
    assert got == {"role": "listen", "accepted": ["127.0.0.1"]}  # (run-a's alone: the listener still open for it)


# ---------------------------------------------------------------------------------------
# what the probe is asked, from the layout


def test_probe_spec_from_a_llamafactory_layout(tmp_path):
    layout = make_layout(job_of(tmp_path, workdir="/work", runtime={"python": "/opt/venv/bin/python"},
                                train={"llamafactory": {"model_name_or_path": "org/model", "dataset": "alpaca, support", "eval_dataset": "support",
                                                        "dataset_dir": "data", "output_dir": "/shared/out"}}),
                         hosts(2), "r1")
    s = probe_spec(layout, 1, token="tok", expect=[0, 1], port_peers=1)
    assert s["python"] == "/opt/venv/bin/python" and s["rank"] == 1
    assert s["datasets"] == {"dir": "/work/data", "names": ["alpaca", "support"]}
    assert s["master_addr"] == "10.0.0.10" and s["workdir"] == "/work"
    assert s["storage"] == [{"name": "shared_dir", "path": "/shared", "create": False, "wait": True},
                            {"name": "output_dir", "path": "/shared/out", "nearest": True}]
    assert s["port"] == {"role": "connect", "addr": "10.0.0.10", "port": 29500, "connect_s": 6, "token": "r1"}
    rank0 = probe_spec(layout, 0, token="tok", expect=[0, 1], port_peers=1)
    assert rank0["storage"][0]["create"] and rank0["port"]["role"] == "listen"
    read_only = probe_spec(layout, 0, token=None, expect=[0], port_peers=None, create=False)  # --dry-run
    assert not read_only["storage"][0]["create"] and "port" not in read_only
    online = make_layout(job_of(tmp_path, train={"llamafactory": {"model_name_or_path": "org/model", "dataset": "x", "dataset_dir": "ONLINE"}}),
                         hosts(1), "r3")
    assert "datasets" not in probe_spec(online, 0, token=None, expect=[0], port_peers=None)


def test_probe_spec_docker_runtime_asks_for_the_image(tmp_path):
    image = "reg/train@sha256:" + "a" * 64
    layout = make_layout(job_of(tmp_path, runtime={"kind": "docker", "image": image}), hosts(2), "r1")
    s = probe_spec(layout, 0, token=None, expect=[0], port_peers=None)
    assert s["docker"] and s["image"] == image and s["python"] is None
    assert s["image_ref_file"] == "/etc/ftbundle/image.ref"


def test_facts_from_json_image_and_errors():
    image = "reg/train@sha256:" + "a" * 64
    f = parse_facts("n0", 0, {"image": image, "image_id": "sha256:" + "b" * 64, "image_ref": image,
                              "gpus": (SMI / "h100-x8.csv").read_text(), "gpu_ids": (SMI / "h100-x8.ids.csv").read_text(),
                              "errors": ["gpus: boom"]})
    assert f.image_id == "sha256:" + "b" * 64 and f.image_ref == image and len(f.gpus) == 8
    assert f.problems == ["gpus: boom"]
    assert R.check_probe([f]).warnings == ["n0: gpus: boom"]


# ---------------------------------------------------------------------------------------
# the plan's decisions from the facts


def cluster_of(*per_host: HostFacts) -> ClusterFacts:
    return ClusterFacts(list(per_host))


def test_auto_nproc_from_the_gpus_the_job_sees(tmp_path):
    h100 = smi("h100-x8.csv")
    auto = layout_of(tmp_path, nproc_per_node="auto")
    assert make_plan(auto, cluster_of(facts("node0", gpus=h100), facts("node1", 1, gpus=h100))).nproc_per_node == 8
    # the host's own CUDA_VISIBLE_DEVICES (its env file) counts ...
    limited = cluster_of(facts("node0", gpus=h100, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}),
                         facts("node1", 1, gpus=h100, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}))
    assert make_plan(auto, limited).nproc_per_node == 4
    # ... and the job's wins over it
    job_env = layout_of(tmp_path, nproc_per_node="auto", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert make_plan(job_env, limited).nproc_per_node == 2
    # hosts that differ each get their own count (issue 36), no longer a refusal
    uneven = make_plan(auto, cluster_of(facts("node0", gpus=h100), facts("node1", 1, gpus=smi("a100-x4.csv"))))
    assert uneven.nprocs == (8, 4) and uneven.world_size == 12
    with pytest.raises(UserError, match="no GPU is visible to the job on some hosts: 0 GPU\\(s\\) on node1"):
        make_plan(auto, cluster_of(facts("node0", gpus=h100), facts("node1", 1)))
    with pytest.raises(UserError, match="needs the hosts' GPU counts"):
        make_plan(auto)


def test_run_gives_the_ranks_the_gpus_per_node_the_job_asks_for(tmp_path):
    """`gpus_per_node` as a scheduler reads it, in `ftbundle run` too: 0 is a CPU job (its ranks
    see no GPU), N narrows a bigger host to its first N (the job's CUDA_VISIBLE_DEVICES wins),
    `nproc_per_node: auto` is N, and a host with fewer than N fails the check by name."""
    h100, a100 = smi("h100-x8.csv"), smi("a100-x4.csv")
    eight = cluster_of(facts("node0", gpus=h100), facts("node1", 1, gpus=h100))
    cpu = make_plan(layout_of(tmp_path, nproc_per_node=2, gpus_per_node=0), eight)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in cpu.nodes] == ["", ""]
    assert make_plan(layout_of(tmp_path, nproc_per_node=2, gpus_per_node=0)).nodes[0].env["CUDA_VISIBLE_DEVICES"] == ""
    four = make_plan(layout_of(tmp_path, nproc_per_node="auto", gpus_per_node=4), eight)
    assert four.nproc_per_node == 4 and [n.env["CUDA_VISIBLE_DEVICES"] for n in four.nodes] == ["0,1,2,3"] * 2
    mixed = cluster_of(facts("node0", gpus=h100), facts("node1", 1, gpus=a100))
    plan = make_plan(layout_of(tmp_path, nproc_per_node=4, gpus_per_node=4), mixed)
    assert plan.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "CUDA_VISIBLE_DEVICES" not in plan.nodes[1].env  # exactly four there: nothing to narrow
    own = make_plan(layout_of(tmp_path, nproc_per_node=2, gpus_per_node=2, env={"CUDA_VISIBLE_DEVICES": "6,7"}),
                    eight)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in own.nodes] == ["6,7", "6,7"]
    assert "CUDA_VISIBLE_DEVICES" not in make_plan(layout_of(tmp_path, nproc_per_node=8), eight).nodes[0].env
    image = "reg/train@sha256:" + "a" * 64
    docker = make_plan(layout_of(tmp_path, nproc_per_node=2, gpus_per_node=2,
                                 runtime={"kind": "docker", "image": image}), eight).nodes[0].argv
    assert docker[docker.index("--gpus") + 1] == '"device=0,1"'
    assert "--gpus" not in make_plan(layout_of(tmp_path, nproc_per_node=2, gpus_per_node=0,
                                               runtime={"kind": "docker", "image": image}), eight).nodes[0].argv

    fours = cluster_of(facts("node0", gpus=a100), facts("node1", 1, gpus=a100))
    short = R.check_gpus(fours.reached, layout_of(tmp_path, nproc_per_node=2, gpus_per_node=8), 2)
    assert short.failure == "GPUs do not fit gpus_per_node", short
    assert short.details == ["gpus_per_node is 8 but node0 has 4 GPU(s)", "gpus_per_node is 8 but node1 has 4 GPU(s)"]
    differ = R.check_gpus(mixed.reached, layout_of(tmp_path, nproc_per_node=2, gpus_per_node=8), 2)
    assert "gpus_per_node is 8 but node1 has 4 GPU(s)" in differ.details
    assert not any("node0 has" in d and "gpus_per_node" in d for d in differ.details)
    fits = R.check_gpus(eight.reached, layout_of(tmp_path, nproc_per_node=2, gpus_per_node=2), 2)
    assert fits.failure is None, fits
    off = R.check_gpus(eight.reached, layout_of(tmp_path, nproc_per_node=2, gpus_per_node=0), 2)
    assert off.failure is None and any("a CPU job" in n for n in off.notes), off
    # what an export of this job would request (issue 21) is said only where it differs from the run
    # (issue 45: on a run's check it was noise): not where the run uses the GPUs an export requests ...
    auto = R.check_gpus(eight.reached, layout_of(tmp_path, nproc_per_node="auto"), 8)
    for same in (off, fits, auto):
        assert not any("export" in n for n in same.notes), same.notes
    # ... but where the run trains on CPUs (no GPUs there) and an export would ask a scheduler for GPUs
    cpus = cluster_of(facts("node0", cpus=8), facts("node1", 1, cpus=8))
    cpu = R.check_gpus(cpus.reached, layout_of(tmp_path, nproc_per_node=2), 2)
    assert ("this run trains on CPUs on node[0-1] (no GPUs there), while an export of this job requests 2 GPU(s) "
            "per node (gpus_per_node: auto); set gpus_per_node: 0 to export a CPU job") in " ".join(cpu.notes), cpu


def test_docker_runtime_gets_the_gpus_and_infiniband_by_default(tmp_path):
    image = "reg/train@sha256:" + "a" * 64
    h100 = smi("h100-x8.csv")
    eight = layout_of(tmp_path, nproc_per_node=8, runtime={"kind": "docker", "image": image})
    argv = make_plan(eight, cluster_of(facts("node0", gpus=h100), facts("node1", 1, gpus=h100))).nodes[1].argv
    assert argv[argv.index("--gpus") + 1] == "all" and "--device" not in argv
    four = layout_of(tmp_path, nproc_per_node=4, runtime={"kind": "docker", "image": image},
                     env={"CUDA_VISIBLE_DEVICES": "2,3,4,5"})
    ib = ("mlx5_0", "rdma_cm", "uverbs0")
    plan = make_plan(four, cluster_of(facts("node0", gpus=h100, infiniband=ib), facts("node1", 1, gpus=h100,
                                                                                    infiniband=ib)))
    argv = plan.nodes[0].argv
    assert argv[argv.index("--gpus") + 1] == '"device=2,3,4,5"'
    assert ["-e", "CUDA_VISIBLE_DEVICES"] not in [argv[i:i + 2] for i in range(len(argv))]  # renumbered inside
    assert argv[argv.index("--device") + 1] == "/dev/infiniband" and "IPC_LOCK" in argv
    assert argv[argv.index("--ulimit") + 1] in ("memlock=-1", "stack=67108864")
    cpu = make_plan(layout_of(tmp_path, runtime={"kind": "docker", "image": image}),
                    cluster_of(facts("node0"), facts("node1", 1))).nodes[0].argv
    assert "--gpus" not in cpu
    explicit = layout_of(tmp_path, nproc_per_node=8, runtime={"kind": "docker", "image": image, "gpus": "none"})
    assert make_plan(explicit, cluster_of(facts("node0", gpus=h100))).nodes[0].argv.count("none") == 1


def test_output_dir_warning_follows_the_storage_facts_not_the_path(tmp_path):
    """output_dir /shared/saves with shared_dir /shared/ftbundle: the old path test called it
    not shared; the sentinels say it is."""
    layout = make_layout(job_of(tmp_path, shared_dir="/shared/ftbundle",
                                train={"llamafactory": {"model_name_or_path": "org/model", "output_dir": "/shared/saves", "save_total_limit": 1}}),
                         hosts(2), "r1")
    seen = {"output_dir": Storage("/shared/saves", written=True, seen=(0, 1), where="/shared")}
    shared = cluster_of(facts("node0", storage=seen), facts("node1", 1, storage=seen))
    assert not [w for w in make_plan(layout, shared).warnings if "output_dir" in w]
    alone = cluster_of(facts("node0", storage={"output_dir": Storage("/shared/saves", written=True, seen=(0,))}),
                       facts("node1", 1, storage={"output_dir": Storage("/shared/saves", written=True, seen=(1,))}))
    [warning] = [w for w in make_plan(layout, alone).warnings if "output_dir" in w]
    assert warning.startswith("output_dir /shared/saves is not on storage every host shares")
    from ftbundle.check.storage_rules import check_storage

    check = check_storage(alone.hosts, "output_dir", "/shared/saves", fail=False)
    assert check.ok and any("node0 does not see the sentinel of node1" in w for w in check.warnings)


# ---------------------------------------------------------------------------------------
# the rules


def test_versions_that_differ_fail_naming_the_host():
    other = {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.6.0", "llamafactory": "0.9.5"}
    fs = [facts("node0"), facts("node1", 1), facts("node2", 2, versions=other)]
    c = R.check_runtime(fs, docker=False)
    assert c.failure == "versions differ"
    assert c.groups[-1] == ("python=3.11.7 torch=2.13.0 transformers=5.6.0 llamafactory=0.9.5", ["node2"])
    assert "torch=2.13.0 transformers=5.6.0 llamafactory=0.9.5 on node2" in c.messages()[0]
    assert R.check_runtime(fs[:2], docker=False).ok
    broken = R.check_runtime([facts("node0"), facts("node1", 1, versions=None, runtime_error="python: not found")],
                             docker=False)
    assert broken.failure == "versions unavailable" and broken.details == ["node1: python: not found"]


def test_image_digest_and_ids_compared_for_docker():
    ref = "reg/t@sha256:" + "a" * 64
    fs = [facts("node0", image=ref, image_id="sha256:aa"), facts("node1", 1, image=ref, image_id="sha256:bb")]
    c = R.check_runtime(fs, docker=True)
    assert c.failure == "image differ"
    shown = " python=3.11.7 torch=2.14.1 transformers=5.6.0 llamafactory=0.9.5"  # what the image holds
    assert c.groups == [(f"{ref} (ID sha256:aa){shown}", ["node0"]), (f"{ref} (ID sha256:bb){shown}", ["node1"])]


def test_a_runtime_without_what_the_job_needs_is_refused_naming_it():
    """torch=absent used to be shown, and then 'all checks passed': the run then failed on every
    host. A LlamaFactory job needs LlamaFactory too (in the image, for the docker runtime)."""
    ref = "reg/t@sha256:" + "a" * 64
    no_lf = {"python": "3.11.2", "torch": "2.13.0", "transformers": "absent", "llamafactory": "absent"}
    image = [facts(f"node{i}", i, image=ref, image_id="sha256:aa", versions=no_lf) for i in range(2)]
    assert R.check_runtime(image, docker=True, mode="script").ok  # a script needs torch alone
    c = R.check_runtime(image, docker=True, mode="llamafactory")
    assert c.failure == "packages missing"
    assert c.details[0] == "llamafactory is not installed in the image on node[0-1]"
    assert "docs/quickstart-servers.md#the-training-image" in c.details[1]
    bare = {"python": "3.11.2", "torch": "absent", "transformers": "absent", "llamafactory": "absent"}
    c = R.check_runtime([facts("node0", versions=bare)], docker=False, mode="script", python="/usr/bin/python3")
    assert c.details[0] == "torch is not installed in /usr/bin/python3 on node0"
    assert "runtime.python" in c.details[1]
    assert R.check_runtime([facts("node0", versions=bare)], docker=False, mode="command").ok  # runs what it says


def test_gpus_must_fit_nproc_per_node(tmp_path):
    h100, v100 = smi("h100-x8.csv"), smi("v100-x8.csv")
    eight = layout_of(tmp_path, nproc_per_node=8)
    assert R.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=h100)], eight, 8).ok
    four = R.check_gpus([facts("node0", gpus=h100)], layout_of(tmp_path, nproc_per_node=4), 4)
    assert four.ok and "node0 has 8 GPUs; 4 rank(s) use the first 4" in four.notes
    too_few = R.check_gpus([facts("node0", gpus=smi("a100-x4.csv"))], eight, 8)
    assert too_few.failure == "GPUs do not fit nproc_per_node"
    assert too_few.details == ["nproc_per_node is 8 but node0 has 4 GPU(s)"]
    visible_job = layout_of(tmp_path, nproc_per_node=8, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert R.check_gpus([facts("node0", gpus=h100)], visible_job, 8).details == [
        "nproc_per_node is 8 but node0 has 4 GPU(s) visible (CUDA_VISIBLE_DEVICES)"]
    mixed = R.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=v100)], eight, 8)
    assert mixed.failure == "GPUs differ" and mixed.groups[1][1] == ["node1"]
    missing = R.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=[])], eight, 8)
    assert missing.failure == "GPUs differ"
    assert "nproc_per_node is 8 but node1 has 0 GPU(s)" in missing.details
    broken = R.check_gpus([facts("node0", gpu_error="NVIDIA-SMI has failed")], eight, 8)
    assert broken.failure == "nvidia-smi failed" and "node0" in broken.details[0]
    cpu = R.check_gpus([facts("node0"), facts("node1", 1)], layout_of(tmp_path, nproc_per_node=2), 2)
    assert cpu.ok and cpu.groups == [("none", ["node0", "node1"])] and "CPU" in cpu.notes[0]


def test_busy_gpus_are_warned_about_with_their_pids(tmp_path):
    a100 = smi("a100-x4.csv")
    apps = parse_compute_apps((SMI / "a100-x4.apps.csv").read_text())
    c = R.check_gpus([facts("node0", gpus=a100, compute_apps=apps), facts("node1", 1, gpus=a100)],
                     layout_of(tmp_path, nproc_per_node=4), 4)
    assert c.ok and c.warnings == ["node0: GPUs in use by pid 48213 (/opt/venv/bin/python3, 30712 MiB) "
                                   "(a previous run still alive? another job?)"]
    # a job that leaves GPU 1 out is not warned about it
    spare = layout_of(tmp_path, nproc_per_node=2, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert R.check_gpus([facts("node0", gpus=a100, compute_apps=apps)], spare, 2).warnings == []


def test_gpus_auto(tmp_path):
    auto = layout_of(tmp_path, nproc_per_node="auto")
    h100 = smi("h100-x8.csv")
    assert R.check_gpus([facts("node0", gpus=h100), facts("node1", 1, gpus=h100)], auto, None).ok
    assert not R.check_gpus([facts("node0")], auto, None).ok


def test_bf16_of_hosts():
    assert cluster_of(facts("a"), facts("b")).bf16 is None
    assert cluster_of(facts("a", gpus=smi("h100-x8.csv")), facts("b", gpus=smi("a100-x4.csv"))).bf16 is True
    assert cluster_of(facts("a", gpus=smi("h100-x8.csv")), facts("b", gpus=smi("v100-x8.csv"))).bf16 is False


def test_duplicate_hostnames_fail():
    c = R.check_hostnames([facts("node0", hostname="gpu1"), facts("node1", 1, hostname="gpu1"),
                           facts("node2", 2, hostname="gpu2")])
    assert c.failure == "hosts are the same machine" and c.details == ["node[0-1] all have hostname gpu1"]


def test_datasets_differing_or_missing_name_host_file_and_dataset():
    ok = {"dataset": "support", "file": "/w/data/support.json", "sha256": "a" * 64}
    c = R.check_datasets([facts("node0", datasets=[ok]), facts("node1", 1, datasets=[ok]),
                          facts("node2", 2, datasets=[dict(ok, sha256="b" * 64)]),
                          facts("node3", 3, datasets=[{"dataset": "support", "file": "/w/data/support.json",
                                                        "error": "missing"}]),
                          facts("node4", 4, datasets=[{"file": "/w/data/dataset_info.json", "error": "missing"}])])
    assert c.failure == "dataset files differ or are missing"
    assert "node3: /w/data/support.json missing (needed for dataset 'support')" in c.details
    assert "node4: /w/data/dataset_info.json missing (needed for the datasets)" in c.details
    differs = [d for d in c.details if "differs" in d]
    assert differs == [(f"dataset 'support' file /w/data/support.json differs: "
                        f"{'a' * 16} on node[0-1]; {'b' * 16} on node2")]
    assert R.check_datasets([facts("node0"), facts("node1", 1)]) is None
    assert R.check_datasets([facts("node0", datasets=[ok]), facts("node1", 1, datasets=[ok])]).ok


def test_route_and_socket_interface(tmp_path):
    layout = layout_of(tmp_path, 3, env={"GLOO_SOCKET_IFNAME": "eth0"})
    fs = [facts("node0", route=Route("lo", "10.0.0.10", True), links=("lo", "eth0")),
          facts("node1", 1, route=Route("eth0", "10.0.0.11", False), links=("lo", "eth0")),
          facts("node2", 2, route=Route("ib0", "10.0.0.12", False), links=("lo", "ib0"))]
    c = R.check_route(fs, layout)
    assert c.failure == "interfaces wrong"
    assert c.details == ["GLOO_SOCKET_IFNAME=eth0 matches no interface on node2 (it has lo, ib0)"]
    fs[2] = facts("node2", 2, route=Route("ib0", None, False), links=("lo", "eth0", "ib0"))
    c = R.check_route(fs, layout)
    assert c.ok and c.notes == ["node2 routes to rank 0 through ib0, not GLOO_SOCKET_IFNAME=eth0"]
    fs[1] = facts("node1", 1, route=Route(None, None, False, "Network is unreachable"))
    assert "no route from node1 to 10.0.0.10: Network is unreachable" in R.check_route(fs, layout).details
    # the env file's value counts when the job does not set one
    nccl = facts("node1", 1, route=Route("eth0", None, False), links=("lo", "eth0"),
                 env={"NCCL_SOCKET_IFNAME": "^docker,lo"})
    assert R.check_route([nccl], layout_of(tmp_path, 3)).ok
    assert R._ifname_matches("=eth0", "eth0") and not R._ifname_matches("=eth", "eth0")
    assert R._ifname_matches("eth,ib", "ib0") and not R._ifname_matches("^eth", "eth1")


def test_shared_dir_not_shared_names_the_host():
    def host(name, rank, seen):
        return facts(name, rank, storage={"shared_dir": Storage("/s", exists=True, written=True, seen=seen, where="/s")})

    fs = [host("node0", 0, (0, 1)), host("node1", 1, (0, 1)), host("node2", 2, (2,))]
    from ftbundle.check.storage_rules import check_storage

    c = check_storage(fs, "shared_dir", "/s", fail=True)
    assert c.failure == "shared_dir /s is not shared by all hosts"
    assert c.groups == [("sees node[0-1]", ["node0", "node1"]), ("sees node2", ["node2"])]
    assert "node2 does not see the sentinel of node[0-1] in /s" in c.details
    assert check_storage([host(f"node{r}", r, (0, 1, 2)) for r in range(3)], "shared_dir", "/s", fail=True).ok


def test_master_port_busy_or_unreachable(tmp_path):
    layout = layout_of(tmp_path, 3)
    holders = ['LISTEN 0 128 *:29500 *:* users:(("python",pid=7,fd=3))']
    busy = R.check_port([facts("node0", port={"role": "listen", "busy": "Address already in use",
                                               "holders": holders}), facts("node1", 1)], layout)
    assert busy.failure == "master port 29500 in use on node0 (rank 0)"
    assert busy.details == [("port 29500 is already in use on node0 (rank 0): Address already in use; "
                             "held by: python (pid 7) (a previous run still alive? another job?)")]
    listening = {"role": "listen", "accepted": ["10.0.0.11"]}
    ok = R.check_port([facts("node0", port=listening), facts("node1", 1, port={"role": "connect", "reachable": True})],
                      layout)
    assert ok.ok and ok.groups == [("free on node0 (rank 0), reachable from", ["node1"])]
    cut = R.check_port([facts("node0", port=listening), facts("node1", 1, port={"role": "connect", "reachable": True}),
                        facts("node2", 2, port={"role": "connect", "reachable": False, "error": "timed out"})], layout)
    assert cut.failure == "master port 29500 on node0 not reachable" and "node2 cannot connect" in cut.details[0]
    local = R.check_port([facts("localhost", port=listening)], make_layout(job_of(tmp_path, shared_dir=".s"),
                         [Host("localhost", "127.0.0.1", local=True)], "r"))
    assert local.ok and "local only" in local.notes[0]


def test_report_format_groups_hosts_and_fails_once():
    fs = [facts("node0"), facts("node1", 1), facts("node2", 2, versions={"python": "3.11.7", "torch": "2.13.0"})]
    report = CheckReport([R.check_ssh(fs), R.check_runtime(fs, docker=False)], seconds=1.25,
                         title="ftbundle check: job j")
    lines = format_report(report)
    assert lines == [
        "ftbundle check: job j",
        "ssh         reachable: node[0-2]",
        "FAIL versions differ:",
        "  python=3.11.7 torch=2.14.1 transformers=5.6.0 llamafactory=0.9.5: node[0-1]",
        "  python=3.11.7 torch=2.13.0: node2",
        "1 of 2 checks failed in 1.2s: versions",
    ]
    assert not report.ok and report.failures == [
        ("versions differ: python=3.11.7 torch=2.14.1 transformers=5.6.0 llamafactory=0.9.5 on node[0-1]; "
         "python=3.11.7 torch=2.13.0 on node2")]
    down = R.check_ssh([facts("node0"), HostFacts("node1", 1, error="No route to host")])
    assert down.messages() == ["ssh: node1 (node rank 1): No route to host"]


@pytest.mark.parametrize("n", [1, 2, 3, 16, 256])
def test_reports_fold_host_lists_at_every_size(tmp_path, n):
    """Host lists are ranges (ClusterShell's NodeSet notation) at every size: 256 healthy hosts
    make one short line per check, and a few bad ones one line per problem, not per host."""
    from ftbundle.hostlist import fold

    names = [f"gpu-{i:03d}" for i in range(1, n + 1)]
    everyone = "gpu-001" if n == 1 else f"gpu-[001-{n:03d}]"
    assert fold(names) == everyone and fold(reversed(names)) == everyone
    fs = [facts(name, rank) for rank, name in enumerate(names)]
    lines = format_report(CheckReport([R.check_ssh(fs)], seconds=1.0))
    assert lines[0] == f"ssh         reachable: {everyone}"
    if n < 16:
        return
    layout = layout_of(tmp_path, n)
    listening = {"role": "listen", "accepted": []}
    cut = [facts(names[0], 0, port=listening)] + [
        facts(name, rank, port={"role": "connect", "reachable": rank not in (3, 4, 5, 9), "error": "timed out"})
        for rank, name in enumerate(names[1:], 1)]
    port = R.check_port(cut, layout)
    assert port.details == [f"gpu-[004-006,010] cannot connect to gpu-001 port {layout.master_port} "
                            "(firewall? wrong ftb_master_addr?)"]
    down = R.check_ssh([HostFacts(name, rank, error=f"cannot SSH to root@10.0.0.{rank}:22: timed out after 10 s")
                        if rank in (7, 8) else facts(name, rank) for rank, name in enumerate(names)])
    assert down.details == ["gpu-[008-009] (node ranks 7-8): cannot SSH: timed out after 10 s"]
    assert "unreachable: gpu-[008-009]" in format_report(CheckReport([down]))[2]


def test_fold_keeps_names_it_cannot_fold_as_they_are():
    from ftbundle.hostlist import fold, fold_numbers

    assert fold(["10.0.0.1", "10.0.0.2", "10.0.1.7"]) == "10.0.0.[1-2],10.0.1.7"
    assert fold(["a[1]", "b,c"]) == "a[1], b,c"  # brackets and commas are NodeSet's syntax
    assert fold(["x@grp", "y"]) in ("x@grp,y", "x@grp, y")
    assert fold([]) == "" and fold_numbers([5, 0, 1, 2]) == "0-2,5"


def test_report_is_a_table_on_a_terminal():
    import io

    from ftbundle.check.report import print_report

    class Tty(io.StringIO):
        def isatty(self):
            return True

    fs = [facts("node0"), facts("node1", 1, versions={"python": "3.11.7", "torch": "[odd]"})]
    out = Tty()
    print_report(CheckReport([R.check_runtime(fs, docker=False)], title="t"), out)
    text = out.getvalue()
    assert "┃" in text or "│" in text  # a table, not plain lines
    assert "torch=[odd]" in text and "FAIL" not in text.split("versions differ")[0]


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


def test_slow_warnings():
    warnings = N.slow_warnings({"node1": 18.5, "node2": 0.9}, "node0", 5.49, 10)
    assert len(warnings) == 2 and warnings[0].startswith("node2 -> node0: 0.90 Gbit/s is under 10 Gbit/s")
    assert "bus bandwidth 5.49" in warnings[1]
    assert N.slow_warnings({"node1": 18.5}, "node0", None, 10) == []


def test_bench_plan_is_the_jobs_own_plan_running_the_bench(tmp_path):
    layout = layout_of(tmp_path, nproc_per_node=2, master_port=29600, env={"GLOO_SOCKET_IFNAME": "eth0"},
                       runtime={"python": "/opt/venv/bin/python"},
                       train={"llamafactory": {"model_name_or_path": "org/model", "dataset": "x", "output_dir": "/shared/o"}})
    plan = make_plan(layout)
    bench = N.bench_plan(plan, size_mib=4, iters=3)
    assert bench.run_dir.startswith("/shared/runs/j-netcheck-") and bench.files == {}
    node = bench.nodes[1]
    assert node.argv[:4] == ("timeout", "-k", "5", str(N.BENCH_LIMIT_S))
    assert node.argv[4:7] == ("/opt/venv/bin/python", "-m", "torch.distributed.run")
    assert f"{bench.run_dir}/ftb_allreduce_bench.py" in node.argv
    assert node.argv[-8:] == ("--size-mib", "4", "--iters", "3", "--timeout", "60", "--out",
                              f"{bench.run_dir}/allreduce.json")
    assert node.env["GLOO_SOCKET_IFNAME"] == "eth0" and node.env["MASTER_PORT"] == "29600"
    assert node.env["FTB_RUN_DIR"] == bench.run_dir and node.log_path.startswith(bench.run_dir)
    assert bench.nproc_per_node == 2 and bench.master_addr == "10.0.0.10"
    assert "ftb-allreduce" in N.bench_source()
    per_node = make_plan(layout_of(tmp_path, train={"command": "echo hi"}))
    assert N.bench_plan(per_node).nodes[0].argv[4:7] == ("python3", "-m", "torch.distributed.run")


def test_sentinel_cleanup_is_one_rm_on_rank0_when_shared_else_on_every_writer(tmp_path):
    from ftbundle.check import sentinel_cleanup

    layout = layout_of(tmp_path, 2, train={"llamafactory": {"model_name_or_path": "org/model", "output_dir": "/shared/saves/a"}})
    ok = {"shared_dir": Storage("/shared", exists=True, written=True, seen=(0, 1), where="/shared"),
          "output_dir": Storage("/shared/saves/a", written=True, seen=(0, 1), where="/shared/saves")}
    jobs = sentinel_cleanup(layout, ClusterFacts([facts("node0", storage=ok), facts("node1", 1, storage=ok)], "t9"))
    assert [(h.name, dirs) for h, dirs in jobs] == [
        ("node0", ["/shared/.ftb-check-t9", "/shared/saves/.ftb-check-t9"])]
    alone = {"shared_dir": Storage("/shared", exists=True, written=True, seen=(0,), where="/shared")}
    jobs = sentinel_cleanup(layout, ClusterFacts([facts("node0", storage=alone), facts("node1", 1, storage=alone)],
                                                 "t9"))
    assert sorted(h.name for h, _ in jobs) == ["node0", "node1"]
    assert sentinel_cleanup(layout, ClusterFacts([facts("node0")], None)) == []


def test_versions_without_site_agree_with_the_full_interpreter(tmp_path):
    """The probe asks the job's interpreter for package versions with -S (no .pth files: 25 ms
    of a large venv's 33 ms start) and finds site-packages as site.py does; what it reports
    equals the interpreter's full view: the job's venv, a venv with system site packages, and
    a directory only a .pth file adds (the fallback to the plain run)."""
    import subprocess

    from ftbundle.remote import probe

    def ask(python, packages):
        out = {}
        probe.versions({"python": str(python), "packages": packages}, out)
        full = subprocess.run([str(python), "-c", probe.VERSIONS_PY, *packages], capture_output=True, text=True)
        answer = json.loads(full.stdout)
        assert answer.pop("_basis") and "_basis" not in out.get("versions", {})
        return out.get("versions"), answer

    fast, full = ask(sys.executable, ["torch", "transformers", "llamafactory", "pyyaml"])
    assert fast == full and "absent" not in fast.values()

    def dist(where: Path, name: str, version: str) -> None:
        meta = where / f"{name}-{version}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")

    def no_site(python, package):
        return json.loads(subprocess.run([str(python), "-S", "-c", probe.VERSIONS_PY, "--no-site", package],
                                         capture_output=True, text=True).stdout)[package]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = next(venv.glob("lib/python3*/site-packages"))
    dist(site_packages, "inthevenv", "0.4")
    assert no_site(python, "inthevenv") == "0.4"  # the venv's site-packages, found without site.py
    fast, full = ask(python, ["inthevenv", "pip", "torch"])  # pip, torch: the base's, if it has them
    assert fast == full and fast["inthevenv"] == "0.4", (fast, full)

    extra = tmp_path / "extra"
    dist(extra, "onlyviapth", "1.2.3")
    (site_packages / "extra.pth").write_text(str(extra) + "\n")
    assert no_site(python, "onlyviapth") == "absent"  # -S alone misses it ...
    fast, full = ask(python, ["onlyviapth", "inthevenv"])
    assert fast == full and fast["onlyviapth"] == "1.2.3"  # ... the probe does not


def test_versions_are_kept_on_the_host_until_a_package_changes(tmp_path, monkeypatch):
    """The probe keeps what the job's interpreter said (its start is most of a probe's CPU)
    and asks it again only when something it was based on changed: a package installed,
    upgraded or removed. Not in a cache directory that others can write."""
    import subprocess
    import time

    from ftbundle.remote import probe, probe_files

    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setattr(probe_files, "CACHE_ROOT", str(root))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = next(venv.glob("lib/python3*/site-packages"))

    def dist(name: str, version: str) -> Path:
        meta = site_packages / f"{name}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        return meta

    starts = tmp_path / "starts"
    python = tmp_path / "python"  # the job's interpreter, counting its starts
    python.write_text(f'#!/bin/sh\necho >> {starts}\nexec {venv}/bin/python "$@"\n')
    python.chmod(0o755)

    def ask() -> tuple[dict, int]:
        out = {}
        probe.versions({"python": str(python), "packages": ["pkga", "pkgb"]}, out)
        return out["versions"], len(starts.read_text().splitlines()) if starts.exists() else 0

    old = dist("pkga", "1.0")
    time.sleep(1.1)  # (a change less than 1 s old is not trusted to a stamp: coarse timestamps)
    first, n = ask()
    assert first["pkga"] == "1.0" and first["pkgb"] == "absent" and n >= 1
    assert ask() == (first, n)  # kept: the interpreter was not started again
    assert [p.name for p in (root / f"ftbundle-{os.getuid()}").iterdir()] != []

    old.rename(site_packages / "pkga-1.1.dist-info")  # upgraded
    (site_packages / "pkga-1.1.dist-info" / "METADATA").write_text("Name: pkga\nVersion: 1.1\n")
    got, m = ask()
    assert got["pkga"] == "1.1" and m > n
    dist("pkgb", "2.0")  # installed
    got, n = ask()
    assert got == {**first, "pkga": "1.1", "pkgb": "2.0"}
    time.sleep(1.1)
    assert ask()[0] == got and ask()[1] == n + 1  # the first asks, the second is kept

    (root / f"ftbundle-{os.getuid()}").chmod(0o777)  # open to others: not trusted
    (_, a), (_, b) = ask(), ask()
    assert b == a + 1 == n + 3


@pytest.mark.parametrize("n", [2, 40])
def test_status_folds_nodes_by_state(n):
    """`ftbundle status`: a row per node for a small run; beyond 16 nodes, rows only for the
    nodes that are not fine; at every size the nodes grouped by state as ranges."""
    from ftbundle.plan import NodePlan
    from ftbundle.runs import RunRef, format_status

    nodes = tuple(NodePlan(rank=r, host=Host(f"gpu{r:02d}", f"10.0.0.{r}"), program=("true",), env={}, workdir="/w",
                           log_path=f"/s/node-{r}.log", env_file=None) for r in range(n))
    ref = RunRef("r1", "/s/runs/r1", {"nnodes": n, "nproc_per_node": 1}, nodes, 1)
    states = [(node, "exited 4" if node.rank == 1 else "running", "last line") for node in nodes]
    lines = format_status(ref, states)
    rows = [line for line in lines if line.startswith("  node rank")]
    if n == 2:
        assert len(rows) == 2 and lines[-1] == "nodes: running gpu00 (node rank 0); exited 4 gpu01 (node rank 1)"
    else:
        assert rows == ["  node rank 1   gpu01                exited 4     last line"]
        assert lines[-1] == f"nodes: running gpu[00,02-{n - 1}] (node ranks 0,2-{n - 1}); exited 4 gpu01 (node rank 1)"


def test_probe_waits_grow_with_the_hosts_and_a_timeout_is_named(tmp_path):
    """The probe's waits account for the spread of n probes' starts; an expired wait says it
    was one, and for how long, not 'no route' or a bare error."""
    from ftbundle import check as C
    from ftbundle.check import scale_s
    from ftbundle.remote import probe

    assert scale_s(2) == 0 and scale_s(16) == 2.0 and scale_s(256) == 32.0
    layout = layout_of(tmp_path, 16)
    spec = C.probe_spec(layout, 1, token="t", expect=list(range(16)), port_peers=15)
    assert spec["sentinel_wait_s"] == C.SENTINEL_WAIT_S + 2 and spec["port"]["connect_s"] == C.CONNECT_S + 2
    closed = free_port()  # (nobody listens on it)
    answer = probe.connect("127.0.0.1", closed, 0.3)
    assert answer["reachable"] is False and answer["error"] == "Connection refused; kept trying for 0.3 s"


def test_what_the_job_asks_of_the_hosts_is_checked_before_anything_starts(tmp_path):
    """bf16 where no GPU can run it, more CPU ranks than cores, a script or a model path
    missing on a host: each was found only when every rank failed on it."""
    h100, v100 = smi("h100-x8.csv"), smi("v100-x8.csv")
    bf16 = {"llamafactory": {"model_name_or_path": "/shared/m", "bf16": True}}
    cpu_hosts = [facts("node0", cpus=2), facts("node1", 1, cpus=2)]
    c = R.check_training(cpu_hosts, layout_of(tmp_path, train=bf16))
    assert c.failure == "the job does not fit the hosts"
    assert c.details == ["bf16: true in train.llamafactory (inline), but node[0-1] has no GPU for the job: "
                         "set bf16: false (a CPU job: use_cpu: true)"]
    old = R.check_training([facts("node0", gpus=v100), facts("node1", 1, gpus=v100)],
                           layout_of(tmp_path, nproc_per_node=8, train=bf16))
    assert "the GPUs of node[0-1] cannot do bf16 (compute capability below 8.0" in old.details[0]
    assert R.check_training([facts("node0", gpus=h100), facts("node1", 1, gpus=h100)],
                            layout_of(tmp_path, nproc_per_node=8, train=bf16)) is None  # a healthy fleet: nothing
    many = R.check_training(cpu_hosts, layout_of(tmp_path, nproc_per_node=1024))
    assert many.details == ["1024 CPU rank(s) on node[0-1], which have 2 core(s): each rank would get a fraction "
                            "of one; set nproc_per_node (or ftb_nproc_per_node) to at most 2"]
    assert R.check_training(cpu_hosts, layout_of(tmp_path, nproc_per_node=2)) is None
    # the files the job names, on the hosts (relative to the workdir, which is shared_dir here)
    layout = layout_of(tmp_path, train={"script": "train.py"})
    assert R.job_paths(layout) == {"train.script": "/shared/train.py"}
    missing = R.check_training([facts("node0", cpus=2, paths={"train.script": None}),
                                facts("node1", 1, cpus=2, paths={"train.script": "No such file or directory"})], layout)
    assert missing.details == ["train.script /shared/train.py on node1: No such file or directory"]
    model = layout_of(tmp_path, train={"llamafactory": {"model_name_or_path": "./models/m"}})
    assert R.job_paths(model) == {"model_name_or_path": "/shared/models/m"}
    hub = layout_of(tmp_path, train={"llamafactory": {"model_name_or_path": "Qwen/Qwen2.5-7B"}})
    assert R.job_paths(hub) == {}  # a hub id is not a path to look for
    docker = layout_of(tmp_path, runtime={"kind": "docker", "image": "r/t@sha256:" + "a" * 64},
                       train={"script": "/app/train.py"})
    assert R.job_paths(docker) == {}  # in the image, perhaps: not the host's to judge


def test_ftb_gpus_naming_a_gpu_its_host_does_not_have_is_refused_naming_it(tmp_path):
    """ftb_gpus "0,1" on a host without GPUs was kept as "0,1" (issue 45): CUDA ends the list at
    the first entry that names no device, so the ranks saw fewer GPUs than the inventory says, or none."""
    h100 = smi("h100-x8.csv")
    job = job_of(tmp_path, nproc_per_node=2)
    nodes = [Host("node0", "10.0.0.10", vars={"ftb_gpus": "6,7"}), Host("node1", "10.0.0.11", vars={"ftb_gpus": "0,1"}),
             Host("node2", "10.0.0.12", vars={"ftb_gpus": "7,9"})]
    layout = make_layout(job, nodes, "r1")
    check = R.check_gpus([facts("node0", gpus=h100), facts("node1", 1, cpus=8), facts("node2", 2, gpus=h100)],
                         layout, 2)
    assert not check.ok
    details = " | ".join(check.details)
    assert "ftb_gpus of node1 is 0,1 but node1 has no GPU: '0' names no GPU there (its ranks would see 0 of the 2)" \
        in details, details
    assert "ftb_gpus of node2 is 7,9 but node2 has GPUs 0,1,2,3,4,5,6,7: '9' names no GPU there (its ranks would see " \
           "1 of the 2)" in details, details
    assert "ftb_gpus of node0" not in details


def test_hosts_with_another_llamafactory_than_the_judge_are_warned_not_refused():
    """The config is judged by the bundled LlamaFactory declarations (ftbundle/lfargs) before the
    hosts are asked; hosts running another LlamaFactory are said (issue 45: warn, not refuse)."""
    from ftbundle.lfargs import schema

    judged = schema()["llamafactory"]
    same = R.check_runtime([facts("node0"), facts("node1", 1)], docker=False, mode="llamafactory")
    assert same.ok and same.warnings == [] and judged == "0.9.5"
    newer = {"python": "3.11.7", "torch": "2.14.1", "transformers": "5.6.0", "llamafactory": "0.9.6"}
    both = R.check_runtime([facts("node0", versions=newer), facts("node1", 1, versions=newer)], docker=False,
                           mode="llamafactory")
    assert both.ok, both
    assert both.warnings == [f"LlamaFactory 0.9.6 on node[0-1]: the config was judged by LlamaFactory {judged}'s "
                             "declarations before the start (a key added or changed since may be judged wrongly); "
                             "`python -m ftbundle.lfargs --write` with the hosts' LlamaFactory installed here judges "
                             "by theirs"], both.warnings
    script = R.check_runtime([facts("node0", versions=newer)], docker=False, mode="script")
    assert script.warnings == []


def test_output_dir_that_no_run_could_write_fails_the_check_but_a_containers_permission_is_not_judged():
    """The probe's sentinel under output_dir (or its nearest parent) is written as the SSH user:
    a file in the way or a kernel file system fails for anyone; a permission the SSH user lacks
    fails the host runtime, not the docker runtime (its ranks write as the container's user)."""
    from ftbundle.check.storage_rules import check_output_dir

    def host(name, rank, written, where, error=None):
        return facts(name, rank, storage={"output_dir": Storage("/s/out", written=written, where=where, error=error)})

    fine = [host("node0", 0, True, "/s"), host("node1", 1, True, "/s")]
    assert check_output_dir(fine, "/s/out") is None
    denied = [host("node0", 0, True, "/s"), host("node1", 1, False, "/s", "Permission denied")]
    check = check_output_dir(denied, "/s/out")
    assert check is not None and not check.ok and check.details[0] == "node1: /s: Permission denied", check
    assert check_output_dir(denied, "/s/out", docker=True) is None
    filed = [host("node0", 0, False, "/s/out", "a file, not a directory")]
    assert check_output_dir(filed, "/s/out", docker=True).details[0] == "node0: /s/out: a file, not a directory"
    proc = [host("node0", 0, False, "/proc", "No such file or directory")]
    assert "node0: /proc is a kernel file system" in check_output_dir(proc, "/proc/x/out").details[0]


def test_rank_0_tries_the_port_only_for_the_run_that_holds_the_claim(tmp_path):
    """claims.py's words: "held" is what this run now holds, "taken" what other runs hold. The
    run that holds the claim tries the master port (its check keeps the master_port line); the
    one refused for the claim does not bind it (the other's listener would be in its way)."""
    from ftbundle.remote.probe import claim_then_port

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    spec = {"claim": {"dir": str(tmp_path / "claims"), "run": "run-a", "keys": [f"port-{port}"], "grace_s": 60},
            "port": {"role": "listen", "port": port, "peers": 0}}
    first: dict = {}
    claim_then_port(spec, first)
    assert first["claim"]["held"] == [f"port-{port}"] and first["port"] == {"role": "listen", "accepted": []}
    second: dict = {}
    claim_then_port({**spec, "claim": {**spec["claim"], "run": "run-b"}}, second)
    assert second["claim"]["taken"] and second["claim"]["taken"][0]["run"] == "run-a" and "port" not in second
