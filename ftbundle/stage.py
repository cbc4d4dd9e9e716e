"""`stage:` (job key) and `ftbundle stage JOB`: the model and dataset copied once to every
host's local ``stage_dir`` before the ranks start, and the ranks pointed at the local copies.

Each source (``model``: the LlamaFactory config's ``model_name_or_path``; ``dataset``: its
``dataset_dir``; or any path) is on the launcher, on shared storage (under ``shared_dir``) or on
one host (``HOST:/path``). What it holds is its manifest: every file's name, size and sha256
(remote/stage_node.py ``manifest``, read where the source lives, the digests cached there by
path, size, mtime and inode), and its entry in ``stage_dir`` is named by it:
``<name>-<first 16 hex digits of the tree's sha256>``. So a host that holds the entry gets
nothing, and a later run, a restart and a spare reuse it; a changed copy is named and received
again.

The hosts that need it are put in a chain in inventory order; each runs the stage program's
``receive`` (one round trip: it answers ``cached`` at once, or the port it listens on). The
source is read once, by the launcher (into the first host's stdin) or by a ``send`` on the host
that holds it (shared storage: the first host of the chain), and every host writes each chunk
and passes it on to the next as it comes: N hosts cost about one copy's time, never N reads of
one source. Each host checks every file's sha256 against the manifest before the copy takes its
name (a half or corrupt copy is never used) and says so; the first host that fails is named.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from . import shipped
from .errors import UserError
from .hostlist import fold
from .inventory import Host
from .paths import is_under
from .units import size_text

DEFAULT_STAGE_DIR = "/var/cache/ftbundle"
STAGE_KEYS = {"model": "model_name_or_path", "dataset": "dataset_dir"}  # the names `stage:` knows
WAIT_S = 30.0  # a receiver says "cached" or its port within this long
PROGRESS_EVERY_S = 2.0
STALL_S = 120.0  # no host of the chain wrote a byte for this long: the copy is stuck, named
TAG = "ftb-stage"


@dataclass(frozen=True)
class Source:
    name: str  # "model", "dataset", or the path as written
    path: str  # absolute, where it lives
    host: str | None  # the host it lives on; None: the launcher or shared storage
    shared: bool  # under shared_dir: any host reads it (the chain's first)
    key: str | None  # the LlamaFactory key its local copy replaces


@dataclass
class Staged:
    source: Source
    entry: str = ""
    local: str = ""  # the path the ranks read: <stage_dir>/<entry>[/<file's name>]
    bytes: int = 0
    files: int = 0
    cached: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    changed: dict[str, str] = field(default_factory=dict)  # host -> what changed in its copy
    pruned: list[str] = field(default_factory=list)  # "HOST: ENTRY (SIZE, unused N days)" removed by stage_keep
    seconds: float = 0.0

    def record(self) -> dict:
        """What plan.json keeps of it (``runs`` says it under the run)."""
        return {"name": self.source.name, "source": self.source.path, "entry": self.entry, "local": self.local,
                "bytes": self.bytes, "files": self.files, "copied": self.copied, "cached": self.cached,
                "changed": self.changed, "seconds": round(self.seconds, 2), "said": self.line()}

    def line(self) -> str:
        what = f"{self.source.name} ({size_text(self.bytes)}, {self.files} file(s), {self.entry})"
        parts = []
        if self.copied:
            rate = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
            parts.append(f"copied to {fold(self.copied)} in {self.seconds:.1f}s ({rate:.0f} MB/s)")
        if self.cached:
            parts.append(f"cached on {fold(self.cached)}")
        changed = "".join(f"; {h}'s copy had changed ({why}): copied again" for h, why in sorted(self.changed.items()))
        pruned = f"; removed by stage_keep: {', '.join(self.pruned)}" if self.pruned else ""
        return f"staged {what}: {', '.join(parts)}{changed}{pruned}"


class StageError(Exception):
    """A host could not take the copy (named), or the source could not be read."""


@cache
def node_source() -> str:
    """The stage program: probe_files.py (hashing, the digest cache), claims.py (the runs with a
    process on the host: their copies are never pruned), then stage_node.py."""
    return "\n".join(shipped.read_text("remote", part) for part in ("probe_files.py", "claims.py", "stage_node.py"))


# The stage program's command line holds this loader, not its ~20 KB (`ps` on the hosts stays
# readable): the program comes first on stdin, its length on a line before it; what follows on
# stdin (the launcher's order, a copy's bytes) is the program's.
BOOT = ("import sys; n = int(sys.stdin.buffer.readline()); "
        "exec(compile(sys.stdin.buffer.read(n), '<ftbundle stage>', 'exec'), "
        "{'__name__': '__main__', '__package__': None, '__builtins__': __builtins__})")


def node_argv(host: Host, spec: dict) -> list[str]:
    from .check import probe_python

    return [probe_python(host), "-S", "-c", BOOT, json.dumps(spec)]


def node_stdin() -> bytes:
    """What the stage program's stdin begins with: the program (see BOOT)."""
    source = node_source().encode()
    return b"%d\n" % len(source) + source


