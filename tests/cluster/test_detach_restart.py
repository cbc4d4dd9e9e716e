"""Detach and come back later; restart all nodes after a failure and resume from a checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import (ASSETS, base_job, ftbundle, job_processes, only_run_dir, quickstart_lora, start_ftbundle,
                           write_job)

pytestmark = pytest.mark.cluster


def test_detach_then_status_logs_and_stop_from_another_invocation(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    shutil.copy(ASSETS / "allreduce.py", shared / "allreduce.py")
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("detached", shared, inventory,
                                                    {"script": "allreduce.py", "args": ["--sleep", "0.2"]}))

    started = ftbundle("run", str(job), "--detach", timeout=60)
    assert started.returncode == 0, started.stderr
    run_id = re.search(r"run (detached-\S+) started on all 2 node", started.stderr).group(1)
    # the launching process is gone; the job runs on (its first step can take minutes on a loaded
    # machine: torch's import and gloo's rendezvous on both hosts; a clean-clone run under load
    # 8-17 saw an empty log after 60 s)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        logs = ftbundle("logs", str(job), "-n", "5", timeout=30)
        if "allreduce ok" in logs.stdout:
            break
        time.sleep(1)
    assert "allreduce ok" in logs.stdout, logs.stdout + logs.stderr
    assert set(job_processes(cluster)) == {"node0", "node1"}

    status = ftbundle("status", str(job), timeout=30)
    assert status.returncode == 0, status.stderr
    assert run_id in status.stdout
    assert re.search(r"node rank 0 +node0 +running", status.stdout) and re.search(r"node rank 1 +node1 +running", status.stdout)
    assert "state: running" in status.stdout

    rank1 = ftbundle("logs", str(job), "--run", run_id, "--rank", "1", timeout=30)
    assert "rank 1 of world size 2 on node1" in rank1.stdout

    stopped = ftbundle("stop", str(job), "--run", run_id, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert job_processes(cluster) == {}
    after = ftbundle("status", str(job), "--run", run_id, timeout=30)
    assert "state: stopped" in after.stdout and "running" not in after.stdout.replace("state:", "")


def test_detached_job_stops_itself_when_a_peer_fails(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    script = 'if [ "$NODE_RANK" = 1 ]; then sleep 2; exit 4; fi; sleep 300'
    job = write_job(tmp_path / "job.yaml", base_job("detached-fail", shared, inventory, {"command": script}))
    assert ftbundle("run", str(job), "--detach", timeout=60).returncode == 0
    deadline = time.monotonic() + 20
    while job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(cluster) == {}
    status = ftbundle("status", str(job), timeout=30)
    assert status.returncode == 1 and "exited 4" in status.stdout and "state: failed" in status.stdout


def test_restart_resumes_from_the_latest_checkpoint(make_cluster, tmp_path):
    cluster = make_cluster(2)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    output = shared / "output/lora"
    train = quickstart_lora(shared, max_steps=100, save_steps=10, save_total_limit=3, per_device_train_batch_size=2)
    job = write_job(tmp_path / "job.yaml", base_job("restart", shared, inventory, {"llamafactory": train},
                                                    restarts=1))
    proc = start_ftbundle("run", "-v", str(job))
    try:
        deadline = time.monotonic() + 300
        while not (output / "checkpoint-10" / "trainer_state.json").exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint after 300s"
            time.sleep(0.2)
        cluster.exec("node1", "pkill -KILL -f ftb_llamafactory.py")
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restarting all nodes" in err and "node node1 (node rank 1" in err
    resumed = re.search(rf"resuming from checkpoint-(\d+) of 100 in {re.escape(str(output))}", err)
    assert resumed, err
    step = int(resumed.group(1))
    assert step >= 10
    log = (only_run_dir(shared) / "node-0-node0.a2.log").read_text()
    assert f"Resuming training from {output}/checkpoint-{step}" in log
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 100 > step
    assert job_processes(cluster) == {}


def test_detached_nodes_stop_when_a_node_or_the_referee_goes_silent(make_cluster, tmp_path):
    """Detached watching: rank 0 referees (it alone reads every heartbeat file) and writes one
    verdict the others read. A killed host (no exit file, its heartbeat frozen) stops the
    others within the stale time; so does a killed rank 0 (its verdict frozen)."""
    from ftbundle.launch.node import DETACHED_STALE_S

    cluster = make_cluster(3)
    shared = cluster.shared_dir
    limit = DETACHED_STALE_S + 15  # stale time, a beat to write the verdict, one to read it, load

    def run_detached(name: str, inventory) -> Path:
        job = write_job(tmp_path / f"{name}.yaml", base_job(name, shared, inventory, {"command": "sleep 300"}))
        started = ftbundle("run", str(job), "--detach", timeout=90)
        assert started.returncode == 0, started.stderr
        run_id = re.search(r"run (\S+) started on all", started.stderr).group(1)
        return shared / "runs" / run_id

    def stopped_within(hosts, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not {h for h in job_processes(cluster) if h in hosts}:
                return True
            time.sleep(1)
        return False

    run = run_detached("silent-node", cluster.write_inventory(tmp_path / "all.yml"))
    assert set(job_processes(cluster)) == {"node0", "node1", "node2"}
    assert (run / "watch.a1").read_text().split()[1] == "ok"
    cluster.kill("node1")
    killed = time.monotonic()
    assert stopped_within({"node0", "node2"}, limit), job_processes(cluster)
    took = time.monotonic() - killed
    assert took >= DETACHED_STALE_S - 2, took  # not before the node was really silent
    assert "node-1.a1.hb unchanged" in (run / "watch.a1").read_text()
    assert "rank 0's watcher says stop: node-1.a1.hb unchanged" in (run / "node-2-node2.a1.log").read_text()

    inventory = cluster.write_inventory(tmp_path / "two.yml")
    data = yaml.safe_load(inventory.read_text())
    data["all"]["children"]["trainers"]["hosts"].pop("node1")
    inventory.write_text(yaml.safe_dump(data))
    run = run_detached("silent-referee", inventory)
    assert set(job_processes(cluster)) == {"node0", "node2"}
    cluster.kill("node0")
    assert stopped_within({"node2"}, limit), job_processes(cluster)
    assert "rank 0's watcher silent" in (run / "node-1-node2.a1.log").read_text()


class Reads:
    """Who reads which file of one directory, counted by the kernel (fanotify: every read of a
    file there by any process, the containers' through their bind mount too, with the reader's
    pid). inotify would not do: it merges a read into an identical last event, so nodes reading
    one file in the same instant count once."""

    FAN_ACCESS, FAN_EVENT_ON_CHILD, FAN_CLOEXEC, FAN_NONBLOCK, FAN_MARK_ADD = 0x1, 0x08000000, 0x1, 0x2, 0x1

    def __init__(self, directory: Path):
        import ctypes
        import os

        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        self.fd = libc.fanotify_init(self.FAN_CLOEXEC | self.FAN_NONBLOCK, os.O_RDONLY | os.O_LARGEFILE)
        assert self.fd >= 0, f"fanotify_init: {os.strerror(ctypes.get_errno())} (needs root)"
        mask = self.FAN_ACCESS | self.FAN_EVENT_ON_CHILD
        assert libc.fanotify_mark(self.fd, self.FAN_MARK_ADD, mask, -100, str(directory).encode()) == 0, \
            os.strerror(ctypes.get_errno())
        self.readers: dict[str, list[int]] = {}  # file name -> the pid of each read

    def drain(self) -> None:
        import os
        import struct

        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at < len(data):  # struct fanotify_event_metadata
                size, _vers, _res, _mlen, mask, fd, pid = struct.unpack_from("IBBHQii", data, at)
                if fd >= 0:
                    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).removesuffix(" (deleted)")
                    os.close(fd)
                    if mask & self.FAN_ACCESS:
                        self.readers.setdefault(name, []).append(pid)
                at += size

    def during(self, seconds: float) -> dict[str, list[int]]:
        self.drain()
        self.readers = {}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
            self.drain()
        return self.readers

    def close(self) -> None:
        import os

        os.close(self.fd)


def test_detached_watching_reads_each_heartbeat_once_a_second_not_once_per_peer(make_cluster, tmp_path):
    """Issue 23, item 3: across the cluster a detached run reads O(n) files a second (the referee
    reads the n-1 other heartbeats, the n-1 others read its one verdict), not O(n^2) (every node
    every peer's heartbeat: n(n-1)). Counted by the kernel (fanotify) on the shared run directory
    while 6 nodes run, with who read each (the lower bounds show it sees the containers' reads)."""
    n, window = 6, 8.0
    cluster = make_cluster(n)
    shared = cluster.shared_dir
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("watched", shared, inventory, {"command": "sleep 300"}))
    started = ftbundle("run", str(job), "--detach", timeout=90)
    assert started.returncode == 0, started.stderr
    run = shared / "runs" / re.search(r"run (\S+) started on all", started.stderr).group(1)
    assert set(job_processes(cluster)) == {f"node{i}" for i in range(n)}
    reads = Reads(run)
    try:
        time.sleep(2)  # every watcher past its first beat
        readers = reads.during(window)
    finally:
        reads.close()
        assert ftbundle("stop", str(job), timeout=60).returncode == 0
    per_s = {name: len(pids) / window for name, pids in readers.items()}
    heartbeats = {name: pids for name, pids in readers.items() if name.endswith(".hb")}
    # one process (rank 0's watcher) reads each other node's heartbeat, about once a beat (a beat
    # is a second plus its own work: a loaded machine makes it slower, never faster) ...
    assert sorted(heartbeats) == [f"node-{r}.a1.hb" for r in range(1, n)], readers.keys()
    assert len({pid for pids in heartbeats.values() for pid in pids}) == 1, heartbeats
    assert all(0.4 * window <= len(pids) <= 1.25 * window for pids in heartbeats.values()), heartbeats
    # ... and each of the others reads its one verdict about once a beat
    verdict = readers.get("watch.a1", [])
    assert len(set(verdict)) == n - 1, verdict
    assert 0.4 * (n - 1) * window <= len(verdict) <= 1.25 * (n - 1) * window, verdict
    assert sum(per_s.values()) <= 3 * n < n * (n - 1), per_s  # nothing else read every beat either
    deadline = time.monotonic() + 30
    while job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(1)
    assert job_processes(cluster) == {}


# what shims/steptimes.py writes, written by the job itself: node1's compute 3x the others'; its
# last line comes 3 s after the one before, inside the watcher's 10 s between writes, so only
# the watcher's last write at the job's end keeps it
STEPS_JOB = ('if [ "$NODE_RANK" = 1 ]; then m=0.300000; else m=0.100000; fi; mkdir -p "${FTB_STEPS_FILE%/*}"; '
             'printf "0 25 $m 0.400000\\n" >"$FTB_STEPS_FILE.0"; echo started; sleep 15; '
             'printf "0 30 $m 0.400000\\n" >"$FTB_STEPS_FILE.0"; sleep 3; '
             'printf "0 40 $m 0.400000\\n" >"$FTB_STEPS_FILE.0"')


def test_a_detached_runs_stragglers_are_named_by_status_and_kept_for_runs(make_cluster, tmp_path):
    """Issue 37 item 3 for detached runs (no control channel to carry step times): each node's
    watcher keeps its ranks' step times in the run directory; `ftbundle status` names the
    straggler while the run goes on, `runs --json` carries every node's last figures after it
    ended, and no step-time folder is left on a host."""
    cluster = make_cluster(3)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job("steps-detached", cluster.shared_dir, inventory,
                                                    {"command": STEPS_JOB}))
    started = ftbundle("run", str(job), "--detach", "--no-check", timeout=90)
    assert started.returncode == 0, started.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = ftbundle("status", str(job), timeout=60)
        # (every node's watcher writes its first figures at its first beat: wait for all three)
        if all(re.search(rf"^    node{i} ", status.stdout, re.M) for i in range(3)):
            break
        time.sleep(1)
    assert "  stragglers   node1 3.00x the fleet's median (straggler_factor 1.15)" in status.stdout, status.stdout
    assert re.search(r"^    node0 +100\.0 ms +400\.0 ms +(25|30)$", status.stdout, re.M), status.stdout
    deadline = time.monotonic() + 60
    while "state: finished" not in status.stdout and time.monotonic() < deadline:
        time.sleep(1)
        status = ftbundle("status", str(job), timeout=60)
    assert "state: finished" in status.stdout, status.stdout
    # (each node's watcher keeps its last figures when it sees its job gone: up to a heartbeat after
    # the job's own exit record, which is what makes the run "finished"; CI once read node0's at 30)
    deadline = time.monotonic() + 10
    while True:
        runs = ftbundle("runs", str(job), "--json", timeout=60)
        assert runs.returncode == 0, runs.stderr
        steps = json.loads(runs.stdout)[-1]["step_times"]
        counts = {host: n["steps"] for host, n in steps["nodes"].items()}
        if counts == {"node0": 40, "node1": 40, "node2": 40} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert steps["stragglers"] == [{"host": "node1", "ratio": 3.0}], steps
    assert counts == {"node0": 40, "node1": 40, "node2": 40}, steps
    assert steps["fleet_median_s"] == 0.1 and steps["straggler_factor"] == 1.15, steps
    for host in cluster.hosts:  # the detached watcher cleans up after its job too
        left = cluster.exec(host, "ls -d /tmp/ftb-steps-* 2>/dev/null", check=False).stdout.strip()
        assert left == "", (host.name, left)
