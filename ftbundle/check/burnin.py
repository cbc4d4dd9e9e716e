"""`ftbundle check --burn-in [SECONDS]`: is any host slower than the rest?

Every host runs the same short load at once (shims/burnin.py, once per node with the job's
own interpreter or image, launched by the launcher's own Supervisor on the job's plan, as
``--net`` launches its all-reduce): per GPU a bf16 GEMM (TFLOP/s) and an HBM copy (GB/s); on
a host without GPUs a CPU GEMM (GFLOP/s, one thread). Each figure is compared with the
fleet's median of the same figure (:func:`compare`, pure): one below ``slow_below`` of it is
named slow, with its figure and the median. Slow is a warning, not a failure; a host whose
measurement could not be made is an error.

Where it is kept: the check's own directory, ``<shared_dir>/checks/<check id>/`` (the
check has no other directory: ``runs/`` holds runs only). ``burnin.json`` there has every
figure, the medians and who was slow; beside it each node's own result and log.
"""

from __future__ import annotations

import dataclasses
import io
import json
import posixpath
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from .. import rundir, shipped
from ..cluster import Cluster, Result, first_line, parallel
from ..hostlist import fold, fold_numbers
from ..plan import Plan, shape_text
from . import WAIT_S_PER_HOST

DEFAULT_SECONDS = 10.0
DEFAULT_SLOW_BELOW = 0.9
START_LIMIT_S = 120  # each node's load is killed after this long beyond its seconds (imports, CUDA start)
# Every host starts measuring when every host is ready (its ready file in the check's
# directory): each waits at most this long, +WAIT_S_PER_HOST per host on clusters over 8 hosts (the launch
# of n nodes is spread over a time that grows with n), then measures anyway and says so.
BARRIER_S = 60.0
# ...and all begin at one moment: the last host's ready time + this, +GO_AFTER_S_PER_HOST a host
# (each must have seen every ready file by then; a host that saw them later says how late it was)
GO_AFTER_S = 1.0
GO_AFTER_S_PER_HOST = 0.02
LATE_S = 0.5  # a host that began this much after the agreed moment says so (late_notes)

# figure key -> (what it is, unit)
METRICS = {
    "gemm_bf16_tflops": ("bf16 GEMM", "TFLOP/s"),
    "hbm_copy_gbps": ("HBM copy", "GB/s"),
    "cpu_gemm_gflops": ("CPU GEMM", "GFLOP/s"),
}


def num(value: float) -> str:
    """A figure as people read it: three digits below 100 (9.04, 29.0, 64.6), whole above (783, 2990)."""
    return f"{value:#.3g}" if abs(value) < 100 else f"{value:.0f}"


@dataclass(frozen=True)
class Figure:
    """One measured figure of one device (a GPU, or a host's CPU)."""

    host: str
    device: str  # "cpu", or "GPU 3" (the index the host's nvidia-smi gives, where known)
    metric: str  # a key of METRICS
    value: float
    uuid: str | None = None
    lib: str | None = None  # the CPU GEMM's library ("numpy 2.4.6", "torch 2.13.0"): compared only with its own
    best: float | None = None  # its fastest slice of the measured time, where the node read slices


# A CPU is shared with whatever else runs on its host (sshd, an agent, other containers on one
# machine): a CPU figure below the line whose fastest slice was not is crowded out, not slow,
# and is said as a note. A GPU is the burn-in's alone: a GPU slow on average is named even when
# it ran at speed for part of the time (a GPU that throttles now and then is the fault sought).
SHARED = {"cpu_gemm_gflops"}


