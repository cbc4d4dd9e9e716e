"""`ftbundle export --to slurm` on a Slurm that enforces GPUs and cores (tests/support/slurm.py,
``SlurmCluster(gpus=2)``: GRES gpu:2 on mknod'd /dev/nvidia0-1, task/cgroup with
ConstrainDevices and ConstrainCores), one cluster for the module:

- a GPU job's ranks see CUDA_VISIBLE_DEVICES, may open exactly the devices they asked for
  (ENXIO: allowed, no driver) and no other (EPERM), and run on all of the node's cores;
- `--gres` and `gpus_per_node: 1` give one device per node, the other refused;
- more GPUs than a node has: the export warns, Slurm refuses the script;
- a CPU job (`gpus_per_node: 0`) with `--cpus-per-node 1` gets no GPU and one core;
- the same job through `ftbundle run` over SSH and through the export: every rank sees the
  same rank variables, job env and NCCL env, except the values listed in MUST_DIFFER.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from tests.support.helpers import ftbundle
from tests.support.slurm import SlurmCluster, ensure_slurm_image

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
# Each rank: what it sees, and what the kernel lets it open. No torch import: fast.
PROBE = """\
import errno, json, os, socket, sys
seen = {k: v for k, v in os.environ.items()
        if k in sys.argv[1].split(",") or k.startswith("NCCL_")}
devices = {}
for i in range(2):
    try:
        os.close(os.open(f"/dev/nvidia{i}", os.O_RDWR))
        devices[i] = "opened"
    except OSError as exc:
        devices[i] = errno.errorcode[exc.errno]
