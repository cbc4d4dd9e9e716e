"""The stall watchdog: a run that stops making progress is diagnosed, then stopped.

A hung rank (a dataloader deadlock, a SIGSTOPped or D-state process) fails no heartbeat:
its node program and torchrun are fine, and its peers wait in a collective for gloo's 30
or NCCL's 10 minutes. So the supervisor also watches *progress*: each node's heartbeat
carries the total size of what its ranks have written (every local rank's output files,
and LlamaFactory's trainer_log.jsonl on rank 0's node: a training step writes its bar or
its log line). The clock starts at the first progress after launch (loading a model is
not a stall) and is reset by every new byte from any rank; ``stall_timeout`` seconds
without any, and the run is stalled.

Before anything is stopped, :func:`collect` asks every host at once for each rank's state,
CPU time and Python stack (ftbundle/remote/stacks.py, py-spy); :func:`diagnose` groups the
ranks by where they are and names the odd one(s) out. Pure from there: :func:`report_lines`.
"""

from __future__ import annotations

import json
import posixpath
import time
from dataclasses import dataclass, field
from functools import cache

from .. import shipped
from ..cluster import Cluster, HostUnreachable, first_line, parallel
from ..inventory import Host
from ..plan import NodePlan, Plan
from ..remote.stallclock import StallClock  # noqa: F401 (the one stall rule: the supervisor takes it from here)
from ..rundir import TRAINER_LOG, RunDir

STALLED_EXIT_CODE = 124  # like timeout(1): the run made no progress for stall_timeout seconds
CPU_SAMPLE_S = 2.0  # each rank's CPU time is read twice, this far apart
COLLECT_TIMEOUT_S = 60.0

FROZEN = {"T": "stopped (SIGSTOP)", "t": "stopped (traced)", "D": "in D state (uninterruptible I/O)",
          "Z": "a zombie"}
STATE_WORDS = {"R": "running", "S": "sleeping", "I": "idle", "X": "gone"}


def progress_globs(plan: Plan, node: NodePlan) -> list[str]:
    """What a node counts as its ranks' output: its log (local rank 0, every attempt) and
    the other local ranks' files under torchrun's --log-dir."""
    return plan.rundir.progress_globs(node.rank, node.host.name)


def steps_file(plan: Plan, node: NodePlan) -> str:
    """Rank 0 of a LlamaFactory job: the trainer's log, whose first line is its first step
    (the stall clock waits for it: loading a model or a first compile is not a stall)."""
    return posixpath.join(plan.checkpoint_dir, TRAINER_LOG) if node.rank == 0 and plan.checkpoint_dir else ""


# ---------------------------------------------------------------------------------------
# Collection (on every host at once)


@dataclass(frozen=True)
class Target:
    """Where one node's ranks are: its host, the job's marker, its container if any."""

    node_rank: int
    host: Host
    marker: str
    container: str | None = None
    pyspy_dirs: tuple[str, ...] = ()
    per_node: bool = False  # a `command:` job: its processes may carry no LOCAL_RANK


@dataclass
class RankStack:
    host: str
    node_rank: int
    rank: int | None
    local_rank: int | None
    pid: int | None
    state: str  # /proc's letter: R S D T Z ...
    cpu_s: float | None  # CPU seconds used during sample_s
    sample_s: float
    frames: list[dict] = field(default_factory=list)  # the main thread's, innermost first
    threads: list[dict] = field(default_factory=list)
    error: str | None = None

    @property
    def who(self) -> str:
        if self.rank is None:  # a `command:` job's own process: no torchrun numbering
            return f"pid {self.pid} on {self.host} (node {self.node_rank})"
        return (f"rank {self.rank} on {self.host} (node {self.node_rank}, local {self.local_rank}, "
                f"pid {self.pid})")


@cache
def collector_source() -> bytes:
    return shipped.read_bytes("remote", "stacks.py")


# The detached watcher is one program, written as files by concern (ftbundle/remote/): its parts
# in this order, main (watch.py) last.
WATCH_PARTS = ("stallclock.py", "watch_rules.py", "watch_host.py", "notifier.py", "gpu_tally.py", "trainer_end.py",
               "watch.py")


TELL_PARTS = ("watch_host.py", "notifier.py", "trainer_end.py", "tell.py")


@cache
def teller_source() -> str:
    """An attached run's word when its launcher is lost, as it is staged (rundir.TELLER_PROGRAM):
    the file helpers, the notifier and the trainer log's reader, then remote/tell.py's ``main``."""
    return "\n\n".join(shipped.read_text("remote", part) for part in TELL_PARTS)