@dataclass(frozen=True)
class Slow:
    figure: Figure
    median: float

    @property
    def ratio(self) -> float:
        return self.figure.value / self.median if self.median else 0.0

    @property
    def where(self) -> str:
        f = self.figure
        return f.host if f.device == "cpu" else f"{f.host} {f.device}" + (f" ({f.uuid})" if f.uuid else "")

    @property
    def best_ratio(self) -> float | None:
        return self.figure.best / self.median if self.median and self.figure.best is not None else None

    def line(self) -> str:
        what, unit = METRICS[self.figure.metric]
        fastest = (f", {self.best_ratio:.2f}x in its fastest slice"
                   if self.figure.metric in SHARED and self.best_ratio is not None else "")
        return (f"{self.where} is slow: {what} {num(self.figure.value)} {unit}, {self.ratio:.2f}x the fleet's median "
                f"{num(self.median)} {unit}{fastest}")

    def crowded_line(self) -> str:
        what, _ = METRICS[self.figure.metric]
        return (f"{self.where}'s {what} was {self.ratio:.2f}x the fleet's median on average but {self.best_ratio:.2f}x "
                "in its fastest slice: other work on its CPU crowded it out for a while; not named slow")


@dataclass
class BurninReport:
    check_dir: str = ""
    seconds: float = DEFAULT_SECONDS
    slow_below: float = DEFAULT_SLOW_BELOW
    figures: list[Figure] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    slow: list[Slow] = field(default_factory=list)
    crowded: list[Slow] = field(default_factory=list)  # below the line on average only: not named (SHARED)
    nodes: dict[str, dict] = field(default_factory=dict)  # host -> its node's result, as written
    net: dict | None = None  # --net's figures, when it ran too
    errors: list[str] = field(default_factory=list)  # hosts or GPUs not measured
    gemm_kept: str | None = None  # where each GPU's bf16 GEMM is kept for later runs' MFU (gemm_record)
    notes: list[str] = field(default_factory=list)  # hosts that measured before every host was ready
    took: float = 0.0

    @property
    def ok(self) -> bool:
        """Every host measured (a slow one is a warning)."""
        return not self.errors

    def to_dict(self) -> dict:
        return {"check_dir": self.check_dir, "seconds": self.seconds, "slow_below": self.slow_below,
                "medians": self.medians,
                "figures": [dataclasses.asdict(f) for f in self.figures],
                "slow": [{**dataclasses.asdict(s.figure), "median": s.median, "ratio": round(s.ratio, 4)}
                         for s in self.slow],
                "crowded": [{**dataclasses.asdict(s.figure), "median": s.median, "ratio": round(s.ratio, 4)}
                            for s in self.crowded],
                "errors": self.errors, "notes": self.notes, "took_s": round(self.took, 2), "nodes": self.nodes,
                **({"net": self.net} if self.net is not None else {})}


# ---------------------------------------------------------------------------------------
# Pure parts


def compare(figures: list[Figure], slow_below: float = DEFAULT_SLOW_BELOW) -> tuple[dict[str, float], list[Slow]]:
    """Each figure against the fleet's median of the same metric: (medians, the slow ones).

    Below ``slow_below`` x the median is slow, except a CPU figure whose fastest slice was
    not (:func:`crowded`). A fleet of one compares with itself (nobody is slow); with two, the
    median is their mean, so a host at half its peer's speed is at 0.67x and named. CPU
    figures made with different libraries are compared each with its own kind; the medians
    returned are the largest group's of each metric."""
    medians, below = _below(figures, slow_below)
    return medians, [s for s in below if not _crowded(s, slow_below)]


def crowded(figures: list[Figure], slow_below: float = DEFAULT_SLOW_BELOW) -> list[Slow]:
    """The CPU figures below the line on average whose fastest slice was at or above it:
    the host's CPU did the fleet's work when it had the core, so it was crowded out by other
    work for a while, not slow. Said as a note, never named (a diagnosis on evidence only)."""
    return [s for s in _below(figures, slow_below)[1] if _crowded(s, slow_below)]


def _crowded(s: Slow, slow_below: float) -> bool:
    return s.figure.metric in SHARED and s.best_ratio is not None and s.best_ratio >= slow_below


