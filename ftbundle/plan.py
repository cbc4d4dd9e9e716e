"""(job, hosts) -> Plan: what runs where. A pure function; no I/O.

Everything that touches a network, a process or a file consumes a :class:`Plan`;
``--dry-run`` prints it and the run directory keeps a redacted copy (plan.json).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

import yaml

from . import llamafactory, runtimes
from .errors import UserError
from .inventory import Host
from .job import Job, check_pinned_image, is_secret

# Set by ftbundle on every node; a job's `env:` may not override them.
RESERVED_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE",
                "FTB_RUN_ID", "FTB_RUN_DIR")
REDACTED = "<redacted>"


@dataclass(frozen=True)
class NodePlan:
    rank: int
    host: Host
    argv: tuple[str, ...]
    env: dict[str, str]  # exported on the node before argv runs (after the env file)
    workdir: str
    log_path: str
    env_file: str | None  # sourced if present (host runtime); --env-file (docker)
    path_prepend: str | None = None  # the host interpreter's bin/ goes first on PATH
    container: str | None = None  # docker runtime: the container to remove on stop
    stream: bool = False  # rank 0: its output goes to the controller's terminal

    @property
    def stop_argv(self) -> tuple[str, ...] | None:
        return tuple(runtimes.docker_stop_argv(self.container)) if self.container else None

    @property
    def label(self) -> str:
        return f"{self.host.name}/rank{self.rank}"


@dataclass(frozen=True)
class Plan:
    job_name: str
    run_id: str
    run_dir: str
    shared_dir: str
    master_addr: str
    master_port: int
    nnodes: int
    nproc_per_node: int
    nodes: tuple[NodePlan, ...]
    files: dict[str, str] = field(default_factory=dict)  # staged into run_dir before launch
    warnings: tuple[str, ...] = ()  # the seeds' traps, shown before launch
    notes: tuple[str, ...] = ()  # facts worth seeing before launch (effective batch size)
    checkpoint_dir: str | None = None  # LlamaFactory's output_dir, absolute: where resumes come from
    effective_batch: int | None = None  # samples per optimizer step (LlamaFactory jobs), for samples/s
    finetuning_type: str | None = None  # LlamaFactory's (lora, full, ...): whether an adapter is the result

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def all_local(self) -> bool:
        return all(n.host.local for n in self.nodes)

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """The plan as data, secrets redacted: what plan.json and --dry-run show."""
        def env(values: dict[str, str]) -> dict[str, str]:
            return {k: (REDACTED if redact and is_secret(k) else v) for k, v in values.items()}

        return {
            "job": self.job_name,
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "shared_dir": self.shared_dir,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "checkpoint_dir": self.checkpoint_dir,
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "nodes": [
                {
                    "rank": n.rank,
                    "host": n.host.name,
                    "address": n.host.address,
                    "port": n.host.port,
                    "user": n.host.user,
                    "local": n.host.local,
                    "workdir": n.workdir,
                    "argv": list(n.argv),
                    "env": env(n.env),
                    "env_file": n.env_file,
                    "path_prepend": n.path_prepend,
                    "container": n.container,
                    "log": n.log_path,
                    "stop_argv": list(n.stop_argv) if n.stop_argv else None,
                }
                for n in self.nodes
            ],
        }


def node_log_name(rank: int, host: str, attempt: int = 1) -> str:
    """A node's log in the run directory; each attempt (restart) writes a log of its own."""
    return f"node-{rank}-{host}.a{attempt}.log"


@dataclass(frozen=True)
class NodeFiles:
    """One node's files of one attempt, in the run directory on shared storage."""

    log: str
    pid: str  # "PID MARKER HOSTNAME" of the job
    exit: str  # the job's exit code, once it ended
    hb: str  # a detached node's heartbeat counter
    marker: str  # FTB_JOB of every process of the job: how stop finds them all

    @classmethod
    def of(cls, run_dir: str, run_id: str, rank: int, host: str, attempt: int) -> NodeFiles:
        base = posixpath.join(run_dir, f"node-{rank}.a{attempt}")
        return cls(log=posixpath.join(run_dir, node_log_name(rank, host, attempt)), pid=base + ".pid",
                   exit=base + ".exit", hb=base + ".hb", marker=f"{run_id}.a{attempt}-{rank}")


