"""Attempts of a run: what the next one runs on after a failure, and the loop that runs them.

The policy (the job's ``on_node_loss``, ``spares``, ``min_nodes``, ``keep_global_batch``) is
the pure function :func:`next_attempt`: from the job, the previous attempt's layout and rank
counts, the hosts that were lost and the spares that passed the preflight, it returns the
next layout (hosts in rank order, MASTER_ADDR on the new rank 0, the LlamaFactory config
with its gradient accumulation rescaled) and the line that says why; or a stop (exit 255)
when fewer than ``min_nodes`` hosts are left.

:func:`launch` is the loop: run an attempt (:class:`.supervisor.Supervisor`), and after a
failure fence it (every process of it confirmed gone on every host it can reach), decide the
next attempt, resume. A lost host may only be cut off, not dead: it is never waited on, and it
cannot write into the next attempt (see :func:`_fence_lost` and docs/launcher.md, "A lost host").
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import yaml

from .. import gpu_metrics, rundir
from ..cluster import Cluster, HostUnreachable, first_line, parallel
from ..errors import UserError
from ..hostlist import fold
from ..inventory import Host
from ..job import Job
from ..llamafactory import HF_DEFAULT_BATCH
from ..layout import Layout, host_settings, master_addr_of
from ..plan import Plan
from ..recovery import RECOVERY_PARTS, attempts_said, recovery_said
from ..ui.progress import Progress
from .failure import read_diverged
from .node import STOP_GRACE_S, WATCHDOG_S, node_argv
from .record import claim_end, failure_said, record_hosts, record_run, told_said
from .staging import stage_files
from .states import INTERRUPTED_EXIT_CODE, LOST_EXIT_CODE, Outcome, State
from .supervisor import Supervisor
from .teardown import stop_requested

RESTART_DELAY_S = 1.0
FENCE_MARGIN_S = 5.0  # beyond a lost node's watchdog and stop grace: its stop written, on a loaded host


# ---------------------------------------------------------------------------------------
# The policy (pure)


@dataclass(frozen=True)
class Batch:
    """The global batch of a LlamaFactory attempt: per device x accumulation x world."""

    per_device: int
    accumulation: int
    world: int

    @property
    def size(self) -> int:
        return self.per_device * self.accumulation * self.world


@dataclass(frozen=True)
class NextAttempt:
    """What the next attempt runs on, or why there is none (``stop``: the exit code)."""

    attempt: int
    hosts: tuple[str, ...]  # in rank order
    lost: dict[str, str]  # host -> why it was left out
    line: str  # "attempt 2 on node[0-1]: node2 lost (...); global batch 12 kept: accumulation 2 -> 3"
    layout: Layout | None = field(default=None, repr=False)
    replaced: dict[str, str] = field(default_factory=dict)  # lost host -> the spare in its place
    batch: Batch | None = None
    stop: int | None = None


def asked_batch(job: Job, first_world: int) -> Batch | None:
    """The global batch the job asked for: its LlamaFactory config on its first world."""
    config = job.train.llamafactory
    if config is None:
        return None
    return Batch(int(config.get("per_device_train_batch_size", HF_DEFAULT_BATCH)),
                 int(config.get("gradient_accumulation_steps", 1)), first_world)


def rescale(asked: Batch, world: int, keep: bool = True) -> tuple[Batch, str]:
    """The batch on ``world`` ranks and what to say of it. Kept: the accumulation that gives
    the asked global batch, or where none divides it, the nearest (the smaller of two equally
    near; never below 1), and the new global batch said."""
    if not keep:
        new = Batch(asked.per_device, asked.accumulation, world)
        return new, (f"global batch {asked.size} -> {new.size} (keep_global_batch: false; "
                     f"accumulation {asked.accumulation} kept)" + (STEPS_CHANGE if new.size != asked.size else ""))
    per_step = asked.per_device * world
    low = max(1, asked.size // per_step)
    high = low + 1
    accumulation = low if asked.size - low * per_step <= high * per_step - asked.size else high
    new = Batch(asked.per_device, accumulation, world)
    change = f"accumulation {asked.accumulation} -> {accumulation}"
    if new.size == asked.size:
        return new, f"global batch {asked.size} kept: {change}"
    return new, (f"global batch {asked.size} cannot be kept on {world} rank(s) x {asked.per_device} per device: "
                 f"{change}, global batch {new.size}{STEPS_CHANGE}")


# what a changed global batch does to the step count the live line shows (the walk saw `step 21/114`,
# then `step 22/96`, with nothing said): an epoch is the dataset over the global batch
STEPS_CHANGE = "; an epoch is now a different number of steps, so the step total changes (max_steps: it does not)"


def next_attempt(job: Job, previous: Layout, nprocs: dict[str, int], lost: dict[str, str], *, attempt: int,
                 first_world: int, spares: list[tuple[Host, int]] = ()) -> NextAttempt:
    """The next attempt after ``lost`` (host name -> why) were lost from ``previous`` (whose
    hosts ran ``nprocs`` ranks each). ``spares``: hosts of the spares group that passed the
    preflight, with their rank counts, in the order they are taken. Pure.

    The hosts left keep their rank order (node ranks renumbered from 0); a spare takes a lost
    host's place in that order (``on_node_loss: spare``; lost hosts beyond the spares are left
    out); MASTER_ADDR follows rank 0. Below ``min_nodes``: a stop (exit 255) naming every
    lost host."""
    said_lost = "; ".join(f"{h} lost ({why})" for h, why in lost.items())
    every = fold((*previous.excluded, *lost))  # (a stop names every host lost so far)
    free = list(spares) if job.on_node_loss == "spare" else []
    hosts: list[Host] = []
    counts = dict(nprocs)
    replaced: dict[str, str] = {}
    for host in previous.hosts:
        if host.name not in lost:
            hosts.append(host)
        elif free:
            spare, n = free.pop(0)
            hosts.append(spare)
            counts[spare.name] = n
            replaced[host.name] = spare.name
    left_out = [h for h in lost if h not in replaced]
    if len(hosts) < job.min_nodes or not hosts:
        return NextAttempt(attempt, tuple(h.name for h in hosts), dict(lost),
                           f"stopping: {said_lost}; {len(hosts)} host(s) left, fewer than min_nodes "
                           f"{job.min_nodes} (lost: {every})" if hosts else
                           f"stopping: {said_lost}; no host left (lost: {every})",
                           stop=LOST_EXIT_CODE)
    parts = [f"attempt {attempt} on {fold(h.name for h in hosts)}: {said_lost}"]
    if replaced:
        parts[0] += "; " + ", ".join(f"{spare} in place of {h}" for h, spare in replaced.items())
    if job.on_node_loss == "spare" and left_out:
        parts[0] += f"; no spare left in group {job.spares}: {fold(left_out)} left out"
    host_nprocs, host_gpus = host_settings(job, hosts)  # (a spare's own ftb_nproc_per_node, ftb_gpus)
    layout = dataclasses.replace(previous, hosts=tuple(hosts), master_addr=master_addr_of(hosts, job),
                                 excluded=tuple(dict.fromkeys((*previous.excluded, *lost))),
                                 host_nprocs=host_nprocs, host_gpus=host_gpus)
    world = sum(counts[h.name] for h in hosts)
    batch = None
    asked = asked_batch(job, first_world)
    if asked is not None and previous.lf_config is not None:
        batch, said = rescale(asked, world, job.keep_global_batch)
        parts.append(said)
        layout = with_accumulation(layout, batch.accumulation)
    return NextAttempt(attempt, tuple(h.name for h in hosts), dict(lost), "; ".join(parts), layout=layout,
                       replaced=replaced, batch=batch)


def with_accumulation(layout: Layout, accumulation: int) -> Layout:
    """The layout with LlamaFactory's gradient_accumulation_steps set, in the staged config and
    in the job's (which the plan's effective batch line is made from)."""
    job = layout.job
    key = "gradient_accumulation_steps"
    config = {**layout.lf_config, key: accumulation}
    train = dataclasses.replace(job.train, llamafactory={**job.train.llamafactory, key: accumulation})
    files = {**layout.files, rundir.LLAMAFACTORY_CONFIG: yaml.safe_dump(config, sort_keys=False)}
    return dataclasses.replace(layout, job=dataclasses.replace(job, train=train), lf_config=config, files=files)


def short_reason(reason: str) -> str:
    """The supervisor's words for a lost node, cut to what the attempt line needs."""
    m = re.search(r"no heartbeat for (\d+)s", reason)
    if m:
        return f"no heartbeat {m.group(1)} s"
    return reason.split(" (")[0][:80]


