"""A run after launch: status and stop, from the state kept in its run directory (its logs: runlogs.py).

Everything needed lives on shared storage (plan.json, the attempt number, each node's
pid/exit/heartbeat files and logs), so these work from any machine with the job file and
the inventory, long after the launching machine is gone (`ftbundle run --detach`). Every
host is asked over the one connection the :class:`~ftbundle.cluster.Cluster` holds to it.
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
import sys
from dataclasses import dataclass

from . import gpu_metrics, protocol
from .cluster import Cluster, HostUnreachable, first_line, parallel
from .errors import UserError
from .hostlist import fold, fold_numbers
from .inventory import Host
from .launch.node import STOP_GRACE_S, node_argv
from .launch.staging import stage_files
from .plan import NodePlan, shape_text
from .recovery import attempts_said
from .rundir import PLAN, STOP_REQUEST, TRAINER_LOG, NodeFiles, RunDir, diverged_name, ended_name, node_glob, runs_dir


@dataclass(frozen=True)
class RunRef:
    """A run directory found through the hosts of the current inventory."""

    run_id: str
    run_dir: str
    record: dict  # plan.json
    nodes: tuple[NodePlan, ...]
    attempt: int
    attempts: tuple[str, ...] = ()  # where each attempt after a lost host ran, and why (attempts.json)
    found_through: Host | None = None  # the host find_run read the run directory through

    def via(self, cluster: Cluster) -> Host:
        """The host the run directory (shared storage) is read and written through: rank 0's while
        it is connected, else the one the run was found through (the first that answered). Rank 0's
        host dead was every read's traceback in `status` and every write's in `stop`."""
        rank0 = self.nodes[0].host
        return rank0 if self.found_through is None or cluster.alive(rank0) else self.found_through

    @property
    def rundir(self) -> RunDir:
        return RunDir(self.run_dir, self.run_id)

    def files(self, node: NodePlan) -> NodeFiles:
        return self.rundir.node(node.rank, node.host.name, self.attempt)

    @property
    def shared_dir(self) -> str:
        """The job's shared_dir (the run directory is ``<shared_dir>/runs/<run id>``)."""
        return self.rundir.shared_dir


READ_S = 15  # a read of the run directory through a host


def _run_dir_command(cluster: Cluster, host: Host, argv: list[str], path: str):
    """A short command on the run directory; one that outlasts READ_S while its host answers is
    shared storage that does not answer there (a hung network filesystem holds the command, not
    the host), said so instead of a traceback."""
    try:
        return cluster.run(host, argv, timeout=READ_S)
    except TimeoutError:
        if not cluster.answers(host, 1.5):
            raise
        raise UserError(f"shared storage does not answer on {host.name}: reading {path} took more than {READ_S}s "
                        "while the host answers (a hung network filesystem? every node's job waits on it "
                        "too)") from None


def _read(cluster: Cluster, host: Host, path: str) -> str | None:
    result = _run_dir_command(cluster, host, ["cat", "--", path], path)
    return result.stdout if result.ok else None


LATEST_TRIES = 5  # run directories tried, newest first, for a job's latest run


def _plan_record(cluster: Cluster, host: Host, rundir: RunDir):
    """A run's plan.json as a dict, or why there is none, in words."""
    name = posixpath.basename(rundir.plan)
    text = _read(cluster, host, rundir.plan)
    if text is None:
        return f"no {name} there (a start refused or stopped before its run directory was staged?)"
    try:
        record = json.loads(text)
    except ValueError as exc:
        return f"its {name} is not valid JSON ({exc})"
    if not isinstance(record, dict) or not isinstance(record.get("nodes"), list):
        return f"its {name} holds no nodes"
    return record


