"""Run history: every past run of a job, from the run directories on shared storage.

A run directory holds plan.json (written before launch), each node's exit file, and,
when the launching ftbundle saw the end, summary.json (state, exit code, duration, final
loss) and metrics.jsonl (the trainer's log records, for ``ftbundle plot``); a detached run's
watcher writes its end as it judged it (ended.aN: state, exit code, duration, loss, tokens/s).
Runs that ended with neither (the controller killed, still running) are judged from their exit
files and the trainer's log. The directory is read here when it is local, else through rank 0's host.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
from dataclasses import asdict, dataclass, field

from . import gpu_metrics
from .cluster import Cluster
from .errors import UserError
from .gpu_health import fold_findings, parse_xids_report, xid_findings
from .inventory import Host
from .protocol import parse_steps
from .recovery import attempts_said
from .remote.trainer_end import earlier_run, ends_figures, parse_records, read_ends, speed_figures
from .rundir import (ATTEMPT, ATTEMPTS, METRICS, PLAN, SUMMARY, TRACKER_RUNS, TRAINER_LOG, ended_name, node_glob,
                     node_name, runs_dir)
from .trackers import placed
from .ui import pace, stragglers

_RUN_ID = re.compile(r"^(?P<job>.+)-(?P<date>\d{8}-\d{6})-[0-9a-f]+$")
_HEADER = re.compile(r"^==> (.*) <==$")


def run_summary(plan, *, exit_code: int, interrupted: bool, attempt: int, started: float, duration_s: float,
                progress, failed_host: str | None, stalled: bool = False, requested: bool = False,
                failure: dict | None = None, launcher_lost: bool = False) -> dict:
    """summary.json's content. Pure. ``stalled``: the stall watchdog stopped the run (it
    made no progress for stall_timeout), which `ftbundle runs` lists as such, not "failed";
    ``requested``: `ftbundle stop` stopped it ("stopped", as a detached run so stopped);
    ``launcher_lost``: the nodes stopped their jobs themselves while the launcher was paused
    past their watchdog (as rank 0's teller says it: remote/tell.py)."""
    state = ("finished" if exit_code == 0 else "stopped" if requested else "interrupted" if interrupted
             else "stalled" if stalled else "stopped: launcher lost" if launcher_lost else "failed")
    return {
        "run_id": plan.run_id, "job": plan.job_name, "state": state, "exit_code": exit_code,
        "attempt": attempt, "started": started, "duration_s": round(duration_s, 1),
        "hosts": [n.host.name for n in plan.nodes], "nproc_per_node": plan.nproc_per_node,
        "steps": progress.shown_step, "total_steps": progress.total, "final_loss": progress.final_loss,
        "train_loss": progress.train_loss, "resumed_at": progress.start_step or None,
        "samples_per_s": progress.throughput(),  # (the live line's and the summary's figure)
        **speed_record(progress),
        "output_dir": plan.checkpoint_dir, "failed_host": failed_host,
        "failure": failure,  # (host, node rank, code and the line why: as `notify` and a detached run's end say it)
        # every node's median and p90 step compute time, and the stragglers named (ui.stragglers)
        "step_times": stragglers.as_record(progress.node_steps.values(), progress.straggler_factor),
        # each node's mean GPU utilization and peak memory, and what was named (ftbundle.gpu_metrics)
        "gpus": progress.gpus.record(),
        # where the whole run slowed against its own pace, and came back (ui.pace)
        "slowdowns": progress.pace.record(),
        # rank 0's word that its loss went nan or its model collapsed, the run let go on (divergence: warn)
        "diverged": progress.diverged,
    }


def speed_record(progress) -> dict:
    """summary.json's tokens and MFU (ftbundle.speed): None where they are not known."""
    tokens = progress.tokens_per_s()
    basis = progress.speed
    per = tokens / basis.ranks if tokens is not None and basis is not None and basis.ranks else None
    return {"tokens": progress.tokens_counted, "tokens_per_s": None if tokens is None else round(tokens, 1),
            "tokens_per_s_per_rank": None if per is None else round(per, 1),
            "tokens_padding": None if basis is None else basis.padding,
            "mfu": None if progress.mfu() is None else float(f"{progress.mfu():.4g}"),
            "mfu_basis": None if basis is None or not basis.gpus else basis.mfu_basis()}


@dataclass
class RunRow:
    run_id: str
    job: str
    hosts: list[str]
    start: str  # ISO 8601, UTC
    duration_s: float | None
    state: str
    exit_code: int | None
    final_loss: float | None
    output_dir: str | None
    failed_host: str | None = None  # the host whose failure ended it (the launcher's or a detached watcher's word)
    failure: str | None = None  # the line why it failed, as its launcher or watcher said it
    samples_per_s: float | None = None  # over the steps trained (ui.progress.Progress.throughput)
    tokens_per_s: float | None = None  # the trainer's token count over its clock (ftbundle.speed)
    tokens_per_s_per_rank: float | None = None  # per GPU on GPUs
    mfu: float | None = None  # model FLOPs utilization, 0-1 (GPU runs whose GPU and model are known)
    trackers: list[str] = field(default_factory=list)  # where its experiment trackers are (ftbundle.trackers)
    tracker_runs: dict | None = None  # the MLflow and W&B runs rank 0 logged to (trackers.json)
    staged: list[str] = field(default_factory=list)  # what `stage:` copied before it (ftbundle.stage)
    attempts: list[str] = field(default_factory=list)  # where each attempt after a lost host ran, and why
    step_times: dict | None = None  # every node's median and p90 step time, the stragglers (ui.stragglers)
    gpu_faults: list[str] = field(default_factory=list)  # the Xids logged during the run (gpu_health)
    gpus: dict | None = None  # each node's mean GPU utilization and peak memory (gpu_metrics)
    slowdowns: list[dict] = field(default_factory=list)  # where the whole run slowed, and came back (ui.pace)


def _start_of(run_id: str, summary: dict) -> str:
    if summary.get("started"):
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(summary["started"]))
    m = _RUN_ID.match(run_id)
    if m:
        d = m.group("date")
        return f"{d[0:4]}-{d[4:6]}-{d[6:8]}T{d[9:11]}:{d[11:13]}:{d[13:15]}"
    return ""


