"""A refusal known at once is reported at once: when rank 0's probe will not listen on the master
port (another run holds its host, or the port is in use), it says so on stderr, the launcher tells
the probes that knock on it (check/__init__.py Relay), and they stop knocking instead of
trying for their whole connect_s (6 s, 38 s at 256 hosts). The real probe and loader here; with
containers and a run that holds the hosts: tests/cluster/test_claims.py."""

from __future__ import annotations

import json
import socket
import time

from ftbundle.check import Relay
from ftbundle.cluster import LocalProc
from ftbundle.remote.probe_common import PORT_OFF
from tests.support.helpers import free_port
from tests.unit.test_probe_cost_unit import told_probe

HELD = "rank 0's host is held by another run"


def knocking_probe(tmp_path, connect_s: float = 30):
    """Rank 1's probe, knocking on a port where nothing listens (rank 0 never bound it)."""
    return told_probe(tmp_path, rank=1, port={"role": "connect", "addr": "127.0.0.1", "port": free_port(),
                                             "connect_s": connect_s, "token": "run"})


def test_a_knocking_probe_told_that_rank_0_will_not_listen_stops_at_once(tmp_path):
    proc, _ = knocking_probe(tmp_path)
    proc.stdin.write(b'{"reachable": [0, 1]}\n')
    proc.stdin.flush()
    time.sleep(1.0)  # knocking by now
    assert proc.poll() is None
    told = time.monotonic()
    out, err = proc.communicate(json.dumps({"port_off": HELD}).encode() + b"\n", timeout=60)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["port"] == {"role": "connect", "skipped": HELD}, (facts, err)
    assert time.monotonic() - told < 3  # (its connect_s is 30 s)
    assert not facts.get("errors"), facts


def test_both_lines_in_one_read_are_both_heard(tmp_path):
    """What comes after the ranks in the same read is kept for the next line, not dropped."""
    proc, _ = knocking_probe(tmp_path)
    began = time.monotonic()
    out, err = proc.communicate(b'{"reachable": [0, 1]}\n' + json.dumps({"port_off": HELD}).encode() + b"\n",
                                timeout=60)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["port"] == {"role": "connect", "skipped": HELD}, (facts, err)
    assert time.monotonic() - began < 5  # (its connect_s is 30 s)


def test_a_knocking_probe_told_nothing_more_still_reports_the_port_unreachable(tmp_path):
    """No word from rank 0 (it listens, but the port is firewalled, say): the knocking goes on
    for connect_s and the port is reported unreachable, as before."""
    proc, _ = knocking_probe(tmp_path, connect_s=2)
    out, err = proc.communicate(b'{"reachable": [0, 1]}\n', timeout=60)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["port"]["reachable"] is False and "kept trying for 2 s" in facts["port"]["error"], (facts, err)


def test_rank_0_whose_port_is_in_use_says_so_on_stderr_before_its_end(tmp_path):
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc, _ = told_probe(tmp_path, port={"role": "listen", "port": port, "peers": None, "listen_s": 5,
                                             "token": "run"})
        proc.stdin.write(b'{"reachable": [0, 1]}\n')
        proc.stdin.flush()
        line = proc.stderr.readline().decode()
        running = proc.poll() is None  # (it still waits a second for rank 1's sentinel)
        out, _ = proc.communicate(timeout=60)
    assert line == f"{PORT_OFF} master port {port} in use on rank 0\n"
    assert running  # said at once, not with its facts at its end
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["port"]["busy"]  # (what the check reports: the port is in use)


def test_a_probe_told_a_host_is_gone_stops_waiting_for_its_sentinel(tmp_path):
    """Rank 1's probe ended without its facts (the launcher's word): the others' storage child
    no longer waits for its sentinel (here sentinel_wait_s 30 s), and says what it did see."""
    proc, sentinels = told_probe(tmp_path, sentinel_wait_s=30)
    proc.stdin.write(b'{"reachable": [0, 1, 2]}\n')
    proc.stdin.flush()
    deadline = time.monotonic() + 10
    while not (sentinels / "rank-0").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    (sentinels / "rank-2").write_text("node2\n")  # rank 2's host (shared storage) wrote its own
    time.sleep(0.5)
    assert proc.poll() is None  # still waiting for rank 1's
    told = time.monotonic()
    out, err = proc.communicate(b'{"gone": [1]}\n', timeout=60)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert time.monotonic() - told < 5, (facts, err)  # (its sentinel_wait_s is 30 s)
    assert facts["storage"]["shared_dir"]["seen"] == [0, 2], facts["storage"]
    assert not facts.get("errors"), facts