def find_run(job_name: str, shared_dir: str, hosts: list[Host], run_id: str | None, cluster: Cluster) -> RunRef:
    """The run `run_id`, or the job's latest run, read through ``hosts[0]`` (rank 0's host, or
    the first that answers)."""
    runs = runs_dir(shared_dir)
    if run_id is None:
        listing = _run_dir_command(cluster, hosts[0], ["ls", "-1", "--", runs], runs).stdout.split()
        pattern = re.compile(re.escape(job_name) + r"-\d{8}-\d{6}-[0-9a-f]+$")
        mine = sorted(name for name in listing if pattern.match(name))
        if not mine:
            raise UserError(f"no run of job {job_name!r} in {runs}", key="--run")
        # the latest run that has a plan: a directory without one (a start refused or killed before
        # it was staged) is named and passed over, never picked
        for candidate in reversed(mine[-LATEST_TRIES:]):
            record = _plan_record(cluster, hosts[0], RunDir.of(shared_dir, candidate))
            if isinstance(record, dict):
                run_id = candidate
                break
            print(f"ftbundle: passing over {candidate}: {record}", file=sys.stderr)
        else:
            raise UserError(f"no run of job {job_name!r} in {runs} has a readable plan (the last "
                            f"{min(len(mine), LATEST_TRIES)} tried); name one with --run", key="--run")
    rundir = RunDir.of(shared_dir, run_id)
    run_dir = rundir.path
    record = _plan_record(cluster, hosts[0], rundir)
    if not isinstance(record, dict):
        raise UserError(f"run {run_id!r} in {runs}: {record}", key="--run")
    attempt_text = (_read(cluster, hosts[0], rundir.attempt) or "1").strip()
    try:
        attempts = attempts_said(json.loads(_read(cluster, hosts[0], rundir.attempts) or "[]"))
    except (ValueError, TypeError):
        attempts = []
    by_name = {h.name: h for h in hosts}
    nodes = []
    for entry in record["nodes"]:
        host = by_name.get(entry["host"])
        if host is None:
            host = Host(entry["host"], entry["address"], entry["port"], entry["user"], local=entry["local"])
        nodes.append(NodePlan(
            rank=entry["rank"], host=host, program=tuple(entry["argv"]), env={}, workdir=entry["workdir"],
            log_path=entry["log"], env_file=entry["env_file"], container=entry.get("container"),
            stream=entry["rank"] == 0, per_node=bool(entry.get("per_node")),
            nproc=int(entry.get("nproc") or record.get("nproc_per_node") or 1),
            first_rank=int((entry.get("ranks") or [entry["rank"] * int(record.get("nproc_per_node") or 1)])[0]),
        ))
    return RunRef(run_id, run_dir, record, tuple(nodes), int(attempt_text) if attempt_text.isdigit() else 1,
                  tuple(attempts), hosts[0])


def node_states(ref: RunRef, cluster: Cluster, gpus: dict | None = None) -> list[tuple[NodePlan, str, str]]:
    """(node, state, last log line) for every node, asked of each host in parallel; with
    ``gpus`` (a GPU job), a running node's GPUs read in the same round into it (host -> readings)."""
    sampled = gpus is not None and bool(ref.record.get("gpu_sample_s"))

    def ask(node: NodePlan) -> tuple[NodePlan, str, str]:
        files = ref.files(node)
        argv = node_argv("state", files.marker, files.exit, files.log, files.stopped,
                         *((gpu_metrics.QUERY, "" if node.container else node.env.get("CUDA_VISIBLE_DEVICES", ""))
                           if sampled else ()))
        try:
            result = cluster.run(node.host, argv, timeout=READ_S)
        except TimeoutError as exc:  # the host answers, its run directory does not?
            if not cluster.answers(node.host, 1.5):
                return node, "unreachable", first_line(exc)
            return node, "unknown", f"no answer within {READ_S}s while its host answers: its shared storage hung?"
        except Exception as exc:  # unreachable host: say so, keep going
            return node, "unreachable", first_line(exc)
        lines = result.stdout.splitlines() + ["", ""]
        said = list(itertools.takewhile(lambda line: line.startswith(f"{protocol.SMI} "), lines[1:]))
        if said and gpus is not None:
            gpus[node.host.name] = gpu_metrics.parse_line("\n".join(line.split(" ", 1)[1] for line in said))
        return node, lines[0], lines[1 + len(said)]

    found = parallel(ask, ref.nodes)
    return [_exit_read_elsewhere(ref, cluster, found, i) if state == "unreachable" else (node, state, last)
            for i, (node, state, last) in enumerate(found)]


def _exit_read_elsewhere(ref: RunRef, cluster: Cluster, found, i: int) -> tuple[NodePlan, str, str]:
    """An unreachable node whose exit code is in the run directory (shared storage): read it
    through a host that answers. Its job ended with that code whatever became of its host since
    (a finished run was said "stopped" when a host was down afterwards). No exit code: still
    unreachable (it may be running behind a partition)."""
    node, state, last = found[i]
    through = next((n.host for n, s, _ in found if s not in ("unreachable", "unknown")), None)
    if through is None:
        return node, state, last
    try:
        result = cluster.run(through, ["cat", "--", ref.files(node).exit], timeout=READ_S)
    except Exception:  # noqa: BLE001 - it stays unreachable, with its own reason
        return node, state, last
    code = result.stdout.strip()
    if not result.ok or not code.lstrip("-").isdigit():
        return node, state, last
    return node, f"exited {int(code)}", f"(its exit code, read through {through.name}: {node.host.name} does not answer: {last})"