def run_row(run_id: str, files: dict[str, str]) -> RunRow | None:
    """One run's row from its files ({name in the run directory: text}). Pure."""
    try:
        plan = json.loads(files.get(PLAN) or "null")
    except ValueError:
        plan = "broken"
    if not isinstance(plan, dict):
        # a directory that is not a run: named (never picked as the latest by status or logs)
        m = _RUN_ID.match(run_id)
        if m is None:
            return None
        state = ("no run: plan.json is not valid JSON" if plan == "broken" else
                 "no run: no plan.json (refused or stopped before it was staged)")
        return RunRow(run_id, m.group("job"), [], _start_of(run_id, {}), None, state, None, None, None)
    try:
        summary = json.loads(files.get(SUMMARY) or "{}")
    except ValueError:
        summary = {"state": "summary.json is not valid JSON"}
    if not isinstance(summary, dict):
        summary = {"state": "summary.json holds no record"}
    hosts = [n["host"] for n in plan.get("nodes", [])]
    attempt = (files.get(ATTEMPT) or "1").strip()  # (the newest)
    ended = {} if summary else ended_record(files.get(ended_name(attempt)))
    if summary:
        state, code = summary.get("state", "?"), summary.get("exit_code")
    else:  # judged from the nodes' exit files (of the newest attempt), and its watcher's word
        codes = []
        for rank in range(len(hosts)):
            text = (files.get(node_name(rank, attempt, "exit")) or "").strip()
            codes.append(int(text) if text.lstrip("-").isdigit() else None)
        failed = [c for c in codes if c not in (None, 0)]
        stopped = [files.get(node_name(rank, attempt, "stopped"), "").strip() for rank in range(len(hosts))]
        why = next((w for w in stopped if w), "")
        if why:  # a node stopped its job by itself: the launcher was gone
            state, code = "stopped: " + why.split(":", 1)[0], failed[0] if failed else None
        elif failed:
            state, code = "failed", failed[0]
        elif codes and all(c == 0 for c in codes):
            state, code = "finished", 0
        else:
            state, code = "running?", None
        if ended and not why:  # (a node's own reason to stop its job, as "stopped: storage ...", says more)
            state, code = str(ended.get("state") or state), ended.get("exit_code", code)
        summary = ended
    try:
        attempts = summary.get("attempts") or json.loads(files.get(ATTEMPTS) or "[]")
    except ValueError:
        attempts = []
    try:
        kept = json.loads(files.get(TRACKER_RUNS) or "{}")
    except ValueError:
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    return RunRow(run_id=run_id, job=plan.get("job", ""), hosts=hosts, start=_start_of(run_id, summary),
                  duration_s=summary.get("duration_s"), state=state, exit_code=code,
                  final_loss=summary.get("final_loss"), output_dir=plan.get("checkpoint_dir"),
                  failed_host=summary.get("failed_host"), failure=_failure_line(summary),
                  samples_per_s=summary.get("samples_per_s"), tokens_per_s=summary.get("tokens_per_s"),
                  tokens_per_s_per_rank=summary.get("tokens_per_s_per_rank"), mfu=summary.get("mfu"),
                  trackers=placed([str(t) for t in plan.get("trackers") or []], kept),
                  tracker_runs=kept or None,
                  staged=[str(s.get("said")) for s in plan.get("staged") or [] if isinstance(s, dict)],
                  step_times=summary.get("step_times") or steps_of(files, plan, attempt),
                  gpu_faults=summary.get("gpu_faults") or fold_findings(faults_of(files, plan, attempt)),
                  attempts=attempts_said(attempts if isinstance(attempts, list) else []),
                  gpus=summary.get("gpus") if isinstance(summary.get("gpus"), dict) else gpus_of(files, plan, attempt),
                  slowdowns=pace.recorded(summary.get("slowdowns")))