def start_node(cluster, host: Host, spec: dict):
    """The stage program running on ``host`` with ``spec``, its program sent: a Proc."""
    proc = cluster.start(host, node_argv(host, spec))
    proc.send(node_stdin())
    return proc


# ---------------------------------------------------------------------------------------
# What to stage (pure: the job's words checked against its layout)


def sources(layout, where: str = "stage") -> list[Source]:
    """The job's ``stage:`` entries as sources; a name that means nothing is a UserError."""
    job = layout.job
    found = []
    for i, raw in enumerate(job.stage):
        key = f"{where}[{i}]"
        lf_key = STAGE_KEYS.get(raw)
        if lf_key is not None:
            if layout.lf_config is None:
                raise UserError(f"'{raw}' means the LlamaFactory config's {lf_key}: this job runs no LlamaFactory "
                                "config; name a path instead", file=str(job.path), key=key)
            value = str(layout.lf_config.get(lf_key) or ("data" if raw == "dataset" else ""))
            if raw == "dataset" and (value == "ONLINE" or value.startswith("REMOTE:")):
                raise UserError(f"dataset_dir is {value}: there is nothing local to stage", file=str(job.path), key=key)
            if raw == "model" and not (value.startswith(("/", "./", "../", "~")) or _exists_somewhere(layout, value)):
                raise UserError(f"model_name_or_path {value!r} is not a path (a hub id?): download it to shared_dir "
                                "first and name that directory, then it can be staged", file=str(job.path), key=key)
            text = value
        else:
            text = raw
        host = None
        if ":" in text and not text.startswith("/"):
            host, text = text.split(":", 1)
            if host not in {h.name for h in layout.hosts}:
                raise UserError(f"{raw!r}: {host} is not one of the job's hosts ({fold(h.name for h in layout.hosts)})",
                                file=str(job.path), key=key)
        path = posixpath.normpath(posixpath.join(layout.workdir, os.path.expanduser(text)))
        shared = bool(layout.shared_dir) and is_under(path, layout.shared_dir)
        if host is None and not shared and not os.path.exists(path):
            raise UserError(f"{raw!r} ({path}) is neither on this machine nor under shared_dir ({layout.shared_dir}); "
                            "a path on one host is written HOST:/path", file=str(job.path), key=key)
        found.append(Source(name=raw, path=path, host=host, shared=shared and host is None, key=lf_key))
    names = [s.path for s in found]
    for i, path in enumerate(names):
        if path in names[:i]:
            raise UserError(f"{job.stage[i]!r} is staged twice ({path})", file=str(job.path), key=f"{where}[{i}]")
    return found


def _exists_somewhere(layout, value: str) -> bool:
    path = posixpath.join(layout.workdir, value)
    return os.path.exists(path) or bool(layout.shared_dir) and is_under(path, layout.shared_dir)


def entry_name(source: Source, sha256: str) -> str:
    base = posixpath.basename(source.path.rstrip("/")) or "root"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in base)[:64]
    return f"{safe}-{sha256[:16]}"


def staged_keys(staged: dict[str, Staged]) -> dict[str, str]:
    """The LlamaFactory keys pointed at the local copies ({key: path}; make_plan lays them over
    the config the ranks read: Layout.staged). Pure."""
    return {s.source.key: s.local for s in staged.values() if s.source.key}


# ---------------------------------------------------------------------------------------
# I/O


