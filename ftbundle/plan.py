"""What runs where: (job, hosts) -> :class:`Layout` -> (with the hosts' facts) -> :class:`Plan`.

Pure functions, no I/O. Data flows one way: the layout is everything the job file and the
inventory decide; the probe (ftbundle/check) is asked about the layout; the plan is built
once from the layout and the facts (``auto`` ranks, the docker runtime's GPUs and recorded
image, bf16, whether output_dir is shared). Everything that touches a network, a process
or a file consumes the plan; ``--dry-run`` prints it and the run directory keeps a redacted
copy (plan.json).
"""

from __future__ import annotations

import dataclasses
import functools
import posixpath
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from . import deepspeed, llamafactory, runtimes
from .errors import UserError
from .inventory import Host, host_gpus, host_nproc
from .job import MIN_SECRET_LEN, PINNED_IMAGE_RE, Job, check_pinned_image, is_secret

if TYPE_CHECKING:
    from .check.facts import ClusterFacts

IMAGE_REF_FILE = "/etc/ftbundle/image.ref"  # written by site.yml (roles/training_image)

# Set by ftbundle on every node; a job's `env:` may not override them.
RESERVED_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE",
                "FTB_RUN_ID", "FTB_RUN_DIR", "FTB_ATTEMPT", "FTB_EXCLUDED_HOSTS")
REDACTED = "<redacted>"


