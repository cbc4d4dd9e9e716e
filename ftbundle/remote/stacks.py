"""ftbundle's stack collector: what every rank of a job on this host is doing, right now.

Shipped as this file's text to the host's python3 on stdin (`python3 -S - SPEC`), like
probe.py; every value arrives in the JSON SPEC argument, nothing is pasted into the text.
Stdlib only. Prints one JSON object: {"ranks": [...], "error": ...}.

For each rank process of the job (found by the job's FTB_JOB marker in /proc/*/environ,
or, for the docker runtime, as a descendant of the container's init; a rank is a process
with LOCAL_RANK in its environment whose parent has none, so dataloader workers are not
ranks): its state (R, S, D, T, Z from /proc/PID/stat), the CPU time it used over
``sample_s`` seconds (utime + stime, read twice), and its Python stack, every thread, from
``py-spy dump --nonblocking --json``. py-spy reads the process's memory from outside
(process_vm_readv), so the rank runs no code of ours: that works on a rank stuck in C code,
a SIGSTOPped rank (``--nonblocking``: the blocking mode's ptrace suspend fails on a stopped
process, "Failed to suspend process") and a rank in a container (the host sees its pid).

Each rank's report is also written to ``out_dir/rank-<RANK>.txt`` (shared storage).
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

STATES = {"R": "running", "S": "sleeping", "D": "in D state (uninterruptible I/O)", "T": "stopped",
          "t": "stopped (traced)", "Z": "zombie", "X": "dead", "I": "idle"}


def read_environ(pid):
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def env_value(entries, name):
    prefix = name.encode() + b"="
    for entry in entries or ():
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def stat_of(pid):
    """(state, ppid, utime + stime in ticks) from /proc/PID/stat, or None."""
    try:
        with open("/proc/%s/stat" % pid) as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[11]) + int(fields[12])


def all_pids():
    return [p for p in os.listdir("/proc") if p.isdigit()]


def marker_pids(marker):
    want = ("FTB_JOB=" + marker).encode()
    return [p for p in all_pids() if want in (read_environ(p) or ())]


def container_pids(name):
    """Every process of a container, by its init's pid (the host sees them all)."""
    try:
        out = subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", name], capture_output=True,
                             text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if not out.isdigit() or out == "0":
        return []
    children = {}
    for p in all_pids():
        st = stat_of(p)
        if st:
            children.setdefault(str(st[1]), []).append(p)
    found, todo = [], [out]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def is_python(pid):
    try:
        return os.path.basename(os.readlink("/proc/%s/exe" % pid)).startswith("python")
    except OSError:
        return False


def rank_processes(pids, per_node=False):
    """{pid: (rank, local_rank)} of the processes that are ranks: Python processes with
    LOCAL_RANK (set by torchrun) whose parent is not one (that would be a dataloader worker);
    a shell or an init in between (a container's entrypoint) is not a rank. A `command:` job
    (``per_node``) whose processes carry no LOCAL_RANK (a program run once per node, or
    started by a launcher that numbers ranks otherwise): its outermost Python processes, or
    with no Python at all (a shell script, a compiled program) the leaves of its tree."""
    envs = {p: read_environ(p) for p in pids}
    marked = [p for p in pids if env_value(envs[p], "LOCAL_RANK") is not None]
    if not marked and per_node:
        marked = [p for p in pids if envs[p] is not None and is_python(p)]
        if not marked:
            parents = {str(st[1]) for st in (stat_of(p) for p in pids) if st}
            marked = [p for p in pids if envs[p] is not None and p not in parents]
    pythons = {p for p in marked if is_python(p)}
    candidates = [p for p in marked if p in pythons] if pythons else marked
    ranks = {}
    for p in candidates:
        local = env_value(envs[p], "LOCAL_RANK") or ""
        st = stat_of(p)
        parent = str(st[1]) if st else None
        if parent in candidates:
            continue  # a dataloader worker or other child of a rank
        rank = env_value(envs[p], "RANK")
        ranks[p] = (int(rank) if rank and rank.isdigit() else None, int(local) if local.isdigit() else None)
    return ranks


