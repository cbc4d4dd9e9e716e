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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any


from . import deepspeed, gpu_metrics, llamafactory, runtimes, tokenized, trackers
from .errors import UserError
from .layout import Layout
from .notify import Notify
from .speed import SpeedBasis, basis_of, token_setting
from .rundir import LLAMAFACTORY_CONFIG, NCCL_TRACE_PREFIX, NodeFiles, RunDir, node_log_name
from .inventory import Host
from .units import release
from .paths import is_under
from .job import MIN_SECRET_LEN, Job, check_pinned_image, is_secret, url_passwords

if TYPE_CHECKING:
    from .facts import ClusterFacts

IMAGE_REF_FILE = "/etc/ftbundle/image.ref"  # written by site.yml (roles/training_image)

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
    # output_dir on storage every host shares (the check's probe, else: under shared_dir): `status`
    # reads its checkpoints through another host when rank 0's is down; None: no output_dir
    checkpoint_shared: bool | None = None
    stall_timeout: int = 0  # seconds without progress before the run is diagnosed and stopped; 0: never
    straggler_factor: float = 1.15  # a node's median step time above this x the fleet's: named (ui.stragglers)
    speed: SpeedBasis | None = None  # what tokens/s per rank and MFU are counted against (ftbundle.speed)
    trackers: tuple[str, ...] = ()  # where the run's experiment trackers are (ftbundle.trackers)
    notify: Notify | None = field(default=None, repr=False)  # told when the run ends (ftbundle.notify)
    staged: tuple[dict, ...] = ()  # what `stage:` copied and where it was cached (ftbundle.stage)
    gpu_sample_s: float = 0.0  # a GPU job's nodes read their GPUs this often (ftbundle.gpu_metrics); 0: not

    @property
    def rundir(self) -> RunDir:
        """Every name under run_dir (:mod:`ftbundle.rundir`)."""
        return RunDir(self.run_dir, self.run_id)

    def lf_config(self) -> dict | None:
        """The LlamaFactory config the ranks read, as staged; None for other jobs."""
        text = self.files.get(LLAMAFACTORY_CONFIG)
        if not text:
            return None
        import yaml

        found = yaml.safe_load(text)
        return found if isinstance(found, dict) else None

    def node_files(self, node: NodePlan, attempt: int) -> NodeFiles:
        """One node's files of one attempt in the run directory."""
        return self.rundir.node(node.rank, node.host.name, attempt)

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
        """Values of secret variables and the passwords in URL values, longest first (long enough
        to mask safely)."""
        return sorted({v for n in self.nodes for k, v in n.env.items() if is_secret(k) and len(v) >= MIN_SECRET_LEN}
                      | {v for n in self.nodes for v in url_passwords(n.env)}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for value in self.secret_values:
            text = text.replace(value, REDACTED)
        return text

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """The plan as data, secrets redacted: what plan.json and --dry-run show. A secret's
        value is masked wherever it appears, a command line included."""
        def env(values: dict[str, str]) -> dict[str, str]:
            return {k: (REDACTED if is_secret(k) else self.redact(v)) if redact else v for k, v in values.items()}

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
            "resumes": self.resumes,  # (`status`: what a failure now would resume from)
            "checkpoint_shared": self.checkpoint_shared,  # (`status` with rank 0's host down)
            "image": self.image,
            "stall_timeout": self.stall_timeout,
            "straggler_factor": self.straggler_factor,  # (a detached run's stragglers: runs.py, history.py)
            "trackers": list(self.trackers),  # (where `runs` says each run's tracker is)
            "staged": list(self.staged),  # (what `runs` says each run's staging did)
            "gpu_sample_s": self.gpu_sample_s,
            "speed": self.speed.record() if self.speed is not None else None,  # (`runs` of a run without summary.json)
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
    checkpoint_shared = None
    if layout.lf_config is not None:
        shared = facts.storage_shared("output_dir") if facts is not None else None
        if layout.checkpoint_dir is not None:
            checkpoint_shared = shared if shared is not None else is_under(layout.checkpoint_dir, layout.shared_dir)
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
    files = dict(layout.files)
    speed = None
    tracker_env: dict[str, str] = {}
    tracked: list[str] = []
    if layout.lf_config is not None:
        staged = {**layout.lf_config, **layout.staged}  # (the ranks read the hosts' local copies: ftbundle/stage.py)
        answer = facts.hosts[0].tokenized if facts is not None and facts.hosts else None
        chosen = tokenized.path_for(answer, layout.run_id)
        if chosen is not None:  # (the ranks' config names the kept tokenized dataset)
            staged["tokenized_path"] = chosen[0]
            notes.append(tokenized.note(*chosen))
        elif answer and answer.get("error"):
            notes.append(f"tokenized dataset: tokenized by this run, not kept ({answer['error']})")
        # the trainer counts its tokens (tokens/s, MFU: ftbundle.speed), without padding where it can
        counting, padding = token_setting(layout.lf_config.get("include_num_input_tokens_seen"),
                                          _package_version(facts, "transformers"))
        staged["include_num_input_tokens_seen"] = counting
        # the trackers LlamaFactory reports to get the run's id and the job's name (ftbundle.trackers)
        keys, tracker_env, tracked = trackers.staged(layout.lf_config, run_dir=layout.run_dir, run_id=layout.run_id,
                                                     job=job.name, env=job.env, workdir=layout.workdir,
                                                     transformers=_package_version(facts, "transformers"),
                                                     mlflow=_package_version(facts, "mlflow")
                                                     or _package_version(facts, "mlflow-skinny"),
                                                     present=_rank0_trackers(facts), rank0_mlflow=_rank0_mlflow(facts))
        staged.update(keys)
        import yaml

        files[LLAMAFACTORY_CONFIG] = yaml.safe_dump(staged, sort_keys=False)
        speed = basis_of(facts, sum(counts), padding, uses_gpus=uses_gpus(job, facts), nprocs=nprocs, env=job.env)
    elif job.train.mode == "script":  # (tokens/s when the script counts its own: shims/steptimes.py StepClock)
        speed = basis_of(facts, sum(counts), None, uses_gpus=uses_gpus(job, facts), nprocs=nprocs, env=job.env)
    if speed is not None and speed.gpus and speed.params and (speed.peak_from or not speed.peak_tflops):
        # (GPUs the table does not know: said before the run, not found in its summary)
        notes.append(f"MFU counted against {speed.mix or f'{speed.peak_tflops:g} TFLOP/s'}, {speed.peak_from}"
                     if speed.peak_tflops
                     else speed.mfu_basis())

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
            "FTB_ATTEMPT_FILE": layout.rundir.attempt,  # (a fenced rank reads it: shims/llamafactory_entry.py)
            "FTB_DIVERGENCE": job.divergence,  # a nan or collapsed run: stop | warn (shims/steptimes.py)
            "PYTHONUNBUFFERED": "1",
            **(nccl_debug_env(layout.run_dir, _torch_version(facts)) if nccl else {}),
            **({"FTB_EXCLUDED_HOSTS": ",".join(layout.excluded)} if layout.excluded else {}),
            **lf_env,
            **({"CUDA_VISIBLE_DEVICES": devices[host.name]} if host.name in devices else {}),
            **tracker_env,
            **job.env,
        }
        torchrun = tuple(runtimes.torchrun_argv(
            layout.python or "python3", nnodes=len(layout.hosts), nproc_per_node=nproc, node_rank=rank,
            master_addr=layout.master_addr, master_port=job.master_port,
            log_dir=layout.rundir.rank_logs(rank),
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
                stage_dir=job.stage_dir if job.stage else None,
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
        nodes=tuple(nodes), files=files, warnings=tuple(warnings),
        notes=tuple(notes), checkpoint_dir=layout.checkpoint_dir, image=image, effective_batch=effective_batch,
        finetuning_type=finetuning_type, resumes=resumes, checkpoint_shared=checkpoint_shared,
        stall_timeout=job.stall_timeout, straggler_factor=job.straggler_factor, speed=speed,
        trackers=tuple(tracked), notify=job.notify, staged=layout.stage_record,
        gpu_sample_s=gpu_sample_every(job, facts),
    )


def uses_gpus(job: Job, facts: ClusterFacts | None) -> bool:
    """The job's ranks use GPUs: not a CPU job (gpus_per_node 0), and the check found some."""
    return job.gpus_per_node != 0 and facts is not None and any(f.gpus for f in facts.reached)


def gpu_sample_every(job: Job, facts: ClusterFacts | None) -> float:
    """How often a node reads its GPUs during the run: never for a CPU job (gpus_per_node 0) or
    on hosts the check found without GPUs (a CPU job costs nothing); else every few seconds (a
    host without nvidia-smi reads nothing; with the check off, the hosts are not known)."""
    if job.gpus_per_node == 0 or (facts is not None and facts.reached and not uses_gpus(job, facts)):
        return 0.0
    return gpu_metrics.SAMPLE_EVERY_S


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
    numbers = release(torch_version)
    old = len(numbers) >= 2 and numbers[:2] < FR_BUFFER_RENAMED_IN
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        ("TORCH_NCCL_TRACE_BUFFER_SIZE" if old else "TORCH_FR_BUFFER_SIZE"): "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": posixpath.join(run_dir, NCCL_TRACE_PREFIX),
        "TORCH_NCCL_DESYNC_DEBUG": "1",
    }


