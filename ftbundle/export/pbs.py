"""Plan -> a qsub script (PBS Pro / Torque). Pure.

The shape of the seeds' PBS script: the hosts are the unique lines of $PBS_NODEFILE in
order, the first is the master, and each gets one launch over ssh with its line number as
node rank. The environment travels on ssh's stdin as shell text quoted by bash itself
(printf %q), so no value appears on a command line.
"""

from __future__ import annotations

from . import ExportSpec
from .shell import (
    directive_value,
    environment,
    header,
    node_program_def,
    q,
    resume,
    stage_files,
    words,
)


def render(spec: ExportSpec, *, queue: str | None = None, time: str | None = None) -> str:
    needs = [f"{spec.shared_dir} mounted on every node (shared storage: logs, run directory, checkpoints)",
             "passwordless ssh between the job's nodes (set FTB_SSH to change the ssh command)"]
    if spec.image is None:
        needs.append(f"{spec.python} with torch (and the training stack) on every node")
    else:
        needs.append(f"docker on every node, able to run {spec.image}")
    resources = f"nodes={spec.nnodes}:ppn={spec.nproc_per_node}" + (f":gpus={spec.nproc_per_node}" if spec.gpus else "")
    lines = ["#!/bin/bash", *header(spec, "pbs", needs),
             f"#PBS -N {directive_value(spec.name, 'name')}",
             f"#PBS -l {resources}"]
    if time:
        lines.append(f"#PBS -l walltime={directive_value(time, '--time')}")
    if queue:
        lines.append(f"#PBS -q {directive_value(queue, '--partition')}")
    lines += [
        "#PBS -r y",
        "#PBS -j oe",
        f"#PBS -o {directive_value(spec.shared_dir, 'shared_dir')}/pbs-{spec.name}.out",
        "set -euo pipefail",
        "",
        f"export FTB_RUN_ID={q(spec.run_id)} FTB_RUN_DIR={q(spec.run_dir)}",
        'mapfile -t FTB_HOSTS < <(awk \'NF && !seen[$0]++\' "$PBS_NODEFILE")',
        f'if [ "${{#FTB_HOSTS[@]}}" != {spec.nnodes} ]; then',
        (f'  echo "ftbundle: this script was written for {spec.nnodes} nodes, $PBS_NODEFILE lists '
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
        *node_program_def(),
        "",
        "# what each node's bash reads on stdin: its environment, quoted by bash, then the job",
        "ftb_node_input() {  # NODE_RANK",
        "  local name",
        *([f"  printf 'if [ -r %q ]; then set -a; . %q; set +a; fi\\n' {q(spec.env_file)} {q(spec.env_file)}"]
          if spec.env_file else []),
        f"  for name in {' '.join(env_names(spec))}; do",
        '    if [ -n "${!name+x}" ]; then printf \'export %s=%q\\n\' "$name" "${!name}"; fi',
        "  done",
        "  printf 'export NODE_RANK=%q\\n' \"$1\"",
        "  printf 'set -- '; printf '%q ' \"${FTB_ARGV[@]}\"; echo",
        '  printf \'%s\\n\' "$FTB_NODE"',
        "}",
        f"FTB_ARGV=({words(spec.docker_argv or spec.argv)})",
        'read -ra FTB_SSH_ARGV <<<"${FTB_SSH:-ssh}"',
        "pids=()",
        'for rank in "${!FTB_HOSTS[@]}"; do',
        '  ftb_node_input "$rank" | "${FTB_SSH_ARGV[@]}" "${FTB_HOSTS[$rank]}" bash -s &',
        "  pids+=($!)",
        "done",
        "rc=0",
        'for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def env_names(spec: ExportSpec) -> list[str]:
    """Every variable a node needs from the launching shell (its NCCL env file is its own)."""
    names = [*spec.env, *spec.secret_names, "FTB_RUN_ID", "FTB_RUN_DIR", "FTB_WORKDIR", "MASTER_ADDR",
             "MASTER_PORT", "NNODES", "NPROC_PER_NODE"]
    if spec.container:
        names.append("FTB_CONTAINER")
    return list(dict.fromkeys(names))