def recovery(marks: dict[str, float], *, wall_offset: float = 0.0) -> dict | None:
    """Where the time from a failure to the next attempt's first step went, from the
    launcher's monotonic ``marks``: ``loss`` (the lost or failed node's last sign of life),
    ``failed`` (the supervisor acted), ``fenced`` (every process of the old attempt confirmed
    gone where reachable), ``planned`` (the next attempt's hosts chosen, a spare preflighted),
    ``waited`` (a lost host's watchdog waited out), then the new attempt's ``begin``, ``up``
    (every node's program running) and ``first_step``. Parts in seconds, in that order:
    detection, teardown, preflight, fence_wait, start (resume point read, staging, channels,
    node programs), resume (the ranks' start, rendezvous, checkpoint load, first step); a part
    whose ends are not both known is None, and so is the total. ``wall_offset`` (time.time()
    - time.monotonic()) dates ``loss_at``/``failed_at``/``first_step_at`` for a reader with a
    clock of its own (bench/node_loss.py). Pure."""
    if "failed" not in marks:
        return None
    order = [("loss", "failed"), ("failed", "fenced"), ("fenced", "planned"), ("planned", "waited"),
             ("waited", "up"), ("up", "first_step")]
    parts = {name: (round(marks[b] - marks[a], 2) if a in marks and b in marks else None)
             for name, (a, b) in zip(RECOVERY_PARTS, order)}
    total = marks["first_step"] - marks["loss"] if "first_step" in marks and "loss" in marks else None
    out = {**parts, "total": None if total is None else round(total, 2)}
    for mark in ("loss", "failed", "first_step"):
        if mark in marks:
            out[f"{mark}_at"] = round(marks[mark] + wall_offset, 3)
    return out


