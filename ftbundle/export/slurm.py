"""Plan -> an sbatch script. Pure.

One task per node (srun) with all of the node's cores (``--exclusive``, or
``--cpus-per-task`` when the node is shared) and the job's GPUs (``--gpus-per-node``, or
``--gres=gpu:N``); the node rank is SLURM_NODEID and the master is the first host of the
allocation. The job is requeueable: 120 s before the time limit Slurm sends USR1
to the batch shell, which requeues the job; a requeued job (like `scontrol requeue`)
starts the script again and resumes from the newest complete checkpoint by the rule of
`restarts`.

Nodes that run different numbers of ranks (ftb_nproc_per_node in the inventory) become a
heterogeneous job: one component (`#SBATCH hetjob`) per run of alike nodes in node rank
order, each started by its own `srun --het-group=K` with its own NPROC_PER_NODE, its node
ranks following the components before it.
"""

from __future__ import annotations

from ..errors import UserError
from ..paths import is_under
from . import ExportSpec, Resources
from .shell import (
    RUN_NODE,
    directive_value,
    time_value,
    environment,
    header,
    node_program_file,
    q,
    resume,
    stage_files,
    words,
)

RUNTIMES = ("pyxis", "docker")


def directives(spec: ExportSpec, res: Resources, gres: bool, nodes: int | None = None,
               gpus: int | None = None) -> list[str]:
    """What each node asks Slurm for: one task, the GPUs, the cores, the memory (``nodes``
    and ``gpus``: of one hetjob component)."""
    gpus = spec.gpus_per_node if gpus is None else gpus
    lines = [f"#SBATCH --nodes={spec.nnodes if nodes is None else nodes}", "#SBATCH --ntasks-per-node=1"]
    if gpus:
        lines.append(f"#SBATCH --gres=gpu:{gpus}" if gres else f"#SBATCH --gpus-per-node={gpus}")
    if res.cpus_per_node is None:
        lines.append("#SBATCH --exclusive")  # the whole node: all its cores for the one task
    else:
        lines.append(f"#SBATCH --cpus-per-task={res.cpus_per_node}")
    lines.append(f"#SBATCH --mem={res.mem or 0}")  # 0: all of the node's memory
    return lines


def requests(spec: ExportSpec, res: Resources, gres: bool) -> list[str]:
    def gpu(n: int) -> str:
        return (f"--gres=gpu:{n}" if gres else f"--gpus-per-node={n}") if n else "no GPUs (a CPU job)"

    cpus = "all cores (--exclusive)" if res.cpus_per_node is None else f"--cpus-per-task={res.cpus_per_node}"
    first = [gpu(spec.gpus_per_node)] if spec.uniform else [
        f"hetjob component {k}: {count} node(s) x {nproc} rank(s), {gpu(gpus)}"
        for k, (count, nproc, gpus) in enumerate(spec.groups())]
    return [*first, f"one task with {cpus}", f"--mem={res.mem or 0}" + ("" if res.mem else " (all of the node's memory)")]


