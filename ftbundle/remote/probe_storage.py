"""The probe's shared storage facts (ftbundle/remote/probe.py): for each path the spec names
(shared_dir, output_dir), a sentinel written under it (or under its nearest existing parent)
and the sentinels of every other host waited for: seeing all of them, not a path, proves the
storage shared. All of it in a child process forked before any thread starts, which first
stats a name never used under each path: a hung network filesystem holds whatever touches it
in the kernel (D state, deaf to kill -9), so the probe itself never touches it (evidence.py
decides what a slow answer is). And the `clean` mode, which removes the sentinels. Shipped
within the probe (``probe_source``); standard library only."""

import os
import time

if __package__:  # imported (tests); shipped, the texts of these come before this one
    from .evidence import HUNG, WAITING, read_load, read_process, storage_verdict
    from .probe_common import Lines, guarded, hostname, json, pauses

def storage_apart(spec, started):
    """Fork the child that asks the storage (before any thread starts: a fork is safe then);
    (its pid, the read end of its report pipe). The child's lines are JSON: ``{"answered":
    NAME}`` once a name never used under that path has been stat'ed (no cache answers that: the
    server did), then ``{"storage": ...}``, :func:`storage`'s result. First of all ``{"control":
    true}``, once it has stat'ed a name never used under /tmp: the host runs it, and its own disk
    answers (the control of :func:`storage_verdict`). With ``told_fd`` in the spec (a pipe's
    ends), the ranks whose sentinels to wait for come on it (probe.py's told)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        if spec.get("told_fd") is not None:  # (the child's end of the ranks' pipe)
            os.close(spec["told_fd"][0])
        return pid, r
    try:  # the child: nothing of the SSH session's streams, so a child stuck for good holds none
        os.close(r)
        if spec.get("told_fd") is not None:  # (the parent's end of the pipe the ranks come on: told)
            os.close(spec["told_fd"][1])
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        report = os.fdopen(w, "w")
        try:  # the control: this host's own disk, asked just before the storage (evidence.py)
            os.stat(f"/tmp/.ftb-control-{os.getpid()}-{time.time_ns()}")
        except OSError:
            pass
        report.write('{"control": true}\n')
        report.flush()
        for item in spec.get("storage", []):
            path = item["path"]
            try:
                os.stat(os.path.join(nearest_existing(path) or path, f".ftb-probe-{os.getpid()}-{time.time_ns()}"))
            except OSError:
                pass
            report.write(json.dumps({"answered": item["name"]}) + "\n")
            report.flush()
        out = {}
        guarded(storage, spec, out, started)
        report.write(json.dumps({"storage": out.get("storage"), "errors": out.get("errors")}) + "\n")
        report.flush()
    finally:
        os._exit(0)


class StorageReport:
    """The storage child's report, read with time limits: it is never waited for."""

    def __init__(self, spec, pid, fd):
        self.spec, self.pid, self.buf, self.lines = spec, pid, b"", []
        self.fd = fd
        self.began = time.monotonic()
        self.last = self.began  # its last word
        self.seen = {}  # path name -> how its reading was seen when it was slow (evidence.py)

    def _read(self, until):
        """Its next lines, waiting for them until ``until`` at most (not at all when it has
        passed); how many lines there are then."""
        import select
        ready, _, _ = select.select([self.fd], [], [], max(0.0, until - time.monotonic()))
        chunk = os.read(self.fd, 65536) if ready else b""
        if chunk:
            self.last = time.monotonic()
            self.buf += chunk
            *done, self.buf = self.buf.split(b"\n")
            self.lines += [json.loads(line) for line in done if line.strip()]
        return len(self.lines)

    def answered(self, limit, patience):
        """Every path answered: None; else the first that did not. Past ``limit`` seconds from the
        fork it is given up on the evidence that the storage holds the reading (its process
        blocked in the kernel while the control answered: :func:`storage_verdict`); while the
        evidence is that this host has not run it (starved), only after ``patience`` more. How
        a slow reading was seen is kept in ``seen`` (the words of the check)."""
        want = [item["name"] for item in self.spec.get("storage", [])]
        until = self.began + limit
        while True:
            now = time.monotonic()
            if now >= until:  # (what it has said already first: it goes on once it has answered)
                while len(self.lines) < self._read(now):
                    pass
            said = {line.get("answered") for line in self.lines}
            pending = [n for n in want if n not in said]
            if not pending:
                return None
            if now >= until:
                state, wchan, _ = read_process(self.pid)
                control = any(line.get("control") for line in self.lines)
                verdict = storage_verdict(state, wchan, control, now - self.began, limit)
                if verdict != WAITING:
                    self.seen[pending[0]] = {"verdict": verdict, "waited_s": round(now - self.began, 1),
                                             "state": state if control else None, "wchan": wchan,
                                             "load": read_load()}
                if verdict == HUNG or now >= self.began + limit + patience:
                    return pending[0]
                until = min(now + 0.25, self.began + limit + patience)  # (looked at again)
            self._read(until)

    def result(self, out, until):
        """:func:`storage`'s result into ``out``; a child that falls silent before ``until`` has
        met storage that stopped answering meanwhile (named by what it had not finished)."""
        while not any("storage" in line for line in self.lines) and time.monotonic() < until:
            self._read(until)
        final = next((line for line in self.lines if "storage" in line), None)
        if final is not None:
            out["storage"] = final["storage"] or {}
            for name, seen in self.seen.items():  # (slow, not hung: the host was starved)
                if name in out["storage"]:
                    out["storage"][name]["slow"] = seen
            if final.get("errors"):
                out.setdefault("errors", []).extend(final["errors"])
            return
        silent = time.monotonic() - self.last
        out["storage"] = {item["name"]: {"path": item["path"], "not_answering_s": round(silent, 1)}
                          for item in self.spec.get("storage", [])}

    def not_answering(self, out, name):
        waited = round(time.monotonic() - self.began, 1)
        out["storage"] = {item["name"]: ({"path": item["path"], "not_answering_s": waited}
                                         if item["name"] == name else {"path": item["path"]})
                          for item in self.spec.get("storage", [])}
        if name in self.seen:  # the evidence: its reading's process, as last seen
            out["storage"][name]["slow"] = self.seen[name]


