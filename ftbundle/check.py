"""Preflight: are the hosts of a plan alike and ready? Nothing is launched.

`ftbundle check JOB` asks every host, in parallel, the questions whose wrong answers
otherwise surface minutes into a run as a hang or an obscure error on one node: can we
reach it, does it run the same Python/torch/transformers/llamafactory (or the same image),
does it have the GPUs `nproc_per_node` promises, is the shared directory really shared,
are the dataset files the same bytes, which interface routes to rank 0, and is the master
port free on rank 0 and reachable from every other host.

The checks follow the StackHPC pattern: gather one value per host, group the hosts by
value, and fail once, showing the grouping, when there is more than one group. The odd
host out is then plain to see.

All over the run's one connection per host (:class:`~ftbundle.cluster.Cluster`):

0. rank 0 creates the shared directory when it is missing (a fresh NFS mount has none);
1. the probe: one bash script per host (:func:`probe_script`) prints its facts in
   `@@ftb <name>` sections (bash, not Python: with the docker runtime the host need not
   have our interpreter; the small Python helpers inside print JSON), and writes a
   sentinel file into the shared directory;
2. every host lists the sentinel directory (each must see every sentinel: that, not a
   path, proves the directory is shared), then rank 0 opens a short-lived listener on the
   master port (the bind is the "is it free?" test) while every other host connects to
   it; rank 0 removes the sentinels afterwards.

The pure parts (probe script, parsers, grouping, the checks themselves) come first;
the I/O is at the end (:func:`prepare_shared_dir`, :func:`gather_facts`,
:func:`second_round`, and :func:`run_checks`, which strings them together).
"""

from __future__ import annotations

import json
import posixpath
import re
import secrets
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

import yaml

from . import runtimes
from .errors import UserError
from .job import PINNED_IMAGE_RE, Job
from .plan import NodePlan, Plan
from .cluster import Cluster, Result, first_line, parallel

PROBE_TIMEOUT_S = 120  # the probe hashes the dataset files; large ones take a while
ROUND_TIMEOUT_S = 30
LISTEN_S = 8  # how long rank 0's listener waits for every other host
CONNECT_S = 6  # how long the other hosts keep trying to reach it
SECTION = "@@ftb "
PACKAGES = ("torch", "transformers", "llamafactory")
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
BF16_MIN_COMPUTE_CAP = (8, 0)  # Ampere and later



# ---------------------------------------------------------------------------------------
# Grouping: one value per host, hosts grouped by value


def group_by_value(values: dict[str, str]) -> list[tuple[str, list[str]]]:
    """[(value, hosts)], the largest group first (ties: the group seen first), hosts in
    the order given (rank order). The odd ones out come last."""
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    order = list(groups)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), order.index(item[0])))


def describe_groups(groups: list[tuple[str, list[str]]]) -> str:
    """`value on a, b; other on c`: a grouping on one line, for failure messages."""
    return "; ".join(f"{value} on {', '.join(hosts)}" for value, hosts in groups)


# ---------------------------------------------------------------------------------------
# GPUs


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    memory_mib: int | None
    compute_cap: str | None  # "9.0"; None when the driver cannot say

    @property
    def compute_cap_tuple(self) -> tuple[int, int] | None:
        match = re.fullmatch(r"(\d+)\.(\d+)", self.compute_cap or "")
        return (int(match.group(1)), int(match.group(2))) if match else None


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
        gpus.append(Gpu(name, driver, int(memory) if memory.isdigit() else None, cap))
    return gpus


def bf16_capable(gpus: Iterable[Gpu]) -> bool:
    """True when there are GPUs and every one has compute capability 8.0 or more."""
    caps = [g.compute_cap_tuple for g in gpus]
    return bool(caps) and all(c is not None and c >= BF16_MIN_COMPUTE_CAP for c in caps)


def describe_gpus(gpus: list[Gpu]) -> str:
    """`8x NVIDIA H100 80GB HBM3 (81559 MiB, compute 9.0, driver 550.54.15)`, or the kinds
    joined with `+` for a host with mixed GPUs."""
    if not gpus:
        return "none"
    kinds: dict[Gpu, int] = {}
    for gpu in gpus:
        kinds[gpu] = kinds.get(gpu, 0) + 1
    return " + ".join(
        f"{count}x {g.name} ({g.memory_mib if g.memory_mib is not None else '?'} MiB, "
        f"compute {g.compute_cap or '?'}, driver {g.driver})" for g, count in kinds.items())


# ---------------------------------------------------------------------------------------
# The probe: what one host is asked, and how its answer is read


@dataclass(frozen=True)
class ProbeSpec:
    """Everything the probe of one host needs to know; built from the plan (pure)."""

    host: str
    rank: int
    python: str | None  # host runtime: the job's interpreter
    image: str | None  # docker runtime: the image whose ID is compared
    master_addr: str
    workdir: str
    shared_dir: str
    sentinel_dir: str | None  # where to write this host's sentinel (None: not checked)
    env_file: str | None
    dataset_dir: str | None  # LlamaFactory mode: absolute dataset_dir
    datasets: tuple[str, ...] = ()

    @property
    def helper_python(self) -> str:
        """The interpreter for the probe's small Python helpers (dataset hashes, the
        port listener): the job's own, or the host's python3 for the docker runtime."""
        return self.python or "python3"


