"""The `ftbundle` command line: parse flags, load job and inventory, hand over to the core.

User mistakes (:class:`UserError`) become one clear message and exit code 2, before
anything is started anywhere.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import time
from pathlib import Path

from . import __version__
from .errors import EXIT_USAGE, UserError
from .inventory import Host, load_hosts, localhost_only
from .job import Job, is_secret, load_job
from .plan import Plan, make_plan


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


def build_plan(job_path: str, inventory: str | None) -> tuple[Job, Plan]:
    job = load_job(job_path)
    hosts = resolve_hosts(job, inventory)
    nproc = None
    if job.nproc_per_node == "auto":
        raise UserError("nproc_per_node: auto is not supported yet; set the number of ranks per host",
                        file=str(job.path), key="nproc_per_node")
    return job, make_plan(job, hosts, new_run_id(job.name), nproc_per_node=nproc)


def format_plan(plan: Plan) -> str:
    """Human-readable --dry-run output: per host, where, what and with which environment."""
    import shlex

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
            lines.append(f"  {key}={'<redacted>' if is_secret(key) else value}")
        lines.append(f"  {shlex.join(node.argv)}")
        lines.append(f"  log {node.log_path}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from .launch import Supervisor, stage_run_dir

    job, plan = build_plan(args.job, args.inventory)
    if args.dry_run:
        print(format_plan(plan))
        return 0
    print(f"ftbundle: run {plan.run_id}: {plan.nnodes} node(s) x {plan.nproc_per_node} rank(s), "
          f"logs in {plan.run_dir}", file=sys.stderr, flush=True)
    for note in plan.notes:
        print(f"ftbundle: {note}", file=sys.stderr)
    for warning in plan.warnings:
        print(f"ftbundle: warning: {warning}", file=sys.stderr)
    stage_run_dir(plan)
    outcome = Supervisor(plan).run()
    if outcome.exit_code == 0:
        print(f"ftbundle: run {plan.run_id} finished on all {plan.nnodes} node(s)", file=sys.stderr)
    return outcome.exit_code


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ftbundle", description="Launch multi-node fine-tuning on an Ansible inventory.")
    parser.add_argument("--version", action="version", version=f"ftbundle {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a job on every host of the inventory")
    run.add_argument("job", help="the job file (job.yaml)")
    run.add_argument("-i", "--inventory", help="Ansible inventory (overrides the job's 'inventory')")
    run.add_argument("--dry-run", action="store_true", help="print each host's command and environment; start nothing")
    run.set_defaults(func=cmd_run)

    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
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
