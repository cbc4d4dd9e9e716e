"""Preflight: are the hosts of a run alike and ready? Nothing is launched.

probe -> facts -> rules -> report, in one round over the run's one connection per host:

- :func:`probe_spec` (pure) says what one host is asked, as JSON;
- :func:`probe_hosts` sends the probe (ftbundle/remote/probe.py) to every host at once on
  stdin to its own python3, with the spec as its argument; each answers one JSON object.
  In that single round rank 0 creates a missing shared_dir, every host writes a sentinel
  and waits (bounded) to see everyone else's, and rank 0 holds the master port open while
  the others connect to it;
- :mod:`ftbundle.facts` parses the answers; :mod:`.rules` turns facts and the layout into
  findings, grouped by value (the odd host out is plain to see); :mod:`.report` prints
  them; :mod:`.net` measures the network (``check --net``) on the same plan.

The facts also feed the plan (``auto`` ranks, GPUs, the recorded image, bf16, whether
output_dir is shared): see :func:`ftbundle.plan.make_plan`.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from functools import cache, partial

from .. import rundir, shipped, tokenized, trackers
from ..cluster import Cluster, Proc, first_line, parallel
from ..facts import ClusterFacts, HostFacts, parse_facts
from ..gpu_health import FIELD_ALIASES, HEALTH_FIELDS, XID_WINDOW_S
from ..inventory import Host
from ..layout import CLAIM_DIR, CLAIM_GRACE_S, Layout, claim_keys
from ..plan import IMAGE_REF_FILE, shape_text
from .claims import claim_check, claimed
from .report import CheckReport, format_report, print_report
from ..remote.probe_common import PORT_OFF
from ..remote.probe_files import HASHING
from ..units import size_text
from .bytes_rules import FINGERPRINTED, on_shared_dir
from .rules import Check, evaluate, job_paths

__all__ = ["Check", "CheckReport", "ClusterFacts", "HostFacts", "claimed", "clean_up", "format_report", "print_report",
           "probe_hosts", "probe_spec", "remove_sentinels", "run_checks", "sentinel_cleanup"]

PACKAGES = ("torch", "transformers", "llamafactory")
PROBE_TIMEOUT_S = 150  # the probe hashes the dataset files; large ones take a while
PROBE_DEADLINE_S = 120  # the probe answers with what it has by then
LISTEN_S = 8  # how long rank 0's listener waits for every other host
CONNECT_S = 6  # how long the other hosts keep trying to reach it
SENTINEL_WAIT_S = 5  # how long a host waits to see every other host's sentinel
COMMAND_S = 5  # a probe's own short commands (ip route get, ss)
# The probes of n hosts start over a spread that grows with n (the controller opens n
# channels and sends each the probe): every wait above gets this much more per host, so a
# healthy large cluster is not failed by its own start-up (256 hosts: +32 s). A wait that
# ends early when all is seen costs a healthy cluster nothing.
WAIT_S_PER_HOST = 0.125
NVIDIA_SMI_TIMEOUT_S = 10
STORAGE_ANSWER_S = 5  # a stat of shared storage not answered this long, its process held in the kernel: hung
# ... and not answered this much longer while its host has not even run it (too busy: remote/evidence.py):
# the host is said to be starved meanwhile; past that, the storage is given up on
STORAGE_PATIENCE_S = 30


# The probe is one program on stdin, written as files by concern (ftbundle/remote/): its parts in
# this order, main (probe.py) last; the versions script (run by the job's interpreter) as a string.
PROBE_PARTS = ("evidence.py", "probe_common.py", "probe_gpus.py", "probe_storage.py", "probe_files.py",
               "probe_tokenized.py", "probe_trackers.py", "claims.py")


@cache
def probe_source() -> bytes:
    """The probe program's text: its parts (``PROBE_PARTS``: the storage rule it shares with the
    launcher, its helpers, GPU and storage facts), ``VERSIONS_PY`` (remote/versions.py's text),
    then ftbundle/remote/probe.py, whose ``main`` runs. One text, one process: as cheap to start
    as one file (a part run alone imports the others it needs; shipped, none is imported)."""
    versions = f"VERSIONS_PY = {shipped.read_text('remote', 'versions.py')!r}\n".encode()
    return b"\n".join([*(shipped.read_bytes("remote", part) for part in PROBE_PARTS), versions,
                       shipped.read_bytes("remote", "probe.py")])


@cache
def probe_loader() -> tuple[str, str]:
    """(remote/probe_loader.py's text, the probe source's digest): the loader runs the probe's
    code object kept on the host while the source is the same, else compiles the source."""
    import hashlib

    return shipped.read_text("remote", "probe_loader.py"), hashlib.sha256(probe_source()).hexdigest()[:16]


def probe_argv(host: Host, spec: str, *, sized: bool = False) -> list[str]:
    """The probe's command line: its interpreter with -S (the probe is standard library only;
    the host's site.py, .pth files and sitecustomize are not its business and cost a few ms),
    the loader (its compiled code kept on the host), the JSON spec and the source's digest as its
    arguments; the program on stdin (``sized``: its length too, and the probe reads what follows
    it: the ranks taking part, see :func:`probe_hosts`)."""
    loader, digest = probe_loader()
    return [probe_python(host), "-S", "-c", loader, spec, digest] + ([str(len(probe_source()))] if sized else [])


def probe_python(host: Host) -> str:
    """The interpreter the probe runs under: Ansible's for that host (the inventory's
    ``ansible_python_interpreter``), else python3; this one for this machine."""
    if host.local:
        return sys.executable
    value = str(host.vars.get("ansible_python_interpreter") or "")
    return value if value and not value.startswith("auto") and "{{" not in value else "python3"


def probe_spec(layout: Layout, rank: int, *, token: str | None, expect: list[int] | None,
               port_peers: int | None, create: bool = True, claim: bool = False, told: bool = False) -> dict:
    """What host ``rank`` is asked (pure). ``token``: the sentinel name (None: no storage
    sentinels, a light probe); ``expect``: the ranks whose sentinels each host waits for;
    ``port_peers``: how many hosts rank 0 waits for on the master port (None: no port test);
    ``create``: rank 0 creates a missing shared_dir (not in a read-only probe: --dry-run).
    ``told``: the ranks taking part come on stdin (remote/probe.py ``told``; the check's probes
    all are, :func:`probe_hosts`): ``expect`` is None, ``port_peers`` any number but None."""
    job = layout.job
    extra = scale_s(len(layout.hosts))
    spec: dict = {
        "rank": rank,
        "master_addr": layout.master_addr,
        "workdir": layout.workdir,
        "env_file": job.runtime.env_file,
        "docker": layout.docker,
        "image": layout.image,
        "image_ref_file": IMAGE_REF_FILE,
        "python": layout.python,
        "packages": list(PACKAGES) + (trackers.probed(layout.lf_config) if layout.lf_config is not None else []),
        "nvidia_smi_timeout_s": NVIDIA_SMI_TIMEOUT_S,
        "deadline_s": PROBE_DEADLINE_S,
        "sentinel_wait_s": SENTINEL_WAIT_S + extra,
        "storage_answer_s": STORAGE_ANSWER_S,
        "storage_patience_s": STORAGE_PATIENCE_S + extra,
        "command_s": COMMAND_S + extra,
        "token": token,
        "expect": None if told else expect,
        "storage": [{"name": "shared_dir", "path": layout.shared_dir, "create": create and rank == 0,
                     "wait": create and rank != 0}],
    }
    if token and layout.checkpoint_dir:
        spec["storage"].append({"name": "output_dir", "path": layout.checkpoint_dir, "nearest": True})
    if port_peers is not None:
        # (the run's id on every knock: rank 0 counts only its own check's hosts, not another's at once)
        spec["port"] = ({"role": "listen", "port": layout.master_port, "peers": None if told else port_peers,
                         "listen_s": LISTEN_S + extra,
                         "token": layout.run_id}
                        if rank == 0 else
                        {"role": "connect", "addr": layout.master_addr, "port": layout.master_port,
                         "connect_s": CONNECT_S + extra, "token": layout.run_id})
    if create and job.health != "off":  # (not in a read-only probe: nothing is checked there)
        spec["health"] = {"fields": list(HEALTH_FIELDS), "aliases": FIELD_ALIASES, "window_s": XID_WINDOW_S}
    # what lives on shared storage is read by rank 0 alone: the same bytes for every host
    if layout.dataset_dir and (rank == 0 or not on_shared_dir(layout, layout.dataset_dir)):
        spec["datasets"] = {"dir": layout.dataset_dir, "names": list(layout.datasets)}
    if layout.docker:
        spec["image_python"] = job.runtime.python
    if rank == 0 and layout.lf_config is not None:  # (where the trackers log: check/tracker_rules.py)
        every = trackers.maybe_every(layout.lf_config)
        if every or trackers.reported(layout.lf_config):
            spec["trackers"] = True  # (the tracker variables the job sees)
        if not layout.docker and (every or "wandb" in trackers.reported(layout.lf_config)):
            spec["wandb_login"] = True  # (would its wandb find a key? a container's home is not the host's)
        asked = trackers.servers_asked(layout.lf_config, job.env)
        if asked:  # (does it reach W&B's and MLflow's servers? the docker runtime shares the host's network)
            spec["servers"] = asked
    wanted = job_paths(layout)
    if wanted:
        spec["paths"] = wanted
    # (one host, or ranks on this machine alone: nothing to compare)
    compared = {key: path for key, path in wanted.items()
                if key in FINGERPRINTED and len(layout.hosts) > 1 and not layout.all_local}
    compared = {key: path for key, path in compared.items() if rank == 0 or not on_shared_dir(layout, path)}
    if compared and create:  # (not in a read-only probe)
        spec["fingerprints"] = compared
    if rank == 0 and create and layout.checkpoint_dir and "model_name_or_path" in wanted:
        spec["model"] = wanted["model_name_or_path"]  # (its size: what a checkpoint holds)
    if told:
        spec["told"] = True
    if rank == 0 and job.gpus_per_node != 0 and (layout.lf_config is not None or job.train.mode == "script"):
        spec["gemm"] = rundir.gemm_record(layout.shared_dir)  # (MFU where the table has no peak: ftbundle/speed.py)
    if rank == 0 and create and layout.dataset_dir and job.tokenize_once:  # (ftbundle/tokenized.py)
        asked = tokenized.request(layout.lf_config, layout.shared_dir, wanted.get("model_name_or_path"))
        if asked is not None:
            spec["tokenized"] = asked
    keys = claim_keys(layout, rank) if claim else []
    if keys:  # (a run's check: its port and GPUs, claimed on the host: remote/claims.py)
        spec["claim"] = {"dir": CLAIM_DIR, "run": layout.run_id, "keys": keys, "grace_s": CLAIM_GRACE_S,
                         "arbiter": rank == 0}
    return spec



def scale_s(hosts: int) -> float:
    """Seconds added to each of the probe's waits for a cluster of ``hosts``."""
    return round(WAIT_S_PER_HOST * hosts, 1) if hosts > 8 else 0.0