def sentinel_name(rank: int) -> str:
    return f"rank-{rank}"


def runtime_python(job: Job, node: NodePlan) -> str | None:
    """The interpreter a host-runtime node runs (as make_plan resolved it), else None."""
    if job.runtime.kind != "host":
        return None
    if node.path_prepend:
        return posixpath.join(node.path_prepend, posixpath.basename(job.runtime.python))
    return job.runtime.python


def docker_image(node: NodePlan) -> str | None:
    """The image of a docker-runtime node's `docker run` (the job pins it by digest)."""
    argv = list(node.argv)
    if argv[:2] != ["docker", "run"]:
        return None
    images = [a for a in argv if PINNED_IMAGE_RE.search(a)]
    return images[0] if images else None


def llamafactory_datasets(plan: Plan, workdir: str) -> tuple[str | None, tuple[str, ...]]:
    """(absolute dataset_dir, dataset names) from the staged LlamaFactory config; the
    names of `dataset` and `eval_dataset`. (None, ()) for other train modes and for
    datasets fetched online, which have no local files to compare."""
    text = plan.files.get(runtimes.LLAMAFACTORY_CONFIG)
    if not text:
        return None, ()
    config = yaml.safe_load(text) or {}
    names: list[str] = []
    for key in ("dataset", "eval_dataset"):
        value = config.get(key)
        if isinstance(value, str):
            value = value.split(",")
        for name in value or []:
            name = str(name).strip()
            if name and name not in names:
                names.append(name)
    dataset_dir = str(config.get("dataset_dir") or "data")
    if not names or dataset_dir == "ONLINE" or dataset_dir.startswith("REMOTE:"):
        return None, ()
    return posixpath.normpath(posixpath.join(workdir, dataset_dir)), tuple(names)


def probe_spec(job: Job, plan: Plan, node: NodePlan, sentinel_dir: str | None) -> ProbeSpec:
    dataset_dir, datasets = llamafactory_datasets(plan, node.workdir)
    return ProbeSpec(
        host=node.host.name, rank=node.rank, python=runtime_python(job, node),
        image=docker_image(node) if job.runtime.kind == "docker" else None,
        master_addr=plan.master_addr, workdir=node.workdir, shared_dir=plan.shared_dir,
        sentinel_dir=sentinel_dir, env_file=node.env_file, dataset_dir=dataset_dir,
        datasets=datasets,
    )


# Package metadata, without importing the packages (torch takes seconds to import). torch's
# own version.py is read as text: its __version__ carries the build (2.14.1+cu130), which
# the distribution's metadata may not.
_VERSIONS_PY = """
import importlib.metadata as md, importlib.util, json, os, re, sys
def version(name):
    try:
        found = md.version(name)
    except md.PackageNotFoundError:
        return "absent"
    try:
        spec = importlib.util.find_spec(name)
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            return re.search(r"^__version__\\s*=\\s*['\\"]([^'\\"]+)", f.read(), re.M).group(1)
    except Exception:
        return found
print(json.dumps({"python": sys.version.split()[0], **{n: version(n) for n in sys.argv[1:]}}))
"""

# LlamaFactory's own rules (data/parser.py, data/loader.py): dataset_info.json in
# dataset_dir maps each name to a file_name (a file, or a directory of files) relative to
# dataset_dir; hub and cloud datasets have no local file.
_DATASETS_PY = """
import hashlib, json, os, sys
dataset_dir, names = sys.argv[1], sys.argv[2:]
info_path = os.path.join(dataset_dir, "dataset_info.json")
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
def digest(path):
    if os.path.isfile(path):
        return sha256(path)
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(f"{os.path.relpath(full, path)}\\0{sha256(full)}\\n".encode())
    return h.hexdigest()
out = []
try:
    with open(info_path) as f:
        info = json.load(f)
except FileNotFoundError:
    info = None
    out.append({"file": info_path, "error": "missing"})
except (OSError, ValueError) as exc:
    info = None
    out.append({"file": info_path, "error": f"unreadable: {exc}"})
for name in names if info is not None else []:
    entry = info.get(name)
    if not isinstance(entry, dict):
        out.append({"dataset": name, "file": info_path, "error": "not defined"})
        continue
    if "file_name" not in entry:
        remote = [k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name") if k in entry]
        out.append({"dataset": name, "remote": remote[0] if remote else "no file_name"})
        continue
    path = os.path.join(dataset_dir, entry["file_name"])
    if not os.path.exists(path):
        out.append({"dataset": name, "file": path, "error": "missing"})
        continue
    try:
        out.append({"dataset": name, "file": path, "sha256": digest(path)})
    except OSError as exc:
        out.append({"dataset": name, "file": path, "error": f"unreadable: {exc.strerror}"})
print(json.dumps(out))
"""


