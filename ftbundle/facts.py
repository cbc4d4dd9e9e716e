"""Facts: what the probe (ftbundle/remote/probe.py) found on each host, typed.

Parsed once from the probe's JSON; everything downstream (check/'s rules, the plan's GPU,
image and storage decisions) reads these values and never the raw answer. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .gpu_health import GpuHealth, Xid, parse_health

BF16_MIN_COMPUTE_CAP = (8, 0)  # Ampere and later


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    memory_mib: int | None
    compute_cap: str | None  # "9.0"; None when the driver cannot say
    index: str | None = None
    uuid: str | None = None
    memory_used_mib: int | None = None

    @property
    def compute_cap_tuple(self) -> tuple[int, int] | None:
        match = re.fullmatch(r"(\d+)\.(\d+)", self.compute_cap or "")
        return (int(match.group(1)), int(match.group(2))) if match else None

    @property
    def kind(self) -> tuple:
        """What makes two GPUs "the same" for the check (not their index or load)."""
        return (self.name, self.driver, self.memory_mib, self.compute_cap)


@dataclass(frozen=True)
class ComputeApp:
    pid: str
    name: str
    gpu_uuid: str
    used_memory_mib: int | None


def _int(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def parse_nvidia_smi(csv_text: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap
    --format=csv,noheader,nounits` (drivers older than 510 lack compute_cap; the probe then
    asks for the first three fields only, which this also reads)."""
    gpus = []
    for line in csv_text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.rsplit(",", 3)]
        if len(fields) == 4 and not re.fullmatch(r"\d+\.\d+|\[N/A\]|N/A", fields[3]):
            fields = [f.strip() for f in line.rsplit(",", 2)]  # a 3-field line, comma in the name
        if len(fields) not in (3, 4):
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        name, driver, memory = fields[:3]
        cap = fields[3] if len(fields) == 4 and re.fullmatch(r"\d+\.\d+", fields[3]) else None
        gpus.append(Gpu(name, driver, _int(memory), cap))
    return gpus


def add_gpu_ids(gpus: list[Gpu], csv_text: str) -> list[Gpu]:
    """Index, UUID and memory in use from `--query-gpu=index,uuid,memory.used` (same order)."""
    rows = [[f.strip() for f in line.split(",")] for line in csv_text.splitlines() if line.strip()]
    if len(rows) != len(gpus) or any(len(r) != 3 for r in rows):
        return gpus
    return [Gpu(g.name, g.driver, g.memory_mib, g.compute_cap, r[0], r[1], _int(r[2])) for g, r in zip(gpus, rows)]


def parse_compute_apps(csv_text: str) -> list[ComputeApp]:
    """`--query-compute-apps=pid,process_name,gpu_uuid,used_memory`."""
    apps = []
    for line in csv_text.splitlines():
        if not line.strip():
            continue
        pid, rest = line.split(",", 1)
        name, uuid, used = [f.strip() for f in rest.rsplit(",", 2)]
        apps.append(ComputeApp(pid.strip(), name, uuid, _int(used)))
    return apps


def bf16_capable(gpus: Iterable[Gpu]) -> bool:
    """True when there are GPUs and every one has compute capability 8.0 or more."""
    caps = [g.compute_cap_tuple for g in gpus]
    return bool(caps) and all(c is not None and c >= BF16_MIN_COMPUTE_CAP for c in caps)


