"""Stragglers during training: every node's step times, and the node that sets the pace. Pure.

In synchronous data-parallel training every rank waits for the slowest at each all-reduce, so
a rank's whole step takes as long on every node: what differs is the compute before the
collective. Each rank times that part of its steps (its model's forward passes,
ftbundle/shims/steptimes.py) and keeps the median and p90 of its own steps in a small file on
its host; the node program sends the file's line on the node's control channel beside its
heartbeat (``ftb-steps 0 40 0.0310 0.0402;1 40 ...``: local rank, steps timed, median and p90
in seconds; only when it changed). No new connection, no polling of the ranks.

Here: a node's figure is its slowest local rank's (a node is as slow as its slowest GPU), the
fleet's median is the median of the nodes' medians, and a node whose median is above
``straggler_factor`` x the fleet's median is a straggler. A healthy run names nobody.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ..hostlist import fold, natural
from ..protocol import RankSteps

STRAGGLER_FACTOR = 1.15  # the job's straggler_factor by default
# a node is judged once it has timed this many steps: the first ones warm up, and a median of a
# few steps on a host shared with other work named healthy nodes (1.2x at step 12 of a healthy
# 200-step run, bench/health.py; the summary, judged at the end, named nobody)
MIN_STEPS = 20
MIN_NODES = 2  # no fleet to compare with below this
# the closing summary lists every node up to this many; beyond, the stragglers and the slowest
# others each on a line, the rest folded into one line of ranges (all: `runs --json`)
TABLE_MAX = 16
SLOWEST_SHOWN = 3


@dataclass(frozen=True)
class NodeSteps:
    """One node's figure: its slowest local rank's."""

    host: str
    steps: int
    median_s: float
    p90_s: float
    local_rank: int = 0  # the slowest local rank


def node_steps(host: str, ranks: Iterable[RankSteps]) -> NodeSteps | None:
    """The node's figure from its ranks' (None when none has timed a step)."""
    ranks = list(ranks)
    if not ranks:
        return None
    slowest = max(ranks, key=lambda r: r.median_s)
    return NodeSteps(host, min(r.steps for r in ranks), slowest.median_s, max(r.p90_s for r in ranks),
                     slowest.local_rank)


def median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def p90(values: Iterable[float]) -> float | None:
    """The 90th percentile (nearest rank: a value that was seen)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def judged(nodes: Iterable[NodeSteps]) -> list[NodeSteps]:
    """The nodes with enough steps timed to be compared."""
    return [n for n in nodes if n.steps >= MIN_STEPS]


def fleet_median(nodes: Iterable[NodeSteps]) -> float | None:
    """The median of the judged nodes' medians; None without a fleet to compare with."""
    nodes = judged(nodes)
    return median(n.median_s for n in nodes) if len(nodes) >= MIN_NODES else None


def stragglers(nodes: Iterable[NodeSteps], factor: float = STRAGGLER_FACTOR) -> list[tuple[NodeSteps, float]]:
    """Every node above ``factor`` x the fleet's median, with its ratio to it, slowest first."""
    nodes = list(nodes)
    fleet = fleet_median(nodes)
    if not fleet:
        return []
    found = [(n, n.median_s / fleet) for n in judged(nodes) if n.median_s > factor * fleet]
    return sorted(found, key=lambda pair: -pair[1])


def live_field(nodes: Iterable[NodeSteps], factor: float = STRAGGLER_FACTOR) -> str | None:
    """The live line's "slowest node2 1.4x" value (None: nobody to name)."""
    found = stragglers(nodes, factor)
    if not found:
        return None
    node, ratio = found[0]
    more = f" (+{len(found) - 1})" if len(found) > 1 else ""
    return f"{node.host} {ratio:.1f}x{more}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _span(values: list[float], fmt) -> str:
    low, high = min(values), max(values)
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low).split()[0]}-{fmt(high)}"


