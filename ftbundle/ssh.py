"""Fabric connections built from inventory hosts: the one place that knows SSH options.

Host keys are checked as OpenSSH checks them: the user's ~/.ssh/known_hosts, the system's
/etc/ssh/ssh_known_hosts (which site.yml's ssh_mesh role manages) and the file the
inventory names with `-o UserKnownHostsFile=` are read (once per run, see
:class:`KnownHosts`); a host whose key is in none of
them is refused with a message that says how to accept it. Only `--accept-new-host-keys`
trusts a new key, and it is then recorded (in the inventory's known_hosts file, else the
user's) and said on stderr: never added silently. A changed key is always refused.

A bastion (`-o ProxyJump=[user@]host[:port]` or `-J ...` in ansible_ssh_common_args) becomes
Fabric's gateway: the connection to the host is tunnelled through one to the bastion.
"""

from __future__ import annotations

import binascii
import contextlib
import hmac
import logging
import os
import socket
import sys
import threading
import types

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
_import_lock = threading.Lock()


_QUIET = logging.NullHandler()


def load_fabric():
    """Import Fabric (and paramiko) once, under a lock: the first connections import it on
    their own threads (so that the TCP connections are made meanwhile), and paramiko
    imported by two threads at once fails with a circular import. Two standard modules they
    import but no connection uses are stood in for meanwhile (:func:`_standing_in`)."""
    with _import_lock:
        if "fabric" not in sys.modules:
            with _standing_in():
                import fabric
        import fabric
        import paramiko.ssh_exception  # noqa: F401
        # paramiko's transport threads log what failed ("Exception (client): Error reading SSH protocol
        # banner", with a traceback) to loggers nobody configured, which Python then prints on stderr;
        # ftbundle says per host what failed, in words (cluster/errors.py)
        logging.getLogger("paramiko").addHandler(_QUIET)
    return fabric


# Importing Fabric is most of what ftbundle pays before its first SSH byte, and 40 ms of
# its ~135 (measured here, 10 starts each) go to two standard modules that no connection
# uses: Invoke's `invoke.context` imports unittest.mock (with asyncio and ssl under it: 27
# ms) for MockContext, a helper for tests; paramiko's `__init__` calls
# importlib.metadata.version("paramiko") (with email, zipfile, csv: 13 ms) for its
# __version__. While Fabric is imported, each is a stand-in that answers that one name
# cheaply (Mock: unittest.mock's own on first use; version: the Version line of the
# package's .dist-info on sys.path, importlib.metadata's own answer when there is none);
# any other name imports the real module and answers from it. A module already imported
# (a test runner's unittest.mock) is left alone, and afterwards the stand-ins leave
# sys.modules: a later import gets the real modules.
_standin_lock = threading.RLock()


class _StandIn(types.ModuleType):
    def __init__(self, name: str, **names):
        super().__init__(name)
        self.__dict__.update(names)

    def __getattr__(self, attr: str):  # (only for names not set above)
        if attr.startswith("__"):  # the import system's own questions (__path__, ...)
            raise AttributeError(attr)
        return getattr(_real_module(self.__name__), attr)


def _real_module(name: str) -> types.ModuleType:
    """The real module ``name``, imported now if a stand-in was in its place."""
    import importlib

    with _standin_lock:
        if isinstance(sys.modules.get(name), _StandIn):
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and isinstance(getattr(sys.modules[parent], child, None), _StandIn):
                delattr(sys.modules[parent], child)
        return importlib.import_module(name)


class _Mock:
    """invoke.context's `Mock` (used by its MockContext only): unittest.mock's on first use."""

    def __new__(cls, *args, **kwargs):
        return _real_module("unittest.mock").Mock(*args, **kwargs)


def _version(name: str) -> str:
    """importlib.metadata.version(name): the Version of the first ``name-*.dist-info`` on
    sys.path (the one importlib.metadata finds first; names compared as it compares them,
    runs of -_. as one _, any case), else importlib.metadata's answer."""
    import re

    def normal(project: str) -> str:
        return re.sub(r"[-_.]+", "_", project).lower()

    wanted = normal(name)
    for entry in sys.path:
        try:
            found = sorted(d for d in os.listdir(entry or ".")
                           if d.endswith(".dist-info") and normal(d.split("-", 1)[0]) == wanted)
        except OSError:
            continue
        for d in found:
            try:
                with open(os.path.join(entry or ".", d, "METADATA"), encoding="utf-8") as f:
                    for line in f:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
                        if not line.strip():  # (the end of the headers)
                            break
            except OSError:
                continue
    return _real_module("importlib.metadata").version(name)


