"""A run that hangs quietly is diagnosed, named and stopped; a slow one is left alone.

Two containerized hosts x 2 ranks, gloo, tests/assets/stall.py (an all-reduce loop that
hangs on purpose), ``stall_timeout`` 10 s. One cluster serves the module: no test here
damages a host.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.helpers import ASSETS, base_job, ftbundle, job_processes, read_stdout_until, start_ftbundle, write_job

pytestmark = pytest.mark.cluster

STALL_TIMEOUT = 10
STALLED = 124  # ftbundle.launch.stall.STALLED_EXIT_CODE


@pytest.fixture(scope="module")
def cluster(testhost_image):
    shared = Path(tempfile.mkdtemp(prefix="ftb-stall-", dir="/tmp"))
    c = Cluster(2, shared_dir=shared, image=testhost_image).up()
    shutil.copy(ASSETS / "stall.py", shared / "stall.py")
    yield c
    c.down()
    shutil.rmtree(shared, ignore_errors=True)


def stall_job(cluster, tmp_path, name: str, *args: str) -> str:
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = base_job(name, cluster.shared_dir, inventory, {"script": "stall.py", "args": list(args)},
                   nproc_per_node=2, stall_timeout=STALL_TIMEOUT)
    return str(write_job(tmp_path / "job.yaml", job))


def run_until_step(proc, step: int, timeout: float = 180) -> float:
    """Read ftbundle's stdout (-v: rank 0's lines) until rank 0 reports ``step``; when."""
    read_stdout_until(proc, f"step {step} allreduce ok", timeout)
    return time.monotonic()


def finish(proc, timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"ftbundle still ran after {timeout}s:\n{err[-4000:]}") from None
    return out, err


def run_dir_of(cluster) -> Path:
    runs = sorted((cluster.shared_dir / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return runs[-1]


def test_rank_stuck_in_a_python_function_is_named_and_the_run_stopped(cluster, tmp_path):
    # rank 3 (node 1, local rank 1) deadlocks in wait_for_lock at step 3; ranks 0-2 wait in all_reduce
    proc = start_ftbundle("run", "-v", stall_job(cluster, tmp_path, "stall-lock", "--hang-rank", "3",
                                                 "--how", "lock", "--hang-at", "3", "--sleep", "0.5"))
    last_step = run_until_step(proc, 2)
    out, err = finish(proc, STALL_TIMEOUT + 90)
    took = time.monotonic() - last_step
    host1 = cluster.hosts[1].name
    assert proc.returncode == STALLED, err
    assert took < STALL_TIMEOUT + 60, f"{took:.1f}s\n{err}"
    assert re.search(r"3 ranks in all_reduce at stall\.py:\d+", err), err
    odd = [line for line in err.splitlines() if "the odd one out" in line]
    assert len(odd) == 1 and f"rank 3 on {host1} (node 1, local 1" in odd[0], err
    assert "wait_for_lock at stall.py:" in odd[0], err
    assert job_processes(cluster) == {}
    stacks = list((run_dir_of(cluster) / "stacks").iterdir())
    assert len(stacks) == 1 and sorted(p.name for p in stacks[0].glob("rank-*")) == [f"rank-{r}.txt" for r in range(4)]
    assert "wait_for_lock" in (stacks[0] / "rank-3.txt").read_text()
    assert str(stacks[0]) in err
    assert json.loads((run_dir_of(cluster) / "summary.json").read_text())["state"] == "stalled"
    print(err)
    print(f"hang -> diagnosed and stopped: {took:.1f}s after the last step (stall_timeout {STALL_TIMEOUT}s)")


def test_sigstopped_rank_is_named_by_its_state_and_a_stall_is_a_failed_attempt(cluster, tmp_path):
    # rank 1 (node 0, local rank 1) stops itself with SIGSTOP at step 3, in both attempts
    job = stall_job(cluster, tmp_path, "stall-stop", "--hang-rank", "1", "--how", "stop", "--hang-at", "3",
                    "--sleep", "0.5")
    text = Path(job).read_text() + "restarts: 1\n"
    Path(job).write_text(text)
    proc = start_ftbundle("run", "-v", job)
    stopped_at: list[float] = []
    err_lines: list[str] = []

    def read_err():
        for line in proc.stderr:
            err_lines.append(line)
            if "stopped every node" in line and not stopped_at:
                stopped_at.append(time.monotonic())

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    last_step = run_until_step(proc, 2)
    try:
        proc.stdout.read()
        proc.wait(timeout=2 * (STALL_TIMEOUT + 90))
    finally:
        proc.kill()
    reader.join(10)
    err = "".join(err_lines)
    host0 = cluster.hosts[0].name
    assert proc.returncode == STALLED, err
    assert stopped_at and stopped_at[0] - last_step < STALL_TIMEOUT + 60, err
    odd = [line for line in err.splitlines() if "the odd one out" in line]
    assert len(odd) == 2, err  # one per attempt
    assert all(f"rank 1 on {host0} (node 0, local 1" in line and "stopped (SIGSTOP)" in line for line in odd), err
    assert "every process of attempt 1 is gone; restarting all nodes" in err and "giving up after 2 attempts" in err
    assert sorted(p.name.split("-")[0] for p in (run_dir_of(cluster) / "stacks").iterdir()) == ["a1", "a2"]
    assert job_processes(cluster) == {}
    print(err)


def test_slow_run_is_never_stopped_and_stacks_shows_every_rank(cluster, tmp_path):
    # one step every stall_timeout/2: progress, however slow
    job = stall_job(cluster, tmp_path, "stall-slow", "--steps", "6", "--sleep", str(STALL_TIMEOUT / 2))
    proc = start_ftbundle("run", "-v", job)
    run_until_step(proc, 1)
    stacks = ftbundle("stacks", job, timeout=120)
    assert stacks.returncode == 0, stacks.stderr
    print(stacks.stdout)
    for rank in range(4):
        assert re.search(rf"\brank {rank}\b|ranks [0-9, ]*\b{rank}\b", stacks.stdout), stacks.stdout
    assert "4 ranks" in stacks.stdout or sum(int(n) for n in re.findall(r"^  (\d) ranks?", stacks.stdout, re.M)) == 4, \
        stacks.stdout
    out, err = finish(proc, 120)
    assert proc.returncode == 0, err
    assert "stalled" not in err
    assert "step 5 allreduce ok" in out
    assert job_processes(cluster) == {}


def test_detached_run_applies_stall_timeout_itself(cluster, tmp_path):
    # rank 2 (node 1, local rank 0) deadlocks at step 3; nobody is attached: rank 0's node referees
    job = stall_job(cluster, tmp_path, "stall-detached", "--hang-rank", "2", "--how", "lock", "--hang-at", "3",
                    "--sleep", "0.5")
    started = ftbundle("run", "--detach", job, timeout=180)
    assert started.returncode == 0, started.stderr
    detached_at = time.monotonic()
    deadline = detached_at + 60 + STALL_TIMEOUT + 90  # start-up, the steps, the limit, the collection
    time.sleep(STALL_TIMEOUT)
    while job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(1)
    took = time.monotonic() - detached_at
    assert job_processes(cluster) == {}, f"still running {took:.0f}s after the detached start"
    status = ftbundle("status", job, timeout=120)
    print(status.stdout)
    assert status.returncode == 1 and "state: stalled" in status.stdout, status.stdout + status.stderr
    odd = [line for line in status.stdout.splitlines() if "the odd one out" in line]
    assert len(odd) == 1 and f"rank 2 on {cluster.hosts[1].name} (node 1, local 0" in odd[0], status.stdout
    assert "wait_for_lock at stall.py:" in odd[0], status.stdout
    print(f"detached: stalled, diagnosed and stopped {took:.0f}s after the detached start")


PER_NODE = """
import os, threading, time
def wait_for_lock():
    lock = threading.Lock(); lock.acquire(); lock.acquire()