def _below(figures: list[Figure], slow_below: float) -> tuple[dict[str, float], list[Slow]]:
    groups: dict[tuple[str, str | None], list[Figure]] = {}
    for f in figures:
        groups.setdefault((f.metric, f.lib), []).append(f)
    group_median = {key: statistics.median(f.value for f in fs) for key, fs in groups.items()}
    medians: dict[str, float] = {}
    for (metric, _), fs in sorted(groups.items(), key=lambda kv: len(kv[1])):
        medians[metric] = group_median[(metric, fs[0].lib)]
    slow = [Slow(f, group_median[(f.metric, f.lib)]) for f in figures
            if f.value < slow_below * group_median[(f.metric, f.lib)]]
    slow.sort(key=lambda s: (s.ratio, s.figure.host, s.figure.device))
    return medians, slow


def figures_of(host: str, result: dict) -> tuple[list[Figure], list[str]]:
    """A node's result (shims/burnin.py's JSON) as figures, and the devices it could not measure."""
    figures, errors = [], []
    for d in result.get("devices", []):
        device = str(d.get("device", "?"))
        if d.get("error"):
            errors.append(f"{host} {device}: not measured: {d['error']}")
            continue
        for metric in METRICS:
            if isinstance(d.get(metric), (int, float)):
                slices = [v for v in d.get(f"{metric}_slices") or [] if isinstance(v, (int, float))]
                figures.append(Figure(host, device, metric, float(d[metric]), d.get("uuid"), d.get("lib"),
                                      max(slices) if slices else None))
    return figures, errors


def lib_notes(figures: list[Figure]) -> list[str]:
    """Hosts whose CPU GEMM ran on different libraries (numpy on some, torch where numpy is
    missing) are not comparable with each other: say which used which."""
    by_lib: dict[str, list[str]] = {}
    for f in figures:
        if f.lib:
            by_lib.setdefault(f.lib, []).append(f.host)
    if len(by_lib) < 2:
        return []
    return ["the CPU GEMM ran on different libraries (" + "; ".join(f"{lib} on {fold(hosts)}" for lib, hosts
                                                                 in sorted(by_lib.items())) +
            "): each host is compared only with those that used the same one"]


def late_notes(host: str, result: dict, names: list[str]) -> list[str]:
    """A host that stopped waiting for others at the barrier measured at another moment: say so."""
    barriers = [d.get("barrier") or {} for d in result.get("devices", [])]
    late = sorted({r for b in barriers for r in b.get("not_ready", []) if isinstance(r, int) and 0 <= r < len(names)})
    if late:
        return [f"{host} measured without waiting any longer for {fold(names[r] for r in late)} (not ready in "
                "time): its figures are not from the same moment as theirs"]
    behind = max((b.get("late_s") or 0.0 for b in barriers), default=0.0)
    if behind >= LATE_S:
        return [f"{host} began measuring {behind:.1f}s after the others (it saw the last host ready only then): "
                "its figures are not from quite the same moment as theirs"]
    return []


def gemm_record(report: BurninReport, check: str, at: float, kept: dict | None = None) -> dict | None:
    """What later runs count MFU against where ftbundle's table knows no dense bf16 peak for
    their GPUs (ftbundle/speed.py ``basis_of``), kept as ``<shared_dir>/checks/gemm.json``:
    each measured GPU's bf16 GEMM by its UUID, with its host, name, and the burn-in (``check``,
    ``at``) that measured it. None: no GPU measured (a CPU burn-in keeps nothing there).
    ``kept``: the record there before: the GPUs measured now replace theirs, the others keep
    theirs (a burn-in of part of the fleet does not lose the rest's figures)."""
    names = _gpu_names(report)
    at = round(at, 3)
    gpus = {f.uuid: {"host": f.host, "device": f.device, "name": names.get(f.uuid), "tflops": round(f.value, 2),
                     "check": check, "at": at}
            for f in report.figures if f.metric == "gemm_bf16_tflops" and f.uuid}
    if not gpus:
        return None
    before = kept.get("gpus") if isinstance(kept, dict) and isinstance(kept.get("gpus"), dict) else {}
    older = {}
    for uuid, gpu in before.items():
        if uuid in gpus or not isinstance(gpu, dict):
            continue
        # (a record written before each GPU carried its own burn-in: the record's own id and time)
        older[uuid] = {"check": kept.get("check"), "at": kept.get("at"), **gpu}
    return {"check": check, "at": at, "gpus": {**older, **gpus}}


