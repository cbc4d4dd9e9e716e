"""A run's claim on its hosts (issue 45, item 4): two runs that would share a master port or GPUs
are not both started; the second one's check names the run that holds them.

Part of the probe (shipped with it: check/__init__.py ``PROBE_PARTS``), run by the check before a
``run`` (never by ``ftbundle check`` alone, nor a --dry-run). Each host keeps its claims in a
directory of its own disk (``dir``, never shared storage): one file per claimed thing and run
(``KEY@RUN``; KEY ``port-N`` on rank 0's host; ``gpus`` for every GPU of a host, or ``gpu-I`` for
each of its ``ftb_gpus``), holding when it was claimed. Claiming is atomic on the host: every
claimer takes the directory's flock, reads what is there, and writes its claims only when none of
them is held. Rank 0's host arbitrates two runs that start at once (see :func:`take`).

A claim is held while its run lives: a process on this host carries its marker (FTB_JOB=<run>...)
or, before any did, for ``grace_s`` after it was claimed (the run's check and start). The node
program marks the start (``<run>.started``, written as its job starts): from then on, a claim
whose run has no process left is stale and is taken over (a finished run, a launcher killed -9).
A refused run's launcher removes the claims it took. Standard library only."""

import fcntl
import os
import time

# the probe's json (probe_common.py's, shipped before this text); the json package when imported,
# or shipped without it (the stage program: ftbundle/stage.py)
json = globals().get("json") or __import__("json")

CLAIMS_LOCK = ".lock"


def started_name(run):
    return "%s.started" % run


def _read(path):
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def running_runs(proc="/proc"):
    """The runs with a process on this host (FTB_JOB=<run>.aN-R of every process whose environment
    can be read), in one pass over /proc; None when none could be read (another user's)."""
    found, readable = set(), False
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc, pid, "environ"), "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        readable = True
        for entry in entries:
            if entry.startswith(b"FTB_JOB="):
                marker = entry[8:].decode("utf-8", "replace")
                found.add(marker.rsplit(".a", 1)[0])
    return found if readable else None


def holds(directory, holder, now, grace_s, running):
    """Whether a claim file's holder (its content) still holds it; ``running``: running_runs()."""
    run = holder.get("run")
    if not run:
        return False
    if running is None or run in running:
        return True  # (processes that cannot be read are taken to be its)
    if os.path.exists(os.path.join(directory, started_name(run))):
        return False  # its job started here and no process of it is left: over
    return now - float(holder.get("at") or 0) < grace_s  # between its check and its start


def take(directory, run, keys, grace_s, now=None, running="read", arbiter=True):
    """Claim ``keys`` for ``run``, all or none: -> ([keys taken], [{key, run, age_s} held by others]).
    One file per claim, ``KEY@RUN``: runs never write each other's. Held by another run: while its
    job runs here, or (on an ``arbiter``, rank 0's host) within its grace before its start. Off the
    arbiter, a run that has not started yet is no conflict: both checks pass there, and rank 0's host
    alone decides which of two runs at once goes on (the other one's refused launcher removes its
    claims). ``running``: the runs with processes here (default: read from /proc; None: none could
    be read)."""
    now = time.time() if now is None else now
    os.makedirs(directory, mode=0o1777, exist_ok=True)
    with open(os.path.join(directory, CLAIMS_LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        names = [n for n in os.listdir(directory) if "@" in n and not n.endswith(".tmp")]
        others = any(not n.endswith("@" + run) for n in names) or \
            any(n.endswith(".started") for n in os.listdir(directory))
        if running == "read":  # (/proc is read only when another run left something here)
            running = running_runs() if others else set()
        taken, stale = [], []
        for name in names:
            key, _, other = name.partition("@")
            if other == run or not any(meets(key, k) for k in keys):
                continue
            holder = _read(os.path.join(directory, name)) or {"run": other}
            if holds(directory, holder, now, grace_s, running):
                started = running is None or other in running or \
                    os.path.exists(os.path.join(directory, started_name(other)))
                if arbiter or started:
                    taken.append({"key": key, "run": other,
                                  "age_s": round(now - float(holder.get("at") or now), 1)})
            else:
                stale.append(name)
        if taken:
            return [], taken
        for name in stale:
            _remove(os.path.join(directory, name))
        # start marks of runs that hold nothing here and run nothing here: gone, so none piles up
        holding = {n.partition("@")[2] for n in os.listdir(directory) if "@" in n}
        for name in os.listdir(directory):
            if name.endswith(".started"):
                old = name[:-len(".started")]
                if old not in holding and running is not None and old not in running and old != run:
                    _remove(os.path.join(directory, name))
        for key in keys:
            path = os.path.join(directory, "%s@%s" % (key, run))
            with open(path + ".tmp", "w") as f:
                f.write(json.dumps({"run": run, "at": now, "pid": os.getpid()}) + "\n")
            os.replace(path + ".tmp", path)
        return list(keys), []


def meets(a, b):
    """Whether two claims are on the same thing: equal, or ``gpus`` (all of a host's) and a GPU."""
    return a == b or (a == "gpus" and b.startswith("gpu-")) or (b == "gpus" and a.startswith("gpu-"))


def _remove(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def claim(spec, out):
    """The probe's task: spec["claim"] = {dir, run, keys, grace_s, arbiter} -> out["claim"]."""
    c = spec["claim"]
    held, taken = take(c["dir"], c["run"], c["keys"], float(c.get("grace_s", 60)), arbiter=c.get("arbiter", True))
    out["claim"] = {"dir": c["dir"], "held": held, "taken": taken}