def describe_gpus(gpus: list[Gpu]) -> str:
    """`8x NVIDIA H100 80GB HBM3 (81559 MiB, compute 9.0, driver 550.54.15)`, or the kinds
    joined with `+` for a host with mixed GPUs."""
    if not gpus:
        return "none"
    kinds: dict[tuple, tuple[Gpu, int]] = {}
    for gpu in gpus:
        first, count = kinds.get(gpu.kind, (gpu, 0))
        kinds[gpu.kind] = (first, count + 1)
    return " + ".join(
        f"{count}x {g.name} ({g.memory_mib if g.memory_mib is not None else '?'} MiB, "
        f"compute {g.compute_cap or '?'}, driver {g.driver})" for g, count in kinds.values())


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a process sees under CUDA_VISIBLE_DEVICES (indices or UUIDs, comma-separated;
    as CUDA does, the list ends at the first entry that names no device)."""
    if cuda_visible_devices is None:
        return list(gpus)
    by_index = {g.index: g for g in gpus if g.index is not None}
    by_position = {str(i): g for i, g in enumerate(gpus)}
    seen: list[Gpu] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        gpu = by_index.get(entry) or (by_position.get(entry) if not by_index else None)
        if gpu is None and entry:
            gpu = next((g for g in gpus if g.uuid and (g.uuid == entry or g.uuid.startswith(entry))), None)
        if gpu is None or gpu in seen:
            break
        seen.append(gpu)
    return seen


@dataclass(frozen=True)
class Route:
    dev: str | None
    src: str | None
    local: bool  # the address is this host's own (rank 0)
    error: str | None = None


@dataclass(frozen=True)
class SlowReading:
    """A stat of shared storage that was slow to answer, and its process as the probe saw it
    then (ftbundle/remote/evidence.py): ``verdict`` "hung" (held in the kernel while the host
    ran) or "starved" (the host had not run it)."""

    verdict: str
    waited_s: float
    state: str | None = None  # /proc/PID/stat's letter; None: not started
    wchan: str = ""
    load: float | None = None  # the host's 1-minute load average


@dataclass(frozen=True)
class Storage:
    """One path's sentinel round on one host."""

    path: str
    exists: bool = False
    created: bool = False
    parent_exists: bool = False
    where: str | None = None  # where the sentinel went (the path, or its nearest existing parent)
    written: bool | None = None
    seen: tuple[int, ...] = ()  # ranks whose sentinel this host saw
    error: str | None = None
    not_answering_s: float | None = None  # a stat under it did not answer this long (hung network filesystem)
    slow: SlowReading | None = None  # that stat, slow: how it was seen (answered later, or not at all)
    free: int | None = None  # bytes free to the user where the sentinel went (statvfs f_bavail)


@dataclass
class HostFacts:
    """What the probe found on one host. ``error`` set: the host could not be asked."""

    host: str
    rank: int
    error: str | None = None
    hostname: str = ""
    kernel: str = ""
    route: Route | None = None
    links: tuple[str, ...] = ()
    versions: dict[str, str] | None = None
    image: str | None = None  # the image the docker runtime would run (given, or recorded)
    image_id: str | None = None
    image_ref: str | None = None  # /etc/ftbundle/image.ref, as site.yml recorded it
    runtime_error: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    gpu_error: str | None = None
    gpu_hung: bool = False
    compute_apps: list[ComputeApp] = field(default_factory=list)
    health_asked: bool = False  # the job's `health` is not off (see .gpu_health)
    gpu_health: list[GpuHealth] = field(default_factory=list)
    xids: list[Xid] = field(default_factory=list)  # the kernel log's NVRM Xid lines
    health_error: str | None = None  # why the GPUs' health readings are missing
    kernel_log_error: str | None = None  # why the kernel log could not be read
    infiniband: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # the job's view after the env file
    workdir_ok: bool = True
    storage: dict[str, Storage] = field(default_factory=dict)
    port: dict[str, Any] | None = None
    claim: dict[str, Any] | None = None  # what a run's check claimed here, or found held (remote/claims.py)
    datasets: list[dict] = field(default_factory=list)
    cpus: int | None = None  # the cores the probe's login may use
    paths: dict[str, str | None] = field(default_factory=dict)  # the job's files: None there, else why not
    fingerprints: dict[str, dict] = field(default_factory=dict)  # the job's node-local files' bytes (remote/probe_files.py)
    model: dict | None = None  # the model's parameters, files and config (rank 0: remote/probe_files.py)
    tokenized: dict | None = None  # the kept tokenized dataset's key and state (rank 0: remote/probe_tokenized.py)
    gemm: dict | None = None  # each GPU's bf16 GEMM as its last burn-in measured it, or {"error"} (rank 0: remote/probe.py gemm)
    wandb_login: dict | None = None  # where rank 0's wandb would find a key (remote/probe.py wandb_login)
    servers: dict | None = None  # whether rank 0 reaches its trackers' servers (remote/probe.py servers)
    mlruns: str | None = None  # rank 0's ./mlruns where it holds runs and no URI is set: MLflow's default then
    problems: list[str] = field(default_factory=list)  # facts that could not be had

    def visible_gpus(self, job_env: dict[str, str]) -> list[Gpu]:
        """The GPUs the job's ranks will see here: the job's CUDA_VISIBLE_DEVICES wins over
        the host's (the node program exports the job's env after the env file)."""
        value = job_env.get("CUDA_VISIBLE_DEVICES", self.env.get("CUDA_VISIBLE_DEVICES"))
        return visible(self.gpus, value)

    @property
    def shared(self) -> Storage:
        return self.storage.get("shared_dir") or Storage(path="")


def slow_reading(data: Any) -> SlowReading | None:
    if not isinstance(data, dict) or data.get("verdict") not in ("hung", "starved"):
        return None
    load = data.get("load")
    return SlowReading(data["verdict"], float(data.get("waited_s") or 0), data.get("state"),
                       str(data.get("wchan") or ""), float(load) if isinstance(load, (int, float)) else None)


