"""What the benchmarks share: timing a child process with its own CPU and memory, medians,
and the markdown each benchmark writes for docs/PERFORMANCE.md (`make bench`)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# This interpreter as the hosts reach it (the venv is bind-mounted at its own path there): a
# relative sys.executable (`../.venv/bin/python` from bench/) names nothing on a host.
HOST_PYTHON = os.path.normpath(os.path.abspath(sys.executable))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# FTB_BENCH_OUT: elsewhere (tests/cluster/test_bench_quick.py runs a benchmark without touching bench/out)
OUT_DIR = Path(os.environ.get("FTB_BENCH_OUT") or REPO / "bench" / "out")


@dataclass
class Measured:
    wall_s: float
    cpu_s: float  # user + system of the child (and what it waited for)
    maxrss_mb: float
    code: int
    stdout: bytes = b""
    stderr: bytes = b""
    self_cpu_s: float = 0.0  # the child's own CPU, without its children (sampled from /proc)
    threads: int = 0  # the child's peak thread count (sampled every 50 ms)
    fds: int = 0  # the child's peak count of open file descriptors (sampled)


def measure(argv: list[str], *, env: dict | None = None, on_start=None, on_stdout=None, cwd=None) -> Measured:
    """Run ``argv`` to its end; wall time, the child's own CPU seconds (wait4) and peak RSS.

    Peak RSS is the child's VmHWM from /proc, read until it exits, not wait4's ru_maxrss:
    Linux starts a child's maxrss at its parent's RSS at fork, so a benchmark holding a big
    buffer would be charged to the next child it starts. ``on_start(proc)`` runs once the
    child is started; ``on_stdout(chunk)``, when given, gets stdout instead of keeping it."""
    import threading

    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=cwd or REPO)
    bufs: dict[str, list[bytes]] = {"out": [], "err": []}

    def pump(stream, sink):
        for chunk in iter(lambda: stream.read1(65536), b""):
            sink.append(chunk)

    class Sink(list):
        def append(self, chunk):
            on_stdout(chunk)

    hwm = [0]
    peaks = {"threads": 0, "fds": 0}
    own_cpu = [0.0]
    done = threading.Event()
    tick = os.sysconf("SC_CLK_TCK")

    def watch_memory():
        path = f"/proc/{proc.pid}/status"
        while not done.is_set():
            try:
                for line in open(path):
                    if line.startswith("VmHWM:"):
                        hwm[0] = max(hwm[0], int(line.split()[1]))
                    elif line.startswith("Threads:"):
                        peaks["threads"] = max(peaks["threads"], int(line.split()[1]))
                peaks["fds"] = max(peaks["fds"], len(os.listdir(f"/proc/{proc.pid}/fd")))
                # utime and stime (fields 14, 15 of stat): this process alone, not its children
                fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
                own_cpu[0] = max(own_cpu[0], (int(fields[11]) + int(fields[12])) / tick)
            except (OSError, ValueError, IndexError):
                pass
            done.wait(0.05)

    readers = [threading.Thread(target=pump, args=(proc.stdout, Sink() if on_stdout else bufs["out"]), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, bufs["err"]), daemon=True),
               threading.Thread(target=watch_memory, daemon=True)]
    for t in readers:
        t.start()
    if on_start is not None:
        on_start(proc)
    # the memory watcher reads until the child is a zombie (its /proc entry then has no VmHWM)
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in readers:
        t.join(10)
    return Measured(wall, usage.ru_utime + usage.ru_stime, hwm[0] / 1024, proc.returncode,
                    b"".join(bufs["out"]), b"".join(bufs["err"]), own_cpu[0], peaks["threads"], peaks["fds"])


def median(values) -> float:
    return statistics.median(values)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))) / 1024 / 1024
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {os.uname().sysname} {os.uname().release}"


def write_section(name: str, markdown: str, rerun: str | None = None) -> Path:
    """One benchmark's section of docs/PERFORMANCE.md (bench/report.py puts them together)."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.md"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    # the machine is shared: how loaded it was tells how far the absolute figures can be trusted
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    path.write_text(markdown.rstrip() + f"\n\n_measured {stamp}, load average (1/5/15 min) at the end "
                    f"{load}; rerun: `.venv/bin/python {rerun or f'bench/{name}.py'}`_\n")
    print(markdown)
    return path


def first_failure(stderr: str) -> str:
    """The line of ftbundle's failure summary that names the node that failed first (or says
    every node was lost at once); "" when there is none."""
    return next((line.strip() for line in stderr.splitlines()
                 if "failed first" in line or "lost every node" in line), "")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
