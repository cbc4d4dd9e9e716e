"""The `ftbundle` command line: parse flags, load job and inventory, hand over to the core.

User mistakes (:class:`UserError`) become one clear message and exit code 2, before
anything is started anywhere.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import secrets
import shlex
import signal
import sys
import time

from . import __version__
from .errors import EXIT_USAGE, UserError
from .inventory import Host, load_hosts, localhost_only
from .job import Job, is_secret, load_job
from .plan import Layout, Plan, make_layout, make_plan


def new_run_id(job_name: str) -> str:
    return f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def resolve_hosts(job: Job, inventory: str | None) -> list[Host]:
    """`-i` wins over the job's `inventory:`; with neither, this machine alone."""
    source = inventory or job.inventory
    if source is None:
        if job.hosts not in ("all", "localhost"):
            raise UserError(f"hosts: {job.hosts!r} needs an inventory (job key 'inventory' or -i)",
                            file=str(job.path), key="hosts")
        return localhost_only()
    return load_hosts(source, job.hosts)


def load_layout(job_path: str, inventory: str | None) -> tuple[Job, Layout]:
    """The job file and the inventory, read once: what runs where, before the hosts are asked."""
    job = load_job(job_path)
    return job, make_layout(job, resolve_hosts(job, inventory), new_run_id(job.name))


def needs_facts(layout: Layout) -> bool:
    """The plan cannot be made from the files alone: ``auto`` ranks, or the docker runtime
    with no image but the one site.yml recorded on the hosts."""
    return layout.job.nproc_per_node == "auto" or (layout.docker and layout.image is None)