def restart_marks(outcome: Outcome) -> dict[str, float]:
    """The first marks of a restart (:func:`recovery`) from the attempt that failed: ``loss``
    (its first failure's date: a lost node's last heartbeat) and ``failed`` (its teardown
    began). Only these: the failed attempt's own begin, up and first_step are not the next
    one's, and a next attempt that never got that far must not borrow them."""
    acted = outcome.marks.get("failed", time.monotonic())
    loss = outcome.failure.at if outcome.failure else acted
    return {"loss": loss, "failed": outcome.marks.get("failed", loss)}


# ---------------------------------------------------------------------------------------
# The loop


@dataclass
class Policy:
    """What the loop needs to make another attempt on other hosts: the job, the first
    attempt's layout, a way to make a plan from a layout (the caller's facts in it), and for
    ``spare``, the spares group's hosts and their preflight."""

    job: Job
    layout: Layout
    replan: Callable[[Layout], Plan]
    spares: Callable[[], list[Host]] = list
    # (the candidate layout, the spares in it) -> {spare name: rank count} of those that passed
    preflight: Callable[[Layout, list[Host]], dict[str, int]] | None = None


def fence(plan: Plan, cluster: Cluster, attempt: int,
          gone: frozenset[int] = frozenset()) -> dict[str, tuple[str, bool]]:
    """Make sure no process of ``attempt`` is left on any host: {host: (problem, unreachable)}
    for each host where that could not be confirmed.

    A host whose connection died is reconnected first; one the supervisor gave up on
    (``gone``: ranks LOST, their host did not answer) is not asked over its old transport at
    all, which stays "active" long after a silent host died and would cost the `stop`'s whole
    timeout (8 s in bench/node_loss.py's cut-off host) before the reconnect. A host that still
    cannot be reached, or whose old processes will not die, is named: relaunching beside them
    would let two attempts collide (ports, GPUs, the same checkpoint directory)."""
    def stop(node) -> bool:
        files = plan.node_files(node, attempt)
        return cluster.run(node.host, node_argv("stop", files.marker, node.container or ""),
                           timeout=STOP_GRACE_S + 5).ok

    def one(node) -> tuple[str, bool] | None:
        host = node.host
        stuck = (f"processes of attempt {attempt} would not stop", False)
        if node.rank not in gone:
            try:
                return None if stop(node) else stuck
            except (HostUnreachable, TimeoutError):
                pass  # the transport may be dead without knowing it yet: one fresh connection
        if not cluster.reconnect(host):
            return f"unreachable ({cluster.errors.get(host.name, 'no connection')})", True
        try:
            return None if stop(node) else stuck
        except (HostUnreachable, TimeoutError) as exc:
            return f"unreachable ({first_line(exc)})", True

    return {n.host.name: p for n, p in zip(plan.nodes, parallel(one, plan.nodes)) if p}