def sentinel_token(layout: Layout) -> str | None:
    """The name of this check's sentinels; None where there is nothing to prove shared (one
    host, or this machine alone) and no output_dir to prove writable."""
    shared = len(layout.hosts) > 1 and not layout.all_local
    return secrets.token_hex(4) if shared or layout.checkpoint_dir else None


def probe_hosts(layout: Layout, cluster: Cluster, *, full: bool = True, token: str | None = None,
                on_progress: Callable[[int, int], None] | None = None, claim: bool = False,
                on_hashing: Callable[[str], None] | None = None) -> ClusterFacts:
    """Every host's facts, asked at once. ``full``: also the master port, and the storage
    sentinels named ``token`` (the check); otherwise only what the plan needs (``--no-check``
    with ``auto``). ``on_hashing``: a line on the files being hashed, while they are.

    On a cluster still connecting (a background open), each host's probe starts as soon as its
    own connection is made, not once all of them are: the probes' start-up and the facts that
    need no other host overlap the other hosts' handshakes (at 128 hosts, most of the round).
    What does need them (whose sentinels to wait for, rank 0's peers on the master port) is
    sent to every probe on its stdin once every host has been tried (``told``; at once on a
    cluster already open): the same questions as a round that starts after the connections,
    asked sooner. The probes' stdin stays open: when rank 0 will not listen on the master port,
    or a host's probe ended without its facts, the others are told (:class:`Relay`), and stop
    knocking or waiting for it."""
    hashing = Hashing(on_hashing) if on_hashing is not None else None
    told = full  # (a light probe asks nothing of the other hosts)
    token = token if full else None
    relay = Relay() if full else None

    def taking_part(rank: int, proc: Proc) -> None:  # (told: once every host was tried)
        cluster.wait_tried()
        ranks = [r for r, h in enumerate(layout.hosts) if h.name not in cluster.errors]
        relay.tell(proc, rank, _line({"reachable": ranks}))

    def on_err(rank: int, host: Host) -> Callable[[bytes], None] | None:  # (what the probe says on stderr)
        feeds = ([partial(hashing.feed, host.name)] if hashing is not None else []) + (
            [relay.feed] if relay is not None and rank == 0 else [])

        def each(chunk: bytes) -> None:
            for feed in feeds:
                feed(chunk)
        return each if feeds else None
    done = [0]
    lock = threading.Lock()
    if on_progress is not None:
        on_progress(0, len(layout.hosts))

    def ask(rank: int) -> HostFacts:
        try:
            got = probe(rank)
            if relay is not None and got.error and layout.hosts[rank].name not in cluster.errors:
                relay.ended(rank, got.error)  # (the others would wait for it for nothing)
            return got
        finally:
            if on_progress is not None:
                with lock:
                    done[0] += 1
                    on_progress(done[0], len(layout.hosts))

    def probe(rank: int) -> HostFacts:
        host = layout.hosts[rank]
        if told:
            cluster.wait_tried(host)
        if host.name in cluster.errors:
            return HostFacts(host.name, rank, error=cluster.errors[host.name])
        spec = probe_spec(layout, rank, token=token, expect=[rank], port_peers=0 if full else None,
                          create=full, claim=claim and full, told=told)
        try:
            proc = cluster.start(host, probe_argv(host, json.dumps(spec), sized=told), timeout=PROBE_TIMEOUT_S)
            result = proc.communicate(probe_source(), timeout=PROBE_TIMEOUT_S, on_err=on_err(rank, host),
                                      then=partial(taking_part, rank) if told else None, keep_stdin=told)
        except Exception as exc:  # connection dropped, timed out: this host's failure
            return HostFacts(host.name, rank, error=f"probe failed: {first_line(exc)}")
        try:
            data = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            said = [line for line in (result.stderr.strip() or result.stdout.strip()).splitlines()
                    if not line.startswith((HASHING, PORT_OFF))][-1:] or [f"exit {result.code}"]
            return HostFacts(host.name, rank, error=f"probe did not finish: {said[0][:300]}")
        return parse_facts(host.name, rank, data)

    return ClusterFacts(parallel(ask, range(len(layout.hosts))), token=token)


