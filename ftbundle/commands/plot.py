"""`ftbundle plot`: loss and learning rate of one or more runs."""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from .common import history_source, say


def cmd_plot(args: argparse.Namespace) -> int:
    """Loss and learning rate of one or more runs (default: the latest)."""
    from ..history import list_runs, read_metrics
    from ..plot import plot_png, plot_terminal

    job, layout, cluster = history_source(args)
    try:
        rows = list_runs(job.name, layout.shared_dir, cluster, layout.hosts[0])
        wanted = args.run or ([rows[-1].run_id] if rows else [])
        if not wanted:
            raise UserError(f"no run of job {job.name!r} in {layout.shared_dir}/runs to plot", file=args.job)
        unknown = [r for r in wanted if r not in {row.run_id for row in rows}]
        if unknown:
            raise UserError(f"no run {unknown[0]!r} of job {job.name!r} in {layout.shared_dir}/runs "
                            "(ftbundle runs lists them)", key="--run")
        metrics = read_metrics(wanted, layout.shared_dir, cluster, layout.hosts[0])
    finally:
        if cluster is not None:
            cluster.close()
    missing = [r for r in wanted if r not in metrics]
    if len(missing) == len(wanted):
        raise UserError(f"run {missing[0]} has no training metrics (metrics.jsonl) to plot", key="--run")
    for run_id in missing:
        say(f"run {run_id} has no training metrics; left out")
    if args.output is None and sys.stdout.isatty():
        plot_terminal(metrics, title=job.name)
        return 0
    out = args.output or "loss.png"
    plot_png(metrics, out, title=job.name)
    print(f"wrote {out}")
    return 0
