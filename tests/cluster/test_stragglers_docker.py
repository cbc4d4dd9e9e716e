"""The docker runtime carries the ranks' step times too: each node's step-time folder is mounted
into its container and FTB_STEPS_FILE passed in, so what a rank writes there reaches the launcher
on the node's control channel (two hosts with Docker engines of their own, a tiny image)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.helpers import REPO, base_job, write_job
from tests.cluster.test_docker_runtime_faults import dcluster  # noqa: F401 - the module's cluster

pytestmark = pytest.mark.cluster

# what shims/steptimes.py writes, written by the job itself (the tiny image has bash, no Python)
JOB = ('if [ "$NODE_RANK" = 1 ]; then m=0.300000; else m=0.100000; fi; '
       'printf "0 25 $m 0.400000\\n" > "$FTB_STEPS_FILE.0"; echo started; sleep 4')


def test_step_times_from_inside_the_containers_name_the_slow_node(dcluster, tmp_path):  # noqa: F811
    cluster, image = dcluster
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = base_job("steps-docker", cluster.shared_dir, inventory, {"command": JOB})
    job["runtime"] = {"kind": "docker", "image": image}
    path = write_job(tmp_path / "job.yaml", job)
    proc = subprocess.run([sys.executable, "-m", "ftbundle", "run", str(path), "--no-check"], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    assert "  stragglers   node1 1.50x the fleet's median" in out, out
    assert any(line.split()[:3] == ["node0", "100.0", "ms"] for line in out.splitlines()), out
    for host in cluster.hosts:  # the node program cleans up after its job: no folder left
        left = cluster.exec(host, "ls -d /tmp/ftb-steps-* 2>/dev/null", check=False).stdout.strip()
        assert left == "", (host.name, left)
