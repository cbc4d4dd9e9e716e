"""What every part of the probe uses (ftbundle/remote/probe.py, which is shipped after this text,
one program: ftbundle/check/__init__.py, ``probe_source``): commands under time limits, the
waits between looks at what the other hosts' probes do, a fact that could not be had.
Standard library only.

The probe runs on every host at every check, and on a loaded host (or 128 containers on two
cores) its CPU is the check's cost. Most of a plain probe's CPU was importing: json, socket,
threading and subprocess import enum, re, collections, selectors and contextlib, 14 ms of a
33 ms probe (and an address given to getaddrinfo as text, the idna codec: 2-6 ms more). So the
probe uses their C halves (_json, _socket, _thread) and os.posix_spawn, each below with the
module itself as the fallback where an interpreter lacks the C half: :data:`json`,
:class:`Task`, :func:`run`, :func:`hostname`, :func:`ipv4_of`, :func:`listening`,
:func:`accepted` and :func:`connected` (tests/unit/test_probe_cost_unit.py holds both: no heavy import,
the same results). bench/launch.py's "check on" column is what it buys."""

import _thread
import os
import time

try:
    import _socket
except ImportError:  # (socket.socket is a subclass of _socket.socket: the same calls)
    import socket as _socket
TIMED_OUT = _socket.timeout  # (socket.timeout: TimeoutError since 3.10, an OSError before)

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
# rank 0's line on stderr when it will not listen on the master port (another run's claim, the port
# in use): the launcher passes it on to the other hosts' probes, which then stop knocking (probe.py)
PORT_OFF = "ftb-port-off"


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
    kernel (a hung GPU driver) cannot be reaped, and must not hang the probe with it.
    What subprocess.Popen(text=True, start_new_session=True, stdin=DEVNULL).communicate()
    gives, with os.posix_spawn, select.poll and waitpid (subprocess where they are missing)."""
    import select

    spawn = getattr(os, "posix_spawn", None)
    if spawn is None or not hasattr(select, "poll"):
        return _run_popen(argv, timeout, env)
    environ = os.environ if env is None else env
    exe = argv[0] if os.sep in argv[0] else which(argv[0], environ.get("PATH", os.defpath))
    if exe is None:
        return None, "", os.strerror(2), False  # (what Popen says: "No such file or directory")
    out_r, out_w = os.pipe()  # (not inheritable: only what the actions dup2 reaches the command)
    err_r, err_w = os.pipe()
    try:
        import _signal
        pid = spawn(exe, list(argv), environ, setsid=True, setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ),
                    file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                  (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except NotImplementedError:  # (no setsid in this libc's posix_spawn)
        pid = None
    except OSError as exc:
        pid = exc
    finally:
        os.close(out_w)
        os.close(err_w)
    if pid is None or isinstance(pid, OSError):
        os.close(out_r)
        os.close(err_r)
        return _run_popen(argv, timeout, env) if pid is None else (None, "", pid.strerror or str(pid), False)
    deadline = time.monotonic() + timeout
    chunks = {out_r: [], err_r: []}
    reading = set(chunks)
    poller = select.poll()
    for fd in reading:
        poller.register(fd, select.POLLIN)
    status, pause = None, 0.0005
    try:
        while reading:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            for fd, _ in poller.poll(left * 1000):
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:  # (the stream's end)
                    poller.unregister(fd)
                    reading.discard(fd)
        while status is None:  # both streams ended: the command's exit follows
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                status = None
                if time.monotonic() >= deadline:
                    raise TimeoutError
                time.sleep(pause)
                pause = min(0.05, pause * 2)
    except TimeoutError:
        try:
            os.killpg(pid, 9)
        except OSError:
            pass
        return None, "", "", True
    finally:
        os.close(out_r)
        os.close(err_r)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    text = [b"".join(chunks[fd]).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            for fd in (out_r, err_r)]
    return code, text[0], text[1], False


def _run_popen(argv, timeout, env=None):
    """:func:`run` with subprocess (an interpreter without os.posix_spawn, or a libc without setsid in it)."""
    import subprocess

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


def which(program, path=None):
    for d in (os.environ.get("PATH", "") if path is None else path).split(os.pathsep):
        candidate = os.path.join(d, program)
        if d and os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate
    return None


def guarded(task, *args):
    out = args[1]
    try:
        task(*args)
    except Exception as exc:  # a fact that could not be had is reported, never a crash
        out.setdefault("errors", []).append(f"{task.__name__}: {type(exc).__name__}: {exc}")


class Task:
    """threading.Thread's few calls the probe makes (start, join with a limit, is_alive, name),
    on _thread: threading imports collections and functools for much it does not use. A task
    never holds the probe's end (the probe leaves with os._exit)."""

    def __init__(self, target, args=(), name=None):
        self.target, self.args = target, args
        self.name = name or target.__name__
        self._done = _thread.allocate_lock()
        self._done.acquire()

    def start(self):
        _thread.start_new_thread(self._run, ())
        return self

    def _run(self):
        try:
            self.target(*self.args)
        finally:
            self._done.release()

    def join(self, timeout=None):
        if self._done.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._done.release()

    def is_alive(self):
        if self._done.acquire(False):
            self._done.release()
            return False
        return True