def resume_point(plan: Plan, cluster: Cluster) -> tuple[str | None, list[str]]:
    """(newest complete checkpoint name or None, what was cleaned up)."""
    result = cluster.run(plan.nodes[0].host, node_argv("resume-point", plan.checkpoint_dir), timeout=30)
    last = result.stdout.strip().splitlines()[-1:] or [None]
    return last[0], [line for line in result.stderr.splitlines() if line.strip()]


def lost_hosts(plan: Plan, supervisor: Supervisor, problems: dict[str, tuple[str, bool]]) -> dict[str, str]:
    """The hosts lost in an attempt: the node's connection and heartbeat gone (LOST), or its
    host unreachable now that the next attempt is prepared; host -> why, in rank order."""
    out: dict[str, str] = {}
    for node, st in zip(plan.nodes, supervisor.status):
        why = []
        if st.state is State.LOST:
            why.append(short_reason(st.reason))
        problem = problems.get(node.host.name)
        if problem and problem[1]:
            why.append("host unreachable")
        if why:
            out[node.host.name] = ", ".join(why)
    return out


def _fence_lost(supervisor: Supervisor, plan: Plan, lost: dict[str, str], say) -> None:
    """A lost host may be cut off, not dead: its node program stops its job by itself when
    the pings stop (WATCHDOG_S, then STOP_GRACE_S to SIGKILL). The next attempt starts only
    after that time has passed since the host's last heartbeat, so an old rank there is gone
    before a new one runs (and the attempt file the old ranks check already says the new
    attempt: :mod:`ftbundle.shims.llamafactory_entry`)."""
    now = time.monotonic()
    last = [st.last_heartbeat or st.since for n, st in zip(plan.nodes, supervisor.status) if n.host.name in lost]
    until = max((t + WATCHDOG_S + STOP_GRACE_S + FENCE_MARGIN_S for t in last), default=now)
    if until > now:
        say(f"waiting {until - now:.0f}s more: a lost host's own watchdog stops its job {WATCHDOG_S}s after "
            "its last ping, so nothing of the old attempt runs beside the new one")
        time.sleep(until - now)


