"""A run after launch: status, logs and stop, from the state kept in its run directory.

Everything needed lives on shared storage (plan.json, the attempt number, each node's
pid/exit/heartbeat files and logs), so these work from any machine with the job file and
the inventory, long after the launching machine is gone (`ftbundle run --detach`). Every
host is asked over the one connection the :class:`~ftbundle.cluster.Cluster` holds to it.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from dataclasses import dataclass

from .cluster import Cluster, first_line, parallel
from .errors import UserError
from .inventory import Host
from .launch.node import STOP_GRACE_S, STOP_REQUEST, node_argv
from .launch.supervisor import stage_files
from .plan import ATTEMPT_FILE, NodeFiles, NodePlan


@dataclass(frozen=True)
class RunRef:
    """A run directory found through the hosts of the current inventory."""

    run_id: str
    run_dir: str
    record: dict  # plan.json
    nodes: tuple[NodePlan, ...]
    attempt: int

    def files(self, node: NodePlan) -> NodeFiles:
        return NodeFiles.of(self.run_dir, self.run_id, node.rank, node.host.name, self.attempt)


def _read(cluster: Cluster, host: Host, path: str) -> str | None:
    result = cluster.run(host, ["cat", "--", path], timeout=15)
    return result.stdout if result.ok else None


def find_run(job_name: str, shared_dir: str, hosts: list[Host], run_id: str | None, cluster: Cluster) -> RunRef:
    """The run `run_id`, or the job's latest run, read through rank 0's host."""
    runs_dir = posixpath.join(shared_dir, "runs")
    if run_id is None:
        listing = cluster.run(hosts[0], ["ls", "-1", "--", runs_dir], timeout=15).stdout.split()
        pattern = re.compile(re.escape(job_name) + r"-\d{8}-\d{6}-[0-9a-f]+$")
        mine = sorted(name for name in listing if pattern.match(name))
        if not mine:
            raise UserError(f"no run of job {job_name!r} in {runs_dir}", key="--run")
        run_id = mine[-1]
    run_dir = posixpath.join(runs_dir, run_id)
    text = _read(cluster, hosts[0], posixpath.join(run_dir, "plan.json"))
    if text is None:
        raise UserError(f"no run {run_id!r} in {runs_dir} (no plan.json there)", key="--run")
    record = json.loads(text)
    attempt_text = (_read(cluster, hosts[0], posixpath.join(run_dir, ATTEMPT_FILE)) or "1").strip()
    by_name = {h.name: h for h in hosts}
    nodes = []
    for entry in record["nodes"]:
        host = by_name.get(entry["host"])
        if host is None:
            host = Host(entry["host"], entry["address"], entry["port"], entry["user"], local=entry["local"])
        nodes.append(NodePlan(
            rank=entry["rank"], host=host, program=tuple(entry["argv"]), env={}, workdir=entry["workdir"],
            log_path=entry["log"], env_file=entry["env_file"], container=entry.get("container"),
            stream=entry["rank"] == 0,
        ))
    return RunRef(run_id, run_dir, record, tuple(nodes), int(attempt_text) if attempt_text.isdigit() else 1)


def node_states(ref: RunRef, cluster: Cluster) -> list[tuple[NodePlan, str, str]]:
    """(node, state, last log line) for every node, asked of each host in parallel."""
    def ask(node: NodePlan) -> tuple[NodePlan, str, str]:
        files = ref.files(node)
        try:
            result = cluster.run(node.host, node_argv("state", files.marker, files.exit, files.log), timeout=15)
        except Exception as exc:  # unreachable host: say so, keep going
            return node, "unreachable", first_line(exc)
        lines = result.stdout.splitlines() + ["", ""]
        return node, lines[0], lines[1]

    return parallel(ask, ref.nodes)


def print_status(ref: RunRef, cluster: Cluster, out=None) -> int:
    """A table of nodes; exit 0 while running or after success, 1 when any node failed."""
    out = out or sys.stdout
    states = node_states(ref, cluster)
    attempt = f", attempt {ref.attempt}" if ref.attempt > 1 else ""
    print(f"run {ref.run_id}  ({ref.record['nnodes']} node(s) x {ref.record['nproc_per_node']} rank(s){attempt})  "
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
    stalled = _detached_stall(ref, cluster)
    if stalled:
        summary = "stalled"
    print(f"state: {summary}", file=out)
    for line in stalled:
        print(line, file=out)
    return 1 if failed or summary in ("stopped", "stalled") else 0


def _detached_stall(ref: RunRef, cluster: Cluster) -> list[str]:
    """A detached run stopped by its own stall watchdog (node.sh stall-watch): the grouped
    view of what its nodes collected; nothing when it did not stall."""
    import dataclasses

    from .launch.stall import DETACHED_STACKS, DETACHED_STALL, STACKS_DIR, diagnose, read_collected, report_lines

    host = ref.nodes[0].host
    said = _read(cluster, host, posixpath.join(ref.run_dir, DETACHED_STALL.format(attempt=ref.attempt)))
    if said is None:
        return []
    out_dir = posixpath.join(ref.run_dir, STACKS_DIR, DETACHED_STACKS.format(attempt=ref.attempt))
    names = {n.rank: n.host.name for n in ref.nodes}
    ranks = [dataclasses.replace(r, host=names.get(r.node_rank, r.host)) for r in read_collected(cluster, host, out_dir)]
    timeout = ref.record.get("stall_timeout")
    head = f"stalled: no progress from any rank for {said.strip()}s (stall_timeout {timeout}s); every node was stopped"
    expected = ref.record.get("nnodes", 0) * ref.record.get("nproc_per_node", 0) or None
    return [head] + report_lines(diagnose(ranks), out_dir=out_dir, expected=expected)


def show_logs(ref: RunRef, cluster: Cluster, rank: int, follow: bool, lines: int, out=None) -> int:
    out = out or sys.stdout
    if not 0 <= rank < len(ref.nodes):
        raise UserError(f"rank must be between 0 and {len(ref.nodes) - 1}", key="--rank")
    node = ref.nodes[rank]
    files = ref.files(node)
    argv = (node_argv("follow", files.marker, files.log, str(lines)) if follow
            else ["tail", "-n", str(lines), "--", files.log])
    # The log is on shared storage: rank 0's host can read any node's log if the node's own is gone.
    for host in dict.fromkeys([node.host, ref.nodes[0].host]):
        if not cluster.alive(host):
            continue
        try:
            proc = cluster.start(host, argv)
        except Exception:
            continue
        proc.close_stdin()
        while chunk := proc.read_out():
            out.write(chunk.decode(errors="replace"))
            out.flush()
        return proc.wait(5) or 0
    raise UserError(f"cannot reach {node.host.name} or rank 0's host to read {files.log}")


def stop_run(ref: RunRef, cluster: Cluster, out=None) -> int:
    """Ask every node to stop (a request file on shared storage for their watchers, and a
    stop on each host), then report what is left."""
    out = out or sys.stderr
    stage_files(cluster, ref.nodes[0].host, ref.run_dir, {STOP_REQUEST: "stop requested\n"})

    def stop(node: NodePlan) -> str:
        if not cluster.alive(node.host):
            return f"unreachable ({cluster.errors.get(node.host.name, 'no connection')})"
        try:
            result = cluster.run(node.host, node_argv("stop", ref.files(node).marker, node.container or ""),
                                 timeout=STOP_GRACE_S + 15)
            return "stopped" if result.ok else "still running"
        except Exception as exc:
            return f"unreachable ({first_line(exc)})"

    results = parallel(stop, ref.nodes)
    code = 0
    for node, result in zip(ref.nodes, results):
        print(f"ftbundle: rank {node.rank} {node.host.name}: {result}", file=out)
        code |= 0 if result == "stopped" else 1
    return code
