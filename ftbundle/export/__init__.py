"""`ftbundle export`: the same job.yaml as a Slurm, Kubeflow or PBS job.

This package owns turning a :class:`~ftbundle.plan.Plan` into a scheduler's text. The
renderers (slurm.py, k8s.py, pbs.py) are pure functions of an :class:`ExportSpec`, which
this module makes from the job and its plan (:func:`spec_from`); the command
(ftbundle/commands/export.py) builds the plan and picks the renderer. This module imports
none of its renderers: they import it.

On a scheduler the hosts are not known when the file is written: the plan is made for N
placeholder hosts (N from ``--nodes``, else the inventory's host count) that keep the
inventory's variables (ftb_shared_dir, ftb_image), and each renderer gets the node rank
and the master address from the scheduler at run time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import runtimes
from ..errors import UserError
from ..inventory import GPUS_VAR
from ..job import Job, check_pinned_image, holds_secret
from ..plan import Plan

TARGETS = ("slurm", "k8s", "trainjob", "pbs")
# Argv elements a renderer replaces at run time (whole elements, or inside a container name).
NODE_RANK = "@FTB_NODE_RANK@"
MASTER_ADDR = "@FTB_MASTER_ADDR@"
# docker runtime: the `--gpus` value, replaced on each node by the devices the scheduler
# allocated there (never `all`: a node can hold GPUs of other jobs)
GPU_DEVICES = "@FTB_GPU_DEVICES@"
# Uneven nodes (ftb_nproc_per_node): torchrun's --nproc_per_node, each node's own NPROC_PER_NODE
NPROC = "@FTB_NPROC@"
# Set per node by each renderer from what the scheduler says, never from the plan.
PER_NODE_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")


@dataclass(frozen=True)
class Resources:
    """What one node of the job asks the scheduler for, beyond the node itself."""

    gpus_per_node: int  # 0: a CPU job
    cpus_per_node: int | None = None  # None: the whole node (Slurm --exclusive, PBS place=excl)
    mem: str | None = None  # e.g. 64G; None: Slurm --mem=0 (all of the node's memory)

    def describe(self) -> str:
        cpus = "all cores (exclusive node)" if self.cpus_per_node is None else f"{self.cpus_per_node} cores"
        mem = "all memory" if self.mem is None else f"{self.mem} memory"
        return f"{self.gpus_per_node} GPU(s), {cpus}, {mem} per node"


@dataclass(frozen=True)
class ExportSpec:
    """What every renderer needs, taken from the job and its plan."""

    name: str
    job_file: str
    nnodes: int
    nproc_per_node: int  # uneven nodes: the most any node runs (see nprocs)
    master_port: int
    run_id: str
    run_dir: str
    shared_dir: str
    workdir: str
    env: dict[str, str]  # plain values (the job's env, PYTHONUNBUFFERED, FTB_RUN_*)
    secret_names: tuple[str, ...]  # taken from the submitter's environment / a Secret, never written
    argv: tuple[str, ...]  # one node's command, with NODE_RANK / MASTER_ADDR placeholders
    program: tuple[str, ...]  # what torchrun runs (or the per-node command), without torchrun
    files: dict[str, str]  # staged into run_dir before launch
    checkpoint_dir: str | None
    image: str | None  # docker runtime: repo@sha256:...
    docker_argv: tuple[str, ...] | None  # docker runtime: `docker run ...` around argv
    container: str | None  # docker runtime: container name (with the NODE_RANK placeholder)
    env_file: str | None  # the NCCL env file on the hosts
    gpus_per_node: int  # GPUs requested per node (0: a CPU job)
    restarts: int
    warnings: tuple[str, ...]
    train_mode: str
    python: str
    nprocs: tuple[int, ...] = ()  # each node's ranks, in node rank order
    gpus: tuple[int, ...] = ()  # each node's GPU request, in node rank order

    @property
    def uniform(self) -> bool:
        return len(set(self.nprocs)) <= 1 and len(set(self.gpus)) <= 1

    def groups(self) -> list[tuple[int, int, int]]:
        """(nodes, ranks, GPUs) of each run of alike nodes in rank order: what a scheduler
        is asked for in one piece (a Slurm hetjob component, a PBS chunk)."""
        out: list[tuple[int, int, int]] = []
        for nproc, gpus in zip(self.nprocs, self.gpus):
            if out and out[-1][1:] == (nproc, gpus):
                out[-1] = (out[-1][0] + 1, nproc, gpus)
            else:
                out.append((1, nproc, gpus))
        return out

    def counts(self) -> str:
        """Each node's ranks, said: `8 on node0, 8 on node1, 4 on node2`."""
        return ", ".join(f"{n} on node{i}" for i, n in enumerate(self.nprocs))


