"""The node's half of staging (ftbundle/stage.py): a copy of a model or dataset into this
host's ``stage_dir``, received from the host before it in a chain and passed on to the next.

Shipped after ftbundle/remote/probe_files.py as one program (its hashing and digest cache),
run as ``python3 -S -c SOURCE SPEC`` (SPEC: JSON); standard library only. Two jobs:

``{"do": "manifest", "path": P}``
    The manifest of P (a file or a directory): every file's relative name, size and sha256,
    and the tree's digest, as one JSON line on stdout. The digests are kept by the probe's
    cache (path, size, mtime, inode), so an unchanged source is read once.

``{"do": "state", "stage_dir": D, "entries": [E...]}``
    What this host holds of each entry, as step 1 of ``receive`` judges it (``ftbundle check``).

``{"do": "send", "path": P, "token": T}``
    P's files, in the order of the manifest on stdin ({"files", "to": [address, port]}), to
    the chain's first host: the source read once, where it lives.

``{"do": "receive", "stage_dir": D, "entry": E, "token": T, "user": RUN, "keep": {"days", "bytes"}}``
    1. ``D/E`` already complete here (its files' sizes and mtimes as they were written):
       ``ftb-stage cached`` and exit 0. A copy changed since: ``ftb-stage changed FILE WHY``,
       and it is received again (the changed one is replaced only by a complete one).
    2. Otherwise it listens on a TCP port of its own (the kernel's ephemeral range: where the
       firewall role opens ports to cluster members) and says ``ftb-stage port N``.
    3. The launcher answers on stdin with one JSON line: {"files": [[rel, size, sha256]...],
       "file_name": the name of a source that is one file (its manifest's rel is ""),
       "from": "stdin" | "tcp", "next": [address, port] | null}.
    4. The bytes come from the launcher (stdin) or from the previous host (the first connection
       that gives the token: a ``send`` reads the source where it lives); each chunk is written under
       ``D/.part-E-PID``, hashed, and sent on to the next host as it comes (one pass down the
       chain: N hosts cost about one copy's time). ``ftb-stage progress BYTES`` about twice a
       second.
    5. Every file's sha256 is compared with the manifest's; only then is the part renamed to
       ``D/E`` (with ``.ftb-stamps.json``, what step 1 reads) and ``ftb-stage done BYTES
       SECONDS`` said. A mismatch, a short stream or a write that fails is ``ftb-stage error
       WHY`` (exit 1), the part removed; a next host that is lost is ``ftb-stage next-lost
       WHY``, and this host's own copy still completes.
    6. Cached or written, the entry is marked used by RUN (``.ftb-used/RUN``), and the other
       entries of D are pruned by ``keep`` (:func:`prune`: ``ftb-stage pruned ENTRY BYTES DAYS``),
       then ``ftb-stage done``.
"""

import json
import os
import shutil
import socket
import sys
import time

if __package__:  # imported (tests); shipped, these parts' texts come before this one (ftbundle/stage.py)
    from .claims import running_runs
    from .probe_files import file_digests, hashing_progress

STAMPS = ".ftb-stamps.json"
USED = ".ftb-used"  # in each entry: one empty file per run (or `ftbundle stage`) that used it, touched when it did
DAY_S = 86400
TAG = "ftb-stage"
CHUNK = 1 << 20
ACCEPT_S = 120.0  # the previous host connects within this long of the launcher's answer
IDLE_S = 120.0  # no byte from the previous host for this long: the stream is lost


def say(*words):
    sys.stdout.write(" ".join([TAG, *map(str, words)]) + "\n")
    sys.stdout.flush()


def entry_state(entry):
    """("cached", ""), ("absent", ""), or ("changed", "FILE WHY")."""
    try:
        with open(os.path.join(entry, STAMPS)) as f:
            stamps = json.load(f)
    except FileNotFoundError:
        return ("changed", f"{STAMPS} missing") if os.path.exists(entry) else ("absent", "")
    except (OSError, ValueError) as exc:
        return "changed", f"{STAMPS} unreadable: {exc}"
    for rel, (size, mtime_ns) in sorted(stamps.items()):
        try:
            st = os.stat(os.path.join(entry, rel))
        except OSError:
            return "changed", f"{rel} missing"
        if st.st_size != size:
            return "changed", f"{rel} size {st.st_size}, staged {size}"
        if st.st_mtime_ns != mtime_ns:
            return "changed", f"{rel} modified since it was staged"
    return "cached", ""


