"""`ftbundle run`: the one-way flow of a launch, top to bottom.

job + hosts -> layout (:func:`~.common.load_layout`) -> facts (the check, or a short probe
when the plan needs them) -> plan (:func:`~ftbundle.plan.make_plan`) -> launch (stage the
run directory, start every node, supervise) -> report (the closing summary). The display
(:class:`ftbundle.ui.Phases`) is handed down explicitly; its messages replace the plain
``ftbundle: ...`` lines while it is shown.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ..errors import UserError
from ..job import Job, is_secret
from ..layout import Layout
from ..plan import Plan, make_plan
from .common import load_layout, open_cluster, refuse_contradictions, say


def needs_facts(layout: Layout) -> bool:
    """The plan cannot be made from the files alone: ``auto`` ranks, or the docker runtime
    with no image but the one site.yml recorded on the hosts."""
    return layout.needs_gpu_counts or (layout.docker and layout.image is None)


def _say(ui, message: str) -> None:
    if ui is not None:
        ui.say(message)
    else:
        say(message)


def checked_plan(layout: Layout, cluster, *, skip_check: bool = False, ui=None, stage: bool = True):
    """(the plan to launch, what the check left on rank 0's host for staging to remove, the
    hosts' facts or None, the layout with its staged copies).

    The hosts are checked first unless the job says `check: false` or ``skip_check``;
    their facts resolve ``auto``, the docker runtime's GPUs and image, bf16 and whether
    output_dir is shared. A failed check is a UserError: nothing has been started anywhere.
    The check's sentinel directories on rank 0's host go in staging's own command (one
    round trip for both); any on other hosts go now."""
    job = layout.job
    check = job.check and not skip_check
    facts = None
    leftovers: tuple[str, ...] = ()
    if check:
        from ..check import claimed, clean_up, print_report, run_checks, sentinel_cleanup

        report, facts = run_checks(layout, cluster, keep_sentinels=True, claim=True,
                                   on_progress=ui.checking if ui is not None else None,
                                   on_hashing=ui.hashing if ui is not None else say)
        cluster.wait_open()  # (a cluster still connecting when the check began: every host tried by now)
        if ui is not None:
            ui.stop()
        sentinels = sentinel_cleanup(layout, facts)
        if not report.ok:  # (the claims this run took on its hosts go with its sentinels)
            clean_up(cluster, sentinels + claimed(layout, facts))
            print_report(report, sys.stderr)
            raise UserError(f"{len(report.failures)} problem(s) found on the hosts before launch (see above); "
                            "nothing was started. Fix them, or set 'check: false' in the job to skip the check",
                            file=str(job.path), key="check")
        rank0 = layout.hosts[0].name
        leftovers = tuple(d for h, dirs in sentinels if h.name == rank0 for d in dirs)
        clean_up(cluster, [(h, dirs) for h, dirs in sentinels if h.name != rank0])
        _say(ui, f"check passed: {len(layout.hosts)} host(s) alike and ready ({len(report.checks)} checks, "
                 f"{report.seconds:.1f}s)")
        for warning in report.warnings:
            _say(ui, f"warning: {warning}")
    else:
        if cluster.errors:
            raise UserError("cannot reach every host, nothing was started: " + cluster.errors_said(),
                            file=str(job.inventory or job.path), key="hosts")
        if needs_facts(layout):
            from ..check import probe_hosts

            facts = probe_hosts(layout, cluster, full=False)
            lost = [f"{f.host}: {f.error}" for f in facts.hosts if f.error]
            if lost:
                raise UserError("cannot ask every host, nothing was started: " + "; ".join(lost),
                                file=str(job.inventory or job.path), key="hosts")
    if stage:
        layout = with_staged(layout, cluster, ui)
    return make_plan(layout, facts), leftovers, facts, layout


def with_staged(layout: Layout, cluster, ui=None) -> Layout:
    """The job's ``stage:`` copied to every host of the layout (ftbundle/stage.py; what a host
    holds already is not copied again), and the layout pointing LlamaFactory at the copies. A
    host that cannot take its copy stops the run before anything starts (exit 2, named)."""
    if not layout.job.stage:
        return layout
    import dataclasses

    from ..stage import StageError, stage_all, staged_keys

    try:
        staged = stage_all(layout, cluster, say=lambda m: _say(ui, m),
                           on_hashing=(lambda m: ui.hashing(m)) if ui is not None and hasattr(ui, "hashing") else None)
    except StageError as exc:
        raise UserError(f"staging failed, nothing was started: {exc}", file=str(layout.job.path), key="stage") from None
    return dataclasses.replace(layout, staged=staged_keys(staged),
                               stage_record=tuple(s.record() for s in staged.values()))


def _launch_imports(layout: Layout, *, skip_check: bool) -> None:
    """What a launch needs after the connections: imported while they are being made (the
    check's modules only when it runs: about 4 ms that a `--no-check` start does not pay)."""
    from .. import launch, ui  # noqa: F401

    if (layout.job.check and not skip_check) or needs_facts(layout):
        from .. import check  # noqa: F401


def format_plan(plan: Plan) -> str:
    """Human-readable --dry-run output: per host, where, what and with which environment."""
    lines = [
        f"job {plan.job_name}  run {plan.run_id}",
        f"world size {plan.world_size} = {plan.shape}; "
        f"master {plan.master_addr}:{plan.master_port}",
        f"run directory {plan.run_dir}",
    ]
    lines += plan.notes
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    for node in plan.nodes:
        where = "local process" if node.host.local else (
            f"ssh {node.host.user + '@' if node.host.user else ''}{node.host.address}:{node.host.port}")
        lines.append("")
        lines.append(f"node rank {node.rank}  {node.host.name}  ({where})  {node.nproc} rank(s): global "
                     + (f"{node.first_rank}-{node.first_rank + node.nproc - 1}" if node.nproc > 1 else f"{node.first_rank}"))
        lines.append(f"  cd {node.workdir}")
        if node.env_file:
            lines.append(f"  env file {node.env_file} (if present)")
        for key, value in node.env.items():
            lines.append(f"  {key}={'<redacted>' if is_secret(key) else plan.redact(value)}")
        lines.append(f"  {plan.redact(shlex.join(node.argv))}")
        lines.append(f"  log {node.log_path}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    job, layout = load_layout(args.job, args.inventory)
    refuse_contradictions(job, layout, args.inventory)
    if args.detach and job.restarts:
        raise UserError(f"restarts: {job.restarts} needs ftbundle to stay and supervise the run; --detach cannot "
                        "restart nodes. Drop --detach, or set restarts: 0 for a detached run",
                        file=str(job.path), key="restarts")
    if args.dry_run and not needs_facts(layout):
        print(format_plan(make_plan(layout)))
        return 0
    checking = job.check and not args.no_check and not args.dry_run  # (its probes start as their hosts connect)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys, wait=not checking,
                      meanwhile=lambda _: _launch_imports(layout, skip_check=args.no_check)) as cluster:
        if args.dry_run:  # starts nothing; the hosts are asked (read-only) what the plan needs
            plan, _, _, _ = checked_plan(layout, cluster, skip_check=True, stage=False)
            print(format_plan(plan))
            return 0
        from ..ui import Phases

        # -v: rank 0's raw output on stdout, so the phases are plain lines (no live line to fight it)
        ui = Phases(sys.stderr, tty=False if args.verbose else None, nnodes=len(layout.hosts))
        try:
            plan, leftovers, facts, layout = checked_plan(layout, cluster, skip_check=args.no_check, ui=ui)
            resume = starting_point(plan, cluster, str(job.path), leftovers)
            policy = node_loss_policy(layout, cluster, facts, args.inventory, ui=ui, skip_check=args.no_check)
            return launch_plan(job, plan, cluster, detach=args.detach, job_file=args.job, verbose=args.verbose,
                               leftovers=leftovers, ui=ui, resume=resume, policy=policy)
        finally:
            ui.stop()


def node_loss_policy(layout: Layout, cluster, facts, inventory: str | None, *, ui=None, skip_check: bool = False):
    """What the launch loop needs for the job's ``on_node_loss`` (:mod:`ftbundle.launch.attempts`):
    a plan from another layout (these facts in it), and for ``spare`` the spares group's hosts
    and their preflight, the same check a launch runs. None for ``stop``."""
    job = layout.job
    if job.on_node_loss == "stop":
        return None
    from ..launch import Policy

    known = {"facts": facts}

    def replan(other: Layout) -> Plan:
        return make_plan(other, known["facts"])

    def spares() -> list:
        from ..inventory import load_hosts

        source = inventory or job.inventory
        if source is None:
            return []
        try:
            return load_hosts(source, job.spares)
        except UserError as exc:
            _say(ui, f"no spare: group {job.spares}: {exc}")
            return []

    def preflight(candidate: Layout, hosts: list) -> dict[str, int]:
        cluster.open(hosts)
        unreachable = [h.name for h in hosts if h.name in cluster.errors]
        if unreachable:
            _say(ui, f"spare {', '.join(unreachable)} cannot be reached: " + cluster.errors_said())
            return {}
        try:
            if job.check and not skip_check:
                from ..check import print_report, run_checks

                report, found = run_checks(candidate, cluster)
                if not report.ok:
                    print_report(report, sys.stderr)
                    return {}
            elif needs_facts(candidate):
                from ..check import probe_hosts

                found = probe_hosts(candidate, cluster, full=False)
            else:
                found = None
            plan = make_plan(with_staged(candidate, cluster, ui), found)  # (a spare gets its copies)
        except UserError as exc:
            _say(ui, f"the spares' preflight: {exc}")
            return {}
        known["facts"] = found
        names = {h.name for h in hosts}
        return {n.host.name: n.nproc for n in plan.nodes if n.host.name in names}

    return Policy(job=job, layout=layout, replan=replan, spares=spares, preflight=preflight)


def starting_point(plan: Plan, cluster, job_path: str, leftovers: tuple[str, ...] = ()):
    """Where a LlamaFactory run starts in its output_dir (the newest checkpoint, read on
    rank 0's host), or None. A finished training is refused (exit 2) with nothing started,
    the check's leftovers removed."""
    from ..launch.resume import read_resume_state, refuse_finished

    resume = read_resume_state(plan, cluster)
    if resume is not None and resume.finished:
        if leftovers:
            from ..check import clean_up

            clean_up(cluster, [(plan.nodes[0].host, list(leftovers))])
        refuse_finished(resume, job_path)
    return resume


def with_tracker_runs(plan: Plan, resume, ui=None) -> Plan:
    """A run resuming another's checkpoint logs on into that run's MLflow and W&B runs: their
    record is staged as this run's trackers.json (rank 0's entry continues what it names)."""
    import dataclasses
    import json

    from ..rundir import TRACKER_RUNS
    from ..trackers import continued, continuing

    record = continued(resume.tracker_runs, resume.written_by) if resume.checkpoint and resume.written_by else None
    if record is None:
        return plan
    _say(ui, continuing(record))
    return dataclasses.replace(plan, files={**plan.files, TRACKER_RUNS: json.dumps(record, indent=1)})


def launch_plan(job: Job, plan: Plan, cluster, *, detach: bool, job_file: str, verbose: bool = True,
                leftovers: tuple[str, ...] = (), ui=None, resume=None, policy=None) -> int:
    """Stage the run directory (removing ``leftovers`` on rank 0's host in the same round
    trip) while the node channels open, then run or detach."""
    from ..launch import StagingError, launch, launch_detached, stage_run_dir

    _say(ui, f"run {plan.run_id}: {plan.shape}, logs in {plan.run_dir}")
    if resume is not None:
        for line in resume.cleaned:
            _say(ui, line)
        if resume.announcement():
            _say(ui, resume.announcement())
        plan = with_tracker_runs(plan, resume, ui)
    for note in plan.notes:
        _say(ui, note)
    for warning in plan.warnings:
        _say(ui, f"warning: {warning}")
    if ui is not None:
        ui.staging()

    def stage() -> None:
        stage_run_dir(cluster, plan, leftovers, detach=detach)

    try:
        if not detach:
            return launch(plan, cluster, restarts=job.restarts, ui=ui, verbose=verbose, before=stage,
                          start_step=resume.step if resume is not None else 0, policy=policy)
        if ui is not None:
            ui.stop()
        code = launch_detached(plan, cluster, before=stage)
    except StagingError as exc:
        if ui is not None:
            ui.stop()
        _say(ui, f"error: {exc}; nothing was started")
        return 2 if exc.refused else 1
    if code == 0:
        _say(ui, f"run {plan.run_id} started on all {plan.nnodes} node(s) and detached; follow it with\n"
                 f"  ftbundle status {job_file} --run {plan.run_id}\n"
                 f"  ftbundle logs {job_file} --run {plan.run_id} -f\n"
                 f"  ftbundle stop {job_file} --run {plan.run_id}")
    return code