def _next_plan(policy: Policy, plan: Plan, layout: Layout, lost: dict[str, str], attempt: int, first_world: int,
               say) -> tuple[NextAttempt, Plan | None, Layout]:
    """The next attempt's plan after hosts were lost (spares preflighted first)."""
    job = policy.job
    nprocs = {n.host.name: n.nproc for n in plan.nodes}
    spares: list[tuple[Host, int]] = []
    if job.on_node_loss == "spare":
        used = {h.name for h in layout.hosts} | set(layout.excluded)
        pool = [h for h in policy.spares() if h.name not in used]
        # one spare at a time, in the group's order: one that fails its preflight (unreachable,
        # a check refused) is passed over for the next, never taking a good one down with it
        while pool and len(spares) < len(lost):
            spare = pool.pop(0)
            passed = {spare.name: 1}
            if policy.preflight is not None:
                try:
                    trial = next_attempt(job, layout, nprocs, lost, attempt=attempt, first_world=first_world,
                                         spares=[*spares, (spare, 1)]).layout
                except UserError as exc:  # (its inventory vars: an ftb_gpus that is not a GPU list)
                    say(f"spare {spare.name}: {exc}")
                    trial = None
                passed = policy.preflight(trial, [spare]) if trial is not None else {}
            if spare.name in passed:
                spares.append((spare, passed[spare.name]))
            else:
                say(f"spare {spare.name} did not pass the preflight (see above): not taken"
                    + (f"; trying {pool[0].name}" if pool else ""))
    nxt = next_attempt(job, layout, nprocs, lost, attempt=attempt, first_world=first_world, spares=spares)
    if nxt.layout is None:
        return nxt, None, layout
    return nxt, policy.replan(nxt.layout), nxt.layout