def said_to(proc: LocalProc) -> list[str]:
    """The lines a stand-in probe (cat) was sent, once its stdin is closed."""
    proc.close_stdin()
    text = b""
    while chunk := proc.read_out():
        text += chunk
    return text.decode().splitlines()


def test_the_notice_reaches_each_knocking_probe_once_after_its_first_line():
    """Real processes (cat) as the probes' stdin: a probe told who takes part before rank 0's
    word gets it when it comes; one told after gets both, in order; rank 0 gets only its line."""
    notice = Relay()
    early, late, rank0 = (LocalProc(["cat"]) for _ in range(3))
    notice.tell(early, 1, b'{"reachable": [0, 1, 2]}\n')
    notice.tell(rank0, 0, b'{"reachable": [0, 1, 2]}\n')
    notice.feed(b"ftb-hashing model 1 2\n" + PORT_OFF.encode() + b" rank 0's host is held")  # (a line in two chunks)
    notice.feed(b" by another run\n" + PORT_OFF.encode() + b" said twice\n")
    notice.off("rank 0's probe ended: probe did not finish")  # (after its word: not said again)
    notice.tell(late, 2, b'{"reachable": [0, 1, 2]}\n')
    got = [said_to(proc) for proc in (early, late, rank0)]
    off = json.dumps({"port_off": HELD})
    assert got[0] == ['{"reachable": [0, 1, 2]}', off]
    assert got[1] == ['{"reachable": [0, 1, 2]}', off]
    assert got[2] == ['{"reachable": [0, 1, 2]}']


def test_a_probe_that_ended_is_said_gone_to_the_others_and_rank_0s_end_stops_the_knocking():
    """Host 2's probe ended without its facts: every other probe told is told it is gone, and a
    probe told later gets it after its first line; rank 0's end also tells the knockers it will
    not listen (once, however it is learnt)."""
    relay = Relay()
    rank0, one, three = (LocalProc(["cat"]) for _ in range(3))
    first = b'{"reachable": [0, 1, 2, 3]}\n'
    relay.tell(rank0, 0, first)
    relay.tell(one, 1, first)
    relay.ended(2, "probe did not finish: python3: not found")
    relay.ended(0, "probe failed: connection dropped")
    relay.feed(PORT_OFF.encode() + b" rank 0's host is held by another run\n")  # (late: not said again)
    relay.tell(three, 3, first)
    got = [said_to(proc) for proc in (rank0, one, three)]
    off = json.dumps({"port_off": "rank 0's probe ended: probe failed: connection dropped"})
    assert got[0] == [first.decode().strip(), '{"gone": [2]}']
    assert got[1] == [first.decode().strip(), '{"gone": [2]}', off, '{"gone": [0]}']
    assert got[2] == [first.decode().strip(), off, '{"gone": [2, 0]}']


def knock(port: int, said: bytes) -> None:
    """A peer's knock on rank 0's port, once it listens."""
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(said)
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_rank_0_stops_waiting_for_the_knock_of_a_host_said_gone_but_not_for_the_others(tmp_path):
    """Rank 0 waits on its port for ranks 1, 2 and 3 (listen_s 30 s). Rank 2 knocks, then is
    said gone (its probe ended after): its knock still counts, and rank 0 still waits for rank
    1, which has not knocked; rank 3 said gone without a knock is not waited for."""
    port = free_port()
    proc, _ = told_probe(tmp_path, port={"role": "listen", "port": port, "peers": None, "listen_s": 30,
                                         "token": "run"})
    proc.stdin.write(b'{"reachable": [0, 1, 2, 3]}\n')
    proc.stdin.flush()
    knock(port, b"run 2\n")
    proc.stdin.write(b'{"gone": [2, 3]}\n')
    proc.stdin.flush()
    time.sleep(1.5)
    assert proc.poll() is None  # (rank 1 not heard yet: a gone host's knock does not stand in for it)
    knock(port, b"run 1\n")
    began = time.monotonic()
    out, err = proc.communicate(timeout=60)
    facts = json.loads(out.decode().strip().splitlines()[-1])
    assert facts["port"] == {"role": "listen", "accepted": ["127.0.0.1", "127.0.0.1"]}, (facts, err)
    assert time.monotonic() - began < 5  # (listen_s 30 s)
