"""The detached watcher (ftbundle/remote/watch.py, issue 44 item 3), without containers: the one
StallClock it ships with, its referee's and followers' decisions as pure functions, and the
shipped program run as the node program starts it. Containers: tests/cluster/test_detach_restart.py,
tests/cluster/test_stall.py and tests/cluster/test_storage_hang.py (detached cases)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time

from ftbundle.launch import stall
from ftbundle.remote import stallclock, watch
from ftbundle.remote.watch import Follower, Referee, culprit, observe_progress, waiting_for_step, wildcard


def shipped_namespace() -> dict:
    """The staged program's text, run as a module (not as __main__: nothing starts)."""
    namespace = {"__name__": "ftb_watch_shipped", "__package__": None}
    exec(compile(stall.watcher_source(), "watch.py", "exec"), namespace)
    return namespace


def test_the_shipped_watcher_carries_the_launchers_own_stall_clock():
    """The stall rule exists once: launch/stall.py's StallClock is remote/stallclock.py's, and the
    program staged for detached nodes carries that module's very text, whose StallClock the
    watcher then uses (not a copy of its own, not ftbundle's: the host cannot import it)."""
    assert stall.StallClock is stallclock.StallClock is watch.StallClock
    source = open(stallclock.__file__).read()
    shipped = stall.watcher_source()
    assert shipped.startswith(source)
    assert inspect.getsource(stallclock.StallClock) in shipped
    assert shipped.count("class StallClock") == 1
    namespace = shipped_namespace()
    clock = namespace["StallClock"]
    assert clock is not stallclock.StallClock and clock.__module__ == "ftb_watch_shipped"
    assert namespace["Watcher"].stall_watch.__globals__["StallClock"] is clock
    # the same rule, step for step
    ours, theirs = stallclock.StallClock(10, wait_for_step=True), clock(10, wait_for_step=True)
    for rank, value, at in [(0, "5 0", 0.0), (1, "7", 1.0), (1, "9", 2.0), (0, "6 10", 3.0), (1, "9", 20.0)]:
        ours.observe(rank, value, at)
        theirs.observe(rank, value, at)
        assert (ours.last_progress, ours.stepped, ours.silent_for(at + 5), ours.stalled(at + 14)) == \
            (theirs.last_progress, theirs.stepped, theirs.silent_for(at + 5), theirs.stalled(at + 14))
    assert ours.last_progress == 3.0 and ours.stalled(13.5) and not ours.stalled(13.0)


def test_the_referee_stops_every_node_for_a_failed_exit_a_request_or_a_silent_heartbeat():
    referee = Referee(stale=20)
    beats = [("node-1.a1.hb", "1\n"), ("node-2.a1.hb", "1\n")]
    assert referee.verdict([], beats, False, 100.0) == "ok"
    assert referee.verdict([("node-2.a1.exit", "0\n")], beats[:1], False, 101.0) == "ok"  # done, not failed
    assert referee.verdict([("node-1.a1.exit", "4\n"), ("node-2.a1.exit", "")], [], False, 102.0) == \
        "stop node-1.a1.exit says exit 4"
    assert referee.verdict([("node-1.a1.exit", "4\n")], [], True, 102.0) == "stop stop requested"
    assert referee.verdict([], beats, True, 102.0) == "stop stop requested"
    # a heartbeat unchanged for the stale time: that node is gone (not before)
    referee = Referee(stale=20)
    assert referee.verdict([], [("node-1.a1.hb", "3\n")], False, 0.0) == "ok"
    assert referee.verdict([], [("node-1.a1.hb", "4\n")], False, 5.0) == "ok"
    assert referee.verdict([], [("node-1.a1.hb", "4\n")], False, 24.9) == "ok"
    assert referee.verdict([], [("node-1.a1.hb", "4\n")], False, 25.0) == \
        "stop node-1.a1.hb unchanged for 20s: that node is gone"
    # rank 0's own end: a success frees the others, a failure stops them
    assert Referee.final("0\n") == "done"
    assert Referee.final("3\n") == "stop rank 0 exited 3"
    assert Referee.final(None) == Referee.final("") == "stop rank 0 exited without a code"


def test_a_detached_runs_told_failure_names_the_host_and_code_its_verdict_stops_on():
    """What the referee's verdict stops on, as a webhook's summary says it (an attached run's
    summary names the failed host and its code; a detached one said only `node-1.a1.hb ...`)."""
    hosts = ["gpu-a", "gpu-b", "gpu-c"]
    assert culprit("node-2.a1.exit says exit 3", hosts) == ("gpu-c", 3)
    assert culprit("node-1.a2.exit says exit -9", hosts) == ("gpu-b", -9)
    assert culprit("node-1.a1.hb unchanged for 20s: that node is gone", hosts) == ("gpu-b", None)
    assert culprit("rank 0 exited 137", hosts) == ("gpu-a", 137)
    assert culprit("rank 0 exited without a code", hosts) == ("gpu-a", None)
    assert culprit("stop requested", hosts) == (None, None)
    assert culprit("node-7.a1.exit says exit 1", hosts) == (None, 1)  # (a plan with fewer hosts: no guess)
    assert culprit("node-1.a1.exit says exit 2", []) == (None, 2)


