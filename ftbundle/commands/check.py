"""`ftbundle check`: every check on every host, launching nothing."""

from __future__ import annotations

import argparse

from ..errors import EXIT_USAGE, UserError
from ..plan import make_plan
from .common import load_layout, open_cluster, refuse_contradictions, say


def cmd_check(args: argparse.Namespace) -> int:
    """Every check on every host, the report on stdout; exit 2 when any fails. With
    --net, the network is measured too, on the job's own plan; with --burn-in, every host
    is loaded at once and compared with the fleet's median (slow links and slow hosts are
    warnings; a measurement that could not be made is a failure)."""
    from ..check import print_report, run_checks

    for flag, value, needs, given in (("--slow-below", args.slow_below, "--burn-in", args.burn_in),
                                      ("--min-gbps", args.min_gbps, "--net", args.net or None)):
        if value is not None and given is None:  # (it judges figures only that measurement makes)
            raise UserError(f"{flag} only applies with {needs}: add {needs}, or drop {flag}", key=flag)
    job, layout = load_layout(args.job, args.inventory)
    refuse_contradictions(job, layout, args.inventory)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys, wait=False) as cluster:
        report, facts = run_checks(layout, cluster, on_hashing=say)  # (its probes start as their hosts connect)
        cluster.wait_open()
        plan = make_plan(layout, facts) if report.ok else None
        if plan is not None:
            said = output_dir_check(plan, cluster)
            if said is not None:
                report.checks.append(said)
            from ..stage import cache_check

            staged = cache_check(layout, cluster, on_hashing=say)  # (which hosts hold the copies `stage:` makes)
            if staged is not None:
                report.checks.append(staged)
        print_report(report)
        if plan is not None and (plan.notes or plan.warnings):  # (what `run` says before it starts, said now)
            print("before it starts, `ftbundle run` would say:")
            for line in [*plan.notes, *(f"warning: {w}" for w in plan.warnings)]:
                print(f"  {line}")
        if not report.ok:
            not_run = [flag for flag, asked in (("--net", args.net), ("--burn-in", args.burn_in is not None)) if asked]
            if not_run:  # (a host that fails the check is never left out of a measurement in silence)
                failed = [c for c in report.checks if not c.ok]
                say(f"{' and '.join(not_run)} not run: the check failed first ({'; '.join(c.failure for c in failed)}); "
                    "nothing was loaded or measured on any host. Fix it, or take the host(s) out of the job's "
                    "hosts, and check again")
            return EXIT_USAGE
        failed = False
        net_figures = None
        if args.net:
            from ..check.net import run_net_check

            net = run_net_check(plan, cluster, min_gbps=10.0 if args.min_gbps is None else args.min_gbps)
            failed = not net.ok
            net_figures = {"throughput_gbps": net.throughput_gbps, "rank0": net.rank0, "busbw_gbps": net.busbw_gbps,
                           "algbw_gbps": net.algbw_gbps, "allreduce": net.bench, "warnings": net.warnings}
        if args.burn_in is not None:
            from ..check.burnin import DEFAULT_SLOW_BELOW, run_burnin

            slow_below = DEFAULT_SLOW_BELOW if args.slow_below is None else args.slow_below
            burnin = run_burnin(plan, cluster, seconds=args.burn_in, slow_below=slow_below, net=net_figures)
            failed = failed or not burnin.ok
    return EXIT_USAGE if failed else 0


def output_dir_check(plan, cluster):
    """What `run` will find in a LlamaFactory job's output_dir, read on rank 0's host without
    removing anything: a finished training fails the check as `run` refuses it; a checkpoint
    to resume from is said. None for a fresh output_dir or a job that does not resume."""
    from ..check.rules import Check
    from ..launch.resume import FRESH_OR_OVERWRITE, finished_words, read_resume_state

    state = read_resume_state(plan, cluster, look=True)
    if state is None or not (state.finished or state.checkpoint):
        return None
    host = [plan.nodes[0].host.name]
    notes = list(state.cleaned)
    if state.finished:
        return Check("output_dir holds a finished training", [(f"{state.output_dir}: finished", host)],
                     failure="output_dir holds a finished training",
                     details=[f"{finished_words(state)}: `run` would refuse it. Either {FRESH_OR_OVERWRITE}"],
                     notes=notes, label="training")
    from ..trackers import continued, continuing

    record = continued(state.tracker_runs, state.written_by) if state.written_by else None
    notes += [continuing(record)] if record else []
    return Check("training", [(state.announcement() or "", host)], notes=notes, label="training")