def probe_script(spec: ProbeSpec) -> str:
    """The bash program of round 1: one section per fact, `@@ftb <name>` before each."""
    q = shlex.quote
    lines = [
        "set -u",
        f"sec() {{ printf '\\n{SECTION}%s\\n' \"$1\"; }}",
        f"PY={q(spec.helper_python)}",
        "sec hostname; hostname 2>/dev/null || cat /proc/sys/kernel/hostname",
        "sec kernel; uname -sr",
        # a name is resolved the way the ranks will resolve it
        f"sec route; a=$(getent ahostsv4 {q(spec.master_addr)} 2>/dev/null | awk 'NR==1{{print $1}}')",
        (f'if [ -z "$a" ]; then echo "ERROR: cannot resolve {spec.master_addr}"; '
         'else ip -o route get "$a" 2>&1 || true; fi'),
        "sec links; ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1",
    ]
    if spec.image:
        lines.append(f"sec image; docker image inspect -f '{{{{.Id}}}}' {q(spec.image)} 2>&1 "
                     "| sed -n 1p | sed 's/^Error.*/ERROR: &/'")
    else:
        lines.append('sec versions; if ! command -v "$PY" >/dev/null 2>&1; then echo "ERROR: $PY not found"; '
                     f'else "$PY" -c {q(_VERSIONS_PY)} {" ".join(PACKAGES)} 2>&1 | tail -n 3; fi')
    query = "nvidia-smi --format=csv,noheader,nounits --query-gpu=name,driver_version,memory.total"
    lines += [
        "sec gpus",
        "if ! command -v nvidia-smi >/dev/null 2>&1; then echo NONE",
        f"elif out=$({query},compute_cap 2>&1); then printf '%s\\n' \"$out\"",
        f"elif out=$({query} 2>&1); then printf '%s\\n' \"$out\"",
        "else echo \"ERROR: $out\" | head -n 3; fi",
        f"sec workdir; if [ -d {q(spec.workdir)} ]; then echo ok; else echo missing; fi",
        f"sec shared_dir; if [ -d {q(spec.shared_dir)} ]; then echo ok; else echo missing; fi",
        f"sec shared_parent; if [ -d {q(posixpath.dirname(spec.shared_dir.rstrip('/')) or '/')} ]; then echo ok; "
        "else echo missing; fi",
    ]
    if spec.sentinel_dir:
        sentinel = posixpath.join(spec.sentinel_dir, sentinel_name(spec.rank))
        lines.append(f"sec sentinel; if [ -d {q(spec.shared_dir)} ] && {{ mkdir -p {q(spec.sentinel_dir)} && "
                     f"hostname > {q(sentinel)}; }} 2>/dev/null; then echo ok; else echo failed; fi")
    # what the ranks will see: the env file first (as the node wrapper sources it)
    names = " ".join(IFNAME_VARS)
    env_file = q(spec.env_file) if spec.env_file else "/dev/null"
    lines.append(f"sec ifname_env; ( for v in {names}; do unset $v; done; "
                 f"if [ -r {env_file} ]; then set -a; . {env_file} >/dev/null 2>&1; set +a; fi; "
                 f"for v in {names}; do printf '%s=%s\\n' \"$v\" \"${{!v-}}\"; done )")
    if spec.dataset_dir:
        lines.append('sec datasets; if ! command -v "$PY" >/dev/null 2>&1; then '
                     'echo "ERROR: no $PY to read dataset_info.json with"; '
                     f'else "$PY" -c {q(_DATASETS_PY)} {q(spec.dataset_dir)} '
                     f'{" ".join(q(d) for d in spec.datasets)} 2>&1 | tail -n 5; fi')
    lines.append("sec end")
    return "\n".join(lines) + "\n"


