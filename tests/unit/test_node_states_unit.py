"""The supervisor's decisions on node states, without I/O: what a node's silence calls for
(launch/states.py's silence_verdict) and who the teardown has confirmed stopped and sends its
second path to (launch/teardown.py's Stopping); then the teardown's shell on fake nodes."""

from __future__ import annotations

import threading
import time

import pytest

from ftbundle.launch.states import (AWAY_WINDOW_S, LOST_EXIT_CODE, PROBE_S, START_TIMEOUT_S, NodeStatus, Silence, State,
                                    silence_verdict, stopped_while_away)
from ftbundle.launch.teardown import SECOND_STOP_AFTER_S, TEARDOWN_SILENT_S, Stopping, stop_nodes

LIMIT = 5.0
ASK_BEFORE = PROBE_S


def running(silent: float, now: float = 1000.0) -> NodeStatus:
    return NodeStatus(State.RUNNING, since=now - 60, last_heartbeat=now - silent)


def verdict(st: NodeStatus, answered=None, *, now: float = 1000.0, limit: float = LIMIT,
            quiet_max: float | None = 3 * LIMIT, ask_before: float = ASK_BEFORE) -> Silence:
    return silence_verdict(st, now, answered, limit=limit, quiet_max=quiet_max, ask_before=ask_before)


def test_a_node_that_never_started_is_lost_after_the_start_timeout_only():
    assert verdict(NodeStatus(State.STARTING, since=1000.0 - START_TIMEOUT_S - 0.1)) is Silence.NOT_STARTED
    assert verdict(NodeStatus(State.STARTING, since=1000.0 - START_TIMEOUT_S + 1)) is Silence.NONE
    assert not Silence.NOT_STARTED.asks  # (nothing to ask its host: its program never said a word)


@pytest.mark.parametrize("state", [State.EXITED, State.LOST])
def test_a_node_that_ended_is_never_judged_by_its_silence(state):
    assert verdict(NodeStatus(state, since=0.0, last_heartbeat=0.0), answered=False) is Silence.NONE


def test_a_silent_node_has_its_host_asked_before_the_limit_and_is_lost_only_when_it_does_not_answer():
    assert verdict(running(LIMIT - ASK_BEFORE - 0.1)) is Silence.NONE
    early = verdict(running(LIMIT - ASK_BEFORE + 0.1))
    assert early is Silence.WAIT and early.asks  # asked ahead, so that a cut network is noticed at the limit
    assert verdict(running(LIMIT - 0.1), answered=False) is Silence.WAIT  # (not before the limit)
    assert verdict(running(LIMIT + 0.1), answered=False) is Silence.HOST_GONE
    assert verdict(running(LIMIT + 0.1), answered=None) is Silence.WAIT  # its answer may still come
    assert verdict(running(LIMIT + PROBE_S + 0.1), answered=None) is Silence.HOST_LATE


def test_a_quiet_node_whose_host_answers_is_given_until_quiet_max_or_forever():
    assert verdict(running(LIMIT + 1), answered=True) is Silence.WAIT
    assert verdict(running(3 * LIMIT - 0.1), answered=True) is Silence.WAIT
    assert verdict(running(3 * LIMIT + 0.1), answered=True) is Silence.QUIET
    assert verdict(running(1e6), answered=True, quiet_max=None) is Silence.WAIT  # (the teardown's check)


def test_while_stopping_the_host_is_asked_at_the_limit_itself():
    assert verdict(running(TEARDOWN_SILENT_S - 0.1), limit=TEARDOWN_SILENT_S, ask_before=0) is Silence.NONE
    assert verdict(running(TEARDOWN_SILENT_S + 0.1), limit=TEARDOWN_SILENT_S, ask_before=0).asks


S, R, E, L = State.STARTING, State.RUNNING, State.EXITED, State.LOST


def test_the_second_path_goes_first_to_orphans_and_to_lost_nodes_whose_host_answers():
    stopping = Stopping([R, E, L, L], orphaned={1}, host_answers={2, 0})
    assert stopping.sent == {1, 2}  # node 3's host did not answer: nothing to send it; node 0 still listens