class Relay:
    """What the launcher tells the probes after their first line (who takes part), on their
    stdin, each probe's lines in order:

    - ``{"port_off": WHY}`` to the probes that knock on rank 0's port, when rank 0 will not
      listen: its probe says so at once (``ftb-port-off WHY`` on its stderr: another run holds
      the host, or the port is in use), or it ended without its facts (its interpreter missing,
      its connection dropped). They stop knocking. Without it they knocked for their whole
      connect_s, 6 s plus 1/8 s a host on clusters over 8 hosts (38 s at 256), and a refusal known in the first
      second was reported after it.
    - ``{"gone": [RANK]}`` to all, when a host's probe ended without its facts: its sentinel
      will never come, and is not waited for (sentinel_wait_s, as long again)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.told: dict[int, Proc] = {}
        self.why: str | None = None
        self.gone: list[int] = []
        self.partial = b""

    def tell(self, proc: Proc, rank: int, line: bytes) -> None:
        """Send a probe its first line (who takes part), then what it missed."""
        with self.lock:
            proc.send(line)
            self.told[rank] = proc
            if rank != 0 and self.why is not None:
                proc.send(_line({"port_off": self.why}))
            if self.gone:
                proc.send(_line({"gone": self.gone}))

    def feed(self, chunk: bytes) -> None:
        """Rank 0's stderr, as it comes."""
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            if line.startswith(PORT_OFF.encode() + b" "):
                self.off(line[len(PORT_OFF) + 1:].decode(errors="replace"))

    def off(self, why: str) -> None:
        """Rank 0 will not listen: the knocking probes are told, once."""
        with self.lock:
            if self.why is None:
                self.why = why
                line = _line({"port_off": why})
                for rank, proc in self.told.items():
                    if rank != 0:
                        proc.send(line)

    def ended(self, rank: int, why: str) -> None:
        """Host ``rank``'s probe ended without its facts: the others are told it is gone (and,
        for rank 0, that it will not listen)."""
        if rank == 0:
            self.off(f"rank 0's probe ended: {why}")
        with self.lock:
            self.gone.append(rank)
            line = _line({"gone": [rank]})
            for other, proc in self.told.items():
                if other != rank:
                    proc.send(line)