def _pyyaml():
    """PyYAML, which ftbundle reads its files with, if it is installed."""
    try:
        import yaml
    except ImportError:
        return None
    return yaml


@contextlib.contextmanager
def _standing_in():
    import importlib

    standins = {"unittest.mock": _StandIn("unittest.mock", Mock=_Mock),
                "importlib.metadata": _StandIn("importlib.metadata", version=_version)}
    with _standin_lock:
        placed = {name: mod for name, mod in standins.items() if name not in sys.modules}
        if "invoke.vendor.yaml" not in sys.modules and _pyyaml() is not None:
            placed["invoke.vendor.yaml"] = _pyyaml()
        sys.modules.update(placed)
        if "importlib.metadata" in placed:
            importlib.metadata = placed["importlib.metadata"]  # (`from importlib import metadata`)
    try:
        yield
    finally:
        with _standin_lock:
            for name, mod in placed.items():
                if isinstance(mod, _StandIn) and sys.modules.get(name) is mod:
                    del sys.modules[name]
            if getattr(importlib, "metadata", None) is placed.get("importlib.metadata"):
                del importlib.metadata


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
        Connection = load_fabric().Connection

        class LowLatencyConnection(Connection):
            # A class attribute, so that Fabric's __init__ sets it on the connection: a name the
            # class lacks is stored into the Config (invoke's DataProxy), and every connection shares
            # one (_config), whose merge then empties it for a moment under the other threads:
            # "No attribute or config key found for 'forward_agent'" in a parallel open.
            inline_ssh_env = None

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


_shared_config = None


def _config():
    """One Fabric Config for every connection (as a Fabric ``Group`` shares one): building
    one reads the ssh_config files and costs about 1 ms of CPU per connection.
    Never forward our own stdin (a terminal, a pipe) to a remote command unless a caller
    hands one over explicitly: Invoke's default reads sys.stdin."""
    global _shared_config
    if _shared_config is None:
        _shared_config = load_fabric().Config(overrides={"run": {"in_stream": False}})
    return _shared_config


def connect(host: Host, *, timeout: int = CONNECT_TIMEOUT, accept_new_host_keys: bool = False,
            sock: LowLatencySocket | None = None, gateway=None):
    """A Fabric Connection to ``host`` using the inventory's user, port, key, known_hosts
    and bastion. Nothing is opened yet, except ``sock``: a TCP connection to the host made
    beforehand (:meth:`LowLatencySocket.connect_to`), which ``open()`` then uses, and
    ``gateway``: an open connection to the host's bastion, shared with other hosts (else
    one of its own is made)."""
    Connection = _connection()

    connect_kwargs = {"banner_timeout": timeout, "auth_timeout": timeout}
    if sock is not None and not host.proxy_jump:
        connect_kwargs["sock"] = sock
    if host.key_file:
        connect_kwargs["key_filename"] = [os.path.expanduser(host.key_file)]
        connect_kwargs["look_for_keys"] = False
        connect_kwargs["allow_agent"] = False
    config = _config()
    if not host.proxy_jump:
        gateway = None
    elif gateway is None:
        gateway = connect(bastion(host), timeout=timeout, accept_new_host_keys=accept_new_host_keys)
    conn = Connection(host=host.address, user=host.user, port=host.port, config=config, gateway=gateway,
                      connect_timeout=timeout, connect_kwargs=connect_kwargs)
    known = conn.client.get_host_keys()
    name = lookup_name(host.address, host.port)
    for keytype, key in known_hosts(known_hosts_paths(host)).keys_for(name).items():
        known.add(name, keytype, key)
    conn.client.set_missing_host_key_policy(_policy(host, accept_new_host_keys))
    return conn


def known_hosts_paths(host: Host) -> tuple[str, ...]:
    """The known_hosts files OpenSSH would read for ``host``, in its order."""
    return (os.path.expanduser("~/.ssh/known_hosts"), SYSTEM_KNOWN_HOSTS,
            *((os.path.expanduser(host.known_hosts),) if host.known_hosts else ()))


