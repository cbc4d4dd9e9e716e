"""A run after launch: status, logs and stop, from the state kept in its run directory.

Everything needed lives on shared storage (plan.json, node-<rank>.pid/.exit, the logs),
so these work from any machine with the job file and the inventory, long after the
launching machine is gone (`ftbundle run --detach`).
"""

from __future__ import annotations

import json
import posixpath
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import nodescript
from .errors import UserError
from .inventory import Host
from .plan import NodePlan, Plan
from .shell import run_script, stream_script, write_files


@dataclass(frozen=True)
class RunRef:
    """A run directory found through the hosts of the current inventory."""

    run_id: str
    run_dir: str
    record: dict  # plan.json
    nodes: tuple[NodePlan, ...]


def find_run(job_name: str, shared_dir: str, hosts: list[Host], run_id: str | None) -> RunRef:
    """The run `run_id`, or the job's latest run, read through rank 0's host."""
    runs_dir = posixpath.join(shared_dir, "runs")
    if run_id is None:
        listing = run_script(hosts[0], f"ls -1 {shlex.quote(runs_dir)} 2>/dev/null | grep -E "
                                       f"{shlex.quote('^' + job_name + '-[0-9]{8}-[0-9]{6}-')} | sort | tail -n 1")
        run_id = listing.stdout.strip()
        if not run_id:
            raise UserError(f"no run of job {job_name!r} in {runs_dir}", key="--run")
    run_dir = posixpath.join(runs_dir, run_id)
    result = run_script(hosts[0], f"cat {shlex.quote(run_dir + '/plan.json')}")
    if not result.ok:
        raise UserError(f"no run {run_id!r} in {runs_dir} (no plan.json there)", key="--run")
    record = json.loads(result.stdout)
    by_name = {h.name: h for h in hosts}
    nodes = []
    for entry in record["nodes"]:
        host = by_name.get(entry["host"])
        if host is None:
            host = Host(entry["host"], entry["address"], entry["port"], entry["user"], local=entry["local"])
        nodes.append(NodePlan(
            rank=entry["rank"], host=host, argv=tuple(entry["argv"]), env={}, workdir=entry["workdir"],
            log_path=entry["log"], env_file=entry["env_file"], container=entry.get("container"),
            stream=entry["rank"] == 0,
        ))
    return RunRef(run_id, run_dir, record, tuple(nodes))


def _node_state_script(ref: RunRef, node: NodePlan) -> str:
    q = shlex.quote
    marker = nodescript.job_marker(ref.run_id, node.rank)
    exitf = nodescript.exit_path(ref.run_dir, node.rank)
    return f"""if grep -qlzx {q('FTB_JOB=' + marker)} /proc/[0-9]*/environ 2>/dev/null; then echo running
elif [ -s {q(exitf)} ]; then echo "exited $(cat {q(exitf)})"
else echo stopped; fi
tail -n 1 {q(node.log_path)} 2>/dev/null | tr '\\r' '\\n' | grep -v '^\\s*$' | tail -n 1
"""


def node_states(ref: RunRef) -> list[tuple[NodePlan, str, str]]:
    """(node, state, last log line) for every node, asked of each host in parallel."""
    def ask(node: NodePlan) -> tuple[NodePlan, str, str]:
        try:
            result = run_script(node.host, _node_state_script(ref, node), timeout=15, connect_timeout=5)
        except Exception as exc:  # unreachable host: say so, keep going
            return node, "unreachable", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        lines = result.stdout.splitlines() + ["", ""]
        return node, lines[0], lines[1]

    with ThreadPoolExecutor(max_workers=max(1, len(ref.nodes))) as pool:
        return list(pool.map(ask, ref.nodes))