def _gpu_names(report: BurninReport) -> dict[str, str]:
    """Each measured GPU's name by its UUID, from the node results (the figures carry no name)."""
    return {str(d["uuid"]): d.get("name") for result in report.nodes.values()
            for d in result.get("devices", []) if isinstance(d, dict) and d.get("uuid")}


def gemm_note(report: BurninReport) -> str | None:
    """Said where the GPUs measured are not in ftbundle's table: their MFU counts against this."""
    from ..speed import gpu_peak

    if not report.gemm_kept:
        return None
    names = _gpu_names(report)
    measured = sorted({str(names[f.uuid]) for f in report.figures
                       if f.metric == "gemm_bf16_tflops" and names.get(f.uuid)})
    unknown = [name for name in measured if gpu_peak(name) is None]
    if not unknown or "gemm_bf16_tflops" not in report.medians:
        return None
    return (f"{', '.join(unknown)}: not in ftbundle's table of data-sheet bf16 peaks; later runs on these GPUs count "
            f"MFU against the bf16 GEMM measured here (median {num(report.medians['gemm_bf16_tflops'])} TFLOP/s), "
            f"kept in {report.gemm_kept}")


def burnin_source() -> str:
    return shipped.read_text("shims", "burnin.py")


def check_dir(plan: Plan) -> str:
    """``<shared_dir>/checks/<the check's id>``: the check's own directory."""
    return rundir.check_dir(plan.shared_dir, plan.run_id)


def burnin_plan(plan: Plan, seconds: float) -> Plan:
    """The job's plan running the burn-in once per node (no torchrun: nothing is exchanged):
    the same hosts, interpreter or image, GPUs and environment, in the check's directory;
    each node bounded by `timeout`."""
    run_dir = check_dir(plan)
    barrier = BARRIER_S + WAIT_S_PER_HOST * max(0, len(plan.nodes) - 8)
    go_after = GO_AFTER_S + GO_AFTER_S_PER_HOST * len(plan.nodes)
    limit = str(int(seconds * 2 + barrier + go_after + START_LIMIT_S))

    def node(n):
        python = n.torchrun[0] if n.torchrun else "python3"
        program = (python, posixpath.join(run_dir, rundir.BURNIN_SCRIPT), "--seconds", f"{seconds:g}", "--out-dir", run_dir,
                   "--nodes", str(len(plan.nodes)), "--barrier-s", f"{barrier:g}", "--go-after", f"{go_after:g}")
        wrapper, container = n.wrapper, n.container
        if container:  # docker runtime: a name of its own (--net's bench may be leaving its containers)
            container = f"{container}-burnin"
            wrapper = tuple(container if w == n.container else w for w in wrapper)
        return dataclasses.replace(
            # stream=False: no host follows its log for the terminal (rank 0's would cost it CPU the others do not pay)
            n, program=program, per_node=True, wrapper=("timeout", "-k", "5", limit, *wrapper), container=container,
            stream=False,
            env={**n.env, "FTB_RUN_DIR": run_dir},
            log_path=posixpath.join(run_dir, posixpath.basename(n.log_path)))

    return dataclasses.replace(plan, run_dir=run_dir, files={}, warnings=(), notes=(), stall_timeout=0,
                               nodes=tuple(node(n) for n in plan.nodes))


# ---------------------------------------------------------------------------------------
# I/O


def _read_node(cluster: Cluster, node, run_dir: str):
    """The node's result file, read on its own host."""
    path = posixpath.join(run_dir, rundir.burnin_node_result(node.rank))
    try:
        result = cluster.run(node.host, ["cat", "--", path], timeout=15)
    except Exception as exc:  # noqa: BLE001 - named in the report
        return first_line(exc)
    return result


