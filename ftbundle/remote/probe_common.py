"""What every part of the probe uses (ftbundle/remote/probe.py, which is shipped after this text,
one program: ftbundle/check/__init__.py, ``probe_source``): commands under time limits, the
waits between looks at what the other hosts' probes do, a fact that could not be had.
Standard library only."""

import os
import subprocess

# How often a host looks again for what its peers' probes do at the same moment (their
# sentinels, rank 0's master port): the probes start within milliseconds of each other, and
# every look that comes too early costs the whole round this long. After POLL_FAST looks
# (0.1 s: a small cluster's probes have all started by then) each look waits 1.25x longer, up
# to POLL_MAX_S: on a large cluster the probes start over seconds, and n hosts each looking for
# n sentinels every 10 ms would be O(n^2) opens per second (256 hosts: about 3 million a
# second, on storage that every host shares).
POLL_S = 0.01
POLL_FAST = 10
POLL_MAX_S = 0.25


def pauses():
    """The waits between one host's looks at the same thing: 10 ms ten times, then 1.25x
    longer each time, to 0.25 s."""
    for _ in range(POLL_FAST):
        yield POLL_S
    wait = POLL_S
    while True:
        wait = min(POLL_MAX_S, wait * 1.25)
        yield wait


def run(argv, timeout, env=None):
    """(returncode, stdout, stderr, timed_out); returncode None when not runnable or timed
    out. A command that times out is killed and not waited for: a process stuck in the
    kernel (a hung GPU driver) cannot be reaped, and must not hang the probe with it."""
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return None, "", exc.strerror or str(exc), False
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, 9)
        except OSError:
            pass
        return None, "", "", True


def last_line(text, default):
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1].strip()[:300] if lines else default


def have(program):
    return which(program) is not None


def which(program):
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and os.access(os.path.join(d, program), os.X_OK):
            return os.path.join(d, program)
    return None


def guarded(task, *args):
    out = args[1]
    try:
        task(*args)
    except Exception as exc:  # a fact that could not be had is reported, never a crash
        out.setdefault("errors", []).append(f"{task.__name__}: {type(exc).__name__}: {exc}")