def parse_sections(text: str) -> dict[str, str]:
    """`@@ftb name` headed sections -> {name: body}, bodies stripped."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(SECTION):
            current = line[len(SECTION):].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {k: "\n".join(v).strip() for k, v in sections.items()}


@dataclass(frozen=True)
class Route:
    dev: str | None
    src: str | None
    local: bool  # the address is this host's own (rank 0)
    error: str | None = None


def parse_route(text: str) -> Route:
    """`ip -o route get ADDR` -> the interface and source address the ranks will use."""
    dev = re.search(r"\bdev (\S+)", text)
    src = re.search(r"\bsrc (\S+)", text)
    if not dev:
        return Route(None, None, False, text.strip().splitlines()[0] if text.strip() else "no route")
    return Route(dev.group(1), src.group(1) if src else None, text.lstrip().startswith("local "))


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
    image_id: str | None = None
    runtime_error: str | None = None  # no interpreter, no image, ...
    gpus: list[Gpu] = field(default_factory=list)
    gpu_error: str | None = None
    workdir_ok: bool = True
    shared_dir_ok: bool = True
    shared_parent_ok: bool = True
    sentinel_ok: bool | None = None
    ifname_env: dict[str, str] = field(default_factory=dict)
    datasets: list[dict] = field(default_factory=list)
    datasets_error: str | None = None


def parse_probe(spec: ProbeSpec, result: Result) -> HostFacts:
    """The probe's output -> HostFacts. A probe cut short is this host's failure."""
    s = parse_sections(result.stdout)
    facts = HostFacts(spec.host, spec.rank)
    if "end" not in s:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or [f"exit {result.code}"]
        facts.error = f"probe did not finish: {tail[0]}"
        return facts
    facts.hostname = s.get("hostname", "")
    facts.kernel = s.get("kernel", "")
    facts.route = parse_route(s.get("route", ""))
    facts.links = tuple(s.get("links", "").split())
    if spec.image:
        value = s.get("image", "")
        if value.startswith("sha256:"):
            facts.image_id = value
        else:
            facts.runtime_error = f"image {spec.image} not on host" + (f" ({value})" if value else "")
    else:
        text = s.get("versions", "")
        try:
            facts.versions = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            said = text.replace("ERROR: ", "").splitlines() or ["no answer"]
            facts.runtime_error = f"{spec.helper_python}: {said[-1]}"
    gpus = s.get("gpus", "")
    if gpus.startswith("ERROR"):
        facts.gpu_error = gpus[len("ERROR: "):].splitlines()[0] if len(gpus) > 7 else "nvidia-smi failed"
    elif gpus != "NONE":
        try:
            facts.gpus = parse_nvidia_smi(gpus)
        except ValueError as exc:
            facts.gpu_error = str(exc)
    facts.workdir_ok = s.get("workdir") == "ok"
    facts.shared_dir_ok = s.get("shared_dir") == "ok"
    facts.shared_parent_ok = s.get("shared_parent") == "ok"
    if "sentinel" in s:
        facts.sentinel_ok = s["sentinel"] == "ok"
    for line in s.get("ifname_env", "").splitlines():
        name, _, value = line.partition("=")
        if value:
            facts.ifname_env[name] = value
    if spec.dataset_dir:
        text = s.get("datasets", "")
        try:
            facts.datasets = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            facts.datasets_error = (text.replace("ERROR: ", "").splitlines() or ["no answer"])[-1]
    return facts


# ---------------------------------------------------------------------------------------
# The checks: pure functions of the facts


@dataclass
class Check:
    """One line (or block) of the report: hosts grouped by value, and why it failed."""

    name: str
    groups: list[tuple[str, list[str]]]
    failure: str | None = None  # e.g. "versions differ"
    details: list[str] = field(default_factory=list)  # failure lines that name hosts
    notes: list[str] = field(default_factory=list)  # worth saying, not a failure
    label: str = ""  # the name as shown, with its subject ("route to 10.0.0.1")

    @property
    def ok(self) -> bool:
        return self.failure is None

    def messages(self) -> list[str]:
        """One self-contained line per failure, for CheckReport.failures."""
        if self.ok:
            return []
        if self.details:
            return [f"{self.name}: {d}" for d in self.details]
        return [f"{self.failure}: {describe_groups(self.groups)}"]


def _grouped(name: str, values: dict[str, str], failure: str | None = None) -> Check:
    """A check that fails with `failure` when the hosts do not all agree."""
    groups = group_by_value(values)
    return Check(name, groups, failure if failure and len(groups) > 1 else None)


def check_ssh(facts: list[HostFacts]) -> Check:
    values = {f.host: ("unreachable" if f.error else "reachable") for f in facts}
    check = Check("ssh", group_by_value(values))
    bad = [f for f in facts if f.error]
    if bad:
        check.failure = "hosts not reachable"
        check.details = [f"{f.host} (rank {f.rank}): {f.error}" for f in bad]
    return check


def check_hostnames(facts: list[HostFacts]) -> Check:
    """Two inventory entries that are one machine (two addresses of one host) would run
    two nodes' ranks on the same GPUs."""
    values = {f.host: f.hostname for f in facts}
    groups = group_by_value(values)
    check = Check("hostname", [(f"{len(groups)} distinct", list(values))])
    twins = [(name, hosts) for name, hosts in groups if len(hosts) > 1]
    if twins:
        check.failure = "hosts are the same machine"
        check.details = [f"{', '.join(hosts)} all have hostname {name}" for name, hosts in twins]
    return check


def check_system(facts: list[HostFacts]) -> Check:
    return _grouped("system", {f.host: f.kernel for f in facts})  # shown, never fails


def check_runtime(facts: list[HostFacts], docker: bool) -> Check:
    """Same interpreter and packages (host runtime) or the same image ID (docker)."""
    name = "image" if docker else "versions"
    values = {}
    for f in facts:
        if f.runtime_error:
            values[f.host] = f"ERROR {f.runtime_error}"
        elif docker:
            values[f.host] = str(f.image_id)
        else:
            values[f.host] = " ".join(f"{k}={v}" for k, v in (f.versions or {}).items())
    check = _grouped(name, values, f"{name} differ")
    broken = [f for f in facts if f.runtime_error]
    if broken:
        check.failure = f"{name} unavailable"
        check.details = [f"{f.host}: {f.runtime_error}" for f in broken]
    return check


def _visible_gpus(job: Job) -> int | None:
    """How many GPUs the job's CUDA_VISIBLE_DEVICES leaves visible, when it sets it."""
    value = job.env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return len([d for d in value.split(",") if d.strip()])


