"""What the job means on these hosts before anything is known about them: (job, hosts) ->
:class:`Layout`. The directories (shared_dir, workdir, the run directory), the interpreter or
image, MASTER_ADDR, what is staged into the run directory, the inventory's per-host settings.

Pure, but for :func:`new_run_id` (the time and a random suffix). The probe is asked about the
layout (ftbundle/check) and :func:`ftbundle.plan.make_plan` turns it and the facts into the plan.
"""

from __future__ import annotations

import posixpath
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from . import llamafactory, rundir, runtimes
from .errors import UserError
from .inventory import Host, host_gpus, host_nproc
from .job import PINNED_IMAGE_RE, Job


# Set by ftbundle on every node; a job's `env:` may not override them.
RESERVED_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE",
                "FTB_RUN_ID", "FTB_RUN_DIR", "FTB_ATTEMPT", "FTB_ATTEMPT_FILE", "FTB_EXCLUDED_HOSTS")


@dataclass(frozen=True)
class Layout:
    """Everything about a run that does not depend on the hosts' facts: where it runs, its
    directories, its interpreter or image, what is staged. Built once from the job and the
    hosts; the probe is asked about it, and :func:`make_plan` turns it and the facts into
    the plan."""

    job: Job = field(repr=False)
    hosts: tuple[Host, ...]
    run_id: str
    run_dir: str
    shared_dir: str
    workdir: str
    master_addr: str
    python: str | None  # host runtime: the interpreter (resolved path, or a name on PATH)
    image: str | None  # docker runtime: pinned by the job or the inventory; None: site.yml's record
    checkpoint_dir: str | None  # LlamaFactory's output_dir, absolute
    dataset_dir: str | None  # LlamaFactory: absolute dataset_dir with local files to compare
    datasets: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict, repr=False)  # staged into run_dir
    lf_config: dict[str, Any] | None = field(default=None, repr=False)  # as staged (no credentials)
    lf_secrets: dict[str, str] = field(default_factory=dict, repr=False)  # config key -> value, via env
    # per-host settings from the inventory (host name -> value; absent: the job's)
    host_nprocs: dict[str, int] = field(default_factory=dict)  # ftb_nproc_per_node
    host_gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ftb_gpus
    # hosts an earlier attempt lost and this one runs without (ftbundle.launch.attempts):
    # FTB_EXCLUDED_HOSTS for every node
    excluded: tuple[str, ...] = ()
    # LlamaFactory keys pointed at each host's local copy by `stage:` (ftbundle/stage.py): key -> path
    staged: dict[str, str] = field(default_factory=dict)
    stage_record: tuple[dict, ...] = ()  # what each source's staging did (Staged.record), kept in plan.json

    @property
    def master_port(self) -> int:
        return self.job.master_port

    @property
    def rundir(self) -> rundir.RunDir:
        """Every name under run_dir (:mod:`ftbundle.rundir`)."""
        return rundir.RunDir(self.run_dir, self.run_id)

    def visible_env(self, host: str) -> dict[str, str]:
        """What decides the GPUs a host's ranks see: the job's env, with the host's
        ``ftb_gpus`` as its CUDA_VISIBLE_DEVICES (the check and ``auto`` count by it)."""
        chosen = self.host_gpus.get(host)
        return {**self.job.env, "CUDA_VISIBLE_DEVICES": ",".join(chosen)} if chosen else self.job.env

    def host_nproc(self, host: str, seen: int | None = None) -> int | None:
        """A host's ranks: its ``ftb_nproc_per_node``, else the job's ``nproc_per_node``; for
        ``auto``, the GPUs its ranks will see: ``gpus_per_node`` when a number, else the count
        of its ``ftb_gpus``, else ``seen`` (what the probe found visible to the job there).
        None: ``auto`` with nothing to count yet."""
        job = self.job
        if host in self.host_nprocs:
            return self.host_nprocs[host]
        if isinstance(job.nproc_per_node, int):
            return job.nproc_per_node
        if isinstance(job.gpus_per_node, int) and job.gpus_per_node > 0:
            return job.gpus_per_node
        if host in self.host_gpus:
            return len(self.host_gpus[host])
        return seen

    @property
    def needs_gpu_counts(self) -> bool:
        """``auto`` ranks that only the hosts' own GPUs can decide, on some host."""
        return any(self.host_nproc(h.name) is None for h in self.hosts)

    @property
    def all_local(self) -> bool:
        return all(h.local for h in self.hosts)

    @property
    def docker(self) -> bool:
        return self.job.runtime.kind == "docker"


