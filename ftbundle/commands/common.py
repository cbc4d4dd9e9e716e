"""What the commands share: the job and its hosts read once (the layout), one connection
per host, and a message line on stderr."""

from __future__ import annotations

import os
import sys

from ..errors import UserError
from ..inventory import resolve_hosts
from ..job import Job, load_job
from ..layout import Layout, make_layout, new_run_id


def say(message: str) -> None:
    print(f"ftbundle: {message}", file=sys.stderr, flush=True)


def load_layout(job_path: str, inventory: str | None) -> tuple[Job, Layout]:
    """The job file and the inventory, read once: what runs where, before the hosts are asked."""
    job = load_job(job_path)
    return job, make_layout(job, resolve_hosts(job, inventory), new_run_id(job.name))


def open_cluster(hosts, *, accept_new_host_keys: bool = False, meanwhile=None):
    """One connection to every host, opened at once. ``meanwhile`` runs here while the
    handshakes wait on the network (the launch path imports what it needs next)."""
    from ..cluster import Cluster

    cluster = Cluster(hosts, accept_new_host_keys=accept_new_host_keys)
    if meanwhile is None:
        return cluster.open()
    cluster.open(background=True)
    try:
        meanwhile()
    finally:
        cluster.wait_open()
    return cluster


def job_or_default(path: str | None) -> str:
    if path:
        return path
    if os.path.exists("job.yaml"):
        return "job.yaml"
    raise UserError("no job file given and no job.yaml here: name one (ftbundle runs path/to/job.yaml)", key="JOB")


def history_source(args):
    """(job, layout, cluster or None): where the job's run directories are, and a connection
    to rank 0's host when they are not on this machine."""
    job, layout = load_layout(job_or_default(args.job), args.inventory)
    if os.path.isdir(layout.shared_dir) or layout.hosts[0].local:
        return job, layout, None
    return job, layout, open_cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys)