def run_state(states: list[str]) -> tuple[str, bool]:
    """(the run's state in a word or two, whether a node failed) from its nodes' states (node.sh
    ``state``: running | exited N | stopped[: why] | unreachable | unknown). Pure."""
    failed = any(state.startswith("exited") and state != "exited 0" for state in states)
    if states and all(state == "exited 0" for state in states):
        return "finished", failed
    if any(state == "running" for state in states):
        return ("running" if not failed else "failing"), failed
    # a node that stopped its job by itself says why (node.sh: "stopped: launcher lost: ...")
    why = next((state.split(":", 1)[1].strip() for state in states if state.startswith("stopped: ")), "")
    return ("failed" if failed else (f"stopped: {why}" if why else "stopped")), failed


STATUS_ROWS_MAX = 16  # more nodes than this: a row only for the nodes that are not fine


def print_status(ref: RunRef, cluster: Cluster, out=None) -> int:
    """A table of nodes; exit 0 while running or after success, 1 when any node failed."""
    out = out or sys.stdout
    gpus: dict = {}
    states = node_states(ref, cluster, gpus)
    for line in format_status(ref, states):
        print(line, file=out)
    for line in gpu_metrics.status_lines(gpus):  # (a GPU job's running nodes, read just now)
        print(line, file=out)
    summary, failed = run_state([state for _, state, _ in states])
    stalled = _said(_detached_stall, ref, cluster, "its stall record")
    if stalled:
        summary = "stalled"
    print(f"state: {summary}", file=out)
    for line in stalled:
        print(line, file=out)
    for line in _said(_detached_kept, ref, cluster, "what its watchers kept"):
        print(line, file=out)
    for line in _said(_training, ref, cluster, "its trainer's log and checkpoints", running=summary == "running"):
        print(line, file=out)
    return 1 if failed or summary.startswith("stopped") or summary == "stalled" else 0


def _said(read, ref: RunRef, cluster: Cluster, what: str, **kwargs) -> list[str]:
    """``read(ref, cluster)``'s lines, or a line saying why they could not be read: the host read
    through stopped answering after the run was found (the table above says which nodes answer)."""
    try:
        return read(ref, cluster, **kwargs)
    except (HostUnreachable, TimeoutError) as exc:
        return [f"{what}: not read: {first_line(exc) or type(exc).__name__}"]


def _detached_stall(ref: RunRef, cluster: Cluster) -> list[str]:
    """A detached run stopped by its own stall watchdog (remote/watch.py stall_watch): the grouped
    view of what its nodes collected; nothing when it did not stall."""
    import dataclasses

    from .launch.stall import diagnose, read_collected, report_lines

    host = ref.via(cluster)
    said = _read(cluster, host, ref.rundir.stalled(ref.attempt))
    if said is None:
        return []
    out_dir = ref.rundir.detached_stacks(ref.attempt)
    names = {n.rank: n.host.name for n in ref.nodes}
    ranks = [dataclasses.replace(r, host=names.get(r.node_rank, r.host)) for r in read_collected(cluster, host, out_dir)]
    timeout = ref.record.get("stall_timeout")
    head = f"stalled: no progress from any rank for {said.strip()}s (stall_timeout {timeout}s); every node was stopped"
    expected = sum(n.nproc for n in ref.nodes) or None
    return [head] + report_lines(diagnose(ranks), out_dir=out_dir, expected=expected)