def ended_record(text: str | None) -> dict:
    """A detached run's end as its watcher judged it (ended.aN's text: remote/watch.py end), {} where
    there is none or it is not whole yet (the teller's claim, its host's name). Pure."""
    try:
        ended = json.loads(text or "{}")
    except ValueError:
        return {}
    return ended if isinstance(ended, dict) else {}


def ended_lines(ended: dict) -> list[str]:
    """`status`'s word of a detached run's end as its watcher judged it, or of an attached run's
    whose launcher was lost as its rank 0 said it (ended_record): its state, duration, and the
    failure it stopped on. Pure."""
    from .ui.progress import clock

    if not ended.get("state"):
        return []
    took = ended.get("duration_s")
    head = f"ended: {ended['state']}" + (f" after {clock(took)}" if isinstance(took, (int, float)) else "")
    failure = ended.get("failure") if isinstance(ended.get("failure"), dict) else {}
    if failure.get("line"):
        head += f": {failure.get('host') or 'a node'} ({failure['line']})"
    if not ended.get("told_by"):
        return [head]
    if ended.get("detached") is False:  # (an attached run whose launcher was lost: remote/tell.py)
        return [head + f"; said by {ended['told_by']} (rank 0), its launcher gone"]
    return [head + f"; judged by {ended['told_by']}'s watcher"]


def diverged_lines(text: str | None, ended: dict) -> list[str]:
    """`status`'s word of the ranks' verdict on a run whose loss went nan or whose model collapsed
    (diverged.aN: shims/steptimes.py): said when the run went on (divergence: warn), or when it
    stopped and no end record says it already. Pure."""
    from .remote.watch_rules import diverged_record

    record = diverged_record(text)
    if record is None:
        return []
    said = record["said"]
    if record.get("action") == "warn":
        return [f"diverged: {said} (divergence: warn: the run went on)"]
    failure = ended.get("failure") if isinstance(ended.get("failure"), dict) else {}
    return [] if said in str(failure.get("line") or "") else [f"diverged: {said}: its ranks stopped the run"]


