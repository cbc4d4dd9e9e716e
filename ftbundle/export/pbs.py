"""Plan -> a qsub script (PBS Pro by default, Torque by option). Pure.

Each node asks for one chunk: PBS Pro ``select=N:ncpus=C:ngpus=G:mpiprocs=1`` with the
node to itself (``place=scatter:excl``), Torque ``nodes=N:ppn=C:gpus=G``; ``-V`` passes
the submitting environment (the job's secrets) to the job. The hosts are the unique lines
of $PBS_NODEFILE in order, the first is the master. Each node's part is started by
``pbsdsh`` (so the MOM tracks and kills every process), or by an ssh loop by option. On
Slurm's PBS wrapper (Debian's slurm-wlm-torque: no $PBS_NODEFILE, no pbsdsh) the script
takes the hosts from Slurm and starts the nodes with srun.
"""

from __future__ import annotations

from ..errors import UserError
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

LAUNCHERS = ("pbsdsh", "ssh")


def resources(spec: ExportSpec, res: Resources, torque: bool) -> list[str]:
    """The resource directives: one chunk (PBS Pro) or one node line (Torque) per node; nodes
    that run different numbers of ranks (ftb_nproc_per_node) as one chunk per count, joined
    by `+` in node rank order (the order of $PBS_NODEFILE)."""
    groups = spec.groups() or [(spec.nnodes, spec.nproc_per_node, spec.gpus_per_node)]
    if torque:
        line = "#PBS -l nodes=" + "+".join(f"{count}:ppn={res.cpus_per_node or nproc}" + (f":gpus={gpus}" if gpus else "")
                                           for count, nproc, gpus in groups)
        # Torque's mem is per job, not per node: --mem is not written for Torque; nor is a
        # node-exclusive flag (-n is not portable: Slurm's #PBS reader refuses it), so the
        # node's cores are ppn: pass --cpus-per-node with the node's core count
        return [line]
    chunks = []
    for count, nproc, gpus in groups:
        chunk = f"{count}:ncpus={res.cpus_per_node or nproc}"
        if gpus:
            chunk += f":ngpus={gpus}"
        if res.mem:  # Slurm's units: a bare number is megabytes
            chunk += f":mem={res.mem.lower()}b" if not res.mem[-1].isdigit() else f":mem={res.mem}mb"
        chunks.append(chunk + ":mpiprocs=1")
    place = "scatter:excl" if res.cpus_per_node is None else "scatter"
    return [f"#PBS -l select={'+'.join(chunks)}", f"#PBS -l place={place}"]


