"""`ftbundle export --to pbs`: no PBS here, so the qsub script's body runs as PBS would run
it on the first node, with a $PBS_NODEFILE listing two containerized SSH hosts
(tests/cluster.py), and launches a real 2-node gloo job over ssh."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from ftbundle.cli import main
from tests.test_export_slurm import SECRET, gloo_job

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
                                cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()[-1]
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
