"""`ftbundle export` of nodes that run different numbers of ranks (issue 36): what each target
writes (pure). Run for real on containerized hosts: tests/cluster/test_export_uneven.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.commands.export import export
from ftbundle.errors import UserError


REPO = Path(__file__).resolve().parents[2]


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
