"""`ftbundle export` of nodes that run different numbers of ranks (issue 36: an inventory
host var ``ftb_nproc_per_node``): every target says what it can express, never a silently
uniform file.

- Slurm: a heterogeneous job, one component per run of alike nodes (`#SBATCH hetjob`), each
  started by its own `srun --het-group=K`; run for real on the containerized Slurm
  (tests/support/slurm.py): 2 nodes with 2 and 1 gloo ranks, world size 3, ranks 0..2 once each;
- PBS: one chunk per count in `select` (Torque: `nodes=...+...`); the script's body runs as PBS
  would run it, with a $PBS_NODEFILE of two containerized SSH hosts (tests/support/cluster.py);
- PyTorchJob and TrainJob (one nprocPerNode for every pod): exit 2 naming the counts.

What each target writes (pure): tests/unit/test_export_uneven_unit.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main

REPO = Path(__file__).resolve().parents[2]

RANKS = """\
import json, os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
rank = dist.get_rank()
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world": dist.get_world_size(),
               "env_world": int(os.environ["WORLD_SIZE"]), "sum": t.item(),
               "node_rank": int(os.environ["NODE_RANK"]), "nproc": int(os.environ["NPROC_PER_NODE"]),
               "host": socket.gethostname()}, f)
dist.destroy_process_group()
"""


# ---------------------------------------------------------------------------------------
# run for real: Slurm (hetjob) and a PBS script's body over ssh


def ranks_job(shared: Path, name: str, job_file: Path, inventory: Path, counts: list[int]) -> Path:
    work = shared / name
    (work / "out").mkdir(parents=True)
    (work / "ranks.py").write_text(RANKS)
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {
        f"h{i}": {"ftb_nproc_per_node": c} for i, c in enumerate(counts)}}}))
    job_file.write_text(yaml.safe_dump({
        "name": name, "inventory": str(inventory), "nproc_per_node": 1, "gpus_per_node": 0,
        "master_port": random.randint(20000, 29000), "shared_dir": str(shared), "workdir": str(work),
        "env": {"GLOO_SOCKET_IFNAME": "eth0", "OUT": str(work / "out"), "OMP_NUM_THREADS": 1},
        "runtime": {"kind": "host", "python": sys.executable}, "train": {"script": "ranks.py"}}))
    return work


def assert_ranks(work: Path, hosts_by_node: dict[int, str] | None = None, log: str = "") -> None:
    ranks = [json.loads(p.read_text()) for p in sorted((work / "out").glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2], log
    assert {r["world"] for r in ranks} == {r["env_world"] for r in ranks} == {3}
    assert {r["sum"] for r in ranks} == {3.0}  # 0 + 1 + 2, every rank in one all_reduce
    by_rank = {r["rank"]: r for r in ranks}
    assert [(by_rank[i]["node_rank"], by_rank[i]["local_rank"], by_rank[i]["nproc"]) for i in range(3)] == \
        [(0, 0, 2), (0, 1, 2), (1, 0, 1)], ranks
    assert by_rank[0]["host"] == by_rank[1]["host"] != by_rank[2]["host"]
    if hosts_by_node:
        assert {r["node_rank"]: r["host"] for r in ranks} == hosts_by_node


@pytest.fixture(scope="module")
def slurm(docker_engine):
    from tests.support.slurm import SlurmCluster, ensure_slurm_image

    shared = Path(tempfile.mkdtemp(prefix="ftb-slurm-het-", dir="/tmp"))
    cluster = SlurmCluster(shared_dir=shared, image=ensure_slurm_image()).up()
    yield cluster
    cluster.down()
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.cluster
def test_slurm_hetjob_runs_two_and_one_ranks(slurm, tmp_path):
    work = ranks_job(slurm.shared_dir, "het", tmp_path / "job.yaml", tmp_path / "hosts.yml", [2, 1])
    script = work / "job.sbatch"
    assert main(["export", str(tmp_path / "job.yaml"), "--to", "slurm", "-o", str(script),
                 "--partition", "debug", "--time", "10:00"]) == 0
    p = subprocess.run(["docker", "exec", slurm.controller, "sbatch", "--parsable", "--wait", str(script)],
                       capture_output=True, text=True, timeout=600, check=False)
    job_id = p.stdout.strip().split(";")[0].split("+")[0]
    logs = [f.read_text() for f in slurm.shared_dir.glob(f"slurm-het-{job_id}*.out")]
    assert p.returncode == 0, p.stdout + p.stderr + "".join(logs) + slurm.logs()
    assert_ranks(work, {0: "node1", 1: "node2"}, "".join(logs))


@pytest.mark.cluster
def test_pbs_script_runs_two_and_one_ranks_from_the_nodefile(make_cluster, tmp_path):
    cluster = make_cluster(2)
    work = ranks_job(cluster.shared_dir, "pbs-het", tmp_path / "job.yaml", tmp_path / "hosts.yml", [2, 1])
    script = tmp_path / "job.pbs"
    assert main(["export", str(tmp_path / "job.yaml"), "--to", "pbs", "--launcher", "ssh", "-o", str(script)]) == 0
    assert "#PBS -l select=1:ncpus=2:mpiprocs=1+1:ncpus=1:mpiprocs=1" in script.read_text()
    # PBS Pro lists a host once per cpu of its chunk, chunks in order: 2 lines, then 1
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{cluster.hosts[0].ip}\n{cluster.hosts[0].ip}\n{cluster.hosts[1].ip}\n")
    ssh = " ".join(cluster.ssh_argv(cluster.hosts[0])[:-1])
    env = {"PATH": os.environ["PATH"], "PBS_NODEFILE": str(nodefile), "FTB_SSH": ssh}
    p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_ranks(work, {0: "node0", 1: "node1"}, p.stderr)