def _detached_kept(ref: RunRef, cluster: Cluster) -> list[str]:
    """What a detached run's watchers kept in its run directory for the launcher they do not
    have, in one read through rank 0's host: the run's end as the watcher that judged it wrote it
    (ended.aN: remote/watch.py end), each node's step times (node-R.aN.steps, remote/watch.py
    keep_steps), shown as an attached run's summary shows its stragglers, and the GPU faults
    its kernel logged while the job ran (node-R.aN.xids, node.sh ftb_xids), as a failed attached
    run names them; and, of any run, its ranks' verdict when its loss went nan or its model
    collapsed (diverged.aN: shims/steptimes.py). Nothing when there is none of these (a `command:`
    job on hosts without GPUs)."""
    from .gpu_health import run_fault_lines
    from .history import diverged_lines, ended_lines, ended_record, faults_of, split_tail_output, step_nodes
    from .ui import stragglers

    names = [node_glob(ref.attempt, "steps"), node_glob(ref.attempt, "xids"), ended_name(ref.attempt),
             diverged_name(ref.attempt)]
    result = _run_dir_command(cluster, ref.via(cluster),
                              ["find", ref.run_dir, "-maxdepth", "1", "(", "-name", names[0], "-o", "-name", names[1],
                               "-o", "-name", names[2], "-o", "-name", names[3], ")",
                               "-exec", "tail", "-v", "-n", "+1", "--", "{}", "+"],
                              ref.rundir.node_glob(ref.attempt, "steps"))
    files = split_tail_output(result.stdout, runs_dir(ref.shared_dir)).get(ref.run_id, {})
    nodes, factor = step_nodes(files, ref.record, ref.attempt)
    ended = ended_record(files.get(names[2]))
    return (ended_lines(ended) + diverged_lines(files.get(names[3]), ended) + stragglers.summary_lines(nodes, factor)
            + run_fault_lines(faults_of(files, ref.record, ref.attempt)))


PACE_RECORDS = 20_000  # the trainer log's last records `status` judges the run's pace on

# output_dir's newest complete checkpoint's age, the host's clock, when the trainer log and the
# run's plan.json were last written, the newest later run of the job whose plan.json names the same
# output_dir ($9: its "checkpoint_dir" as the plan's JSON writes it), and the trainer log's last
# records, on rank 0's host
_TRAINING_READ = r'''dir=$1 last=$2
if [ -n "$last" ]; then stat -c %Y -- "$dir/$last/trainer_state.json" 2>/dev/null || echo -; else echo -; fi
date +%s
stat -c %Y -- "$5" 2>/dev/null || echo -
stat -c %Y -- "$4" 2>/dev/null || echo -
later=-
for p in "$6/$7"-*/plan.json; do r=${p%/plan.json}; r=${r##*/}
  [[ ${r#"$7-"} =~ ^[0-9]{8}-[0-9]{6}-[0-9a-f]+$ && $r > $8 ]] && grep -qF -- "$9" "$p" 2>/dev/null && later=$r; done
echo "$later"
tail -n "$3" -- "$5" 2>/dev/null
true'''


def _training(ref: RunRef, cluster: Cluster, *, running: bool) -> list[str]:
    """What the trainer has done, read through rank 0's host: the run's pace (ui.pace) from its
    trainer log's last records, what an attached run's launcher says while it goes, for a detached
    run or another terminal; and output_dir's newest complete checkpoint, its age and what a failure
    now would cost (launch/resume.py). Nothing for a job without a trainer log (a script's)."""
    from .launch.resume import checkpoint_status
    from .remote.trainer_end import earlier_run
    from .speed import SpeedBasis
    from .ui.pace import last_step, status_lines
    from .ui.progress import clock, status_training

    out_dir = ref.record.get("checkpoint_dir")
    if not isinstance(out_dir, str) or not out_dir:
        return []
    host, rank0, shared = ref.via(cluster), ref.nodes[0].host, ref.record.get("checkpoint_shared")
    if host is not rank0 and shared is not True:  # (its own disk, or a plan.json that does not say)
        return [f"checkpoint: not read: rank 0's host {rank0.name}, which writes {out_dir}, does not answer"
                + (", and no other host has it (not on shared storage)" if shared is False else "")]
    found = _run_dir_command(cluster, host, node_argv("resume-point", out_dir, "look"), out_dir)
    last = (found.stdout.strip().splitlines()[-1:] or [""])[0] if found.ok else ""
    read = _run_dir_command(cluster, host, ["bash", "-c", _TRAINING_READ, "ftb", out_dir, last, str(PACE_RECORDS),
                                            posixpath.join(ref.run_dir, PLAN), posixpath.join(out_dir, TRAINER_LOG),
                                            runs_dir(ref.shared_dir), str(ref.record.get("job") or ref.run_id),
                                            ref.run_id, json.dumps({"checkpoint_dir": out_dir})[1:-1]], out_dir)
    saved_at, now, logged_at, planned_at, later, log = (read.stdout.split("\n", 5) + [""] * 6)[:6]
    if later not in ("", "-"):  # (as `runs` and `plot` read only the newest run writing to an output_dir)
        return [f"training: not read: a later run of this job, {later}, writes the same output_dir {out_dir}: "
                f"its trainer log and checkpoints are that run's, not this one's"]
    ago = int(now) - int(saved_at) if saved_at.isdigit() and now.isdigit() else None
    said = []
    if logged_at.isdigit() and planned_at.isdigit() and earlier_run(int(logged_at), int(planned_at)):
        # (a fresh trainer removes it as it begins; one that resumes appends: until then it is not this run's)
        said, log = [f"training: no step logged by this run yet ({out_dir}/{TRAINER_LOG} was last written "
                     f"{clock(int(planned_at) - int(logged_at))} before it began: an earlier run's)"], ""
    elif log and logged_at.isdigit() and now.isdigit():
        said = status_training(log, SpeedBasis.from_record(ref.record.get("speed")), int(now) - int(logged_at))
    resumes = ref.record.get("resumes")
    line = checkpoint_status(out_dir, last or None, ago, last_step(log), running=running,
                             resumes=resumes if isinstance(resumes, bool) else None)
    return said + status_lines(log) + [line]