@dataclass(frozen=True)
class NodePlan:
    """One node's launch. Its command line is ``wrapper + torchrun + program``: the docker
    runtime's `docker run ... IMAGE` (or nothing), torchrun (or nothing for a per-node
    command), then what trains. ``env`` is hidden from repr: it holds secrets."""

    rank: int
    host: Host
    program: tuple[str, ...]
    env: dict[str, str] = field(repr=False)  # exported on the node before argv runs (after the env file)
    workdir: str
    log_path: str
    env_file: str | None  # sourced if present (host runtime); --env-file (docker)
    wrapper: tuple[str, ...] = ()
    torchrun: tuple[str, ...] = ()
    per_node: bool = False  # a `command:` job: the program runs once per node, not under torchrun
    path_prepend: str | None = None  # the host interpreter's bin/ goes first on PATH
    container: str | None = None  # docker runtime: the container to remove on stop
    stream: bool = False  # rank 0: its output goes to the controller's terminal
    nproc: int = 1  # this node's ranks (torchrun's --nproc-per-node; NPROC_PER_NODE of a `command:`)
    first_rank: int = 0  # the global rank of its local rank 0: ranks are contiguous per node, in node order

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.wrapper, *(() if self.per_node else self.torchrun), *self.program)

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
    nodes: tuple[NodePlan, ...]
    files: dict[str, str] = field(default_factory=dict)  # staged into run_dir before launch
    warnings: tuple[str, ...] = ()  # the seeds' traps, shown before launch
    notes: tuple[str, ...] = ()  # facts worth seeing before launch (effective batch size)
    checkpoint_dir: str | None = None  # LlamaFactory's output_dir, absolute: where resumes come from
    image: str | None = None  # docker runtime: the pinned image every node runs
    effective_batch: int | None = None  # samples per optimizer step (LlamaFactory jobs), for samples/s
    finetuning_type: str | None = None  # LlamaFactory's (lora, full, ...): whether an adapter is the result
    # LlamaFactory resumes from output_dir's newest checkpoint-N by itself (overwrite_output_dir
    # false, no resume_from_checkpoint): ftbundle says so before launch, or refuses a finished one
    resumes: bool = False
    stall_timeout: int = 0  # seconds without progress before the run is diagnosed and stopped; 0: never
    straggler_factor: float = 1.15  # a node's median step time above this x the fleet's: named (ui.stragglers)

    @property
    def nprocs(self) -> tuple[int, ...]:
        """Each node's ranks, in node rank order (hosts may differ: an 8-GPU beside a 4-GPU)."""
        return tuple(n.nproc for n in self.nodes)

    @property
    def uniform(self) -> bool:
        return len(set(self.nprocs)) <= 1

    @property
    def nproc_per_node(self) -> int:
        """The ranks per node when every node runs as many; else the most any node runs
        (an upper bound: read :attr:`nprocs` for each node's own)."""
        return max(self.nprocs, default=0)

    @property
    def world_size(self) -> int:
        return sum(self.nprocs)

    @property
    def shape(self) -> str:
        """`2 node(s) x 4 rank(s)`, or for uneven nodes `2 node(s) with 8+4 rank(s)`."""
        return shape_text(self.nprocs)

    @property
    def all_local(self) -> bool:
        return all(n.host.local for n in self.nodes)

    def with_program(self, program: tuple[str, ...]) -> Plan:
        """The same plan (hosts, ranks, interpreter or image, environment) running another
        program under torchrun: how ``check --net`` runs its all-reduce bench."""
        return dataclasses.replace(self, files={}, warnings=(), notes=(), nodes=tuple(
            dataclasses.replace(n, program=program, per_node=False) for n in self.nodes))

    @functools.cached_property
    def secret_values(self) -> list[str]:
        """Values of secret variables, longest first (long enough to mask safely)."""
        return sorted({v for n in self.nodes for k, v in n.env.items() if is_secret(k) and len(v) >= MIN_SECRET_LEN},
                      key=len, reverse=True)

    def redact(self, text: str) -> str:
        for value in self.secret_values:
            text = text.replace(value, REDACTED)
        return text

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """The plan as data, secrets redacted: what plan.json and --dry-run show. A secret's
        value is masked wherever it appears, a command line included."""
        def env(values: dict[str, str]) -> dict[str, str]:
            return {k: (REDACTED if redact and is_secret(k) else v) for k, v in values.items()}

        def argv(values) -> list[str]:
            return [self.redact(a) for a in values] if redact else list(values)

        return {
            "job": self.job_name,
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "shared_dir": self.shared_dir,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,  # uneven nodes: the most; "nprocs" has each one's
            "nprocs": list(self.nprocs),
            "world_size": self.world_size,
            "checkpoint_dir": self.checkpoint_dir,
            "image": self.image,
            "stall_timeout": self.stall_timeout,
            "straggler_factor": self.straggler_factor,  # (a detached run's stragglers: runs.py, history.py)
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "nodes": [
                {
                    "rank": n.rank,
                    "host": n.host.name,
                    "nproc": n.nproc,
                    "ranks": [n.first_rank, n.first_rank + n.nproc - 1],
                    "address": n.host.address,
                    "port": n.host.port,
                    "user": n.host.user,
                    "local": n.host.local,
                    "workdir": n.workdir,
                    "argv": argv(n.argv),
                    "env": env(n.env),
                    "env_file": n.env_file,
                    "path_prepend": n.path_prepend,
                    "container": n.container,
                    "per_node": n.per_node,
                    "log": n.log_path,
                    "stop_argv": list(n.stop_argv) if n.stop_argv else None,
                }
                for n in self.nodes
            ],
        }


def shape_text(nprocs: tuple[int, ...] | list[int], unit: str = "node(s)") -> str:
    """How many nodes and ranks: `2 node(s) x 4 rank(s)`, or `2 node(s) with 8+4 rank(s)`."""
    if len(set(nprocs)) <= 1:
        return f"{len(nprocs)} {unit} x {nprocs[0] if nprocs else 0} rank(s)"
    return f"{len(nprocs)} {unit} with {'+'.join(map(str, nprocs))} rank(s)"


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
ATTEMPTS_FILE = "attempts.json"  # beside it: each attempt's hosts and why they changed (ftbundle.launch.attempts)


RECOVERY_PARTS = ("detection", "teardown", "preflight", "fence_wait", "start", "resume")  # (launch.attempts.recovery)