def check_gpus(facts: list[HostFacts], job: Job, nproc_per_node: int) -> Check:
    """Same GPUs everywhere, and as many as ranks per node (`auto`: the same number, > 0)."""
    values = {f.host: (f"ERROR {f.gpu_error}" if f.gpu_error else describe_gpus(f.gpus)) for f in facts}
    check = Check("gpus", group_by_value(values))
    errors = [f for f in facts if f.gpu_error]
    if errors:
        check.failure = "nvidia-smi failed"
        check.details = [f"{f.host}: nvidia-smi failed: {f.gpu_error}" for f in errors]
    elif len(check.groups) > 1:
        check.failure = "GPUs differ"
    counts = {f.host: len(f.gpus) for f in facts if not f.gpu_error}
    visible = _visible_gpus(job)
    fit = []
    if job.nproc_per_node == "auto":
        if counts and not any(counts.values()):
            fit.append("nproc_per_node is auto but no host has a GPU; set the number of ranks per host")
    elif any(counts.values()):
        for host, count in counts.items():
            usable = min(count, visible) if visible is not None else count
            if usable != nproc_per_node:
                fit.append(f"nproc_per_node is {nproc_per_node} but {host} has {usable} GPU(s)"
                           + (" visible (CUDA_VISIBLE_DEVICES)" if visible is not None else ""))
    else:
        check.notes.append(f"no GPUs: {nproc_per_node} CPU rank(s) per host")
    if fit:
        if check.failure == "GPUs differ":
            check.details.append(f"GPUs differ: {describe_groups(check.groups)}")
        check.failure = check.failure or "GPUs do not fit nproc_per_node"
        check.details += fit
    return check


def check_dirs(facts: list[HostFacts], plan: Plan, workdir: str, created_on: str | None = None) -> Check:
    """workdir and shared_dir on every host. ``created_on``: the host (rank 0's) that just
    created the missing shared_dir; a host that does not see it then has a parent that is
    not the same storage, and is told so."""
    label = f"workdir {workdir}" + (f", shared_dir {plan.shared_dir}" if plan.shared_dir != workdir else "")
    check = Check("dirs", [("present", [f.host for f in facts])], label=label)
    parent = posixpath.dirname(plan.shared_dir.rstrip("/")) or "/"
    for f in facts:
        if not f.workdir_ok and workdir != plan.shared_dir:
            check.details.append(f"workdir {workdir} does not exist on {f.host}")
        if f.shared_dir_ok:
            continue
        if not f.shared_parent_ok:
            check.details.append(f"{parent}, the parent of shared_dir {plan.shared_dir}, does not exist on "
                                 f"{f.host} (shared storage not mounted there?)")
        elif created_on and created_on != f.host:
            check.details.append(f"shared_dir {plan.shared_dir} was just created on {created_on} (rank 0), but "
                                 f"{f.host} does not see it: {parent} on {f.host} is not the same storage "
                                 f"as on {created_on}")
        else:
            check.details.append(f"shared_dir {plan.shared_dir} does not exist on {f.host} and could not be "
                                 "created there")
    if check.details:
        check.failure = "directories missing"
        bad = {f.host for f in facts if not f.shared_dir_ok or (not f.workdir_ok and workdir != plan.shared_dir)}
        check.groups = group_by_value({f.host: "missing" if f.host in bad else "present" for f in facts})
    return check


def check_datasets(facts: list[HostFacts]) -> Check | None:
    """The same bytes of every dataset file on every host; a missing dataset_info.json,
    an unknown dataset or a missing file names the host, the file and the dataset."""
    if not any(f.datasets or f.datasets_error for f in facts):
        return None
    check = Check("datasets", [])
    per_file: dict[tuple[str, str], dict[str, str]] = {}
    for f in facts:
        if f.datasets_error:
            check.details.append(f"{f.host}: cannot hash the dataset files: {f.datasets_error}")
        for entry in f.datasets:
            if "remote" in entry:
                note = f"dataset {entry['dataset']!r} is not a local file ({entry['remote']}): not compared"
                if note not in check.notes:
                    check.notes.append(note)
                continue
            if "error" in entry:
                what = f"dataset {entry['dataset']!r}" if "dataset" in entry else "the datasets"
                check.details.append(f"{f.host}: {entry['file']} {entry['error']} (needed for {what})")
                if "dataset" in entry:
                    per_file.setdefault((entry["dataset"], entry["file"]), {})[f.host] = entry["error"]
                continue
            per_file.setdefault((entry["dataset"], entry["file"]), {})[f.host] = entry["sha256"][:16]
    for (dataset, path), hashes in per_file.items():
        groups = group_by_value(hashes)
        present = group_by_value({h: v for h, v in hashes.items() if len(v) == 16})
        if len(present) > 1:
            check.details.append(f"dataset {dataset!r} file {path} differs: {describe_groups(present)}")
        check.groups += [(f"{dataset} {path} " + (f"sha256 {value}" if len(value) == 16 else value), hosts)
                         for value, hosts in groups]
    if check.details:
        check.failure = "dataset files differ or are missing"
    return check


def _ifname_matches(spec: str, dev: str) -> bool:
    """NCCL_SOCKET_IFNAME syntax: comma-separated prefixes, `=` exact, `^` excludes."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    hit = any(dev == n if exact else dev.startswith(n) for n in names)
    return not hit if exclude else hit


def check_route(facts: list[HostFacts], job: Job, plan: Plan) -> Check:
    """The interface each host reaches rank 0 through, and whether the socket interface
    named for NCCL/gloo exists there (gloo stops with "Unable to find address" if not)."""
    values = {}
    for f in facts:
        r = f.route
        if r is None or r.dev is None:
            values[f.host] = f"ERROR {r.error if r else 'no route'}"
        elif r.local:
            values[f.host] = f"{r.dev} (rank 0 itself)"
        else:
            values[f.host] = r.dev
    check = Check("route", group_by_value(values), label=f"route to {plan.master_addr}")
    for f in facts:
        if f.route is None or f.route.dev is None:
            check.details.append(f"no route from {f.host} to {plan.master_addr}: "
                                 f"{f.route.error if f.route else 'no answer'}")
        for var in IFNAME_VARS:
            spec = job.env.get(var) or f.ifname_env.get(var)
            if not spec:
                continue
            if f.links and not any(_ifname_matches(spec, link) for link in f.links):
                check.details.append(f"{var}={spec} matches no interface on {f.host} "
                                     f"(it has {', '.join(f.links)})")
            elif f.route and f.route.dev and not f.route.local and not _ifname_matches(spec, f.route.dev):
                check.notes.append(f"{f.host} routes to rank 0 through {f.route.dev}, not {var}={spec}")
    if check.details:
        check.failure = "interfaces wrong"
    return check


def bf16_of(facts: list[HostFacts]) -> bool | None:
    """Whether every host's GPUs can do bf16; None when no host has a GPU."""
    if not any(f.gpus for f in facts):
        return None
    return all(f.gpus and bf16_capable(f.gpus) for f in facts)


