"""`ftbundle runs`: past runs of a job from its run directories."""

from __future__ import annotations

import argparse

from .common import history_source


def cmd_runs(args: argparse.Namespace) -> int:
    """Past runs of the job from its run directories: a table, or JSON with --json."""
    from ..history import format_runs, list_runs, runs_json

    job, layout, cluster, host = history_source(args)
    try:
        rows = list_runs(None if args.all else job.name, layout.shared_dir, cluster, host)
    finally:
        if cluster is not None:
            cluster.close()
    if args.last is not None:  # (oldest first: the newest N are the table's last N lines)
        rows = rows[-args.last:]
    if args.json:
        print(runs_json(rows))
    elif not rows:
        print(f"no runs of {job.name} in {layout.shared_dir}/runs yet")
    else:
        print(format_runs(rows))
    return 0