def stream_of(how, stdin, listener, token):
    """Where the bytes come from: the launcher (stdin) or the previous host (a connection)."""
    return stdin if how == "stdin" else accept(listener, token)


def accept(listener, token):
    """The previous host's connection: the first to send the token (others are dropped)."""
    listener.settimeout(ACCEPT_S)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(IDLE_S)
        stream = conn.makefile("rb")
        if stream.readline().strip().decode(errors="replace") == token:
            return stream
        conn.close()


class Next:
    """The next host's connection, or none; a lost one is said once and dropped."""

    def __init__(self, where, token):
        self.sock = None
        if where:
            self.sock = socket.create_connection((where[0], int(where[1])), timeout=30)
            self.sock.settimeout(IDLE_S)
            self.sock.sendall(token.encode() + b"\n")

    def send(self, chunk):
        if self.sock is None:
            return
        try:
            self.sock.sendall(chunk)
        except OSError as exc:
            say("next-lost", exc.strerror or exc)
            self.sock.close()
            self.sock = None

    def close(self):
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_WR)
                self.sock.settimeout(IDLE_S)
                self.sock.recv(1)  # (the next host closes when its copy is written: the bytes were taken)
            except OSError:
                pass
            self.sock.close()


def mark_used(entry, user):
    """``user`` (a run id, or this `ftbundle stage`'s) used the entry now."""
    try:
        os.makedirs(os.path.join(entry, USED), exist_ok=True)
        path = os.path.join(entry, USED, user)
        with open(path, "a"):
            pass
        os.utime(path)
    except OSError:
        pass


def entry_use(entry):
    """(when it was last used, by whom, its bytes) from its marks and stamps."""
    try:
        users = {n: os.stat(os.path.join(entry, USED, n)).st_mtime for n in os.listdir(os.path.join(entry, USED))}
    except OSError:
        users = {}
    try:
        with open(os.path.join(entry, STAMPS)) as f:
            size = sum(s for s, _ in json.load(f).values())
        last = os.stat(os.path.join(entry, STAMPS)).st_mtime
    except (OSError, ValueError, TypeError):
        size, last = 0, 0.0
    return max([last, *users.values()]), set(users), size


def prune(stage_dir, keep, user, now=None, running="read"):
    """Entries unused longest first, removed while one is older than ``keep["days"]`` or all
    of them hold more than ``keep["bytes"]``: never one this ``user`` (this run, this stage)
    marked, nor one a run with a process on this host used (``running``: claims.py's
    running_runs; when /proc cannot be read, nothing is removed). Says each it removes."""
    now = time.time() if now is None else now
    running = running_runs() if running == "read" else running
    if running is None or not (keep.get("days") or keep.get("bytes")):
        return
    found = []
    for name in os.listdir(stage_dir):
        path = os.path.join(stage_dir, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        last, users, size = entry_use(path)
        found.append((last, name, users, size))
    total = sum(f[3] for f in found)
    for last, name, users, size in sorted(found):
        if user in users or users & running:
            continue
        old = keep.get("days") and now - last > keep["days"] * DAY_S
        over = keep.get("bytes") and total > keep["bytes"]
        if not (old or over):
            continue
        shutil.rmtree(os.path.join(stage_dir, name), ignore_errors=True)
        total -= size
        say("pruned", name, size, f"{(now - last) / DAY_S:.1f}")


def receive(spec):
    stage_dir, name, token = spec["stage_dir"], spec["entry"], spec["token"]
    entry = os.path.join(stage_dir, name)
    state, why = entry_state(entry)
    code = 0 if state == "cached" else _receive_anew(spec, stage_dir, name, entry, token, state, why)
    if code == 0:  # (held already, or written now: marked used, the others pruned, then said)
        user = spec.get("user") or "stage"
        mark_used(entry, user)
        prune(stage_dir, spec.get("keep") or {}, user)
        say("cached" if state == "cached" else "done")
    return code


def _receive_anew(spec, stage_dir, name, entry, token, state, why):
    import hashlib

    if state == "changed":
        say("changed", why)
    try:
        os.makedirs(stage_dir, exist_ok=True)
        part = os.path.join(stage_dir, f".part-{name}-{os.getpid()}")
        os.mkdir(part)
    except OSError as exc:
        say("error", f"cannot write {stage_dir}: {exc.strerror or exc}")
        return 1
    if socket.has_dualstack_ipv6():  # (the next hop may name this host by an IPv6 address)
        listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=4)
    else:
        listener = socket.create_server(("", 0), backlog=4)
    say("port", listener.getsockname()[1])
    try:
        order = json.loads(sys.stdin.buffer.readline() or b"null")
        if not order:
            say("error", "no word from the launcher")
            return 1
        return _receive(order, stage_dir, entry, part, listener, token, hashlib)
    except (OSError, ValueError) as exc:
        say("error", getattr(exc, "strerror", None) or exc)
        return 1
    finally:
        listener.close()
        shutil.rmtree(part, ignore_errors=True)


