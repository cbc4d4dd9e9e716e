"""One SSH transport per host, opened once, in parallel, and reused by everything.

A run talks to its hosts many times: the check's rounds, staging the run directory, the
node channels, log tails, teardown, fencing before a restart, status. Each of those used to
pay an SSH handshake of its own. Here every remote host gets one Fabric ``Connection``
(auth, known_hosts, one paramiko transport), opened for all hosts at once, and every later
command is a new *channel* on that transport: no handshake, one round trip (:class:`Cluster`).
"""

from __future__ import annotations

import os
import random
import shlex
import threading
import time
from collections.abc import Iterable, Sequence

from ..inventory import Host
from .errors import HostUnreachable, NoBanner, causes, first_line, no_banner, refused, timed_out
from .fanout import parallel
from .paramiko_fixes import hook_exec_answers, settle
from .procs import ChannelProc, LocalProc, Proc, Result

CONNECT_TIMEOUT_S = 10
# New connections are opened a few at a time per sshd, and not all at once overall. A stock
# sshd's `MaxStartups 10:30:100` starts refusing (at random, 30% of them at first) the
# connections beyond 10 that are not yet authenticated: 8 per sshd stays under it with room
# for a user's own ssh. Overall, 64 handshakes in flight keep the controller's CPU (the key
# exchanges) from stretching each handshake past its timeout on a loaded machine.
# Environment: FTBUNDLE_SSH_MAX_STARTUPS, FTBUNDLE_SSH_MAX_HANDSHAKES, FTBUNDLE_SSH_CONNECT_TRIES.
MAX_STARTUPS = 8
MAX_HANDSHAKES = 64
CONNECT_TRIES = 5  # a refused or reset connection (an sshd at its MaxStartups, restarting)
RETRY_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)  # before the 2nd, 3rd, ... try (+ up to 50% jitter)