def render(spec: ExportSpec, res: Resources, *, partition: str | None = None, time: str | None = None,
           container: str = "pyxis", gres: bool = False) -> str:
    if container not in RUNTIMES:
        raise UserError(f"unknown container runtime {container!r}; valid: {', '.join(RUNTIMES)}", key="--container")
    needs = [f"{spec.shared_dir} mounted on every node (shared storage: logs, run directory, checkpoints)"]
    if spec.image is None:
        needs.append(f"{spec.python} with torch (and the training stack) on every node")
    elif container == "pyxis":
        needs.append(f"pyxis + enroot, able to pull {spec.image} by digest (not run here: no pyxis "
                     "could be installed where this exporter was tested)")
    else:
        needs.append(f"docker on every node, able to run {spec.image}")
    lines = ["#!/bin/bash", *header(spec, "slurm", needs, requests(spec, res, gres))]
    groups = spec.groups() if not spec.uniform else []
    where = []
    if partition:
        where.append(f"#SBATCH --partition={directive_value(partition, '--partition')}")
    if time:
        where.append(f"#SBATCH --time={time_value(time, 'slurm')}")
    lines += [f"#SBATCH --job-name={directive_value(spec.name, 'name')}",
              *directives(spec, res, gres, *(groups[0][::2] if groups else ())), *where]
    lines += [
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={directive_value(spec.shared_dir, 'shared_dir')}/slurm-%x-%j.out",
    ]
    for count, _, gpus in groups[1:]:  # the nodes that run other counts: one component each
        lines += ["#SBATCH hetjob", *directives(spec, res, gres, count, gpus), *where]
    lines += [
        "set -euo pipefail",
        "",
        f"export FTB_RUN_ID={q(spec.run_id)} FTB_RUN_DIR={q(spec.run_dir)}",
        *(allocation_check(spec) if not groups else hetjob_hosts(groups)),
        "",
        "# the run directory, staged as `ftbundle run` stages it",
        *stage_files(spec),
        "",
        *environment(spec),
        *(['MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
           'export MASTER_ADDR NNODES="$SLURM_JOB_NUM_NODES"'] if not groups else
          ['export MASTER_ADDR="${FTB_HOSTS[0]}" NNODES="${#FTB_HOSTS[@]}"']),
        ('echo "ftbundle: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
         'master $MASTER_ADDR" >&2'),
        *resume(spec),
        "",
        "# the node program every node runs (srun), staged beside the job's files",
        *node_program_file(),
        "",
        "# near the time limit (--signal): back into the queue; the next start resumes",
        'trap \'echo "ftbundle: requeueing job $SLURM_JOB_ID" >&2; scontrol requeue "$SLURM_JOB_ID"\' USR1',
    ]
    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    # the step's one task gets every core the job has on the node (else Slurm pins it to one)
    cpus = '--cpus-per-task="$SLURM_CPUS_ON_NODE"' if res.cpus_per_node is None else f"--cpus-per-task={res.cpus_per_node}"
    argv = spec.argv
    if spec.image is not None and container == "pyxis":
        mounts = [f"{spec.shared_dir}:{spec.shared_dir}"]
        if not is_under(spec.workdir, spec.shared_dir):
            mounts.append(f"{spec.workdir}:{spec.workdir}")
        srun += [f"--container-image={enroot_image(spec.image)}", f"--container-mounts={','.join(mounts)}",
                 f"--container-workdir={spec.workdir}"]
    elif spec.image is not None:
        argv = spec.docker_argv or argv
    if groups:
        return "\n".join(lines + hetjob_steps(groups, srun, res, argv)) + "\n"
    start = q('export NODE_RANK="$SLURM_NODEID"; ' + RUN_NODE)
    lines += [
        "# NODE_RANK is the task's own SLURM_NODEID, set inside the step",
        "# shellcheck disable=SC2016",
        f"{words((*srun[:2], f'--nodes={spec.nnodes}', *srun[2:]))} {cpus} bash -c {start} ftb-node \\",
        f"  {words(argv)} &",
        "FTB_SRUN=$!",
        'while :; do',
        '  rc=0; wait "$FTB_SRUN" || rc=$?',
        '  kill -0 "$FTB_SRUN" 2>/dev/null || break  # a trap interrupted the wait: keep waiting',
        'done',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def allocation_check(spec: ExportSpec) -> list[str]:
    return [f'if [ "$SLURM_JOB_NUM_NODES" != {spec.nnodes} ]; then',
            (f'  echo "ftbundle: this script was written for {spec.nnodes} nodes, the allocation has '
             '$SLURM_JOB_NUM_NODES" >&2; exit 2'),
            "fi"]


def hetjob_hosts(groups: list[tuple[int, int, int]]) -> list[str]:
    """The hosts of every component in node rank order (FTB_HOSTS), each component checked
    for the nodes it was written for."""
    lines = ["# the nodes of each hetjob component, in node rank order", "FTB_HOSTS=()"]
    for k, (count, nproc, _) in enumerate(groups):
        lines += [f'mapfile -t FTB_HET < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{k}")',
                  f'if [ "${{#FTB_HET[@]}}" != {count} ]; then',
                  (f'  echo "ftbundle: hetjob component {k} was written for {count} node(s) x {nproc} rank(s), '
                   'it has ${#FTB_HET[@]}" >&2; exit 2'),
                  "fi",
                  'FTB_HOSTS+=("${FTB_HET[@]}")']
    return lines


def hetjob_steps(groups: list[tuple[int, int, int]], srun: list[str], res: Resources,
                 argv: tuple[str, ...]) -> list[str]:
    """One step per component, each node's rank its component's first plus its SLURM_NODEID
    in the step, its NPROC_PER_NODE the component's; the first step to fail ends the others.
    A whole node's cores: the component's own (SLURM_JOB_CPUS_PER_NODE_HET_GROUP_K, e.g. 72(x2))."""
    lines = ["# one step per hetjob component: NODE_RANK = the component's first node rank + SLURM_NODEID",
             "pids=()"]
    first = 0
    for k, (count, nproc, _) in enumerate(groups):
        cpus = (f'--cpus-per-task="${{SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{k}%%[(,]*}}"' if res.cpus_per_node is None
                else f"--cpus-per-task={res.cpus_per_node}")
        start = q(f'export NODE_RANK=$(({first} + SLURM_NODEID)) NPROC_PER_NODE={nproc}; ' + RUN_NODE)
        step = (srun[0], f"--het-group={k}", *srun[1:2], f"--nodes={count}", *srun[2:])
        lines += ["# shellcheck disable=SC2016",
                  f"{words(step)} {cpus} bash -c {start} ftb-node \\",
                  f"  {words(argv)} &",
                  "pids+=($!)"]
        first += count
    return lines + [
        "rc=0",
        'while [ "${#pids[@]}" -gt 0 ]; do',
        '  r=0; wait -n || r=$?',
        '  alive=(); for p in "${pids[@]}"; do if kill -0 "$p" 2>/dev/null; then alive+=("$p"); fi; done',
        '  [ "${#alive[@]}" != "${#pids[@]}" ] || continue  # a trap interrupted the wait: keep waiting',
        '  pids=("${alive[@]}")',
        '  if [ "$r" != 0 ] && [ "$rc" = 0 ]; then rc=$r; kill "${pids[@]}" 2>/dev/null || true; fi',
        'done',
        'exit "$rc"',
    ]


def enroot_image(image: str) -> str:
    """repo@sha256:... in enroot's notation (REGISTRY#IMAGE); an image ID cannot be pulled."""
    if image.startswith("sha256:"):
        raise UserError("pyxis pulls images from a registry: the image must be repo@sha256:<digest>, not an "
                        "image ID (or export with --container docker)", key="runtime.image")
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return image
