"""What went wrong with a host, in words: unreachable, timed out, refused (worth another try)."""

from __future__ import annotations

import socket


class HostUnreachable(Exception):
    """The host could not be connected to (or its transport is gone)."""


class NoBanner(Exception):
    """The TCP connection was accepted and no SSH banner came back in time."""


def no_banner(conn) -> bool:
    """Whether a connection that failed never heard the server's SSH banner (its transport has
    no remote version): something accepts connections on that port and does not speak SSH.
    Not a connection the server reset or closed before its banner (an sshd at MaxStartups
    does that): that is refused, worth another try."""
    client = getattr(conn, "client", None)
    transport = client.get_transport() if client is not None else None
    if transport is None or getattr(transport, "remote_version", ""):
        return False
    saved = getattr(transport, "saved_exception", None)
    return saved is None or not refused(saved)


def causes(exc: BaseException | None):
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1


def timed_out(exc: BaseException) -> bool:
    return any(isinstance(e, (socket.timeout, TimeoutError)) or "timed out" in str(e).lower()
               for e in causes(exc))


def refused(exc: BaseException) -> bool:
    """A connection refused or dropped before it was authenticated: what an sshd at its
    MaxStartups (or restarting) does; worth another try. Not a timeout, not auth, not a
    host key."""
    from ..ssh import load_fabric

    load_fabric()  # (not imported yet when the TCP connection failed)
    from paramiko.ssh_exception import AuthenticationException, BadHostKeyException

    if isinstance(exc, (AuthenticationException, BadHostKeyException)) or timed_out(exc):
        return False
    for e in causes(exc):
        if isinstance(e, (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
                          BrokenPipeError, EOFError)):
            return True
        text = str(e)
        if "Error reading SSH protocol banner" in text or "Connection reset" in text or "Connect failed" in text:
            return True
    return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:400]