# ---------------------------------------------------------------------------------------
# Rounds 2 and 3: the shared directory and the master port


def list_script(sentinel_dir: str) -> str:
    return f"ls -1A {shlex.quote(sentinel_dir)} 2>&1 || true\n"


def check_shared(listings: dict[str, str], writers: dict[str, str], shared_dir: str) -> Check:
    """Every host must see every sentinel: `writers` maps sentinel file -> host name."""
    expected = list(writers)
    values = {}
    for host, listing in listings.items():
        seen = [writers[s] for s in expected if s in listing.split()]
        values[host] = f"sees {', '.join(seen) or 'no sentinel'}"
    groups = group_by_value(values)
    everyone = f"sees {', '.join(writers[s] for s in expected)}"
    check = Check("shared_dir", groups, label=f"shared_dir {shared_dir}")
    if any(value != everyone for value in values.values()):
        check.failure = f"shared_dir {shared_dir} is not shared by all hosts"
        for host in values:
            missing = [writers[s] for s in expected if s not in listings[host].split()]
            if missing:
                check.details.append(f"{host} does not see the sentinel of {', '.join(missing)} in {shared_dir}")
    return check


_LISTEN_PY = """
import socket, sys, time
port, want, wait = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
try:
    s.bind(("", port))
except OSError as exc:
    print("busy", exc.strerror, flush=True)
    sys.exit(0)
s.listen(64)
print("listening", flush=True)
peers, end = [], time.monotonic() + wait
while len(peers) < want and time.monotonic() < end:
    s.settimeout(max(0.05, end - time.monotonic()))
    try:
        conn, addr = s.accept()
    except socket.timeout:
        break
    peers.append(addr[0])
    conn.close()
print("accepted", *peers, flush=True)
"""


def listen_script(python: str, port: int, peers: int) -> str:
    """Rank 0: bind the master port (the "is it free" test) and accept the other hosts'
    connections for a few seconds; who holds the port when it is busy. Bounded by
    `timeout`, so nothing outlives the check even if the SSH channel is lost."""
    q = shlex.quote
    return (f"out=$(timeout -k 2 {LISTEN_S + 5} {q(python)} -c {q(_LISTEN_PY)} {port} {peers} {LISTEN_S} 2>&1)\n"
            'printf "%s\\n" "$out"\n'
            'case "$out" in busy*) ss -Htlnp "( sport = :' + str(port) + ' )" 2>/dev/null | head -n 3 ;; esac\n')


def connect_script(addr: str, port: int) -> str:
    """Any other host: try to reach rank 0's master port for up to CONNECT_S seconds."""
    q = shlex.quote
    target = f"</dev/tcp/{addr}/{port}"
    return (f"end=$((SECONDS + {CONNECT_S}))\n"
            f"while :; do\n"
            f"  if timeout 2 bash -c {q(target)} 2>/dev/null; then echo reachable; exit 0; fi\n"
            f'  [ $SECONDS -ge $end ] && {{ echo unreachable; exit 0; }}\n'
            f"  sleep 0.05\n"
            f"done\n")


def check_port(rank0: str, port: int, rank0_out: str, others: dict[str, str], remote: bool) -> Check:
    """Free on rank 0 (we could bind it) and reachable from every other host."""
    first = rank0_out.strip().splitlines() or ["no answer"]
    if first[0].startswith("busy"):
        holders = re.findall(r'\("([^"]+)",pid=(\d+)', " ".join(first[1:]))
        holder = ", ".join(f"{name} (pid {pid})" for name, pid in dict.fromkeys(holders))
        return Check("master_port", [(f"{port} in use", [rank0])], label=f"master_port {port}",
                     failure=f"master port {port} in use on {rank0} (rank 0)",
                     details=[f"port {port} is already in use on {rank0} (rank 0): {first[0][5:]}"
                              + (f"; held by: {holder}" if holder else "")
                              + " (a previous run still alive? another job?)"])
    if not first[0].startswith("listening"):
        return Check("master_port", [("not tested", [rank0])], label=f"master_port {port}",
                     failure="master port not tested",
                     details=[f"could not listen on {port} on {rank0}: {first[-1]}"])
    values = {h: ("reachable from" if out.strip() == "reachable" else f"not reachable ({out.strip() or 'no answer'})")
              for h, out in others.items()}
    groups = [(f"free on {rank0} (rank 0)", [rank0])] if not others else [
        (f"free on {rank0} (rank 0), {value}", hosts) for value, hosts in group_by_value(values)]
    check = Check("master_port", groups, label=f"master_port {port}")
    bad = [h for h, v in values.items() if v != "reachable from"]
    if bad:
        check.failure = f"master port {port} on {rank0} not reachable"
        check.details = [f"{h} cannot connect to {rank0} port {port} (firewall? wrong ftb_master_addr?)" for h in bad]
    if not remote:
        check.notes.append("local only: reachability from other hosts not tested")
    return check