def storage(spec, out, started):
    """For each path: write our sentinel, then wait (bounded) for everyone else's."""
    token, rank, expect = spec.get("token"), spec["rank"], spec.get("expect", [])
    wait_s = spec.get("sentinel_wait_s", 5)
    results = {}
    pending = []
    for item in spec.get("storage", []):
        path, res = item["path"], {"path": item["path"]}
        results[item["name"]] = res
        if item.get("create"):
            if not os.path.isdir(path):
                try:
                    os.makedirs(path)
                    res["created"] = True
                except OSError as exc:
                    res["create_error"] = ("it is a file, not a directory" if os.path.exists(path)
                                           and not os.path.isdir(path) else exc.strerror)
        else:  # another host may be creating it right now (rank 0, a fresh shared_dir)
            deadline = started + (wait_s if item.get("wait") else 0)
            waits = pauses()
            while not os.path.isdir(path) and time.monotonic() < deadline:
                time.sleep(min(next(waits), max(0.0, deadline - time.monotonic())))
        res["exists"] = os.path.isdir(path)
        parent = os.path.dirname(path.rstrip("/")) or "/"
        res["parent_exists"] = os.path.isdir(parent)
        where = path if res["exists"] else nearest_existing(path) if item.get("nearest") else None
        if where is None or not token:
            continue
        block = None if res["exists"] else file_in_the_way(path)
        if block is not None:  # (a run's makedirs would fail there: nothing is written)
            res.update(where=block, written=False, write_error="a file, not a directory")
            continue
        sdir = os.path.join(where, f".ftb-check-{token}")
        res["where"] = where
        try:
            os.makedirs(sdir, exist_ok=True)
            with open(os.path.join(sdir, f"rank-{rank}"), "w") as f:
                f.write(hostname() + "\n")
            res["written"] = True
            pending.append((res, sdir))
            fs = os.statvfs(sdir)  # (what a checkpoint written there may use: check/checkpoint_rules.py)
            res["free"], res["size"] = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        except OSError as exc:
            res["written"] = False
            res["write_error"] = exc.strerror
    if expect is None:  # the ranks whose probes run come after the start (probe.py, told): our own is written
        expect = told_ranks(spec, rank) if pending else []
    deadline = time.monotonic() + wait_s
    gone = set()
    for res, sdir in pending:
        unseen, seen, waits = list(expect), set(), pauses()
        while True:  # (only the sentinels not seen yet, of hosts not gone, are looked for again)
            seen.update(r for r in unseen if r not in gone and sees(os.path.join(sdir, f"rank-{r}")))
            unseen = [r for r in unseen if r not in seen and r not in gone]
            if not unseen or time.monotonic() >= deadline:
                break
            gone |= heard_gone(spec, min(next(waits), max(0.0, deadline - time.monotonic())))
        res["seen"] = [r for r in expect if r in seen]
    out["storage"] = results


def told_ranks(spec, rank):
    """The storage child's copy of the ranks whose probes run (probe.py's told, on the pipe
    ``told_fd``), waited for until the probe's deadline; only its own when none came."""
    spec["told_lines"] = Lines(spec["told_fd"][0])
    line = spec["told_lines"].next(time.monotonic() + spec.get("deadline_s", 150))
    return json.loads(line) if line else [rank]


def heard_gone(spec, pause):
    """The ranks said gone on the told pipe within ``pause`` seconds (``{"gone": [RANK]}``: a
    host whose probe ended without its facts, whose sentinel will never come): waited for
    there, where there is such a pipe, instead of sleeping."""
    lines = spec.get("told_lines")
    if lines is None or lines.ended:
        time.sleep(pause)
        return set()
    line = lines.next(time.monotonic() + pause)
    try:
        return {int(r) for r in json.loads(line)["gone"]} if line else set()
    except (ValueError, KeyError, TypeError):
        return set()


def sees(path):
    """open(), not stat(): NFS revalidates a file on open (close-to-open consistency)."""
    try:
        with open(path):
            return True
    except OSError:
        return False


def file_in_the_way(path):
    """The first thing on ``path`` (itself, or a parent) that exists and is not a directory:
    what makes creating it fail; None when there is none."""
    path = os.path.normpath(path)
    while True:
        if os.path.lexists(path):
            return None if os.path.isdir(path) else path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def nearest_existing(path):
    path = os.path.normpath(path)
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def cleanup(spec, out):
    """Remove this check's sentinel directories (mode `clean`): under each path, or its
    nearest existing parent, where :func:`storage` wrote them."""
    import shutil
    removed = []
    for path in spec.get("paths", []):
        where = nearest_existing(path)
        if where is None:
            continue
        sdir = os.path.join(where, f".ftb-check-{spec['token']}")
        if os.path.isdir(sdir):
            shutil.rmtree(sdir, ignore_errors=True)
            removed.append(sdir)
    out["removed"] = removed