def attempts_said(records: list | None) -> list[str]:
    """The lines an attempts record says: for each attempt after a loss, where it ran and why
    ("attempt 2 on node[0-1]: node2 lost (...); global batch 12 kept: ..."), and when it
    trained again (its "recovery", once known: :func:`recovery_said`). Pure."""
    lines = []
    for r in records or []:
        if isinstance(r, dict) and r.get("why"):
            lines.append(str(r["why"]))
            said = recovery_said(r.get("attempt"), r.get("recovery"))
            if said:
                lines.append("  " + said)
    return lines


def recovery_said(attempt: int, parts: dict | None) -> str | None:
    """"attempt 2 trained again 38 s after the loss: detection 6 s, teardown 2 s, ..."; None
    when its first step was never seen (a command job, or it failed before)."""
    number = (int, float)
    if not isinstance(parts, dict) or not isinstance(parts.get("total"), number):
        return None
    said = ", ".join(f"{name.replace('_', ' ')} {parts[name]:.0f} s" for name in RECOVERY_PARTS
                     if isinstance(parts.get(name), number))
    return f"attempt {attempt} trained again {parts['total']:.0f} s after the failure: {said}"


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

    @property
    def master_port(self) -> int:
        return self.job.master_port

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
    run_dir = posixpath.join(shared_dir, "runs", run_id)
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
            files[runtimes.DEEPSPEED_CONFIG] = job.train.deepspeed_json
            config = {**config, "deepspeed": posixpath.join(run_dir, runtimes.DEEPSPEED_CONFIG)}
        files[runtimes.LLAMAFACTORY_CONFIG] = yaml.safe_dump(config, sort_keys=False)
        files[runtimes.LLAMAFACTORY_ENTRY] = runtimes.llamafactory_entry_source()
    if job.train.mode in ("llamafactory", "script"):  # (a script adds its callback itself: shims/steptimes.py)
        files[runtimes.STEPTIMES] = runtimes.steptimes_source()

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
    if gpus and "CUDA_VISIBLE_DEVICES" in job.env:
        raise UserError(f"CUDA_VISIBLE_DEVICES is set for every host here, and ftb_gpus in the inventory for "
                        f"{', '.join(gpus)}: choose the GPUs in one place", file=str(job.path),
                        key="env.CUDA_VISIBLE_DEVICES")
    return nprocs, gpus