def step_nodes(files: dict[str, str], plan: dict, attempt) -> tuple[list, float]:
    """A detached run's nodes' step figures (ui.stragglers.NodeSteps) from the step times each
    node's watcher kept in the run directory (node-R.aN.steps: remote/watch.py keep_steps), on the
    hosts plan.json names, and its straggler_factor. Pure."""
    found = []
    for entry in plan.get("nodes", []):
        text = files.get(node_name(entry.get('rank'), attempt, "steps"))
        node = stragglers.node_steps(entry.get("host", "?"), parse_steps(text or ""))
        if node is not None:
            found.append(node)
    return found, float(plan.get("straggler_factor") or stragglers.STRAGGLER_FACTOR)


def steps_of(files: dict[str, str], plan: dict, attempt) -> dict | None:
    """A detached run's ``step_times`` record, as an attached run's summary.json holds it. Pure."""
    return stragglers.as_record(*step_nodes(files, plan, attempt))


def gpus_of(files: dict[str, str], plan: dict, attempt) -> dict | None:
    """A detached run's ``gpus`` record (as an attached run's summary.json holds it: each node's
    mean utilization and peak memory; nothing named, no launcher watched) from what each node's
    watcher kept (node-R.aN.gpumetrics: remote/watch.py keep_gpus). Pure."""
    nodes = {}
    for entry in plan.get("nodes", []):
        try:
            kept = json.loads(files.get(node_name(entry.get("rank"), attempt, "gpumetrics")) or "null")
        except ValueError:
            continue
        if isinstance(kept, dict):
            nodes[entry.get("host", "?")] = {k: kept.get(k) for k in ("gpus", "util_mean", "mem_peak_mib",
                                                                         "mem_total_mib", "readings")}
    return {"nodes": nodes, "named": []} if nodes else None


def faults_of(files: dict[str, str], plan: dict, attempt) -> list:
    """A detached run's GPU faults (gpu_health findings; folded, what a failed attached run's
    summary.json holds) from the Xid lines each node's watcher kept in the run directory
    (node-R.aN.xids: node.sh ftb_xids), on the hosts plan.json names. Pure."""
    found = []
    for entry in plan.get("nodes", []):
        text = files.get(node_name(entry.get('rank'), attempt, "xids"))
        if text:
            gpus, xids = parse_xids_report(text)
            found += xid_findings(entry.get("host", "?"), gpus, xids, window_s=float("inf"))
    return found


