"""Hung storage, or a host too busy to run the reading: the one rule, read from the kernel.

A reading of shared storage (a ``stat`` of a name never used, in a child process) that has not
answered after a few seconds has two very different causes. A hung network filesystem (an NFS
server gone, a frozen sshfs) holds the child in the kernel, inside the filesystem: asleep
(state S; sshfs/FUSE in ``request_wait_answer``) or, after a signal or on NFS, in D
(``rpc_wait_bit_killable``, ``nfs_*``), for as long as the freeze lasts. A host whose CPUs are
taken (256 hosts' probes on 2 cores, load 140) has not even run the child yet: it is runnable
(R), or has not reached its ``exec`` while it runs, and its storage may be a local disk that
answers at once. (A child held before its ``exec``, asleep in the kernel, is judged by its state and
wait as any other: the node program's expands globs of the shared storage there: node.sh ``ftb_why``.)
Only the first is the storage. So it is named only on that evidence: the child blocked in the
kernel (S or D), not in a wait of this host's own disks or memory, while a control (the child's
own ``stat`` of a name under /tmp, made just before; or the node program, which reads the
child's state) shows the host runs what it is given. Everything else is the host starved: worth
a warning, and a bounded longer wait, never the storage's name.

Standard library, no imports: shipped with the probe (ftbundle/check/__init__.py,
``probe_source``) and imported by the launcher (ftbundle/launch/storage.py), which words what
node programs report (node.sh, ``ftb_why``).
"""

HUNG, STARVED, WAITING = "hung", "starved", "waiting"
# Where a process waits in the kernel for this host's own block devices or memory (a page of its
# program read from a busy local disk, reclaim): a busy host, not a shared filesystem. (A wait
# inside the filesystem, or on a lock of a directory there that a process stuck in it holds,
# shows a name of that filesystem or of the lock: fuse_*, request_wait_answer, nfs_*, rpc_*,
# rwsem_down_*.)
HOST_WAITS = ("io_schedule", "folio_wait", "wait_on_page", "bit_wait_io", "blk_", "balance_dirty_pages",
              "throttle_direct_reclaim", "reclaim", "congestion_wait", "compaction", "kswapd")


def storage_verdict(state, wchan, control, seconds, slow_s):
    """HUNG, STARVED or WAITING, for a reading of storage not answered for ``seconds``.

    ``state``: the reading's process's state letter from /proc/PID/stat (R, S, D, ...), or None
    when it cannot be seen or has not reached its program (not exec'd yet); ``wchan``: where it
    waits (/proc/PID/wchan; "0" or "" when running or not shown); ``control``: whether a reading
    of this host's own disk, asked at the same time, has answered. WAITING: not slow yet, or the
    reading just ended (Z, gone): look again."""
    if seconds < slow_s or state in ("Z", "X", "x"):
        return WAITING
    if control and state in ("S", "D") and not any(w in (wchan or "") for w in HOST_WAITS):
        return HUNG
    return STARVED


def read_process(pid):
    """(state, wchan, program) of process ``pid`` from /proc; (None, "", "") when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        return None, "", ""
    program = stat[stat.find("(") + 1:stat.rfind(")")]
    return (stat[stat.rfind(")") + 2:] or "?")[0], wchan, program


def read_load():
    """The 1-minute load average, or None."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def waits_in(state, wchan):
    """How the reading's process was seen, in words: `runnable (R)`, `asleep in request_wait_answer (S)`."""
    if state is None:
        return "not started"
    if state == "R":
        return "runnable (R), not run"
    if state in ("T", "t"):
        return f"stopped ({state})"
    where = f" in {wchan}" if wchan and wchan != "0" else ""
    return f"{'uninterruptible' if state == 'D' else 'asleep'}{where} ({state})"
