"""The failing rank's own story, after a run failed: which local rank, its exit code or
signal, and its own Python traceback; and the words around it (:func:`exit_reason`,
:func:`unreachable_note`) and the end of the node's log (:func:`read_tail`).

torchrun's ChildFailedError report at the end of the node's log names the root cause
(global rank, local rank, exit code, error file). The traceback comes from torch elastic's
error file (``@record`` in the LlamaFactory entry shim writes it), else from that rank's
own stderr file (torchrun's ``--log-dir`` in the run directory), else from the node log.
Files are read here when the run directory is local, else through the node's host.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

from ..cluster import Cluster
from ..plan import Plan
from ..remote.watch_rules import diverged_said
from ..ui.summary import (RankError, before_torchrun_report, describe_exit, last_words, parse_error_file,
                          traceback_from_stderr)
from .node import WATCHDOG_S

_ROOT = re.compile(r"Root Cause \(first observed failure\):")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_PREFIX = re.compile(r"^\[[^\]\s]+ r\d+\] ")  # "[node0 r0] ", as the terminal shows a node's lines
_ERROR_FILE = re.compile(r"^\s*error_file\s*:\s*(\S+)")


@dataclass
class RankFailure:
    global_rank: int | None = None
    local_rank: int | None = None
    code: int | None = None
    error_file: str | None = None
    error: RankError | None = None
    traceback: str | None = None
    # no traceback: (its stderr file, or None for the node log; its last lines there)
    last_words: tuple[str | None, list[str]] | None = None


def parse_root_cause(lines: list[str]) -> RankFailure:
    """torchrun's "Root Cause (first observed failure)" block, from the end of a node log."""
    found = RankFailure()
    start = max((i for i, line in enumerate(lines) if _ROOT.search(line)), default=None)
    if start is None:
        return found
    for line in lines[start:]:
        line = line.split("] ", 1)[-1] if line.startswith("[") and "] " in line[:40] else line
        if (m := _RANK.match(line)) and found.global_rank is None:
            found.global_rank, found.local_rank = int(m.group(1)), int(m.group(2))
        elif (m := _EXIT.match(line)) and found.code is None:
            found.code = int(m.group(1))
        elif (m := _ERROR_FILE.match(line)) and found.error_file is None and m.group(1) != "<N/A>":
            found.error_file = m.group(1)
    return found


def cause_line(found: RankFailure, node_code: int | None) -> str | None:
    """The failing rank in a line, added to its node's reason where it is read later (summary.json's
    failure, `ftbundle runs`, a webhook): torchrun exits 1 whatever its rank did, so "exited with
    code 1" alone hides the rank's own code and exception. None when torchrun named no rank."""
    if found.global_rank is None:
        return None
    who = f"rank {found.global_rank}" + (f" (local rank {found.local_rank})" if found.local_rank is not None else "")
    line = f"{who}: {describe_exit(found.code if found.code is not None else node_code)}"
    raised = found.error.message if found.error is not None and found.error.message else None
    if raised is None and found.traceback:
        raised = next((t.strip() for t in reversed(found.traceback.splitlines()) if t.strip()), None)
    if raised:
        raised = " ".join(raised.split())
        line += f"; {raised[:197] + '...' if len(raised) > 200 else raised}"
    return line


def _reader(plan: Plan, cluster: Cluster, rank: int):
    """A host to read the run directory through, when it is not visible here: any other
    node's (shared storage; the failing node's own host may be the one that is gone), else
    the failing node's. None: read here (or nowhere)."""
    if os.path.isdir(plan.run_dir):
        return None  # the shared storage is mounted here: what is not here does not exist
    hosts = [n.host for n in plan.nodes if n.rank != rank] + [plan.nodes[rank].host]
    return next((h for h in dict.fromkeys(hosts) if cluster.alive(h)), None)


def _read(plan: Plan, cluster: Cluster, rank: int, path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-256 * 1024:]
    except OSError:
        pass
    host = _reader(plan, cluster, rank)
    if host is None:
        return None
    try:
        result = cluster.run(host, ["tail", "-c", str(256 * 1024), "--", path], timeout=10)
    except Exception:
        return None
    return result.stdout if result.ok else None