def launch(plan: Plan, cluster: Cluster, *, restarts: int = 0, out: TextIO | None = None,
           err: TextIO | None = None, ui=None, verbose: bool = True, before=None, start_step: int = 0,
           policy: Policy | None = None) -> int:
    """Run the plan to its end, restarting up to ``restarts`` times; the exit code.

    ``before`` (staging the run directory) runs while the first attempt's node channels
    open; it raising means nothing was started. ``start_step``: the checkpoint's step the
    first attempt resumes from (:mod:`.resume`); a restart reads its own. ``policy``: what a
    lost host leads to (the job's ``on_node_loss``); None: every attempt on the same hosts.

    With ``ui`` (:class:`ftbundle.ui.Phases`) the run shows its phases and ends with a
    summary, and its record (summary.json, metrics.jsonl, attempts.json) is left in the run
    directory for ``ftbundle runs``, ``status`` and ``plot``."""
    err = err or sys.stderr
    started_wall, started = time.time(), time.monotonic()
    wall_offset = started_wall - started
    recoveries: list[dict] = []  # each restart's parts (:func:`recovery`), for summary.json
    pending: dict[str, float] = {}  # the marks of the restart under way, before its attempt's own
    layout = policy.layout if policy is not None else None
    first_world = plan.world_size  # (the world the job's global batch was asked on)
    history = [{"attempt": 1, "hosts": [n.host.name for n in plan.nodes], "why": ""}]

    def say(message: str) -> None:
        if ui is not None:
            ui.say(message)
        else:
            print(f"ftbundle: {message}", file=err, flush=True)

    curve: list[dict] = []  # every attempt's trainer records, each with its attempt: one curve per run
    fleets: list = []  # every attempt's GPUs (gpu_metrics.GpuFleet); the run's figures over them: run_gpus
    run_gpus: dict | None = None
    telling: list[threading.Thread] = []  # a lost host told (notify) while the run goes on

    def tell_lost(nxt: NextAttempt, outcome: Outcome, attempt: int) -> None:
        """A host lost and the run going on without it (or with a spare): told once, now, in a thread
        of its own (the restart never waits on a notifier; the run's end waits for it within its limit)."""
        if plan.notify is None:
            return
        from ..notify import send

        told = {"run_id": plan.run_id, "job": plan.job_name, "state": "host lost", "attempt": attempt + 1,
                "hosts": list(nxt.hosts), "lost": dict(nxt.lost), "replaced": dict(nxt.replaced), "line": nxt.line,
                "failure": failure_said(outcome)}
        telling.append(threading.Thread(target=send, args=(plan.notify, told, say), daemon=True))
        telling[-1].start()

    def finish(outcome: Outcome, attempt: int) -> int:
        for thread in telling:  # (a lost host's word, still on its way: within its own limit)
            thread.join(timeout=15)
        if ui is not None:
            summary, via = record_run(plan, cluster, outcome, attempt=attempt, started_wall=started_wall,
                                      duration_s=time.monotonic() - started, attempts=history, recoveries=recoveries,
                                      curve=curve, gpus=run_gpus)
            told = claim_end(plan, cluster, attempt, via) if outcome.launcher_lost and plan.notify else None
            if told is not None:
                say("notify: not told again: " + told_said(plan, attempt, told))
            elif plan.notify is not None:  # (once, at the run's end: ftbundle/notify.py)
                from ..notify import send

                send(plan.notify, summary, say)  # (summary.json: its failure as the notifier gets it too)
        return outcome.exit_code

    def stopped_between(outcome: Outcome, attempt: int) -> int:
        """`ftbundle stop` asked between two attempts (no node was running to be stopped): the
        next one is not started, and the run is recorded as stopped."""
        say(f"stopped by `ftbundle stop` ({plan.rundir.stop_request}): attempt {attempt} not started")
        return finish(dataclasses.replace(outcome, exit_code=INTERRUPTED_EXIT_CODE, failure=None, interrupted=True,
                                          requested=True), attempt - 1)

    attempts = restarts + 1
    for attempt in range(1, attempts + 1):
        if attempt > 1 and stop_requested(plan, cluster):  # (`ftbundle stop` while the restart was prepared)
            return stopped_between(outcome, attempt)
        if attempt > 1:
            files = {rundir.ATTEMPT: f"{attempt}\n"}
            if len(history) > 1:
                import json

                files[rundir.PLAN] = json.dumps(plan.to_dict(redact=True), indent=2) + "\n"
                files[rundir.ATTEMPTS] = json.dumps(history, indent=2) + "\n"
                files.update(plan.files)  # (the config with its rescaled accumulation)
            stage_files(cluster, plan.nodes[0].host, plan.run_dir, files)
        supervisor = Supervisor(plan, cluster, attempt=attempt, out=out, err=err, ui=ui, verbose=verbose,
                                start_step=start_step, more_attempts=attempt < attempts, run_started=started)
        outcome = supervisor.run(before if attempt == 1 else None)
        curve += [{**r, "attempt": attempt} for r in (outcome.progress.plot_records() + outcome.progress.gpus.curve
                                                      if outcome.progress else [])]
        fleets.append(outcome.progress.gpus if outcome.progress else None)
        run_gpus = gpu_metrics.over_attempts(fleets)
        if pending:  # (a restart: where the time from the failure to this attempt's first step went)
            parts = recovery({**pending, **outcome.marks}, wall_offset=wall_offset)
            recoveries.append({"attempt": attempt, **parts})
            if history[-1]["attempt"] == attempt:
                history[-1]["recovery"] = parts
            pending = {}
        if outcome.exit_code == 0:
            if ui is not None:
                ui.final_progress()
                ui.done(closing_lines(plan, outcome, time.monotonic() - started, attempt, history, recoveries,
                                      gpus=run_gpus))
            else:
                say(f"run {plan.run_id} finished on all {plan.nnodes} node(s)"
                    + (f" (attempt {attempt})" if attempt > 1 else ""))
            return finish(outcome, attempt)
        f = outcome.failure  # (a rank's exception exits 1: only then can its ranks have stopped it)
        if f is not None and f.code == 1 and (diverged := read_diverged(plan, cluster, attempt)) is not None:
            outcome = dataclasses.replace(outcome, failure=dataclasses.replace(
                f, reason=f"its ranks stopped the run: {diverged}"))  # (what `notify` and `runs` say)
            if attempt < attempts:
                say(f"not restarting: the ranks stopped the run: {diverged}; a restart would take up its newest "
                    "checkpoint with the same settings and go the same way (change them, then `ftbundle run` again)")
            return finish(outcome, attempt)
        if outcome.interrupted or attempt == attempts:
            if attempts > 1 and not outcome.interrupted:
                say(f"giving up after {attempts} attempts")
            return finish(outcome, attempt)
        if stop_requested(plan, cluster):  # (`ftbundle stop` as this attempt ended)
            return stopped_between(outcome, attempt + 1)
        # the run goes on: no end to tell, whatever rank 0's teller makes of its launcher gone (a pause, a cut)
        lost_ranks = frozenset(rank for rank, st in enumerate(supervisor.status) if st.state is State.LOST)
        told = claim_end(plan, cluster, attempt, next(iter(record_hosts(plan, cluster, lost_ranks | set(outcome.lost))), None))
        if told is not None and plan.notify is not None:
            say(f"notify: {told_said(plan, attempt, told)}; the run goes on, and its end is told when it comes")
        pending = restart_marks(outcome)
        problems = fence(plan, cluster, attempt, lost_ranks)
        pending["fenced"] = time.monotonic()
        acts = policy is not None and policy.job.on_node_loss != "stop"
        if any(not unreachable for _, unreachable in problems.values()) or (problems and not acts):
            say("not restarting: the old processes could not be confirmed gone on every host: "
                + "; ".join(f"{h} is {p}" if unreachable else f"{h}: {p}"
                            for h, (p, unreachable) in problems.items()))
            return outcome.exit_code
        lost = lost_hosts(plan, supervisor, problems) if acts else {}
        if lost:
            nxt, new_plan, new_layout = _next_plan(policy, plan, layout, lost, attempt + 1, first_world, say)
            pending["planned"] = time.monotonic()
            say(nxt.line)
            if nxt.stop is not None:
                outcome = dataclasses.replace(outcome, exit_code=nxt.stop)
                return finish(outcome, attempt)
            tell_lost(nxt, outcome, attempt)
            _fence_lost(supervisor, plan, lost, say)
            pending["waited"] = time.monotonic()
            plan, layout = new_plan, new_layout
            history.append({"attempt": attempt + 1, "hosts": list(nxt.hosts), "why": nxt.line,
                            "lost": nxt.lost, "replaced": nxt.replaced})
            say(f"every process of attempt {attempt} is gone on the hosts left; restarting on "
                f"{plan.nnodes} node(s) (restart {attempt} of {restarts})")
        else:
            pending["planned"] = pending["waited"] = pending["fenced"]
            say(f"every process of attempt {attempt} is gone; restarting all nodes "
                f"(restart {attempt} of {restarts})")
        if plan.resumes:
            from .resume import read_resume_state

            state = read_resume_state(plan, cluster, writer=False)
            for line in state.cleaned:
                say(line)
            say(state.announcement() or "no checkpoint yet: starting from the beginning")
            start_step = state.step
        elif plan.checkpoint_dir:
            last, cleaned = resume_point(plan, cluster)
            for line in cleaned:
                say(line)
            say(f"resuming from {plan.checkpoint_dir}/{last}" if last
                else "no checkpoint yet: starting from the beginning")
        time.sleep(RESTART_DELAY_S)
    return 1


def closing_lines(plan: Plan, outcome: Outcome, duration_s: float, attempt: int,
                  history: list[dict] = (), recoveries: list[dict] = (), gpus: dict | None = None) -> list[str]:
    from ..ui.summary import closing_summary

    adapter = None
    if plan.checkpoint_dir and plan.finetuning_type in ("lora", "oft", "freeze_lora", None):
        adapter = posixpath.join(plan.checkpoint_dir, "adapter_model.safetensors")
    lines = closing_summary(run_id=plan.run_id, run_dir=plan.run_dir, duration_s=duration_s,
                            progress=outcome.progress or Progress(), output_dir=plan.checkpoint_dir,
                            adapter=adapter, nnodes=plan.nnodes, staged=plan.staged, gpus=gpus)
    if attempt > 1:
        lines[0] += f" (attempt {attempt})"
    told = {r["attempt"] for r in history if r.get("why")}  # (a loss's attempt says its recovery with its line)
    return lines + attempts_said(list(history)) + [
        said for r in recoveries if r["attempt"] not in told and (said := recovery_said(r["attempt"], r))]