def make_plan(layout: Layout, facts: ClusterFacts | None = None) -> Plan:
    """Decide every node's command line and environment, from the layout and (when the
    hosts were asked) their facts: ``nproc_per_node: auto`` from the GPUs the job will see,
    the docker runtime's GPUs, InfiniBand devices and recorded image, bf16, and whether
    output_dir is really on shared storage."""
    job = layout.job
    wanted = job.gpus_per_node if isinstance(job.gpus_per_node, int) else None  # None: auto
    nprocs = _nprocs(layout, facts)
    image = layout.image or (_recorded_image(layout, facts) if layout.docker else None)
    gpus = _docker_gpus(layout, facts, nprocs, wanted) if layout.docker else {}
    devices = _host_devices(layout, facts, wanted)
    counts = [nprocs[h.name] for h in layout.hosts]
    infiniband = layout.docker and facts is not None and facts.infiniband

    warnings: list[str] = []
    notes: list[str] = []
    effective_batch = finetuning_type = None
    resumes = False
    if layout.lf_config is not None:
        shared = facts.storage_shared("output_dir") if facts is not None else None
        prepared = llamafactory.prepare(
            job.train.llamafactory, workdir=layout.workdir, shared_dir=layout.shared_dir,
            nprocs=counts, bf16_capable=facts.bf16 if facts else None,
            output_shared=shared)
        warnings += prepared.warnings
        if job.train.deepspeed_json is not None:
            warnings += deepspeed.advice(job.train.deepspeed_json, nnodes=len(layout.hosts),
                                         infiniband=_infiniband(layout, facts))
        effective_batch = prepared.effective_batch
        finetuning_type = str(prepared.config.get("finetuning_type") or "lora")
        resumes = (layout.checkpoint_dir is not None and not prepared.config.get("overwrite_output_dir")
                   and not prepared.config.get("resume_from_checkpoint"))
        notes.append(llamafactory.effective_batch_line(prepared.config, counts, prepared.effective_batch))

    lf_env = llamafactory.credential_env(layout.lf_secrets)
    nccl = _uses_nccl(job, facts, any(gpus.values()))
    nodes = []
    first_rank = 0
    for rank, host in enumerate(layout.hosts):
        nproc = nprocs[host.name]
        env = {
            "NNODES": str(len(layout.hosts)),
            "NODE_RANK": str(rank),
            "MASTER_ADDR": layout.master_addr,
            "MASTER_PORT": str(job.master_port),
            "NPROC_PER_NODE": str(nproc),
            "FTB_RUN_ID": layout.run_id,
            "FTB_RUN_DIR": layout.run_dir,
            "PYTHONUNBUFFERED": "1",
            **(nccl_debug_env(layout.run_dir, _torch_version(facts)) if nccl else {}),
            **({"FTB_EXCLUDED_HOSTS": ",".join(layout.excluded)} if layout.excluded else {}),
            **lf_env,
            **({"CUDA_VISIBLE_DEVICES": devices[host.name]} if host.name in devices else {}),
            **job.env,
        }
        torchrun = tuple(runtimes.torchrun_argv(
            layout.python or "python3", nnodes=len(layout.hosts), nproc_per_node=nproc, node_rank=rank,
            master_addr=layout.master_addr, master_port=job.master_port,
            log_dir=posixpath.join(layout.run_dir, runtimes.RANKS_DIR, f"node-{rank}"),
        ))
        program = tuple(runtimes.program_argv(job.train.mode, run_dir=layout.run_dir, script=job.train.script,
                                              args=job.train.args, command=job.train.command))
        container = None
        path_prepend = None
        wrapper: tuple[str, ...] = ()
        if layout.docker:
            container = runtimes.container_name(layout.run_id, rank)
            wrapper = tuple(runtimes.docker_prefix(
                image=image, name=container, shared_dir=layout.shared_dir, workdir=layout.workdir,
                env_names=list(env), env_file=job.runtime.env_file, gpus=gpus.get(host.name), infiniband=infiniband,
                extra=job.runtime.docker_args, steps=runtimes.steps_dir(layout.run_id, rank),
            ))
        elif layout.python and "/" in layout.python:
            path_prepend = posixpath.dirname(layout.python)
        nodes.append(NodePlan(
            rank=rank, host=host, wrapper=wrapper, torchrun=torchrun, per_node=job.train.mode == "command",
            program=program, env=env, workdir=layout.workdir,
            log_path=posixpath.join(layout.run_dir, node_log_name(rank, host.name)),
            env_file=job.runtime.env_file, path_prepend=path_prepend, container=container,
            stream=(rank == 0), nproc=nproc, first_rank=first_rank,
        ))
        first_rank += nproc

    return Plan(
        job_name=job.name, run_id=layout.run_id, run_dir=layout.run_dir, shared_dir=layout.shared_dir,
        master_addr=layout.master_addr, master_port=job.master_port, nnodes=len(layout.hosts),
        nodes=tuple(nodes), files=dict(layout.files), warnings=tuple(warnings),
        notes=tuple(notes), checkpoint_dir=layout.checkpoint_dir, image=image, effective_batch=effective_batch,
        finetuning_type=finetuning_type, resumes=resumes,
        stall_timeout=job.stall_timeout, straggler_factor=job.straggler_factor,
    )


NCCL_TRACE_PREFIX = "nccl-trace-rank-"  # in the run directory; torch appends the global rank


# The flight recorder's size, under the name the ranks' torch reads: TORCH_FR_BUFFER_SIZE
# (the old name still works but warns on every rank: torch 2.11 on the first H100 run; 2.13
# and 2.14 here read the new one first). The rename came with the recorder made
# vendor-neutral (pytorch PR 152563, May 2025), so from torch 2.8 on; that boundary is
# inferred from the PR's date, not read from a 2.8 build.
FR_BUFFER_RENAMED_IN = (2, 8)


