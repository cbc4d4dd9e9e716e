"""Shared storage that stops answering (issue 37 item 4), without containers: the words
(:class:`ftbundle.launch.storage.StorageWatch`), and the real node program beating on while a
`stat` under shared_dir hangs (a stand-in `stat` first on PATH that waits while a file exists,
and ignores SIGTERM as a process in D state ignores everything). The real freeze, sshfs in
containers, is tests/cluster/test_storage_hang.py."""

from __future__ import annotations

import re
import subprocess
import time

from ftbundle.launch.node import env_payload, program
from ftbundle.launch.storage import StorageWatch
from ftbundle.rundir import RunDir


def test_a_node_that_reports_its_storage_stuck_is_named_once_with_path_and_host():
    watch = StorageWatch("/shared", ["node0", "node1"])
    said = watch.observe(1, "5", at=100.0)
    assert said.startswith("shared storage /shared on node1 not answering for 5s"), said
    assert watch.observe(1, "6", at=101.0) is None  # (said once per freeze)
    assert watch.stuck() == [1]
    assert watch.describe(110.0) == "shared storage /shared on node1 not answering for 15s"
    watch.observe(0, "5", at=108.0)
    assert watch.describe(110.0) == "shared storage /shared on node[0-1] not answering for 15s"
    assert watch.observe(1, "ok", at=120.0) == "shared storage /shared on node1 answers again (after 25s)"
    assert watch.stuck() == [0] and watch.observe(1, "ok", at=121.0) is None
    assert watch.observe(0, "garbage", at=122.0) is None


FAKE_STAT = r"""#!/bin/bash
# stat, but a never-used name under the frozen directory (the storage probe), or the frozen
# filesystem itself (stat -f), waits while $FREEZE exists, deaf to SIGTERM as a process in D state
# is deaf to everything
trap '' TERM
for a; do
  case $1:$a in *:"$FROZEN"/.ftb-probe-*|-f:"$FROZEN") while [ -e "$FREEZE" ]; do sleep 0.05; done ;; esac
done
exec /usr/bin/stat "$@"
"""