def _kept_gemm(cluster: Cluster, host, path: str, report: BurninReport) -> dict | None:
    """The GEMM record an earlier burn-in kept (rundir.gemm_record), read on rank 0's host
    only where this burn-in measured GPUs; None: none there, or one that cannot be merged
    (said as a note: this burn-in's record replaces it)."""
    if not any(f.metric == "gemm_bf16_tflops" and f.uuid for f in report.figures):
        return None
    try:
        answer = cluster.run(host, ["sh", "-c", 'test ! -e "$1" || cat -- "$1"', "sh", path], timeout=15)
        text = answer.stdout if answer.ok else None
        why = None if answer.ok else (first_line(answer.stderr) or f"exit {answer.code}")
    except Exception as exc:  # noqa: BLE001 - said below
        text, why = None, first_line(exc)
    if text is not None and not text.strip():
        return None
    try:
        if why is None:
            kept = json.loads(text)
            if isinstance(kept, dict) and isinstance(kept.get("gpus"), dict):
                return kept
            why = "not a record of GPUs"
    except ValueError as exc:
        why = f"not JSON ({exc})"
    report.notes.append(f"{path} could not be read ({why}): the GPUs earlier burn-ins measured there and this one "
                        "did not are no longer kept")
    return None


def _bookkeeping(bench: Plan) -> tuple[str, ...]:
    """The launcher's own files of the burn-in (pid, exit code, attempt) and the staged
    script: removed once burnin.json is written. Each node's log and result stay."""
    run = bench.rundir
    files = [run.attempt, run.join(rundir.BURNIN_SCRIPT), run.join(rundir.BURNIN_READY)]
    for n in bench.nodes:
        f = bench.node_files(n, 1)
        files += [f.pid, f.exit, f.hb]
    return tuple(files)


def _why(bench: Plan, cluster: Cluster, node, failure, answer) -> str:
    """Why a node wrote no result: its own failure (the launcher's reason, and its log's last
    line), or stopped with the one that failed (the launcher stops every node then)."""
    from ..launch import read_tail

    if failure is not None and failure.rank != node.rank:
        return f"stopped when {failure.host} failed"
    tail = [line.strip() for line in read_tail(bench, cluster, node.rank, node.log_path, 4) or [] if line.strip()]
    said = failure.reason if failure is not None else (answer if isinstance(answer, str) else "no result written")
    return f"{said}" + (f" ({tail[-1]})" if tail else "")


def run_burnin(plan: Plan, cluster: Cluster, seconds: float = DEFAULT_SECONDS,
               slow_below: float = DEFAULT_SLOW_BELOW, out: TextIO | None = None, *,
               quiet: bool = False, net: dict | None = None) -> BurninReport:
    """Load every host at once, compare, keep burnin.json in the check's directory, print
    the report to ``out`` (default: stdout) unless ``quiet``; return it. ``net``: the
    figures of ``--net`` made just before, kept in the same file."""
    from ..launch import StagingError, Supervisor, stage_files, stage_run_dir

    started = time.monotonic()
    bench = burnin_plan(plan, seconds)
    report = BurninReport(check_dir=bench.run_dir, seconds=seconds, slow_below=slow_below, net=net)
    rank0 = bench.nodes[0].host
    try:
        stage_run_dir(cluster, bench, tell=False)
        stage_files(cluster, rank0, bench.run_dir, {rundir.BURNIN_SCRIPT: burnin_source()})
        outcome = Supervisor(bench, cluster, out=io.StringIO(), err=io.StringIO()).run()
        if outcome.interrupted:  # Ctrl-C: every node was stopped; the CLI says so and exits 130
            raise KeyboardInterrupt
        failure = outcome.failure
        answers = parallel(lambda n: _read_node(cluster, n, bench.run_dir), list(bench.nodes))
        for node, answer in zip(bench.nodes, answers):
            name = node.host.name
            try:
                if not isinstance(answer, Result) or not answer.ok:
                    raise ValueError
                result = json.loads(answer.stdout)
            except ValueError:
                report.errors.append(f"{name}: not measured: {_why(bench, cluster, node, failure, answer)}")
                continue
            report.nodes[name] = result
            report.notes += late_notes(name, result, [n.host.name for n in bench.nodes])
            figures, errors = figures_of(name, result)
            report.figures += figures
            report.errors += errors
        report.medians, report.slow = compare(report.figures, slow_below)
        report.crowded = crowded(report.figures, slow_below)
        report.notes += lib_notes(report.figures)
        report.took = time.monotonic() - started
        stage_files(cluster, rank0, bench.run_dir, {rundir.BURNIN_RESULT: json.dumps(report.to_dict(), indent=2) + "\n"},
                    leftovers=_bookkeeping(bench))
        record = rundir.gemm_record(plan.shared_dir)
        kept = gemm_record(report, plan.run_id, time.time(), _kept_gemm(cluster, rank0, record, report))
        if kept is not None:  # (a later run's MFU on GPUs the table does not know: ftbundle/speed.py)
            try:
                stage_files(cluster, rank0, posixpath.dirname(record), {rundir.GEMM: json.dumps(kept, indent=1) + "\n"})
                report.gemm_kept = record
            except StagingError as exc:
                report.notes.append(f"each GPU's bf16 GEMM was not kept for later runs' MFU: {exc}")
    except StagingError as exc:  # the check's directory could not be written: say so
        report.errors.append(f"burn-in could not run: {exc}")
        report.took = time.monotonic() - started
    if not quiet:
        print_burnin_report(report, plan, out)
    return report


