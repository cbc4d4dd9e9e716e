"""Hung storage only on evidence (issue 44 item 7): a reading of shared storage that has not
answered is named hung only when its process is held in the kernel while its host runs; a
host too busy to run it (256 hosts' probes on 2 cores) is starved, said so, and waited for.

The rule (ftbundle/remote/evidence.py) as a table; its reading of /proc on real processes; the
launcher's words for what node programs report (launch/storage.py); the check's words
(check/rules.py); and the real node program, whose reading is stopped before it runs (a
stand-in `stat` that stops itself: a process the kernel does not run, as a starved host's is
not run). The real freeze and a really starved container host: tests/cluster/test_storage_hang.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from ftbundle.check import probe_source
from ftbundle.facts import parse_facts
from ftbundle.launch.node import program
from ftbundle.launch.storage import STORAGE_PATIENCE_S, StorageWatch
from ftbundle.protocol import env_payload
from ftbundle.remote.evidence import HUNG, STARVED, WAITING, read_process, storage_verdict


@pytest.mark.parametrize(("state", "wchan", "control", "seconds", "verdict"), [
    ("S", "request_wait_answer", True, 5, HUNG),  # sshfs/FUSE, frozen
    ("D", "request_wait_answer", True, 9, HUNG),  # ... after a signal
    ("D", "rpc_wait_bit_killable", True, 5, HUNG),  # NFS
    ("D", "rwsem_down_read_slowpath", True, 5, HUNG),  # the directory's lock, held by a process stuck in it
    ("S", "0", True, 5, HUNG),  # asleep in its one system call, where not shown
    ("S", "request_wait_answer", True, 4.9, WAITING),  # not slow yet
    ("R", "0", True, 5, STARVED),  # runnable, not run: the host's CPUs are taken
    ("R", "0", True, 60, STARVED),
    (None, "", True, 5, STARVED),  # not at its program yet (a fork that has not run)
    ("S", "request_wait_answer", False, 5, STARVED),  # the control did not answer either
    ("D", "io_schedule", True, 5, STARVED),  # this host's own disk (a page of its program)
    ("D", "folio_wait_bit_common", True, 5, STARVED),
    ("T", "do_signal_stop", True, 5, STARVED),  # stopped: not run
    ("Z", "0", True, 5, WAITING),  # it has just ended: answered
])
def test_the_storage_is_named_only_on_evidence(state, wchan, control, seconds, verdict):
    assert storage_verdict(state, wchan, control, seconds, 5) == verdict


def test_read_process_sees_a_sleeper_a_stopped_one_and_a_gone_one():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        state, wchan, prog = read_process(sleeper.pid)
        assert (state, prog) == ("S", "sleep") and wchan not in ("", "0"), (state, wchan)
        sleeper.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert read_process(sleeper.pid)[0] == "T"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert read_process(sleeper.pid) == (None, "", "")


def test_the_launcher_says_a_starved_host_once_and_names_the_storage_only_on_evidence():
    watch = StorageWatch("/shared", ["node0", "node1"])
    said = watch.observe(1, "6 R 0 140.5", at=100.0)
    assert said == ("host node1 is starved: its reading of shared storage /shared has waited 6s to be run (its "
                    "process runnable (R), not run; load 140.5): its CPUs are taken, not a hung filesystem; "
                    f"waiting up to {STORAGE_PATIENCE_S}s more"), said
    assert watch.observe(1, "7 - 0 140.5", at=101.0) is None  # (said once)
    assert watch.stuck() == []  # the stall watchdog does not blame the storage
    assert watch.observe(1, "ok", at=102.0) is None  # (nothing was said to be stuck)
    # the bare line: the node saw its reading held in the kernel
    assert watch.observe(0, "5", at=110.0).startswith("shared storage /shared on node0 not answering for 5s")
    # starved for all the longer wait: given up on, and said why
    late = 5 + STORAGE_PATIENCE_S
    said = watch.observe(1, f"{late} R 0 90", at=140.0)
    assert said == (f"shared storage /shared on node1 not answering for {late}s: its host too busy to run a "
                    "reading of it all that time (its process runnable (R), not run; load 90)"), said
    assert watch.stuck() == [0, 1]


def test_the_probe_waits_for_a_reading_its_host_has_not_run_instead_of_calling_it_hung(tmp_path):
    """The real probe, told to give up on its storage at once (storage_answer_s 0): its child,
    just forked, has not run (nor has its control), so it is waited for, not named hung."""
    spec = {"rank": 0, "workdir": str(tmp_path), "token": None, "expect": [0], "sentinel_wait_s": 1,
            "storage": [{"name": "shared_dir", "path": str(tmp_path), "create": False}],
            "storage_answer_s": 0, "storage_patience_s": 20}
    proc = subprocess.run([sys.executable, "-S", "-", json.dumps(spec)], input=probe_source(), capture_output=True,
                          timeout=60, check=False)
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    storage = out["storage"]["shared_dir"]
    assert "not_answering_s" not in storage, out
    assert storage.get("slow", {"verdict": STARVED})["verdict"] == STARVED, out  # (or it had answered by then)
    assert storage["exists"] and out["workdir_ok"], out  # what lives under it was looked at


def storage_facts(host, rank, **storage):
    return parse_facts(host, rank, {"storage": {"shared_dir": {"path": "/shared", "exists": True,
                                                               "parent_exists": True, **storage}}})


def test_the_check_warns_of_starved_hosts_and_fails_hung_storage_with_its_evidence():
    from ftbundle.check.rules import check_storage_answers

    starved = {"verdict": "starved", "waited_s": 9.2, "state": "R", "wchan": "0", "load": 140.2}
    fine = storage_facts("node0", 0, written=True, seen=[0, 1, 2])
    facts = [fine, storage_facts("node1", 1, written=True, seen=[0, 1, 2], slow=starved),
             storage_facts("node2", 2, written=True, seen=[0, 1, 2], slow={**starved, "state": None, "load": 120})]
    check = check_storage_answers(facts)
    assert check.ok, check.messages()
    assert check.warnings == ["hosts node[1-2] are starved: a stat under /shared (shared_dir) waited to be run for 9s "
                              "(its process not started, runnable (R), not run; load 140.2): its CPUs are taken, "
                              "not a hung filesystem"], check.warnings
    # not run in all the longer wait: a failure, still worded as the host's
    busy = storage_facts("node1", 1, not_answering_s=35.1, slow={**starved, "waited_s": 35.1})
    check = check_storage_answers([fine, busy])
    assert check.messages() == ["storage: host node1 is starved: a stat under /shared (shared_dir) was not run in 35s "
                                "(its process runnable (R), not run; load 140.2): its CPUs are taken, not a hung "
                                "filesystem"], check.messages()
    # hung: the evidence said
    hung = storage_facts("node1", 1, not_answering_s=5.0, slow={"verdict": "hung", "waited_s": 5.0, "state": "S",
                                                                 "wchan": "request_wait_answer", "load": 0.4})
    assert check_storage_answers([fine, hung]).messages() == [
        "storage: shared storage /shared (shared_dir) on node1 not answering for 5s: a stat under it got no answer, "
        "its process asleep in request_wait_answer (S) while the host ran (a hung network filesystem: its server "
        "down, or the network to it cut?); every process that touches it waits until it answers"]
    # two hosts hung alike make one line, though their waits and loads differ (as they always do):
    # the longest wait is said; a host whose process waits elsewhere gets its own line
    hung2 = storage_facts("node2", 2, not_answering_s=5.6, slow={"verdict": "hung", "waited_s": 5.6, "state": "S",
                                                                  "wchan": "request_wait_answer", "load": 1.7})
    hung3 = storage_facts("node3", 3, not_answering_s=6.0, slow={"verdict": "hung", "waited_s": 6.0, "state": "D",
                                                                  "wchan": "rpc_wait_bit_killable", "load": 0.2})
    said = check_storage_answers([fine, hung, hung2, hung3]).messages()
    assert [m.split(": a stat")[0] for m in said] == [
        "storage: shared storage /shared (shared_dir) on node[1-2] not answering for 6s",
        "storage: shared storage /shared (shared_dir) on node3 not answering for 6s"], said
    assert "asleep in request_wait_answer (S)" in said[0] and "rpc_wait_bit_killable (D)" in said[1], said


STOPPED_STAT = r"""#!/bin/bash
# stat, but a never-used name under the shared directory (the storage reading) is stopped before
# it runs while $STARVE exists: a process the kernel does not run, as a starved host does not
for a; do
  case $a in "$SHARED"/.ftb-probe-*) [ -e "$STARVE" ] && kill -STOP $$ ;; esac
