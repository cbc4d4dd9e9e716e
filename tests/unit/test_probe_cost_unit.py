"""The probe's own cost (issue 44 item 7): the probe runs on every host at every check, and on a
loaded host its CPU is the check's cost. It imports no module that pulls in enum, re or
collections (json, socket, threading, subprocess: 14 ms of a 33 ms probe); it uses their C halves
and os.posix_spawn instead (remote/probe_common.py), and each stand-in does what the module did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ftbundle.check import probe_source
from ftbundle.remote import probe_common as PC
from tests.unit.test_check_unit import local_spec

# what the C halves spare the probe (each imports enum, re, collections or the idna codec)
HEAVY = {"enum", "re", "json", "socket", "threading", "subprocess", "selectors", "collections", "contextlib",
         "encodings.idna", "signal", "functools"}


def imported(argv: list[str], stdin: bytes) -> tuple[set[str], dict]:
    proc = subprocess.run(argv, input=stdin, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    names = {line.split("|")[-1].strip() for line in proc.stderr.decode().splitlines()
             if line.startswith("import time:") and "cumulative" not in line}
    return names, json.loads(proc.stdout.decode().strip().splitlines()[-1])


def test_the_shipped_probe_imports_none_of_the_heavy_modules_and_still_answers_everything(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    port = 29000 + os.getpid() % 1000
    spec = local_spec(tmp_path, token="t1", storage=[{"name": "shared_dir", "path": str(shared), "create": True}],
                      port={"role": "listen", "port": port, "peers": 0, "listen_s": 1, "token": "run"})
    names, out = imported([sys.executable, "-S", "-X", "importtime", "-", json.dumps(spec)], probe_source())
    assert names, "no import was reported: -X importtime said nothing"
    assert not names & HEAVY, sorted(names & HEAVY)
    assert {"_json", "_socket"} <= names  # (the C halves it uses instead)
    # and every fact is there: the host, its route (a command run), the storage sentinel, the port
    assert out["hostname"] and out["route"]["dev"] == "lo" and out["route"]["local"]
    assert out["storage"]["shared_dir"]["written"] and out["storage"]["shared_dir"]["seen"] == [0]
    assert out["port"] == {"role": "listen", "accepted": []}
    assert not out.get("errors"), out.get("errors")


VALUES = [{"a": [1, 2.5, "é\n\"\\\t\u2028", None, True, False, {}, []], "b": -0.0, "c": 10**30},
          [], "x", 1e100, 1e-7, float("inf"), {"b": 1, "a": {"d": 2, "c": 3}}, "\x00\x1f\ud83d\ude00"]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_the_light_json_writes_and_reads_what_the_json_package_does(value):
    assert type(PC.json).__name__ == "_Json"  # (this interpreter has _json: the light one is in use)
    for sort in (False, True):
        assert PC.json.dumps(value, sort_keys=sort) == json.dumps(value, sort_keys=sort)
    text = json.dumps(value)
    assert json.dumps(PC.json.loads(text)) == text
    assert json.dumps(PC.json.loads(f" \n{text}\t ".encode())) == text


@pytest.mark.parametrize("bad", ["", " ", "{", '{"a": 1} x', "nul", '{"a": }', "[1,]"])
def test_the_light_json_refuses_what_the_json_package_refuses(bad):
    with pytest.raises(ValueError):
        json.loads(bad)
    with pytest.raises(ValueError):
        PC.json.loads(bad)


def test_the_light_json_refuses_what_json_cannot_write():
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        PC.json.dumps({"a": {1}})


def test_run_gives_what_subprocess_gave():
    # exit code, both streams, the PATH lookup, a missing program, a signal
    assert PC.run(["sh", "-c", "echo out; echo err >&2; exit 3"], 5) == (3, "out\n", "err\n", False)
    assert PC.run(["no-such-program-ftb"], 5) == (None, "", "No such file or directory", False)
    assert PC.run(["sh", "-c", "kill -9 $$"], 5)[0] == -signal.SIGKILL
    assert PC.run(["sh", "-c", "printf 'a\\r\\nb\\rc'"], 5)[1] == "a\nb\nc"  # (text mode's newlines)
    # its own session (a command that times out is killed with its children), stdin from /dev/null,
    # SIGPIPE as a shell expects it (Python ignores it; a pipeline's writer must die of it)
    code, out, _, _ = PC.run(["sh", "-c", "ps -o sid= -p $$; cat; yes | head -1"], 5)
    assert code == 0 and out.split() == [out.split()[0], "y"] and int(out.split()[0]) != os.getsid(0)
    code, out, _, _ = PC.run(["bash", "-c", "yes | head -1; echo ${PIPESTATUS[0]}"], 5)
    assert out.split() == ["y", str(128 + signal.SIGPIPE)]
    # an env of its own, its PATH the one the program is looked up in
    assert PC.run(["printenv", "X"], 5, env={"X": "1", "PATH": os.environ["PATH"]})[:2] == (0, "1\n")
    assert PC.run(["printenv", "X"], 5, env={"X": "1", "PATH": "/nonexistent"})[0] is None


def test_run_kills_a_command_at_its_limit_and_does_not_wait_for_it(tmp_path):
    marker = tmp_path / "child"
    began = time.monotonic()
    code, out, err, timed_out = PC.run(["sh", "-c", f"sleep 30 & echo $! > {marker}; wait"], 0.5)
    assert (code, out, err, timed_out) == (None, "", "", True)
    assert time.monotonic() - began < 3
    child = int(marker.read_text())
    for _ in range(50):  # the whole session was killed: its child too
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the command's child outlived the limit")
    # a command that closes its output and goes on is waited for only until the limit
    began = time.monotonic()
    assert PC.run(["sh", "-c", "exec >/dev/null 2>&1; sleep 30"], 0.5)[3]
    assert time.monotonic() - began < 3


def test_a_task_joins_with_a_limit_and_says_whether_it_still_runs():
    task = PC.Task(time.sleep, (0.3,)).start()
    assert task.name == "sleep" and task.is_alive()
    task.join(0.05)
    assert task.is_alive()
    task.join()
    assert not task.is_alive()


def test_a_listener_takes_more_knocks_at_once_than_the_old_backlog_and_a_dead_port_is_an_error():
    s = PC.listening(0, 200)
    port = s.getsockname()[1]
    try:
        knocks = [PC.connected("127.0.0.1", port, 2) for _ in range(150)]  # none accepted yet
        got = [PC.accepted(s, 2) for _ in knocks]
        assert all(g is not None and g[1] == "127.0.0.1" for g in got)
        assert PC.accepted(s, 0.05) is None  # nobody else: None at the limit
        for conn in knocks + [g[0] for g in got]:
            conn.close()
    finally:
        s.close()
    with pytest.raises(OSError):
        PC.connected("127.0.0.1", port, 1)
    with pytest.raises(OSError):
        busy = PC.listening(0)
        try:
            PC.listening(busy.getsockname()[1])
        finally:
            busy.close()


def told_probe(tmp_path, *, rank: int = 0, port: dict | None = None, sentinel_wait_s: float = 1):
    """The real loader and probe, started as a check on a cluster still connecting starts it:
    spec ``told``, the source's length an argument, who takes part still to come on stdin."""
    from ftbundle.check import probe_argv
    from ftbundle.inventory import Host

    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    spec = local_spec(tmp_path, rank=rank, token="t2", expect=None, told=True, sentinel_wait_s=sentinel_wait_s,
                      storage=[{"name": "shared_dir", "path": str(shared), "create": True}])
    if port is not None:
        spec["port"] = port
    argv = probe_argv(Host("localhost", "127.0.0.1", local=True), json.dumps(spec), sized=True)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(probe_source())
    proc.stdin.flush()
    return proc, shared / ".ftb-check-t2"