class _Json:
    """json.loads, load, dumps (sort_keys) and dump on the json package's own C scanner and
    encoder (_json), the package itself not imported (it imports re and enum): the same text
    out, the same values in (plain JSON: what the probe reads and writes). Malformed text raises
    a ValueError (json.JSONDecodeError, imported then)."""

    def __init__(self, c):
        # the scanner's settings, read from this object (json.decoder.JSONDecoder's defaults)
        self.strict, self.object_hook, self.object_pairs_hook = True, None, None
        self.parse_float, self.parse_int, self.memo = float, int, {}
        self.parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__
        self._scan = c.make_scanner(self)

        def default(o):
            raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

        # (markers, default, encoder, indent, key_separator, item_separator, sort_keys, skipkeys, allow_nan)
        self._encoders = {sort: c.make_encoder(None, default, c.encode_basestring_ascii, None, ": ", ", ",
                                               sort, False, True) for sort in (False, True)}

    def loads(self, text):
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")
        start = len(text) - len(text.lstrip(" \t\n\r"))
        try:
            value, end = self._scan(text, start)
        except StopIteration:
            raise ValueError(f"Expecting value: char {start}") from None
        if text[end:].strip(" \t\n\r"):
            raise ValueError(f"Extra data: char {end}")
        return value

    def load(self, f):
        return self.loads(f.read())

    def dumps(self, value, sort_keys=False):
        return "".join(self._encoders[bool(sort_keys)](value, 0))

    def dump(self, value, f, sort_keys=False):
        f.write(self.dumps(value, sort_keys))


def _json():
    try:
        import _json as c

        light = _Json(c)
        if light.dumps(light.loads('{"a": [1, 2.5, "\\u00e9", null, true]}')) == '{"a": [1, 2.5, "\\u00e9", null, true]}':
            return light
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    import json as module  # (an interpreter whose _json is not CPython's)

    return module


json = _json()


def hostname():
    return _socket.gethostname()


def _host(addr):
    """``addr`` as getaddrinfo should get it: a name in ASCII as bytes (as text it imports the
    idna codec, 2-6 ms of a probe)."""
    try:
        return addr.encode("ascii")
    except UnicodeEncodeError:
        return addr


def ipv4_of(addr):
    """The IPv4 address ``addr`` names (an address, or a name resolved)."""
    return _socket.getaddrinfo(_host(addr), None, _socket.AF_INET)[0][4][0]


def listening(port_number, peers=0):
    """A TCP socket bound to ``port_number`` on every address, listening (OSError: not free),
    with room for every one of ``peers`` to knock at once: a full backlog drops a knock's SYN,
    and the peer's kernel sends it again only a second later (128 hosts: 1 s of every check)."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
    try:
        s.bind(("", port_number))
        s.listen(max(64, peers + 8))  # (the kernel caps it at net.core.somaxconn)
    except OSError:
        s.close()
        raise
    return s


def accepted(s, timeout):
    """(the next connection to ``s``, its peer's address), or None after ``timeout``."""
    s.settimeout(timeout)
    try:
        fd, addr = s._accept()
    except TIMED_OUT:
        return None
    return _socket.socket(s.family, s.type, s.proto, fd), addr[0]


def knocked(addr, port_number, timeout):
    """"ok" when a TCP connection to ``addr``:``port_number`` is made at one of the addresses it
    resolves to, else why not, the most telling first: refused (something is there, not this),
    then no answer, then the first other error ("localhost" may resolve to an IPv6 address a
    host cannot use beside the IPv4 one that refuses)."""
    try:
        places = _socket.getaddrinfo(_host(addr), port_number, 0, _socket.SOCK_STREAM)
    except OSError as exc:
        return "name not resolved" if exc.__class__.__name__ == "gaierror" else exc.strerror or str(exc)
    whys = []
    for family, kind, proto, _, where in places:
        s = _socket.socket(family, kind, proto)
        try:
            s.settimeout(timeout)
            s.connect(where)
            return "ok"
        except OSError as exc:
            whys.append("no answer in %g s" % timeout if isinstance(exc, TIMED_OUT) else exc.strerror or str(exc))
        finally:
            s.close()
    for telling in ("Connection refused", "no answer in %g s" % timeout):
        if telling in whys:
            return telling
    return whys[0] if whys else "no address"


def connected(addr, port_number, timeout):
    """A TCP connection to ``addr``:``port_number`` (each address it resolves to, in turn, as
    socket.create_connection); OSError (``_socket.timeout``: timed out) when none answers."""
    last = OSError("no address")
    for family, kind, proto, _, where in _socket.getaddrinfo(_host(addr), port_number, 0, _socket.SOCK_STREAM):
        s = _socket.socket(family, kind, proto)
        try:
            s.settimeout(timeout)
            s.connect(where)
            return s
        except OSError as exc:
            s.close()
            last = exc
    raise last


class Lines:
    """The lines that come on ``fd``, one at a time, each waited for until a deadline: what
    follows a line in the same read is kept for the next."""

    def __init__(self, fd):
        self.fd, self.got, self.ended = fd, b"", False

    def next(self, end):
        """The next line without its newline, waited for until ``end`` (monotonic); what came
        before the stream ended or the time was up when no whole line did (b"" when nothing)."""
        import select

        while b"\n" not in self.got and not self.ended:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            chunk = os.read(self.fd, 65536) if ready else b""
            if not chunk:
                self.ended = bool(ready)  # (a stream's end; an empty select is the time up)
                break
            self.got += chunk
        line, _, self.got = self.got.partition(b"\n")
        return line


class Latch:
    """threading.Event's set and wait, on _thread: a task waits until what it needs is known."""

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self):
        try:
            self._lock.release()
        except RuntimeError:  # (set already)
            pass

    def wait(self, timeout=-1):
        """Whether it is set, waited for at most ``timeout`` seconds (-1: until it is)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True