def nccl_debug_env(run_dir: str, torch_version: str | None = None) -> dict[str, str]:
    """What torch offers for a hung NCCL collective, turned on (a job's own `env:` wins):
    a timed-out collective aborts its communicator and ends the rank (so the launcher sees an
    exit instead of a hang), the flight recorder keeps the last collectives of every rank and
    dumps them into the run directory on a timeout, and desync debugging names the rank the
    others waited for. ``torch_version``: the ranks' torch, as the check read it (None: not
    asked, taken to be a current one)."""
    numbers = re.match(r"(\d+)\.(\d+)", torch_version or "")
    old = numbers is not None and (int(numbers[1]), int(numbers[2])) < FR_BUFFER_RENAMED_IN
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        ("TORCH_NCCL_TRACE_BUFFER_SIZE" if old else "TORCH_FR_BUFFER_SIZE"): "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": posixpath.join(run_dir, NCCL_TRACE_PREFIX),
        "TORCH_NCCL_DESYNC_DEBUG": "1",
    }


def _torch_version(facts: ClusterFacts | None) -> str | None:
    """The torch every reached host's ranks run (one version: the check refuses a mix)."""
    found = {(f.versions or {}).get("torch") for f in facts.reached} if facts is not None else set()
    found.discard(None)
    found.discard("absent")
    return found.pop() if len(found) == 1 else None


def _uses_nccl(job: Job, facts: ClusterFacts | None, gpus: bool) -> bool:
    """NCCL will carry the collectives: the docker runtime is given GPUs, the hosts asked
    have GPUs, or the job sets NCCL variables itself."""
    if gpus:
        return True
    if facts is not None and any(f.gpus for f in facts.reached):
        return True
    return any(name.startswith("NCCL_") for name in job.env)


def _nprocs(layout: Layout, facts: ClusterFacts | None) -> dict[str, int]:
    """Each host's ranks (:meth:`Layout.host_nproc`). ``auto`` counts the GPUs each host's
    ranks will see (its ftb_gpus, else the job's CUDA_VISIBLE_DEVICES, else the host's): hosts
    may differ (an 8-GPU server beside a 4-GPU one), but each must have one."""
    job = layout.job
    seen = {f.host: len(f.visible_gpus(layout.visible_env(f.host))) for f in facts.reached} if facts else {}
    out = {h.name: layout.host_nproc(h.name, seen.get(h.name) or None) for h in layout.hosts}
    unknown = [name for name, n in out.items() if n is None]
    if unknown and facts is None:
        raise UserError("nproc_per_node: auto needs the hosts' GPU counts (run without --no-check, set a number, "
                        f"or set ftb_nproc_per_node in the inventory for {', '.join(unknown)})",
                        file=str(job.path), key="nproc_per_node")
    if unknown:
        shown = "; ".join(f"{seen[h]} GPU(s) on {h}" if h in seen else f"{h} did not answer" for h in unknown)
        raise UserError(f"is auto, but no GPU is visible to the job on some hosts: {shown}; set "
                        "ftb_nproc_per_node for them in the inventory (CPU ranks), or a number here",
                        file=str(job.path), key="nproc_per_node")
    return out  # type: ignore[return-value]


def _host_devices(layout: Layout, facts: ClusterFacts | None, wanted: int | None) -> dict[str, str]:
    """The host runtime: CUDA_VISIBLE_DEVICES per host, as a scheduler would give the job:
    the host's ``ftb_gpus``; with a whole ``gpus_per_node``, none for 0 (a CPU job), the
    first N the job would see when a host has more. Not when the job's env sets it. {}
    when there is nothing to narrow."""
    job = layout.job
    if layout.docker or "CUDA_VISIBLE_DEVICES" in job.env:
        return {}
    if wanted == 0:
        return {h.name: "" for h in layout.hosts}
    out = {name: ",".join(chosen[:wanted] if wanted else chosen) for name, chosen in layout.host_gpus.items()}
    if wanted is None:
        return out
    for f in facts.reached if facts is not None else []:
        seen = f.visible_gpus(job.env)
        if f.host not in out and len(seen) > wanted:  # (fewer: the check refuses it)
            out[f.host] = ",".join(g.index or str(f.gpus.index(g)) for g in seen[:wanted])
    return out


