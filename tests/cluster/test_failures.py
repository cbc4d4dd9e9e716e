"""Fail fast, leave nothing behind: a node dies, a network is cut, the user presses Ctrl-C.

Each test runs a real gloo all-reduce loop under torchrun on containerized hosts, injects
the fault, and measures the time until `ftbundle run` has stopped every node.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from tests.support.helpers import ASSETS, base_job, job_processes, read_stdout_until, start_ftbundle, write_job

pytestmark = pytest.mark.cluster


def allreduce_job(cluster, tmp_path, name: str) -> str:
    shared = cluster.shared_dir
    shutil.copy(ASSETS / "allreduce.py", shared / "allreduce.py")
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = base_job(name, shared, inventory, {"script": "allreduce.py", "args": ["--sleep", "0.2"]})
    return str(write_job(tmp_path / "job.yaml", job))


def wait_for_steps(proc, steps: int = 3, timeout: float = 120) -> list[str]:
    """Read ftbundle's stdout until rank 0 has done `steps` all-reduce steps."""
    return read_stdout_until(proc, f"step {steps - 1} allreduce ok", timeout)


@pytest.fixture
def cluster3(make_cluster):
    return make_cluster(3)


def test_killed_node_tears_everything_down_within_10s(cluster3, tmp_path):
    proc = start_ftbundle("run", "-v", allreduce_job(cluster3, tmp_path, "kill-node"))
    try:
        wait_for_steps(proc)
        killed_at = time.monotonic()
        cluster3.kill("node2")
        proc.wait(timeout=30)
        took = time.monotonic() - killed_at
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode != 0
    assert took < 10, f"teardown took {took:.1f}s\n{err}"
    assert "node node2 (node rank 2" in err and "failed first" in err, err
    assert job_processes(cluster3) == {}
    print(f"node killed -> ftbundle exited, all stopped: {took:.1f}s")


def test_killed_process_tears_everything_down(cluster3, tmp_path):
    proc = start_ftbundle("run", "-v", allreduce_job(cluster3, tmp_path, "kill-proc"))
    try:
        wait_for_steps(proc)
        killed_at = time.monotonic()
        cluster3.exec("node1", "pkill -KILL -f allreduce.py")
        proc.wait(timeout=30)
        took = time.monotonic() - killed_at
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode != 0
    assert took < 10, f"teardown took {took:.1f}s\n{err}"
    assert "node node1 (node rank 1" in err, err
    assert job_processes(cluster3) == {}