# ---------------------------------------------------------------------------------------
# The report


@dataclass
class CheckReport:
    checks: list[Check]
    gpu_counts: dict[str, int]
    bf16_capable: bool | None
    seconds: float = 0.0
    title: str = ""

    @property
    def failures(self) -> list[str]:
        return [m for c in self.checks for m in c.messages()]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def format_report(report: CheckReport) -> list[str]:
    """One block per check: `label  value: hosts`, a line per group; failures start with
    FAIL and list what is wrong where."""
    lines = [report.title] if report.title else []
    width = 12
    for c in report.checks:
        if not c.ok:
            lines.append(f"FAIL {c.failure}:")
            lines += [f"  {value}: {', '.join(hosts)}" for value, hosts in c.groups]
            lines += [f"  - {detail}" for detail in c.details]
        else:
            label = c.label or c.name
            if len(label) >= width:  # a long subject gets a line of its own
                lines.append(label)
                label = ""
            for value, hosts in c.groups:
                lines.append(f"{label:<{width}}{value}: {', '.join(hosts)}")
                label = ""
        lines += [f"{'':<{width}}note: {note}" for note in c.notes]
    failed = [c for c in report.checks if not c.ok]
    lines.append(f"all {len(report.checks)} checks passed in {report.seconds:.1f}s" if not failed else
                 f"{len(failed)} of {len(report.checks)} checks failed in {report.seconds:.1f}s: "
                 + ", ".join(c.name for c in failed))
    return lines


def print_report(report: CheckReport, out: TextIO | None = None) -> None:
    out = out or sys.stdout  # looked up now: callers (and tests) may swap sys.stdout
    for line in format_report(report):
        print(line, file=out)
    out.flush()


def resolve_nproc(report: CheckReport, job: Job) -> int:
    """`nproc_per_node: auto` -> the hosts' common GPU count, or a UserError."""
    counts = set(report.gpu_counts.values())
    if len(counts) != 1 or 0 in counts:
        shown = describe_groups(group_by_value({h: f"{c} GPU(s)" for h, c in report.gpu_counts.items()}))
        raise UserError(f"is auto, but the hosts do not all have the same number of GPUs (> 0): {shown}",
                        file=str(job.path), key="nproc_per_node")
    return counts.pop()


# ---------------------------------------------------------------------------------------
# I/O: asking the hosts


LIST_END = "@@ftb-listed"  # between the sentinel listing and the port test in round 2


def _bash(cluster: Cluster, node: NodePlan, script: str, timeout: float) -> Result:
    return cluster.run(node.host, ["bash", "-c", script], timeout=timeout)


def prepare_shared_dir(plan: Plan, cluster: Cluster) -> str | None:
    """Round 0: rank 0 creates shared_dir when it is missing (site.yml mounts the share,
    nothing creates the directory in it). Rank 0's name when it created it, else None."""
    script = '[ -d "$1" ] && exit 0; mkdir -p -- "$1" 2>/dev/null && echo created; exit 0'
    node = plan.nodes[0]
    if node.host.name in cluster.errors:
        return None
    try:
        result = cluster.run(node.host, ["bash", "-c", script, "ftb", plan.shared_dir], timeout=ROUND_TIMEOUT_S)
    except Exception:  # the probe reports the host's trouble
        return None
    return node.host.name if result.stdout.strip() == "created" else None


def gather_facts(specs: dict[int, ProbeSpec], plan: Plan, cluster: Cluster,
                 on_host: Callable[[int, int], None] | None = None) -> list[HostFacts]:
    """Round 1 on every host at once; an unreachable host becomes facts with an error.
    ``on_host(done, total)`` is told as each host answers (the progress display)."""
    done = [0]
    lock = threading.Lock()

    def ask(node: NodePlan) -> HostFacts:
        facts = _ask(node)
        if on_host is not None:
            with lock:
                done[0] += 1
                on_host(done[0], len(plan.nodes))
        return facts

    def _ask(node: NodePlan) -> HostFacts:
        spec = specs[node.rank]
        if node.host.name in cluster.errors:
            return HostFacts(node.host.name, node.rank, error=cluster.errors[node.host.name])
        try:
            result = _bash(cluster, node, probe_script(spec), PROBE_TIMEOUT_S)
        except Exception as exc:  # connection dropped, timed out: this host's failure
            return HostFacts(node.host.name, node.rank, error=f"probe failed: {first_line(exc)}")
        return parse_probe(spec, result)

    return parallel(ask, plan.nodes)


