"""`ftbundle export --to slurm` on a real Slurm: Debian's slurm-wlm and munge in containers
(tests/support/slurm.py: a controller and two compute nodes).

- the exported script passes shellcheck;
- `sbatch --wait` runs a 2-node gloo job: world size 4, node ranks 0 and 1, the job's
  secret taken from the submitting environment (never from the script);
- the quickstart LoRA runs through sbatch on 2 nodes, is requeued (`scontrol requeue`)
  after its first checkpoint, resumes from it, and writes the adapter.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.export.shell import NODE_PROGRAM
from tests.support.helpers import place_tiny_model
from tests.support.slurm import SlurmCluster, ensure_slurm_image

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"
SECRET = "hf_slurm_secret_value_42"

ALLREDUCE = """\
import json, os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rank = dist.get_rank()
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": dist.get_world_size(), "sum": t.item(),
               "node_rank": int(os.environ["NODE_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
               "host": socket.gethostname(), "secret_ok": os.environ.get("HF_TOKEN") == SECRET}, f)
dist.destroy_process_group()
""".replace("SECRET", repr(SECRET))


@pytest.fixture(scope="module")
def slurm(docker_engine):
    shared = Path(tempfile.mkdtemp(prefix="ftb-slurm-", dir="/tmp"))
    cluster = SlurmCluster(shared_dir=shared, image=ensure_slurm_image()).up()
    yield cluster
    cluster.down()
    shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="module")
def shellcheck() -> str:
    p = subprocess.run(["bash", str(REPO / ".ci" / "shellcheck.sh")], capture_output=True, text=True, check=True)
    return p.stdout.strip().splitlines()[-1]


def export(job: Path, out: Path, *args: str) -> str:
    assert main(["export", str(job), "--to", "slurm", "-o", str(out), *args]) == 0
    return out.read_text()


def sbatch_env(slurm: SlurmCluster, script: Path, *, wait: bool, timeout: float = 600) -> tuple[int, int]:
    """sbatch with the job's secret in the submitting environment, as a user would."""
    p = subprocess.run(["docker", "exec", "-e", f"HF_TOKEN={SECRET}", slurm.controller, "sbatch", "--parsable",
                        *(["--wait"] if wait else []), str(script)],
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.stdout.strip(), p.stderr
    return int(p.stdout.split(";")[0]), p.returncode


def gloo_job(shared: Path, name: str, job_file: Path) -> Path:
    """A 2-rank-per-node gloo all-reduce job (the secret in its env) writing one JSON per
    rank into ``<shared>/<name>/out``; the work directory."""
    work = shared / name
    (work / "out").mkdir(parents=True)
    (work / "allreduce.py").write_text(ALLREDUCE)
    job = {"name": name, "nproc_per_node": 2, "gpus_per_node": 0, "master_port": random.randint(20000, 29000),
           "shared_dir": str(shared), "workdir": str(work),
           "env": {"GLOO_SOCKET_IFNAME": "eth0", "OUT": str(work / "out"), "OMP_NUM_THREADS": 1,
                   "HF_TOKEN": SECRET},
           "runtime": {"kind": "host", "python": sys.executable},
           "train": {"script": "allreduce.py"}}
    job_file.write_text(yaml.safe_dump(job))
    return work


def test_gloo_job_on_two_nodes(slurm, shellcheck, tmp_path):
    shared = slurm.shared_dir
    work = gloo_job(shared, "gloo-check", tmp_path / "job.yaml")
    script = work / "job.sbatch"
    text = export(tmp_path / "job.yaml", script, "--nodes", "2", "--partition", "debug", "--time", "10:00")
    assert SECRET not in text
    subprocess.run([shellcheck, str(script)], check=True)

    job_id, rc = sbatch_env(slurm, script, wait=True)
    log = next(shared.glob(f"slurm-gloo-check-{job_id}.out")).read_text()
    assert rc == 0, log + slurm.logs()
    ranks = [json.loads(p.read_text()) for p in sorted((work / "out").glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], log
    assert {r["world"] for r in ranks} == {4} and {r["sum"] for r in ranks} == {4.0}
    assert {r["node_rank"] for r in ranks} == {0, 1}
    assert all(r["node_rank"] == r["group_rank"] == r["rank"] // 2 for r in ranks)
    assert {r["host"] for r in ranks} == {"node1", "node2"}
    assert all(r["secret_ok"] for r in ranks)
    assert SECRET not in log
    # what the nodes ran is a file in the run directory, readable after the job (no blob)
    staged = [p.read_text() for p in shared.glob("runs/*/ftb-node.sh")]
    assert staged and set(staged) == {NODE_PROGRAM + "\n"}, staged


@pytest.fixture(scope="module")
def quickstart_work(slurm) -> Path:
    """examples/quickstart's data and the tiny model, in a work directory on shared storage."""
    work = slurm.shared_dir / "quickstart"
    shutil.copytree(QUICKSTART / "data", work / "data")
    place_tiny_model(work / "tiny-llama")
    return work


@pytest.mark.train
def test_quickstart_lora_requeued_resumes_and_writes_the_adapter(slurm, quickstart_work, shellcheck, tmp_path):
    shared, work = slurm.shared_dir, quickstart_work
    train = yaml.safe_load((QUICKSTART / "train.yaml").read_text())
    output = work / "output" / "lora"
    train.update(model_name_or_path=str(work / "tiny-llama"), output_dir=str(output),
                 max_steps=30, save_steps=5)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    job = yaml.safe_load((QUICKSTART / "job.yaml").read_text())
    job.update(shared_dir=str(shared), workdir=str(work), master_port=random.randint(20000, 29000),
               runtime={"kind": "host", "python": sys.executable})
    job["env"]["GLOO_SOCKET_IFNAME"] = "eth0"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    script = work / "lora.sbatch"
    export(tmp_path / "job.yaml", script, "--nodes", "2")
    subprocess.run([shellcheck, str(script)], check=True)

    job_id, rc = sbatch_env(slurm, script, wait=False)
    assert rc == 0
    log_file = shared / f"slurm-quickstart-lora-{job_id}.out"

    def log() -> str:
        return log_file.read_text() if log_file.exists() else ""

    deadline = time.monotonic() + 300
    t0 = time.monotonic()
    while not (output / "checkpoint-5" / "trainer_state.json").exists():
        assert time.monotonic() < deadline, log() + slurm.logs()
        assert slurm.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), log() + slurm.logs()
        time.sleep(0.2)
    print(f"first checkpoint after {time.monotonic() - t0:.0f}s")
    slurm.run("scontrol", "requeue", str(job_id))
    # a requeued job becomes eligible only after a delay (BeginTime, about 3 minutes here);
    # an operator can start it at once, and so does the test, once it is back in the queue
    deadline = time.monotonic() + 60
    while slurm.job_state(job_id) != "PENDING":
        assert time.monotonic() < deadline, log() + slurm.logs()
        time.sleep(0.2)
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    t1 = time.monotonic()
    deadline = time.monotonic() + 400
    while (state := slurm.job_state(job_id)) != "COMPLETED":
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY"), \
            state + log() + slurm.logs()
        assert time.monotonic() < deadline, state + log() + slurm.logs()
        time.sleep(1)
    print(f"requeued run finished after {time.monotonic() - t1:.0f}s")
    text = log()
    assert "(restart 1)" in text, text
    assert "ftbundle: resuming from checkpoint-" in text, text
    assert "Resuming training from" in text, text  # LlamaFactory picked the checkpoint up
    assert (output / "adapter_model.safetensors").stat().st_size > 0
    state = json.loads((output / "trainer_state.json").read_text())
    assert state["global_step"] == 30


def test_usr1_before_the_time_limit_requeues_the_job(slurm, tmp_path):
    """What --signal=B:USR1@120 does near the time limit, sent by hand: the batch shell's
    trap puts the job back into the queue (Slurm counts a restart)."""
    job = {"name": "usr1-requeue", "nproc_per_node": 1, "gpus_per_node": 0, "shared_dir": str(slurm.shared_dir),
           "train": {"command": "sleep 60"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    script = slurm.shared_dir / "usr1.sbatch"
    export(tmp_path / "job.yaml", script, "--nodes", "2")
    job_id, rc = sbatch_env(slurm, script, wait=False)
    assert rc == 0
    try:
        deadline = time.monotonic() + 60
        while slurm.job_state(job_id) != "RUNNING":
            assert time.monotonic() < deadline, slurm.logs()
            time.sleep(0.2)
        time.sleep(1)  # the batch shell is past its setup and waiting for srun
        slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))
        deadline = time.monotonic() + 60
        while "Restarts=1" not in slurm.run("scontrol", "show", "job", str(job_id)).stdout:
            assert time.monotonic() < deadline, slurm.logs()
            time.sleep(0.2)
        log = (slurm.shared_dir / f"slurm-usr1-requeue-{job_id}.out").read_text()
        assert f"ftbundle: requeueing job {job_id}" in log, log
    finally:
        slurm.run("scancel", str(job_id), check=False)