def split_tail_output(text: str, runs_dir: str) -> dict[str, dict[str, str]]:
    """`tail -v -n +1 -- FILES` output -> {run id: {file name: text}}. Pure."""
    out: dict[str, dict[str, str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        m = _HEADER.match(line.rstrip("\n"))
        if m:
            rel = posixpath.relpath(m.group(1), runs_dir)
            run_id, _, name = rel.partition("/")
            current = []
            out.setdefault(run_id, {})[name] = current  # type: ignore[assignment]
            continue
        if current is not None:
            current.append(line)
    return {run: {name: "".join(lines).rstrip("\n") + "\n" for name, lines in files.items()}
            for run, files in out.items()}


def read_run_files(cluster: Cluster | None, host: Host | None, runs_dir: str,
                   patterns: tuple[str, ...], *, here: bool | None = None) -> dict[str, dict[str, str]]:
    """{run id: {file name: text}} for files matching ``patterns`` in each run directory:
    read here when the directory is (``here``: None = when it exists here), else in one
    round trip through ``host``."""
    import fnmatch

    if here is None:  # no host to read through: the runs are here, or there are none yet
        here = os.path.isdir(runs_dir) or cluster is None or host is None
    if here:
        out: dict[str, dict[str, str]] = {}
        if not os.path.isdir(runs_dir):
            return out  # no run has made it yet
        for run_id in sorted(os.listdir(runs_dir)):
            directory = os.path.join(runs_dir, run_id)
            if not os.path.isdir(directory):
                continue
            out.setdefault(run_id, {})  # (an empty one too: `runs` names it)
            for name in os.listdir(directory):
                if any(fnmatch.fnmatch(name, p) for p in patterns):
                    try:
                        with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                            out.setdefault(run_id, {})[name] = f.read()
                    except OSError:
                        pass
        return out
    if cluster is None or host is None:
        raise UserError(f"{runs_dir} is not on this machine and there is no host to read it through")
    argv = ["find", runs_dir, "-mindepth", "2", "-maxdepth", "2", "-type", "f", "("]
    for i, pattern in enumerate(patterns):
        argv += (["-o"] if i else []) + ["-name", pattern]
    argv += [")", "-exec", "tail", "-v", "-n", "+1", "--", "{}", "+"]
    result = cluster.run(host, argv, timeout=60)
    return split_tail_output(result.stdout, runs_dir)


def list_runs(job_name: str | None, shared_dir: str, cluster: Cluster | None = None,
              host: Host | None = None) -> list[RunRow]:
    """Every run of ``job_name`` (every job's, with None), oldest first."""
    files = read_run_files(cluster, host, runs_dir(shared_dir),
                           (PLAN, SUMMARY, node_glob("*", "exit"), node_glob("*", "stopped"), ATTEMPT, ATTEMPTS,
                            node_glob("*", "steps"), node_glob("*", "xids"), node_glob("*", "gpumetrics"),
                            TRACKER_RUNS, ended_name("*")))
    rows = []
    for run_id in sorted(files):
        row = run_row(run_id, files[run_id])
        if row is not None and (job_name is None or row.job == job_name):
            rows.append(row)
    where = runs_dir(shared_dir)
    unrecorded = [r.run_id for r in rows if r.hosts and r.duration_s is None]
    if unrecorded:  # (running, or its launcher lost: no summary.json nor ended.aN, the trainer's log says)
        here = os.path.isdir(where) or cluster is None or host is None
        ends = read_trainer_ends(rows, unrecorded, where, None if here else cluster, None if here else host)
        for row in rows:
            if row.run_id in ends:
                fill_from_trainer(row, ends[row.run_id], files[row.run_id].get(PLAN, ""))
    if any(r.state == "running?" for r in rows) and disk_full(where, cluster, host):
        # no record and no exit written: on a full disk none could be (status says the same)
        read_here = os.path.isdir(where) or cluster is None or host is None
        for row in rows:
            if row.state == "running?":
                row.state = enospc_state(where, None if read_here else host.name)
    return sorted(rows, key=lambda r: (r.start, r.run_id))


def enospc_state(path: str, host: str | None) -> str:
    """A run stopped by a full disk, as node.sh's mode_state says it: where, and on which host
    (None: read on this machine)."""
    return f"stopped: no space left on {path}" + (f" on {host}" if host else "") + " (ENOSPC)"
DISK_FULL_KIB = 64  # as node.sh ftb_disk_full


def disk_full(path: str, cluster: Cluster | None, host: Host | None) -> bool:
    """Whether the filesystem under ``path`` has less than DISK_FULL_KIB free: here, or asked
    of ``host`` (2 s at most: a frozen network filesystem is not full)."""
    if os.path.isdir(path) or cluster is None or host is None:
        try:
            st = os.statvfs(path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize // 1024 < DISK_FULL_KIB
    try:
        result = cluster.run(host, ["timeout", "2", "stat", "-f", "-c", "%a %S", "--", path], timeout=5)
        free, size = (int(x) for x in result.stdout.split())
    except Exception:  # noqa: BLE001 - not known: not full
        return False
    return free * size // 1024 < DISK_FULL_KIB


def format_runs(rows: list[RunRow]) -> str:
    """The table `ftbundle runs` prints. Pure."""
    def dur(s):
        if s is None:
            return "-"
        m, sec = divmod(int(s), 60)
        h, m = divmod(m, 60)
        return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"

    header = ("RUN", "HOSTS", "START", "DURATION", "STATE", "EXIT", "FINAL LOSS", "SAMPLES/S", "TOKENS/S",
              "PER RANK", "MFU", "GPU", "OUTPUT DIR")
    table = [header] + [(
        r.run_id, ",".join(r.hosts) if len(r.hosts) <= 3 else f"{r.hosts[0]},+{len(r.hosts) - 1}",
        r.start.replace("T", " "), dur(r.duration_s), r.state, "-" if r.exit_code is None else str(r.exit_code),
        "-" if r.final_loss is None else f"{r.final_loss:.4f}",
        "-" if r.samples_per_s is None else f"{r.samples_per_s:.1f}",
        "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
        "-" if r.tokens_per_s_per_rank is None else f"{r.tokens_per_s_per_rank:,.0f}",
        "-" if r.mfu is None else f"{r.mfu:.1%}", gpu_metrics.runs_cell(r.gpus), r.output_dir or "-") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i and rows[i - 1].failure:  # (the line why, as the run's end said it: not only in --json)
            lines.append(f"  failed on {rows[i - 1].failed_host or 'a node'}: {rows[i - 1].failure}")
        lines += [f"  {said}" for said in (rows[i - 1].attempts if i else [])]  # (under its run: a lost host)
        lines += [f"  tracker: {where}" for where in (rows[i - 1].trackers if i else [])]
        lines += [f"  {said}" for said in (rows[i - 1].staged if i else [])]
        lines += [f"  slowed {pace.said(s)}" for s in (rows[i - 1].slowdowns if i else [])]
    return "\n".join(lines)


def _failure_line(summary: dict) -> str | None:
    failure = summary.get("failure")
    line = failure.get("line") if isinstance(failure, dict) else None
    return line if isinstance(line, str) else None


def runs_json(rows: list[RunRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


def read_metrics(run_ids: list[str], shared_dir: str, cluster: Cluster | None = None,
                 host: Host | None = None) -> dict[str, list[dict]]:
    """{run id: trainer log records} for the runs asked for (those that have any); a run of
    several attempts (a restart, a lost host) gives one curve per attempt: {"RUN attempt N": ...}."""
    files = read_run_files(cluster, host, runs_dir(shared_dir), (METRICS,))
    out = {}
    for run_id in run_ids:
        records = parse_records(files.get(run_id, {}).get(METRICS, ""))
        attempts = sorted({r.get("attempt", 1) for r in records}, key=lambda a: (str(type(a)), a))  # (2 before 10)
        if len(attempts) > 1:
            for n in attempts:
                out[f"{run_id} attempt {n}"] = [r for r in records if r.get("attempt", 1) == n]
        elif records:
            out[run_id] = records
    return out


# a trainer log thinned to at most $2 lines, evenly, its first and last kept (a week's at one record a
# second is about 180 MB: the plot needs no more points than a finished run's metrics.jsonl holds)
_THINNED = r'''f=$1 max=$2
[ -r "$f" ] || exit 3
echo "$(stat -c %Y -- "$f") $(stat -c %Y -- "$3" 2>/dev/null || echo -)"
n=$(wc -l < "$f")
exec awk -v s=$(( n / max + 1 )) -v n="$n" 'NR == 1 || NR % s == 0 || NR == n' "$f"'''


def read_trainer_logs(rows: list[RunRow], run_ids: list[str], runs_at: str, cluster: Cluster | None = None,
                      host: Host | None = None) -> dict[str, tuple[str, list[dict]]]:
    """{run id: (the log's path, its records)} from output_dir's trainer_log.jsonl, for the runs
    asked for that have no metrics.jsonl: a detached run (no launcher writes one), one still
    running, one whose launcher was lost. Only for the newest of ``rows`` writing to that
    output_dir (a later run's records are not an older run's), and only a log written since the run
    began (an earlier run's left there is not its), at most RECORDS_MAX records, evenly thinned.
    Read here when it is on this machine (``runs_at``: the runs' directory), else through ``host``."""
    from .ui.progress import RECORDS_MAX

    out = {}
    for run_id, (path, plan) in _newest_writers(rows, run_ids, runs_at).items():
        if cluster is None or host is None:  # (the runs are on this machine: history_source)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            if not _this_runs(path, plan):
                continue
            stride = len(lines) // RECORDS_MAX + 1
            text = "\n".join(line for i, line in enumerate(lines, 1)
                              if i == 1 or i % stride == 0 or i == len(lines))
        else:
            try:
                result = cluster.run(host, ["bash", "-c", _THINNED, "ftb", path, str(RECORDS_MAX), plan], timeout=60)
            except Exception:  # noqa: BLE001 - the plot says the run has no records
                continue
            stamps, _, text = result.stdout.partition("\n")
            if not result.ok or not _stamps(stamps):
                continue
        records = parse_records(text)
        if records:
            out[run_id] = (path, records)
    return out


# LOG PLAN pairs: each log's header, the two files' change times, its first line and last ones
_ENDS = r'''while [ $# -ge 2 ]; do f=$1 p=$2; shift 2; [ -r "$f" ] || continue; echo "==> $f <=="
echo "$(stat -c %Y -- "$f") $(stat -c %Y -- "$p" 2>/dev/null || echo -)"; head -n 1 -- "$f"; tail -n 3 -- "$f"
done; true'''


def _newest_writers(rows: list[RunRow], run_ids: list[str], runs_at: str) -> dict[str, tuple[str, str]]:
    """{run id: (its trainer log's path, its plan.json's)} for the runs asked for that are the newest
    of ``rows`` to write to their output_dir (a later run's records are not an older run's)."""
    newest = {row.output_dir: row.run_id for row in rows if row.output_dir}  # (rows: oldest first)
    return {row.run_id: (posixpath.join(row.output_dir, TRAINER_LOG), posixpath.join(runs_at, row.run_id, PLAN))
            for row in rows if row.run_id in run_ids and row.output_dir and newest[row.output_dir] == row.run_id}


def _this_runs(log: str, plan: str) -> bool:
    """Whether the trainer log here was written since its run began (trainer_end.earlier_run)."""
    try:
        return not earlier_run(os.stat(log).st_mtime, os.stat(plan).st_mtime)
    except OSError:
        return True  # (no plan.json to compare with: the log is read, or not, as before)


def _stamps(line: str) -> bool:
    """The `stat` line the bash readers print before a log: "LOG_MTIME PLAN_MTIME" -> this run's?"""
    logged, _, planned = line.partition(" ")
    return not (logged.isdigit() and planned.isdigit() and earlier_run(int(logged), int(planned)))


def read_trainer_ends(rows: list[RunRow], run_ids: list[str], runs_at: str, cluster: Cluster | None = None,
                      host: Host | None = None) -> dict[str, list[dict]]:
    """{run id: its trainer log's first record and last ones} for the runs asked for (the newest
    writer of their output_dir, a log written since the run began): what `runs` says of a run that
    has no summary.json. One round trip through ``host`` for all of them, else read here."""
    paths = _newest_writers(rows, run_ids, runs_at)
    if cluster is None or host is None:  # (its first line, and its end: a week's log is 180 MB)
        return {run_id: records for run_id, (log, plan) in paths.items()
                if (records := read_ends(log)) and _this_runs(log, plan)}
    texts: dict[str, str] = {}
    if paths:
        try:
            result = cluster.run(host, ["bash", "-c", _ENDS, "ftb", *(p for pair in paths.values() for p in pair)],
                                 timeout=30)
        except Exception:  # noqa: BLE001 - the rows keep what their run directories say
            return {}
        path = stamped = None
        for line in result.stdout.splitlines():
            if line.startswith("==> ") and line.endswith(" <=="):
                path, stamped = line[4:-4], False
            elif path is not None and not stamped:
                stamped = True
                if _stamps(line):
                    texts[path] = ""
            elif path in texts:
                texts[path] += line + "\n"
    return {run_id: records for run_id, (log, _) in paths.items() if (records := parse_records(texts.get(log, "")))}


def fill_from_trainer(row: RunRow, records: list[dict], plan_text: str) -> None:
    """A run without summary.json: its final loss and tokens/s (per rank, and MFU on GPUs) from its
    trainer log's first and last records, as the launcher's closing summary counts them
    (remote/trainer_end.py), against the speed basis plan.json keeps (ftbundle.speed)."""
    figures = ends_figures(records)
    row.final_loss, row.tokens_per_s = figures["final_loss"], figures["tokens_per_s"]
    try:
        plan = json.loads(plan_text)
        speed = plan.get("speed") or {}
        ranks, per_token_s = int(speed.get("ranks") or plan.get("world_size") or 0), speed.get("mfu_per_token_s")
    except (ValueError, TypeError, AttributeError):
        ranks, per_token_s = 0, None
    speeds = speed_figures(row.tokens_per_s, ranks, per_token_s if isinstance(per_token_s, (int, float)) else None)
    row.tokens_per_s_per_rank, row.mfu = speeds["tokens_per_s_per_rank"], speeds["mfu"]
