"""The failing rank's own story, after a run failed: which local rank, its exit code or
signal, and its own Python traceback.

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
from ..plan import ATTEMPT_FILE, Plan
from ..runtimes import RANKS_DIR
from ..ui.summary import RankError, before_torchrun_report, last_words, parse_error_file, traceback_from_stderr

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
    newer = posixpath.join(plan.run_dir, ATTEMPT_FILE)
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
    ranks_dir = posixpath.join(plan.run_dir, RANKS_DIR, f"node-{rank}")
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