def _find(plan: Plan, cluster: Cluster, rank: int, directory: str, name: str) -> list[str]:
    """Files called ``name`` under ``directory`` written during this attempt."""
    newer = plan.rundir.attempt
    if os.path.isdir(plan.run_dir):
        since = os.path.getmtime(newer) if os.path.exists(newer) else 0
        return sorted(os.path.join(d, name) for d, _, files in os.walk(directory)
                      if name in files and os.path.getmtime(os.path.join(d, name)) >= since)
    host = _reader(plan, cluster, rank)
    if host is None:
        return []
    try:
        result = cluster.run(host, ["find", directory, "-name", name, "-newer", newer], timeout=10)
    except Exception:
        return []
    return sorted(result.stdout.split())


def rank_failure(plan: Plan, cluster: Cluster, rank: int, tail: list[str]) -> RankFailure:
    """What the failing node's failing rank said; every field may stay unknown."""
    found = parse_root_cause(tail)
    ranks_dir = plan.rundir.rank_logs(rank)
    candidates = [found.error_file] if found.error_file else _find(plan, cluster, rank, ranks_dir, "error.json")
    errors = []
    for path in candidates:
        text = _read(plan, cluster, rank, path)
        local = posixpath.basename(posixpath.dirname(path))
        error = parse_error_file(text or "", int(local) if local.isdigit() else None)
        if error is not None:
            errors.append(error)
    if errors:
        found.error = min(errors, key=lambda e: e.timestamp)  # the first to fail is the cause
        if found.local_rank is None:
            found.local_rank = found.error.local_rank
    elif found.local_rank:  # a local rank other than 0 wrote to its own stderr file
        for path in _find(plan, cluster, rank, ranks_dir, "stderr.log"):
            if posixpath.basename(posixpath.dirname(path)) == str(found.local_rank):
                text = _read(plan, cluster, rank, path) or ""
                found.traceback = traceback_from_stderr(text)
                if found.traceback is None and last_words(text):
                    found.last_words = (path, last_words(text))
    if found.error is None and found.traceback is None and found.last_words is None:
        own = [_PREFIX.sub("", line) for line in tail]
        found.traceback = traceback_from_stderr("\n".join(own))
        said = before_torchrun_report(own) if found.traceback is None and not found.local_rank else None
        if said and last_words("\n".join(said)):
            found.last_words = (None, last_words("\n".join(said)))
    return found


def read_diverged(plan: Plan, cluster: Cluster, attempt: int) -> str | None:
    """What the ranks said when they stopped this attempt because its loss went nan or its model
    collapsed (diverged.aN, written by global rank 0's callback before every rank raised:
    shims/steptimes.py); None when they did not."""
    return diverged_said(_read(plan, cluster, 0, plan.rundir.diverged(attempt)))


# ---------------------------------------------------------------------------------------
# The words for a failure and the log it points to


def exit_reason(code: int) -> str:
    if code > 128 and code - 128 in (9, 15, 2, 6, 11):
        names = {9: "SIGKILL", 15: "SIGTERM", 2: "SIGINT", 6: "SIGABRT", 11: "SIGSEGV"}
        return f"exited with code {code} ({names[code - 128]})"
    return f"exited with code {code}"


def unreachable_note(unreachable: list[str], slow: list[str]) -> str:
    """Why nodes were not confirmed stopped: the hosts that could not be reached, and those
    that answer but did not confirm in time."""
    from ..hostlist import fold

    notes = []
    if unreachable:
        notes.append(f"could not reach {fold(unreachable)} (its own "
                     f"watchdog stops its job within {WATCHDOG_S}s of losing the controller)")
    if slow:
        notes.append(f"{fold(slow)} did not confirm its stop in time "
                     "(its host answers; its job's processes were sent a stop of their own; "
                     "`ftbundle status` shows what is left)")
    return "; ".join(notes)


def read_tail(plan: Plan, cluster: Cluster, rank: int, path: str, lines: int, *,
              lost: bool = False) -> list[str] | None:
    """The end of a file on shared storage: here if we can, else through the node's own
    host, else through any other reachable host. ``lost``: the node's host is likely cut
    off (its transport may not know it yet), so it is asked last, not first."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        pass
    others = [n.host for n in plan.nodes if n.rank != rank]
    hosts = others + [plan.nodes[rank].host] if lost else [plan.nodes[rank].host] + others
    for host in dict.fromkeys(hosts):
        if not cluster.alive(host):
            continue
        try:
            result = cluster.run(host, ["tail", "-n", str(lines), "--", path], timeout=5)
        except Exception:
            continue
        if result.ok:
            return result.stdout.splitlines()
    return None
