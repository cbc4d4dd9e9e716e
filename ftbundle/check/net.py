"""`ftbundle check --net`: how fast can the hosts actually talk?

Two measurements, both bounded in time and leaving nothing behind:

* iperf3 between rank 0 and every other host, one at a time (so they do not share rank
  0's link): a one-shot server on rank 0 (`iperf3 -s -1`, port master_port + 1) and a
  2-second test from the other host. The number is what the host's TCP path can carry.
* a short all-reduce across all ranks, launched by ftbundle itself on the job's own plan
  (hosts, ranks, interpreter or image, environment; :meth:`Plan.with_program` swaps the
  training for shims/allreduce_bench.py): NCCL on GPUs, gloo on the CPU. Rank 0 writes its
  result as JSON into the run directory, where the controller reads it. Its bus bandwidth
  is what the collective the training runs actually gets.

Hosts under ``min_gbps`` get a warning naming them (multi-node training wants 10 Gbit/s
or more between nodes); a measurement that could not be made is an error.
"""

from __future__ import annotations

import dataclasses
import io
import json
import posixpath
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from .. import rundir, shipped
from ..cluster import Cluster, Result, first_line
from ..plan import Plan, shape_text
from . import probe_argv, probe_source

DEFAULT_MIN_GBPS = 10.0
IPERF_SECONDS = 2
IPERF_SERVER_S = 15  # the one-shot server gives up after this long without its client
IPERF_CONNECT_S = 8  # the client keeps trying to reach the server for this long
BENCH_SIZE_MIB = 16
BENCH_ITERS = 10
BENCH_LIMIT_S = 180  # each node's torchrun is killed after this long (start-up included)


@dataclass
class NetReport:
    throughput_gbps: dict[str, float] = field(default_factory=dict)  # host -> Gbit/s to rank 0
    rank0: str = ""
    busbw_gbps: float | None = None
    algbw_gbps: float | None = None
    bench: dict = field(default_factory=dict)  # rank 0's result (allreduce.json)
    warnings: list[str] = field(default_factory=list)  # slow hosts, slow collective
    errors: list[str] = field(default_factory=list)  # measurements that could not be made
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every measurement was made (slow ones are warnings, not errors)."""
        return not self.errors


# ---------------------------------------------------------------------------------------
# Pure parts


def parse_iperf3_json(text: str) -> float:
    """Bits per second received, from `iperf3 -c ... -J`; ValueError with iperf3's own
    message when the test failed."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(text.strip().splitlines()[-1] if text.strip() else "no output from iperf3") from None
    if data.get("error"):
        raise ValueError(data["error"])
    try:
        return float(data["end"]["sum_received"]["bits_per_second"])
    except (KeyError, TypeError):
        raise ValueError("iperf3 output has no end.sum_received.bits_per_second") from None


def slow_warnings(throughput: dict[str, float], rank0: str, busbw: float | None, min_gbps: float) -> list[str]:
    """A warning per host under the threshold, and one for the collective."""
    warnings = [f"{host} -> {rank0}: {gbps:.2f} Gbit/s is under {min_gbps:g} Gbit/s; multi-node training "
                f"will be network-bound (slow link? wrong interface? check NCCL_SOCKET_IFNAME / the fabric)"
                for host, gbps in throughput.items() if gbps < min_gbps]
    if busbw is not None and busbw < min_gbps:
        warnings.append(f"all-reduce bus bandwidth {busbw:.2f} Gbit/s is under {min_gbps:g} Gbit/s")
    return warnings


def bench_source() -> str:
    return shipped.read_text("shims", "allreduce_bench.py")