with open(os.path.join(os.environ["OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": seen, "devices": devices, "cores": len(os.sched_getaffinity(0)),
               "host": socket.gethostname()}, f)
"""
RANK_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
             "FTB_RUN_ID", "FTB_RUN_DIR", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "JOB_VALUE", "GLOO_SOCKET_IFNAME"]
# What must differ between `ftbundle run` over SSH and the Slurm export, and why:
MUST_DIFFER = {
    "MASTER_ADDR",  # SSH: the inventory's address of the first host (an IP); Slurm: its node name
    "FTB_RUN_ID", "FTB_RUN_DIR",  # two runs, two run ids
}
NCCL_ENV = "NCCL_SOCKET_IFNAME=eth0\nNCCL_IB_DISABLE=1\n"


@pytest.fixture(scope="module")
def slurm(docker_engine):
    shared = Path(tempfile.mkdtemp(prefix="ftb-slurm-gpu-", dir="/tmp"))
    cluster = SlurmCluster(shared_dir=shared, image=ensure_slurm_image(), gpus=2).up()
    for name in ("node1", "node2"):  # the NCCL env file site.yml writes on every host
        cluster.cluster.exec(name, "mkdir -p /etc/ftbundle && cat > /etc/ftbundle/nccl.env", input=NCCL_ENV)
    yield cluster
    cluster.down()
    shutil.rmtree(shared, ignore_errors=True)


def probe_job(slurm: SlurmCluster, tmp_path: Path, name: str, **extra) -> tuple[Path, Path]:
    """A 2-rank-per-node job running PROBE; (job file, its output directory)."""
    work = slurm.shared_dir / name
    (work / "out").mkdir(parents=True)
    (work / "probe.py").write_text(PROBE)
    job = {"name": name, "nproc_per_node": 2, "master_port": random.randint(20000, 29000),
           "shared_dir": str(slurm.shared_dir), "workdir": str(work),
           "env": {"OUT": str(work / "out"), "OMP_NUM_THREADS": 1, "JOB_VALUE": "it's $(not run) `x`",
                   "GLOO_SOCKET_IFNAME": "eth0"},
           "runtime": {"kind": "host", "python": sys.executable},
           "train": {"script": "probe.py", "args": [",".join(RANK_VARS)]}, **extra}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml", work / "out"


def submit(slurm: SlurmCluster, job: Path, out: Path, *args: str) -> dict[int, dict]:
    script = out.parent / "job.sbatch"
    assert main(["export", str(job), "--to", "slurm", "--nodes", "2", "-o", str(script), *args]) == 0
    job_id, rc = slurm.sbatch(script, wait=True, timeout=300)
    log = next(slurm.shared_dir.glob(f"slurm-*-{job_id}.out")).read_text()
    assert rc == 0, log + slurm.logs()
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1, 2, 3], log
    return ranks


def test_gpu_job_sees_and_may_open_exactly_its_gpus_on_all_cores(slurm, tmp_path, capsys):
    job, out = probe_job(slurm, tmp_path, "gpu-all")
    ranks = submit(slurm, job, out, "--node-gpus", "2")
    err = capsys.readouterr().err
    assert "warning" not in err and "2 GPU(s), all cores (exclusive node), all memory per node" in err
    text = (out.parent / "job.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=2" in text and "#SBATCH --exclusive" in text and "#SBATCH --mem=0" in text
    for r in ranks.values():
        assert r["env"]["CUDA_VISIBLE_DEVICES"] == "0,1", r
        assert r["devices"] == {"0": "ENXIO", "1": "ENXIO"}, r  # allowed (no driver behind them)
        assert r["cores"] == 2, r  # the node's two cores, not the one Slurm pins a task to by default
    assert {r["host"] for r in ranks.values()} == {"node1", "node2"}


def test_one_gpu_per_node_by_gres_refuses_the_other_device(slurm, tmp_path):
    job, out = probe_job(slurm, tmp_path, "gpu-one", gpus_per_node=1)
    ranks = submit(slurm, job, out, "--gres")
    assert "#SBATCH --gres=gpu:1" in (out.parent / "job.sbatch").read_text()
    for r in ranks.values():
        assert r["env"]["CUDA_VISIBLE_DEVICES"] == "0", r  # Slurm renumbers what it gives
        assert sorted(r["devices"].values()) == ["ENXIO", "EPERM"], r  # one allowed, one refused


def test_more_gpus_than_a_node_has_warns_and_slurm_refuses(slurm, tmp_path, capsys):
    job, out = probe_job(slurm, tmp_path, "gpu-three", gpus_per_node=3)
    script = out.parent / "job.sbatch"
    assert main(["export", str(job), "--to", "slurm", "--nodes", "2", "--node-gpus", "2", "-o", str(script)]) == 0
    err = capsys.readouterr().err
    assert "warning: the job asks for 3 GPU(s) per node but the nodes have 2" in err, err
    assert "# warning: the job asks for 3 GPU(s)" in script.read_text()
    p = slurm.run("sbatch", "--parsable", str(script), check=False)
    assert p.returncode != 0 and "Requested node configuration is not available" in p.stderr, p.stderr + p.stdout


def test_cpu_job_gets_no_gpu_and_the_cores_it_asks_for(slurm, tmp_path):
    job, out = probe_job(slurm, tmp_path, "cpu-shared", gpus_per_node=0)
    ranks = submit(slurm, job, out, "--cpus-per-node", "1")
    text = (out.parent / "job.sbatch").read_text()
    assert "--gpus" not in text and "--gres" not in text and "--exclusive" not in text
    for r in ranks.values():
        # the script exports it empty, as `ftbundle run` gives a CPU job, but Slurm clears it for a
        # task given no GPU: there the cgroup is what refuses the devices (next line)
        assert "CUDA_VISIBLE_DEVICES" not in r["env"], r
        assert r["devices"] == {"0": "EPERM", "1": "EPERM"}, r
        assert r["cores"] == 1, r


def test_ssh_run_and_slurm_export_give_every_rank_the_same_view(slurm, tmp_path):
    inventory = slurm.cluster.write_inventory(tmp_path / "hosts.yml")
    (tmp_path / "ssh").mkdir()
    job, out = probe_job(slurm, tmp_path / "ssh", "same-view", gpus_per_node=0, inventory=str(inventory),
                         hosts="node1:node2", check=False)
    p = ftbundle("run", str(job), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    by_ssh = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    assert sorted(by_ssh) == [0, 1, 2, 3], p.stderr
    for f in out.glob("rank*.json"):
        f.unlink()
    by_slurm = submit(slurm, job, out)

    for rank in range(4):
        ssh_env, slurm_env = by_ssh[rank]["env"], by_slurm[rank]["env"]
        assert by_ssh[rank]["host"] == by_slurm[rank]["host"] == f"node{rank // 2 + 1}"
        assert ssh_env["NCCL_SOCKET_IFNAME"] == "eth0" and ssh_env["NCCL_IB_DISABLE"] == "1"  # the hosts' file
        assert ssh_env["JOB_VALUE"] == "it's $(not run) `x`"
        differ = {k for k in ssh_env.keys() | slurm_env.keys() if ssh_env.get(k) != slurm_env.get(k)}
        assert differ == MUST_DIFFER | {"CUDA_VISIBLE_DEVICES"}, {k: (ssh_env.get(k), slurm_env.get(k)) for k in differ}
        # a CPU job (gpus_per_node: 0): over SSH the empty value is what hides the GPUs; Slurm clears
        # the variable for a task given none, and its cgroup refuses the devices instead
        assert ssh_env["CUDA_VISIBLE_DEVICES"] == "" and "CUDA_VISIBLE_DEVICES" not in slurm_env
    assert by_ssh[0]["env"]["MASTER_ADDR"] == slurm.cluster.host("node1").ip
    assert by_slurm[0]["env"]["MASTER_ADDR"] == "node1"
