"""GPU health: nvidia-smi's health readings and the kernel's Xid lines -> findings per GPU.

The probe (ftbundle/remote/probe.py, ``health``) brings back raw text: one
``nvidia-smi --query-gpu=HEALTH_QUERY --format=csv,nounits`` (with its header, so the columns
are read by name), ``nvidia-smi -q -d TEMPERATURE`` (the slowdown threshold is in no
``--query-gpu`` field), the NVRM Xid lines of the kernel log (``dmesg``, or ``journalctl -k``
where dmesg is refused) and the host's uptime. Here, without I/O, that text becomes
:class:`GpuHealth` and :class:`Xid` values (:func:`parse_health`), and those become findings
(:func:`findings`), which ``check_health`` (ftbundle/check/rules.py) groups into the check's line,
and a failed run's summary folds into its fault lines (:func:`run_fault_lines`).

What refuses a run (``health: refuse``, the default) and what only warns:

- refuses: volatile uncorrectable ECC errors, a row remapping failure or a pending remap,
  pages pending retirement, a fatal Xid (:data:`FATAL_XIDS`) within :data:`XID_WINDOW_S`;
- warns: clock event reasons active that cut the clocks (HW slowdown, HW thermal, SW thermal,
  HW power brake), the temperature at its slowdown threshold, a PCIe link narrower (or, on a
  busy GPU, slower) than the GPU and the system allow, any other Xid in the window.

The formats are nvidia-smi's own (tests/data/nvidia-smi/health/ holds the readings of a real
H100): `[N/A]`, `[Not Supported]` and other bracketed words read as "unknown", never as 0.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .hostlist import fold

# The probe's one --query-gpu call (the fields of tests/data/nvidia-smi/health/query-gpu-health.csv,
# recorded on a real H100, then the two more the check needs). Drivers that do not know a
# field say so ('Field "x" is not a valid field to query.') and the probe asks without it.
HEALTH_FIELDS = (
    "index", "uuid", "name", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total", "retired_pages.pending", "remapped_rows.pending",
    "remapped_rows.failure", "clocks_throttle_reasons.active", "clocks.sm", "clocks.max.sm", "temperature.gpu",
    "power.draw", "pcie.link.gen.current", "pcie.link.width.current", "pcie.link.width.max",
    "pcie.link.gen.max", "pci.bus_id",
)
HEALTH_QUERY = ",".join(HEALTH_FIELDS)
# newer drivers print (and know) the clock event reasons by their new name
FIELD_ALIASES = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}

XID_WINDOW_S = 24 * 3600  # Xid lines older than this (by the kernel's clock) are not counted

# Xids that mean the GPU (or its memory, or its link) cannot be trusted with a run until it is
# reset, repaired or the node rebooted: NVIDIA's Xid catalog and the DCGM health watches
# (140 and 142, "Unrecovered ECC Error" both, as the catalog's listing copied into leptonai/gpud's
# pkg/nvidia-query/xid/xid.go names them). docs/check.md shows this table.
FATAL_XIDS = {
    48: "double-bit (uncorrectable) ECC error",
    61: "internal micro-controller breakpoint: the GPU may need a reset",
    62: "internal micro-controller halt: the GPU needs a reset",
    63: "ECC page retirement or row remapping recorded: reset the GPU to apply it",
    64: "ECC page retirement or row remapping failed: the GPU needs service",
    74: "NVLink error: the link (or a GPU on it) needs a reset or service",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error: the GPU needs a reset",
    95: "uncontained ECC error: the GPU needs a reset",
    119: "GSP firmware RPC timeout: the GPU needs a reset",
    120: "GSP firmware error: the GPU needs a reset",
    140: "unrecovered ECC error: the GPU needs a reset",
    142: "unrecovered ECC error: the GPU needs a reset",
}
# Xids that are usually the application's doing (a kernel's bad address, a killed process):
# warned about with their meaning, never refused.
OTHER_XIDS = {
    13: "graphics engine exception (usually the application's)",
    31: "GPU memory page fault (usually the application's)",
    43: "GPU stopped processing (usually the application's)",
    45: "preemptive cleanup after an earlier error",
}

# clock event reasons (NVML's nvmlClocksThrottleReason bits) that mean the clocks are cut
SLOWDOWN_REASONS = {
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
}
IDLE_REASON = 0x1

_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)(?:, (.*))?")
_STAMP_RE = re.compile(r"^\s*\[\s*(\d+(?:\.\d+)?)\]")


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health readings; None where nvidia-smi could not say (`[N/A]`)."""

    index: str
    uuid: str | None = None
    bus_id: str | None = None  # 00000000:00:06.0
    ecc_mode: str | None = None
    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    clock_events: int | None = None  # the clock event reasons bitmask
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None  # absolute slowdown threshold (GPUs before Hopper)
    tlimit_c: int | None = None  # margin to T.Limit (Hopper and later report temperatures so)
    slowdown_tlimit_c: int | None = None  # the margin at which slowdown begins (-2 on an H100)
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None  # what this GPU and this system allow
    pcie_width: int | None = None
    pcie_width_max: int | None = None

    @property
    def at_slowdown(self) -> bool:
        if self.tlimit_c is not None and self.slowdown_tlimit_c is not None:
            return self.tlimit_c <= self.slowdown_tlimit_c
        if self.temperature_c is not None and self.slowdown_c is not None:
            return self.temperature_c >= self.slowdown_c
        return False