@cache
def watcher_source() -> str:
    """The detached watcher's program, as it is staged for detached nodes (rundir.WATCHER_PROGRAM):
    remote/stallclock.py's text (StallClock, imported here from it: the one stall rule), the
    watcher's rules and its hands, then remote/watch.py's, whose ``main`` runs."""
    return "\n\n".join(shipped.read_text("remote", part) for part in WATCH_PARTS)


def collect(cluster: Cluster, targets: list[Target], out_dir: str, *,
            sample_s: float = CPU_SAMPLE_S) -> tuple[list[RankStack], list[str]]:
    """Every rank's state, CPU time and stack from every host at once; (ranks, problems).
    Each host also writes its ranks' reports into ``out_dir`` (shared storage)."""
    def one(t: Target):
        spec = {"marker": t.marker, "container": t.container, "pyspy_dirs": list(t.pyspy_dirs),
                "out_dir": out_dir, "host": t.host.name, "node_rank": t.node_rank, "sample_s": sample_s,
                "timeout": 20, "per_node": t.per_node}
        try:
            result = cluster.run(t.host, ["python3", "-S", "-", json.dumps(spec)], stdin=collector_source(),
                                 timeout=COLLECT_TIMEOUT_S)
        except (HostUnreachable, TimeoutError, OSError, EOFError) as exc:
            return [], f"{t.host.name}: {first_line(exc)}"
        if not result.ok:
            return [], f"{t.host.name}: stack collection failed: {(result.stderr.strip() or str(result.code))[-300:]}"
        try:
            data = json.loads(result.stdout)
        except ValueError:
            return [], f"{t.host.name}: stack collection said {result.stdout[:200]!r}"
        return [_rank_stack(t, r) for r in data["ranks"]], (f"{t.host.name}: {data['error']}" if data.get("error")
                                                           else None)

    ranks: list[RankStack] = []
    problems: list[str] = []
    for found, problem in parallel(one, targets):
        ranks += found
        if problem:
            problems.append(problem)
    ranks.sort(key=lambda r: (r.rank is None, r.rank or 0, r.node_rank))
    return ranks, problems


def _rank_stack(t: Target, r: dict) -> RankStack:
    threads = r.get("threads") or []
    main = next((th for th in threads if th.get("os_thread_id") == r["pid"]), None) or \
        next((th for th in threads if th.get("thread_name") == "MainThread"), None) or \
        (threads[0] if threads else None)
    return RankStack(host=t.host.name, node_rank=t.node_rank, rank=r.get("rank"), local_rank=r.get("local_rank"),
                     pid=r.get("pid"), state=r.get("state") or "?", cpu_s=r.get("cpu_s"),
                     sample_s=r.get("sample_s") or 0.0, frames=list(main.get("frames") or []) if main else [],
                     threads=threads, error=r.get("error"))


def plan_targets(plan: Plan, attempt: int) -> list[Target]:
    return [Target(n.rank, n.host, plan.node_files(n, attempt).marker,
                   n.container, (n.path_prepend,) if n.path_prepend else (), n.per_node) for n in plan.nodes]


def stacks_dir(run_dir: str, label: str) -> str:
    return RunDir(run_dir, "").stacks_collection(label, time.strftime('%Y%m%d-%H%M%S', time.gmtime()))


# ---------------------------------------------------------------------------------------
# Diagnosis (pure)

_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")


def _short(filename: str) -> str:
    return posixpath.basename(filename or "?")


def where(r: RankStack) -> str:
    """``all_reduce at train.py:24``: the innermost Python function, at the innermost line of
    the user's own code (the library's own line is in the full stack)."""
    if not r.frames:
        return f"no Python stack ({r.error})" if r.error else "no Python stack"
    inner = r.frames[0]
    user = next((f for f in r.frames if not any(p in (f.get("filename") or "") for p in _LIBRARY_PARTS)), inner)
    return f"{inner.get('name')} at {_short(user.get('filename'))}:{user.get('line')}"


def place(r: RankStack) -> str:
    """Where a rank is, with its state when that state is the story (a frozen process)."""
    if r.state in FROZEN:
        return f"{FROZEN[r.state]} in {where(r)}" if r.frames else FROZEN[r.state]
    return where(r)


@dataclass
class Diagnosis:
    groups: list[tuple[str, list[RankStack]]]  # largest first
    odd: list[RankStack]  # the rank(s) out of step: in a smaller group, or frozen


