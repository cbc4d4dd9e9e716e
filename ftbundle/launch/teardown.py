"""The teardown: every node of an attempt stopped at once, over the open connections.

The fence goes up first: a node whose channel opens from now on never starts its job
(:meth:`.node.NodeRunner.fenced`). Then every node's stdin says stop and closes: its watchdog
stops the job (SIGTERM, SIGKILL after STOP_GRACE_S) and its node program exits only after
that, so its exit confirms that nothing of the job is left there. The sends go through a few
threads (:class:`Stoppers`: a send can wait on its host's transport; a thread per node costs
more than it saves at 100+ hosts). A second path, the node program's ``stop`` mode on a
channel of its own, goes only to a node whose program died (its watchdog with it) or was given
up on while its host answers, and to one that has not confirmed by SECOND_STOP_AFTER_S.

A node silent for TEARDOWN_SILENT_S meanwhile is asked whether its host answers
(:meth:`Cluster.answers`, through the supervisor's silence check): only one that does not is
lost, its failure dated by its last heartbeat (a dead host found now may still be the root
cause). A node that answers is being stopped, just slowly (a loaded controller or host):
waited for.

Who is confirmed stopped and who gets the second path is decided without I/O
(:class:`Stopping`); :func:`stop_nodes` does the sending and the waiting. Whether a silent
node's host answers is asked on a thread of its own (:class:`Probe`, the supervisor's too).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ..cluster import Cluster
from ..inventory import Host
from .node import HEARTBEAT_S, STOP_GRACE_S, NodeRunner
from .states import PROBE_S, NodeStatus, State

TEARDOWN_SILENT_S = 2 * HEARTBEAT_S + 0.5  # while stopping: silent this long, its host is asked
STOPPER_THREADS = 8  # the teardown's sends (a send can wait on one host's transport)
SECOND_STOP_AFTER_S = 2.0  # while stopping: a node not confirmed stopped by then gets its `stop` mode too


class Stopping:
    """Which nodes the teardown has confirmed stopped, and which the second path goes to.
    Pure: given the nodes' states (and the second path's answers in ``confirmed``), it says
    what is left to do."""

    def __init__(self, states: Sequence[State], orphaned: Iterable[int], host_answers: Iterable[int]):
        answers = set(host_answers)
        # their node program died (``orphaned``), or was given up on while its host answers
        # (frozen?): nothing on its stdin listens, but its host does
        self.sent: set[int] = set(orphaned) | {r for r, s in enumerate(states) if s is State.LOST and r in answers}
        self.confirmed: dict[int, bool] = {}  # the second path's answers: True, nothing of the job is left

    def stopped(self, rank: int, state: State) -> bool:
        """Confirmed stopped: by the second path, or by its node program's exit (which waits
        for its watchdog) when no second path went to it."""
        return self.confirmed.get(rank, False) or (state is State.EXITED and rank not in self.sent)

    def done(self, states: Sequence[State]) -> bool:
        """Nothing left to wait for: a lost node is not waited for, unless a second path went
        to its host, which answers."""
        return all(self.stopped(r, s) or (s is State.LOST and r not in self.sent) for r, s in enumerate(states))

    def late(self, states: Sequence[State]) -> list[int]:
        """The nodes still starting or running that no second path went to: it goes to them
        now (they count as sent from here on)."""
        late = [r for r, s in enumerate(states) if s in (State.STARTING, State.RUNNING) and r not in self.sent]
        self.sent.update(late)
        return late

    def unconfirmed(self, states: Sequence[State]) -> list[int]:
        return [r for r, s in enumerate(states) if not self.stopped(r, s)]


def stop_nodes(runners: Sequence[NodeRunner], status: Sequence[NodeStatus], *, fence: threading.Event,
               orphaned: Iterable[int], host_answers: Iterable[int], take_events: Callable[[float], None],
               check_silence: Callable[[float], None]) -> Stopping:
    """Stop every node (see the module's docstring) and wait for them to confirm, up to
    STOP_GRACE_S + 2 s (more when the second path goes out late). ``status`` is the
    supervisor's, changed only by ``take_events`` (its loop's handlers); ``check_silence``
    is its silence check, given TEARDOWN_SILENT_S. Returns what was confirmed (a second
    path may still answer after: read it as late as possible)."""
    fence.set()
    stoppers = Stoppers(min(STOPPER_THREADS, len(runners)))
    for runner, st in zip(runners, status):
        if st.state is not State.LOST:  # (a lost node's channels are closed already: Supervisor._lose)
            stoppers.put(runner.close_stdin)
    stopping = Stopping([st.state for st in status], orphaned, host_answers)

    def second_path(rank: int) -> None:
        stopping.confirmed[rank] = runners[rank].stop()

    for rank in sorted(stopping.sent):
        stoppers.put(functools.partial(second_path, rank))
    began = time.monotonic()
    deadline = began + STOP_GRACE_S + 2
    while time.monotonic() < deadline:
        if stopping.done([st.state for st in status]):
            break
        take_events(0.1)
        now = time.monotonic()
        if now - began >= SECOND_STOP_AFTER_S:
            late = stopping.late([st.state for st in status])
            for rank in late:
                stoppers.put(functools.partial(second_path, rank))
            if late:  # (its stop: SIGTERM, SIGKILL after the grace; waited for)
                deadline = max(deadline, now + STOP_GRACE_S + 1.5)
        check_silence(TEARDOWN_SILENT_S)  # (waited for while its host answers)
    stoppers.close()  # (not waited for: a send to a held transport may wait 15 s, for nothing)
    return stopping


class Stoppers:
    """A few threads that run the teardown's sends and stop channels, in the order given."""

    def __init__(self, threads: int):
        self.work: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._serve, daemon=True, name=f"stopper{i}")
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def put(self, job) -> None:
        self.work.put(job)

    def _serve(self) -> None:
        while (job := self.work.get()) is not None:
            try:
                job()
            except Exception:
                pass  # (a node that cannot be told is judged by its silence)

    def close(self) -> None:
        """No more jobs: the threads end once the ones given have run."""
        for _ in self.threads:
            self.work.put(None)


STOPPED_CODES = (143, 137)  # a job ended by SIGTERM (and SIGKILL after the grace): what `ftbundle stop` does
REQUEST_ASK_S = 3.0


def stop_requested(plan, cluster) -> bool:
    """Whether `ftbundle stop` asked this run to stop (its ``stop-requested`` file in the run
    directory, written before it stops the nodes), as the first node that answers sees shared
    storage: an attached run so stopped is not a failure to report, nor one to restart. A
    storage that does not answer within REQUEST_ASK_S: not asked."""
    for node in plan.nodes:
        if not cluster.alive(node.host):
            continue
        try:
            return cluster.run(node.host, ["test", "-e", plan.rundir.stop_request], timeout=REQUEST_ASK_S).ok
        except Exception:  # noqa: BLE001 - not known: not asked
            return False
    return False


class Probe:
    """Whether a silent node's host answers (:meth:`Cluster.answers`), asked on a thread:
    ``answered`` is None until it is known."""

    def __init__(self, cluster: Cluster, host: Host, since: float):
        self.answered: bool | None = None
        self.since = since  # the last heartbeat before the silence it asks about
        threading.Thread(target=self._ask, args=(cluster, host), daemon=True, name=f"probe-{host.name}").start()

    def _ask(self, cluster: Cluster, host: Host) -> None:
        self.answered = cluster.answers(host, PROBE_S)
