"""Two runs on the same hosts and port (issue 45, item 4), on containerized hosts: started at the
same moment, exactly one proceeds and the other's check refuses it (exit 2), naming the run that
holds the hosts and starting nothing; while the first runs, a third is refused the same way; once
it ended, the next run starts (its node programs released the claims); a detached run holds them
until its job ends (its watcher releases them)."""

from __future__ import annotations

import re
import time

import pytest

from ftbundle.check import CONNECT_S
from tests.support.helpers import base_job, ftbundle, job_processes, start_ftbundle, write_job

pytestmark = pytest.mark.cluster

HELD = re.compile(r"held by run (claims-\d{8}-\d{6}-[0-9a-f]+)")


def test_two_runs_at_once_exactly_one_proceeds_and_the_other_names_it(make_cluster, tmp_path):
    cluster = make_cluster(2)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("claims", cluster.shared_dir, inventory,
                                                    {"command": "echo up $NODE_RANK; sleep 6"}))
    first, second = start_ftbundle("run", str(job)), start_ftbundle("run", str(job))
    outs = [p.communicate(timeout=180) for p in (first, second)]
    codes = sorted(p.returncode for p in (first, second))
    said = "\n".join(out + err for out, err in outs)
    assert codes == [0, 2], said
    refused = next(err for (out, err), p in zip(outs, (first, second)) if p.returncode == 2)
    holder = HELD.search(refused)
    assert holder, refused
    runs = sorted(p.name for p in (cluster.shared_dir / "runs").iterdir())
    assert runs == [holder.group(1)], (runs, refused)  # the refused one made no run directory
    assert "master port 29500" in refused and "nothing was started" in refused, refused
    assert job_processes(cluster) == {}

    # ended: its claims were released, the next run starts at once
    again = ftbundle("run", str(job), timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_detached_run_holds_its_hosts_until_its_job_ends(make_cluster, tmp_path):
    cluster = make_cluster(2)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("claims", cluster.shared_dir, inventory,
                                                    {"command": "sleep 8"}))
    started = ftbundle("run", "--detach", str(job), timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    busy = ftbundle("run", str(job), timeout=180)
    assert busy.returncode == 2 and HELD.search(busy.stderr), busy.stdout + busy.stderr
    # refused as soon as it is known: node1's probe stopped knocking on the port rank 0 will not
    # listen on (told through the launcher) instead of trying for its whole connect_s
    took = re.search(r"checks? failed in ([\d.]+)s", busy.stdout + busy.stderr)
    assert took and float(took.group(1)) < CONNECT_S, busy.stdout + busy.stderr  # (knocking: always more)
    print(f"refused: the check took {took.group(1)}s (connect_s {CONNECT_S}s)")
    deadline = time.monotonic() + 60
    while job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # (its watcher releases the claims as the job ends)
    free = ftbundle("run", str(job), timeout=180)
    assert free.returncode == 0, free.stdout + free.stderr