def bench_plan(plan: Plan, *, size_mib: float = BENCH_SIZE_MIB, iters: int = BENCH_ITERS) -> Plan:
    """The job's plan running the all-reduce bench: same hosts, ranks, interpreter or image,
    environment and master port, in a run directory of its own; every node bounded by
    `timeout` so a hung collective cannot outlive the check."""
    run_id = f"{plan.job_name}-netcheck-{time.strftime('%Y%m%d-%H%M%S')}-{plan.run_id[-4:]}"
    run = rundir.RunDir.of(plan.shared_dir, run_id)
    run_dir = run.path
    program = (run.join(rundir.NET_BENCH_SCRIPT), "--size-mib", f"{size_mib:g}", "--iters", str(iters),
               "--timeout", "60", "--out", run.join(rundir.NET_BENCH_RESULT))
    bench = plan.with_program(program)
    nodes = tuple(dataclasses.replace(
        n, wrapper=("timeout", "-k", "5", str(BENCH_LIMIT_S), *n.wrapper), torchrun=_in_run_dir(n.torchrun, plan.run_dir, run_dir),
        env={**n.env, "FTB_RUN_ID": run_id, "FTB_RUN_DIR": run_dir},
        log_path=posixpath.join(run_dir, posixpath.basename(n.log_path))) for n in bench.nodes)
    return dataclasses.replace(bench, run_id=run_id, run_dir=run_dir, nodes=nodes)


def _in_run_dir(torchrun: tuple[str, ...], job_run_dir: str, run_dir: str) -> tuple[str, ...]:
    """torchrun's --log-dir moved from the job's run directory into the bench's."""
    argv = list(torchrun)
    if "--log-dir" in argv:
        at = argv.index("--log-dir") + 1
        argv[at] = posixpath.join(run_dir, posixpath.relpath(argv[at], job_run_dir))
    return tuple(argv)


# ---------------------------------------------------------------------------------------
# I/O


def _probe(host, spec: dict) -> list[str]:
    return probe_argv(host, json.dumps(spec))


def _answer(result) -> dict:
    if not isinstance(result, Result):
        return {"error": first_line(result)}
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (result.stderr.strip().splitlines() or [f"exit {result.code}"])[-1]}


def measure_iperf(plan: Plan, cluster: Cluster, report: NetReport) -> None:
    """rank 0 <- each other host, one at a time (the probe's iperf modes: argv, no shell)."""
    rank0 = plan.nodes[0]
    port = plan.master_port + 1
    server = {"mode": "iperf-server", "port": port, "server_s": IPERF_SERVER_S}
    client = {"mode": "iperf-client", "addr": plan.master_addr, "port": port, "seconds": IPERF_SECONDS,
              "connect_s": IPERF_CONNECT_S}
    for node in plan.nodes[1:]:
        served, measured = [_answer(r) for r in cluster.run_all(
            [(rank0.host, _probe(rank0.host, server)), (node.host, _probe(node.host, client))],
            stdin=probe_source(), timeout=IPERF_SERVER_S + IPERF_CONNECT_S + IPERF_SECONDS + 20)]
        if served.get("missing"):
            report.errors.append(f"iperf3 is not installed on {rank0.host.name} (rank 0): "
                                 "throughput not measured (apt-get install iperf3)")
            return
        if measured.get("missing"):
            report.errors.append(f"iperf3 is not installed on {node.host.name}: its throughput was not measured")
            continue
        try:
            report.throughput_gbps[node.host.name] = parse_iperf3_json(measured.get("json") or
                                                                      measured.get("error", "")) / 1e9
        except ValueError as exc:
            report.errors.append(f"iperf3 {node.host.name} -> {rank0.host.name}:{port} failed: {exc}")


