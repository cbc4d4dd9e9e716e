"""`ftbundle plot`: loss and learning rate of one or more runs."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import UserError
from .common import history_source, say


def cmd_plot(args: argparse.Namespace) -> int:
    """Loss and learning rate of one or more runs (default: the latest)."""
    from ..history import list_runs, read_metrics, read_trainer_logs
    from ..rundir import runs_dir
    from ..plot import plot_png, plot_terminal

    if args.output is not None:
        writable_output(args.output)
    job, layout, cluster, host = history_source(args)
    try:
        rows = list_runs(job.name, layout.shared_dir, cluster, host)
        runs = [row for row in rows if row.hosts]  # (a directory without a plan is no run to plot)
        wanted = args.run or ([runs[-1].run_id] if runs else [])
        if not wanted:
            raise UserError(f"no run of job {job.name!r} in {layout.shared_dir}/runs to plot", file=args.job)
        unknown = [r for r in wanted if r not in {row.run_id for row in rows}]
        if unknown:
            raise UserError(f"no run {unknown[0]!r} of job {job.name!r} in {layout.shared_dir}/runs "
                            "(ftbundle runs lists them)", key="--run")
        metrics = read_metrics(wanted, layout.shared_dir, cluster, host)
        # a run without metrics.jsonl (detached, still running, its launcher lost): its trainer's own log
        unwritten = [r for r in wanted if not any(k == r or k.startswith(f"{r} attempt ") for k in metrics)]
        logs = read_trainer_logs(rows, unwritten, runs_dir(layout.shared_dir), cluster, host)
        for run_id, (path, records) in logs.items():
            say(f"run {run_id} has no metrics.jsonl (detached, still running, or its launcher was lost): "
                f"plotted from {path}")
            metrics[run_id] = records
    finally:
        if cluster is not None:
            cluster.close()
    missing = [r for r in wanted if not any(k == r or k.startswith(f"{r} attempt ") for k in metrics)]
    if len(missing) == len(wanted):
        # (the key only when the user named the run: a flag never given is not to blame)
        raise UserError(f"run {missing[0]} has no training metrics (metrics.jsonl) to plot: its trainer logged no "
                        "step (logging_steps above the steps it trained?)", key="--run" if args.run else None)
    for run_id in missing:
        say(f"run {run_id} has no training metrics; left out")
    if args.output is None and sys.stdout.isatty():
        plot_terminal(metrics, title=job.name)
        return 0
    out = args.output or "loss.png"
    try:
        plot_png(metrics, out, title=job.name)
    except OSError as exc:
        raise UserError(f"cannot write the plot: {exc.strerror or exc}", file=out, key="-o") from None
    print(f"wrote {out}")
    return 0


def writable_output(path: str) -> None:
    """Where ``-o`` writes: a file (or a new name) in a directory that exists and can be written.
    Said before any run is read; a system directory (/proc, /sys) is no place for a PNG."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise UserError(f"{path} is a directory: name the PNG file (e.g. {os.path.join(path, 'loss.png')})",
                        file=path, key="-o")
    if not os.path.isdir(folder):
        raise UserError(f"the directory {folder} does not exist: create it, or write the plot elsewhere",
                        file=path, key="-o")
    if folder == "/proc" or folder.startswith(("/proc/", "/sys/")) or folder == "/sys":
        raise UserError(f"{folder} is a kernel file system, not a place for a file", file=path, key="-o")
    if not os.access(folder, os.W_OK):
        raise UserError(f"cannot write into {folder} (permission denied)", file=path, key="-o")