ATTEMPT_FILE = "attempt"  # in the run directory: the number of the attempt now running


def make_plan(job: Job, hosts: list[Host], run_id: str, *,
              nproc_per_node: int | None = None, bf16_capable: bool | None = None) -> Plan:
    """Decide every node's command line and environment.

    ``hosts`` are in rank order. ``nproc_per_node`` is the resolved value when the job
    says ``auto`` (the caller asks the hosts for their GPU count first); ``bf16_capable``
    is what the hosts' GPUs support, when known.
    """
    if not hosts:
        raise UserError("no hosts to run on", file=str(job.path), key="hosts")
    _check_distinct_addresses(hosts, job)
    all_local = all(h.local for h in hosts)

    nproc = job.nproc_per_node
    if nproc == "auto":
        if nproc_per_node is None:
            raise UserError("nproc_per_node: auto needs the hosts' GPU counts (run without --dry-run, "
                            "or set a number)", file=str(job.path), key="nproc_per_node")
        nproc = nproc_per_node
    assert isinstance(nproc, int)

    shared_dir = _resolve_dir(job, "shared_dir", job.shared_dir or _inventory_shared_dir(hosts, job),
                              all_local, default=str(job.base_dir / ".ftbundle"))
    workdir = _resolve_dir(job, "workdir", job.workdir, all_local,
                           default=str(job.base_dir) if all_local else shared_dir)
    run_dir = posixpath.join(shared_dir, "runs", run_id)
    master_addr = _master_addr(hosts, job)

    clash = sorted(set(RESERVED_ENV) & set(job.env))
    if clash:
        raise UserError(f"{', '.join(clash)} is set by ftbundle for every node and cannot be overridden",
                        file=str(job.path), key=f"env.{clash[0]}")

    python = job.runtime.python
    if job.runtime.kind == "host" and "/" in python and not posixpath.isabs(python):
        python = _resolve_dir(job, "runtime.python", python, all_local, default=python)

    image = None
    if job.runtime.kind == "docker":
        image = _docker_image(job, hosts)

    files: dict[str, str] = {}
    warnings: list[str] = []
    notes: list[str] = []
    checkpoint_dir = None
    effective_batch = None
    finetuning_type = None
    if job.train.mode == "llamafactory":
        output_dir = job.train.llamafactory.get("output_dir")
        if output_dir:
            checkpoint_dir = posixpath.normpath(posixpath.join(workdir, str(output_dir)))
        prepared = llamafactory.prepare(job.train.llamafactory, workdir=workdir, shared_dir=shared_dir,
                                        nnodes=len(hosts), nproc_per_node=nproc, bf16_capable=bf16_capable)
        config = prepared.config
        if job.train.deepspeed_json is not None:
            files[runtimes.DEEPSPEED_CONFIG] = job.train.deepspeed_json
            config = {**config, "deepspeed": posixpath.join(run_dir, runtimes.DEEPSPEED_CONFIG)}
        files[runtimes.LLAMAFACTORY_CONFIG] = yaml.safe_dump(config, sort_keys=False)
        files[runtimes.LLAMAFACTORY_ENTRY] = runtimes.llamafactory_entry_source()
        warnings += prepared.warnings
        effective_batch = prepared.effective_batch
        finetuning_type = str(prepared.config.get("finetuning_type") or "lora")
        notes.append(llamafactory.effective_batch_line(prepared.config, len(hosts), nproc,
                                                       prepared.effective_batch))

    nodes = []
    for rank, host in enumerate(hosts):
        env = {
            "NNODES": str(len(hosts)),
            "NODE_RANK": str(rank),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(job.master_port),
            "NPROC_PER_NODE": str(nproc),
            "FTB_RUN_ID": run_id,
            "FTB_RUN_DIR": run_dir,
            "PYTHONUNBUFFERED": "1",
            **job.env,
        }
        torchrun = runtimes.torchrun_argv(
            python, nnodes=len(hosts), nproc_per_node=nproc, node_rank=rank,
            master_addr=master_addr, master_port=job.master_port,
            log_dir=posixpath.join(run_dir, runtimes.RANKS_DIR, f"node-{rank}"),
        )
        argv = runtimes.train_argv(job.train.mode, torchrun, run_dir=run_dir, script=job.train.script,
                                   args=job.train.args, command=job.train.command)
        container = None
        path_prepend = None
        if job.runtime.kind == "docker":
            container = runtimes.container_name(run_id, rank)
            argv = runtimes.docker_argv(
                argv, image=image, name=container, shared_dir=shared_dir, workdir=workdir,
                env_names=list(env), env_file=job.runtime.env_file, gpus=job.runtime.gpus,
                extra=job.runtime.docker_args,
            )
        elif "/" in python:
            path_prepend = posixpath.dirname(python)
        nodes.append(NodePlan(
            rank=rank, host=host, argv=tuple(argv), env=env, workdir=workdir,
            log_path=posixpath.join(run_dir, node_log_name(rank, host.name)),
            env_file=job.runtime.env_file, path_prepend=path_prepend, container=container,
            stream=(rank == 0),
        ))

    return Plan(
        job_name=job.name, run_id=run_id, run_dir=run_dir, shared_dir=shared_dir,
        master_addr=master_addr, master_port=job.master_port, nnodes=len(hosts),
        nproc_per_node=nproc, nodes=tuple(nodes), files=files, warnings=tuple(warnings),
        notes=tuple(notes), checkpoint_dir=checkpoint_dir, effective_batch=effective_batch,
        finetuning_type=finetuning_type,
    )


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