def spec_from(job: Job, plan: Plan) -> ExportSpec:
    node = plan.nodes[0]
    env = {k: v for k, v in node.env.items()
           if k not in PER_NODE_ENV and not holds_secret(k, v)}
    secrets = tuple(k for k, v in node.env.items() if holds_secret(k, v))
    warnings = list(plan.warnings)
    chosen = [n.host.name for n in plan.nodes if n.host.vars.get(GPUS_VAR) is not None]
    if chosen and job.gpus_per_node != 0 and "CUDA_VISIBLE_DEVICES" not in job.env:
        env.pop("CUDA_VISIBLE_DEVICES", None)  # one host's choice, not every node's
        warnings.append(f"{GPUS_VAR} of the inventory ({', '.join(chosen)}) is not exported: the scheduler "
                        "gives each node its GPUs")
    # the host runtime's interpreter as make_plan resolved it (its argv[0]); in an image, as written
    python = node.argv[0] if job.runtime.kind == "host" and job.train.mode != "command" else job.runtime.python
    uniform = plan.uniform
    torchrun = runtimes.torchrun_argv(python, nnodes=plan.nnodes,
                                      nproc_per_node=plan.nproc_per_node if uniform else NPROC,  # type: ignore[arg-type]
                                      node_rank=NODE_RANK, master_addr=MASTER_ADDR,  # type: ignore[arg-type]
                                      master_port=plan.master_port)
    program = runtimes.program_argv(job.train.mode, run_dir=plan.run_dir, script=job.train.script,
                                    args=job.train.args, command=job.train.command)
    argv = program if job.train.mode == "command" else [*torchrun, *program]
    image = docker = container = None
    per_node = tuple(gpus_per_node(job, n) for n in plan.nprocs)
    gpus = max(per_node)
    if job.runtime.kind == "docker":
        image = plan.image
        if image is None:  # a tag in the inventory: `run` reads the digest site.yml recorded, export cannot
            raise UserError("runtime 'docker' needs an image pinned by digest to export: set runtime.image or "
                            "ftb_image to repo@sha256:... (the digest site.yml recorded in /etc/ftbundle/image.ref)",
                            file=str(job.path), key="runtime.image")
        container = runtimes.container_name(plan.run_id, NODE_RANK)  # type: ignore[arg-type]
        prefix = runtimes.docker_prefix(
            image=image, name=container, shared_dir=plan.shared_dir, workdir=node.workdir,
            env_names=[*env, *secrets, "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE"],
            env_file=None, gpus=GPU_DEVICES if gpus else None, extra=job.runtime.docker_args)
        if job.runtime.env_file:  # one word, so that a node without the file can drop it (shell.NODE_PROGRAM)
            prefix.insert(len(prefix) - 1, f"--env-file={job.runtime.env_file}")
        docker = (*prefix, *argv)
    return ExportSpec(
        name=job.name, job_file=str(job.path), nnodes=plan.nnodes, nproc_per_node=plan.nproc_per_node,
        master_port=plan.master_port, run_id=plan.run_id, run_dir=plan.run_dir, shared_dir=plan.shared_dir,
        workdir=node.workdir, env=env, secret_names=secrets, argv=tuple(argv), program=tuple(program), files=dict(plan.files),
        checkpoint_dir=plan.checkpoint_dir, image=image, docker_argv=docker, container=container,
        env_file=job.runtime.env_file, gpus_per_node=gpus, restarts=job.restarts,
        warnings=tuple(warnings), train_mode=job.train.mode, python=python, nprocs=plan.nprocs, gpus=per_node,
    )


def refuse_uneven(spec: ExportSpec, target: str, why: str) -> None:
    """A target with one rank count for every node, asked for nodes that differ: exit 2
    naming the counts, never a silently uniform file."""
    if not spec.uniform:
        raise UserError(f"the nodes run different numbers of ranks ({spec.counts()}; ftb_nproc_per_node in the "
                        f"inventory), and --to {target} cannot say so: {why}. Give every node the same count, "
                        "or export --to slurm "
                        "(a heterogeneous job) or --to pbs (one chunk per count)", file=spec.job_file,
                        key="nproc_per_node")


def gpus_per_node(job: Job, nproc_per_node: int | None = None) -> int:
    """The GPUs each node asks the scheduler for: the job's `gpus_per_node`, or for `auto`
    one per rank (``nproc_per_node``: the ranks per node as resolved, for a job whose own is
    `auto`), unless the job is a CPU job (a LlamaFactory config with `use_cpu: true`)."""
    if job.gpus_per_node != "auto":
        return int(job.gpus_per_node)
    if job.train.mode == "llamafactory" and (job.train.llamafactory or {}).get("use_cpu"):
        return 0
    return int(nproc_per_node if nproc_per_node is not None else job.nproc_per_node)


def resource_warnings(spec: ExportSpec, node_gpus: int | None) -> list[str]:
    """What the scheduler would refuse or the ranks would regret, said before submitting."""
    out = []
    if node_gpus is not None and spec.gpus_per_node > node_gpus:
        out.append(f"the job asks for {spec.gpus_per_node} GPU(s) per node but the nodes have {node_gpus} "
                   "(--node-gpus): the scheduler will refuse it or never start it")
    if 0 < spec.gpus_per_node < spec.nproc_per_node:
        out.append(f"{spec.nproc_per_node} ranks per node share {spec.gpus_per_node} GPU(s)")
    return out


def parse_count(value: str | None, flag: str, lo: int = 1) -> int | None:
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        count = -1
    if not lo <= count <= 100000:
        raise UserError(f"must be a whole number ({lo} or more), got {value!r}", key=flag)
    return count


MEM_RE = re.compile(r"^[1-9][0-9]*[KMGT]?$")


def parse_mem(value: str | None) -> str | None:
    if value is not None and not MEM_RE.match(value):
        raise UserError(f"must be a size such as 64G, 512000M or 1T, got {value!r}", key="--mem")
    return value


def check_image(image: str, where: str) -> str:
    """A tag is refused here as `ftbundle run` refuses it."""
    check_pinned_image(image, lambda msg: UserError(msg, file=where, key="--image"))
    return image