class Lines:
    """A stage program's stdout, read by a thread: its ``ftb-stage`` lines as they come."""

    def __init__(self, proc):
        self.proc = proc
        self.said: list[list[str]] = []
        self.progress = 0
        self.changed = threading.Event()
        self.ended = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        try:
            while chunk := self.proc.read_out():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    words = line.decode(errors="replace").split(" ", 2)
                    if words[0] != TAG or len(words) < 2:
                        continue
                    if words[1] == "progress":
                        self.progress = int(words[2])
                    else:
                        self.said.append(words[1:])
                    self.changed.set()
        except (OSError, EOFError, ValueError):
            pass
        self.ended = True
        self.changed.set()

    def first(self, *kinds: str) -> list[str] | None:
        return next((w for w in self.said if w[0] in kinds), None)

    def wait_for(self, kinds: tuple[str, ...], timeout: float) -> list[str] | None:
        deadline = time.monotonic() + timeout
        while True:
            found = self.first(*kinds)
            if found or self.ended or time.monotonic() > deadline:
                return found
            self.changed.wait(min(0.5, max(0.01, deadline - time.monotonic())))
            self.changed.clear()


def manifest(cluster, source: Source, hosts: list[Host], on_hashing: Callable[[str], None] | None = None) -> dict:
    """The source's manifest, read where it lives (the launcher, its host, or shared storage by
    the first host)."""
    if source.host is None and not source.shared:
        from .remote.probe_files import file_digests

        found = file_digests(source.path)
        return {"sha256": found["sha256"], "bytes": found["bytes"], "kind": "dir" if os.path.isdir(source.path)
                else "file", "files": [[rel, found["sizes"][rel], found["digests"][rel]] for rel, _ in found["listing"]]}
    host = next(h for h in hosts if h.name == source.host) if source.host else hosts[0]
    proc = start_node(cluster, host, {"do": "manifest", "path": source.path})
    err_said = [b""]

    def on_err(chunk: bytes) -> None:
        err_said[0] += chunk
        if on_hashing is not None:
            *lines, err_said[0] = err_said[0].split(b"\n")
            for line in lines:
                words = line.decode(errors="replace").split()
                if len(words) == 4 and words[0] == "ftb-hashing":
                    on_hashing(f"hashing {source.name} on {host.name}: {size_text(int(words[2]))} of "
                               f"{size_text(int(words[3]))}")

    result = proc.communicate(timeout=3600, on_err=on_err)
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise StageError(f"{host.name}: cannot read {source.path}: "
                         f"{(result.stderr.strip().splitlines() or [f'exit {result.code}'])[-1]}") from None
    if "error" in answer:
        raise StageError(f"{host.name}: {answer['error']}")
    return answer


def stage_one(cluster, source: Source, hosts: list[Host], stage_dir: str, *,
              say: Callable[[str], None], on_hashing: Callable[[str], None] | None = None,
              user: str = "stage", keep: dict | None = None) -> Staged:
    """Copy one source to every host's stage_dir (see the module's text)."""
    started = time.monotonic()
    found = manifest(cluster, source, hosts, on_hashing)
    entry = entry_name(source, found["sha256"])
    local = posixpath.join(stage_dir, entry)
    if found["kind"] == "file":
        local = posixpath.join(local, posixpath.basename(source.path))
    staged = Staged(source, entry=entry, local=local, bytes=found["bytes"], files=len(found["files"]))
    token = secrets.token_hex(16)
    spec = {"do": "receive", "stage_dir": stage_dir, "entry": entry, "token": token, "user": user, "keep": keep or {}}
    procs = {h.name: start_node(cluster, h, spec) for h in hosts}
    lines = {name: Lines(p) for name, p in procs.items()}
    try:
        ports: dict[str, int] = {}
        for h in hosts:
            said = lines[h.name].wait_for(("cached", "port", "error"), WAIT_S)
            for w in lines[h.name].said:
                if w[0] == "changed":
                    staged.changed[h.name] = w[1] if len(w) > 1 else "?"
            if said is None:
                raise StageError(f"{h.name}: the stage program said nothing in {WAIT_S:.0f}s"
                                 + _err_tail(procs[h.name]))
            if said[0] == "error":
                raise StageError(f"{h.name}: {' '.join(said[1:])}")
            if said[0] == "cached":
                staged.cached.append(h.name)
            else:
                ports[h.name] = int(said[1])
        chain = [h for h in hosts if h.name in ports]
        if source.host in ports:  # the host that holds the source heads the chain
            chain.sort(key=lambda h: h.name != source.host)
        if chain:
            _copy(cluster, source, found, hosts, chain, ports, procs, lines, token, say)
        staged.copied = [h.name for h in chain]
        for h in hosts:  # (a cached host prunes before it answers; a copying one before its "done")
            for w in lines[h.name].said:
                if w[0] == "pruned" and len(w) > 1 and len(w[1].split()) == 3:
                    name, size, days = w[1].split()
                    staged.pruned.append(f"{h.name}: {name} ({size_text(int(size))}, unused {float(days):.0f} days)")
    finally:
        for p in procs.values():
            p.close()
    staged.seconds = time.monotonic() - started
    return staged