def _line(said: dict) -> bytes:
    """One line of JSON on a probe's stdin."""
    return json.dumps(said).encode() + b"\n"


class Hashing:
    """The probes' ``ftb-hashing NAME DONE TOTAL`` lines (remote/probe_files.py) summed over
    the hosts, said as one line at most every PROGRESS_S, the first after PROGRESS_S (a quick
    hash is not said), and once more when all is hashed."""

    PROGRESS_S = 1.0

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.each: dict[tuple[str, str], tuple[int, int]] = {}
        self.partial: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.started = self.last = time.monotonic()  # (a hash done within PROGRESS_S is not said at all)
        self.said = False

    def feed(self, host: str, chunk: bytes) -> None:
        with self.lock:
            *lines, self.partial[host] = (self.partial.get(host, b"") + chunk).split(b"\n")
            for line in lines:
                words = line.decode(errors="replace").split()
                if len(words) == 4 and words[0] == HASHING and words[2].isdigit() and words[3].isdigit():
                    self.each[(host, words[1])] = (int(words[2]), int(words[3]))
            if not self.each:
                return
            done = sum(d for d, _ in self.each.values())
            total = sum(t for _, t in self.each.values())
            now = time.monotonic()
            if now - self.last < self.PROGRESS_S and (done < total or not self.said):
                return
            self.last, self.said = now, True
            names = ", ".join(sorted({name for _, name in self.each}))
            rate = done / max(now - self.started, 1e-3)
            line = (f"hashing {names}: {size_text(done)} of {size_text(total)} on "
                    f"{len({h for h, _ in self.each})} host(s), {size_text(rate)}/s")
        try:
            self.say(line)
        except Exception:  # (a display's trouble is not the probe's)
            pass


