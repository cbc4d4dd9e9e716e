"""The launcher core on containerized hosts: one SSH connection per host, a node channel that
output cannot drown, a fresh shared directory, quick stops, restarts that cannot collide.

Each test runs real `ftbundle` processes against real sshd hosts; timings here are loose
upper bounds (the benchmarks under bench/ measure them properly).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import (REPO, base_job, ftbundle, job_processes, logins, logins_per_host, only_run_dir,
                           start_ftbundle, write_job)

pytestmark = pytest.mark.cluster


def command_job(cluster, tmp_path, name: str, command: str, **extra) -> Path:
    inventory = cluster.write_inventory(tmp_path / "hosts.yml")
    job = base_job(name, cluster.shared_dir, inventory, {"command": command})
    job.update(extra)
    return write_job(tmp_path / "job.yaml", job)


@pytest.fixture
def cluster2(make_cluster):
    return make_cluster(2)


@pytest.fixture
def cluster3(make_cluster):
    return make_cluster(3)


def test_one_ssh_handshake_per_host_for_check_stage_launch_and_teardown(cluster3, tmp_path):
    """The check's rounds, staging, the node channels, rank 0's log and the stop at the end
    all ride one connection per host: sshd logs exactly one login on each."""
    job = command_job(cluster3, tmp_path, "handshakes",
                      'echo "rank $NODE_RANK"; [ "$NODE_RANK" = 2 ] && { sleep 1; exit 3; }; sleep 30')
    before = logins_per_host(cluster3)
    result = ftbundle("run", "-v", str(job), timeout=120)
    assert result.returncode == 3, result.stderr
    assert "check passed" in result.stderr and "node node2 (node rank 2" in result.stderr
    after = logins_per_host(cluster3)
    assert {h: after[h] - before[h] for h in after} == {"node0": 1, "node1": 1, "node2": 1}
    assert job_processes(cluster3) == {}


def test_tcp_nodelay_is_set_before_the_ssh_handshake(cluster2, tmp_path, monkeypatch):
    """paramiko makes its socket with Nagle's algorithm on: the handshake's back-to-back small
    packets (NEWKEYS, the ssh-userauth request) then wait 40 ms for the server's delayed ACK
    on every login. ftbundle's connections hand paramiko a socket with TCP_NODELAY already set,
    which also ACKs at once what it reads (ftbundle.ssh.LowLatencySocket; the effect on start
    latency is in bench/launch.py)."""
    import socket

    import paramiko

    from ftbundle.cluster import Cluster
    from ftbundle.inventory import load_hosts
    from ftbundle.ssh import LowLatencySocket

    seen = []
    original = paramiko.Transport.__init__

    def spy(self, sock, *args, **kwargs):
        if isinstance(sock, socket.socket):
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        original(self, sock, *args, **kwargs)

    monkeypatch.setattr(paramiko.Transport, "__init__", spy)
    hosts = load_hosts(cluster2.write_inventory(tmp_path / "hosts.yml"), "trainers")
    with Cluster(hosts) as cluster:
        cluster.open()
        assert cluster.errors == {}
        assert len(seen) == 2 and all(seen), seen  # both handshakes ran on a TCP_NODELAY socket
        assert all(isinstance(cluster._transport(h).sock, LowLatencySocket) for h in hosts)
        assert all(cluster.run(h, ["hostname"]).stdout.strip() == h.name for h in hosts)


@pytest.mark.parametrize("last_word", ["eof", "ping"])
def test_a_send_as_the_command_ends_never_cuts_the_hosts_connection(cluster2, tmp_path, monkeypatch, last_word):
    """paramiko makes a data or EOF message under the channel's lock and sends it after
    letting go (paramiko #1115, #1705, open). A command that ends in that gap gets its
    channel closed by both sides first, and sshd then drops the whole connection over the
    late message ("ieof packet referred to nonexistent channel"), with every other channel
    of that host on it. Here the gap is made wide on purpose: our sends from this thread
    are held back 0.5 s while the command ends after 0.1 s. The connection must survive,
    the command's exit code must arrive, and the next command must run on it."""
    import threading

    import paramiko
    from paramiko.common import MSG_CHANNEL_DATA, MSG_CHANNEL_EOF

    from ftbundle.cluster import Cluster
    from ftbundle.inventory import load_hosts

    original = paramiko.Transport._send_user_message

    def late(self, message):
        if threading.current_thread() is not self and message.asbytes()[0] in (MSG_CHANNEL_DATA, MSG_CHANNEL_EOF):
            time.sleep(0.5)
        return original(self, message)

    monkeypatch.setattr(paramiko.Transport, "_send_user_message", late)
    host = load_hosts(cluster2.write_inventory(tmp_path / "hosts.yml"), "trainers")[0]
    with Cluster([host]) as cluster:
        cluster.open()
        assert cluster.errors == {}
        transport = cluster._transport(host)
        proc = cluster.start(host, ["sleep", "0.1"])
        if last_word == "eof":
            proc.close_stdin()
            assert proc.chan.eof_sent
        else:
            assert proc.send(b"\n") is True  # a node channel's ping
        assert proc.wait(timeout=10) == 0
        time.sleep(0.3)  # sshd would have dropped the connection by now
        assert transport.is_active() and cluster._transport(host) is transport
        assert cluster.run(host, ["hostname"]).stdout.strip() == host.name


def test_a_send_during_a_rekey_waits_without_the_channel_lock(cluster2, tmp_path, monkeypatch):
    """While a key exchange is in progress (paramiko clears ``clear_to_send``) our send waits
    *without* holding the channel's lock: paramiko's transport thread may need that lock to
    get through the exchange. It goes out once the exchange is over; one that never ends
    gives up after REKEY_WAIT_S instead of hanging the pinger or a teardown."""
    import threading

    from ftbundle import cluster as C
    from ftbundle.inventory import load_hosts

    host = load_hosts(cluster2.write_inventory(tmp_path / "hosts.yml"), "trainers")[0]
    with C.Cluster([host]) as cluster:
        cluster.open()
        transport = cluster._transport(host)
        proc = cluster.start(host, ["bash", "-c", "read -r line; echo \"got $line\""])
        transport.clear_to_send.clear()  # as paramiko does when a key exchange begins
        result = []
        sender = threading.Thread(target=lambda: result.append(proc.send(b"ping\n")))
        sender.start()
        time.sleep(0.7)
        assert sender.is_alive() and proc.chan.lock.acquire(blocking=False)  # waiting, lock free
        proc.chan.lock.release()
        transport.clear_to_send.set()  # the exchange is over
        sender.join(5)
        assert result == [True]
        proc.close_stdin()
        assert proc.wait(timeout=10) == 0 and proc.read_out().strip() == b"got ping"

        monkeypatch.setattr(C.paramiko_fixes, "REKEY_WAIT_S", 1)
        proc = cluster.start(host, ["cat"])
        transport.clear_to_send.clear()
        began = time.monotonic()
        assert proc.send(b"x") is False and 0.9 < time.monotonic() - began < 5
        transport.clear_to_send.set()
        proc.close()
        assert cluster.run(host, ["hostname"]).stdout.strip() == host.name


def test_a_stream_through_many_real_rekeys_to_a_command_that_prints_as_it_reads(cluster2, tmp_path):
    """A long stream (ftbundle/stage.py feeding a model to the first host) into a command that
    reads slowly (the peer's window stays full) and prints as it goes: each rekey that begins
    while a send waits for the window must be waited out without the channel's lock (the
    transport thread needs it to hand over what the command prints). It deadlocked at 512 MiB,
    paramiko's rekey threshold, on capped links; here the threshold is 256 KiB, so a 24 MiB
    stream goes through dozens of real key exchanges with sshd."""
    from ftbundle import cluster as C
    from ftbundle.inventory import load_hosts

    host = load_hosts(cluster2.write_inventory(tmp_path / "hosts.yml"), "trainers")[0]
    reader = ("import sys, time\nn = 0\nwhile chunk := sys.stdin.buffer.read1(65536):\n    n += len(chunk)\n"
              "    print('read', n, flush=True)\n    time.sleep(0.002)\nprint('total', n, flush=True)\n")
    with C.Cluster([host]) as cluster:
        cluster.open()
        transport = cluster._transport(host)
        transport.packetizer.REKEY_BYTES = 256 << 10  # (paramiko's: 512 MiB; a class attribute, shadowed here)
        kex = []
        original = transport._send_kex_init
        transport._send_kex_init = lambda: (kex.append(time.monotonic()), original())[1]
        proc = cluster.start(host, ["python3", "-c", reader])
        out = []
        import threading

        drain = threading.Thread(target=lambda: [out.append(c) for c in iter(proc.read_out, b"")], daemon=True)
        drain.start()
        chunk = bytes(range(256)) * 4096  # 1 MiB
        began = time.monotonic()
        sent = [proc.send(chunk) for _ in range(24)]
        proc.close_stdin()
        assert proc.wait(timeout=60) == 0
        drain.join(10)
        assert sent == [True] * 24, (sent, time.monotonic() - began)
        assert b"".join(out).decode().strip().splitlines()[-1] == f"total {24 << 20}"
        assert len(kex) >= 20, len(kex)  # (our side began them: the threshold counts what we send)
        assert transport.is_active() and cluster.run(host, ["hostname"]).stdout.strip() == host.name


def test_a_start_guard_never_closes_a_command_sshd_said_yes_to(cluster2, tmp_path, monkeypatch):
    """A start's time limit closes a channel whose exec request sshd never answers, and only
    that. sshd's "yes" is settled where paramiko reads it: an exec that succeeded just before
    the limit runs its command, however late exec_command itself gets to return (held back 1 s
    past a 0.5 s limit here; the guard used to close it and report "did not answer"). A session
    process that really never answers (SIGSTOPped) still ends the start at the limit, named."""
    import paramiko

    from ftbundle import cluster as C
    from ftbundle.inventory import load_hosts

    host = load_hosts(cluster2.write_inventory(tmp_path / "hosts.yml"), "trainers")[0]
    original = paramiko.Channel.exec_command

    def late(self, command):
        original(self, command)
        time.sleep(1.0)  # answered in time; this thread was not scheduled again before the limit

    with C.Cluster([host]) as cluster:
        cluster.open()
        monkeypatch.setattr(paramiko.Channel, "exec_command", late)
        proc = cluster.start(host, ["bash", "-c", "echo ran"], timeout=0.5)
        assert proc.wait(timeout=10) == 0 and proc.read_out().strip() == b"ran"
        monkeypatch.setattr(paramiko.Channel, "exec_command", original)

        session = " ".join(cluster2.exec(host.name, "pgrep -f '[s]shd: root@notty'").stdout.split())
        assert session, "no sshd session process for this connection"

        def unanswered(self, command):  # the channel is open; its session process stops before the exec
            cluster2.exec(host.name, f"kill -STOP {session}")
            original(self, command)

        monkeypatch.setattr(paramiko.Channel, "exec_command", unanswered)
        try:
            began = time.monotonic()
            with pytest.raises(C.HostUnreachable, match="did not answer the request to start the command within 2s"):
                cluster.start(host, ["true"], timeout=2)
            assert time.monotonic() - began < 6
        finally:
            cluster2.exec(host.name, f"kill -CONT {session}")


def test_chatty_rank0_is_never_taken_for_lost(cluster2, tmp_path):
    """Rank 0 prints ~1 MB/s (10,000 lines a second) and a 10 MB burst; ftbundle's stdout is
    a pipe nobody reads for a while. The run still ends with exit 0, the node log holds every
    line in order, and the terminal says how many lines it skipped instead of blocking."""
    chatty = cluster2.shared_dir / "chatty.py"
    chatty.write_text(
        "import sys, time\n"
        "n, start = 0, time.monotonic()\n"
        "while time.monotonic() - start < 8:\n"
        "    for _ in range(100):\n"
        "        sys.stdout.write(f'line {n:09d} ' + 'x' * 85 + '\\n'); n += 1\n"
        "    time.sleep(0.01)\n"
        "burst = ''.join(f'line {i:09d} ' + 'y' * 85 + '\\n' for i in range(n, n + 100000))\n"
        "sys.stdout.write(burst); n += 100000\n"
        "sys.stdout.write(f'total {n}\\n')\n")
    job = command_job(cluster2, tmp_path, "chatty",
                      f'if [ "$NODE_RANK" = 0 ]; then {sys.executable} {chatty}; else sleep 9; fi')
    proc = subprocess.Popen([sys.executable, "-m", "ftbundle", "run", "-v", str(job)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(6)  # the "terminal" falls behind: nobody reads stdout for a while
    out, err = proc.communicate(timeout=120)
    out, err = out.decode(), err.decode()
    assert proc.returncode == 0, err[-3000:]
    assert "no heartbeat" not in err
    log = (only_run_dir(cluster2.shared_dir) / "node-0-node0.a1.log").read_text()
    lines = log.splitlines()
    total = int(lines[-1].split()[1])
    assert total > 100000 + 40000 and len(lines) == total + 1
    assert all(line.startswith(f"line {i:09d} ") for i, line in enumerate(lines[:-1]))
    assert f"total {total}" in out  # rank 0's output is drained before ftbundle returns
    assert re.search(r"\d+ line\(s\) not shown: the terminal fell behind \(full log: \S+node-0-node0\.a1\.log\)", out)


def test_fresh_shared_dir_is_created_and_proven_shared(cluster2, tmp_path):
    """site.yml mounts the share; nothing creates ftbundle's directory in it. The check creates
    it on rank 0 and the sentinel round proves every host sees it."""
    fresh = cluster2.shared_dir / "ftbundle"
    assert not fresh.exists()
    job = command_job(cluster2, tmp_path, "fresh", 'echo "rank $NODE_RANK in $PWD"', shared_dir=str(fresh))
    result = ftbundle("run", "-v", str(job), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "check passed" in result.stderr
    assert fresh.is_dir() and (fresh / "runs").is_dir()
    assert f"rank 0 in {fresh}" in result.stdout
    assert not list(fresh.glob(".ftb-check-*"))  # the sentinels are gone


def test_node_channels_wait_at_the_gate_until_staging_succeeds(cluster2, tmp_path):
    """The node channels open while rank 0 stages the run directory, but no node program runs
    before staging has succeeded: here staging fails on node0 (check off; shared_dir is local
    to each host and its runs/ is a file on node0 alone), and node1, whose channel was already
    open, never runs the job, creates nothing and leaves no process."""
    for host in cluster2.hosts:
        cluster2.exec(host, "mkdir -p /var/tmp/gate && rm -f /tmp/ran")
    cluster2.exec("node0", "touch /var/tmp/gate/runs")
    job = command_job(cluster2, tmp_path, "gate", "touch /tmp/ran", shared_dir="/var/tmp/gate", check=False)
    result = ftbundle("run", "-v", str(job), timeout=60)
    assert result.returncode == 1, result.stderr
    assert "could not write /var/tmp/gate/runs/gate-" in result.stderr and "on node0" in result.stderr
    assert "nothing was started" in result.stderr and "Traceback" not in result.stderr
    for host in cluster2.hosts:
        assert cluster2.exec(host, "ls /tmp/ran", check=False).returncode != 0, host
    assert cluster2.exec("node1", "ls -A /var/tmp/gate").stdout.strip() == ""  # not even the run dir
    assert job_processes(cluster2) == {}


def test_unshared_parent_is_named_as_such(cluster2, tmp_path):
    """A directory that is local to each host: created on rank 0, unseen by the other, and the
    message says the parent is not the same storage (which is true here)."""
    for host in cluster2.hosts:  # the parent exists on both hosts, each its own local directory
        cluster2.exec(host, "mkdir -p /var/tmp/not-shared")
    job = command_job(cluster2, tmp_path, "unshared", "true", shared_dir="/var/tmp/not-shared/ftbundle")
    result = ftbundle("run", "-v", str(job), timeout=120)
    assert result.returncode == 2, result.stderr
    assert ("shared_dir /var/tmp/not-shared/ftbundle was just created on node0 (rank 0), but node1 does not see "
            "it: /var/tmp/not-shared on node1 is not the same storage as on node0") in result.stderr
    assert "nothing was started" in result.stderr
    # a parent that does not exist at all on a host (a mount missing there) is named as such
    cluster2.exec("node0", "mkdir -p /mnt/share")
    job = command_job(cluster2, tmp_path, "unshared", "true", shared_dir="/mnt/share/ftbundle")
    result = ftbundle("run", "-v", str(job), timeout=120)
    assert result.returncode == 2
    assert ("/mnt/share, the parent of shared_dir /mnt/share/ftbundle, does not exist on node1 "
            "(shared storage not mounted there?)") in result.stderr
    assert "not the same storage" not in result.stderr


def test_ctrl_c_during_the_check_exits_within_2s(cluster2, tmp_path):
    """The probe hangs (an interpreter that takes 60 s to answer): Ctrl-C still ends ftbundle
    at once, exit 130, and no run was started."""
    slow = cluster2.shared_dir / "slow-python"
    slow.write_text(f"#!/bin/sh\nsleep 60\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    job = command_job(cluster2, tmp_path, "slowcheck", "sleep 60", runtime={"kind": "host", "python": str(slow)})
    proc = start_ftbundle("run", "-v", str(job))
    try:
        deadline = time.monotonic() + 30
        while not any("slow-python" in " ".join(p) for p in _procs(cluster2).values()):
            assert time.monotonic() < deadline and proc.poll() is None, "the probe never started"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    assert took < 2, f"{took:.1f}s"
    assert not (cluster2.shared_dir / "runs").exists()


def _procs(cluster) -> dict[str, list[str]]:
    return {h.name: cluster.exec(h, "ps -eo args", check=False).stdout.splitlines() for h in cluster.hosts}


def test_heartbeat_clock_starts_when_the_program_runs(cluster2, tmp_path):
    """A node whose start is slow (its env file takes 7 s, longer than the 5 s give-up) is
    STARTING, not silent: the run goes through."""
    env_file = cluster2.shared_dir / "slow.env"
    env_file.write_text("sleep 7\nSLOW_ENV=loaded\n")
    job = command_job(cluster2, tmp_path, "slowstart", 'echo "env $SLOW_ENV"',
                      runtime={"kind": "host", "python": sys.executable, "env_file": str(env_file)})
    result = ftbundle("run", "-v", str(job), "--no-check", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "env loaded" in result.stdout and "heartbeat" not in result.stderr


def test_a_node_heard_late_by_a_busy_launcher_is_not_lost(cluster2, tmp_path):
    """The launcher's own thread for node1 falls 18 s behind (held in its line handler, as
    3,000 threads waiting for 2 cores and the GIL held them at 1,024 simulated hosts) while
    node1 beats on: past 3 x the give-up its channel holds heartbeats no one has read yet, so
    the silence is ours, not the node's, and the run goes through (it used to end in "no
    heartbeat for 15s although its host answers", exit 255)."""
    job = command_job(cluster2, tmp_path, "unheard", "sleep 24")
    driver = ("import sys, time\n"
              "from ftbundle.launch import node as N\n"
              "original, held = N.NodeRunner._on_line, []\n"
              "def late(self, line):\n"
              "    if self.rank == 1 and line.startswith(b'ftb-hb') and not held:\n"
              "        held.append(time.monotonic()); time.sleep(18)\n"
              "    return original(self, line)\n"
              "N.NodeRunner._on_line = late\n"
              "from ftbundle.cli import main\n"
              "code = main(['run', '-v', sys.argv[1], '--no-check'])\n"
              "print('held', len(held), file=sys.stderr)\n"
              "sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", driver, str(job)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert "held 1" in result.stderr, result.stderr
    assert result.returncode == 0 and "no heartbeat" not in result.stderr, result.stderr[-3000:]


def test_restart_is_a_new_attempt_that_never_replays_the_old_one(cluster2, tmp_path):
    """Attempt 1 fails on rank 1; attempt 2 runs with its own marker, pid, exit and log files,
    after the old processes were confirmed gone; the terminal shows each attempt once."""
    job = command_job(cluster2, tmp_path, "attempts",
                      'echo "attempt $FTB_ATTEMPT rank $NODE_RANK"; '
                      'if [ "$FTB_ATTEMPT" = 1 ] && [ "$NODE_RANK" = 1 ]; then sleep 1; exit 3; fi; sleep 2',
                      restarts=1)
    result = ftbundle("run", "-v", str(job), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("attempt 1 rank 0") == 1 and result.stdout.count("attempt 2 rank 0") == 1
    assert result.stdout.index("attempt 1 rank 0") < result.stdout.index("attempt 2 rank 0")
    assert "every process of attempt 1 is gone; restarting all nodes" in result.stderr
    run = only_run_dir(cluster2.shared_dir)
    assert (run / "node-1.a1.exit").read_text().strip() == "3"
    assert (run / "node-1.a2.exit").read_text().strip() == "0"
    assert (run / "node-0-node0.a1.log").read_text() == "attempt 1 rank 0\n"
    assert (run / "node-0-node0.a2.log").read_text() == "attempt 2 rank 0\n"
    markers = {(run / f"node-0.a{a}.pid").read_text().split()[1] for a in (1, 2)}
    assert markers == {f"{run.name}.a1-0", f"{run.name}.a2-0"}
    assert (run / "attempt").read_text().strip() == "2"
    status = ftbundle("status", str(job), timeout=60)
    assert "attempt 2" in status.stdout and "state: finished" in status.stdout


def test_no_restart_on_a_host_that_cannot_be_fenced(cluster2, tmp_path):
    """A partitioned node cannot be confirmed stopped: ftbundle does not relaunch beside it."""
    job = command_job(cluster2, tmp_path, "fence", 'echo "up $NODE_RANK"; sleep 120', restarts=2)
    proc = start_ftbundle("run", "-v", str(job))
    try:
        assert "up 0" in proc.stdout.readline()
        cluster2.partition("node1")
        cut = time.monotonic()
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - cut
    finally:
        proc.kill()
        cluster2.heal("node1")
    assert proc.returncode == 255, err
    assert "node node1 (node rank 1" in err and "no heartbeat" in err
    assert "not restarting: the old processes could not be confirmed gone" in err and "node1 is unreachable" in err
    assert "restarting all nodes" not in err
    assert took < 30, f"{took:.1f}s"
    run = only_run_dir(cluster2.shared_dir)
    assert not list(run.glob("*.a2.*"))


def test_restarts_with_detach_is_refused_before_anything_starts(cluster2, tmp_path):
    job = command_job(cluster2, tmp_path, "detach-restarts", "sleep 30", restarts=1)
    before = logins(cluster2)
    result = ftbundle("run", str(job), "--detach", timeout=60)
    assert result.returncode == 2
    assert "key 'restarts'" in result.stderr and "--detach cannot restart" in result.stderr
    assert logins(cluster2) == before and not (cluster2.shared_dir / "runs").exists()


def test_detached_run_stops_when_a_host_powers_off(cluster2, tmp_path):
    """No controller is watching a detached run: each node beats into a file on shared storage,
    and the survivors stop once a peer's file goes stale (no .exit file ever comes from a host
    that lost power)."""
    job = command_job(cluster2, tmp_path, "poweroff", "sleep 300")
    assert ftbundle("run", str(job), "--detach", timeout=60).returncode == 0
    run = only_run_dir(cluster2.shared_dir)
    deadline = time.monotonic() + 20
    while not ((run / "node-0.a1.hb").exists() and (run / "node-1.a1.hb").exists()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert set(job_processes(cluster2)) == {"node0", "node1"}
    cluster2.kill("node1")
    killed = time.monotonic()
    while job_processes(cluster2) and time.monotonic() - killed < 60:
        time.sleep(0.5)
    took = time.monotonic() - killed
    assert job_processes(cluster2) == {}, "node0 kept running beside a dead peer"
    assert took < 35, f"{took:.1f}s"
    assert "node-1.a1.hb unchanged for 20s" in (run / "node-0-node0.a1.log").read_text()