def wait_for_peer():
    while True:
        time.sleep(1)
for step in range(1, 4):
    print("node", os.environ["NODE_RANK"], "step", step, flush=True)
    time.sleep(0.5)
wait_for_lock() if os.environ["NODE_RANK"] == "1" else wait_for_peer()
"""


def test_detached_command_job_without_torchrun_stalls_and_its_processes_are_shown(cluster, tmp_path):
    """A `command:` job runs its own program once per node: no torchrun, no LOCAL_RANK on its
    processes. Its detached watchdog took "no LOCAL_RANK process left" for torchrun ending and
    never stopped it; the collector found no rank. Now: stalled, stopped, both processes shown."""
    (cluster.shared_dir / "per_node.py").write_text(PER_NODE)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job(
        "stall-command", cluster.shared_dir, inventory, {"command": f"python3 {cluster.shared_dir}/per_node.py"},
        stall_timeout=STALL_TIMEOUT))
    started = ftbundle("run", "--detach", str(job), timeout=180)
    assert started.returncode == 0, started.stderr
    detached_at = time.monotonic()
    deadline = detached_at + 60 + STALL_TIMEOUT + 90
    time.sleep(STALL_TIMEOUT)
    while job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(1)
    took = time.monotonic() - detached_at
    assert job_processes(cluster) == {}, f"still running {took:.0f}s after the detached start"
    status = ftbundle("status", str(job), timeout=120)
    print(status.stdout)
    assert status.returncode == 1 and "state: stalled" in status.stdout, status.stdout + status.stderr
    assert re.search(r"1 rank in wait_for_lock at per_node\.py:\d+", status.stdout), status.stdout
    assert re.search(r"1 rank in wait_for_peer at per_node\.py:\d+", status.stdout), status.stdout
    assert "rank(s) not found" not in status.stdout, status.stdout


@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detached"])
def test_a_job_that_prints_once_then_hangs_is_still_a_stall(cluster, tmp_path, detach):
    """Its only output comes before the watchdog's first look (a banner, then a hang in the
    first rendezvous). The first reading the watchdog saw already held it, nothing changed
    after, and the clock never started: a detached run hung forever. Each node now reads its
    baseline before the job starts."""
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = str(write_job(tmp_path / "job.yaml", base_job(
        "stall-banner", cluster.shared_dir, inventory, {"command": "echo banner; exec sleep 600"},
        stall_timeout=5)))
    t0 = time.monotonic()
    if detach:
        started = ftbundle("run", "--detach", "--no-check", job, timeout=180)
        assert started.returncode == 0, started.stderr
        while job_processes(cluster) and time.monotonic() - t0 < 120:
            time.sleep(1)
        status = ftbundle("status", job, timeout=120)
        assert "state: stalled" in status.stdout, status.stdout + status.stderr
    else:
        proc = start_ftbundle("run", "--no-check", job)
        _, err = finish(proc, 120)
        assert proc.returncode == STALLED and "stalled: no progress from any rank for" in err, err
    assert job_processes(cluster) == {}, f"still running {time.monotonic() - t0:.0f}s after the start"


HANG = """
import threading, time
def wait_for_lock():
    lock = threading.Lock(); lock.acquire(); lock.acquire()
