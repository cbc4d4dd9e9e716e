"""Benchmark: a chatty rank 0 (NCCL_DEBUG=INFO on 8 ranks prints about this much).

On 2 containerized hosts, rank 0 prints fixed-size lines at a set rate for a set time
(default 1 MB/s, 10,000 lines a second, for 60 s); rank 1 waits as long. ftbundle's stdout
is a pipe this script reads and throws away, as a terminal would. Reported: exit code,
lines in the node log vs lines printed, ftbundle's CPU seconds per MB streamed and its
peak RSS; then the same at a higher rate for 10 MB and 100 MB in all, to show memory stays
flat however much has streamed.

    .venv/bin/python bench/chatty.py [--seconds 60]

On this shared machine the CPU per MB of one run moves a lot with the load (docs/PERFORMANCE.md):
``--compare OTHER_CHECKOUT`` runs only the 1 MB/s x 20 s rows (display and -v), alternating this
checkout's ftbundle with another's (e.g. `git worktree add /tmp/old COMMIT`) on one cluster,
``--pairs`` times, and prints them (docs/PERFORMANCE.md is not written).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common import HOST_PYTHON, measure, table, write_section

from tests.support.cluster import Cluster, ensure_image
from tests.support.helpers import base_job, only_run_dir, write_job

PRINTER = """
import sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])  # lines/s, s
line = 'x' * 89
n, start = 0, time.monotonic()
while time.monotonic() - start < seconds:
    target = int((time.monotonic() - start) * rate)
    while n < target:
        sys.stdout.write(f'{n:09d} {line}\\n'); n += 1
    time.sleep(0.005)
sys.stdout.write(f'total {n}\\n')
"""


def one(cluster: Cluster, shared: Path, tmp: Path, rate: float, seconds: float, verbose: bool = True,
        tree: Path | None = None) -> list:
    """One run; ``verbose``: `-v` (rank 0's raw lines on stdout), else the default progress
    display (rank 0's lines still stream to ftbundle, which reads them for progress).
    ``tree``: the checkout whose ftbundle runs (python -m ftbundle from there)."""
    for old in (shared / "runs").glob("*"):
        shutil.rmtree(old)
    inventory = cluster.write_inventory(tmp / "hosts.yml")
    cmd = (f'if [ "$NODE_RANK" = 0 ]; then {HOST_PYTHON} {shared}/printer.py {rate} {seconds}; '
           f'else sleep {seconds}; fi')
    job = write_job(tmp / "job.yaml", base_job("chatty", shared, inventory, {"command": cmd}))
    shown = [0, b""]

    def count(chunk: bytes) -> None:  # lines of rank 0's output that reached "the terminal"
        lines = (shown[1] + chunk).split(b"\n")
        shown[1] = lines.pop()
        shown[0] += sum(1 for line in lines if line.startswith(b"[node0 r0] 0"))

    m = measure([sys.executable, "-m", "ftbundle", "run", *(["-v"] if verbose else []), str(job), "--no-check"],
                on_stdout=count, cwd=tree)
    log = (only_run_dir(shared) / "node-0-node0.a1.log").read_text().splitlines()
    printed = int(log[-1].split()[1]) if log and log[-1].startswith("total") else -1
    mb = (len(log) - 1) * 100 / 1e6  # (its last line: the printer's total)
    lost = "no heartbeat" in m.stderr.decode()
    return [f"{rate * 100 / 1e6:.1f} MB/s x {seconds:.0f}s", "-v" if verbose else "display", m.code, f"{len(log) - 1} / {printed}",
            f"{mb:.0f}", f"{m.cpu_s:.2f}", f"{m.cpu_s / mb:.3f}" if mb else "-", f"{m.maxrss_mb:.0f}", shown[0] if verbose else "-",
            "yes" if lost else "no"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--compare", type=Path, help="another checkout, alternated with this one (see above)")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    ensure_image()
    if args.compare:
        compare(args.compare.resolve(), args.pairs)
        return
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-chatty-", dir="/tmp"))
    tmp = Path(tempfile.mkdtemp(prefix="ftb-bench-chatty-jobs-"))
    (shared / "printer.py").write_text(PRINTER)
    rows = []
    try:
        with Cluster(2, shared_dir=shared) as cluster:
            rows.append(one(cluster, shared, tmp, 10000, args.seconds))  # 1 MB/s
            rows.append(one(cluster, shared, tmp, 50000, 2))  # 10 MB in all
            rows.append(one(cluster, shared, tmp, 50000, 20))  # 100 MB in all
            rows.append(one(cluster, shared, tmp, 10000, 20, verbose=False))  # the default display
            # the same 20 s with rank 0 silent: ftbundle's fixed work (start, connections, staging,
            # heartbeats, teardown), which the rows above count in their CPU per MB
            rows.append(one(cluster, shared, tmp, 0.001, 20, verbose=False))
            for row in rows:
                print(row, flush=True)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    md = ["## Chatty rank 0 (issue 9)", "",
          "2 containerized hosts; rank 0 prints 100-byte lines; ftbundle's stdout is a pipe read and dropped. "
          "Mode `-v` shows rank 0's raw lines; `display` is the default progress display, which still reads "
          "every line of rank 0 (for its progress). "
          "Targets: exit 0 with every line in the node log, at most 0.3 CPU s per MB, peak RSS at most 200 MB "
          "and flat between 10 MB and 100 MB streamed.", "",
          table(["stream", "mode", "exit", "lines in log / printed", "MB", "ftbundle CPU s", "CPU s per MB",
                 "peak RSS MB", "lines shown on stdout", "declared lost"], rows)]
    display, silent = rows[-2], rows[-1]
    above = (float(display[5]) - float(silent[5])) / float(display[4])
    md += ["", f"The last row is the display row's 20 s with rank 0 silent: ftbundle's own fixed work (start, "
           f"connections, staging, heartbeats, teardown), {silent[5]} CPU s, which every row's CPU per MB counts. "
           f"Above it, streaming rank 0's output to the default display cost {above:.3f} CPU s per MB."]
    write_section("chatty", "\n".join(md))


def compare(other: Path, pairs: int) -> None:
    shared = Path(tempfile.mkdtemp(prefix="ftb-bench-chatty-", dir="/tmp"))
    tmp = Path(tempfile.mkdtemp(prefix="ftb-bench-chatty-jobs-"))
    (shared / "printer.py").write_text(PRINTER)
    rows = []
    try:
        with Cluster(2, shared_dir=shared) as cluster:
            for _ in range(pairs):
                for verbose in (False, True):
                    for name, tree in (("this checkout", None), (str(other), other)):
                        load = os.getloadavg()[0]
                        row = one(cluster, shared, tmp, 10000, 20, verbose=verbose, tree=tree)
                        rows.append([name, f"{load:.1f}"] + row)
                        print(rows[-1], flush=True)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(["ftbundle of", "load (1 min) before", "stream", "mode", "exit", "lines in log / printed", "MB",
                 "ftbundle CPU s", "CPU s per MB", "peak RSS MB", "lines shown on stdout", "declared lost"], rows))


if __name__ == "__main__":
    main()
