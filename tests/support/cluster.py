"""A test cluster in a box: N Debian containers that are real SSH hosts.

Used by the integration tests (through ``tests/conftest.py``) and by the
``bench/`` scripts. Plain Python, no pytest needed::

    from tests.support.cluster import Cluster
    with Cluster(2, shared_dir=Path("/tmp/x")) as c:
        subprocess.run(c.ssh_argv(c.hosts[0]) + ["hostname"], check=True)

Each cluster gets its own Docker network (a random free /24 in 198.18.0.0/15,
the range reserved for network test beds), its own ed25519 key and
known_hosts file, and names ``<prefix>-<random>-nodeI`` so that clusters
never collide. Containers run with NET_ADMIN, NET_RAW and SYS_PTRACE only
(``--privileged`` is not available here). The controller's venv and its
``sys.base_prefix`` are bind-mounted read-only at the same paths, and
``shared_dir`` read-write at the same path, on every host.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = [
    "Cluster",
    "ClusterCommandError",
    "ClusterError",
    "ClusterHost",
    "docker_available",
    "ensure_image",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_SCRIPT = REPO_ROOT / ".ci" / "testhost-image.sh"
ENGINE_SCRIPT = REPO_ROOT / ".ci" / "docker-engine.sh"

# The test image's host keys, made at each container's start (.ci/testhost-image.sh: no RSA key).
HOST_KEYS = ("/etc/ssh/ssh_host_ed25519_key.pub", "/etc/ssh/ssh_host_ecdsa_key.pub")

# Labels on everything a cluster creates (containers, network).
LABEL_CLUSTER = "org.ftbundle.testcluster"
LABEL_OWNER_PID = "org.ftbundle.testcluster.pid"
LABEL_OWNER_NS = "org.ftbundle.testcluster.pidns"
LABEL_TMPDIR = "org.ftbundle.testcluster.tmpdir"

TEST_NET = ipaddress.ip_network("198.18.0.0/15")
# The Molecule scenarios' networks, per checkout slot (tests/support/testbed.py: 198.18.243.0/24 to
# 198.18.254.0/24): a cluster never takes them, so a scenario can start while clusters of
# other test workers or checkouts are up.
RESERVED_NETS = (ipaddress.ip_network("198.18.240.0/20"),)
_SYSTEM_PREFIXES = {
    "/",
    "/usr",
    "/bin",
    "/lib",
    "/etc",
    "/var",
    "/root",
    "/home",
    "/tmp",
}


class ClusterError(RuntimeError):
    """The cluster could not be brought up (or a docker call failed)."""


class ClusterCommandError(subprocess.CalledProcessError):
    """A command in a host failed; str() includes its output."""

    def __str__(self) -> str:  # pragma: no cover - formatting only
        def tail(s: str | bytes | None) -> str:
            if not s:
                return ""
            if isinstance(s, bytes):
                s = s.decode(errors="replace")
            return s[-2000:]

        return (
            f"{super().__str__()}\n--- stdout ---\n{tail(self.stdout)}"
            f"\n--- stderr ---\n{tail(self.stderr)}"
        )


class ClusterHost:
    """One host of a cluster: ``name`` (nodeI, also its hostname), ``ip``, ``container``."""

    __slots__ = ("container", "ip", "name")

    def __init__(self, name: str, ip: str, container: str):
        self.name = name
        self.ip = ip
        self.container = container

    def __repr__(self) -> str:
        return f"ClusterHost(name={self.name!r}, ip={self.ip!r}, container={self.container!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterHost) and (
            self.name,
            self.ip,
            self.container,
        ) == (
            other.name,
            other.ip,
            other.container,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.ip, self.container))


# --------------------------------------------------------------------------- helpers


def _docker(
    *args: str,
    check: bool = True,
    timeout: float | None = 120,
    input: str | None = None,
):
    try:
        proc = subprocess.run(
            ["docker", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(
            f"docker {' '.join(args)}: timed out after {timeout}s"
        ) from e
    if check and proc.returncode != 0:
        raise ClusterError(
            f"docker {' '.join(args)} failed (rc={proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def docker_available() -> bool:
    """True if a Docker engine answers (``docker info``)."""
    if shutil.which("docker") is None:
        return False
    try:
        return (
            subprocess.run(
                ["docker", "info"], check=False, capture_output=True, timeout=20
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


_image_lock = threading.Lock()
_image_ref: str | None = None


def ensure_image(force: bool = False) -> str:
    """Build (or reuse, cached by recipe hash) the test-host image; return its reference.

    Runs ``.ci/testhost-image.sh`` once per process.
    """
    global _image_ref
    with _image_lock:
        if _image_ref is None or force:
            env = dict(os.environ)
            env.setdefault("FTBUNDLE_PYTHON", sys.executable)
            proc = subprocess.run(
                ["bash", str(IMAGE_SCRIPT)],
                check=False,
                capture_output=True,
                text=True,
                env=env,
            )
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                raise ClusterError(
                    f"{IMAGE_SCRIPT} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            _image_ref = lines[-1].strip()
        return _image_ref


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> None:
    """Remove clusters left behind by dead processes of this PID namespace.

    Only things whose owner PID (label) is no longer alive *and* whose PID
    namespace is ours are removed, so clusters of concurrently running test
    sessions are never touched.
    """
    ns = _pidns()
    stale: set[str] = set()
    tmpdirs: set[str] = set()
    for kind in ("container", "network"):
        ls = _docker(
            kind,
            "ls",
            *(["-a"] if kind == "container" else []),
            "--filter",
            f"label={LABEL_CLUSTER}",
            "-q",
            check=False,
            timeout=30,
        )
        ids = ls.stdout.split()
        if not ids:
            continue
        insp = _docker(kind, "inspect", *ids, check=False, timeout=30)
        try:
            objs = json.loads(insp.stdout or "[]")
        except ValueError:
            continue
        for o in objs:
            labels = (
                (o.get("Config") or {}).get("Labels")
                if kind == "container"
                else o.get("Labels")
            )
            labels = labels or {}
            if labels.get(LABEL_OWNER_NS) != ns:
                continue
            try:
                pid = int(labels.get(LABEL_OWNER_PID, "0"))
            except ValueError:
                continue
            if pid > 0 and not _pid_alive(pid):
                stale.add(labels.get(LABEL_CLUSTER, ""))
                if labels.get(LABEL_TMPDIR):
                    tmpdirs.add(labels[LABEL_TMPDIR])
    for cid in sorted(s for s in stale if s):
        _remove_by_label(cid)
    for d in tmpdirs:  # the key and known_hosts of the dead cluster
        p = Path(d)
        if p.is_absolute() and p.parent == Path(tempfile.gettempdir()):
            shutil.rmtree(p, ignore_errors=True)


def _remove_by_label(cluster_id: str) -> None:
    flt = f"label={LABEL_CLUSTER}={cluster_id}"
    ids = _docker("ps", "-aq", "--filter", flt, check=False, timeout=60).stdout.split()
    if ids:
        _docker("rm", "-f", "-v", *ids, check=False, timeout=120)
    nets = _docker(
        "network", "ls", "-q", "--filter", flt, check=False, timeout=60
    ).stdout.split()
    for n in nets:
        _docker("network", "rm", n, check=False, timeout=60)


def _used_subnets() -> list[ipaddress.IPv4Network]:
    out: list[ipaddress.IPv4Network] = []
    ids = _docker("network", "ls", "-q", check=False, timeout=30).stdout.split()
    if not ids:
        return out
    insp = _docker("network", "inspect", *ids, check=False, timeout=30)
    try:
        for n in json.loads(insp.stdout or "[]"):
            for cfg in (n.get("IPAM") or {}).get("Config") or []:
                try:
                    net = ipaddress.ip_network(cfg.get("Subnet", ""), strict=False)
                except ValueError:
                    continue
                if isinstance(net, ipaddress.IPv4Network):
                    out.append(net)
    except ValueError:
        pass
    return out


# --------------------------------------------------------------------------- cluster

_LIVE: set[Cluster] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _cleanup_at_exit() -> None:
    with _LIVE_LOCK:
        clusters = list(_LIVE)
    for c in clusters:
        with contextlib.suppress(Exception):  # best effort at exit
            c.down()


class Cluster:
    """N containerized SSH hosts on their own Docker network.

    ``up()`` brings them up (and returns self); ``down()`` removes everything.
    Also a context manager.
    """

    def __init__(
        self,
        n: int,
        *,
        name_prefix: str = "ftb",
        shared_dir: Path,
        extra_mounts: Iterable[tuple[str, str, bool]] = (),
        image: str | None = None,
        ssh_timeout: float = 30.0,
        docker_args: Iterable[str] = (),
    ):
        if n < 1:
            raise ValueError("a cluster needs at least one host")
        self.n = n
        self.name_prefix = name_prefix
        self.shared_dir = Path(shared_dir).resolve()
        self.extra_mounts = [(str(s), str(d), bool(ro)) for s, d, ro in extra_mounts]
        self.image = image
        self.ssh_timeout = ssh_timeout
        #: more `docker run` options for every host (capabilities for a Docker engine inside,
        #: device rules for a Slurm that enforces GPUs)
        self.docker_args = list(docker_args)
        self.id = secrets.token_hex(4)
        #: prefix of every container and of the network: ``<name_prefix>-<random>``
        self.name = f"{name_prefix}-{self.id}"
        self.network: str | None = None
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: list[ClusterHost] = []
        self.tmpdir: Path | None = None
        self.key_file: Path | None = None
        self.known_hosts: Path | None = None
        self._down = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:  # noqa: PYI034
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def __repr__(self) -> str:
        return (
            f"Cluster(name={self.name!r}, subnet={self.subnet}, hosts={self.hosts!r})"
        )

    def mounts(self) -> list[tuple[str, str, bool]]:
        """(source, destination, read_only) bind mounts every host gets."""
        m: list[tuple[str, str, bool]] = [
            (str(self.shared_dir), str(self.shared_dir), False)
        ]
        # running in a venv: make it (and the interpreter it links to) usable on the hosts
        if sys.prefix != sys.base_prefix:
            for p in (sys.prefix, sys.base_prefix):
                for q in dict.fromkeys([os.path.abspath(p), os.path.realpath(p)]):
                    if q not in _SYSTEM_PREFIXES and os.path.isdir(q):
                        m.append((q, q, True))
        m.extend(self.extra_mounts)
        seen: set[str] = set()
        out = []
        for s, d, ro in m:
            if d in seen:
                continue
            seen.add(d)
            out.append((s, d, ro))
        return out

    def up(self) -> Cluster:
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        if not docker_available():
            raise ClusterError("no Docker engine answers (run .ci/docker-engine.sh)")
        with contextlib.suppress(Exception):  # never block a new cluster on old debris
            cleanup_stale()
        image = self.image or ensure_image()
        self.image = image
        self.shared_dir.mkdir(parents=True, exist_ok=True)

        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.key_file = self.tmpdir / "id_ed25519"
        self.known_hosts = self.tmpdir / "known_hosts"
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                f"{self.name}@controller",
                "-f",
                str(self.key_file),
            ],
            check=True,
            capture_output=True,
        )
        pubkey = (self.tmpdir / "id_ed25519.pub").read_text()

        labels = [
            "--label",
            f"{LABEL_CLUSTER}={self.id}",
            "--label",
            f"{LABEL_OWNER_PID}={os.getpid()}",
            "--label",
            f"{LABEL_OWNER_NS}={_pidns()}",
            "--label",
            f"{LABEL_TMPDIR}={self.tmpdir}",
        ]
        self._create_network(labels)
        assert self.subnet is not None and self.network is not None

        addrs = list(self.subnet.hosts())
        self.hosts = [
            ClusterHost(f"node{i}", str(addrs[10 + i]), f"{self.name}-node{i}")
            for i in range(self.n)
        ]
        add_hosts: list[str] = []
        for h in self.hosts:
            add_hosts += ["--add-host", f"{h.name}:{h.ip}"]
        vols: list[str] = []
        for src, dst, ro in self.mounts():
            vols += ["-v", f"{src}:{dst}:{'ro' if ro else 'rw'}"]
        init = ["--init"] if shutil.which("docker-init") else []

        def start(h: ClusterHost) -> None:
            _docker(
                "run",
                "-d",
                "--name",
                h.container,
                "--hostname",
                h.name,
                "--network",
                self.network,
                "--ip",
                h.ip,
                *add_hosts,
                "--cap-add",
                "NET_ADMIN",
                "--cap-add",
                "NET_RAW",
                "--cap-add",
                "SYS_PTRACE",
                *init,
                *labels,
                *vols,
                *self.docker_args,
                image,
            )

        with ThreadPoolExecutor(max_workers=min(8, self.n)) as pool:
            for f in [pool.submit(start, h) for h in self.hosts]:
                f.result()

        # root's key, then wait for the host keys (made by the entrypoint)
        for h in self.hosts:
            _docker(
                "exec",
                "-i",
                h.container,
                "sh",
                "-c",
                "umask 077 && mkdir -p /root/.ssh && cat > /root/.ssh/authorized_keys",
                input=pubkey,
            )
        deadline = time.monotonic() + self.ssh_timeout
        lines: list[str] = []
        for h in self.hosts:
            while True:
                p = _docker(
                    "exec",
                    h.container,
                    "sh",
                    "-c",
                    "cat " + " ".join(HOST_KEYS),
                    check=False,
                    timeout=30,
                )
                keys = [
                    ln.split()[:2]
                    for ln in p.stdout.splitlines()
                    if len(ln.split()) >= 2
                ]
                if p.returncode == 0 and len(keys) == len(HOST_KEYS):
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{h.container}: no ssh host keys after {self.ssh_timeout}s: {p.stderr.strip()}\n"
                        + self._logs(h)
                    )
                time.sleep(0.2)
            for ktype, kdata in keys:
                lines.append(f"{h.ip},{h.name} {ktype} {kdata}")
        self.known_hosts.write_text("\n".join(lines) + "\n")

        # SSH must work, with the key and strict host key checking
        pending = list(self.hosts)
        last_err: dict[str, str] = {}
        while pending:
            for h in list(pending):
                left = max(1.0, deadline - time.monotonic())
                try:
                    p = subprocess.run(
                        self.ssh_argv(h, connect_timeout=min(5, int(left) + 1))
                        + ["true"],
                        check=False,
                        capture_output=True,
                        text=True,
                        timeout=left + 5,
                    )
                    ok = p.returncode == 0
                    last_err[h.name] = p.stderr.strip()
                except subprocess.TimeoutExpired:
                    ok = False
                    last_err[h.name] = "ssh timed out"
                if ok:
                    pending.remove(h)
            if pending:
                if time.monotonic() > deadline:
                    detail = "\n".join(
                        f"{h.name} ({h.ip}): {last_err.get(h.name)}\n{self._logs(h)}"
                        for h in pending
                    )
                    raise ClusterError(
                        f"SSH not ready after {self.ssh_timeout}s on:\n{detail}"
                    )
                time.sleep(0.2)

    def _create_network(self, labels: Sequence[str]) -> None:
        used = _used_subnets()
        rng = random.SystemRandom()
        # a /24 holds the hosts from .11 up to 240 of them; a larger cluster (bench/launch.py's
        # 256 hosts) gets a /22
        candidates = [net for net in TEST_NET.subnets(new_prefix=24 if self.n <= 240 else 22)
                      if not any(net.overlaps(r) for r in RESERVED_NETS)]
        last = ""
        for _attempt in range(30):
            net = rng.choice(candidates)
            if any(net.overlaps(u) for u in used):
                continue
            name = f"{self.name}-net"
            p = _docker(
                "network",
                "create",
                "--driver",
                "bridge",
                "--subnet",
                str(net),
                "--gateway",
                str(net.network_address + 1),
                *labels,
                name,
                check=False,
                timeout=60,
            )
            if p.returncode == 0:
                self.network, self.subnet = name, net
                return
            last = p.stderr.strip()
            # someone else took it in the meantime: pick another
            used = _used_subnets()
        raise ClusterError(f"could not create a test network in {TEST_NET}: {last}")

    def _logs(self, h: ClusterHost) -> str:
        p = _docker("logs", "--tail", "20", h.container, check=False, timeout=30)
        return f"--- docker logs {h.container} ---\n{p.stdout}{p.stderr}"

    def down(self) -> None:
        """Remove containers, network and temp dir. Never raises; safe to call twice."""
        try:
            with contextlib.suppress(Exception):
                _remove_by_label(self.id)
            # by name as well, in case labels were never applied
            for h in self.hosts:
                with contextlib.suppress(Exception):
                    _docker("rm", "-f", "-v", h.container, check=False, timeout=60)
            if self.network:
                with contextlib.suppress(Exception):
                    _docker("network", "rm", self.network, check=False, timeout=60)
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
        finally:
            self._down = True
            with _LIVE_LOCK:
                _LIVE.discard(self)

    # ------------------------------------------------------------------ access

    def host(self, host: ClusterHost | str | int) -> ClusterHost:
        """A host by ClusterHost, name (``node1``), container name, IP or index."""
        if isinstance(host, ClusterHost):
            return host
        if isinstance(host, int):
            return self.hosts[host]
        for h in self.hosts:
            if host in (h.name, h.container, h.ip):
                return h
        raise KeyError(f"no host {host!r} in cluster {self.name}")

    def ssh_argv(
        self, host: ClusterHost | str, *, connect_timeout: int = 5
    ) -> list[str]:
        """``ssh`` argv from the controller into ``host`` (append the remote command)."""
        h = self.host(host)
        assert self.key_file is not None and self.known_hosts is not None, (
            "cluster is not up"
        )
        return [
            "ssh",
            "-i",
            str(self.key_file),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"ConnectTimeout={connect_timeout}",
            "-o",
            "LogLevel=ERROR",
            "-l",
            "root",
            h.ip,
        ]

    def write_inventory(
        self,
        path: Path,
        group: str = "trainers",
        hostvars: dict | None = None,
        *,
        per_host: dict[str, dict] | None = None,
    ) -> Path:
        """Write an Ansible YAML inventory of the hosts under ``all.children.<group>``.

        ``hostvars`` are added to every host, ``per_host[name]`` to that host.
        """
        assert self.key_file is not None and self.known_hosts is not None, (
            "cluster is not up"
        )
        hosts: dict[str, dict] = {}
        for h in self.hosts:
            v = {
                "ansible_host": h.ip,
                "ansible_user": "root",
                "ansible_ssh_private_key_file": str(self.key_file),
                "ansible_ssh_common_args": (
                    f"-o UserKnownHostsFile={self.known_hosts} -o StrictHostKeyChecking=yes"
                ),
                "ansible_python_interpreter": "/usr/bin/python3",
            }
            v.update(hostvars or {})
            v.update((per_host or {}).get(h.name, {}))
            hosts[h.name] = v
        inv = {"all": {"children": {group: {"hosts": hosts}}}}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import yaml  # type: ignore

            text = yaml.safe_dump(inv, sort_keys=False, default_flow_style=False)
        except ImportError:  # JSON is YAML
            text = json.dumps(inv, indent=2) + "\n"
        path.write_text(text)
        return path

    def exec(
        self,
        host: ClusterHost | str,
        cmd: str,
        check: bool = True,
        *,
        timeout: float | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``bash -c cmd`` in the host's container (``docker exec``); text output."""
        h = self.host(host)
        argv = [
            "docker",
            "exec",
            *(["-i"] if input is not None else []),
            h.container,
            "bash",
            "-c",
            cmd,
        ]
        p = subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and p.returncode != 0:
            raise ClusterCommandError(p.returncode, argv, p.stdout, p.stderr)
        return p

    def kill(self, host: ClusterHost | str) -> None:
        """The node dies: ``docker kill`` its container (SIGKILL to everything in it)."""
        h = self.host(host)
        _docker("kill", h.container, check=False, timeout=60)

    def is_running(self, host: ClusterHost | str) -> bool:
        h = self.host(host)
        p = _docker(
            "inspect", "-f", "{{.State.Running}}", h.container, check=False, timeout=30
        )
        return p.returncode == 0 and p.stdout.strip() == "true"

    _PARTITION_TABLE = "ftbundle_partition"

    def partition(self, host: ClusterHost | str) -> None:
        """Cut the node's network: nftables drops all input and output except loopback.

        Established connections hang (no reset), as with a real network partition.
        """
        t = self._PARTITION_TABLE
        ruleset = (
            f"table inet {t} {{\n"
            f'  chain input {{ type filter hook input priority -300; policy drop; iif "lo" accept; }}\n'
            f'  chain output {{ type filter hook output priority -300; policy drop; oif "lo" accept; }}\n'
            f"}}\n"
        )
        self.exec(
            host, f"nft delete table inet {t} 2>/dev/null; nft -f -", input=ruleset
        )

    def heal(self, host: ClusterHost | str) -> None:
        """Undo ``partition``."""
        self.exec(
            host,
            f"if nft list table inet {self._PARTITION_TABLE} >/dev/null 2>&1; then "
            f"nft delete table inet {self._PARTITION_TABLE}; fi",
        )

    def pgrep(self, host: ClusterHost | str, pattern: str) -> list[str]:
        """``pgrep -af pattern`` in the host: ``["PID cmdline", ...]`` (not the pgrep itself)."""
        h = self.host(host)
        p = subprocess.run(
            ["docker", "exec", h.container, "pgrep", "-af", "--", pattern],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if p.returncode not in (0, 1):
            raise ClusterCommandError(p.returncode, p.args, p.stdout, p.stderr)
        return [ln for ln in p.stdout.splitlines() if ln.strip()]