def checked_plan(layout: Layout, cluster, *, skip_check: bool = False, on_host=None) -> tuple[Plan, tuple[str, ...]]:
    """The plan to launch, and what the check left on rank 0's host for staging to remove.

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
        from .check import clean_up, print_report, run_checks, sentinel_cleanup

        report, facts = run_checks(layout, cluster, keep_sentinels=True, on_progress=on_host)
        if _UI is not None:
            _UI.stop()
        sentinels = sentinel_cleanup(layout, facts)
        if not report.ok:
            clean_up(cluster, sentinels)
            print_report(report, sys.stderr)
            raise UserError(f"{len(report.failures)} problem(s) found on the hosts before launch (see above); "
                            "nothing was started. Fix them, or set 'check: false' in the job to skip the check",
                            file=str(job.path), key="check")
        rank0 = layout.hosts[0].name
        leftovers = tuple(d for h, dirs in sentinels if h.name == rank0 for d in dirs)
        clean_up(cluster, [(h, dirs) for h, dirs in sentinels if h.name != rank0])
        say(f"check passed: {len(layout.hosts)} host(s) alike and ready ({len(report.checks)} checks, "
            f"{report.seconds:.1f}s)")
        for warning in report.warnings:
            say(f"warning: {warning}")
    else:
        if cluster.errors:
            raise UserError("cannot reach every host, nothing was started: " + "; ".join(cluster.errors.values()),
                            file=str(job.inventory or job.path), key="hosts")
        if needs_facts(layout):
            from .check import probe_hosts

            facts = probe_hosts(layout, cluster, full=False)
            lost = [f"{f.host}: {f.error}" for f in facts.hosts if f.error]
            if lost:
                raise UserError("cannot ask every host, nothing was started: " + "; ".join(lost),
                                file=str(job.inventory or job.path), key="hosts")
    return make_plan(layout, facts), leftovers


def open_cluster(hosts, *, accept_new_host_keys: bool = False, meanwhile=None):
    """One connection to every host, opened at once. ``meanwhile`` runs here while the
    handshakes wait on the network (the launch path imports what it needs next)."""
    from .cluster import Cluster

    cluster = Cluster(hosts, accept_new_host_keys=accept_new_host_keys)
    if meanwhile is None:
        return cluster.open()
    cluster.open(background=True)
    try:
        meanwhile()
    finally:
        cluster.wait_open()
    return cluster


def _launch_imports(layout: Layout, *, skip_check: bool) -> None:
    """What a launch needs after the connections: imported while they are being made (the
    check's modules only when it runs: about 4 ms that a `--no-check` start does not pay)."""
    from . import launch, ui  # noqa: F401

    if (layout.job.check and not skip_check) or needs_facts(layout):
        from . import check  # noqa: F401


def format_plan(plan: Plan) -> str:
    """Human-readable --dry-run output: per host, where, what and with which environment."""
    lines = [
        f"job {plan.job_name}  run {plan.run_id}",
        f"world size {plan.world_size} = {plan.nnodes} node(s) x {plan.nproc_per_node} rank(s); "
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
        lines.append(f"rank {node.rank}  {node.host.name}  ({where})")
        lines.append(f"  cd {node.workdir}")
        if node.env_file:
            lines.append(f"  env file {node.env_file} (if present)")
        for key, value in node.env.items():
            lines.append(f"  {key}={'<redacted>' if is_secret(key) else plan.redact(value)}")
        lines.append(f"  {plan.redact(shlex.join(node.argv))}")
        lines.append(f"  log {node.log_path}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    global _UI
    job, layout = load_layout(args.job, args.inventory)
    if args.detach and job.restarts:
        raise UserError(f"restarts: {job.restarts} needs ftbundle to stay and supervise the run; --detach cannot "
                        "restart nodes. Drop --detach, or set restarts: 0 for a detached run",
                        file=str(job.path), key="restarts")
    if args.dry_run and not needs_facts(layout):
        print(format_plan(make_plan(layout)))
        return 0
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys,
                      meanwhile=lambda: _launch_imports(layout, skip_check=args.no_check)) as cluster:
        if args.dry_run:  # starts nothing; the hosts are asked (read-only) what the plan needs
            plan, _ = checked_plan(layout, cluster, skip_check=True)
            print(format_plan(plan))
            return 0
        from .ui import Phases

        # -v: rank 0's raw output on stdout, so the phases are plain lines (no live line to fight it)
        _UI = Phases(sys.stderr, tty=False if args.verbose else None, nnodes=len(layout.hosts))
        try:
            plan, leftovers = checked_plan(layout, cluster, skip_check=args.no_check, on_host=_UI.checking)
            return launch_plan(job, plan, cluster, detach=args.detach, job_file=args.job, verbose=args.verbose,
                               leftovers=leftovers)
        finally:
            _UI.stop()
            _UI = None


def launch_plan(job: Job, plan: Plan, cluster, *, detach: bool, job_file: str, verbose: bool = True,
                leftovers: tuple[str, ...] = ()) -> int:
    """Stage the run directory (removing ``leftovers`` on rank 0's host in the same round
    trip) while the node channels open, then run or detach."""
    from .launch import StagingError, launch, launch_detached, stage_run_dir

    say(f"run {plan.run_id}: {plan.nnodes} node(s) x {plan.nproc_per_node} rank(s), logs in {plan.run_dir}")
    for note in plan.notes:
        say(note)
    for warning in plan.warnings:
        say(f"warning: {warning}")
    if _UI is not None:
        _UI.staging()

    def stage() -> None:
        stage_run_dir(cluster, plan, leftovers)

    try:
        if not detach:
            return launch(plan, cluster, restarts=job.restarts, ui=_UI, verbose=verbose, before=stage)
        if _UI is not None:
            _UI.stop()
        code = launch_detached(plan, cluster, before=stage)
    except StagingError as exc:
        if _UI is not None:
            _UI.stop()
        say(f"error: {exc}; nothing was started")
        return 1
    if code == 0:
        say(f"run {plan.run_id} started on all {plan.nnodes} node(s) and detached; follow it with\n"
            f"  ftbundle status {job_file} --run {plan.run_id}\n"
            f"  ftbundle logs {job_file} --run {plan.run_id} -f\n"
            f"  ftbundle stop {job_file} --run {plan.run_id}")
    return code


def cmd_check(args: argparse.Namespace) -> int:
    """Every check on every host, the report on stdout; exit 2 when any fails. With
    --net, the network is measured too, on the job's own plan (slow links are warnings; a
    measurement that could not be made is a failure)."""
    from .check import print_report, run_checks

    job, layout = load_layout(args.job, args.inventory)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys) as cluster:
        report, facts = run_checks(layout, cluster)
        print_report(report)
        if not report.ok:
            return EXIT_USAGE
        if args.net:
            from .check.net import run_net_check

            net = run_net_check(make_plan(layout, facts), cluster, min_gbps=args.min_gbps)
            if not net.ok:
                return EXIT_USAGE
    return 0


def with_run(args: argparse.Namespace, action) -> int:
    """``action(ref, cluster)`` on the run named by ``--run`` (default: the job's latest)."""
    from .runs import find_run

    job, layout = load_layout(args.job, args.inventory)
    with open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys) as cluster:
        if layout.hosts[0].name in cluster.errors:
            raise UserError(f"cannot read the run directory through rank 0's host: "
                            f"{cluster.errors[layout.hosts[0].name]}", file=str(job.inventory or job.path))
        ref = find_run(job.name, layout.shared_dir, list(layout.hosts), args.run, cluster)
        return action(ref, cluster)