def test_a_node_is_confirmed_stopped_by_its_exit_or_by_the_second_path():
    stopping = Stopping([R, E, L, L], orphaned={1}, host_answers={2})
    assert not stopping.stopped(1, E)  # an orphan's exit says nothing of its job: the second path must
    assert not stopping.done([E, E, L, L])
    stopping.confirmed.update({1: True, 2: True})
    assert stopping.done([E, E, L, L])  # node 3 (lost, its host silent) is not waited for
    assert stopping.unconfirmed([E, E, L, L]) == [3]
    assert stopping.unconfirmed([R, E, L, L]) == [0, 3]


def test_late_nodes_get_the_second_path_once():
    stopping = Stopping([S, R, E, R], orphaned=(), host_answers=())
    assert stopping.late([S, R, E, R]) == [0, 1, 3]
    assert stopping.late([S, R, E, R]) == []
    stopping.confirmed.update({0: True, 1: False})
    assert stopping.unconfirmed([S, R, E, E]) == [1, 3]  # (node 3's exit came after its second path went)


class FakeRunner:
    def __init__(self, rank: int, exits_on_stdin: bool):
        self.rank, self.exits_on_stdin = rank, exits_on_stdin
        self.stdin_closed = threading.Event()
        self.stopped_at: float | None = None

    def close_stdin(self) -> None:
        self.stdin_closed.set()

    def stop(self) -> bool:
        self.stopped_at = time.monotonic()
        return True


def test_the_teardown_confirms_each_node_by_its_exit_or_its_late_stop():
    """Node 0 exits once told on its stdin; node 1 never does: its second path goes out after
    SECOND_STOP_AFTER_S and confirms it. Node 2 was lost (its host silent): not waited for."""
    runners = [FakeRunner(0, True), FakeRunner(1, False), FakeRunner(2, False)]
    status = [NodeStatus(R, last_heartbeat=0.0), NodeStatus(R, last_heartbeat=0.0), NodeStatus(L)]
    fence = threading.Event()
    checked = []

    def take_events(timeout: float) -> None:  # the loop's handlers: a node program's exit
        time.sleep(timeout)
        for runner, st in zip(runners, status):
            if runner.exits_on_stdin and runner.stdin_closed.is_set():
                st.state = E

    began = time.monotonic()
    stopping = stop_nodes(runners, status, fence=fence, orphaned=(), host_answers=(), take_events=take_events,
                          check_silence=checked.append)
    took = time.monotonic() - began
    assert fence.is_set() and runners[0].stdin_closed.is_set() and not runners[2].stdin_closed.is_set()
    assert runners[0].stopped_at is None and runners[2].stopped_at is None
    assert runners[1].stopped_at is not None and runners[1].stopped_at - began >= SECOND_STOP_AFTER_S
    # node 2 cannot be confirmed (the outcome names it as not stopped); the others are, well before the deadline
    assert stopping.unconfirmed([st.state for st in status]) == [2] and took < SECOND_STOP_AFTER_S + 2
    assert checked and set(checked) == {TEARDOWN_SILENT_S}


def test_a_failure_is_the_launchers_pause_only_right_after_it_and_only_a_watchdogs_stop():
    """ftbundle woke at t=1000 after 30 s paused (past the nodes' 10 s watchdog): the nodes' stops
    that waited in their connections are its pause, not their fault. A failure long after the
    waking, one of another kind (a rank's exit 1), or with no pause at all is a node's own."""
    away = (1000.0, 30.0)
    for code in (143, 137, LOST_EXIT_CODE):
        assert stopped_while_away(away, 1000.3, code)
    assert stopped_while_away(away, 985.0, 143)  # (read by its reader thread while the loop was stuck)
    assert stopped_while_away(away, 1000.0 + AWAY_WINDOW_S, 143)
    assert not stopped_while_away(away, 1000.0 + AWAY_WINDOW_S + 0.1, 143)
    assert not stopped_while_away(away, 4600.0, 143)  # (an hour later: a node's own)
    assert not stopped_while_away(away, 1000.3, 1)  # (a rank's exception)
    assert not stopped_while_away(away, 960.0, 143)  # (before the pause began)
    assert not stopped_while_away(None, 1000.3, 143)

