"""Supervise a run: one event loop, one state per node, a full stop at the first failure.

Each node goes STARTING -> RUNNING (its first heartbeat) -> EXITED (an exit code) or LOST
(its connection dropped, or no heartbeat for ``LOST_AFTER_S``). Only the loop changes a
state; the node runners (:mod:`.node`) and the pinger threads (one a node) only send or emit.

The first node that exits non-zero or is lost stops the run at once: every node's stdin says
stop and closes (its watchdog stops the job; its node program's exit confirms it), a stop on a
channel of its own goes only to a node that has not confirmed within a moment, and the loop
waits for the nodes to confirm (:meth:`Supervisor._teardown`). The root cause is decided after
that: the earliest failure, where a lost node counts from its last heartbeat (a host that dies
takes its peers down with "connection reset" a second or two later); a node is lost while
stopping only when its host does not answer.

The states and the pure decisions on them are :mod:`.states`; the stopping is :mod:`.teardown`;
the failing rank's story and the words for a failure are :mod:`.failure`. Restarts and the
policy for a lost host are :mod:`.attempts`: each attempt is a :class:`Supervisor` of its own
(new job marker, new pid, exit and log files). Staging the run directory is :mod:`.staging`, a
detached run's start :mod:`.detached`.

Timing (see docs/launcher.md): heartbeats every ``HEARTBEAT_S`` (1 s) on a channel that
output cannot hold back; a running node is LOST after ``LOST_AFTER_S`` (5 s) of silence,
so a stall of a second or two never trips it while a cut network is noticed in about 5 s.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import queue
import sys
import threading
import time
from typing import TextIO

from ..cluster import Cluster, HostUnreachable, parallel
from ..gpu_metrics import GpuFleet
from ..plan import Plan
from ..rundir import TRAINER_LOG
from ..ui.progress import Progress
from .checkpoints import CheckpointWatch
from .display import Display, ProgressFeed
from .failure import cause_line, exit_reason, rank_failure, read_tail, unreachable_note
from .node import HEARTBEAT_S, WATCHDOG_S, Event, NodeRunner, gpu_every_s, node_argv, start_behind
from .stall import STALLED_EXIT_CODE, StallClock, ending, stall_report
from .states import (INTERRUPTED_EXIT_CODE, LOST_EXIT_CODE, PROBE_S, START_TIMEOUT_S, Failure, NodeStatus, Outcome, Silence, State,
                     silence_verdict, stopped_while_away)
from .storage import StorageWatch
from .teardown import STOPPED_CODES, Probe, stop_nodes, stop_requested

LOST_AFTER_DEFAULT_S = 5.0
LOST_AFTER_S = float(os.environ.get("FTB_LOST_AFTER", LOST_AFTER_DEFAULT_S))
PING_INTERVAL_S = 1.0
QUIET_MAX_FACTOR = 3  # a silent node whose host answers is lost after this many LOST_AFTER_S
PAUSED_AFTER_S = 2.0  # the loop wakes every 0.2 s: a gap this long means ftbundle itself did not run
TAIL_LINES = 20
DRAIN_S = 3.0  # how long rank 0's log may take to reach its end after the job
HELD_WAIT_S = 0.5  # a key exchange in progress on rank 0's connection waited for before the drain
FAILURE_TAIL_LINES = 300  # of the failed node's log, read for torchrun's root-cause report
# a failed run's GPU faults (_print_gpu_faults): each node's kernel log read in at most this long,
# by this many threads; an Xid this long before the run's start still counts (clocks, rounding)
XID_READ_S = 4.0
XID_READ_THREADS = 32
XID_SLACK_S = 5.0


class Supervisor:
    """One attempt of a run on an open cluster."""

    def __init__(self, plan: Plan, cluster: Cluster, *, attempt: int = 1, out: TextIO | None = None,
                 err: TextIO | None = None, lost_after: float = LOST_AFTER_S, ui=None, verbose: bool = True,
                 start_step: int = 0, more_attempts: bool = False, run_started: float | None = None):
        self.plan = plan
        self.cluster = cluster
        self.attempt = attempt
        self.more_attempts = more_attempts  # a failure may be followed by another attempt: said as the attempt's
        self.out = out or sys.stdout  # looked up now, not at import: callers may swap sys.stdout
        self.err = err or sys.stderr
        self.lost_after = lost_after
        self.redact = plan.redact
        self.events: queue.Queue[Event] = queue.Queue()
        rank0 = plan.node_files(plan.nodes[0], attempt)
        # ui (ftbundle.ui.Phases): phases and summaries on it. Without verbose, rank 0's output
        # feeds a progress display instead of the terminal (the log keeps every line).
        self.ui = ui
        self.progress = Progress(effective_batch=plan.effective_batch,  # LlamaFactory: trainer_log.jsonl
                                 from_jsonl=bool(plan.checkpoint_dir), start_step=start_step,
                                 straggler_factor=plan.straggler_factor, speed=plan.speed,
                                 before=(("staging data", sum(s.get("seconds") or 0 for s in plan.staged)),)
                                 if plan.staged and attempt == 1 else ())
        self.gpu_every = gpu_every_s(plan)  # a GPU job's nodes read their GPUs this often (0: not)
        self.progress.gpus = GpuFleet(every_s=self.gpu_every, beat_s=HEARTBEAT_S)
        self._log_follower: threading.Thread | None = None
        if ui is not None and not verbose:
            self.display = ProgressFeed(ui, self.progress, self._show_progress)
        else:
            self.display = Display(self.out, redact=self.redact, log_hint=rank0.log)
        self.fence = threading.Event()  # up once the teardown began: no node may start after it
        self.runners = [NodeRunner(n, plan, cluster, self.events, attempt=attempt, display=self.display,
                                   fence=self.fence, run_started=run_started) for n in plan.nodes]
        self.status = [NodeStatus() for _ in plan.nodes]
        self.marks: dict[str, float] = {}  # Outcome.marks
        self._running = 0  # nodes RUNNING, kept by _set (read for every progress update)
        self._finished = 0  # nodes EXITED with code 0, likewise
        self.failures: list[Failure] = []
        self._orphaned: set[int] = set()  # ranks whose node program died under a running job
        self._probes: dict[int, Probe] = {}  # silent nodes: does their host answer?
        self._stop_pinging = threading.Event()
        self._awake = time.monotonic()  # when the loop last looked at its events
        self.away: tuple[float, float] | None = None  # paused past the nodes' watchdog (_pardon): woke when, for how long
        # progress from the heartbeats (:mod:`.stall`); LlamaFactory: from its first step on
        self.stall = StallClock(plan.stall_timeout, wait_for_step=bool(plan.checkpoint_dir))
        # shared storage that does not answer, as the nodes report it (:mod:`.storage`)
        self.storage = StorageWatch(plan.shared_dir, [n.host.name for n in plan.nodes])
        # the first checkpoint's real size against the room left (:mod:`.checkpoints`)
        self.checkpoints = CheckpointWatch(plan, cluster, plan.lf_config(), start_step)

    def say(self, message: str) -> None:
        if self.ui is not None:
            self.ui.say(message)
        else:
            print(f"ftbundle: {message}", file=self.err, flush=True)

    # -- what the person watching sees --------------------------------------------------
    def _alive(self) -> int:
        return self._running

    def _show_nodes(self) -> None:
        """Launching until every node has said it is up (its first heartbeat), then training."""
        if self.ui is None:
            return
        alive = self._alive()
        # (an attempt on fewer or other hosts launches anew: its count is its own, not the first's:
        # the live line said "nodes 2/3 finished" of a 2-node attempt 2)
        starting = self.ui.phase in ("", "launching", "staging", "checking") or self.ui.nnodes != len(self.status)
        if starting and alive < len(self.status):
            self.ui.launching(alive, len(self.status))
        else:
            if self.ui.phase in ("", "launching", "staging", "checking"):
                self.ui.launching(alive, len(self.status))
            self.ui.training(self.progress, alive, self._finished)

    def _show_progress(self) -> None:
        if self.ui is not None and self.ui.phase == "training":
            self.ui.training(self.progress, self._alive(), self._finished)

    def _follow_trainer_log(self, pid: str) -> None:
        """LlamaFactory's trainer_log.jsonl (in output_dir) on a channel of rank 0's host,
        while rank 0's job runs: the progress display's best source, and the run's curve
        (metrics.jsonl) and summary figures also when -v shows rank 0's raw lines instead."""
        path = posixpath.join(self.plan.checkpoint_dir, TRAINER_LOG)
        argv = ["tail", "-n", "0", "-F", "-s", "0.5", f"--pid={pid}", "--", path]
        record = self.display.record if isinstance(self.display, ProgressFeed) else self._record_quietly

        def follow() -> None:
            pending = b""
            try:
                proc = self.cluster.start(self.plan.nodes[0].host, argv)
                proc.close_stdin()
                while chunk := proc.read_out():
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        record(line.decode(errors="replace"))
            except (HostUnreachable, OSError, EOFError):
                pass

        self._log_follower = threading.Thread(target=follow, daemon=True, name="trainer-log")
        self._log_follower.start()

    def _record_quietly(self, line: str) -> None:
        """A trainer_log.jsonl line kept for the record only (-v: the terminal shows rank 0's own)."""
        from ..ui.progress import parse_trainer_log

        if (found := parse_trainer_log(line)) is not None:
            self.progress.feed_record(found)  # (this thread alone feeds records: -v has no progress display)

    # -- the loop ---------------------------------------------------------------------
    def run(self, before=None) -> Outcome:
        """The attempt, to its end. ``before`` (staging the run directory) runs first, while
        the node channels open (:func:`.node.start_behind`); if it fails, nothing started."""
        self.marks["begin"] = time.monotonic()
        start_behind(self.runners, before)
        started = self._awake = time.monotonic()
        for st in self.status:
            st.since = started
        for rank in range(len(self.runners)):  # one each: no host's pings wait on another's
            threading.Thread(target=self._pinger, args=(rank,), daemon=True, name=f"pinger{rank}").start()
        self._show_nodes()
        try:
            outcome = self._loop()
            outcome.progress = self.progress
        except KeyboardInterrupt:
            if self.ui is not None:
                self.ui.stop()
            self.say("interrupted: stopping every node")
            lost, took = self._teardown()
            self.say(f"all nodes stopped in {took:.1f}s" if not lost else
                     f"reachable nodes stopped in {took:.1f}s; " + self._unreachable_note(lost))
            outcome = Outcome(INTERRUPTED_EXIT_CODE, interrupted=True, teardown_s=took, lost=tuple(lost))
        finally:
            self._stop_pinging.set()
            self.display.close(timeout=2)
        if self.progress.first_step_at is not None:  # (rank 0's output may have said it before any node's steps)
            self.marks["first_step"] = min(self.marks.get("first_step", self.progress.first_step_at),
                                           self.progress.first_step_at)
        outcome.marks = self.marks
        return outcome

    def _pinger(self, rank: int) -> None:
        """One node's pings. A thread per node: a send can wait (a key exchange on that
        host's transport, up to cluster.REKEY_WAIT_S), and no other host may wait behind it."""
        runner, st = self.runners[rank], self.status[rank]
        while not self._stop_pinging.wait(PING_INTERVAL_S):
            if st.state in (State.EXITED, State.LOST):
                return
            runner.ping()

    def _next_event(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _take_events(self, timeout: float) -> None:
        """Handle every event that is waiting (after a wait of up to ``timeout`` for the
        first), so that silence is judged only on what the nodes have really said; and
        notice when ftbundle itself did not run for a while."""
        event = self._next_event(timeout)
        now = time.monotonic()
        if now - self._awake > PAUSED_AFTER_S + timeout:
            self._pardon(now - self._awake)
        while event is not None:
            self._handle(event)
            event = self._next_event(0)
        self._awake = time.monotonic()

    def _pardon(self, gap: float) -> None:
        """ftbundle was paused (SIGSTOP, a laptop lid, a VM migration, a starved CPU): the
        nodes' silence meanwhile is ours, not theirs. Their clocks start again now."""
        now = time.monotonic()
        for st in self.status:
            if st.state is State.RUNNING:
                st.last_heartbeat = max(st.last_heartbeat or now, now)
            elif st.state is State.STARTING:
                st.since = max(st.since, now)
        if gap >= WATCHDOG_S:
            self.away = (now, gap)
            self.say(f"ftbundle itself was paused for {gap:.1f}s, longer than the nodes' watchdog "
                     f"({WATCHDOG_S}s): they will have stopped their jobs")
        else:
            self.say(f"ftbundle itself was paused for {gap:.1f}s (stopped, suspended or starved of CPU); "
                     "not counting that silence against the nodes")

    def _loop(self) -> Outcome:
        while True:
            self._take_events(0.2)
            self._check_silence(self.lost_after, quiet_max=QUIET_MAX_FACTOR * self.lost_after)
            self.checkpoints.tick(self.progress.shown_step, self.progress.total)
            if (said := self.checkpoints.said()) is not None:
                self.say(("warning: " if said[1] else "") + said[0])
            for said in self.progress.gpu_tick(time.monotonic(), self.marks.get("first_step")):
                self.say("warning: " + said)  # (the GPUs' readings: ftbundle.gpu_metrics)
            if (paced := self.progress.pace_tick()) is not None:  # (the whole run slowed, or is back: ui.pace)
                self.say(("warning: " if paced[1] else "") + paced[0])
            if self.failures:
                return self._fail()
            if self.stall.stalled(time.monotonic()) and (outcome := self._stalled()) is not None:
                return outcome
            if all(st.state is State.EXITED for st in self.status):
                self._drain_rank0()
                return Outcome(0)

    def _set(self, rank: int, state: State, **fields) -> None:
        st = self.status[rank]
        self._running += (state is State.RUNNING) - (st.state is State.RUNNING)
        self._finished -= st.state is State.EXITED and st.code == 0
        st.state = state
        st.since = time.monotonic()
        for name, value in fields.items():
            setattr(st, name, value)
        self._finished += st.state is State.EXITED and st.code == 0
        if self._running == len(self.status) and "up" not in self.marks:
            self.marks["up"] = st.since

    def _fail_node(self, rank: int, reason: str, code: int, at: float) -> None:
        self.failures.append(Failure(rank, self.plan.nodes[rank].host.name, reason, code, at))

    def _handle(self, event: Event) -> None:
        st = self.status[event.rank]
        if st.state in (State.EXITED, State.LOST):
            return  # a node that has ended says nothing more that matters
        if event.kind == "hb":
            st.last_heartbeat = event.at
            if self.gpu_every and self.runners[event.rank].gpu_host:  # (its readings stopped? gpu_metrics)
                self.progress.gpus.beat(self.plan.nodes[event.rank].host.name)
            self.stall.observe(event.rank, event.text, event.at)
            if st.state is State.STARTING:
                self._set(event.rank, State.RUNNING)
                self._show_nodes()
        elif event.kind == "pid":
            st.pid = event.text
            st.last_heartbeat = event.at  # the program runs: its heartbeat clock starts now
            if (event.rank == 0 and self.ui is not None and self.plan.checkpoint_dir
                    and event.text.isdigit() and self._log_follower is None):
                self._follow_trainer_log(event.text)
            if st.state is State.STARTING:
                self._set(event.rank, State.RUNNING)
                self._show_nodes()
        elif event.kind == "steps":  # the node's ranks' step times (ui.stragglers)
            if self.progress.feed_steps(self.plan.nodes[event.rank].host.name, event.text):
                self._show_progress()
            if "first_step" not in self.marks and self.progress.node_steps:  # (a node's ranks made a step)
                self.marks["first_step"] = event.at
        elif event.kind == "storage":
            said = self.storage.observe(event.rank, event.text, event.at)
            if said and self.storage.since.get(event.rank) is not None:
                said += (f"; the run is stopped if no rank moves for stall_timeout ({self.plan.stall_timeout}s)"
                         if self.plan.stall_timeout else "; stall_timeout is 0: the run waits for it")
            if said:
                self.say(said)
        elif event.kind == "smi":  # a reading of the node's GPUs (ftbundle.gpu_metrics)
            self.progress.gpus.observe(self.plan.nodes[event.rank].host.name, event.text, event.at)
        elif event.kind == "msg":
            text = f"[{self.plan.nodes[event.rank].host.name} r{event.rank}] {self.redact(event.text)}"
            if self.ui is not None:
                self.ui.print(text)
            else:
                print(text, file=self.err, flush=True)
        elif event.kind == "exit":
            self._set(event.rank, State.EXITED, code=event.code)
            if event.code != 0:
                self._fail_node(event.rank, exit_reason(event.code), event.code, event.at)
            else:
                self._show_progress()  # (a node that finished is shown so, not as one gone)
        elif event.kind == "lost":
            at = st.last_heartbeat if st.last_heartbeat is not None else event.at
            self._lose(event.rank, event.text, at)
        elif event.kind == "fenced":  # its channel opened after the teardown began: nothing started
            self._set(event.rank, State.EXITED, reason=event.text)
        elif event.kind == "killed":  # its node program died, its host answers: stopped like the others
            self._set(event.rank, State.EXITED, code=LOST_EXIT_CODE, reason=event.text)
            self._orphaned.add(event.rank)  # (its job may still run: the teardown's second path)
            self._fail_node(event.rank, event.text, LOST_EXIT_CODE, event.at)

    def _lose(self, rank: int, reason: str, at: float) -> None:
        """A node given up on: LOST, its channels dropped, its failure dated ``at`` (its last
        sign of life, which is what the root cause is decided by)."""
        self._set(rank, State.LOST, reason=reason)
        self.runners[rank].drop()
        self._fail_node(rank, reason, LOST_EXIT_CODE, at)

    def _check_silence(self, limit: float, *, quiet_max: float | None = None, ask_before: float = PROBE_S) -> None:
        """Give up on a node that has not started in START_TIMEOUT_S, or that has been silent
        for ``limit`` while its host does not answer (:meth:`Cluster.answers`, asked
        ``ask_before`` seconds before the limit, so that a cut network is still noticed at
        the limit). A node whose host answers is alive but quiet (its node program starved
        of CPU, or our own loop slow to hear it: at 512 hosts on 2 cores, healthy nodes went
        silent for 5 s): it is given until ``quiet_max`` of silence, None for no limit (the
        teardown, which has a deadline of its own), and never while its channel holds what
        it said that our thread for it has not read yet (:meth:`NodeRunner.unheard`: the
        silence is then ours). Its failure is dated by its last heartbeat (a dead host found
        late may still be the root cause). The verdict is :func:`.states.silence_verdict`'s."""
        now = time.monotonic()
        for rank, st in enumerate(self.status):
            probe = self._probes.get(rank)
            if probe is not None and (st.state is not State.RUNNING or probe.since < st.last_heartbeat):
                probe = None  # (none yet for this silence)
            verdict = silence_verdict(st, now, None if probe is None else probe.answered, limit=limit,
                                      quiet_max=quiet_max, ask_before=ask_before)
            if verdict.asks and probe is None:
                self._probes[rank] = Probe(self.cluster, self.plan.nodes[rank].host, st.last_heartbeat)
            if verdict is Silence.NOT_STARTED:
                self._lose(rank, f"its node program did not start within {START_TIMEOUT_S:.0f}s", now)
                continue
            if not verdict.asks:
                continue
            silent = now - st.last_heartbeat
            if verdict is Silence.HOST_GONE:
                self._lose(rank, f"no heartbeat for {silent:.0f}s and its host does not answer "
                                 "(host down or network cut?)", st.last_heartbeat)
            elif verdict is Silence.HOST_LATE:
                self._lose(rank, f"no heartbeat for {silent:.0f}s and its host did not answer within {PROBE_S:g}s "
                                 "(host down or network cut?)", st.last_heartbeat)
            elif verdict is Silence.QUIET and not self.runners[rank].unheard():
                why = ("its node program frozen or starved of CPU?" if rank not in self.storage.since else
                       self.storage.describe(now, [rank]))  # (caught in a stat after all)
                self._lose(rank, f"no heartbeat for {silent:.0f}s although its host answers ({why})",
                           st.last_heartbeat)

    # -- failure and teardown ---------------------------------------------------------
    def _fail(self) -> Outcome:
        lost, took = self._teardown()
        first = min(self.failures, key=lambda f: f.at)
        node = self.plan.nodes[first.rank]
        if self.ui is not None:
            self.ui.stop()
        if self._lost_all_at_once():
            return self._lost_all(first, took)
        if stopped_while_away(self.away, first.at, first.code):
            return self._stopped_while_away(first, took, lost)
        if first.code in STOPPED_CODES and stop_requested(self.plan, self.cluster):
            self.say(f"stopped by `ftbundle stop` ({self.plan.rundir.stop_request}): every node stopped in {took:.1f}s"
                     + (f"; {self._unreachable_note(lost)}" if lost else ""))
            return Outcome(INTERRUPTED_EXIT_CODE, interrupted=True, requested=True, teardown_s=took, lost=tuple(lost),
                           progress=self.progress)
        self.say(f"node {first.host} (node rank {first.rank}, {node.host.address}) failed first: {first.reason}")
        for f in sorted((f for f in self.failures if f is not first), key=lambda f: f.at):
            self.say(f"  then {f.host} (node rank {f.rank}): {f.reason}")
        self.say(f"stopped the other nodes in {took:.1f}s" + (f"; {self._unreachable_note(lost)}" if lost else ""))
        if self.ui is not None:
            cause = self._print_failure_summary(first)
            if cause:  # (what the run's record, `runs` and a webhook say: the rank, not only its node)
                first = dataclasses.replace(first, reason=f"{first.reason}; {cause}")
        else:
            self._print_log_tail(first.rank)
        faults = self._print_gpu_faults()
        return Outcome(first.code, first, teardown_s=took, lost=tuple(lost), progress=self.progress,
                       gpu_faults=faults)

    def _lost_all_at_once(self) -> bool:
        """Every node of a multi-node run went silent, none said a word about failing: it
        is this machine that lost them (its network, its VPN), not each of them."""
        return (len(self.status) > 1 and all(st.state is State.LOST for st in self.status)
                and all(f.code == LOST_EXIT_CODE and "heartbeat" in f.reason for f in self.failures))

    def _lost_all(self, first: Failure, took: float) -> Outcome:
        spread = max(f.at for f in self.failures) - first.at
        self.say(f"lost every node at once: no heartbeat from any of the {len(self.status)} nodes "
                 f"(they fell silent within {spread:.1f}s of each other); the network between this machine "
                 "and the nodes is likely cut, not the nodes")
        self.say(f"each node stops its job by itself within {WATCHDOG_S}s of its last ping (its watchdog) "
                 "and writes why into its log; `ftbundle runs` shows the run as stopped: launcher lost")
        lost = list(range(len(self.status)))
        return Outcome(LOST_EXIT_CODE, first, teardown_s=took, lost=tuple(lost), progress=self.progress,
                       launcher_lost=True)

    def _stopped_while_away(self, first: Failure, took: float, lost: list[int]) -> Outcome:
        """ftbundle was paused past the nodes' watchdog (_pardon: a laptop's lid, SIGSTOP): each
        node stopped its job itself (launcher lost) and none failed. Said as that, not as the
        first node's SIGTERM; rank 0's host may have told the run's end meanwhile (attempts.finish)."""
        why = (f"launcher lost: ftbundle was paused for {self.away[1]:.1f}s, longer than the nodes' watchdog "
               f"({WATCHDOG_S}s)")
        self.say("every node stopped its job by itself while ftbundle was paused: the run is recorded as stopped: "
                 "launcher lost" + (f"; {self._unreachable_note(lost)}" if lost else ""))
        return Outcome(LOST_EXIT_CODE, dataclasses.replace(first, code=LOST_EXIT_CODE, reason=why), teardown_s=took,
                       lost=tuple(lost), progress=self.progress, launcher_lost=True)

    def _stalled(self) -> Outcome | None:
        """No progress for stall_timeout: every rank's state and stack first (:mod:`.stall`),
        then the same teardown as a failure; exit STALLED_EXIT_CODE. None: not a stall after
        all (no rank is left: torchrun is ending), the run goes on."""
        silent = self.stall.silent_for(time.monotonic())
        if self.storage.stuck():
            return self._stalled_on_storage(silent)
        lines, culprit, found = stall_report(self.plan, self.cluster, self.attempt)
        self._awake = time.monotonic()  # (busy collecting, not paused: no pardon for those seconds)
        while (event := self._next_event(0)) is not None:  # the heartbeats that came meanwhile
            self._handle(event)
        if ending(self.plan, found):
            self.stall.last_progress = time.monotonic()  # (asked again after another stall_timeout)
            return None
        if self.ui is not None:
            self.ui.stop()
        self.say(f"stalled: no progress from any rank for {silent:.0f}s (stall_timeout {self.plan.stall_timeout}s); "
                 "every rank's state and stack:")
        for line in lines:
            self.say(self.redact(line))
        t0 = time.monotonic()
        lost, took = self._teardown()
        self.say(f"stopped every node in {took:.1f}s" + (f"; {self._unreachable_note(lost)}" if lost else ""))
        failure = Failure(culprit.node_rank if culprit else 0, culprit.host if culprit else self.plan.nodes[0].host.name,
                          f"stalled: no progress for {silent:.0f}s", STALLED_EXIT_CODE, t0)
        faults = self._print_gpu_faults()  # (a GPU that fell off the bus leaves its peers waiting in a collective)
        return Outcome(STALLED_EXIT_CODE, failure, teardown_s=took, lost=tuple(lost), progress=self.progress,
                       stalled=True, gpu_faults=faults)

    def _stalled_on_storage(self, silent: float) -> Outcome:
        """No progress while shared storage does not answer: that is the story. The ranks'
        stacks are not collected (they are kept on that storage, and a rank waiting there
        would show only its write); the same teardown as a failure, exit STALLED_EXIT_CODE."""
        now = time.monotonic()
        stuck = self.storage.stuck()
        if self.ui is not None:
            self.ui.stop()
        what = self.storage.describe(now)
        self.say(f"stalled: {what}; no progress from any rank for {silent:.0f}s "
                 f"(stall_timeout {self.plan.stall_timeout}s)")
        t0 = time.monotonic()
        lost, took = self._teardown()
        self.say(f"stopped every node in {took:.1f}s" + (f"; {self._unreachable_note(lost)}" if lost else ""))
        if lost:
            self.say("a process waiting on that storage cannot be killed: its SIGKILL waits until the storage "
                     "answers (or its mount is forced off: umount -f / -l)")
        failure = Failure(stuck[0], self.plan.nodes[stuck[0]].host.name, f"stalled: {what}", STALLED_EXIT_CODE, t0)
        return Outcome(STALLED_EXIT_CODE, failure, teardown_s=took, lost=tuple(lost), progress=self.progress,
                       stalled=True)

    def _print_failure_summary(self, first: Failure) -> str | None:
        """Who failed, the failing rank's own traceback, a hint (:mod:`ftbundle.ui.summary`);
        returns the failing rank in a line (:func:`failure.cause_line`), None if none was named."""
        from ..ui.summary import failure_summary

        runner = self.runners[first.rank]
        node = self.plan.nodes[first.rank]
        full = read_tail(self.plan, self.cluster, first.rank, runner.files.log, FAILURE_TAIL_LINES,
                         lost=self.status[first.rank].state is State.LOST) or []
        found = rank_failure(self.plan, self.cluster, first.rank, full)
        tail = full[-TAIL_LINES:] if full else None
        lines = failure_summary(
            host=first.host, address=node.host.address, node_rank=first.rank, reason=first.reason,
            code=found.code if found.code is not None else first.code, rank_error=found.error,
            rank_traceback=found.traceback, tail=tail, log_path=runner.files.log, local_rank=found.local_rank,
            global_rank=found.global_rank, rank_last_words=found.last_words, wrapper_said=tuple(runner.messages))
        if self.more_attempts and lines:  # (the attempt's end, not the run's: what follows says what comes next)
            lines[0] = f"attempt {self.attempt} {lines[0]}"
        for line in lines:
            self.ui.print(self.redact(line))
        if runner.messages:
            self.say("node wrapper said: " + self.redact(" / ".join(runner.messages[-3:])))
        cause = cause_line(found, first.code)
        return None if cause is None else self.redact(cause)

    def _print_gpu_faults(self) -> tuple[str, ...]:
        """GPU faults the kernel logged during the run (NVRM Xid lines since it began), on every
        node that still answers, named by host, GPU index and UUID, with what they mean: a GPU
        that fell off the bus or hit an uncorrectable error is often what ended the run, and its
        host is not always the one that failed first (its peers' collectives fail too). One
        short command a node with nvidia-smi (its node program said ``ftb-gpu``), all at once
        (node.sh ``xids``); none on a fleet without GPUs. Returns the findings' lines (summary.json)."""
        from ..gpu_health import fold_findings, parse_xids_report, run_fault_lines, xid_findings

        window = time.monotonic() - self.marks.get("begin", time.monotonic()) + XID_SLACK_S
        ranks = [r for r, st in enumerate(self.status) if st.state is not State.LOST and self.runners[r].gpu_host]
        if not ranks:  # (no node said it has nvidia-smi: nothing to read, and no round trip)
            return ()

        def ask(rank: int) -> list:
            host = self.plan.nodes[rank].host
            try:
                result = self.cluster.run(host, node_argv("xids", str(int(window) + 1)), timeout=XID_READ_S)
            except Exception:  # noqa: BLE001 - a host that does not answer now: its log stays unread
                return []
            gpus, xids = parse_xids_report(result.stdout)
            return xid_findings(host.name, gpus, xids, window_s=window)

        found = [f for per_node in parallel(ask, ranks, workers=XID_READ_THREADS) for f in per_node]
        for line in run_fault_lines(found):
            self.say(line)
        return tuple(fold_findings(found))

    def _unreachable_note(self, lost: list[int]) -> str:
        unreachable = [self.plan.nodes[r].host.name for r in lost if self.status[r].state is State.LOST]
        slow = [self.plan.nodes[r].host.name for r in lost if self.status[r].state is not State.LOST]
        return unreachable_note(unreachable, slow)

    def _teardown(self) -> tuple[list[int], float]:
        """Stop every node over the open connections (:mod:`.teardown`); the ranks not confirmed
        stopped, and the seconds the stopping took (what "stopped the other nodes in" says: not
        the wait for rank 0's log to reach its end after it, up to DRAIN_S, which a rank 0 whose
        host's SSH key exchange hangs spends whole). The loop's events are taken meanwhile: a
        node silent for TEARDOWN_SILENT_S is lost only when its host does not answer."""
        t0 = time.monotonic()
        self.marks.setdefault("failed", t0)  # (the launcher acted: Outcome.marks)
        stopping = stop_nodes(self.runners, self.status, fence=self.fence, orphaned=self._orphaned,
                              host_answers=[r for r, probe in self._probes.items() if probe.answered],
                              take_events=self._take_events,
                              check_silence=lambda limit: self._check_silence(limit, ask_before=0))
        took = time.monotonic() - t0
        self._drain_rank0()
        return stopping.unconfirmed([st.state for st in self.status]), took

    def _drain_rank0(self) -> None:
        """Rank 0's log to its end on the terminal before we return. Not waited for while a key
        exchange holds rank 0's connection (HELD_WAIT_S): paramiko's transport thread then waits
        to send a channel's close and reads nothing more, so the log cannot reach its end (DRAIN_S
        spent for nothing); the log is whole on shared storage."""
        host = self.plan.nodes[0].host
        if self.status[0].state is State.EXITED and (not self.cluster.alive(host)
                                                     or self.cluster.can_send(host, HELD_WAIT_S)):
            self.runners[0].log_drained(DRAIN_S)
            if self._log_follower is not None:
                self._log_follower.join(DRAIN_S)
        self.display.flush(timeout=DRAIN_S)

    def _print_log_tail(self, rank: int) -> None:
        runner = self.runners[rank]
        path = runner.files.log
        lines = read_tail(self.plan, self.cluster, rank, path, TAIL_LINES,
                          lost=self.status[rank].state is State.LOST)
        if lines is None:
            self.say(f"could not read {path}")
        else:
            self.say(f"last {len(lines)} lines of {path}:")
            for line in lines:
                print(f"  | {self.redact(line)}", file=self.err)
        if runner.messages:
            self.say("node wrapper said: " + self.redact(" / ".join(runner.messages[-3:])))