def test_cut_network_is_detected_by_heartbeat_within_15s(cluster3, tmp_path):
    proc = start_ftbundle("run", "-v", allreduce_job(cluster3, tmp_path, "partition"))
    try:
        wait_for_steps(proc)
        cut_at = time.monotonic()
        cluster3.partition("node1")
        proc.wait(timeout=60)
        took = time.monotonic() - cut_at
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode != 0
    assert took < 15, f"teardown took {took:.1f}s\n{err}"
    assert "node node1 (node rank 1" in err and "heartbeat" in err, err
    # the reachable nodes are clean at once; the cut-off node's own watchdog stops its job
    left = job_processes(cluster3)
    assert "node0" not in left and "node2" not in left, left
    deadline = time.monotonic() + 15
    while job_processes(cluster3).get("node1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(cluster3) == {}, "the partitioned node did not stop its own job"


# freeze: a node program (its heartbeats, its watchdog), not its job, stopped with SIGSTOP while
# its host answers: a node that is alive but quiet, as every node is at 128+ hosts on 2 cores.
# The frozen pids go to a file for the clean-up.
FREEZE = r"""
freeze() {
  node=$(ps -o ppid= -p "$PPID" | tr -d ' ')
  frozen="$node $(pgrep -P "$node" | grep -vx "$PPID" | tr '\n' ' ')"
  echo "$frozen" > "$FTB_RUN_DIR/frozen-$NODE_RANK"
  kill -STOP $frozen
}
"""


def run_freezing(cluster, tmp_path, name: str, cases: str, timeout: float) -> tuple[int, str]:
    """A `command:` job of FREEZE and ``cases`` (a shell `case` on NODE_RANK) to its end:
    (exit code, stderr); the frozen node programs killed afterwards."""
    shared = cluster.shared_dir
    (shared / f"{name}.sh").write_text(FREEZE + cases)
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = write_job(tmp_path / "job.yaml", base_job(name, shared, inventory,
                                                     {"command": f"bash {shared}/{name}.sh"}))
    proc = start_ftbundle("run", "-v", "--no-check", str(job))
    try:
        proc.wait(timeout=timeout)
        return proc.returncode, proc.stderr.read()
    finally:
        proc.kill()
        for frozen in (shared / "runs").glob(f"{name}-*/frozen-*"):
            cluster.exec(f"node{frozen.name[-1]}", f"kill -KILL {frozen.read_text().strip()}", check=False)


def test_a_slow_node_during_the_teardown_is_not_named_as_the_cause(cluster3, tmp_path):
    """While stopping, a node silent for a few heartbeats is lost (and dated by its last
    heartbeat, which can make it the root cause) only when its host does not answer. Here
    node1's node program freezes a second before node2's job exits 7: node2 is named, exit 7;
    node1 is not called unreachable, and its job is stopped through a channel of its own (its
    watchdog is frozen) before ftbundle exits. (With 128 hosts on 2 cores the teardown named
    a healthy node this way in 5 of 5 trials.)"""
    code, err = run_freezing(cluster3, tmp_path, "slow-teardown", r"""
case "$NODE_RANK" in
1) sleep 3; freeze; sleep 300 ;;
2) sleep 4; echo "rank 2 gives up"; exit 7 ;;
*) sleep 300 ;;
esac
""", timeout=60)
    assert "node node2 (node rank 2" in err and "failed first: exited with code 7" in err, err
    assert code == 7, err
    assert "could not reach" not in err and "did not confirm" not in err, err
    assert job_processes(cluster3) == {}


def test_a_quiet_node_whose_host_answers_is_given_time(cluster3, tmp_path):
    """A running node silent for the give-up (5 s) is lost only when its host does not answer
    either: one that answers is alive but quiet (its node program starved of CPU, as on a
    2-core machine running 512 sshd), and is given until 3 x the give-up. node1, frozen for
    7 s and then running again, does not fail the run; node2, frozen for good, is named after
    about 15 s, with why (the old give-up named node1 at 5 s)."""
    code, err = run_freezing(cluster3, tmp_path, "quiet-node", r"""
case "$NODE_RANK" in
1) sleep 2; freeze; sleep 7; kill -CONT $frozen; sleep 60 ;;
2) sleep 3; freeze; sleep 60 ;;
*) sleep 60 ;;
esac
""", timeout=90)
    first = next((line for line in err.splitlines() if "failed first" in line), "")
    assert "node node2 (node rank 2" in first and "although its host answers" in first, err
    silent = int(first.split("no heartbeat for ")[1].split("s")[0])
    assert 15 <= silent <= 18, first
    assert code == 255, err
    assert job_processes(cluster3) == {}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupt_leaves_no_process_anywhere_within_5s(cluster3, tmp_path, sig):
    proc = start_ftbundle("run", "-v", allreduce_job(cluster3, tmp_path, "interrupt"))
    try:
        wait_for_steps(proc)
        sent_at = time.monotonic()
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # say where it waits: ftbundle dumps its threads on SIGUSR1
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            raise AssertionError(f"ftbundle still runs 20 s after {sig.name}; its stderr:\n"
                                 + proc.communicate()[1][-6000:]) from None
        # the time until ftbundle returned (not the docker execs of the look below, which
        # take seconds of their own on a loaded machine) ...
        took = time.monotonic() - sent_at
        # ... and once it has returned, nothing of the job may be left on any host
        left = job_processes(cluster3)
    finally:
        proc.kill()
    assert left == {}, left
    assert took < 5, f"{took:.1f}s"
    assert proc.returncode == 130
