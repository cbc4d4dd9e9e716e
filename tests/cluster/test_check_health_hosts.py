"""GPU health in the check on containerized hosts (issue 37, item 1): the nvidia-smi and dmesg
stand-ins on every host replay the real readings of an H100 (tests/data/nvidia-smi/README.md,
sample h100-health); a clean fleet passes, then two faults made from them by the documented
edits, on two hosts, are each named on their host and GPU, and the run is refused (exit 2,
nothing started), or only warned about with `health: warn`."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.helpers import ASSETS, base_job, ftbundle, job_processes, write_job

pytestmark = pytest.mark.cluster

SMI = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi"
SAMPLE = "h100-health"
UUID0 = "GPU-0e7e2459-5537-7ce0-d915-6c9a8d0e0338"  # the recorded H100's
UUID1 = "GPU-1e7e2459-5537-7ce0-d915-6c9a8d0e0338"  # node1's: the same reading, another UUID


def install(cluster, host, uuid: str) -> None:
    """The stand-ins and the real readings on ``host``, its GPU's UUID set to ``uuid``."""
    box = cluster.host(host).container
    cluster.exec(host, "mkdir -p /etc/ftb-smi")
    for f in SMI.glob(f"{SAMPLE}.*"):
        subprocess.run(["docker", "cp", str(f), f"{box}:/etc/ftb-smi/{f.name}"], check=True)
    subprocess.run(["docker", "cp", str(ASSETS / "nvidia-smi-replay"), f"{box}:/usr/bin/nvidia-smi"], check=True)
    subprocess.run(["docker", "cp", str(ASSETS / "dmesg-replay"), f"{box}:/usr/local/bin/dmesg"], check=True)
    cluster.exec(host, f"echo {SAMPLE} > /etc/ftb-smi/sample && sed -i s/{UUID0}/{uuid}/ /etc/ftb-smi/{SAMPLE}.*")


