"""`ftbundle status`, `logs`, `stop` and `stacks`: a run after launch (attached, detached or finished),
found in the job's run directories through one connection per host."""

from __future__ import annotations

import argparse

from ..errors import UserError
from .common import load_layout, open_cluster, say_slow_hosts


def with_run(args: argparse.Namespace, action) -> int:
    """``action(ref, cluster)`` on the run named by ``--run`` (default: the job's latest)."""
    from ..runs import find_run

    job, layout = load_layout(args.job, args.inventory)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys,
                      meanwhile=lambda cluster: say_slow_hosts(cluster, layout.hosts)) as cluster:
        # (through rank 0's host, else the first that answers: a run may have gone on without rank 0's)
        reachable = [h for h in layout.hosts if h.name not in cluster.errors]
        if not reachable:
            raise UserError(f"cannot read the run directory through any host: {cluster.errors_said()}",
                            file=str(job.inventory or job.path))
        hosts = reachable + [h for h in layout.hosts if h.name in cluster.errors]
        ref = find_run(job.name, layout.shared_dir, hosts, args.run, cluster)
        return action(ref, cluster)


def cmd_status(args: argparse.Namespace) -> int:
    from ..runs import print_status

    return with_run(args, print_status)


def cmd_logs(args: argparse.Namespace) -> int:
    from ..runlogs import show_logs

    return with_run(args, lambda ref, cluster: show_logs(ref, cluster, args.rank, args.follow, args.lines,
                                                        all_ranks=args.all))


def cmd_stop(args: argparse.Namespace) -> int:
    from ..runs import stop_run

    return with_run(args, stop_run)


def cmd_stacks(args: argparse.Namespace) -> int:
    from .stacks import show_stacks

    return with_run(args, show_stacks)