def _devices(devices: set[str]) -> str:
    """``{"GPU 0", "GPU 1", "GPU 3"}`` -> ``GPUs 0-1,3``; the CPU is said by the metric."""
    gpus = [d[4:] for d in devices if d.startswith("GPU ")]
    if not gpus:
        return ""
    if all(g.isdigit() for g in gpus):
        return f" (GPU{'s' if len(gpus) > 1 else ''} {fold_numbers(int(g) for g in gpus)})"
    return f" ({', '.join(sorted(devices))})"


def format_burnin_report(report: BurninReport, plan: Plan) -> list[str]:
    """Per metric one line: the median, and the hosts within ``slow_below`` of it folded with
    their range; then one warning per slow figure, the errors, and where the figures are kept."""
    lines = [f"ftbundle check --burn-in: job {plan.job_name}, {shape_text(plan.nprocs, 'host(s)')}, "
             f"{report.seconds:g}s of load on every host at once; slow: below {report.slow_below:g}x the fleet's median"]
    slow = {(s.figure.host, s.figure.device, s.figure.metric) for s in report.slow}
    for metric, (what, unit) in METRICS.items():
        fine = [f for f in report.figures if f.metric == metric and (f.host, f.device, f.metric) not in slow]
        if metric not in report.medians:
            continue
        line = f"{what:<10}  median {num(report.medians[metric])} {unit}"
        if fine:
            low, high = min(f.value for f in fine), max(f.value for f in fine)
            span = num(low) if num(low) == num(high) else f"{num(low)}-{num(high)}"
            line += f"; {fold(f.host for f in fine)}{_devices({f.device for f in fine})}: {span} {unit}"
        lines.append(line)
    lines += [f"warning: {s.line()}" for s in report.slow]
    lines += [f"note: {s.crowded_line()}" for s in report.crowded]
    lines += [f"note: {n}" for n in report.notes + [gemm_note(report)] if n]
    lines += [f"error: {e}" for e in report.errors]
    if report.figures and not report.slow:
        lines.append("no host is slow")
    kept = f"; figures in {posixpath.join(report.check_dir, rundir.BURNIN_RESULT)}" if report.figures else ""
    lines.append(f"burn-in {'done' if report.ok else 'incomplete'} in {report.took:.1f}s{kept}")
    return lines


def print_burnin_report(report: BurninReport, plan: Plan, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    for line in format_burnin_report(report, plan):
        print(line, file=out)
    out.flush()