def format_status(ref: RunRef, states: list[tuple[NodePlan, str, str]]) -> list[str]:
    """The run's line, a row per node (up to STATUS_ROWS_MAX nodes; beyond, rows only for
    the nodes neither running nor exited 0), and the nodes grouped by state, as ranges."""
    attempt = f", attempt {ref.attempt}" if ref.attempt > 1 else ""
    lines = [f"run {ref.run_id}  ({shape_text([n.nproc for n in ref.nodes])}{attempt})  "
             f"{ref.run_dir}"]
    lines += [f"  {said}" for said in ref.attempts]  # (a lost host: which hosts each attempt ran on, and why)
    many = len(states) > STATUS_ROWS_MAX
    for node, state, last in states:
        if not many or state not in ("running", "exited 0"):
            lines.append(f"  node rank {node.rank:<3} {node.host.name:<20} {state:<12} {last[:100]}")
    groups: dict[str, list[NodePlan]] = {}
    for node, state, _ in states:
        groups.setdefault(state.split(" (")[0], []).append(node)
    lines.append("nodes: " + "; ".join(
        f"{state} {fold(n.host.name for n in nodes)} (node rank{'s' if len(nodes) > 1 else ''} "
        f"{fold_numbers(n.rank for n in nodes)})" for state, nodes in groups.items()))
    return lines


def _ended(cluster: Cluster, ref: RunRef) -> bool:
    """Whether the run's end is on record: its launcher's summary.json, or a detached run's watcher's
    ended.aN (whole: not the teller's claim alone). One read."""
    from .history import ended_record

    said = _run_dir_command(cluster, ref.via(cluster),
                            ["bash", "-c", 'if [ -e "$1" ]; then echo summary; else cat -- "$2" 2>/dev/null; fi; true',
                             "ftb", ref.rundir.summary, ref.rundir.ended(ref.attempt)], ref.rundir.summary)
    return said.stdout.strip() == "summary" or bool(ended_record(said.stdout).get("state"))


def stop_run(ref: RunRef, cluster: Cluster, out=None) -> int:
    """Ask every node to stop (a request file on shared storage for their watchers, and a
    stop on each host), then report what is left."""
    out = out or sys.stderr
    states = [state for _, state, _ in node_states(ref, cluster)]
    if states and all(s.startswith(("exited", "stopped")) for s in states):
        state = run_state(states)[0]
        if state != "finished" and not _ended(cluster, ref):
            # failed with no record of its end: its launcher may be between two attempts (a restart,
            # a lost host's wait), and would start the next one: it is told not to
            stage_files(cluster, ref.via(cluster), ref.run_dir, {STOP_REQUEST: "stop requested\n"})
            print(f"ftbundle: run {ref.run_id} has no node running (state: {state}) and no record of its end: if its "
                  "launcher is between attempts, it starts no other (stop-requested written)", file=out)
            return 0
        # over already: nothing to stop, and nothing written into its run directory
        print(f"ftbundle: run {ref.run_id} is not running (state: {state}): nothing to stop", file=out)
        return 0
    stage_files(cluster, ref.via(cluster), ref.run_dir, {STOP_REQUEST: "stop requested\n"})

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
    by_result: dict[str, list[NodePlan]] = {}
    for node, result in zip(ref.nodes, results):
        by_result.setdefault(result, []).append(node)
    for result, nodes in by_result.items():
        ranks = fold_numbers(n.rank for n in nodes)
        print(f"ftbundle: rank{'s' if len(nodes) > 1 else ''} {ranks} {fold(n.host.name for n in nodes)}: {result}",
              file=out)
    return 0 if set(by_result) <= {"stopped"} else 1