def _resolve_dir(job: Job, key: str, value: str | None, all_local: bool, default: str) -> str:
    if value is None:
        if key == "shared_dir" and not all_local:
            raise UserError(
                "is required when hosts are remote: the same absolute path on every host, on shared "
                "storage (site.yml mounts NFS at ftb_shared_dir)", file=str(job.path), key=key)
        return posixpath.normpath(default)
    if posixpath.isabs(value):
        return posixpath.normpath(value)
    if not all_local:
        raise UserError(f"must be an absolute path when hosts are remote, got {value!r}",
                        file=str(job.path), key=key)
    return posixpath.normpath(posixpath.join(str(job.base_dir), value))


def _master_addr(hosts: list[Host], job: Job) -> str:
    rank0 = hosts[0]
    if all(h.local for h in hosts):
        return "127.0.0.1"
    if rank0.local and not rank0.vars.get("ftb_master_addr"):
        raise UserError(
            f"rank 0 ({rank0.name}) is this machine but other hosts are remote: set ftb_master_addr "
            "for it in the inventory to an address the other hosts can reach",
            file=str(job.inventory or job.path), key="ftb_master_addr")
    return rank0.master_addr


def _docker_image(job: Job, hosts: list[Host]) -> str:
    if job.runtime.image:
        return job.runtime.image
    values = {str(h.vars["ftb_image"]) for h in hosts if h.vars.get("ftb_image")}
    if not values:
        raise UserError("runtime 'docker' needs an image: set runtime.image, or ftb_image in the "
                        "inventory (site.yml pins it by digest)", file=str(job.path), key="runtime.image")
    if len(values) > 1:
        raise UserError(f"hosts disagree on ftb_image: {sorted(values)}",
                        file=str(job.inventory or job.path), key="ftb_image")
    image = values.pop()
    check_pinned_image(image, lambda msg: UserError(msg, file=str(job.inventory or job.path), key="ftb_image"))
    return image