def lookup_name(address: str, port: int) -> str:
    """The name paramiko (and OpenSSH) look a host up by: `addr`, or `[addr]:port`."""
    return address if int(port) == 22 else f"[{address}]:{port}"


class KnownHosts:
    """Every known_hosts file of a run, read and indexed once, shared by all connections.

    Why: paramiko's ``HostKeys.load`` checks each line against every entry loaded before it
    (quadratic in the file), and each connection used to load every file itself, under the
    GIL: for a cluster's file of 3 keys per host, 37 ms of CPU per connection at 64 hosts,
    100 ms at 128, 300 ms at 256, so starting n hosts cost O(n^3). Here the lines are split
    once (linear) into an index by host name; a connection parses only the lines that name
    its host (plus hashed `|1|` lines, which must be hashed per name to be matched: the
    one per-connection cost that stays linear in the file).

    Same answers as paramiko's loading: exact names and hashed names (no patterns, as in
    paramiko), the first key of a type wins, files in the order given; a line whose key
    cannot be decoded is skipped, as OpenSSH skips it (paramiko stops reading the file).
    """

    def __init__(self, paths: tuple[str, ...]):
        self._plain: dict[str, list[str]] = {}  # name -> its lines, in file order
        self._hashed: list[str] = []
        for path in paths:
            try:
                with open(path, errors="replace") as f:
                    lines = f.read().splitlines()
            except OSError:  # absent or unreadable: as OpenSSH, nothing known from it
                continue
            for line in lines:
                line = line.strip()
                if not line or line[0] == "#":
                    continue
                names = line.split(None, 1)[0]
                if names.startswith("|1|"):
                    self._hashed.append(line)
                    continue
                for name in dict.fromkeys(names.split(",")):
                    self._plain.setdefault(name, []).append(line)

    def keys_for(self, name: str) -> dict:
        """``{key type: paramiko PKey}`` known for ``name`` (empty when none)."""
        from paramiko.hostkeys import HostKeyEntry, HostKeys, InvalidHostKey
        from paramiko.ssh_exception import SSHException

        found: dict = {}
        lines = list(self._plain.get(name, ()))
        if self._hashed:
            lines += [line for line in self._hashed if _hashed_match(name, line.split(None, 1)[0], HostKeys)]
        for number, line in enumerate(lines, 1):
            try:
                entry = HostKeyEntry.from_line(line, number)
            except (SSHException, InvalidHostKey):  # a broken line: skipped (paramiko would stop the file)
                continue
            if entry is not None and entry.key is not None:
                found.setdefault(entry.key.get_name(), entry.key)
        return found


def _hashed_match(name: str, field: str, host_keys) -> bool:
    for hashed in field.split(","):
        try:
            if hashed.startswith("|1|") and hmac.compare_digest(host_keys.hash_host(name, hashed), hashed):
                return True
        except (AssertionError, ValueError, binascii.Error):  # a malformed salt: no match, as in paramiko
            continue
    return False


_known_lock = threading.Lock()
_known: dict[tuple[str, ...], tuple[tuple, KnownHosts]] = {}  # paths -> (their stamp, index)


def known_hosts(paths: tuple[str, ...]) -> KnownHosts:
    """The shared index of ``paths``, read again only when one of the files changed (a key
    recorded by --accept-new-host-keys, an edit during a long run)."""
    stamp = []
    for path in paths:
        try:
            st = os.stat(path)
            stamp.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamp.append(None)
    with _known_lock:  # the first of n connecting threads reads; the others wait for it
        cached = _known.get(paths)
        if cached is None or cached[0] != stamp:
            cached = _known[paths] = (stamp, KnownHosts(paths))
        return cached[1]


def bastion(host: Host) -> Host:
    """The ProxyJump host as a Host: `[user@]name[:port]`, with the target's key and
    known_hosts (Ansible users set them once for both)."""
    spec = host.proxy_jump.split(",")[0]
    user, _, rest = spec.rpartition("@")
    name, _, port = rest.partition(":")
    return Host(name=name, address=name, port=int(port) if port.isdigit() else 22, user=user or host.user,
                key_file=host.key_file, known_hosts=host.known_hosts)