def test_node_program_beats_on_and_says_its_storage_does_not_answer(tmp_path):
    import threading

    bin_dir, shared = tmp_path / "bin", tmp_path / "shared"
    bin_dir.mkdir()
    shared.mkdir()
    (bin_dir / "stat").write_text(FAKE_STAT)
    (bin_dir / "stat").chmod(0o755)
    freeze = tmp_path / "freeze"
    (shared / "rank.log").write_text("x" * 7)
    env = {"FTB_RUN_DIR": str(shared), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(tmp_path / "job.log"),
           "FTB_EXIT": str(tmp_path / "node.exit"), "FTB_PIDFILE": str(tmp_path / "node.pid"),
           "FTB_HBFILE": str(tmp_path / "node.hb"), "FTB_MARKER": "ftb-test-storage", "FTB_ATTEMPT": "1",
           "FTB_WATCHDOG": "30", "FTB_HEARTBEAT": "0.2", "FTB_STOP_GRACE": "1", "FTB_DETACH": "0",
           "FTB_PROGRESS_FILES": f"{shared}/*.log", "FTB_PROGRESS_EVERY": "1", "FTB_SHARED_DIR": str(shared),
           "FTB_STORAGE_SLOW": "1"}
    job = f"while [ ! -e {tmp_path}/end ]; do sleep 0.1; done; exit 3"
    proc = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sh", "-c", job],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                                 "FROZEN": str(shared), "FREEZE": str(freeze)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.decode().rstrip("\n") for line in proc.stderr),
                              daemon=True)
    reader.start()

    def wait_for(text: str, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [i for i, line in enumerate(list(lines)) if line == text]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in {timeout}s: {lines}")

    try:
        proc.stdin.write(env_payload(env))
        proc.stdin.flush()
        wait_for("ftb-hb 7")  # beating, with readings
        freeze.touch()
        most = 0
        frozen_at = time.monotonic()
        while time.monotonic() - frozen_at < 3:  # the stand-in stats that wait: at most one at a time
            ps = [line.split(None, 2) for line in subprocess.run(
                ["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=False).stdout.splitlines()]
            fakes = {pid: ppid for pid, ppid, *args in ps if args and f"{bin_dir}/stat" in args[0]}
            most = max(most, sum(ppid not in fakes for ppid in fakes.values()))  # (not its own `sleep`s)
            time.sleep(0.05)
        first = next(i for i, line in enumerate(list(lines)) if line.startswith("ftb-storage "))
        freeze.unlink()
        ok = wait_for("ftb-storage ok")
        deadline = time.monotonic() + 10
        while "ftb-hb 7" not in lines[ok:] and time.monotonic() < deadline:
            time.sleep(0.05)
        freeze.touch()  # frozen again when the job ends (exit 3): the node program still ends
        (tmp_path / "end").touch()
        t0 = time.monotonic()
        code = proc.wait(timeout=20)
        ended_after = time.monotonic() - t0
    finally:
        freeze.unlink(missing_ok=True)
        (tmp_path / "end").touch()
        proc.kill()
    reader.join(5)
    proc.stdin.close()
    assert code == 3, lines
    assert most == 1, most
    assert lines[first] in ("ftb-storage 1", "ftb-storage 2"), lines
    frozen = lines[first:ok]
    # beats went on meanwhile, without progress readings (those wait on the storage)
    assert sum(line == "ftb-hb" for line in frozen) >= 3, lines
    assert "ftb-hb 7" in lines[ok:], lines  # readings again once it answers
    assert 2 <= ended_after < 8, (ended_after, lines)  # (its disk-full look at the end waits 2 s, no more)

def test_check_names_storage_that_does_not_answer_and_not_as_a_missing_directory():
    from ftbundle.check.rules import check_dirs, check_storage_answers
    from ftbundle.facts import parse_facts

    frozen = {"storage": {"shared_dir": {"path": "/shared", "not_answering_s": 5.0}}}
    fine = {"storage": {"shared_dir": {"path": "/shared", "exists": True, "parent_exists": True, "written": True,
                                       "seen": [0, 1]}}}
    facts = [parse_facts("node0", 0, fine), parse_facts("node1", 1, frozen)]
    check = check_storage_answers(facts)
    assert not check.ok and check.messages() == [(
        "storage: shared storage /shared (shared_dir) on node1 not answering for 5s: a stat under it got no "
        "answer (a hung network filesystem: its server down, or the network to it cut?); every process that "
        "touches it waits until it answers")]
    assert check_storage_answers([facts[0]]) is None

    class Layout:
        workdir = shared_dir = "/shared"
    assert check_dirs(facts, Layout()).ok  # (not "does not exist": it did not answer)


def marked(marker: str, name: str = "FTB_JOB") -> list[int]:
    """The processes with NAME=MARKER in their environment."""
    import os

    want = f"{name}={marker}".encode()
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_detached_node_stops_its_job_when_the_storage_freezes_after_a_reading(tmp_path):
    """A detached node's stall watchdog whose reading answered and whose next step (reading the
    nodes' progress files) then waits on the storage: the watchdog itself never waits there, so it
    still stops the job at stall_timeout, and says why once the storage answers. (The freeze: a
    FIFO as a peer's progress file, whose open waits in the kernel for a writer as a read of a
    frozen filesystem waits for its server; the watcher's writes asked after it wait behind it.)"""
    import os
    from pathlib import Path

    from ftbundle.launch.stall import watcher_source

    shared = tmp_path / "shared"
    run = RunDir(str(shared), "r")  # (the names the launcher gives every node: ftbundle/rundir.py)
    Path(run.path).mkdir(parents=True)
    Path(run.watcher_program).write_text(watcher_source())  # (staged by the launcher)
    files = run.node(0, "h", 1)
    marker = f"ftb-test-detached-{time.time_ns()}"
    env = {**run.env(1), **files.env(), "FTB_REFEREE": "1", "NODE_RANK": "0", "NNODES": "2",
           "FTB_WATCHER_PROGRAM": run.watcher_program, "FTB_WORKDIR": str(tmp_path), "FTB_MARKER": marker,
           "FTB_ATTEMPT": "1", "FTB_WATCHDOG": "30", "FTB_HEARTBEAT": "0.5", "FTB_STOP_GRACE": "1",
           "FTB_DETACH": "1", "FTB_STALE": "600", "FTB_STALL_TIMEOUT": "3",
           "FTB_PROGRESS_FILES": f"{shared}/rank*.out", "FTB_SHARED_DIR": str(shared)}
    job = f"while :; do echo step >> {shared}/rank0.out; sleep 0.2; done"
    run_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    progress, stopped, log = Path(files.progress), Path(files.stopped), Path(files.log)
    frozen = Path(run.node(1, "h1", 1).progress)  # node 1's progress file: the FIFO

    def thaw() -> None:
        try:
            fd = os.open(frozen, os.O_WRONLY | os.O_NONBLOCK)  # (ENXIO: nobody waits on it)
        except OSError:
            return
        os.write(fd, b" 1\n")
        os.close(fd)

    try:
        node = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sh", "-c", job], stdin=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=run_env)
        node.stdin.write(env_payload(env))
        node.stdin.flush()  # (kept open: a closed one before the job starts means the launcher is gone)
        assert node.wait(timeout=20) == 0, node.stderr.read()
        node.stdin.close()
        node.stderr.close()
        deadline = time.monotonic() + 20
        while not progress.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the watchdog reads every node's progress file at its next reading, once all are there
        os.mkfifo(frozen)
        frozen_at = time.monotonic()
        while marked(marker) and time.monotonic() - frozen_at < 20:
            time.sleep(0.2)
        stopped_after = time.monotonic() - frozen_at
        left_frozen = marked(marker)
        assert not stopped.exists()  # (written once the storage answers)
        thaw()
        deadline = time.monotonic() + 15
        while (marked(marker, "FTB_MARKER") or not stopped.exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        thaw()
        for pid in marked(marker, "FTB_MARKER"):
            subprocess.run(["kill", "-9", str(pid)], check=False)
    assert left_frozen == [], left_frozen
    assert 3 <= stopped_after < 12, stopped_after
    why = stopped.read_text()
    assert re.fullmatch(rf"shared storage {shared} on \S+ not answering for [3-9]s \(stall_timeout 3s\)\n", why), why
    assert "stopped the job on" in log.read_text()
    assert marked(marker, "FTB_MARKER") == []  # the watchers too, once it answered


FAKE_TAIL = r"""#!/bin/bash
# tail, but while $FREEZE exists it is a tail the frozen storage holds: no output, deaf to SIGTERM
# until the storage answers (then the SIGTERM it held ends it)
if [ -e "$FREEZE" ]; then trap '' TERM; while [ -e "$FREEZE" ]; do sleep 0.05; done; exit 143; fi
exec /usr/bin/tail "$@"
"""


def test_logs_follow_says_the_storage_does_not_answer_and_ends_with_the_job(tmp_path):
    """`ftbundle logs -f` (node.sh's follow): while a stat under the shared storage hangs, its
    stderr names the storage, path and host, after FTB_STORAGE_SLOW and not again within 30 s;
    once it answers, that is said; a tail the storage still holds when the job is gone does
    not keep the follow (the channel) open: it ends saying the log's end could not be read."""
    from ftbundle.launch.node import node_argv

    bin_dir, shared = tmp_path / "bin", tmp_path / "shared"
    run_dir = shared / "runs" / "r1"
    bin_dir.mkdir()
    run_dir.mkdir(parents=True)
    for name, text in (("stat", FAKE_STAT), ("tail", FAKE_TAIL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = run_dir / "node-0.log"
    log.write_text("before the freeze\n")
    freeze, end = tmp_path / "freeze", tmp_path / "end"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FROZEN": str(shared), "FREEZE": str(freeze), "FTB_STORAGE_SLOW": "1"}
    marker = "ftb-test-follow"

    def job():  # a job process of the run until `end` exists
        return subprocess.Popen(["bash", "-c", f"while [ ! -e {end} ]; do sleep 0.1; done"],
                                env={**env, "FTB_JOB": marker})

    # 1. frozen for a while, then answering: said, then said to answer again; the log comes whole
    running = job()
    follow = subprocess.Popen(node_argv("follow", marker, str(log), "10", str(shared)), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    freeze.touch()
    time.sleep(3.5)
    freeze.unlink()
    time.sleep(2.5)
    with open(log, "a") as f:
        f.write("after the thaw\n")
    time.sleep(1.5)
    end.touch()
    out, err = follow.communicate(timeout=30)
    running.wait(5)
    assert follow.returncode == 0, err
    assert out == "before the freeze\nafter the thaw\n", out
    said = err.splitlines()
    assert len(said) == 2 and re.fullmatch(rf"ftbundle: shared storage {shared} on \S+ not answering for [1-3]s: the "
                                           r"log cannot be read \(and every rank that writes there waits too\)",
                                           said[0]), err
    assert re.fullmatch(rf"ftbundle: shared storage {shared} on \S+ answers again", said[1]), err

    # 2. frozen when the job ends (its tail held): the follow ends anyway, and says why
    end.unlink()
    freeze.touch()
    try:
        running = job()
        follow = subprocess.Popen(node_argv("follow", marker, str(log), "10", str(shared)), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.5)
        end.touch()
        started = time.monotonic()
        out, err = follow.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        freeze.unlink()
    assert follow.returncode == 3 and out == "", (out, err)
    assert "not answering for" in err and err.strip().endswith(
        f"ftbundle: the end of the log could not be read: shared storage {shared} on "
        f"{err.split(' on ')[1].split()[0]} does not answer"), err
    assert took < 9, took  # the job's end seen within a second, 3 s for a last answer, tail's last read, 2 s for cat