def _torch_version(facts: ClusterFacts | None) -> str | None:
    """The torch every reached host's ranks run (one version: the check refuses a mix)."""
    return _package_version(facts, "torch")


def _package_version(facts: ClusterFacts | None, package: str) -> str | None:
    """The version of ``package`` every reached host's ranks run (one: the check refuses a mix)."""
    from .facts import package_version  # (only where there are facts: not on plan's import)

    return package_version(facts.reached, package) if facts is not None else None


def _rank0_trackers(facts: ClusterFacts | None) -> frozenset[str] | None:
    """The trackers installed where rank 0 logs, as its probe found them (None: not asked)."""
    rank0 = next((f for f in facts.reached if f.rank == 0), None) if facts is not None else None
    return trackers.installed(rank0.versions) if rank0 is not None else None


def _rank0_mlflow(facts: ClusterFacts | None) -> tuple[str | None, str | None]:
    """Rank 0's host's MLFLOW_TRACKING_URI (its env file or login; the probe cut its user and
    password) and its ./mlruns where that holds runs, as its probe found them."""
    rank0 = next((f for f in facts.reached if f.rank == 0), None) if facts is not None else None
    return (rank0.env.get("MLFLOW_TRACKING_URI"), rank0.mlruns) if rank0 is not None else (None, None)


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