def package_version(hosts: list[HostFacts], package: str) -> str | None:
    """The version of ``package`` these hosts' ranks run, where they agree (None: not one)."""
    found = {(f.versions or {}).get(package) for f in hosts}
    found.discard(None)
    found.discard("absent")
    return found.pop() if len(found) == 1 else None


def parse_facts(host: str, rank: int, data: dict[str, Any]) -> HostFacts:
    """The probe's JSON -> HostFacts."""
    f = HostFacts(host, rank)
    f.hostname = data.get("hostname", "")
    f.kernel = data.get("kernel", "")
    f.links = tuple(data.get("links") or ())
    r = data.get("route")
    if r is not None:
        f.route = Route(r.get("dev"), r.get("src"), bool(r.get("local")), r.get("error"))
    f.versions = data.get("versions")
    f.image, f.image_id, f.image_ref = data.get("image"), data.get("image_id"), data.get("image_ref")
    f.runtime_error = data.get("runtime_error")
    f.gpu_error, f.gpu_hung = data.get("gpu_error"), bool(data.get("gpu_hung"))
    if data.get("gpus"):
        try:
            f.gpus = add_gpu_ids(parse_nvidia_smi(data["gpus"]), data.get("gpu_ids", ""))
        except ValueError as exc:
            f.gpu_error = str(exc)
    try:
        f.compute_apps = parse_compute_apps(data.get("compute_apps") or "")
    except ValueError:
        pass
    if "health" in data:
        f.health_asked = True
        f.gpu_health, f.xids, f.health_error, f.kernel_log_error = parse_health(data["health"] or {})
    f.infiniband = tuple(data.get("infiniband") or ())
    f.env = dict(data.get("env") or {})
    f.workdir_ok = bool(data.get("workdir_ok", True))
    for name, s in (data.get("storage") or {}).items():
        f.storage[name] = Storage(
            path=s.get("path", ""), exists=bool(s.get("exists")), created=bool(s.get("created")),
            parent_exists=bool(s.get("parent_exists")), where=s.get("where"), written=s.get("written"),
            seen=tuple(s.get("seen") or ()), error=s.get("write_error") or s.get("create_error"),
            not_answering_s=s.get("not_answering_s"), slow=slow_reading(s.get("slow")),
            free=s.get("free") if isinstance(s.get("free"), int) else None)
    f.port = data.get("port")
    f.claim = data.get("claim") if isinstance(data.get("claim"), dict) else None
    f.datasets = list(data.get("datasets") or [])
    f.cpus = data.get("cpus") if isinstance(data.get("cpus"), int) else None
    f.paths = dict(data.get("paths") or {})
    f.wandb_login = data.get("wandb_login") if isinstance(data.get("wandb_login"), dict) else None
    f.servers = data.get("servers") if isinstance(data.get("servers"), dict) else None
    f.mlruns = data.get("mlruns") if isinstance(data.get("mlruns"), str) else None
    f.fingerprints = {k: v for k, v in (data.get("fingerprints") or {}).items() if isinstance(v, dict)}
    f.model = data.get("model") if isinstance(data.get("model"), dict) else None
    f.tokenized = data.get("tokenized") if isinstance(data.get("tokenized"), dict) else None
    f.gemm = data.get("gemm") if isinstance(data.get("gemm"), dict) else None
    f.problems = list(data.get("errors") or [])
    return f


@dataclass
class ClusterFacts:
    """Every host's facts, in rank order; unreachable hosts carry ``error``."""

    hosts: list[HostFacts]
    token: str | None = None  # the check's sentinel name on the hosts (None: no sentinels)

    @property
    def reached(self) -> list[HostFacts]:
        return [f for f in self.hosts if not f.error]

    @property
    def bf16(self) -> bool | None:
        """Whether every host's GPUs can do bf16; None when no host has a GPU."""
        reached = self.reached
        if not any(f.gpus for f in reached):
            return None
        return all(f.gpus and bf16_capable(f.gpus) for f in reached)

    @property
    def infiniband(self) -> bool:
        reached = self.reached
        return bool(reached) and all(f.infiniband for f in reached)

    def storage_shared(self, name: str) -> bool | None:
        """Every reached host saw every reached host's sentinel for ``name``; None when it
        was not asked."""
        reached = [f for f in self.reached if name in f.storage]
        if not reached:
            return None
        ranks = {f.rank for f in reached}
        return all(f.storage[name].written and set(f.storage[name].seen) >= ranks for f in reached)