done
exec /usr/bin/stat "$@"
"""


def test_node_program_says_how_its_reading_waits_when_it_is_not_the_storage(tmp_path):
    bin_dir, shared, starve = tmp_path / "bin", tmp_path / "shared", tmp_path / "starve"
    bin_dir.mkdir()
    shared.mkdir()
    (bin_dir / "stat").write_text(STOPPED_STAT)
    (bin_dir / "stat").chmod(0o755)
    (shared / "rank.log").write_text("x" * 7)
    env = {"FTB_RUN_DIR": str(shared), "FTB_WORKDIR": str(tmp_path), "FTB_LOG": str(tmp_path / "job.log"),
           "FTB_EXIT": str(tmp_path / "node.exit"), "FTB_PIDFILE": str(tmp_path / "node.pid"),
           "FTB_HBFILE": str(tmp_path / "node.hb"), "FTB_MARKER": "ftb-test-starved", "FTB_ATTEMPT": "1",
           "FTB_WATCHDOG": "30", "FTB_HEARTBEAT": "0.2", "FTB_STOP_GRACE": "1", "FTB_DETACH": "0",
           "FTB_PROGRESS_FILES": f"{shared}/*.log", "FTB_PROGRESS_EVERY": "1", "FTB_SHARED_DIR": str(shared),
           "FTB_STORAGE_SLOW": "1"}
    end = tmp_path / "end"
    proc = subprocess.Popen(["bash", "-c", program(), "ftb", "node", "sh", "-c",
                             f"while [ ! -e {end} ]; do sleep 0.1; done"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SHARED": str(shared),
                                 "STARVE": str(starve)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.decode().rstrip("\n") for line in proc.stderr),
                              daemon=True)
    reader.start()

    def stopped_stats() -> list[int]:
        found = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                if read_process(int(pid))[::2] == ("T", "stat"):
                    found.append(int(pid))
            except (OSError, ValueError):
                pass
        return found

    try:
        proc.stdin.write(env_payload(env))
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while "ftb-hb 7" not in lines and time.monotonic() < deadline:
            time.sleep(0.05)
        starve.touch()
        deadline = time.monotonic() + 15
        while not any(line.startswith("ftb-storage ") for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        starve.unlink()
        for pid in stopped_stats():
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while "ftb-storage ok" not in lines and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        starve.unlink(missing_ok=True)
        for pid in stopped_stats():
            os.kill(pid, signal.SIGCONT)
        end.touch()
        code = proc.wait(timeout=20)
        reader.join(5)
        proc.stdin.close()
    said = [line for line in lines if line.startswith("ftb-storage ")]
    assert code == 0, lines
    assert said and re.fullmatch(r"ftb-storage [12] T do_signal_stop \d+\.\d+", said[0]), lines
    assert "ftb-storage ok" in said, lines
    watch = StorageWatch(str(shared), ["node0"])
    assert watch.observe(0, said[0].split(" ", 1)[1], at=10.0).startswith("host node0 is starved: "), said
    assert watch.stuck() == []


def test_a_reading_held_before_its_exec_is_said_with_where_it_waits():
    """The node program's reading is a child that is bash until its `exec stat`, and it expands
    the progress globs (the ranks' logs, on shared storage) first: a readdir of frozen storage
    holds it there, asleep in the filesystem. It was said "not started" (its program not
    reached), so a CI run's real sshfs freeze was called a starved host for 35 s and the run's
    stop came 81 s after the freeze. Now its state and where it waits go to the launcher's rule.
    ftb_why itself, on real processes: a bash asleep in the kernel (here a FIFO's read: a wait
    that is not this host's disk or memory), a bash that runs (a busy loop: not at its program,
    as before), one that is gone."""
    source = program()
    why = source[source.index("ftb_why() {"):source.index("\n}\n", source.index("ftb_why() {")) + 3]
    fifo = f"/tmp/ftb-why-{os.getpid()}"
    os.mkfifo(fifo)
    asleep = subprocess.Popen(["bash", "-c", f"read -r x < {fifo}"])
    busy = subprocess.Popen(["bash", "-c", "while :; do :; done"])
    try:
        time.sleep(0.5)

        def ask(pid: int) -> str:
            out = subprocess.run(["bash", "-c", why + f'FTB_ASK_PID={pid}; ftb_why; printf "[%s]" "$FTB_WHY"'],
                                 capture_output=True, text=True, timeout=10)
            return out.stdout

        held, running = ask(asleep.pid), ask(busy.pid)
        gone = ask(999_999_999)
    finally:
        for proc in (asleep, busy):
            proc.kill()
            proc.wait()
        os.unlink(fifo)
    words = held.strip("[]").split()
    assert words[0] == "S" and words[1] not in ("", "0") and float(words[2]) >= 0, held
    watch = StorageWatch("/shared", ["node0"])
    said = watch.observe(0, "6" + held.strip("[]"), at=100.0)
    assert said is not None and "not answering for 6s" in said and "starved" not in said, said
    assert running.startswith("[ - 0 "), running  # (a bash that runs: not held, not started: starved)
    assert gone == "[Z]", gone