def _docker_gpus(layout: Layout, facts: ClusterFacts | None, nprocs: dict[str, int],
                 wanted: int | None) -> dict[str, str | None]:
    """`docker run --gpus` per host: the host's ``ftb_gpus`` as a device list; else the job's
    ``runtime.gpus``; else, when the hosts were asked and the job is not a CPU job, all of a
    host's GPUs, or the devices its ranks will use when they use fewer (the job's
    CUDA_VISIBLE_DEVICES first)."""
    job = layout.job
    by_host = {f.host: f for f in facts.reached} if facts is not None else {}
    out: dict[str, str | None] = {}
    for host in layout.hosts:
        chosen = layout.host_gpus.get(host.name)
        f = by_host.get(host.name)
        if chosen is not None and wanted != 0:
            out[host.name] = f'"device={",".join(chosen[:wanted] if wanted else chosen)}"'
        elif job.runtime.gpus is not None:
            out[host.name] = job.runtime.gpus
        elif wanted == 0 or f is None or not f.gpus:
            out[host.name] = None
        else:
            used = f.visible_gpus(job.env)[:wanted or nprocs[host.name]]
            out[host.name] = "all" if len(used) == len(f.gpus) else \
                '"device=' + ",".join(g.index or str(f.gpus.index(g)) for g in used) + '"'
    return out


def _recorded_image(layout: Layout, facts: ClusterFacts | None) -> str:
    """The docker runtime without an image in the job or inventory: the reference site.yml
    recorded on every host (/etc/ftbundle/image.ref), the same everywhere and pinned."""
    job = layout.job
    where = dict(file=str(job.path), key="runtime.image")
    if facts is None:
        raise UserError("runtime 'docker' has no image: set runtime.image (repo@sha256:...), pin ftb_image in "
                        "the inventory, or let ftbundle read the digest site.yml recorded on the hosts "
                        f"({IMAGE_REF_FILE}; not with --no-check)", **where)
    refs = {f.host: f.image_ref for f in facts.reached}
    values = set(refs.values())
    if None in values or not values:
        missing = ", ".join(h for h, r in refs.items() if r is None) or "every host"
        raise UserError(f"runtime 'docker' has no image and site.yml recorded none on {missing} ({IMAGE_REF_FILE}); "
                        "run site.yml, or set runtime.image to repo@sha256:...", **where)
    if len(values) > 1:
        shown = "; ".join(f"{r} on {h}" for h, r in refs.items())
        raise UserError(f"the hosts recorded different images in {IMAGE_REF_FILE}: {shown}; rerun site.yml",
                        **where)
    image = values.pop()
    check_pinned_image(image, lambda msg: UserError(f"{IMAGE_REF_FILE} on the hosts: {msg}", **where))
    return image


def _infiniband(layout: Layout, facts: ClusterFacts | None) -> bool:
    """Whether NCCL will use InfiniBand: not when the job or every host's nccl_env role says
    NCCL_IB_DISABLE=1; else what the hosts have (/dev/infiniband on every one), when they
    were asked; else only when the job or the inventory says NCCL_IB_DISABLE=0."""
    job, hosts = layout.job, layout.hosts
    said = job.env.get("NCCL_IB_DISABLE")
    if said is None and hosts and all(h.vars.get("nccl_env_ib_disable") is not None for h in hosts):
        values = {str(h.vars["nccl_env_ib_disable"]) for h in hosts}
        said = values.pop() if len(values) == 1 and values <= {"0", "1"} else None
    if said == "1":
        return False
    if facts is not None:
        return facts.infiniband
    return said == "0"


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
