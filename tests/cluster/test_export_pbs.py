"""`ftbundle export --to pbs`: no PBS server can be installed here, so

- the qsub script's body runs as PBS would run it on the first node, with a $PBS_NODEFILE
  listing two containerized SSH hosts (tests/support/cluster.py), and launches a real 2-node gloo
  job over ssh (`--launcher ssh`);
- Debian's slurm-wlm-torque `qsub` (a wrapper that hands the script to sbatch, which reads
  the #PBS lines) runs the PBS Pro and the Torque script on a real 2-node Slurm: the
  directives parse, -V passes the submitting environment (the secret), and the nodes are
  started by srun (the wrapper gives no $PBS_NODEFILE and has no pbsdsh).
pbsdsh itself, PBS Pro's and Torque's own schedulers and MOMs were not run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from ftbundle.cli import main
from ftbundle.export.shell import NODE_PROGRAM
from tests.support.slurm import SlurmCluster, ensure_slurm_image
from tests.cluster.test_export_slurm import SECRET, gloo_job

pytestmark = pytest.mark.cluster


def test_pbs_script_runs_a_two_node_job_from_the_nodefile(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    work = gloo_job(shared, "pbs-gloo", tmp_path / "job.yaml")
    script = tmp_path / "job.pbs"
    assert main(["export", str(tmp_path / "job.yaml"), "--to", "pbs", "--nodes", "2", "--launcher", "ssh",
                 "-o", str(script)]) == 0
    text = script.read_text()
    assert SECRET not in text and "#PBS -l select=2:ncpus=2:mpiprocs=1" in text and "#PBS -V" in text
    shellcheck = subprocess.run(["bash", ".ci/shellcheck.sh"], capture_output=True, text=True, check=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout.split()[-1]
    subprocess.run([shellcheck, str(script)], check=True)

    # PBS lists a host once per slot; the script launches once per host, in file order
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{h.ip}\n{h.ip}\n" for h in cluster.hosts))
    ssh = " ".join(cluster.ssh_argv(cluster.hosts[0])[:-1])
    env = {"PATH": os.environ["PATH"], "PBS_NODEFILE": str(nodefile), "FTB_SSH": ssh, "HF_TOKEN": SECRET}
    p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    ranks = [json.loads(f.read_text()) for f in sorted((work / "out").glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], p.stderr
    assert {r["world"] for r in ranks} == {4} and {r["sum"] for r in ranks} == {4.0}
    assert all(r["node_rank"] == r["group_rank"] == r["rank"] // 2 for r in ranks)
    assert {r["node_rank"]: r["host"] for r in ranks} == {0: "node0", 1: "node1"}
    assert all(r["secret_ok"] for r in ranks)
    assert (shared / "runs").is_dir() and SECRET not in p.stdout + p.stderr
    assert [f.read_text() for f in shared.glob("runs/*/ftb-node.sh")] == [NODE_PROGRAM + "\n"]


def test_pbs_script_refuses_a_nodefile_of_the_wrong_size(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "pbs-size", "nproc_per_node": 1, "shared_dir": str(tmp_path / "shared"),
        "train": {"command": "true"}}))
    script = tmp_path / "job.pbs"
    assert main(["export", str(tmp_path / "job.yaml"), "--to", "pbs", "--nodes", "3", "-o", str(script)]) == 0
    (tmp_path / "nodefile").write_text("a\nb\n")
    p = subprocess.run(["bash", str(script)], env={"PATH": os.environ["PATH"], "PBS_NODEFILE": str(tmp_path / "nodefile")},
                       capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode == 2 and "written for 3 nodes" in p.stderr, p.stderr
    assert not (tmp_path / "shared").exists()  # nothing staged


@pytest.fixture(scope="module")
def slurm(docker_engine):
    shared = Path(tempfile.mkdtemp(prefix="ftb-pbs-slurm-", dir="/tmp"))
    cluster = SlurmCluster(shared_dir=shared, image=ensure_slurm_image()).up()
    yield cluster
    cluster.down()
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize("flavour", ["pro", "torque"])
def test_qsub_of_slurm_wlm_torque_runs_the_script_on_two_nodes(slurm, tmp_path, flavour):
    """A per-node command (no torch: what is proven here is the scheduler side) on 2 nodes."""
    work = slurm.shared_dir / f"qsub-{flavour}"
    (work / "out").mkdir(parents=True)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": f"qsub-{flavour}", "nproc_per_node": 2, "gpus_per_node": 0, "shared_dir": str(slurm.shared_dir),
        "workdir": str(work), "env": {"HF_TOKEN": SECRET},
        "train": {"command": 'printf "%s %s %s %s" "$(hostname)" "$NNODES" "$MASTER_ADDR" '
                             '"$(printf %s "$HF_TOKEN" | sha256sum | cut -c1-16)" > out/node"$NODE_RANK"'}}))
    script = work / "job.pbs"
    args = ["--torque"] if flavour == "torque" else []
    assert main(["export", str(tmp_path / "job.yaml"), "--to", "pbs", "--nodes", "2", "--time", "00:10:00",
                 "-o", str(script), *args]) == 0
    text = script.read_text()
    assert ("#PBS -l nodes=2:ppn=2" if flavour == "torque" else "#PBS -l select=2:ncpus=2:mpiprocs=1") in text
    out = work / "qsub.out"
    p = subprocess.run(["docker", "exec", "-e", f"HF_TOKEN={SECRET}", "-w", str(work), slurm.controller,
                        "qsub", "-o", str(out), str(script)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    job_id = int(p.stdout.strip().splitlines()[-1].split(".")[0])
    deadline = time.monotonic() + 240
    while (state := slurm.job_state(job_id)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, state + slurm.logs()
        time.sleep(1)
    log = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", log + slurm.logs()
    seen = {f.name: f.read_text().split() for f in (work / "out").iterdir()}
    # -V: the secret came from the submitting environment, not from the file
    token = hashlib.sha256(SECRET.encode()).hexdigest()[:16]
    assert seen == {"node0": ["node1", "2", "node1", token], "node1": ["node2", "2", "node1", token]}, log
    assert SECRET not in text + log