def _copy(cluster, source, found, hosts, chain, ports, procs, lines, token, say) -> None:
    files = found["files"]
    feeder = None
    launcher_feeds = source.host is None and not source.shared
    head_from: object = "stdin" if launcher_feeds else "tcp"
    for i, h in enumerate(chain):
        nxt = [chain[i + 1].master_addr, ports[chain[i + 1].name]] if i + 1 < len(chain) else None
        order = {"files": files, "file_name": posixpath.basename(source.path), "from": head_from if i == 0 else "tcp",
                 "next": nxt}
        if not procs[h.name].send((json.dumps(order) + "\n").encode()):
            raise StageError(f"{h.name}: the stage program is gone before the copy")
    if launcher_feeds:
        feeder = Feed(procs[chain[0].name], source.path, files)
    else:  # the source's host (or, for shared storage, the chain's first) reads it and sends it on
        reader = next(h for h in hosts if h.name == source.host) if source.host else chain[0]
        feeder = start_node(cluster, reader, {"do": "send", "path": source.path, "token": token})
        feeder.send((json.dumps({"files": files, "to": [chain[0].master_addr if reader is not chain[0] else "127.0.0.1",
                                                          ports[chain[0].name]]}) + "\n").encode())
        feeder.close_stdin()
    try:
        _follow(source, found, chain, procs, lines, feeder, say)
    finally:
        if feeder is not None:
            feeder.close()


def _follow(source, found, chain, procs, lines, feeder, say) -> None:
    """Until every host of the chain has its copy (or the first is named that could not)."""
    last = time.monotonic()
    began = last
    moved = [-1, last]  # (the least any host of the chain has written, and when it last grew)
    while True:
        done = [h for h in chain if lines[h.name].first("done")]
        failed = [(h, lines[h.name].first("error")) for h in chain if lines[h.name].first("error")]
        if failed:
            h, words = failed[0]
            raise StageError(f"{h.name}: {' '.join(words[1:])}")
        ended = [h for h in chain if lines[h.name].ended and h not in done]
        if ended:
            raise StageError(f"{ended[0].name}: the stage program ended without a word" + _err_tail(procs[ended[0].name]))
        if len(done) == len(chain):
            break
        if isinstance(feeder, Feed) and feeder.error:
            raise StageError(f"{chain[0].name}: the launcher could not send {source.path} to it: {feeder.error}")
        if not isinstance(feeder, Feed) and feeder.wait(0) not in (None, 0):
            raise StageError(f"{source.host or chain[0].name}: could not read {source.path}" + _err_tail(feeder))
        now = time.monotonic()
        least = min(lines[h.name].progress for h in chain if h not in done)
        if least > moved[0]:
            moved[:] = [least, now]
        elif now - moved[1] > STALL_S:  # (the first host that holds the least: the ones after it wait on it)
            stuck = next(h for h in chain if h not in done and lines[h.name].progress == least)
            raise StageError(f"{stuck.name}: no byte for {STALL_S:.0f}s, at {size_text(least)} of "
                             f"{size_text(found['bytes'])} (the hosts after it in the chain wait on it)")
        if now - last >= PROGRESS_EVERY_S:
            last = now
            rate = least / (now - began) / 1e6
            say(f"staging {source.name}: {size_text(least)} of {size_text(found['bytes'])} to "
                f"{fold(h.name for h in chain)}, {rate:.0f} MB/s, {len(done)} of {len(chain)} host(s) done")
        time.sleep(0.05)
    for h in chain:
        lost = lines[h.name].first("next-lost")
        if lost:
            raise StageError(f"{h.name}: could not pass the copy on: {' '.join(lost[1:])}")