def test_two_planted_faults_are_named_on_their_hosts_and_gpus(make_cluster, tmp_path):
    cluster = make_cluster(2)
    install(cluster, "node0", UUID0)
    install(cluster, "node1", UUID1)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("health", cluster.shared_dir, inventory,
                                                    {"command": "echo started > $FTB_RUN_DIR/started-$NODE_RANK"}))

    clean = ftbundle("check", str(job), timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "1 GPU(s) healthy: node[0-1]" in clean.stdout
    assert "WARN" not in clean.stdout and "Xid events not read" not in clean.stdout

    # node0: a pending remap (refuses); node1: HW slowdown (warns) and an Xid 79 (refuses)
    cluster.exec("node0", f"sed -i '2s/, No, No, 0x/, Yes, No, 0x/' /etc/ftb-smi/{SAMPLE}.health.csv")
    cluster.exec("node1", f"sed -i '2s/0x0000000000000001/0x0000000000000008/' /etc/ftb-smi/{SAMPLE}.health.csv")
    cluster.exec("node1", "awk '{printf \"[%12.6f] NVRM: Xid (PCI:0000:00:06): 79, pid=2816, name=python3, "
                          "GPU has fallen off the bus.\\n\", $1 - 20}' /proc/uptime >> "
                          f"/etc/ftb-smi/{SAMPLE}.dmesg.txt")
    sick = ftbundle("check", str(job), timeout=120)
    assert sick.returncode == 2, sick.stdout + sick.stderr
    out = sick.stdout
    assert "FAIL GPUs unfit to run (health: refuse):" in out
    assert (f"- node0: GPU 0 ({UUID0}): row remapping pending: a bad memory row is remapped only at the next "
            "GPU reset: reset it") in out
    assert f"- node1: GPU 0 ({UUID1}): Xid 79 " in out and "GPU has fallen off the bus" in out
    assert (f"WARN node1: GPU 0 ({UUID1}): clock event reasons 0x8 (HW slowdown), SM 345 of 1980 MHz: "
            "the clocks are cut") in out
    assert "node0: GPU 0" not in out.split("WARN", 1)[-1]  # node0's only finding is its failure

    refused = ftbundle("run", str(job), timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert list(cluster.shared_dir.rglob("started-*")) == [] and job_processes(cluster) == {}

    warned = write_job(tmp_path / "warn.yaml", {**base_job("health", cluster.shared_dir, inventory,
                                                           {"command": "echo started > $FTB_RUN_DIR/started-$NODE_RANK"}),
                                                "health": "warn"})
    ran = ftbundle("run", str(warned), timeout=180)
    assert ran.returncode == 0, ran.stderr
    assert "row remapping pending" in ran.stderr + ran.stdout
    assert len(list(cluster.shared_dir.rglob("started-*"))) == 2


def xid_job(cluster, tmp_path, name: str) -> Path:
    """Two nodes with the stand-ins; node0's kernel logged an application's Xid 13 two hours
    ago (the check warns of it); in the run, node1's kernel logs an Xid 79 and its rank fails."""
    install(cluster, "node0", UUID0)
    install(cluster, "node1", UUID1)
    cluster.exec("node0", "awk '{printf \"[%12.6f] NVRM: Xid (PCI:0000:00:06): 13, Graphics Exception: ESR 0x50\\n\", "
                          f"($1 > 7200 ? $1 - 7200 : 0)}}' /proc/uptime >> /etc/ftb-smi/{SAMPLE}.dmesg.txt")
    fault = ("awk '{printf \"[%12.6f] NVRM: Xid (PCI:0000:00:06): 79, pid=2816, name=python3, GPU has fallen off "
             f"the bus.\\n\", $1}}' /proc/uptime >> /etc/ftb-smi/{SAMPLE}.dmesg.txt")
    return write_job(tmp_path / "job.yaml", base_job(name, cluster.shared_dir, inventory=cluster.write_inventory(
        tmp_path / "hosts.yml"), train={"command": f'if [ "$NODE_RANK" = 1 ]; then sleep 2; {fault}; '
                                                  'echo "CUDA error: unspecified launch failure" >&2; exit 3; fi; '
                                                  'sleep 60'}))


XID79_NAMED = (rf"node1: GPU 0 \({UUID1}\): Xid 79 \d+ s ago \(pid=2816, name=python3, GPU has fallen off the bus\.\): "
               r"GPU has fallen off the bus")


def test_a_gpu_fault_during_a_run_is_named_when_the_run_fails(make_cluster, tmp_path):
    """An Xid 79 that the kernel logs on node1 while the run goes on (its rank then fails) is
    named after the failure, on its host, GPU index and UUID, with a hint to reset or pull it;
    an Xid logged before the run (node0's application fault, warned by the check) is not."""
    cluster = make_cluster(2)
    job = xid_job(cluster, tmp_path, "xid-run")
    run = ftbundle("run", str(job), timeout=180)
    out = run.stdout + run.stderr
    assert run.returncode == 3, out
    assert re.search(r"warning: node0: GPU 0 \(\S+\): Xid 13 ", out.split("GPU faults")[0]), out  # (the check saw it)
    faults = out.split("GPU faults the kernel logged during the run (NVRM Xid):", 1)
    assert len(faults) == 2, out
    assert re.search(XID79_NAMED, faults[1]), out
    assert "Xid 13" not in faults[1] and "node0" not in faults[1].split("hint:")[0], out
    assert "hint: node1: a GPU there needs a reset or service before the next run" in faults[1], out
    assert "hint: a CUDA error that a GPU fault can cause" in faults[0], out
    [row] = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
    assert len(row["gpu_faults"]) == 1 and re.fullmatch(XID79_NAMED, row["gpu_faults"][0]), row  # (summary.json)


def test_a_detached_runs_gpu_fault_is_named_by_status(make_cluster, tmp_path):
    """A detached run has no launcher to read the kernel logs when it fails: each node's watcher
    keeps the Xid lines logged while its job ran (node-R.aN.xids), and `ftbundle status` names
    them as a failed attached run does; node0, whose only Xid is older than the run, has none."""
    cluster = make_cluster(2)
    job = xid_job(cluster, tmp_path, "xid-detached")
    started = ftbundle("run", "--detach", str(job), timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status = ftbundle("status", str(job), timeout=60)
        if "state: failed" in status.stdout and "GPU faults" in status.stdout:
            break
        time.sleep(1)
    out = status.stdout + status.stderr
    assert "state: failed" in out and status.returncode == 1, out
    faults = out.split("GPU faults the kernel logged during the run (NVRM Xid):", 1)
    assert len(faults) == 2 and re.search(XID79_NAMED, faults[1]), out
    assert "Xid 13" not in out and "hint: node1: a GPU there needs a reset or service" in faults[1], out
    kept = sorted(p.name for p in cluster.shared_dir.rglob("*.xids"))
    assert kept == ["node-1.a1.xids"], kept
    [row] = json.loads(ftbundle("runs", str(job), "--json", timeout=60).stdout)
    assert len(row["gpu_faults"]) == 1 and re.fullmatch(XID79_NAMED, row["gpu_faults"][0]), row  # (no summary.json)