def command_name(pid):
    try:
        with open("/proc/%s/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return "?"


def find_pyspy(dirs):
    for d in dirs:
        if d and os.access(os.path.join(d, "py-spy"), os.X_OK):
            return os.path.join(d, "py-spy")
    return shutil.which("py-spy")


def dump(pyspy, pid, timeout):
    """(threads as py-spy's JSON, error text)."""
    if pyspy is None:
        return None, "py-spy not found (pip install py-spy, beside the job's python or on PATH)"
    try:
        proc = subprocess.run([pyspy, "dump", "--pid", str(pid), "--nonblocking", "--json"],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "py-spy dump did not answer within %ss" % timeout
    except OSError as exc:
        return None, "py-spy: %s" % exc
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return None, "py-spy: " + (lines[0] if lines else "exit %d" % proc.returncode)
    try:
        return json.loads(proc.stdout), None
    except ValueError:
        return None, "py-spy: unreadable output"


def stack_text(threads):
    lines = []
    for t in threads or ():
        lines.append('Thread %s (%s): "%s"' % (t.get("os_thread_id"), "active" if t.get("active") else "idle",
                                               t.get("thread_name") or ""))
        for fr in t.get("frames") or ():
            lines.append("    %s (%s:%s)" % (fr.get("name"), fr.get("filename"), fr.get("line")))
    return "\n".join(lines)


def spec_from_env(out_dir):
    """A detached node's own collection (its watcher's stall watchdog, remote/watch.py): its values
    from the node's environment, as the node program has it."""
    prepend = os.environ.get("FTB_PATH_PREPEND")
    return {"marker": os.environ.get("FTB_MARKER", ""), "container": os.environ.get("FTB_CONTAINER") or None,
            "pyspy_dirs": [prepend] if prepend else [], "out_dir": out_dir, "host": os.uname().nodename,
            "node_rank": int(os.environ.get("NODE_RANK", "0")), "sample_s": 2.0, "timeout": 20,
            "per_node": os.environ.get("FTB_PER_NODE") == "1"}


def main():
    spec = spec_from_env(sys.argv[2]) if sys.argv[1] == "--env" else json.loads(sys.argv[1])
    pids = container_pids(spec["container"]) if spec.get("container") else marker_pids(spec["marker"])
    ranks = rank_processes(pids, spec.get("per_node", False))
    tick = os.sysconf("SC_CLK_TCK")
    first = {p: stat_of(p) for p in ranks}
    t0 = time.monotonic()
    pyspy = find_pyspy(spec.get("pyspy_dirs") or [])
    stacks = {}

    def one(p):
        if is_python(p):
            stacks[p] = dump(pyspy, p, spec.get("timeout", 20))
        else:  # py-spy has nothing to read there: say what it is instead of py-spy's error
            stacks[p] = (None, "not a Python process: %s" % command_name(p))

    threads = [threading.Thread(target=one, args=(p,)) for p in ranks]
    for t in threads:
        t.start()
    time.sleep(max(0.0, spec.get("sample_s", 1.0) - (time.monotonic() - t0)))
    second = {p: stat_of(p) for p in ranks}
    wall = time.monotonic() - t0
    for t in threads:
        t.join()
    out_dir = spec.get("out_dir")
    if out_dir and ranks:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError:
            pass
    reports = []
    for p, (rank, local) in sorted(ranks.items(), key=lambda kv: (kv[1][0] is None, kv[1][0] or 0)):
        a, b = first.get(p), second.get(p)
        threads_, error = stacks.get(p, (None, "no stack"))
        report = {
            "pid": int(p), "rank": rank, "local_rank": local,
            "state": (b or a or ("X",))[0],
            "cpu_s": round((b[2] - a[2]) / tick, 2) if a and b else None,
            "sample_s": round(wall, 2), "threads": threads_, "error": error,
        }
        reports.append(report)
        if out_dir:
            header = ("host %s (node %s), rank %s, local rank %s, pid %s\nstate: %s (%s), CPU %s s in the last %.1f s\n"
                      % (spec.get("host"), spec.get("node_rank"), rank, local, p, report["state"],
                         STATES.get(report["state"], "?"), report["cpu_s"], wall))
            try:
                with open(os.path.join(out_dir, "rank-%s.txt" % (rank if rank is not None else "p" + p)), "w") as f:
                    f.write(header + "\n" + (stack_text(threads_) or error or "") + "\n")
            except OSError as exc:
                report["write_error"] = str(exc)
    result = json.dumps({"ranks": reports, "pyspy": pyspy, "error": None if ranks else "no rank process found",
                         "host": spec.get("host"), "node_rank": spec.get("node_rank")})
    if out_dir and ranks:  # the whole answer too, for a later look (`ftbundle status` of a detached run)
        try:
            with open(os.path.join(out_dir, "node-%s.json" % spec.get("node_rank")), "w") as f:
                f.write(result + "\n")
        except OSError:
            pass
    print(result)


if __name__ == "__main__":
    main()