def new_run_id(job_name: str) -> str:
    """A fresh run id (the run directory's name): the job's name, the time, 4 random hex digits.
    The one impure helper here: callers make it and hand it to :func:`make_layout`."""
    return f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def make_layout(job: Job, hosts: list[Host], run_id: str) -> Layout:
    """What the job means on these hosts, before anything is known about them."""
    if not hosts:
        raise UserError("no hosts to run on", file=str(job.path), key="hosts")
    _check_distinct_addresses(hosts, job)
    all_local = all(h.local for h in hosts)

    shared_dir = _resolve_dir(job, "shared_dir", job.shared_dir or _inventory_shared_dir(hosts, job),
                              all_local, default=str(job.base_dir / ".ftbundle"))
    workdir = _resolve_dir(job, "workdir", job.workdir, all_local,
                           default=str(job.base_dir) if all_local else shared_dir)
    run_dir = rundir.RunDir.of(shared_dir, run_id).path
    master_addr = master_addr_of(hosts, job)

    clash = sorted(set(RESERVED_ENV) & set(job.env))
    if clash:
        raise UserError(f"{', '.join(clash)} is set by ftbundle for every node and cannot be overridden",
                        file=str(job.path), key=f"env.{clash[0]}")

    python = None
    if job.runtime.kind == "host":
        python = job.runtime.python
        if "/" in python and not posixpath.isabs(python):
            python = _resolve_dir(job, "runtime.python", python, all_local, default=python)
    image = _docker_image(job, hosts) if job.runtime.kind == "docker" else None

    files: dict[str, str] = {}
    checkpoint_dir = dataset_dir = None
    datasets: tuple[str, ...] = ()
    config = secrets_ = None
    if job.train.mode == "llamafactory":
        config, secrets_ = llamafactory.split_credentials(job.train.llamafactory)
        output_dir = config.get("output_dir")
        if output_dir:
            checkpoint_dir = posixpath.normpath(posixpath.join(workdir, str(output_dir)))
        dataset_dir, datasets = llamafactory.local_datasets(config, workdir)
        config = llamafactory.capped(config)
        if job.train.deepspeed_json is not None:
            files[rundir.DEEPSPEED_CONFIG] = job.train.deepspeed_json
            config = {**config, "deepspeed": posixpath.join(run_dir, rundir.DEEPSPEED_CONFIG)}
        files[rundir.LLAMAFACTORY_CONFIG] = yaml.safe_dump(config, sort_keys=False)
        files[rundir.LLAMAFACTORY_ENTRY] = runtimes.llamafactory_entry_source()
    if job.train.mode in ("llamafactory", "script"):  # (a script adds its callback itself: shims/steptimes.py)
        files[rundir.STEPTIMES] = runtimes.steptimes_source()

    host_nprocs, gpus = host_settings(job, hosts)
    return Layout(job=job, hosts=tuple(hosts), run_id=run_id, run_dir=run_dir, shared_dir=shared_dir,
                  workdir=workdir, master_addr=master_addr, python=python, image=image,
                  checkpoint_dir=checkpoint_dir, dataset_dir=dataset_dir, datasets=datasets, files=files,
                  lf_config=config, lf_secrets=secrets_ or {}, host_nprocs=host_nprocs, host_gpus=gpus)


def host_settings(job: Job, hosts: list[Host]) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """The inventory's per-host ``ftb_nproc_per_node`` and ``ftb_gpus``, validated."""
    source = str(job.inventory or job.path)
    nprocs = {h.name: n for h in hosts if (n := host_nproc(h, source)) is not None}
    gpus = {h.name: g for h in hosts if (g := host_gpus(h, source)) is not None}
    if gpus and job.gpus_per_node == 0:
        raise UserError(f"ftb_gpus is set for {', '.join(gpus)} in the inventory, and the job is a CPU job "
                        "(gpus_per_node: 0): its ranks would see no GPU either way. Remove ftb_gpus, or set "
                        "gpus_per_node to the GPUs each host's ranks use", file=str(job.path), key="gpus_per_node")
    if gpus and "CUDA_VISIBLE_DEVICES" in job.env:
        raise UserError(f"CUDA_VISIBLE_DEVICES is set for every host here, and ftb_gpus in the inventory for "
                        f"{', '.join(gpus)}: choose the GPUs in one place", file=str(job.path),
                        key="env.CUDA_VISIBLE_DEVICES")
    return nprocs, gpus


