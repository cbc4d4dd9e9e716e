"""`ftbundle check`: every check on every host, launching nothing."""

from __future__ import annotations

import argparse

from ..errors import EXIT_USAGE
from ..plan import make_plan
from .common import load_layout, open_cluster


def cmd_check(args: argparse.Namespace) -> int:
    """Every check on every host, the report on stdout; exit 2 when any fails. With
    --net, the network is measured too, on the job's own plan (slow links are warnings; a
    measurement that could not be made is a failure)."""
    from ..check import print_report, run_checks

    job, layout = load_layout(args.job, args.inventory)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys) as cluster:
        report, facts = run_checks(layout, cluster)
        print_report(report)
        if not report.ok:
            return EXIT_USAGE
        if args.net:
            from ..check.net import run_net_check

            net = run_net_check(make_plan(layout, facts), cluster, min_gbps=args.min_gbps)
            if not net.ok:
                return EXIT_USAGE
    return 0
