"""The GPUs while a run goes: every node's readings, the fleet's figures, and what is named. Pure.

Each node of a GPU job samples its GPUs with one ``nvidia-smi --query-gpu=FIELDS -lms N`` loop
(one process for the whole run, never one a sample: ftbundle/remote/node.sh ``ftb_gpu_sampler``)
and sends each reading on its control channel as one line, its GPUs apart by ';'::

    ftb-smi 0, 94, 62311, 81559, 688.21, 61, 1755, 0x0000000000000004;1, 93, ...

No new connection and no polling from the launcher. Here the readings become:

* the live line's ``GPU 94% 61/80 GiB`` (the fleet's mean utilization, the fullest GPU);
* what is named while the run goes, once each and only on evidence over a window:
  a node whose GPUs idle well below the fleet's while the fleet is busy (input-bound or waiting,
  from its step times: :func:`ftbundle.ui.stragglers.idle_cause`), a GPU within 5% of its memory, a GPU whose
  clocks are cut (the health check's slowdown reasons: :data:`ftbundle.gpu_health.SLOWDOWN_REASONS`;
  the SW power cap is how a healthy GPU runs a long load, and is not one), a node whose readings
  stopped (or never came) while its heartbeats go on: its nvidia-smi loop hung or ended (a GPU
  that stops responding hangs nvidia-smi); its last reading is then left out of the live figures,
  never shown as if it were now;
* the summary's each node's mean utilization and peak memory (summary.json ``gpus``), and a
  thinned curve of the fleet's utilization for ``plot``.

``ftbundle status`` reads one reading of each host (:func:`status_lines`).
"""

from __future__ import annotations

import collections
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from .gpu_health import SLOWDOWN_REASONS
from .hostlist import fold, natural
from .remote.gpu_tally import GpuTally

# what the node's loop asks (the fields' order is the parser's); clocks_throttle_reasons.active is
# still known by drivers that print it as clocks_event_reasons.active (the recorded H100's 580)
FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total", "power.draw", "temperature.gpu",
          "clocks.sm", "clocks_throttle_reasons.active")
QUERY = ",".join(FIELDS)
SAMPLE_EVERY_S = 2.0  # a reading every this long on every node (one line a node: 64 lines/s at 128 hosts)
WINDOW_S = 30.0  # a node's utilization is judged over this much of its latest readings
MIN_SPAN_S = 20.0  # ... and only once they span this long (a start, a restart: no verdict on a few readings)
BUSY_FLEET = 50.0  # the fleet's median utilization (%) from which a node well below it is named
IDLE_GAP = 30.0  # points below the fleet's median: "well below"
IDLE_CLEAR_GAP = 15.0  # ... back within this: the node is judged again
NEAR_MEMORY = 0.95  # a GPU using this share of its memory is within 5% of it: an out-of-memory risk
MEMORY_CLEAR = 0.90
REPEATS = 2  # readings in a row a memory or clock verdict needs (one odd reading names nothing)
# a node that reads its GPUs and sends this many heartbeats without a reading (at least SILENT_READINGS
# readings' time): its readings stopped. Counted in the node's own heartbeats, which come on the same
# channel in the order they were written: a launcher paused or starved of CPU, or a busy network,
# delays both alike and names nobody
SILENT_BEATS = 10
SILENT_READINGS = 10
CURVE_EVERY_S = 10.0  # the plot's points of the fleet's utilization, at most this often
CURVE_MAX = 2000  # ... and at most this many (thinned by halves: a week-long run stays small)
GIB_PER_MIB = 1 / 1024