def summary_lines(nodes: Iterable[NodeSteps], factor: float = STRAGGLER_FACTOR) -> list[str]:
    """The closing summary's lines: the straggler(s) named (or nobody), then every node's
    median and p90 compute time per step; none for a run of one node (no fleet to compare).
    Beyond TABLE_MAX nodes, the stragglers and the SLOWEST_SHOWN slowest others a line each,
    and the rest one folded line of ranges: 256 lines would push the run's end off the screen
    (every node's figures stay in summary.json and `ftbundle runs --json`)."""
    nodes = sorted(nodes, key=lambda n: natural(n.host))
    if len(nodes) < MIN_NODES:
        return []
    fleet = fleet_median(nodes)
    found = stragglers(nodes, factor)
    if found:
        head = "; ".join(f"{n.host} {ratio:.2f}x the fleet's median" for n, ratio in found)
        lines = [f"  stragglers   {head} (straggler_factor {factor:g})"]
    elif fleet is not None:
        lines = [f"  stragglers   none (every node within {factor:g}x the fleet's median)"]
    else:
        lines = [f"  stragglers   not judged (fewer than {MIN_NODES} nodes with {MIN_STEPS}+ steps timed)"]
    shown, rest = nodes, []
    if len(nodes) > TABLE_MAX:
        named = [n for n, _ in found]
        others = sorted((n for n in nodes if n not in named), key=lambda n: -n.median_s)
        shown = named + others[:SLOWEST_SHOWN]
        rest = [n for n in nodes if n not in shown]  # (in the table's natural order)
    folded = f"{fold(n.host for n in rest)} ({len(rest)} nodes)" if rest else ""
    width = max([len(n.host) for n in shown] + [len(folded)])
    lines.append("  step compute per node (forward to last gradient; median / p90 / steps timed"
                 + (f"; fleet median {_ms(fleet)}" if fleet else "") + "):")
    for n in shown:
        rank = f"  (slowest GPU: local rank {n.local_rank})" if n.local_rank else ""
        lines.append(f"    {n.host.ljust(width)}  {_ms(n.median_s):>10}  {_ms(n.p90_s):>10}  {n.steps:>6}{rank}")
    if rest:
        steps = _span([float(n.steps) for n in rest], lambda v: f"{v:.0f}")
        lines.append(f"    {folded.ljust(width)}  {_span([n.median_s for n in rest], _ms):>10}  "
                     f"{_span([n.p90_s for n in rest], _ms):>10}  {steps:>6}")
        lines.append(f"    (the {len(shown)} above: stragglers and the slowest others; every node's figures: "
                     "`ftbundle runs --json`, step_times)")
    return lines


def as_record(nodes: Iterable[NodeSteps], factor: float = STRAGGLER_FACTOR) -> dict | None:
    """For summary.json and `ftbundle runs --json` (None: no step timed anywhere)."""
    nodes = sorted(nodes, key=lambda n: n.host)
    if not nodes:
        return None
    fleet = fleet_median(nodes)
    return {
        "straggler_factor": factor,
        "fleet_median_s": fleet,
        "nodes": {n.host: {k: v for k, v in asdict(n).items() if k != "host"} for n in nodes},
        "stragglers": [{"host": n.host, "ratio": round(ratio, 3)} for n, ratio in stragglers(nodes, factor)],
    }


def idle_cause(host: str, steps: dict[str, NodeSteps], factor: float = STRAGGLER_FACTOR) -> str:
    """Whether a node whose GPUs idle below the fleet's (ftbundle.gpu_metrics) looks input-bound or
    waiting, from its own step compute time against the fleet's median (each rank times its forward
    passes, before the all-reduce)."""
    mine = steps.get(host)
    fleet = fleet_median(steps.values())
    if mine is None or not fleet:
        return "no step times to tell whether it is input-bound or waiting"
    ratio = mine.median_s / fleet
    if ratio >= factor:
        return (f"its own steps are slow ({ratio:.2f}x the fleet's median compute): it looks input-bound "
                "(its GPUs wait on data loading or its CPU, and the others wait on it)")
    if ratio <= 1 / factor:
        return (f"its own steps' compute is {ratio:.2f}x the fleet's: it looks like it waits (its GPUs finish "
                "first and idle until the slower nodes reach each step's all-reduce)")
    return (f"its steps' compute is like the fleet's ({ratio:.2f}x): it looks input-bound (its GPUs idle between "
            "steps: data loading or its CPU)")