def _check_distinct_addresses(hosts: list[Host], job: Job) -> None:
    seen: dict[tuple[str, int], str] = {}
    for host in hosts:
        if host.local:
            continue
        key = (host.address, host.port)
        if key in seen:
            raise UserError(
                f"hosts {seen[key]} and {host.name} have the same address {host.address}:{host.port}; "
                "each node must be a different machine",
                file=str(job.inventory or job.path), key="ansible_host",
            )
        seen[key] = host.name


def _inventory_shared_dir(hosts: list[Host], job: Job) -> str | None:
    values = {str(h.vars["ftb_shared_dir"]) for h in hosts if h.vars.get("ftb_shared_dir")}
    if len(values) > 1:
        raise UserError(f"hosts disagree on ftb_shared_dir: {sorted(values)}",
                        file=str(job.inventory or job.path), key="ftb_shared_dir")
    return values.pop() if values else None


# Never a shared_dir: `shared_dir: /` wrote /runs/<run-id>/ at the filesystem's root
SYSTEM_DIRS = frozenset(("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run",
                         "/sbin", "/sys", "/usr", "/var"))


def _resolve_dir(job: Job, key: str, value: str | None, all_local: bool, default: str) -> str:
    if value is None:
        if key == "shared_dir" and not all_local:
            raise UserError(
                "is required when hosts are remote: the same absolute path on every host, on shared "
                "storage (site.yml mounts NFS at ftb_shared_dir)", file=str(job.path), key=key)
        return posixpath.normpath(default)
    if posixpath.isabs(value):
        value = posixpath.normpath(value)
        if key == "shared_dir" and value in SYSTEM_DIRS:
            raise UserError(f"is {value}, a system directory: run directories (runs/<run-id>/) would be written "
                            "there; give a directory of its own on the shared storage, e.g. /shared/ftbundle",
                            file=str(job.path), key=key)
        return value
    if not all_local:
        raise UserError(f"must be an absolute path when hosts are remote, got {value!r}",
                        file=str(job.path), key=key)
    return posixpath.normpath(posixpath.join(str(job.base_dir), value))


def master_addr_of(hosts: list[Host], job: Job) -> str:
    """MASTER_ADDR of a run on ``hosts``: rank 0's (it moves when rank 0's host is lost)."""
    rank0 = hosts[0]
    if all(h.local for h in hosts):
        return "127.0.0.1"
    if rank0.local and not rank0.vars.get("ftb_master_addr"):
        raise UserError(
            f"rank 0 ({rank0.name}) is this machine but other hosts are remote: set ftb_master_addr "
            "for it in the inventory to an address the other hosts can reach",
            file=str(job.inventory or job.path), key="ftb_master_addr")
    return rank0.master_addr


def _docker_image(job: Job, hosts: list[Host]) -> str | None:
    """runtime.image, else the inventory's ftb_image when it is pinned, else None: the digest
    site.yml recorded on the hosts is used (a tagged ftb_image is what site.yml resolved)."""
    if job.runtime.image:
        return job.runtime.image
    values = {str(h.vars["ftb_image"]) for h in hosts if h.vars.get("ftb_image")}
    if len(values) > 1:
        raise UserError(f"hosts disagree on ftb_image: {sorted(values)}",
                        file=str(job.inventory or job.path), key="ftb_image")
    image = values.pop() if values else None
    return image if image and PINNED_IMAGE_RE.search(image) else None


# A run's claims on its hosts (remote/claims.py: a second run on the same port or GPUs is refused
# by its check): one directory on each host's own disk, one file per claimed thing.
CLAIM_DIR = "/tmp/ftbundle-claims"
CLAIM_GRACE_S = 60  # a claim holds this long before its run's job starts (the check, then the start)


def claim_keys(layout: Layout, rank: int) -> list[str]:
    """What host ``rank`` of a run claims: the master port on rank 0's host; the GPUs a GPU job
    uses on every host (``gpu-I`` for each of its ``ftb_gpus``, else ``gpus``: all of them). A
    CPU job (gpus_per_node: 0) claims only the port. This machine (a local host) claims nothing:
    tests and the demo run side by side here on ports of their own. Pure."""
    host = layout.hosts[rank]
    if host.local:
        return []
    keys = [f"port-{layout.master_port}"] if rank == 0 else []
    if layout.job.gpus_per_node != 0:
        chosen = layout.host_gpus.get(host.name)
        keys += [f"gpu-{g}" for g in chosen] if chosen else ["gpus"]
    return keys