@dataclass(frozen=True)
class GpuReading:
    """One GPU's reading; None where nvidia-smi said ``[N/A]`` or nothing usable."""

    index: str
    util: float | None = None  # %
    mem_used_mib: float | None = None
    mem_total_mib: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    sm_mhz: float | None = None
    reasons: int | None = None  # the clock event reasons bitmask

    @property
    def mem_share(self) -> float | None:
        if self.mem_used_mib is None or not self.mem_total_mib:
            return None
        return self.mem_used_mib / self.mem_total_mib

    @property
    def slowdowns(self) -> list[str]:
        """The reasons its clocks are cut (none at a power cap, idle or an application clock)."""
        if not self.reasons:
            return []
        return [name for bit, name in SLOWDOWN_REASONS.items() if self.reasons & bit]


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_reading(line: str) -> GpuReading | None:
    """One GPU's CSV line in :data:`FIELDS`' order (nounits); None when it is not one."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != len(FIELDS) or not cells[0].isdigit():
        return None
    reasons = None
    if re.fullmatch(r"0x[0-9a-fA-F]+", cells[7]):
        reasons = int(cells[7], 16)
    return GpuReading(cells[0], *(_number(c) for c in cells[1:7]), reasons)


def parse_line(text: str) -> list[GpuReading]:
    """What follows ``ftb-smi``: the node's GPUs' lines joined by ';' (or one per line, as
    ``status`` reads them); a part that is not a reading is skipped (a driver's message)."""
    found = []
    for part in re.split(r"[;\n]", text):
        if (reading := parse_reading(part)) is not None:
            found.append(reading)
    return found


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def gib(mib: float | None) -> str:
    return "?" if mib is None else f"{mib * GIB_PER_MIB:.1f}"


def near_memory(host: str, r: GpuReading) -> str:
    """A GPU within 5% of its memory, in words (the run's warning and `status`'s line)."""
    return (f"{host} GPU {r.index} holds {gib(r.mem_used_mib)} of {gib(r.mem_total_mib)} GiB ({r.mem_share:.0%}): "
            f"within {1 - NEAR_MEMORY:.0%} of its memory, an out-of-memory risk")


@dataclass
class NodeGpus:
    """One node's readings: the latest, a window for the verdicts, and the run's totals."""

    host: str
    latest: list[GpuReading] = field(default_factory=list)
    at: float | None = None
    window: collections.deque = field(default_factory=collections.deque)  # (at, mean utilization)
    tally: GpuTally = field(default_factory=GpuTally)  # the run's totals (a detached run's watcher keeps the same)
    streak: dict[tuple[str, str], int] = field(default_factory=dict)  # (gpu, verdict) -> readings in a row
    judged_at: float | None = None  # the reading the memory and clock verdicts last looked at

    def add(self, readings: list[GpuReading], at: float) -> None:
        self.latest, self.at = readings, at
        util = self.tally.add([(r.index, r.util, r.mem_used_mib, r.mem_total_mib) for r in readings])
        if util is not None:
            self.window.append((at, util))
        while self.window and self.window[0][0] < at - WINDOW_S:
            self.window.popleft()

    def window_util(self, since: float | None = None) -> float | None:
        """The mean utilization over the window (from ``since`` on), None until it spans MIN_SPAN_S."""
        kept = [(at, u) for at, u in self.window if since is None or at >= since]
        if len(kept) < 2 or kept[-1][0] - kept[0][0] < MIN_SPAN_S:
            return None
        return _mean(u for _, u in kept)

    def record(self) -> dict:
        """summary.json's figures of this node."""
        return self.tally.record()


class GpuFleet:
    """Every node's GPUs during one attempt. ``observe`` a node's reading; ``said`` what is to be
    named now (each once: a verdict comes back only after it cleared); ``live`` the live line's."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S, beat_s: float = 1.0):
        self.nodes: dict[str, NodeGpus] = {}
        self.beat_s = beat_s
        self.silent_beats = max(SILENT_BEATS, math.ceil(SILENT_READINGS * every_s / beat_s))
        self.unread: dict[str, int] = {}  # a node that reads its GPUs -> its heartbeats since its last reading
        self._named: set[tuple[str, str]] = set()  # (host or host/gpu, verdict) named and not cleared
        self.named: list[str] = []  # everything named, in order (summary.json)
        self.training_since: float | None = None  # the first step (readings before it are not judged)
        self.curve: list[dict] = []  # the fleet's utilization for `plot`
        self._curve_every = CURVE_EVERY_S
        self._curve_at: float | None = None
        self._looked: float | None = None

    def observe(self, host: str, text: str, at: float) -> None:
        readings = parse_line(text)
        if readings:
            self.nodes.setdefault(host, NodeGpus(host)).add(readings, at)
            self.unread[host] = 0

    def beat(self, host: str) -> None:
        """A heartbeat of a node that reads its GPUs (its node program found nvidia-smi)."""
        self.unread[host] = self.unread.get(host, 0) + 1

    def silent(self, host: str) -> bool:
        """Its readings stopped (or never came) while its heartbeats went on."""
        return self.unread.get(host, 0) >= self.silent_beats

    def _reading(self) -> list[NodeGpus]:
        """The nodes whose readings are current (a silent node's last one is not)."""
        return [n for host, n in self.nodes.items() if not self.silent(host)]

    # -- the live line and the plot ------------------------------------------------------------
    def _now(self) -> tuple[list[GpuReading], float | None]:
        """Every node's latest reading, and the fleet's mean utilization in them (None: none said)."""
        latest = [r for n in self._reading() for r in n.latest]
        return latest, _mean(r.util for r in latest if r.util is not None)

    def live(self) -> str | None:
        """"94% 61/80 GiB": the fleet's mean utilization, the fullest GPU's memory."""
        latest, util = self._now()
        if util is None:
            return None
        fullest = max((r for r in latest if r.mem_share is not None), key=lambda r: r.mem_share, default=None)
        mem = "" if fullest is None else (f" {fullest.mem_used_mib * GIB_PER_MIB:.0f}/"
                                          f"{fullest.mem_total_mib * GIB_PER_MIB:.0f} GiB")
        return f"{util:.0f}%{mem}"

    def point(self, at: float, step: int | None) -> None:
        """The plot's curve: the fleet's mean utilization and its fullest GPU now, at most every
        CURVE_EVERY_S (thinned by halves past CURVE_MAX points, every other one kept)."""
        if self._curve_at is not None and at - self._curve_at < self._curve_every:
            return
        latest, util = self._now()
        if util is None:
            return
        self._curve_at = at
        used = max((r.mem_used_mib for r in latest if r.mem_used_mib is not None), default=None)
        self.curve.append({"current_steps": step, "gpu_util": round(util, 1),
                           "gpu_mem_gib": None if used is None else round(used * GIB_PER_MIB, 2)})
        if len(self.curve) > CURVE_MAX:
            self.curve = self.curve[::2]
            self._curve_every *= 2

    def tick(self, now: float, *, step: int | None, first_step: float | None, cause=None) -> list[str]:
        """The supervisor's look, every loop: at most once a second, the plot's point and what
        is to be named now (judged from the first step on, when the job has a step clock).
        ``cause``: host -> whether an idle node looks input-bound or waiting (ui.stragglers.idle_cause)."""
        if not self.unread or (self._looked is not None and now - self._looked < 1.0):
            return []
        self._looked = now
        if first_step is not None and self.training_since is None:
            self.training_since = first_step
        self.point(now, step)
        return self.said(now, cause)

    # -- what is named ------------------------------------------------------------------------
    def said(self, now: float, cause=None) -> list[str]:
        """What is to be named now (``cause``: as :meth:`tick`'s)."""
        out = []
        for node in self.nodes.values():
            if node.at != node.judged_at:  # (a new reading: one held over two looks counts once)
                node.judged_at = node.at
                out += self._memory_and_clocks(node)
        out += self._silence()
        out += self._idle(cause or (lambda host: "no step times to tell whether it is input-bound or waiting"))
        self.named += out
        return out

    def _once(self, key: tuple[str, str], holds: bool, clears: bool) -> bool:
        """True the first time ``holds``; again only after ``clears``."""
        if holds and key not in self._named:
            self._named.add(key)
            return True
        if clears:
            self._named.discard(key)
        return False

    def _streak(self, node: NodeGpus, gpu: str, verdict: str, holds: bool) -> int:
        n = node.streak.get((gpu, verdict), 0) + 1 if holds else 0
        node.streak[(gpu, verdict)] = n
        return n

    def _memory_and_clocks(self, node: NodeGpus) -> list[str]:
        out = []
        for r in node.latest:
            share = r.mem_share
            near = share is not None and share >= NEAR_MEMORY
            if self._once((f"{node.host}/{r.index}", "memory"), self._streak(node, r.index, "memory", near) >= REPEATS,
                          share is not None and share < MEMORY_CLEAR):
                out.append(near_memory(node.host, r) + " (a longer batch, an evaluation or a checkpoint's copy can "
                           "tip it over)")
            slow = r.slowdowns
            held = self._streak(node, r.index, "clocks", bool(slow))
            if self._once((f"{node.host}/{r.index}", "clocks"), held >= REPEATS, not slow and held == 0):
                clock = f", SM clock {r.sm_mhz:.0f} MHz" if r.sm_mhz is not None else ""
                temp = f", {r.temp_c:.0f} C" if r.temp_c is not None else ""
                out.append(f"{node.host} GPU {r.index} is throttled: {', '.join(slow)}{clock}{temp} "
                           f"(clock event reasons {r.reasons:#x}; the check names the same on its next run)")
        return out

    def _silence(self) -> list[str]:
        out = []
        for host, beats in self.unread.items():
            if not self._once((host, "silent"), beats >= self.silent_beats, beats == 0):
                continue
            # (the rule's count, not how many had come by this look: the launcher looks once a second)
            heard = (f"in its last {self.silent_beats} heartbeats ({self.silent_beats * self.beat_s:.0f}s) while the "
                     "node itself answers")
            if host in self.nodes:
                out.append(f"{host}'s GPU readings stopped: none {heard}. Its nvidia-smi loop hung or ended: a GPU "
                           "that stops responding (fallen off the bus, Xid 79) or a wedged driver hangs nvidia-smi; "
                           "its GPUs are left out of the live figures until it reads again (`ftbundle status JOB` "
                           "asks it once more)")
            else:
                out.append(f"{host} has sent no GPU reading {heard}: its nvidia-smi loop (`nvidia-smi "
                           f"--query-gpu={QUERY} -lms N`) said nothing usable: a hung or refused query "
                           "(an old driver, no devices), so nothing of its GPUs is shown")
        return out

    def _idle(self, cause) -> list[str]:
        since = self.training_since
        utils = {host: u for host, n in self.nodes.items()
                 if not self.silent(host) and (u := n.window_util(since)) is not None}
        if len(utils) < 2:
            return []
        fleet = _median(utils.values())
        if fleet is None or fleet < BUSY_FLEET:
            return []
        out = []
        for host, util in utils.items():
            if self._once((host, "idle"), util <= fleet - IDLE_GAP, util >= fleet - IDLE_CLEAR_GAP):
                out.append(f"{host}'s GPUs idle well below the fleet's: {util:.0f}% busy over the last "
                           f"{WINDOW_S:.0f}s against the fleet's median {fleet:.0f}%; " + cause(host))
        return out

    # -- the summary -------------------------------------------------------------------------
    def record(self) -> dict | None:
        """summary.json's ``gpus``: each node's figures and what was named (None: no GPU read)."""
        if not self.nodes:
            return None
        return {"nodes": {host: n.record() for host, n in sorted(self.nodes.items(), key=lambda kv: natural(kv[0]))},
                "named": list(self.named)}


def over_attempts(fleets: list[GpuFleet | None]) -> dict | None:
    """summary.json's ``gpus`` over a run's attempts (each attempt's fleet, in order): each node's
    tallies added up (remote/gpu_tally.py: its mean utilization over all its readings, its highest
    memory, its GPUs as the last attempt that read them saw them); everything named, in order,
    once. None when no attempt read a GPU."""
    kept = [f for f in fleets if f is not None and f.nodes]
    if len(kept) <= 1:
        return kept[0].record() if kept else None
    tallies: dict[str, GpuTally] = {}
    for fleet in kept:
        for host, node in fleet.nodes.items():
            tallies.setdefault(host, GpuTally()).absorb(node.tally)
    return {"nodes": {host: t.record() for host, t in sorted(tallies.items(), key=lambda kv: natural(kv[0]))},
            "named": list(dict.fromkeys(said for fleet in kept for said in fleet.named))}


SUMMARY_ROWS_MAX = 16


def summary_lines(record: dict | None) -> list[str]:
    """The closing summary's GPU lines: each node's mean utilization and peak memory (beyond
    SUMMARY_ROWS_MAX nodes, the least busy three and the rest folded), then what was named."""
    if not record or not record.get("nodes"):
        return []
    nodes = record["nodes"]
    most = max((r.get("readings") or 0 for r in nodes.values()), default=0)

    def said(host: str, r: dict) -> str:
        util = "?" if r.get("util_mean") is None else f"{r['util_mean']:.0f}%"
        # (a node read far less than the others, its readings stopped: its mean is of those alone)
        few = r.get("readings") or 0
        over = f", over {few} readings only ({most} on the node read most)" if few < most / 2 else ""
        return (f"{host} {util} busy on average, peak {gib(r.get('mem_peak_mib'))}/{gib(r.get('mem_total_mib'))} GiB "
                f"({r.get('gpus')} GPU(s){over})")

    rows = list(nodes.items())
    lines = []
    if len(rows) <= SUMMARY_ROWS_MAX:
        lines += [f"  GPUs         {said(h, r)}" for h, r in rows]
    else:
        ordered = sorted(rows, key=lambda kv: kv[1].get("util_mean") if kv[1].get("util_mean") is not None else -1)
        lines += [f"  GPUs         {said(h, r)}" for h, r in ordered[:3]]
        rest = [h for h, _ in ordered[3:]]
        utils = [r["util_mean"] for _, r in ordered[3:] if r.get("util_mean") is not None]
        lines.append(f"  GPUs         {fold(rest)}: " + (f"{min(utils):.0f}-{max(utils):.0f}% busy" if utils else "?"))
    lines += [f"  named        {line}" for line in record.get("named") or []]
    return lines


def runs_cell(record: dict | None) -> str:
    """`runs`' GPU column: "93% 61/80G" (the nodes' mean utilization, the fullest GPU's peak)."""
    nodes = (record or {}).get("nodes") or {}
    utils = [r["util_mean"] for r in nodes.values() if isinstance(r.get("util_mean"), (int, float))]
    if not utils:
        return "-"
    fullest = max(nodes.values(), key=lambda r: (r.get("mem_peak_mib") or 0) / (r.get("mem_total_mib") or 1))
    peak = "" if not fullest.get("mem_peak_mib") or not fullest.get("mem_total_mib") else \
        f" {fullest['mem_peak_mib'] * GIB_PER_MIB:.0f}/{fullest['mem_total_mib'] * GIB_PER_MIB:.0f}G"
    return f"{sum(utils) / len(utils):.0f}%{peak}"


STATUS_SMI_S = 2  # `ftbundle status` waits this long for a node's nvidia-smi (node.sh mode_state)


def status_lines(readings: dict[str, list[GpuReading]]) -> list[str]:
    """``ftbundle status``'s GPU lines from one reading of each host: every GPU, then what that
    reading shows (a host far below the others, a GPU near its memory or throttled), said as
    one reading's. A host with an empty list: its nvidia-smi gave no reading (node.sh ``state``)."""
    lines = ["GPUs now (one reading of each running node):"] if readings else []
    for host in sorted((h for h, rs in readings.items() if not rs), key=natural):
        lines.append(f"  gpu  {host:<20} no reading: nvidia-smi gave none within {STATUS_SMI_S}s (a GPU that stops "
                     "responding or a wedged driver hangs it)")
    for host in sorted(readings, key=natural):
        for r in readings[host]:
            util = "?" if r.util is None else f"{r.util:.0f}%"
            power = "" if r.power_w is None else f"  {r.power_w:.0f} W"
            temp = "" if r.temp_c is None else f"  {r.temp_c:.0f} C"
            clock = "" if r.sm_mhz is None else f"  {r.sm_mhz:.0f} MHz"
            lines.append(f"  gpu  {host:<20} {r.index:>2}  {util:>4}  {gib(r.mem_used_mib)}/{gib(r.mem_total_mib)} GiB"
                         f"{power}{temp}{clock}")
    means = {h: u for h, rs in readings.items() if (u := _mean(r.util for r in rs if r.util is not None)) is not None}
    fleet = _median(means.values()) if len(means) >= 2 else None
    for host in sorted(readings, key=natural):
        if fleet is not None and fleet >= BUSY_FLEET and means.get(host, fleet) <= fleet - IDLE_GAP:
            lines.append(f"  idle: {host}'s GPUs {means[host]:.0f}% busy against the fleet's median {fleet:.0f}% "
                         "(this reading; the run's own line says it over 30 s)")
        for r in readings[host]:
            if r.mem_share is not None and r.mem_share >= NEAR_MEMORY:
                lines.append(f"  memory: {near_memory(host, r)}")
            if r.slowdowns:
                lines.append(f"  throttled: {host} GPU {r.index}: {', '.join(r.slowdowns)}")
    return lines