def render(spec: ExportSpec, res: Resources, *, queue: str | None = None, time: str | None = None,
           torque: bool = False, launcher: str = "pbsdsh") -> str:
    if launcher not in LAUNCHERS:
        raise UserError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}", key="--launcher")
    needs = [f"{spec.shared_dir} mounted on every node (shared storage: logs, run directory, checkpoints)"]
    needs.append("pbsdsh (PBS Pro or Torque) on the first node" if launcher == "pbsdsh"
                 else "passwordless ssh between the job's nodes (set FTB_SSH to change the ssh command)")
    if spec.image is None:
        needs.append(f"{spec.python} with torch (and the training stack) on every node")
    else:
        needs.append(f"docker on every node, able to run {spec.image}")
    flavour = "Torque" if torque else "PBS Pro"
    requested = [f"{flavour}: " + " ".join(d.removeprefix("#PBS ") for d in resources(spec, res, torque))]
    lines = ["#!/bin/bash", *header(spec, "pbs", needs, requested),
             f"#PBS -N {directive_value(spec.name, 'name')}",
             *resources(spec, res, torque),
             "#PBS -V"]
    if time:
        lines.append(f"#PBS -l walltime={time_value(time, 'pbs')}")
    if queue:
        lines.append(f"#PBS -q {directive_value(queue, '--partition')}")
    lines += [
        "#PBS -r y",
        "#PBS -j oe",
        f"#PBS -o {directive_value(spec.shared_dir, 'shared_dir')}/pbs-{spec.name}.out",
        "set -euo pipefail",
        "",
        f"export FTB_RUN_ID={q(spec.run_id)} FTB_RUN_DIR={q(spec.run_dir)}",
        "# the job's hosts in order, once each, and each one's first slot (pbsdsh -n)",
        'if [ -n "${PBS_NODEFILE:-}" ]; then',
        '  mapfile -t FTB_HOSTS < <(awk \'NF && !seen[$0]++\' "$PBS_NODEFILE")',
        '  mapfile -t FTB_SLOTS < <(awk \'NF && !seen[$0]++ {print NR - 1}\' "$PBS_NODEFILE")',
        "  FTB_LAUNCH=" + launcher,
        'elif [ -n "${SLURM_JOB_NODELIST:-}" ]; then  # Slurm\'s qsub wrapper (slurm-wlm-torque)',
        '  mapfile -t FTB_HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "  FTB_LAUNCH=srun",
        "else",
        '  echo "ftbundle: no PBS_NODEFILE: run this script with qsub" >&2; exit 2',
        "fi",
        f'if [ "${{#FTB_HOSTS[@]}}" != {spec.nnodes} ]; then',
        (f'  echo "ftbundle: this script was written for {spec.nnodes} nodes, the job has '
         '${#FTB_HOSTS[@]}" >&2; exit 2'),
        "fi",
        "",
        "# the run directory, staged as `ftbundle run` stages it",
        *stage_files(spec),
        "",
        *environment(spec),
        'export MASTER_ADDR="${FTB_HOSTS[0]}" NNODES="${#FTB_HOSTS[@]}"',
        *resume(spec),
        "",
        "# the node program every node runs, staged beside the job's files",
        *node_program_file(),
        "",
        f"FTB_ARGV=({words(spec.docker_argv or spec.argv)})",
        *([] if spec.uniform else ["# each node's ranks, in node rank order (the chunks of select)",
                                   f"FTB_NPROCS=({' '.join(map(str, spec.nprocs))})"]),
        *launch_lines(spec),
        "rc=0",
        'for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def launch_lines(spec: ExportSpec) -> list[str]:
    """One start per node. pbsdsh and srun pass no shell variables, so the node gets them as
    NAME=value arguments (values are the job's plain env, never secrets: those come from
    the job's own environment, -V); ssh reads them on stdin."""
    env_file = ([f"  printf 'if [ -r %q ]; then set -a; . %q; set +a; fi\\n' {q(spec.env_file)} {q(spec.env_file)}"]
                if spec.env_file else [])
    plain = [n for n in env_names(spec) if n not in spec.secret_names]
    source = f"if [ -r {q(spec.env_file)} ]; then set -a; . {q(spec.env_file)}; set +a; fi; " if spec.env_file else ""
    # the node's bash: NCCL env file, then NAME=value words up to --, then the node program
    node = source + 'while [ "$1" != -- ]; do export "$1"; shift; done; shift; ' + RUN_NODE
    return [
        f"FTB_NODE_ARGV=(bash -c {q(node)} ftb-node)",
        "ftb_env_words() {  # NODE_RANK",
        "  local name",
        f"  for name in {' '.join(plain)}; do",
        '    if [ -n "${!name+x}" ]; then printf \'%s=%s\\0\' "$name" "${!name}"; fi',
        "  done",
        "  printf 'NODE_RANK=%s\\0' \"$1\"",
        "}",
        "# what an ssh'd node's bash reads on stdin: its environment, quoted by bash, then the job",
        "ftb_node_input() {  # NODE_RANK",
        "  local name",
        *env_file,
        f"  for name in {' '.join(env_names(spec))}; do",
        '    if [ -n "${!name+x}" ]; then printf \'export %s=%q\\n\' "$name" "${!name}"; fi',
        "  done",
        "  printf 'export NODE_RANK=%q\\n' \"$1\"",
        "  printf 'set -- '; printf '%q ' \"${FTB_ARGV[@]}\"; echo",
        f"  printf '%s\\n' {q(RUN_NODE)}",
        "}",
        "pids=()",
        'for rank in "${!FTB_HOSTS[@]}"; do',
        *([] if spec.uniform else ['  export NPROC_PER_NODE="${FTB_NPROCS[$rank]}"']),
        '  mapfile -d \'\' -t words < <(ftb_env_words "$rank")',
        '  case $FTB_LAUNCH in',
        '    pbsdsh) pbsdsh -n "${FTB_SLOTS[$rank]}" -- "${FTB_NODE_ARGV[@]}" "${words[@]}" -- "${FTB_ARGV[@]}" & ;;',
        ('    srun) srun --nodes=1 --ntasks=1 -w "${FTB_HOSTS[$rank]}" "${FTB_NODE_ARGV[@]}" "${words[@]}" -- '
         '"${FTB_ARGV[@]}" & ;;'),
        '    *) read -ra FTB_SSH_ARGV <<<"${FTB_SSH:-ssh}"',
        '       ftb_node_input "$rank" | "${FTB_SSH_ARGV[@]}" "${FTB_HOSTS[$rank]}" bash -s & ;;',
        "  esac",
        "  pids+=($!)",
        "done",
    ]


def env_names(spec: ExportSpec) -> list[str]:
    """Every variable a node needs from the launching shell (its NCCL env file is its own)."""
    names = [*spec.env, *spec.secret_names, "FTB_RUN_ID", "FTB_RUN_DIR", "FTB_WORKDIR", "MASTER_ADDR",
             "MASTER_PORT", "NNODES", "NPROC_PER_NODE"]
    if spec.container:
        names.append("FTB_CONTAINER")
    return list(dict.fromkeys(names))