def _receive(order, stage_dir, entry, part, listener, token, hashlib):
    started = time.monotonic()
    files = order["files"]
    nxt = Next(order.get("next"), token)
    source = stream_of(order["from"], sys.stdin.buffer, listener, token)
    total = sum(size for _, size, _ in files)
    done, said = 0, time.monotonic()
    stamps, bad = {}, []
    for rel, size, digest in files:
        name = rel or order["file_name"]  # (a source that is one file: its manifest's one name is "")
        path = os.path.join(part, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        h = hashlib.sha256()
        left = size
        with open(path, "wb") as out:
            while left:
                chunk = source.read(min(CHUNK, left))
                if not chunk:
                    say("error", f"the stream ended after {done} of {total} bytes (in {name})")
                    return 1
                nxt.send(chunk)
                out.write(chunk)
                h.update(chunk)
                left -= len(chunk)
                done += len(chunk)
                if time.monotonic() - said >= 0.5:
                    said = time.monotonic()
                    say("progress", done)
        if h.hexdigest() != digest:
            bad.append(name)
        st = os.stat(path)
        stamps[name] = [st.st_size, st.st_mtime_ns]
    nxt.close()
    if bad:
        say("error", f"sha256 differs from the source's: {', '.join(bad[:3])}" + (" ..." if len(bad) > 3 else ""))
        return 1
    with open(os.path.join(part, STAMPS), "w") as f:
        json.dump(stamps, f)
    old = None
    if os.path.lexists(entry):  # a changed copy: replaced only now, by a complete one
        old = os.path.join(stage_dir, f".old-{os.path.basename(entry)}-{os.getpid()}")
        os.rename(entry, old)
    os.rename(part, entry)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    say("written", done, f"{time.monotonic() - started:.3f}")
    return 0


def send(spec):
    """The source's bytes, read here in the manifest's order, to the chain's first host."""
    order = json.loads(sys.stdin.buffer.readline() or b"null")
    path = spec["path"]
    nxt = Next(order["to"], spec["token"])
    for rel, size, _ in order["files"]:
        full = os.path.join(path, rel) if rel else path
        if os.path.getsize(full) != size:
            sys.stderr.write(f"{full} changed since it was hashed (size {os.path.getsize(full)}, was {size})\n")
            return 1
        with open(full, "rb") as f:
            left = size
            while left and (chunk := f.read(min(CHUNK, left))):
                nxt.send(chunk)
                left -= len(chunk)
        if nxt.sock is None:
            return 1
    nxt.close()
    return 0


def state(spec):
    """What this host holds of each entry (``ftbundle check``): {entry: [state, why]}."""
    print(json.dumps({e: entry_state(os.path.join(spec["stage_dir"], e)) for e in spec["entries"]}))
    return 0


def manifest(spec):
    path = spec["path"]
    if not os.path.exists(path):
        print(json.dumps({"error": f"{path}: no such file or directory"}))
        return 1
    found = file_digests(path, hashing_progress(os.path.basename(path)))
    files = [[rel, found["sizes"][rel], found["digests"][rel]] for rel, _ in found["listing"]]
    print(json.dumps({"sha256": found["sha256"], "bytes": found["bytes"], "files": files,
                      "kind": "dir" if os.path.isdir(path) else "file"}))
    return 0


if __name__ == "__main__" and not __package__:
    SPEC = json.loads(sys.argv[1])
    sys.exit({"manifest": manifest, "send": send, "receive": receive, "state": state}[SPEC["do"]](SPEC))