def remove_sentinels(layout: Layout, cluster: Cluster, token: str | None, hosts: list[Host],
                     timeout: float = 30) -> None:
    """The check's sentinel directories go, on ``hosts``, wherever the probe may have written
    them (the probe's `clean` mode: under each storage path or its nearest existing parent).
    For an interrupted check, whose facts never came back."""
    if not token:
        return
    paths = [layout.shared_dir] + ([layout.checkpoint_dir] if layout.checkpoint_dir else [])
    spec = json.dumps({"mode": "clean", "token": token, "paths": paths})
    jobs = [(h, probe_argv(h, spec)) for h in hosts if cluster.alive(h) and h.name not in cluster.errors]
    if jobs:
        cluster.run_all(jobs, timeout=timeout, stdin=probe_source())


def sentinel_cleanup(layout: Layout, facts: ClusterFacts) -> list[tuple[Host, list[str]]]:
    """(host, directories) to remove: the sentinel directories the probe reported, on rank
    0's host alone when every host shares the storage, else on every host that wrote one."""
    if not facts.token:
        return []
    hosts = {h.name: h for h in layout.hosts}
    todo: dict[str, list[str]] = {}
    for name in ("shared_dir", "output_dir"):
        writers = [f for f in facts.reached if name in f.storage and f.storage[name].written]
        if facts.storage_shared(name):
            writers = writers[:1]
        for f in writers:
            path = f"{f.storage[name].where.rstrip('/')}/.ftb-check-{facts.token}"
            if path not in todo.setdefault(f.host, []):
                todo[f.host].append(path)
    return [(hosts[name], dirs) for name, dirs in todo.items()]


