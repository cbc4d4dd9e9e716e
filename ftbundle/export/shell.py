"""Pieces of shell text shared by the Slurm and PBS scripts.

Every value from a job file or an inventory enters the text through :func:`q` (one
single-quoted word, never expanded), :func:`comment` (one line, in a comment) or a quoted
here-document (staged files, as plain text a reviewer can read; the node program below
is staged the same way, as ``ftb-node.sh`` in the run directory); the fixed programs below
take their values as arguments and environment, never by pasting.
"""

from __future__ import annotations

import hashlib
import re
import shlex

from ..errors import UserError
from ..plan import shape_text
from ..rundir import SHELL_NODE_FILE
from . import GPU_DEVICES, MASTER_ADDR, NODE_RANK, NPROC, ExportSpec

CONTROL_RE = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\x85]+")

SAFE_DIRECTIVE_RE = re.compile(r"^[A-Za-z0-9_./:@%+=,-]+$")


def q(value: str) -> str:
    """One shell word that means ``value`` and never expands: single quotes, or bash's
    $'...' where the value holds control characters (a newline stays on its line)."""
    if not CONTROL_RE.search(value):
        return shlex.quote(value)
    out = []
    for ch in value:
        if ch in "\\'":
            out.append("\\" + ch)
        elif CONTROL_RE.match(ch):
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def directive_value(value: str, flag: str) -> str:
    """A value on an #SBATCH / #PBS line: the scheduler reads those lines itself, without a
    shell, so only plain characters are allowed there."""
    if not SAFE_DIRECTIVE_RE.match(value):
        raise UserError(f"{value!r} cannot go on a scheduler directive line: use letters, digits and ./:@%+=,-_",
                        key=flag)
    return value


# Slurm's --time forms (sbatch(1)): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; and
# UNLIMITED / INFINITE. PBS's walltime is [[HH:]MM:]SS (or seconds).
SLURM_TIME_RE = re.compile(r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(?::\d{1,2}(?::\d{1,2})?)?|"
                           r"UNLIMITED|INFINITE|unlimited|infinite)$")
PBS_TIME_RE = re.compile(r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2})$")


