"""Fabric connections built from inventory hosts: the one place that knows SSH options.

Host keys are checked as OpenSSH checks them: the user's ~/.ssh/known_hosts, the system's
/etc/ssh/ssh_known_hosts (which site.yml's ssh_mesh role manages) and the file the
inventory names with `-o UserKnownHostsFile=` are loaded; a host whose key is in none of
them is refused with a message that says how to accept it. Only `--accept-new-host-keys`
trusts a new key, and it is then recorded (in the inventory's known_hosts file, else the
user's) and said on stderr: never added silently. A changed key is always refused.

A bastion (`-o ProxyJump=[user@]host[:port]` or `-J ...` in ansible_ssh_common_args) becomes
Fabric's gateway: the connection to the host is tunnelled through one to the bastion.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from .inventory import Host

CONNECT_TIMEOUT = 10
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
_record_lock = threading.Lock()


class UnknownHostKey(Exception):
    """The host's key is in no known_hosts file (and new keys are not accepted)."""


def _policy(host: Host, accept_new: bool):
    from paramiko.client import MissingHostKeyPolicy

    class Policy(MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            if not accept_new:
                raise UnknownHostKey(
                    f"host key of {hostname} ({key.get_name()}) is not in known_hosts: refused, as OpenSSH "
                    "refuses it. Check it, then run again with --accept-new-host-keys to trust and record it "
                    f"(or add it yourself: ssh-keyscan -p {host.port} {host.address} >> ~/.ssh/known_hosts)")
            path = os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts")
            with _record_lock:
                os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
                with open(path, "a") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            print(f"ftbundle: accepted the new host key of {hostname} ({key.get_name()} "
                  f"{key.fingerprint if hasattr(key, 'fingerprint') else ''}) and recorded it in {path}",
                  file=sys.stderr, flush=True)

    return Policy()


_connection_class = None


class LowLatencySocket(socket.socket):
    """The TCP socket under every SSH connection, tuned for SSH's small request/answer
    messages (measured on the test hosts, paramiko 5.1 against OpenSSH 9.2):

    * TCP_NODELAY before the handshake: paramiko's own socket has Nagle's algorithm on, and
      the handshake sends small packets back to back (NEWKEYS, then the ssh-userauth service
      request): the second waited for the server's delayed ACK, 40 ms of a 70 ms login.
    * TCP_QUICKACK after every read: after the login sshd sends a few small messages of its
      own (a debug message, the hostkeys-00@openssh.com notice) that need no answer, so the
      client delayed its ACK; sshd's Nagle then held the confirmation of the first channel
      behind that ACK: the first command on every connection took 52 ms to start, the
      second 1 ms. Linux leaves quick-ACK mode by itself, hence once per read.
    """

    @classmethod
    def connect_to(cls, host: str, port: int, timeout: float | None) -> LowLatencySocket:
        """Like socket.create_connection: each address of ``host`` in turn. An ASCII name goes
        to getaddrinfo as bytes: given a str, Python encodes it as IDNA first, and importing
        that codec (encodings.idna, stringprep) costs 3-4 ms of every start."""
        error: OSError | None = None
        name = host.encode("ascii") if host.isascii() else host
        for family, kind, proto, _, address in socket.getaddrinfo(name, port, 0, socket.SOCK_STREAM):
            sock = cls(family, kind, proto)
            try:
                sock.settimeout(timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.connect(address)
                return sock
            except OSError as exc:
                error = exc
                sock.close()
        raise error or OSError(f"cannot resolve {host}")

    def recv(self, n: int, *flags: int) -> bytes:
        data = super().recv(n, *flags)
        if hasattr(socket, "TCP_QUICKACK"):  # Linux
            try:
                self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:
                pass
        return data


def _connection():
    """Fabric's Connection, whose ``open()`` hands paramiko a :class:`LowLatencySocket`
    (the one :func:`connect` was given, already connected, else a new one). Through a
    bastion the target's "socket" is a channel of the bastion's connection, which has one
    of its own."""
    global _connection_class
    if _connection_class is None:
        from fabric import Connection

        class LowLatencyConnection(Connection):
            def open(self):
                if self.is_connected or self.gateway:
                    return super().open()
                sock = self.connect_kwargs.get("sock") or LowLatencySocket.connect_to(
                    self.host, int(self.port), self.connect_timeout)
                self.connect_kwargs = {**self.connect_kwargs, "sock": sock}
                try:
                    return super().open()
                except BaseException:
                    sock.close()
                    raise
                finally:
                    self.connect_kwargs = {k: v for k, v in self.connect_kwargs.items() if k != "sock"}

        _connection_class = LowLatencyConnection
    return _connection_class


def connect(host: Host, *, timeout: int = CONNECT_TIMEOUT, accept_new_host_keys: bool = False,
            sock: LowLatencySocket | None = None):
    """A Fabric Connection to ``host`` using the inventory's user, port, key, known_hosts
    and bastion. Nothing is opened yet, except ``sock``: a TCP connection to the host made
    beforehand (:meth:`LowLatencySocket.connect_to`), which ``open()`` then uses."""
    from fabric import Config

    Connection = _connection()

    connect_kwargs = {"banner_timeout": timeout, "auth_timeout": timeout}
    if sock is not None and not host.proxy_jump:
        connect_kwargs["sock"] = sock
    if host.key_file:
        connect_kwargs["key_filename"] = [os.path.expanduser(host.key_file)]
        connect_kwargs["look_for_keys"] = False
        connect_kwargs["allow_agent"] = False
    # Never forward our own stdin (a terminal, a pipe) to a remote command unless a caller
    # hands one over explicitly: Invoke's default reads sys.stdin.
    config = Config(overrides={"run": {"in_stream": False}})
    gateway = None
    if host.proxy_jump:
        gateway = connect(bastion(host), timeout=timeout, accept_new_host_keys=accept_new_host_keys)
    conn = Connection(host=host.address, user=host.user, port=host.port, config=config, gateway=gateway,
                      connect_timeout=timeout, connect_kwargs=connect_kwargs)
    for path in (os.path.expanduser("~/.ssh/known_hosts"), SYSTEM_KNOWN_HOSTS,
                 os.path.expanduser(host.known_hosts) if host.known_hosts else None):
        if path and os.path.exists(path):
            conn.client.load_host_keys(path)
    conn.client.set_missing_host_key_policy(_policy(host, accept_new_host_keys))
    return conn


def bastion(host: Host) -> Host:
    """The ProxyJump host as a Host: `[user@]name[:port]`, with the target's key and
    known_hosts (Ansible users set them once for both)."""
    spec = host.proxy_jump.split(",")[0]
    user, _, rest = spec.rpartition("@")
    name, _, port = rest.partition(":")
    return Host(name=name, address=name, port=int(port) if port.isdigit() else 22, user=user or host.user,
                key_file=host.key_file, known_hosts=host.known_hosts)