def cmd_status(args: argparse.Namespace) -> int:
    from .runs import print_status

    return with_run(args, print_status)


def cmd_logs(args: argparse.Namespace) -> int:
    from .runs import show_logs

    return with_run(args, lambda ref, cluster: show_logs(ref, cluster, args.rank, args.follow, args.lines))


def cmd_stop(args: argparse.Namespace) -> int:
    from .runs import stop_run

    return with_run(args, stop_run)


def cmd_stacks(args: argparse.Namespace) -> int:
    from .commands.stacks import show_stacks

    return with_run(args, show_stacks)


def cmd_export(args: argparse.Namespace) -> int:
    """The job as an sbatch script, Kubeflow manifests or a qsub script: to -o or stdout."""
    from .export import export

    text, warnings = export(args.job, to=args.to, inventory=args.inventory, nodes=args.nodes,
                            partition=args.partition, time=args.time, container=args.container,
                            image=args.image, pvc=args.pvc, secret=args.secret)
    for warning in warnings:
        say(f"warning: {warning}")
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        try:
            with open(args.output, "w") as out:
                out.write(text)
        except OSError as exc:
            raise UserError(f"cannot write: {exc.strerror}", file=args.output, key="-o") from None
        say(f"wrote {args.output}")
    return 0


_UI = None  # the run's display (ftbundle.ui.Phases) while `ftbundle run` shows one


def say(message: str) -> None:
    if _UI is not None:
        _UI.say(message)
    else:
        print(f"ftbundle: {message}", file=sys.stderr, flush=True)


def _job_or_default(path: str | None) -> str:
    if path:
        return path
    import os

    if os.path.exists("job.yaml"):
        return "job.yaml"
    raise UserError("no job file given and no job.yaml here: name one (ftbundle runs path/to/job.yaml)", key="JOB")


def _history_source(args: argparse.Namespace):
    """(job, layout, cluster or None): where the job's run directories are, and a connection
    to rank 0's host when they are not on this machine."""
    import os

    job, layout = load_layout(_job_or_default(args.job), args.inventory)
    if os.path.isdir(layout.shared_dir) or layout.hosts[0].local:
        return job, layout, None
    return job, layout, open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys)


