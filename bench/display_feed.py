"""Benchmark: what the default display costs per MB of rank 0's output, without the network.

bench/chatty.py measures ftbundle's whole CPU while a node prints 1 MB/s over SSH; most of
that is the SSH transport's, and it moves with the machine's load (2026-11-27, the same code:
0.03 to 0.14 CPU s per MB from one run to the next). This measures the display's own work
alone, in this process: rank 0's bytes in 32 KB chunks (as the log channel hands them) through
the runner's line splitter, the progress feed, the progress state and the plain display, as
`ftbundle run` without -v does. Rows: the chatty printer's 100-byte lines (nothing a trainer
says: every line is looked at and let go), and the recorded LlamaFactory run
(tests/data/llamafactory) repeated to the same size.

    .venv/bin/python bench/display_feed.py [--mb 20] [--compare OTHER_CHECKOUT]

``--compare``: the same measured with another checkout's ftbundle (e.g. an older commit:
`git worktree add /tmp/old COMMIT`), each in a child process, alternated, in one run.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, table

RECORDED = REPO / "tests" / "data" / "llamafactory" / "cpu-3steps.node-0.log"
CHUNK = 32 * 1024


def workloads(mb: float) -> dict[str, bytes]:
    size = int(mb * 1e6)
    chatty = "".join(f"{n:09d} {'x' * 89}\n" for n in range(size // 100)).encode()
    log = RECORDED.read_bytes()
    return {"chatty 100-byte lines": chatty, "recorded LlamaFactory log": (log * (size // len(log) + 1))[:size]}


def measure_here(data: bytes) -> float:
    """CPU seconds to feed ``data`` through the display path of the ftbundle on sys.path."""
    from ftbundle.launch.display import ProgressFeed
    from ftbundle.launch.node import LineSplitter
    from ftbundle.ui.phases import Phases
    from ftbundle.ui.progress import Progress

    ui = Phases(io.StringIO(), tty=False, nnodes=2)
    progress = Progress(effective_batch=8, from_jsonl=True)
    ui.launching(2, 2)
    ui.training(progress, 2)
    feed = ProgressFeed(ui, progress, lambda: ui.training(progress, 2))  # (the supervisor's _show_progress)
    prefix = "[node0 r0] "
    splitter = LineSplitter(lambda line: feed.line(prefix + line), lambda line: feed.progress(prefix + line))
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    start = time.process_time()
    for chunk in chunks:
        splitter.feed(chunk)
    splitter.close()
    return time.process_time() - start


def child(tree: str, mb: float) -> dict[str, float]:
    """CPU s per MB for each workload, measured in a child importing ``tree``'s ftbundle."""
    out = subprocess.run([sys.executable, __file__, "--child", tree, "--mb", str(mb)], capture_output=True,
                         text=True, check=True, cwd=tree)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=20)
    parser.add_argument("--compare", help="another checkout, measured the same way in the same run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, args.child)
        print(json.dumps({name: measure_here(data) / args.mb for name, data in workloads(args.mb).items()}))
        return
    trees = {"this checkout": str(REPO)}
    if args.compare:
        trees[args.compare] = str(Path(args.compare).resolve())
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):  # alternated: a busy moment of the machine falls on both
        for name, tree in trees.items():
            runs[name].append(child(tree, args.mb))
    rows = []
    for workload in workloads(0.001):
        mine = statistics.median(r[workload] for r in runs["this checkout"])
        row = [workload, f"{args.mb:.0f}", f"{mine:.4f}"]
        if args.compare:
            other = statistics.median(r[workload] for r in runs[args.compare])
            row += [f"{other:.4f}", f"{mine / other:.2f}"]
        rows.append(row)
    head = ["rank 0's output", "MB", "CPU s per MB (this checkout)"]
    if args.compare:
        head += [f"CPU s per MB ({args.compare})", "ratio"]
    print(table(head, rows))
    print(f"\nmedians of {args.rounds} alternated rounds; load average at the end "
          + " / ".join(f"{x:.1f}" for x in __import__("os").getloadavg()))


if __name__ == "__main__":
    main()
