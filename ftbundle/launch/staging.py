"""Staging: the files a run needs, written into its run directory on shared storage before any
node starts, in one round trip through rank 0's host (every node sees the same directory)."""

from __future__ import annotations

import io
import tarfile
import time

from .. import rundir
from ..cluster import Cluster, HostUnreachable, first_line
from ..inventory import Host
from ..plan import Plan
from .node import node_argv
from .stall import collector_source, teller_source, watcher_source


class StagingError(RuntimeError):
    """The run directory could not be written (nothing was started). ``refused``: the shared
    storage has less free space than a run needs (a refusal like the check's: exit 2)."""

    def __init__(self, message: str, *, refused: bool = False):
        super().__init__(message)
        self.refused = refused


NO_SPACE = 28  # the node program's `stage` refused: less free space than min_free_mb (ENOSPC's number)


MIN_FREE_MB = 64  # a run is not started on a shared directory with less free space than this


def stage_files(cluster: Cluster, host: Host, directory: str, files: dict[str, str],
                leftovers: tuple[str, ...] = (), timeout: float = 60, min_free_mb: int = 0) -> None:
    """Write files into a directory on shared storage, in one round trip through ``host``
    (rank 0's: every node sees the same directory); ``leftovers`` (paths on that host, the
    check's sentinels) are removed in the same command. Each file is written whole or not
    at all (renamed into place). With ``min_free_mb``, a filesystem with less free space
    is refused before anything is written."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    try:
        result = cluster.run(host, node_argv("stage", directory, str(min_free_mb), *leftovers), stdin=buf.getvalue(),
                             timeout=timeout)
    except (HostUnreachable, TimeoutError) as exc:
        raise StagingError(f"could not write {directory} through {host.name}: {first_line(exc)}") from exc
    if not result.ok:
        raise StagingError(f"could not write {directory} on {host.name}: {result.stderr.strip() or result.code}",
                           refused=result.code == NO_SPACE and min_free_mb > 0)


def stage_run_dir(cluster: Cluster, plan: Plan, leftovers: tuple[str, ...] = (), *, detach: bool = False,
                  tell: bool = True) -> None:
    """The run directory: the staged files, plan.json (redacted) and the attempt number; with
    ``detach``, the detached watcher every node starts beside its job (remote/watch.py); else,
    with ``tell`` (a run, not a check's load), rank 0's word if its launcher is lost (remote/tell.py)."""
    import json

    files = dict(plan.files)
    files[rundir.PLAN] = json.dumps(plan.to_dict(redact=True), indent=2) + "\n"
    files[rundir.ATTEMPT] = "1\n"
    if plan.stall_timeout:  # a detached run's nodes collect their stacks with it (remote/watch.py)
        files[rundir.STACKS_PROGRAM] = collector_source().decode()
    if detach:
        files[rundir.WATCHER_PROGRAM] = watcher_source()
    elif tell:
        files[rundir.TELLER_PROGRAM] = teller_source()
    stage_files(cluster, plan.nodes[0].host, plan.run_dir, files, leftovers, min_free_mb=MIN_FREE_MB)