def cmd_runs(args: argparse.Namespace) -> int:
    """Past runs of the job from its run directories: a table, or JSON with --json."""
    from .history import format_runs, list_runs, runs_json

    job, layout, cluster = _history_source(args)
    try:
        rows = list_runs(None if args.all else job.name, layout.shared_dir, cluster, layout.hosts[0])
    finally:
        if cluster is not None:
            cluster.close()
    if args.json:
        print(runs_json(rows))
    elif not rows:
        print(f"no runs of {job.name} in {layout.shared_dir}/runs yet")
    else:
        print(format_runs(rows))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Loss and learning rate of one or more runs (default: the latest)."""
    from .history import list_runs, read_metrics
    from .plot import plot_png, plot_terminal

    job, layout, cluster = _history_source(args)
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


def cmd_init(args: argparse.Namespace) -> int:
    from .init import run_init

    return run_init(args)


def cmd_completion(args: argparse.Namespace) -> int:
    from .completion import script

    print(script(args.shell, _PARSER))
    return 0


def _on_sigterm(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # once is enough: the teardown must not be cut short
    raise KeyboardInterrupt


EXAMPLES = """\
examples:
  ftbundle init                              write job.yaml, train.yaml, inventory.yml (asks on a terminal)
  ftbundle run job.yaml                      check the hosts, launch, show progress, summarize
  ftbundle run job.yaml --dry-run            print every host's command and environment
  ftbundle run job.yaml -v                   rank 0's raw output instead of the progress display
  ftbundle logs job.yaml -f                  follow the latest run's rank 0 log
  ftbundle runs job.yaml                     past runs: state, duration, final loss
  ftbundle plot job.yaml -o loss.png         loss and learning rate of the latest run
  source <(ftbundle completion bash)         shell completion (bash; zsh via bashcompinit)