def time_value(value: str, target: str) -> str:
    """``--time`` as the target's scheduler reads it, or a UserError that shows its forms."""
    if target == "pbs":
        if not PBS_TIME_RE.match(value):
            raise UserError(f"{value!r} is not a PBS walltime: [[HH:]MM:]SS, e.g. 24:00:00 or 3600", key="--time")
    elif not SLURM_TIME_RE.match(value):
        raise UserError(f"{value!r} is not a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                        "D-HH:MM:SS (e.g. 2-00:00:00 for two days), or UNLIMITED", key="--time")
    return directive_value(value, "--time")


def comment(text: str) -> str:
    """Any text as the rest of one comment line: a newline in a job or inventory value
    (a path, a warning) cannot start a line of code."""
    return CONTROL_RE.sub(" ", text)


def header(spec: ExportSpec, target: str, needs: list[str], requests: list[str]) -> list[str]:
    lines = ["# shellcheck disable=SC2016  # values are single-quoted on purpose: they must not expand",
             comment(f"# {spec.name}: written by `ftbundle export --to {target}` from {spec.job_file}"),
             comment(f"# {shape_text(spec.nprocs or [spec.nproc_per_node] * spec.nnodes)}; run directory {spec.run_dir}"),
             "# Requests per node:"]
    lines += [comment(f"#   - {r}") for r in requests]
    lines.append("# Needs on the cluster:")
    lines += [comment(f"#   - {need}") for need in needs]
    if spec.secret_names:
        lines.append("# Secrets are not in this file: export " + " ".join(spec.secret_names)
                     + " in the shell you submit from.")
    lines += [comment(f"# warning: {w}") for w in spec.warnings]
    return lines


def heredoc_end(text: str) -> str:
    """A here-document terminator that is no line of ``text``."""
    end = "FTB_EOF_" + hashlib.sha256(text.encode()).hexdigest()[:12]
    while end in text.splitlines():
        end += "_"
    return end


def stage_files(spec: ExportSpec) -> list[str]:
    """Write the plan's files into the run directory, as `ftbundle run` stages them: each
    as plain text in a quoted here-document (nothing in it expands), readable here."""
    lines = ['mkdir -p -- "$FTB_RUN_DIR"']
    for name, text in sorted(spec.files.items()):
        body = text.removesuffix("\n")
        end = heredoc_end(text)
        if text.endswith("\n"):
            lines += [f'cat >"$FTB_RUN_DIR"/{q(name)} <<\'{end}\'', body, end]
        else:  # a here-document always ends in a newline: drop the one the file does not have
            lines += [f"printf '%s' \"$(cat <<'{end}'", body, end, f')" >"$FTB_RUN_DIR"/{q(name)}']
    return lines


def environment(spec: ExportSpec) -> list[str]:
    """The NCCL env file of the hosts first, then the job's env (which wins over it)."""
    lines = []
    if spec.env_file:
        lines.append("# shellcheck source=/dev/null")
        lines.append(f"if [ -r {q(spec.env_file)} ]; then set -a; . {q(spec.env_file)}; set +a; fi")
    for key, value in spec.env.items():
        lines.append(f"export {key}={q(value)}")
    for key in spec.secret_names:
        lines.append(f': "${{{key}:?{key} must be set in the environment this job is submitted from}}"')
        lines.append(f"export {key}")
    lines.append(f"export FTB_WORKDIR={q(spec.workdir)} MASTER_PORT={spec.master_port}"
                 + (f" NPROC_PER_NODE={spec.nproc_per_node}" if spec.uniform else ""))  # uneven: set per node
    if spec.container:
        lines.append(f"export FTB_CONTAINER={q(spec.container)}")
    return lines


# The newest complete checkpoint-N of a directory: an incomplete newest one (no
# trainer_state.json yet: the job died while saving) is removed first. The same rule as
# `ftbundle run`'s restarts (ftbundle/remote/node.sh, mode resume-point).
RESUME_POINT = r'''# shellcheck disable=SC2010
ftb_resume_point() {
  local last
  last=$(ls -1 -- "$1" 2>/dev/null | grep -E '^checkpoint-[0-9]+$' | sort -t- -k2 -n | tail -n 1) || true
  if [ -n "$last" ] && [ ! -e "$1/$last/trainer_state.json" ]; then
    rm -rf -- "${1:?}/$last"; echo "ftbundle: removed incomplete checkpoint $last" >&2
  fi
  ls -1 -- "$1" 2>/dev/null | grep -E '^checkpoint-[0-9]+$' | sort -t- -k2 -n | tail -n 1 || true
}'''


def resume(spec: ExportSpec) -> list[str]:
    if not spec.checkpoint_dir:
        return []
    return [RESUME_POINT,
            f"FTB_LAST=$(ftb_resume_point {q(spec.checkpoint_dir)})",
            ('if [ -n "$FTB_LAST" ]; then echo "ftbundle: resuming from $FTB_LAST" >&2; '
             'else echo "ftbundle: no checkpoint yet: starting from the beginning" >&2; fi')]


# One node's part, run once per node (by srun, or over ssh): the node rank and master come
# from the environment, the command is its arguments. Placeholders are whole words the
# exporter put in the argv (ftbundle.export.NODE_RANK, MASTER_ADDR).
NODE_PROGRAM = r'''set -u
args=()
for a in "$@"; do
  a=${a//@NODE_RANK@/$NODE_RANK}
  a=${a//@MASTER_ADDR@/$MASTER_ADDR}
  case $a in *@NPROC@*) a=${a//@NPROC@/$NPROC_PER_NODE} ;; esac  # uneven nodes: each its own
  if [ -n "${FTB_CONTAINER:-}" ]; then
    case $a in
      # the hosts' NCCL env file, where this node has one
      --env-file=*) [ -r "${a#--env-file=}" ] || continue ;;
      # the GPUs the scheduler gave this node (real indices), never all of the node's
      @GPU_DEVICES@)
        dev=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}}
        if [ -z "$dev" ]; then echo "ftbundle: GPUs requested, but the scheduler named none on $(hostname)" >&2; exit 97; fi
        a="\"device=$dev\"" ;;
    esac
  fi
  args+=("$a")
done
cd -- "$FTB_WORKDIR" || { echo "ftbundle: workdir $FTB_WORKDIR missing on $(hostname)" >&2; exit 96; }
if [ -n "${FTB_CONTAINER:-}" ]; then
  FTB_CONTAINER=${FTB_CONTAINER//@NODE_RANK@/$NODE_RANK}
  # removing the container is what stops it: killing `docker run` does not
  trap 'docker rm -f "$FTB_CONTAINER" >/dev/null 2>&1' EXIT
  trap 'exit 143' TERM INT
  "${args[@]}" &
  wait $!
else
  exec "${args[@]}"
fi'''.replace("@NODE_RANK@", NODE_RANK).replace("@MASTER_ADDR@", MASTER_ADDR).replace(
    "@GPU_DEVICES@", GPU_DEVICES).replace("@NPROC@", NPROC)


NODE_FILE = SHELL_NODE_FILE  # in the run directory, beside the staged files (rundir.py)
RUN_NODE = f'exec bash "$FTB_RUN_DIR"/{NODE_FILE} "$@"'  # a node's start: FTB_RUN_DIR set, argv the command


def node_program_file() -> list[str]:
    """The node program, staged into the run directory as a file like the job's own (a
    reviewer reads it there and in this script; every node runs it from shared storage:
    its batch shell wrote and closed it before any node started, so NFS's close-to-open
    rule shows it whole to all of them)."""
    return [f"cat >\"$FTB_RUN_DIR\"/{NODE_FILE} <<'FTB_NODE_EOF'", NODE_PROGRAM, "FTB_NODE_EOF"]


def words(argv: tuple[str, ...]) -> str:
    return " ".join(q(a) for a in argv)
