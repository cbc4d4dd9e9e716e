"""`ftbundle logs --all` / `--rank` on two containerized hosts x 2 local ranks: every rank's
output merged in time order with a host:rank prefix, one rank's own output by global rank or
node:local, and -f following all of them until the job ends (issue 24, part 3)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, base_job, ftbundle, job_processes, write_job

SCRIPT = """import logging, sys, time
import torch.distributed as dist
logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO, stream=sys.stderr)
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(3):
    logging.info("rank %d step %d", rank, step)
    time.sleep(0.4)
dist.barrier()
if rank == FAIL:
    raise ValueError(f"boom on rank {rank}")
time.sleep(0 if FAIL < 0 else 20)
"""


@pytest.mark.cluster
def test_all_ranks_merged_one_rank_by_number_and_following_every_rank(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    (shared / "ranks.py").write_text(SCRIPT.replace("FAIL", "3"))
    job = write_job(tmp_path / "job.yaml", base_job("logs", shared, inventory,
                                                   {"script": str(shared / "ranks.py")}, nproc_per_node=2))
    run = ftbundle("run", str(job), "--no-check", timeout=300)
    assert run.returncode != 0, run.stderr[-2000:]

    merged = ftbundle("logs", str(job), "--all", "-n", "500", timeout=60)
    assert merged.returncode == 0, merged.stderr
    lines = merged.stdout.splitlines()
    seen = {m.group(1) for line in lines if (m := re.match(r"^(node\d:\d) .* rank \d step \d$", line))}
    assert seen == {"node0:0", "node0:1", "node1:2", "node1:3"}, merged.stdout
    for line in lines:  # each rank's lines carry its own prefix
        m = re.match(r"^node\d:(\d) .* rank (\d) step \d$", line)
        if m:
            assert m.group(1) == m.group(2), line
    stamps = [line.split(" ", 1)[1][:23] for line in lines if re.match(r"^node\d:\d \d{4}-\d\d-\d\d ", line)]
    assert stamps == sorted(stamps), stamps  # time order across hosts and ranks
    # the failing rank is found: its traceback under its own prefix, after its steps
    boom = [i for i, line in enumerate(lines) if re.match(r"^node1:3 (\[rank3\]: )?ValueError: boom on rank 3$", line)]
    assert boom, merged.stdout
    assert any(re.match(r"^node1:3 (\[rank3\]: )?Traceback \(most recent call last\)", line) for line in lines[:boom[0]])

    for spec in ("3", "1:1"):
        one = ftbundle("logs", str(job), "--rank", spec, "-n", "500", timeout=60)
        assert one.returncode == 0, one.stderr
        assert "ValueError: boom on rank 3" in one.stdout and "node1:3 " in one.stdout
        assert "rank 0 step" not in one.stdout and "rank 2 step" not in one.stdout, one.stdout
    bad = ftbundle("logs", str(job), "--rank", "4", timeout=60)
    assert bad.returncode == 2 and "no rank '4' in this run" in bad.stderr

    # -f: a detached run, followed from its start to its end, every rank's lines
    (shared / "ranks.py").write_text(SCRIPT.replace("FAIL", "-1"))
    assert ftbundle("run", str(job), "--no-check", "--detach", timeout=120).returncode == 0
    follow = subprocess.Popen([sys.executable, "-m", "ftbundle", "logs", str(job), "--all", "-f", "-n", "500"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 400  # (importing torch alone took 100 s on this machine under load)
        while job_processes(cluster) and time.monotonic() < deadline:
            time.sleep(2)
        assert job_processes(cluster) == {}, "the detached job did not end"
        out, err = follow.communicate(timeout=30)  # it ends with the job
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    got = {m.group(1) for line in out.splitlines() if (m := re.match(r"^(node\d:\d) .* step 2$", line))}
    assert got == {"node0:0", "node0:1", "node1:2", "node1:3"}, out