def clean_up(cluster: Cluster, leftovers: list[tuple[Host, list[str]]], timeout: float = 30) -> None:
    """Remove ``(host, directories)``: one ``rm -rf`` (argv, no shell) per host, at once."""
    if leftovers:
        cluster.run_all([(h, ["rm", "-rf", "--", *dirs]) for h, dirs in leftovers], timeout=timeout)


def run_checks(layout: Layout, cluster: Cluster, *, nproc_per_node: int | None = None,
               on_progress: Callable[[int, int], None] | None = None,
               keep_sentinels: bool = False, claim: bool = False,
               on_hashing: Callable[[str], None] | None = None) -> tuple[CheckReport, ClusterFacts]:
    """Ask every host whether they are alike and ready: (the report, the facts). Starts
    nothing; leaves nothing behind but the shared directory it created (and, with
    ``keep_sentinels``, the sentinels for the caller to remove, e.g. as it stages)."""
    started = time.monotonic()
    token = sentinel_token(layout)
    try:
        facts = probe_hosts(layout, cluster, full=True, token=token, on_progress=on_progress, claim=claim,
                            on_hashing=on_hashing)
    except KeyboardInterrupt:  # a moment for the sentinels, not more: Ctrl-C must be quick
        remove_sentinels(layout, cluster, token, list(layout.hosts), timeout=1)
        raise
    if not keep_sentinels:
        clean_up(cluster, sentinel_cleanup(layout, facts))
    nproc = nproc_per_node if nproc_per_node is not None else (
        layout.job.nproc_per_node if isinstance(layout.job.nproc_per_node, int) else None)
    claims = claim_check(layout, facts)
    report = CheckReport(
        checks=evaluate(layout, facts, nproc) + ([claims] if claims is not None else []),
        seconds=time.monotonic() - started,
        title=(f"ftbundle check: job {layout.job.name}, {_shape(layout)}, "
               f"master {layout.master_addr}:{layout.master_port}"),
    )
    return report, facts


def _shape(layout: Layout) -> str:
    """`2 host(s) x 8 rank(s)`, `2 host(s) with 8+4 rank(s)` (per-host counts), or `... x auto rank(s)`."""
    nprocs = [layout.host_nproc(h.name) for h in layout.hosts]
    if None in nprocs:
        return f"{len(layout.hosts)} host(s) x {layout.job.nproc_per_node} rank(s)"
    return shape_text(nprocs, "host(s)")  # type: ignore[arg-type]