def measure_allreduce(plan: Plan, cluster: Cluster, report: NetReport, *, size_mib: float, iters: int) -> None:
    """Launch the bench with the launcher's own Supervisor; read rank 0's result file."""
    from ..launch import Supervisor, read_tail, stage_files, stage_run_dir

    bench = bench_plan(plan, size_mib=size_mib, iters=iters)
    rank0 = bench.nodes[0].host
    try:
        stage_run_dir(cluster, bench, tell=False)
        stage_files(cluster, rank0, bench.run_dir, {rundir.NET_BENCH_SCRIPT: bench_source()})
        outcome = Supervisor(bench, cluster, out=io.StringIO(), err=io.StringIO()).run()
        result = cluster.run(rank0, ["cat", "--", bench.rundir.join(rundir.NET_BENCH_RESULT)], timeout=15)
        if outcome.exit_code != 0 or not result.ok:
            first = outcome.failure.rank if outcome.failure else 0
            tail = read_tail(bench, cluster, first, bench.nodes[first].log_path, 8) or []
            report.errors.append(f"all-reduce bench failed (exit {outcome.exit_code}):\n    "
                                 + "\n    ".join(line for line in tail if line.strip()))
            return
        data = json.loads(result.stdout)
        report.bench = data
        report.busbw_gbps = float(data["busbw_gbps"])
        report.algbw_gbps = float(data["algbw_gbps"])
    finally:
        try:
            runs = posixpath.dirname(bench.run_dir)  # removed too if the bench made it
            cluster.run(rank0, ["bash", "-c", 'rm -rf -- "$1"; rmdir -- "$2" 2>/dev/null; true',
                                "ftb", bench.run_dir, runs], timeout=30)
        except Exception:
            pass


def run_net_check(plan: Plan, cluster: Cluster, min_gbps: float = DEFAULT_MIN_GBPS, out: TextIO | None = None,
                  *, quiet: bool = False, size_mib: float = BENCH_SIZE_MIB, iters: int = BENCH_ITERS) -> NetReport:
    """Measure, print the report to ``out`` (default: stdout) unless ``quiet``, return it."""
    started = time.monotonic()
    report = NetReport(rank0=plan.nodes[0].host.name)
    if len(plan.nodes) > 1:
        measure_iperf(plan, cluster, report)
    measure_allreduce(plan, cluster, report, size_mib=size_mib, iters=iters)
    crosses = report.bench.get("world", 1) != 1  # world size 1: bus bandwidth is 0 by definition
    report.warnings = slow_warnings(report.throughput_gbps, report.rank0,
                                    report.busbw_gbps if crosses else None, min_gbps)
    report.seconds = time.monotonic() - started
    if not quiet:
        print_net_report(report, plan, min_gbps, out)
    return report


def format_net_report(report: NetReport, plan: Plan, min_gbps: float) -> list[str]:
    lines = [(f"ftbundle check --net: job {plan.job_name}, {shape_text(plan.nprocs, 'host(s)')}, "
              f"threshold {min_gbps:g} Gbit/s")]
    if len(plan.nodes) == 1:
        lines.append("iperf3      one host: no link between hosts to measure")
    for host, gbps in report.throughput_gbps.items():
        lines.append(f"iperf3      {host} -> {report.rank0}: {gbps:.2f} Gbit/s")
    if report.busbw_gbps is not None:
        b = report.bench
        lines.append(f"all-reduce  {b.get('backend')} world {b.get('world')}, {float(b.get('size_mib', 0)):g} MiB x "
                     f"{b.get('iters')}: {float(b.get('time_ms', 0)):.2f} ms each, "
                     f"bus bandwidth {report.busbw_gbps:.2f} Gbit/s ({report.busbw_gbps / 8:.2f} GB/s), "
                     f"algorithm bandwidth {report.algbw_gbps:.2f} Gbit/s")
        if b.get("world") == 1:
            lines.append("            (world size 1: nothing crosses a link; bus bandwidth is 0 by definition)")
    lines += [f"warning: {w}" for w in report.warnings]
    lines += [f"error: {e}" for e in report.errors]
    lines.append(f"network check {'done' if report.ok else 'incomplete'} in {report.seconds:.1f}s")
    return lines


def print_net_report(report: NetReport, plan: Plan, min_gbps: float, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    for line in format_net_report(report, plan, min_gbps):
        print(line, file=out)
    out.flush()
