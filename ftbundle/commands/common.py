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


def refuse_contradictions(job: Job, layout: Layout, inventory: str | None) -> None:
    """What a run or a check must refuse before any host is asked, because the job and its
    hosts contradict each other (issue 45, item 2): ``min_nodes`` above the hosts there are, and
    ``on_node_loss: spare`` without a usable spares group (missing, empty, or the trainers themselves)."""
    hosts = layout.hosts
    if job.on_node_loss != "stop" and job.min_nodes > len(hosts):
        raise UserError(f"is {job.min_nodes}, above the {len(hosts)} host(s) of the job ({job.hosts}): the run "
                        f"could never go on after a loss, nor start. Set min_nodes to {len(hosts)} or less",
                        file=str(job.path), key="min_nodes")
    if job.on_node_loss != "spare":
        return
    source = inventory or job.inventory
    if source is None:
        raise UserError("on_node_loss: spare takes its spares from an inventory group, and this job has no "
                        "inventory (job key 'inventory' or -i)", file=str(job.path), key="on_node_loss")
    from ..inventory import load_hosts

    try:
        spares = load_hosts(source, job.spares)
    except UserError as exc:
        raise UserError(f"'{job.spares}' names no usable group of hosts in {source}: {exc.message}. Add the group "
                        "(its hosts stand by for a lost one), or set on_node_loss: exclude",
                        file=str(job.path), key="spares") from None
    if not spares:
        raise UserError(f"group '{job.spares}' of {source} has no hosts: add the hosts that stand by, or set "
                        "on_node_loss: exclude", file=str(job.path), key="spares")
    trainers = {h.name for h in hosts}
    both = [h.name for h in spares if h.name in trainers]
    if both:
        raise UserError(f"group '{job.spares}' holds {', '.join(both)}, which the job trains on ({job.hosts}): a "
                        "spare must be a host that stands by. Take them out of one of the two groups",
                        file=str(job.path), key="spares")


def open_cluster(hosts, *, accept_new_host_keys: bool = False, meanwhile=None, wait: bool = True):
    """One connection to every host, opened at once. ``meanwhile(cluster)`` runs here while the
    handshakes wait on the network (the launch path imports what it needs next; status says a
    host that is slow to answer). ``wait=False``: return while they do; what comes next is the
    check, whose probes start host by host as each connects (check/__init__.py probe_hosts),
    and the caller waits (``wait_open``) after it."""
    from ..cluster import Cluster

    cluster = Cluster(hosts, accept_new_host_keys=accept_new_host_keys)
    if meanwhile is None and wait:
        return cluster.open()
    cluster.open(background=True)
    try:
        if meanwhile is not None:
            meanwhile(cluster)
    finally:
        if wait:
            cluster.wait_open()
    return cluster


def say_slow_hosts(cluster, hosts, after_s: float | None = None) -> None:
    """While the connections open: the hosts that have not answered within ``after_s`` (HEDGE_S)
    are said at once, with how long the wait may last (a command that needs every host waits for
    a dead one's connect timeout: it said nothing for 10 s)."""
    import time

    from ..hostlist import fold

    deadline = time.monotonic() + (HEDGE_S if after_s is None else after_s)
    waiting = [h for h in hosts if not h.local]
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        waiting = [h for h in waiting if not cluster.alive(h) and h.name not in cluster.errors]
    if waiting:
        one = len(waiting) == 1
        say(f"{fold(h.name for h in waiting)} {'has' if one else 'have'} not answered {'its' if one else 'their'} "
            f"SSH connection in {HEDGE_S:g}s; waiting up to {cluster.connect_timeout:g}s before going on without "
            f"{'it' if one else 'them'}")


def job_or_default(path: str | None) -> str:
    if path:
        return path
    if os.path.exists("job.yaml"):
        return "job.yaml"
    raise UserError("no job file given and no job.yaml here: name one (ftbundle runs path/to/job.yaml)", key="JOB")


HEDGE_S = 1.0  # a host that has not answered its connection this long: the next is asked beside it


def history_source(args):
    """(job, layout, cluster or None, host): where the job's run directories are, and a
    connection to one host to read them through when they are not on this machine: rank 0's,
    else the next that answers. Only that host is asked (every host was: one host down held
    `runs` for the whole connect timeout, saying nothing); one that does not answer is said at
    once, with why."""
    from ..cluster import Cluster

    job, layout = load_layout(job_or_default(args.job), args.inventory)
    if os.path.isdir(layout.shared_dir) or layout.hosts[0].local:
        return job, layout, None, layout.hosts[0]
    cluster = Cluster(layout.hosts, accept_new_host_keys=args.accept_new_host_keys)
    # (hedged: a host that has not answered in HEDGE_S has the next one asked beside it; a dead
    # rank 0 costs that, not the 10 s connect timeout)
    host, _ = cluster.open_first(list(layout.hosts), hedge_s=HEDGE_S)
    if host is not None:
        for h in layout.hosts[:layout.hosts.index(host)]:
            why = cluster.errors.get(h.name) or f"{h.name} has not answered its SSH connection in {HEDGE_S:g}s"
            say(f"{why}; reading the runs through {host.name}")
        return job, layout, cluster, host
    cluster.close()
    raise UserError(f"cannot read {layout.shared_dir}/runs through any host: {cluster.errors_said()}",
                    file=str(job.inventory or job.path))
