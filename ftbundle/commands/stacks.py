"""`ftbundle stacks JOB [--run RUN]`: where every rank of a running job is, without stopping it.

The same collection and grouped view the stall watchdog prints before it stops a run
(:mod:`ftbundle.launch.stall`), on demand: from another terminal beside an attached run,
or for a detached one. py-spy reads each rank from outside (``--nonblocking``): the ranks
are not paused, and the run goes on.
"""

from __future__ import annotations

import sys

from ..cluster import Cluster
from ..launch.stall import Target, collect, diagnose, report_lines, stacks_dir
from ..runs import RunRef


def targets_of(ref: RunRef) -> list[Target]:
    by_rank = {entry["rank"]: entry for entry in ref.record.get("nodes", [])}
    targets = []
    for node in ref.nodes:
        prepend = by_rank.get(node.rank, {}).get("path_prepend")
        targets.append(Target(node.rank, node.host, ref.files(node).marker, node.container,
                              (prepend,) if prepend else (), node.per_node))
    return targets


def show_stacks(ref: RunRef, cluster: Cluster, out=None) -> int:
    """The grouped view on stdout; exit 1 when no rank of the run is running."""
    out = out or sys.stdout
    out_dir = stacks_dir(ref.run_dir, f"a{ref.attempt}-ondemand")
    ranks, problems = collect(cluster, targets_of(ref), out_dir)
    expected = sum(n.nproc for n in ref.nodes) or None
    print(f"run {ref.run_id}" + (f", attempt {ref.attempt}" if ref.attempt > 1 else "")
          + f": {len(ranks)} rank(s) found", file=out)
    if not ranks:
        for problem in problems:
            print(f"  could not ask {problem}", file=out)
        print("no rank of this run is running", file=out)
        return 1
    for line in report_lines(diagnose(ranks), out_dir=out_dir, expected=expected, problems=problems, stalled=False):
        print(line, file=out)
    return 0