def print_status(ref: RunRef, out=None) -> int:
    """A table of nodes; exit 0 while running or after success, 1 when any node failed."""
    out = out or sys.stdout
    states = node_states(ref)
    print(f"run {ref.run_id}  ({ref.record['nnodes']} node(s) x {ref.record['nproc_per_node']} rank(s))  "
          f"{ref.run_dir}", file=out)
    failed = False
    for node, state, last in states:
        print(f"  rank {node.rank:<3} {node.host.name:<20} {state:<12} {last[:100]}", file=out)
        failed |= state.startswith("exited") and state != "exited 0"
    if all(state == "exited 0" for _, state, _ in states):
        summary = "finished"
    elif any(state == "running" for _, state, _ in states):
        summary = "running" if not failed else "failing"
    else:
        summary = "failed" if failed else "stopped"
    print(f"state: {summary}", file=out)
    return 1 if failed or summary == "stopped" else 0


def show_logs(ref: RunRef, rank: int, follow: bool, lines: int, out=None) -> int:
    out = out or sys.stdout
    if not 0 <= rank < len(ref.nodes):
        raise UserError(f"rank must be between 0 and {len(ref.nodes) - 1}", key="--rank")
    node = ref.nodes[rank]
    q = shlex.quote
    if not follow:
        script = f"tail -n {lines} {q(node.log_path)}"
    else:
        marker = nodescript.job_marker(ref.run_id, node.rank)
        # follow until the node's job is gone (finished, failed or stopped)
        script = (f"tail -n {lines} -F {q(node.log_path)} 2>/dev/null & t=$!\n"
                  f"while grep -qlzx {q('FTB_JOB=' + marker)} /proc/[0-9]*/environ 2>/dev/null; do sleep 1; done\n"
                  "sleep 1; kill $t 2>/dev/null; wait $t 2>/dev/null; exit 0\n")
    # The log is on shared storage: rank 0's host can read any node's log if the node's own is gone.
    for host in dict.fromkeys([node.host, ref.nodes[0].host]):
        try:
            return stream_script(host, script, out)
        except Exception:
            continue
    raise UserError(f"cannot reach {node.host.name} or rank 0's host to read {node.log_path}")


def stop_run(ref: RunRef, out=None) -> int:
    """Ask every node to stop (a request file on shared storage for their watchers, and a
    stop over SSH on each host), then report what is left."""
    out = out or sys.stderr
    write_files(ref.nodes[0].host, ref.run_dir, {nodescript.STOP_REQUEST: "stop requested\n"})

    def stop(node: NodePlan) -> str:
        try:
            run_script(node.host, nodescript.stop_script(node, ref.run_id),
                       timeout=nodescript.STOP_GRACE_S + 15, connect_timeout=5)
            return "stopped"
        except Exception as exc:
            return f"unreachable ({exc})"

    with ThreadPoolExecutor(max_workers=max(1, len(ref.nodes))) as pool:
        results = list(pool.map(stop, ref.nodes))
    code = 0
    for node, result in zip(ref.nodes, results):
        print(f"ftbundle: rank {node.rank} {node.host.name}: {result}", file=out)
        code |= 0 if result == "stopped" else 1
    return code


def launch_detached(plan: Plan, out=None) -> int:
    """Start every node's job and return once all have started; nothing is supervised
    from here (each node's watcher stops its job when a peer fails)."""
    out = out or sys.stderr
    import queue as _queue

    from .launch import make_runner

    events: _queue.Queue = _queue.Queue()
    runners = [make_runner(node, plan, events, detach=True) for node in plan.nodes]
    for runner in runners:
        runner.start()
    pending = {r.node.rank for r in runners}
    failed = []
    while pending:
        event = events.get(timeout=120)
        if event.kind in ("exit", "lost"):
            pending.discard(event.rank)
            if event.code != 0:
                failed.append((event.rank, event.text or f"exit code {event.code}"))
    if failed:
        for rank, why in failed:
            print(f"ftbundle: rank {rank} {plan.nodes[rank].host.name} did not start: {why}", file=out)
        return 1
    return 0