def fact_checks(job: Job, plan: Plan, facts: list[HostFacts], created_on: str | None = None) -> list[Check]:
    """Every check that round 1's facts alone answer."""
    remote = not plan.all_local
    checks = [check_ssh(facts)] if remote else []
    reached = [f for f in facts if not f.error]
    if not reached:
        return checks
    if len(reached) > 1:
        checks.append(check_hostnames(reached))
    checks.append(check_system(reached))
    checks.append(check_runtime(reached, docker=job.runtime.kind == "docker"))
    checks.append(check_gpus(reached, job, plan.nproc_per_node))
    checks.append(check_dirs(reached, plan, plan.nodes[0].workdir, created_on))
    datasets = check_datasets(reached)
    if datasets:
        checks.append(datasets)
    if remote:
        checks.append(check_route(reached, job, plan))
    return checks


def second_round(plan: Plan, cluster: Cluster, reached: list[HostFacts], helper_python: str,
                 sentinel_dir: str | None) -> list[Check]:
    """Round 2, one command per host: list the sentinels (when shared storage is tested),
    then the master port: rank 0 listens, the others connect."""
    nodes = {n.rank: n for n in plan.nodes}
    port_tested = reached[0].rank == 0

    def ask(node: NodePlan) -> str:
        script = (list_script(sentinel_dir) if sentinel_dir else "") + f"echo {LIST_END}\n"
        if port_tested:
            if node.rank == 0:
                script += listen_script(helper_python, plan.master_port, len(reached) - 1)
            else:
                script += connect_script(plan.master_addr, plan.master_port)
        try:
            return _bash(cluster, node, script, LISTEN_S + 20).stdout
        except Exception as exc:
            return f"ERROR {first_line(exc)}\n{LIST_END}\nERROR {first_line(exc)}"

    answers = parallel(ask, [nodes[f.rank] for f in reached])
    listings, ports = {}, {}
    for f, answer in zip(reached, answers):
        listing, _, port = answer.partition(LIST_END + "\n")
        listings[f.host], ports[f.host] = listing, port
    checks = []
    if sentinel_dir and len(reached) > 1:
        writers = {sentinel_name(f.rank): f.host for f in reached if f.sentinel_ok}
        check = check_shared(listings, writers, plan.shared_dir)
        unwritable = [f for f in reached if f.sentinel_ok is False and f.shared_dir_ok]
        if unwritable:
            check.failure = check.failure or f"shared_dir {plan.shared_dir} not writable"
            check.details += [f"cannot write to {plan.shared_dir} on {f.host}" for f in unwritable]
        checks.append(check)
    if port_tested:
        others = {f.host: ports[f.host] for f in reached if f.rank != 0}
        checks.append(check_port(reached[0].host, plan.master_port, ports[reached[0].host], others,
                                 not plan.all_local))
    return checks


def remove_sentinels(plan: Plan, cluster: Cluster, reached: list[HostFacts], sentinel_dir: str,
                     timeout: float = ROUND_TIMEOUT_S) -> None:
    """The sentinel directory goes, on every host that wrote into it (round 2 is over, so no
    host still needs to list it; a host whose directory is not shared has its own copy)."""
    nodes = {n.rank: n for n in plan.nodes}
    writers = [nodes[f.rank].host for f in reached if f.sentinel_ok]
    cluster.run_all([(host, ["rm", "-rf", "--", sentinel_dir]) for host in writers], timeout=timeout)


def run_checks(job: Job, plan: Plan, cluster: Cluster, out: TextIO | None = None, *,
               quiet: bool = False, on_host: Callable[[int, int], None] | None = None) -> CheckReport:
    """Ask every host of ``plan`` whether they are alike and ready; print the report to
    ``out`` (default: stdout) unless ``quiet``. Starts nothing; leaves nothing behind but
    the shared directory it created."""
    started = time.monotonic()
    sentinel_dir = None
    if not plan.all_local and len(plan.nodes) > 1:
        sentinel_dir = posixpath.join(plan.shared_dir, f".ftb-check-{secrets.token_hex(4)}")
    specs = {n.rank: probe_spec(job, plan, n, sentinel_dir) for n in plan.nodes}

    created_on = prepare_shared_dir(plan, cluster)
    reached: list[HostFacts] = []
    try:
        if on_host is not None:
            on_host(0, len(plan.nodes))
        facts = gather_facts(specs, plan, cluster, on_host)
        reached = [f for f in facts if not f.error]
        checks = fact_checks(job, plan, facts, created_on)
        if reached:
            checks += second_round(plan, cluster, reached, specs[0].helper_python, sentinel_dir)
    except KeyboardInterrupt:
        if sentinel_dir:  # a moment for the sentinels, not more: Ctrl-C must be quick
            everyone = [HostFacts(n.host.name, n.rank, sentinel_ok=True) for n in plan.nodes
                        if n.host.name not in cluster.errors]
            remove_sentinels(plan, cluster, everyone, sentinel_dir, timeout=1)
        raise
    if sentinel_dir:
        remove_sentinels(plan, cluster, reached, sentinel_dir)

    report = CheckReport(
        checks=checks,
        gpu_counts={f.host: len(f.gpus) for f in reached},
        bf16_capable=bf16_of(reached),
        seconds=time.monotonic() - started,
        title=(f"ftbundle check: job {plan.job_name}, {plan.nnodes} host(s) x {plan.nproc_per_node} rank(s), "
               f"master {plan.master_addr}:{plan.master_port}"),
    )
    if not quiet:
        print_report(report, out)
    return report