def test_a_probe_started_while_the_others_connect_waits_for_who_takes_part_then_asks_it(tmp_path):
    import socket
    import threading

    port = 29000 + (os.getpid() + 7) % 1000
    proc, sentinels = told_probe(tmp_path, port={"role": "listen", "port": port, "peers": None, "listen_s": 5,
                                                 "token": "run"})
    time.sleep(1.0)
    assert proc.poll() is None  # no answer yet: whose sentinels and how many peers are not known
    assert (sentinels / "rank-0").is_file()  # (its own sentinel is written meanwhile)
    (sentinels / "rank-3").write_text("node3\n")  # rank 3's host (shared storage) has written its own

    def peer():  # rank 3 knocks with its run's token and its rank, once the listener is up
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"run 3\n")
                    return
            except OSError:
                time.sleep(0.05)

    knock = threading.Thread(target=peer, daemon=True)
    knock.start()
    began = time.monotonic()
    out, err = proc.communicate(b'{"reachable": [0, 3]}\n', timeout=60)
    knock.join(5)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["storage"]["shared_dir"]["seen"] == [0, 3], (facts, err)  # it waited for rank 3's, and saw it
    assert facts["port"] == {"role": "listen", "accepted": ["127.0.0.1"]}  # and for one peer on the port
    assert time.monotonic() - began < 5 and not facts.get("errors"), facts


def test_a_told_probe_that_hears_nothing_waits_for_no_one(tmp_path):
    proc, _ = told_probe(tmp_path, rank=2, port={"role": "connect", "addr": "127.0.0.1", "port": 9,
                                                 "connect_s": 5, "token": "run"})
    began = time.monotonic()
    out, err = proc.communicate(b"", timeout=60)  # (the launcher gone: stdin ends after the source)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["storage"]["shared_dir"]["seen"] == [2], (facts, err)  # its own sentinel only
    assert "port" not in facts  # no rank 0 among those taking part: no port to try
    assert time.monotonic() - began < 3, facts