wait_for_lock()
"""


def test_collector_reads_a_rank_inside_a_container_from_the_host(testhost_image, tmp_path):
    """The docker runtime's ranks live in a container; the collector, run on the host, finds
    them under the container's init and py-spy reads them from outside, stopped or not."""
    import json
    import secrets
    import sys

    from ftbundle.launch.stall import collector_source

    (tmp_path / "hang.py").write_text(HANG)
    name = f"ftb-stalltest-{secrets.token_hex(4)}"
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--entrypoint", "python3", "-e", "LOCAL_RANK=1",
                    "-e", "RANK=3", "-v", f"{tmp_path}:/w:ro", testhost_image, "/w/hang.py"], check=True,
                   capture_output=True)
    try:
        spec = {"marker": "", "container": name, "pyspy_dirs": [str(Path(sys.executable).parent)],
                "out_dir": str(tmp_path / "out"), "host": "h", "node_rank": 0, "sample_s": 0.5}

        def collect() -> dict:
            deadline = time.monotonic() + 30
            while True:
                p = subprocess.run(["python3", "-S", "-", json.dumps(spec)], input=collector_source(),
                                   capture_output=True, timeout=60)
                ranks = json.loads(p.stdout)["ranks"]
                if (ranks and ranks[0]["threads"]) or time.monotonic() > deadline:
                    return ranks[0] if ranks else {}
                time.sleep(1)  # (the interpreter may still be starting)

        running = collect()
        assert running.get("rank") == 3 and running["local_rank"] == 1, running
        assert running["threads"][0]["frames"][0]["name"] == "wait_for_lock"
        subprocess.run(["docker", "kill", "-s", "STOP", name], check=True, capture_output=True)
        stopped = collect()
        assert stopped["state"] == "T" and stopped["threads"][0]["frames"][0]["name"] == "wait_for_lock", stopped
        assert "wait_for_lock" in (tmp_path / "out" / "rank-3.txt").read_text()
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