@dataclass(frozen=True)
class Xid:
    """One NVRM Xid line of the kernel log."""

    code: int
    pci: str  # as the kernel wrote it: 0000:00:06
    age_s: float | None  # seconds before the probe ran; None when the line has no timestamp
    text: str  # what follows the code


def _value(text: str | None) -> str | None:
    """A CSV cell, or None for nvidia-smi's "cannot say" (`[N/A]`, `N/A`, `[Not Supported]`, ...)."""
    text = (text or "").strip()
    if not text or text.startswith("[") or text in ("N/A", "Not Supported", "Unknown Error"):
        return None
    return text


def _number(text: str | None) -> int | None:
    """`345`, `345 MHz`, `70.56 W` (rounded), `0x0000000000000001`, or None."""
    text = _value(text)
    if text is None:
        return None
    if text.lower().startswith("0x"):
        try:
            return int(text, 16)
        except ValueError:
            return None
    match = re.match(r"-?\d+(\.\d+)?", text)
    return round(float(match.group(0))) if match else None


def _flag(text: str | None) -> bool | None:
    text = _value(text)
    if text is None:
        return None
    return {"yes": True, "no": False, "active": True, "not active": False}.get(text.lower())


def pci_key(bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of `00000000:00:06.0` (nvidia-smi) or `0000:00:06` (the kernel's Xid)."""
    match = re.fullmatch(r"(?:([0-9A-Fa-f]+):)?([0-9A-Fa-f]+):([0-9A-Fa-f]+)(?:\.[0-7])?", (bus_id or "").strip())
    if not match:
        return None
    return int(match.group(1) or "0", 16), int(match.group(2), 16), int(match.group(3), 16)


def parse_health_csv(text: str) -> list[GpuHealth]:
    """`nvidia-smi --query-gpu=... --format=csv[,nounits]`, read by its header's names (units in
    the header, `clocks.current.sm [MHz]`, are dropped; old and new names of a field are one).
    Lines that do not have the header's columns (nvidia-smi's "Unable to determine the device
    handle for GPU ..." between rows) are skipped. Raises ValueError without a header."""
    rows = [r for r in csv.reader(text.splitlines(), skipinitialspace=True) if r]
    if not rows or "index" not in [c.strip() for c in rows[0]]:
        raise ValueError(f"nvidia-smi health query without its header: {text.strip()[:200]!r}")
    names = [re.sub(r"\s*\[.*\]$", "", c.strip()) for c in rows[0]]
    names = [{v: k for k, v in FIELD_ALIASES.items()}.get(n, n) for n in names]
    names = ["clocks.sm" if n == "clocks.current.sm" else n for n in names]
    gpus = []
    for row in rows[1:]:
        if len(row) != len(names):
            continue
        cell = dict(zip(names, (c.strip() for c in row)))
        gpus.append(GpuHealth(
            index=cell["index"], uuid=_value(cell.get("uuid")), bus_id=_value(cell.get("pci.bus_id")),
            ecc_mode=_value(cell.get("ecc.mode.current")),
            ecc_uncorrected=_number(cell.get("ecc.errors.uncorrected.volatile.total")),
            retired_pages_pending=_flag(cell.get("retired_pages.pending")),
            remap_pending=_flag(cell.get("remapped_rows.pending")),
            remap_failure=_flag(cell.get("remapped_rows.failure")),
            clock_events=_number(cell.get("clocks_throttle_reasons.active")),
            sm_clock_mhz=_number(cell.get("clocks.sm")), sm_clock_max_mhz=_number(cell.get("clocks.max.sm")),
            temperature_c=_number(cell.get("temperature.gpu")),
            pcie_gen=_number(cell.get("pcie.link.gen.current")), pcie_gen_max=_number(cell.get("pcie.link.gen.max")),
            pcie_width=_number(cell.get("pcie.link.width.current")),
            pcie_width_max=_number(cell.get("pcie.link.width.max"))))
    return gpus


def parse_temperatures(text: str) -> list[tuple[str, dict[str, int | None]]]:
    """`nvidia-smi -q -d TEMPERATURE`: [(bus id, {label: degrees})] in nvidia-smi's GPU order.
    Labels as printed: `GPU Current Temp`, `GPU Slowdown Temp` (absolute, before Hopper),
    `GPU T.Limit Temp` and `GPU Slowdown T.Limit Temp` (margins, Hopper and later)."""
    blocks: list[tuple[str, dict[str, int | None]]] = []
    for line in text.splitlines():
        header = re.fullmatch(r"GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-7])\s*", line)
        if header:
            blocks.append((header.group(1), {}))
            continue
        label, sep, value = line.partition(":")
        if blocks and sep and "Temp" in label:
            blocks[-1][1][label.strip()] = _number(value)
    return blocks


def with_temperatures(gpus: list[GpuHealth], text: str) -> list[GpuHealth]:
    """Each GPU's slowdown threshold from `-q -d TEMPERATURE`, matched by PCI bus id (by
    position where the health query gave none: both list the GPUs in nvidia-smi's order)."""
    from dataclasses import replace

    blocks = parse_temperatures(text)
    by_bus = {pci_key(bus): temps for bus, temps in blocks}
    out = []
    for i, g in enumerate(gpus):
        temps = by_bus.get(pci_key(g.bus_id)) if g.bus_id else (blocks[i][1] if i < len(blocks) else None)
        if temps is None:
            out.append(g)
            continue
        bus_id = g.bus_id or blocks[i][0]
        out.append(replace(g, bus_id=bus_id, slowdown_c=temps.get("GPU Slowdown Temp"),
                           tlimit_c=temps.get("GPU T.Limit Temp"),
                           slowdown_tlimit_c=temps.get("GPU Slowdown T.Limit Temp"),
                           temperature_c=g.temperature_c if g.temperature_c is not None
                           else temps.get("GPU Current Temp")))
    return out


def parse_xids(lines: Iterable[str], uptime_s: float | None) -> list[Xid]:
    """NVRM Xid lines (`[ 1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off
    the bus.`, as dmesg and `journalctl -k -o short-monotonic` print them) with their age by
    the kernel's clock: uptime minus the line's stamp."""
    found = []
    for line in lines:
        match = _XID_RE.search(line)
        if not match:
            continue
        stamp = _STAMP_RE.match(line)
        age = max(0.0, uptime_s - float(stamp.group(1))) if stamp and uptime_s is not None else None
        found.append(Xid(int(match.group(2)), match.group(1), age, (match.group(3) or "").strip()))
    return found


def parse_health(data: dict) -> tuple[list[GpuHealth], list[Xid], str | None, str | None]:
    """The probe's ``health`` answer -> (GPUs, Xids, why the GPUs' health is unknown, why the
    kernel log is)."""
    error = data.get("error")
    gpus: list[GpuHealth] = []
    if data.get("query"):
        try:
            gpus = parse_health_csv(data["query"])
        except ValueError as exc:
            error = error or str(exc)
    if gpus and data.get("temperature"):
        gpus = with_temperatures(gpus, data["temperature"])
    log = data.get("kernel_log") or {}
    xids = parse_xids(log.get("lines") or [], log.get("uptime_s"))
    return gpus, xids, error, log.get("error")


def parse_xids_report(text: str) -> tuple[list[GpuHealth], list[Xid]]:
    """node.sh's ``xids`` answer (a failed run's summary): ``uptime SECONDS``, ``smi: `` lines
    (nvidia-smi's CSV of index, uuid and pci.bus_id, with its header), the kernel log's NVRM Xid
    lines. GPUs as far as nvidia-smi answered (none: the Xids are named by PCI address)."""
    uptime, smi, lines = None, [], []
    for line in text.splitlines():
        if line.startswith("uptime "):
            try:
                uptime = float(line.split()[1])
            except (IndexError, ValueError):
                pass
        elif line.startswith("smi: "):
            smi.append(line[5:])
        elif "NVRM: Xid" in line:
            lines.append(line)
    try:
        gpus = parse_health_csv("\n".join(smi)) if smi else []
    except ValueError:
        gpus = []
    return gpus, parse_xids(lines, uptime)


# ---------------------------------------------------------------------------------------
# findings


@dataclass(frozen=True)
class Finding:
    """One thing wrong with one GPU: ``reading`` is what nvidia-smi or the kernel said,
    ``meaning`` what it means in a few words; ``fatal`` refuses the run."""

    host: str
    gpu: str  # `GPU 0 (GPU-0e7e...)`, or `PCI 0000:3b:00` for an Xid of a GPU nvidia-smi did not list
    index: str | None
    kind: str  # a short name for the grouping: `remap pending`, `Xid 79`
    reading: str
    meaning: str
    fatal: bool


def _gpu_name(g: GpuHealth) -> str:
    return f"GPU {g.index}" + (f" ({g.uuid})" if g.uuid else "")


def gpu_findings(host: str, g: GpuHealth) -> list[Finding]:
    """What is wrong with one GPU, by its readings."""
    out = []

    def add(kind: str, reading: str, meaning: str, fatal: bool) -> None:
        out.append(Finding(host, _gpu_name(g), g.index, kind, reading, meaning, fatal))

    if g.ecc_uncorrected:
        add("uncorrectable ECC", f"{g.ecc_uncorrected} volatile uncorrectable ECC error(s)",
            "memory returned bad data since the driver loaded: reset the GPU, then watch it", True)
    if g.remap_failure:
        add("remap failure", "row remapping failure", "a memory row could not be remapped: the GPU needs service", True)
    if g.remap_pending:
        add("remap pending", "row remapping pending",
            "a bad memory row is remapped only at the next GPU reset: reset it", True)
    if g.retired_pages_pending:
        add("retirement pending", "page retirement pending",
            "bad memory pages are retired only at the next GPU reset: reset it", True)
    reasons = g.clock_events or 0
    cut = [name for bit, name in SLOWDOWN_REASONS.items() if reasons & bit]
    if cut:
        clocks = (f", SM {g.sm_clock_mhz} of {g.sm_clock_max_mhz} MHz"
                  if g.sm_clock_mhz is not None and g.sm_clock_max_mhz is not None else "")
        add("clocks cut", f"clock event reasons {reasons:#x} ({', '.join(cut)}){clocks}",
            "the clocks are cut (too hot, or the power supply brakes): this GPU sets every rank's pace", False)
    if g.at_slowdown:
        if g.tlimit_c is not None and g.slowdown_tlimit_c is not None:
            reading = f"{g.tlimit_c} C from T.Limit, slowdown at {g.slowdown_tlimit_c} C"
        else:
            reading = f"{g.temperature_c} C, slowdown at {g.slowdown_c} C"
        add("slowdown temperature", f"temperature at its slowdown threshold ({reading})",
            "the GPU slows itself down to cool off (airflow, fans, a blocked intake?)", False)
    if g.pcie_width is not None and g.pcie_width_max is not None and g.pcie_width < g.pcie_width_max:
        add("PCIe width", f"PCIe link x{g.pcie_width} of x{g.pcie_width_max}",
            "the link trained narrower than it can: host-device copies are slower (reseat or check the riser)", False)
    if (g.pcie_gen is not None and g.pcie_gen_max is not None and g.pcie_gen < g.pcie_gen_max
            and not reasons & IDLE_REASON):  # an idle GPU may lower its link speed to save power
        add("PCIe gen", f"PCIe link gen {g.pcie_gen} of gen {g.pcie_gen_max} (GPU busy)",
            "the link runs slower than it can: host-device copies are slower", False)
    return out


def xid_findings(host: str, gpus: list[GpuHealth], xids: list[Xid], window_s: float = XID_WINDOW_S) -> list[Finding]:
    """Xids within the window, on the GPU their PCI address names: one finding per GPU and
    code (a failing GPU repeats its Xid, often once per process), the latest line's words
    and how many there were."""
    by_bus = {pci_key(g.bus_id): g for g in gpus if g.bus_id}
    latest: dict[tuple, tuple[Xid, int]] = {}
    for x in xids:
        if x.age_s is not None and x.age_s > window_s:
            continue
        key = (pci_key(x.pci) or x.pci, x.code)
        latest[key] = (x, latest.get(key, (x, 0))[1] + 1)  # (the log is in time order)
    out = []
    for x, count in latest.values():
        g = by_bus.get(pci_key(x.pci))
        when = f"{_ago(x.age_s)} ago" if x.age_s is not None else "since boot"
        times = f" ({count} times, the last {when})" if count > 1 else f" {when}"
        meaning = FATAL_XIDS.get(x.code) or OTHER_XIDS.get(x.code) or "see NVIDIA's Xid catalog"
        said = f" ({x.text})" if x.text else ""
        out.append(Finding(host, _gpu_name(g) if g else f"PCI {x.pci}", g.index if g else None, f"Xid {x.code}",
                           f"Xid {x.code}{times}{said}"[:240], meaning, x.code in FATAL_XIDS))
    return out


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def findings(host: str, gpus: list[GpuHealth], xids: list[Xid], window_s: float = XID_WINDOW_S) -> list[Finding]:
    return [f for g in gpus for f in gpu_findings(host, g)] + xid_findings(host, gpus, xids, window_s)


def run_fault_lines(found: list[Finding]) -> list[str]:
    """What a failed run (or `ftbundle status` of a detached one) says of the GPU faults its
    nodes' kernels logged while it ran: a head, the findings folded, a hint naming the hosts
    whose GPU must be reset or serviced. None without a finding."""
    if not found:
        return []
    lines = ["GPU faults the kernel logged during the run (NVRM Xid):"]
    lines += [f"  {line}" for line in fold_findings(found)]
    fatal = fold(f.host for f in found if f.fatal)
    if fatal:
        lines.append(f"hint: {fatal}: a GPU there needs a reset or service before the next run (`ftbundle check` "
                     "refuses it while the Xid is within its window: docs/check.md)")
    return lines


def fold_findings(found: list[Finding]) -> list[str]:
    """One line per (what, GPU index, reading), its hosts folded: `node[3-5]: GPU 0 (GPU-a, GPU-b,
    GPU-c): row remapping pending: ...`. A finding names host, GPU index and UUID."""
    groups: dict[tuple, list[Finding]] = {}
    for f in found:
        key = (f.index if f.index is not None else f.gpu, re.sub(r"\d+(\.\d+)? (s|min|h) ago", "", f.reading),
               f.meaning, f.fatal)
        groups.setdefault(key, []).append(f)
    lines = []
    for fs in groups.values():
        first = fs[0]
        if len(fs) == 1:
            lines.append(f"{first.host}: {first.gpu}: {first.reading}: {first.meaning}")
            continue
        uuids = [re.sub(r"^GPU \S+ \((.*)\)$", r"\1", f.gpu) for f in fs]
        shown = ", ".join(uuids[:8]) + (f" and {len(uuids) - 8} more" if len(uuids) > 8 else "")
        what = f"GPU {first.index} ({shown})" if first.index is not None else first.gpu
        lines.append(f"{fold(f.host for f in fs)}: {what}: {first.reading}: {first.meaning}")
    return lines