class Feed:
    """The launcher as the source: each file's bytes, in the manifest's order, into the first
    host's stdin, on a thread; ``error`` says why it stopped short."""

    def __init__(self, proc, path: str, files: list):
        self.proc, self.path, self.files = proc, path, files
        self.error = ""
        threading.Thread(target=self._run, daemon=True, name="stage-feed").start()

    def _run(self) -> None:
        try:
            for rel, size, _ in self.files:
                with open(os.path.join(self.path, rel) if rel else self.path, "rb") as f:
                    left = size
                    while left and (chunk := f.read(min(1 << 20, left))):
                        if not self.proc.send(chunk):
                            self.error = f"its stage program stopped reading after {size_text(size - left)} of {rel}"
                            return
                        left -= len(chunk)
            self.proc.close_stdin()
        except Exception as exc:  # noqa: BLE001 - said by _follow
            self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        pass


def _err_tail(proc) -> str:
    try:
        if proc.wait(1) is None:
            return ""
        err = b""
        while chunk := proc.read_err():
            err += chunk
    except (OSError, EOFError, ValueError):
        return ""
    last = err.decode(errors="replace").strip().splitlines()
    return f" ({last[-1]})" if last else ""


def cache_check(layout, cluster, on_hashing: Callable[[str], None] | None = None):
    """``ftbundle check``'s word on staging: per source, which hosts hold its copy already,
    which would get it (and why: absent, or changed since it was staged). A source that cannot be
    read fails the check. None when the job stages nothing."""
    from .check.finding import Check
    from .cluster import parallel

    if not layout.job.stage:
        return None
    groups: list[tuple[str, list[str]]] = []
    details: list[str] = []
    hosts = list(layout.hosts)
    for source in sources(layout):
        try:
            found = manifest(cluster, source, hosts, on_hashing)
        except StageError as exc:
            details.append(f"{source.name}: {exc}")
            continue
        entry = entry_name(source, found["sha256"])
        spec = {"do": "state", "stage_dir": layout.job.stage_dir, "entries": [entry]}
        def ask(h, spec=spec):
            try:
                return cluster.run(h, node_argv(h, spec), stdin=node_stdin(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - named in the report
                return exc

        answers = parallel(ask, hosts)
        said: dict[str, list[str]] = {}
        for h, answer in zip(hosts, answers):
            try:
                what, why = json.loads(answer.stdout)[entry]
            except (AttributeError, ValueError, KeyError, TypeError):
                details.append(f"{source.name}: {h.name} did not answer ({getattr(answer, 'stderr', answer)!s:.200})")
                continue
            text = {"cached": "cached", "absent": "to copy"}.get(what, f"to copy again ({why})")
            said.setdefault(text, []).append(h.name)
        head = f"{source.name} ({size_text(found['bytes'])}, {entry})"
        groups += [(f"{head}: {text}", names) for text, names in said.items()]
    return Check("stage", groups, failure="a source to stage cannot be read" if details else None, details=details,
                 label=f"stage to {layout.job.stage_dir}")


def stage_all(layout, cluster, *, say: Callable[[str], None], on_hashing: Callable[[str], None] | None = None,
              run: bool = True) -> dict[str, Staged]:
    """Every source of the job's ``stage:`` to every host of the layout: {name: Staged}. A
    StageError names the host that failed; nothing has been started. Each host's copies are
    marked used by the run (``run``; else by this `ftbundle stage`), and its stage_dir pruned by
    the job's ``stage_keep`` (never what a running run uses)."""
    found = {}
    user = layout.run_id if run else f"stage-{int(time.time())}"
    for source in sources(layout):
        staged = stage_one(cluster, source, list(layout.hosts), layout.job.stage_dir, say=say, on_hashing=on_hashing,
                           user=user, keep=layout.job.stage_keep)
        say(staged.line())
        found[source.name] = staged
    return found