def diagnose(ranks: list[RankStack]) -> Diagnosis:
    by_place: dict[str, list[RankStack]] = {}
    for r in ranks:
        by_place.setdefault(place(r), []).append(r)
    groups = sorted(by_place.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    odd: list[RankStack] = []
    if len(groups) > 1:
        largest = len(groups[0][1])
        for i, (_, members) in enumerate(groups):
            if len(members) < largest or (i > 0 and len(members) == largest and members[0].state in FROZEN):
                odd += members
    odd += [r for r in ranks if r.state in FROZEN and r not in odd]
    return Diagnosis(groups, odd)


def _cpu(r: RankStack) -> str:
    if r.cpu_s is None:
        return "CPU unknown"
    return f"{r.cpu_s:.2f} s CPU in {r.sample_s:.0f} s"


def _names(members: list[RankStack]) -> str:
    ranks = [str(m.rank) for m in members if m.rank is not None]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(ranks) if ranks else f"{len(members)} process(es)"


def stack_lines(r: RankStack, indent: str = "      ", limit: int = 12) -> list[str]:
    lines = []
    for f in r.frames[:limit]:
        lines.append(f"{indent}{f.get('name')} ({f.get('filename')}:{f.get('line')})")
    if len(r.frames) > limit:
        lines.append(f"{indent}... {len(r.frames) - limit} more frames")
    if not r.frames and r.error:
        lines.append(f"{indent}{r.error}")
    return lines


def report_lines(d: Diagnosis, *, out_dir: str, expected: int | None = None,
                 problems: list[str] = (), stalled: bool = True) -> list[str]:
    """The grouped view a person reads: where every rank is, the odd one(s) out named with
    their own stack, and where the full stacks were kept."""
    total = sum(len(m) for _, m in d.groups)
    lines = []
    for key, members in d.groups:
        cpus = [m.cpu_s for m in members if m.cpu_s is not None]
        cpu = (f"{min(cpus):.2f}" if len(set(cpus)) < 2 else f"{min(cpus):.2f}-{max(cpus):.2f}") if cpus else "?"
        how = "" if members[0].state in FROZEN else ("with " if key.startswith("no Python") else "in ")
        lines.append(f"  {len(members)} rank{'s' if len(members) != 1 else ''} {how}{key}  "
                     f"({_names(members)}; {cpu} s CPU{' each' if len(members) > 1 else ''} "
                     f"in {members[0].sample_s:.0f} s)")
    if expected is not None and total < expected:
        lines.append(f"  {expected - total} rank(s) not found (exited, or on a host that did not answer)")
    for r in d.odd:
        lines.append(f"the odd one out: {r.who}: {where(r)}, {STATE_WORDS.get(r.state, FROZEN.get(r.state, r.state))}, "
                     f"{_cpu(r)}")
        lines += stack_lines(r)
    if stalled and not d.odd and len(d.groups) == 1 and total > 1 and d.groups[0][1][0].frames:
        lines.append(f"every rank is in the same place ({d.groups[0][0]}): a collective waiting on something "
                     "outside the ranks (the network, a GPU), or a deadlock they share")
    for problem in problems:
        lines.append(f"  could not ask {problem}")
    lines.append(f"every rank's state and full stack (all threads): {out_dir}/")
    return lines


def stall_report(plan: Plan, cluster: Cluster, attempt: int,
                 label: str = "stall") -> tuple[list[str], RankStack | None, int]:
    """Collect from every node of the plan's attempt and diagnose: (lines, the first odd
    one, how many ranks were found)."""
    out_dir = stacks_dir(plan.run_dir, f"a{attempt}-{label}")
    ranks, problems = collect(cluster, plan_targets(plan, attempt), out_dir)
    d = diagnose(ranks)
    lines = report_lines(d, out_dir=out_dir, expected=plan.world_size, problems=problems)
    return lines, (d.odd[0] if d.odd else None), len(ranks)


def ending(plan: Plan, found: int) -> bool:
    """No rank process left on any host of a torchrun job: its ranks have finished and
    torchrun is ending (its agents wait for each other at an exit barrier), not stalled."""
    return found == 0 and not any(n.per_node for n in plan.nodes)


def read_collected(cluster: Cluster, host: Host, out_dir: str) -> list[RankStack]:
    """What a detached run's nodes collected (their node-N.json in ``out_dir``), read
    through ``host``."""
    try:
        result = cluster.run(host, ["sh", "-c", 'cat -- "$1"/node-*.json 2>/dev/null', "sh", out_dir], timeout=15)
    except (HostUnreachable, TimeoutError, OSError, EOFError):
        return []
    ranks: list[RankStack] = []
    for line in result.stdout.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        t = Target(int(data.get("node_rank") or 0), Host(str(data.get("host")), ""), "")
        ranks += [_rank_stack(t, r) for r in data.get("ranks") or []]
    ranks.sort(key=lambda r: (r.rank is None, r.rank or 0, r.node_rank))
    return ranks
