"""`ftbundle export` of nodes that run different numbers of ranks (issue 36: an inventory
host var ``ftb_nproc_per_node``): every target says what it can express, never a silently
uniform file.

- Slurm: a heterogeneous job, one component per run of alike nodes (`#SBATCH hetjob`), each
  started by its own `srun --het-group=K`; run for real on the containerized Slurm
  (tests/slurm.py): 2 nodes with 2 and 1 gloo ranks, world size 3, ranks 0..2 once each;
- PBS: one chunk per count in `select` (Torque: `nodes=...+...`); the script's body runs as PBS
  would run it, with a $PBS_NODEFILE of two containerized SSH hosts (tests/cluster.py);
- PyTorchJob and TrainJob (one nprocPerNode for every pod): exit 2 naming the counts.
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
from ftbundle.commands.export import export
from ftbundle.errors import UserError

REPO = Path(__file__).resolve().parent.parent

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


def write_job(tmp_path: Path, counts: list[int | None], nproc: int = 2, gpus=None, **extra) -> Path:
    """A job whose inventory gives host i the count ``counts[i]`` (None: the job's)."""
    hosts = {f"h{i}": ({"ftb_nproc_per_node": c} if c is not None else {}) for i, c in enumerate(counts)}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    job = {"name": "uneven", "inventory": "hosts.yml", "nproc_per_node": nproc, "shared_dir": "/shared/ftb",
           "runtime": {"kind": "host", "python": "/opt/venv/bin/python"}, "train": {"script": "train.py"},
           **({"gpus_per_node": gpus} if gpus is not None else {}), **extra}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.fixture(scope="module")
def shellcheck() -> str:
    p = subprocess.run(["bash", str(REPO / ".ci" / "shellcheck.sh")], capture_output=True, text=True, check=True)
    return p.stdout.strip().splitlines()[-1]


def assert_shellcheck(shellcheck: str, text: str, tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text(text)
    subprocess.run([shellcheck, str(script)], check=True)


# ---------------------------------------------------------------------------------------
# what each target writes (pure)


@pytest.mark.parametrize("to,field", [("k8s", "nprocPerNode"), ("trainjob", "numProcPerNode")])
def test_kubeflow_targets_refuse_uneven_nodes_naming_the_counts(tmp_path, capsys, to, field):
    job = write_job(tmp_path, [8, 8, 4], nproc=8, runtime={"kind": "docker", "image": "r/t@sha256:" + "a" * 64})
    with pytest.raises(UserError) as err:
        export(str(job), to=to)
    text = str(err.value)
    assert "8 on node0, 8 on node1, 4 on node2" in text and f"--to {to} cannot say so" in text
    assert field in text and "--to slurm" in text and "--to pbs" in text
    assert main(["export", str(job), "--to", to]) == 2 and capsys.readouterr().out == ""
    # alike nodes still export
    assert export(str(write_job(tmp_path, [8, 8], nproc=4, runtime={"kind": "docker", "image": "r/t@sha256:" + "a" * 64})),
                  to=to)[0]


def test_slurm_writes_a_heterogeneous_job_in_node_rank_order(tmp_path, shellcheck):
    text, _, _ = export(str(write_job(tmp_path, [8, 8, 4], nproc=8)), to="slurm", partition="gpu", time="1:00:00")
    assert text.count("#SBATCH hetjob") == 1
    head, first = text.split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8" in head
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4" in first
    # each component is asked for where and how long; the job-wide options come once, before
    assert head.count("--partition=gpu") == first.count("--partition=gpu") == 1
    assert first.count("--time=1:00:00") == 1 and "--requeue" in head and "--requeue" not in first
    assert "# 3 node(s) with 8+8+4 rank(s)" in text
    assert "hetjob component 0: 2 node(s) x 8 rank(s), --gpus-per-node=8" in text
    assert "hetjob component 1: 1 node(s) x 4 rank(s), --gpus-per-node=4" in text
    # one step per component: its own ranks, node ranks after the components before it
    assert "srun --het-group=0 --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 --cpus-per-task=\"${SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0%%[(,]*}\"" in text
    assert "srun --het-group=1 --kill-on-bad-exit=1 --nodes=1" in text
    assert "NODE_RANK=$((0 + SLURM_NODEID)) NPROC_PER_NODE=8" in text
    assert "NODE_RANK=$((2 + SLURM_NODEID)) NPROC_PER_NODE=4" in text
    assert "--nproc_per_node @FTB_NPROC@" in text and " NPROC_PER_NODE=8\n" not in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1"' in text
    assert "hetjob component 1 was written for 1 node(s) x 4 rank(s)" in text
    assert_shellcheck(shellcheck, text, tmp_path)


def test_slurm_uniform_nodes_are_one_component_as_before(tmp_path):
    text, _, _ = export(str(write_job(tmp_path, [None, 4], nproc=4)), to="slurm")
    assert "#SBATCH hetjob" not in text and "--het-group" not in text and "--nproc_per_node @FTB_NPROC@" not in text
    assert "NPROC_PER_NODE=4" in text and "--nproc_per_node 4 " in text
    assert "srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1" in text


def test_pbs_asks_one_chunk_per_count(tmp_path, shellcheck):
    job = write_job(tmp_path, [8, 8, 4], nproc=8)
    text, _, _ = export(str(job), to="pbs")
    assert "#PBS -l select=2:ncpus=8:ngpus=8:mpiprocs=1+1:ncpus=4:ngpus=4:mpiprocs=1" in text
    assert "FTB_NPROCS=(8 8 4)" in text and 'export NPROC_PER_NODE="${FTB_NPROCS[$rank]}"' in text
    assert "--nproc_per_node @FTB_NPROC@" in text
    torque, _, _ = export(str(job), to="pbs", torque=True, cpus_per_node="16")
    assert "#PBS -l nodes=2:ppn=16:gpus=8+1:ppn=16:gpus=4" in torque
    cpu, _, _ = export(str(write_job(tmp_path, [2, 1], gpus=0)), to="pbs", mem="8G")
    assert "#PBS -l select=1:ncpus=2:mem=8gb:mpiprocs=1+1:ncpus=1:mem=8gb:mpiprocs=1" in cpu
    assert_shellcheck(shellcheck, text, tmp_path)
    assert_shellcheck(shellcheck, export(str(job), to="pbs", launcher="ssh")[0], tmp_path)


def test_a_fixed_gpus_per_node_is_asked_of_every_node(tmp_path):
    """gpus_per_node: 8 with 8 and 4 ranks: the GPU request is alike, the ranks are not."""
    text, _, _ = export(str(write_job(tmp_path, [8, 4], nproc=8, gpus=8)), to="slurm")
    assert text.count("--gpus-per-node=8") >= 2 and "NPROC_PER_NODE=4" in text


def test_ftb_gpus_is_not_exported(tmp_path):
    """A host's ftb_gpus is its own: on a scheduler, each node's GPUs are the scheduler's."""
    job = write_job(tmp_path, [None, None], nproc=2)
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": {"h0": {"ftb_gpus": "2,3"}, "h1": {}}}}))
    text, warnings, _ = export(str(job), to="slurm")
    assert "export CUDA_VISIBLE_DEVICES" not in text and "2,3" not in text
    assert any("ftb_gpus of the inventory (node0) is not exported" in w for w in warnings)


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
    from tests.slurm import SlurmCluster, ensure_slurm_image

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