"""

_PARSER: argparse.ArgumentParser | None = None


def main(argv: list[str] | None = None) -> int:
    global _PARSER
    parser = argparse.ArgumentParser(
        prog="ftbundle", description="Launch multi-node fine-tuning on an Ansible inventory.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _PARSER = parser
    parser.add_argument("--version", action="version", version=f"ftbundle {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    hosts = argparse.ArgumentParser(add_help=False)  # how every subcommand reaches the hosts
    hosts.add_argument("-i", "--inventory", help="Ansible inventory (overrides the job's 'inventory')")
    hosts.add_argument("--vault-password-file", metavar="FILE",
                       help="for vault-encrypted inventory vars (default: $ANSIBLE_VAULT_PASSWORD_FILE)")
    hosts.add_argument("--accept-new-host-keys", action="store_true",
                       help="trust hosts whose SSH key is not in known_hosts yet, and record it there "
                            "(default: refused, as OpenSSH does)")

    run = sub.add_parser("run", help="launch a job on every host of the inventory", parents=[hosts])
    run.add_argument("job", help="the job file (job.yaml)")
    run.add_argument("--dry-run", action="store_true", help="print each host's command and environment; start nothing")
    run.add_argument("--detach", action="store_true",
                     help="start the job and return; follow it later with status/logs/stop")
    run.add_argument("--no-check", action="store_true",
                     help="skip the pre-launch check of the hosts (as 'check: false' in the job)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="show rank 0's raw output instead of the progress display")
    run.set_defaults(func=cmd_run)

    chk = sub.add_parser("check", help="check the hosts of a job are alike and ready; launch nothing",
                         parents=[hosts])
    chk.add_argument("job", help="the job file (job.yaml)")
    chk.add_argument("--net", action="store_true",
                     help="also measure the network: iperf3 to rank 0 from every host, and an all-reduce")
    chk.add_argument("--min-gbps", type=float, default=10.0,
                     help="warn about links slower than this, in Gbit/s (default 10)")
    chk.set_defaults(func=cmd_check)

    for name, func, text in (("status", cmd_status, "state of every node of a run"),
                             ("logs", cmd_logs, "a node's log (rank 0's by default)"),
                             ("stop", cmd_stop, "stop every node of a run"),
                             ("stacks", cmd_stacks, "every rank's state and Python stack, grouped; the run goes on")):
        p = sub.add_parser(name, help=text, parents=[hosts])
        p.add_argument("job", help="the job file the run was started from")
        p.add_argument("--run", help="run id (default: the job's latest run)")
        if name == "logs":
            p.add_argument("--rank", type=int, default=0, help="node rank (default 0)")
            p.add_argument("-f", "--follow", action="store_true", help="follow until the node's job ends")
            p.add_argument("-n", "--lines", type=int, default=50, help="lines to show first (default 50)")
        p.set_defaults(func=func)

    exp = sub.add_parser("export", help="write the job as a Slurm, Kubeflow (PyTorchJob, TrainJob) or PBS job")
    exp.add_argument("job", help="the job file (job.yaml)")
    exp.add_argument("--to", required=True, help="slurm | k8s (PyTorchJob) | trainjob (Kubeflow Trainer) | pbs")
    exp.add_argument("-i", "--inventory", help="Ansible inventory (overrides the job's 'inventory')")
    exp.add_argument("--nodes", help="number of nodes (default: the inventory's host count)")
    exp.add_argument("--partition", help="Slurm partition / PBS queue")
    exp.add_argument("--time", help="time limit (Slurm --time, PBS walltime)")
    exp.add_argument("--container", default="pyxis", help="slurm, docker runtime: pyxis (--container-image, "
                     "default) or docker (docker run on each node)")
    exp.add_argument("--image", help="k8s/trainjob: the image (repo@sha256:...) when the job's runtime is not docker")
    exp.add_argument("--pvc", help="k8s/trainjob: the shared volume's claim (default: <job name>-shared)")
    exp.add_argument("--secret", help="k8s/trainjob: the Secret holding the job's secrets (default: <job name>-secrets)")
    exp.add_argument("-o", "--output", help="write here instead of stdout")
    exp.set_defaults(func=cmd_export)

    runs = sub.add_parser("runs", help="past runs of a job: state, duration, final loss", parents=[hosts],
                          epilog="example: ftbundle runs job.yaml --json | jq '.[-1].final_loss'")
    runs.add_argument("job", nargs="?", help="the job file (default: ./job.yaml)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    runs.add_argument("--all", action="store_true", help="every job's runs in the shared directory")
    runs.set_defaults(func=cmd_runs)

    plot = sub.add_parser("plot", help="plot loss and learning rate of runs", parents=[hosts],
                          epilog="example: ftbundle plot job.yaml --run RUN_A --run RUN_B -o compare.png")
    plot.add_argument("job", help="the job file the runs were started from")
    plot.add_argument("--run", action="append", help="run id; repeat to overlay runs (default: the latest)")
    plot.add_argument("-o", "--output", help="write a PNG here (default on a terminal: a plot in the "
                                             "terminal; otherwise loss.png)")
    plot.set_defaults(func=cmd_plot)

    init = sub.add_parser("init", help="write a job, a LlamaFactory config and an inventory stub",
                          epilog="example: ftbundle init --hosts gpu1,gpu2 --gpus 8 --model Qwen/Qwen2.5-7B "
                                 "--mode lora")
    init.add_argument("--dir", default=".", help="where to write the files (default: here)")
    init.add_argument("--name", help="job name (default: the directory's name)")
    init.add_argument("--hosts", help="comma-separated host names or addresses (default: localhost)")
    init.add_argument("--gpus", type=int, help="GPUs per host (default 8; 2 CPU ranks on localhost)")
    init.add_argument("--model", help="model path or hub id")
    init.add_argument("--mode", choices=["lora", "qlora", "full"], help="fine-tuning method (default lora)")
    init.add_argument("--shared-dir", help="shared storage path on every host (default /shared/ftbundle)")
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    init.add_argument("--yes", "-y", action="store_true", help="take flags and defaults; ask nothing")
    init.set_defaults(func=cmd_init)

    comp = sub.add_parser("completion", help="print a shell completion script",
                          epilog="example: ftbundle completion bash > /etc/bash_completion.d/ftbundle")
    comp.add_argument("shell", choices=["bash", "zsh"])
    comp.set_defaults(func=cmd_completion)

    args = parser.parse_args(argv)
    if getattr(args, "vault_password_file", None):
        os.environ["ANSIBLE_VAULT_PASSWORD_FILE"] = os.path.abspath(args.vault_password_file)
    # a closed terminal (SIGHUP) or a kill (SIGTERM) stops the run as Ctrl-C does
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, _on_sigterm)
    # `kill -USR1 <pid>`: every thread's stack on stderr, for a launcher that seems stuck
    # (not where stderr has no file descriptor: main() called in-process, its stderr captured)
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both OSError and ValueError
        pass
    try:
        return args.func(args)
    except UserError as exc:
        print(f"ftbundle: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("ftbundle: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