class Cluster:
    """The open connections to a job's hosts (one per distinct remote host).

    ``open()`` connects to every remote host at once; a host that cannot be reached is
    recorded in ``errors`` (the check reports it; a launch refuses to start). Everything
    else asks for a :class:`Proc` on a host with :meth:`start` or runs a short command with
    :meth:`run`. ``close()`` (or the context manager) drops every connection.
    """

    def __init__(self, hosts: Iterable[Host], *, connect_timeout: float = CONNECT_TIMEOUT_S,
                 accept_new_host_keys: bool = False, max_startups: int | None = None,
                 max_handshakes: int | None = None, connect_tries: int | None = None):
        self.hosts = list(dict.fromkeys(hosts))
        self.connect_timeout = connect_timeout
        self.accept_new_host_keys = accept_new_host_keys
        self.max_startups = max_startups or _env_int("FTBUNDLE_SSH_MAX_STARTUPS", MAX_STARTUPS)
        self.connect_tries = connect_tries or _env_int("FTBUNDLE_SSH_CONNECT_TRIES", CONNECT_TRIES)
        self.max_handshakes = max_handshakes or _env_int("FTBUNDLE_SSH_MAX_HANDSHAKES", MAX_HANDSHAKES)
        self._handshakes = threading.BoundedSemaphore(self.max_handshakes)
        self._startups: dict[tuple[str, int], threading.BoundedSemaphore] = {}  # per sshd
        self._gateways: dict[tuple, object] = {}  # one shared connection per bastion
        self._gateway_locks: dict[tuple, threading.Lock] = {}
        self.errors: dict[str, str] = {}  # host name -> why it could not be connected
        self._why: dict[str, str] = {}  # host name -> the reason alone (the summary groups by it)
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()
        self._opening: threading.Thread | None = None
        self._tried: dict[str, threading.Event] = {}  # host name -> set once its connection was tried

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- connections ------------------------------------------------------------------
    def open(self, hosts: Iterable[Host] | None = None, *, background: bool = False) -> Cluster:
        """Connect to the given (default: all) remote hosts in parallel, once each: a host
        already connected, or already found unreachable, is left as it is (a second try is
        :meth:`reconnect`'s business). With ``background``, return at once; the caller does
        its own work while the handshakes wait on the network, then calls :meth:`wait_open`."""
        todo = [h for h in (self.hosts if hosts is None else hosts)
                if not h.local and h.name not in self._conns and h.name not in self.errors]
        _enough_fds(len(self._conns) + len(todo))
        # (no more connecting threads than handshakes may be in flight: 64, not one per host)
        workers = self.max_handshakes
        if background:
            self._opening = threading.Thread(target=parallel, args=(self._connect, todo, workers), daemon=True,
                                             name="connect")
            self._opening.start()
        else:
            parallel(self._connect, todo, workers)
        return self

    def open_first(self, hosts: list[Host], hedge_s: float = 1.0) -> tuple[Host | None, list[Host]]:
        """Connect to ``hosts`` in order, starting the next one each time the last has not
        answered within ``hedge_s``: (the first in order that is connected, the hosts tried before
        it that had not answered yet: their connections go on in the background). A dead host
        costs ``hedge_s``, not the connect timeout; (None, []) when every host failed."""
        started: list[tuple[Host, threading.Thread]] = []
        pending = list(hosts)
        next_at = time.monotonic()
        while True:
            now = time.monotonic()
            if pending and now >= next_at:
                host = pending.pop(0)
                t = threading.Thread(target=self._connect, args=(host,), daemon=True, name=f"connect {host.name}")
                t.start()
                started.append((host, t))
                next_at = now + hedge_s
            for i, (host, t) in enumerate(started):
                if host.name in self._conns and not t.is_alive():
                    return host, [h for h, t2 in started[:i] if h.name not in self.errors]
            if not pending and all(not t.is_alive() for _, t in started):
                return None, []
            if all(not t.is_alive() for _, t in started):  # (all tried so far failed: the next at once)
                next_at = now
            time.sleep(0.01)

    def errors_said(self, each_up_to: int = 3) -> str:
        """The connection errors in one line: each host's own for a few; past that, the hosts
        folded by reason ("412 hosts: node[5-17]-p[2201-2232]: Authentication timeout."), so
        that 1,000 hosts do not make a line no one can read."""
        from ..hostlist import fold

        if len(self.errors) <= each_up_to:
            return "; ".join(self.errors.values())
        by_reason: dict[str, list[str]] = {}
        for name in self.errors:
            by_reason.setdefault(self._why.get(name, "no connection"), []).append(name)
        groups = sorted(by_reason.items(), key=lambda item: -len(item[1]))
        return f"{len(self.errors)} hosts: " + "; ".join(f"{fold(names)}: {reason}" for reason, names in groups)

    def opening(self) -> bool:
        """Whether a background :meth:`open` is still trying hosts."""
        opening = self._opening
        return opening is not None and opening.is_alive()

    def wait_tried(self, host: Host | None = None, timeout: float | None = None) -> bool:
        """Wait until ``host`` (None: every host) of a background :meth:`open` has been tried:
        connected, or found unreachable. Unlike :meth:`wait_open`, any number of threads may
        wait at once (a check whose probes start as their hosts connect)."""
        if host is not None:
            if host.local or host.name in self._conns or host.name in self.errors:
                return True
            with self._lock:
                tried = self._tried.setdefault(host.name, threading.Event())
            end = None if timeout is None else time.monotonic() + timeout
            while not tried.wait(0.1):
                if not self.opening():  # (a host this open never tries: done when the open is)
                    return True
                if end is not None and time.monotonic() >= end:
                    return False
            return True
        opening = self._opening
        if opening is not None:
            opening.join(timeout)
        return not self.opening()

    def wait_open(self) -> Cluster:
        """Wait (interruptibly) until a background :meth:`open` has tried every host."""
        opening, self._opening = self._opening, None
        while opening is not None and opening.is_alive():
            opening.join(0.1)
        return self

    def _connect(self, host: Host) -> None:
        """Open ``host``'s connection: at most ``max_startups`` handshakes at a time to one
        sshd and ``MAX_HANDSHAKES`` in all; a refused or reset connection is tried again
        (``connect_tries`` in all, with backoff) before the host is called unreachable."""
        for attempt in range(self.connect_tries):
            try:
                conn = self._open_one(host)
            except Exception as exc:  # refused, timed out, auth or host key failure
                if attempt + 1 < self.connect_tries and refused(exc):
                    delay = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                    time.sleep(delay * (1 + random.random() / 2))
                    continue
                where = f"{host.user + '@' if host.user else ''}{host.address}:{host.port}"
                if host.proxy_jump:
                    where += f" through {host.proxy_jump}"
                tries = f" ({attempt + 1} tries)" if attempt else ""
                reason = self._reason(exc)
                with self._lock:
                    self.errors[host.name] = f"cannot SSH to {where}: {reason}{tries}"
                    self._why[host.name] = reason
                    self._tried.setdefault(host.name, threading.Event()).set()
                return
            with self._lock:
                self.errors.pop(host.name, None)
                self._why.pop(host.name, None)
                self._conns[host.name] = conn
                self._tried.setdefault(host.name, threading.Event()).set()
            return

    def _open_one(self, host: Host):
        """One try: a connected, authenticated Connection to ``host``, or an exception."""
        from ..ssh import LowLatencySocket, connect

        gateway = self._gateway(host) if host.proxy_jump else None
        conn = sock = None
        with self._startup_slot(host.address, host.port), self._handshakes:
            try:
                # The TCP connection first: sshd forks and sends its banner while Fabric and
                # paramiko are imported (about 80 ms, in connect() the first time).
                sock = None if host.proxy_jump else LowLatencySocket.connect_to(host.address, host.port,
                                                                                self.connect_timeout)
                conn = connect(host, timeout=self.connect_timeout, accept_new_host_keys=self.accept_new_host_keys,
                               sock=sock, gateway=gateway)
                conn.open()  # on a ftbundle.ssh.LowLatencySocket: no 40 ms stalls on small messages
                settle(conn.transport)
            except BaseException as exc:
                silent = conn is not None and no_banner(conn) and not refused(exc)
                if conn is not None:
                    _close_quietly(conn)
                elif sock is not None:
                    sock.close()
                if silent:  # (paramiko goes on to authenticate and says "No existing session")
                    # (a host whose system hangs, frozen or paused, still accepts TCP: its kernel answers)
                    raise NoBanner(f"timed out after {self.connect_timeout:g} s waiting for the SSH banner: the "
                                   f"port accepts connections but nothing there speaks SSH: the host hangs (its "
                                   f"kernel still answers TCP) or {host.port} is not its sshd's port") from exc
                raise
        return conn

    def _startup_slot(self, address: str, port: int) -> threading.BoundedSemaphore:
        with self._lock:
            return self._startups.setdefault((address, int(port)), threading.BoundedSemaphore(self.max_startups))

    def _gateway(self, host: Host):
        """The one open connection to ``host``'s bastion, shared by every host behind it
        (each host used to open its own: n unauthenticated connections at once to one sshd,
        past a stock MaxStartups). Opened by the first host that needs it, again when lost."""
        from ..ssh import bastion, connect

        jump = bastion(host)
        key = (jump.address, jump.port, jump.user, jump.key_file, jump.known_hosts)
        with self._lock:
            lock = self._gateway_locks.setdefault(key, threading.Lock())
        with lock:
            gateway = self._gateways.get(key)
            if gateway is not None and gateway.is_connected:
                return gateway
            if gateway is not None:
                _close_quietly(gateway)
            gateway = connect(jump, timeout=self.connect_timeout, accept_new_host_keys=self.accept_new_host_keys)
            with self._startup_slot(jump.address, jump.port), self._handshakes:
                gateway.open()
            settle(gateway.transport)
            self._gateways[key] = gateway
            return gateway

    def _reason(self, exc: BaseException) -> str:
        """Why a try failed, in words: a timeout says so and how long it waited."""
        if isinstance(exc, NoBanner):
            return str(exc)
        if timed_out(exc):
            return f"timed out after {self.connect_timeout:g} s"
        if refused(exc) and not any(isinstance(e, ConnectionRefusedError) for e in causes(exc)):
            return (f"the server closed the connection before its SSH banner ({first_line(exc)}): an sshd "
                    "at its MaxStartups or restarting does this")
        return first_line(exc)

    def reconnect(self, host: Host) -> bool:
        """A fresh connection to a host whose transport died (after a partition heals or
        the host comes back); True when it is up."""
        if host.local:
            return True
        self.drop(host)
        self._connect(host)
        return self.alive(host)

    def _transport(self, host: Host):
        """The host's paramiko transport while it is up, else None."""
        conn = self._conns.get(host.name)
        transport = getattr(conn, "transport", None) if conn is not None else None
        return transport if transport is not None and transport.is_active() else None

    def alive(self, host: Host) -> bool:
        return host.local or self._transport(host) is not None

    def can_send(self, host: Host, wait: float = 0.0) -> bool:
        """Whether a message to ``host`` would go out now: its transport is up and no key exchange
        holds its sends (one in progress is waited for up to ``wait`` seconds; a real one takes
        milliseconds, one whose peer stopped mid-way never ends, while the transport stays active)."""
        if host.local:
            return True
        transport = self._transport(host)
        return transport is not None and transport.clear_to_send.wait(wait)

    def answers(self, host: Host, timeout: float) -> bool:
        """Whether the host's sshd replies within ``timeout``: a global request that wants a
        reply (sshd answers one it does not know with a failure, which is an answer). A
        transport stays "active" for minutes after its host died or its network was cut
        (:meth:`alive` says yes); this asks the other end. The request waits on a thread of
        its own, which ends with the transport when the host never answers."""
        if host.local:
            return True
        transport = self._transport(host)
        if transport is None:
            return False
        replied = threading.Event()

        def ask() -> None:
            try:
                transport.global_request("keepalive@openssh.com", wait=True)
                if transport.is_active():
                    replied.set()
            except Exception:
                pass

        threading.Thread(target=ask, daemon=True, name=f"answers-{host.name}").start()
        return replied.wait(timeout)

    def drop(self, host: Host) -> None:
        """Forget a host's connection without waiting for it (a lost host's transport may
        hang on a dead network)."""
        with self._lock:
            conn = self._conns.pop(host.name, None)
        if conn is not None:
            threading.Thread(target=_close_quietly, args=(conn,), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            conns += list(self._gateways.values())  # (after the hosts tunnelled through them)
            self._gateways = {}
        for conn in conns:
            threading.Thread(target=_close_quietly, args=(conn,), daemon=True).start()

    # -- commands ---------------------------------------------------------------------
    def start(self, host: Host, argv: Sequence[str], *, timeout: float | None = None) -> Proc:
        """Start ``argv`` on ``host``: a channel on its transport, or a local process."""
        if host.local:
            return LocalProc(argv)
        transport = self._transport(host)
        if transport is None:
            raise HostUnreachable(self.errors.get(host.name) or f"no connection to {host.name}")
        chan = None
        limit = timeout or self.connect_timeout
        # A key exchange in progress holds every send on the transport, the channel open's
        # included, and paramiko waits for its end without a limit: a peer that died in the
        # middle of one held the run's last record 30 s (tests/cluster/test_launcher_faults.py).
        if not transport.clear_to_send.wait(limit):
            raise HostUnreachable(f"{host.name}: its SSH key exchange did not finish within {limit:g}s")
        try:
            chan = transport.open_session(timeout=limit)
            # paramiko waits for sshd's answer to the exec request without a limit: a session
            # process that never answers would hold the caller (a stop, a teardown) forever.
            # Closing the channel at the limit ends that wait with an error.
            # The guard and sshd's answer exclude each other, decided where the answer is read
            # (paramiko's transport thread, hook_exec_answers): an answer read first makes the
            # guard close nothing, however late exec_command itself returns; a guard that fired
            # first makes a late answer count for nothing (the channel is closed).
            fired = threading.Event()
            settled = threading.Lock()
            answered = threading.Event()

            def expire() -> None:
                with settled:
                    if not answered.is_set():
                        fired.set()
                        chan.close()

            def on_answer() -> bool:
                with settled:
                    if fired.is_set():
                        return False
                    answered.set()
                    return True

            hook_exec_answers(transport)
            chan.ftb_on_answer = on_answer
            guard = threading.Timer(limit, expire)
            guard.daemon = True
            guard.start()
            try:
                chan.exec_command(shlex.join(argv))
            finally:
                guard.cancel()
            if fired.is_set():
                raise EOFError("the channel was closed at the time limit")
        except Exception as exc:
            if chan is not None and fired.is_set():
                raise HostUnreachable(f"{host.name}: sshd did not answer the request to start the command "
                                      f"within {limit:g}s") from exc
            if chan is not None and chan.closed and transport.is_active():
                # paramiko's "Channel closed.": sshd answered the exec request with a failure
                # (it could not fork the session: process limits, PAM), the connection is fine
                raise HostUnreachable(f"{host.name}: sshd refused to start the command (its exec request "
                                      "failed; the reason is in that host's sshd log)") from exc
            raise HostUnreachable(f"{host.name}: {first_line(exc)}") from exc
        return ChannelProc(chan)

    def run(self, host: Host, argv: Sequence[str], *, stdin: bytes = b"", timeout: float = 30) -> Result:
        """Run a short command to its end; raises HostUnreachable or TimeoutError."""
        return self.start(host, argv, timeout=timeout).communicate(stdin, timeout=timeout)

    def run_all(self, jobs: Sequence[tuple[Host, Sequence[str]]], *, timeout: float = 30,
                stdin: bytes = b"") -> list[Result | Exception]:
        """Run one command per (host, argv) at once; an exception in place of a result for
        a host that could not run it."""
        def one(job: tuple[Host, Sequence[str]]) -> Result | Exception:
            try:
                return self.run(job[0], job[1], stdin=stdin, timeout=timeout)
            except Exception as exc:
                return exc

        return parallel(one, jobs)


def _enough_fds(connections: int) -> None:
    """Raise the soft limit on open files (1024 by default) towards the hard one when the
    connections need more: one socket per host, a few per node channel's pipes."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 4 * connections + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                        hard))
    except (ImportError, ValueError, OSError):  # not raised: the system's own limit then applies
        pass


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


def _close_quietly(conn) -> None:
    try:
        conn.close()
    except Exception:
        pass