def test_a_follower_obeys_the_verdict_and_stops_when_it_stops_changing():
    follower = Follower(stale=20)
    assert follower.look("", 0.0) is None  # (no verdict yet: the stale time counts from the start)
    assert follower.look("1 ok", 1.0) is None
    assert follower.look("1 ok", 20.9) is None
    assert follower.look("1 ok", 21.0) == ("silent", None)
    assert Follower(20).look("7 stop node-1.a1.hb unchanged for 20s: that node is gone", 0.0) == \
        ("stop", "node-1.a1.hb unchanged for 20s: that node is gone")
    done = Follower(stale=20)
    assert done.look("8 done", 0.0) is None
    assert done.look("8 done", 100.0) is None and done.look("9 stop late", 101.0) is None  # (nothing to referee)


def test_detached_progress_lines_drive_the_stall_clock_as_the_attached_heartbeats_do():
    clock = stallclock.StallClock(5)
    observe_progress(clock, [("0", " 10"), ("1", " 20")], 0.0)  # the first lines: baselines
    assert clock.last_progress is None and not clock.stalled(100.0)
    observe_progress(clock, [("0", " 10"), ("1", " 25 moved")], 3.0)
    assert clock.last_progress == 3.0 and clock.stalled(8.5) and not clock.stalled(8.0)
    # a node that had moved before the referee's first look: the clock starts at once (the banner case)
    banner = stallclock.StallClock(5)
    observe_progress(banner, [("0", " 10 moved"), ("1", " 20")], 1.0)
    assert banner.last_progress == 1.0
    observe_progress(banner, [("0", " 10 moved"), ("1", " 20")], 4.0)
    assert banner.last_progress == 1.0 and banner.stalled(6.5)
    assert waiting_for_step(" 10 0") and waiting_for_step(" 10 ") and not waiting_for_step(" 10 7")
    assert not waiting_for_step(" 10")
    assert wildcard("/s/runs/r/node-*.a1.hb", "/s/runs/r/node-12.a1.hb") == "12"


def test_the_shipped_watcher_runs_under_an_isolated_python_and_keeps_a_node_s_files(tmp_path):
    """The staged text under `python3 -I -S` (as node.sh starts it: no ftbundle, no site): a
    follower beats, keeps its ranks' step times, reads the verdict, and obeys a stop request:
    its job is stopped through the node program's own `stop`."""
    from ftbundle.launch.node import program

    run = tmp_path / "run"
    run.mkdir()
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    (steps_dir / "a1.steps.0").write_text("0 25 0.100000 0.400000\n")
    program_file = run / "watch.py"
    program_file.write_text(stall.watcher_source())
    marker = f"ftb-test-watch-{time.time_ns()}"
    job = subprocess.Popen(["sleep", "60"], env={**os.environ, "FTB_JOB": marker})
    env = {"PATH": os.environ["PATH"], "FTB_MARKER": marker, "FTB_CONTAINER": "",
           "FTB_STOP_GRACE": "1", "FTB_HEARTBEAT": "0.2", "FTB_STALE": "600", "FTB_STALL_TIMEOUT": "0",
           "FTB_REFEREE": "0", "NODE_RANK": "1", "NNODES": "2", "FTB_RUN_DIR": str(run),
           "FTB_LOG": str(run / "node-1-h.a1.log"), "FTB_EXIT": str(run / "node-1.a1.exit"),
           "FTB_HBFILE": str(run / "node-1.a1.hb"), "FTB_VERDICT_FILE": str(run / "watch.a1"),
           "FTB_STOP_REQUEST": str(run / "stop-requested"), "FTB_KEPT_STEPS_FILE": str(run / "node-1.a1.steps"),
           "FTB_XIDS_FILE": str(run / "node-1.a1.xids"), "FTB_STEPS_FILE": str(steps_dir / "a1.steps")}
    (run / "watch.a1").write_text("1 ok\n")
    watcher = subprocess.Popen([sys.executable, "-I", "-S", str(program_file), str(job.pid), "", program()], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not (run / "node-1.a1.steps").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (run / "node-1.a1.hb").read_text().strip().isdigit()
        assert (run / "node-1.a1.steps").read_text() == "0 25 0.100000 0.400000\n"
        assert job.poll() is None
        (run / "stop-requested").write_text("stop requested\n")
        assert job.wait(timeout=10) is not None
        out, err = watcher.communicate(timeout=10)
    finally:
        job.kill()
        watcher.kill()
    assert watcher.returncode == 0, err
    assert not any(steps_dir.iterdir())  # the ranks' step-time files, away with the job
    assert not (run / "node-1.a1.xids").exists()  # (no nvidia-smi here)


def test_the_watchers_commands_resolve_as_they_did_at_the_start():
    """The node program's children (``ftb xids``, ``ftb stop``) get a PATH of the folders that hold
    the commands they run, in the PATH's own order: a stand-in or wrapper in /usr/local/bin keeps
    winning over /usr/bin (on a test host, dmesg's; the CI failure of 2026-11-28 read the real
    kernel log instead), and a folder with none of them (one on shared storage) is left out."""
    from ftbundle.remote.watch_host import command_path

    found = ["/usr/bin/bash", "/usr/bin/grep", "/usr/bin/nvidia-smi", "/usr/local/bin/dmesg", None]
    path = "/shared/venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/local/bin"
    assert command_path(path, found) == "/usr/local/bin:/usr/bin"
    assert command_path("", [None]) == "/usr/bin:/bin"
