"""The small bash program each node runs: the contract between controller and node.

The controller starts it over SSH (or as a local process) and talks to it through three
streams:

* stdin: the first line carries the environment (base64, so secrets never appear on a
  command line or in ``ps``); every later line is a ping. When pings stop for
  ``WATCHDOG_S`` seconds, or stdin closes, the node stops its job: a controller that
  disappears (Ctrl-C, laptop lid, network cut) leaves nothing running.
* stdout: rank 0's log, tailed, so the terminal shows training as it happens.
* stderr: a heartbeat line every second, so the controller notices a node that went
  silent (host down, network cut) in seconds rather than after NCCL's 10-minute watchdog.

The job itself runs in its own session (``setsid``), so one signal to the process group
stops torchrun and every rank; its whole output goes to the log on shared storage, and
its exit code to ``node-<rank>.exit`` beside it (which ``status`` reads later).
"""

from __future__ import annotations

import base64
import shlex

from .job import MIN_SECRET_LEN, is_secret
from .plan import NodePlan

HEARTBEAT = "ftb-hb"
WATCHDOG_S = 10  # node stops its job after this long without a ping from the controller
STOP_GRACE_S = 3  # SIGTERM, then SIGKILL after this long


def pid_path(run_dir: str, rank: int) -> str:
    return f"{run_dir}/node-{rank}.pid"


def exit_path(run_dir: str, rank: int) -> str:
    return f"{run_dir}/node-{rank}.exit"


def env_payload(node: NodePlan) -> bytes:
    """First stdin line: shell statements setting the node's environment, base64-encoded."""
    lines = []
    if node.env_file:
        f = shlex.quote(node.env_file)
        lines.append(f"if [ -r {f} ]; then set -a; . {f}; set +a; fi")
    if node.path_prepend:
        lines.append(f'export PATH={shlex.quote(node.path_prepend)}:"$PATH"')
    lines += [f"export {k}={shlex.quote(v)}" for k, v in node.env.items()]
    return base64.b64encode("\n".join(lines).encode()) + b"\n"


def job_marker(run_id: str, rank: int) -> str:
    """Value of FTB_JOB, set on the node's job and inherited by everything it starts."""
    return f"{run_id}-{rank}"


def stop_function(node: NodePlan) -> str:
    """`ftb_stop MARKER`: stop every process of the job on this host, container included.

    torchrun starts each rank in a session of its own, so killing torchrun's process
    group is not enough (a SIGKILLed torchrun orphans its ranks, which keep the GPUs).
    Every process the job starts inherits FTB_JOB=<marker>, so the host's /proc finds
    them all, orphans included: SIGTERM, then SIGKILL after a grace period.
    """
    extra = shlex.join(node.stop_argv) + " >/dev/null 2>&1" if node.stop_argv else ":"
    steps = int(STOP_GRACE_S * 10)
    return f"""ftb_pids() {{ grep -lzx "FTB_JOB=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; }}
ftb_stop() {{
  p=$(ftb_pids "$1"); [ -n "$p" ] && kill -TERM $p 2>/dev/null
  {extra}
  for _ in $(seq {steps}); do p=$(ftb_pids "$1"); [ -z "$p" ] && return 0; sleep 0.1; done
  kill -KILL $p 2>/dev/null
  {extra}
  return 0
}}"""


# Replaces every secret value (>= MIN_SECRET_LEN characters) in the job's output with
# <redacted>, line by line, before it reaches the log. Literal matching (index, not regex);
# values come from the environment, so they are never written into a script or a command line.
REDACT_AWK = r"""BEGIN { n = split(ENVIRON["FTB_SECRET_NAMES"], names, " ")
  for (i = 1; i <= n; i++) { v = ENVIRON[names[i]]; if (length(v) >= MIN_LEN) secret[++m] = v } }
{ line = $0
  for (i = 1; i <= m; i++) {
    out = ""
    while ((p = index(line, secret[i])) > 0) {
      out = out substr(line, 1, p - 1) "<redacted>"; line = substr(line, p + length(secret[i]))
    }
    line = out line
  }
  print line; fflush() }"""


def secret_names(node: NodePlan) -> list[str]:
    return [name for name in node.env if is_secret(name)]


def job_runner(node: NodePlan) -> str:
    """The bash program that runs the job's argv ("$@") with its whole output appended to
    the log, then records the exit code. When the job has secrets in its environment the
    output goes through REDACT_AWK first, so the log on shared storage never holds them."""
    names = secret_names(node)
    if not names:
        return '"$@" >>"$FTB_LOG" 2>&1 </dev/null; rc=$?; echo $rc >"$FTB_EXIT"; exit $rc'
    return (f"export FTB_SECRET_NAMES={shlex.quote(' '.join(names))}\n"
            f'"$@" 2>&1 </dev/null | awk -v MIN_LEN={MIN_SECRET_LEN} {shlex.quote(REDACT_AWK)} >>"$FTB_LOG"; '
            'rc=${PIPESTATUS[0]}\n'
            'echo $rc >"$FTB_EXIT"; exit $rc')


def node_script(node: NodePlan, run_dir: str, run_id: str, *, detach: bool = False) -> str:
    """The bash program for one node (see the module docstring for the protocol)."""
    q = shlex.quote
    argv = shlex.join(node.argv)
    log, pidf, exitf = node.log_path, pid_path(run_dir, node.rank), exit_path(run_dir, node.rank)
    marker = job_marker(run_id, node.rank)
    head = f"""set -u
IFS= read -r ftb_env || {{ echo "ftbundle: no environment on stdin" >&2; exit 97; }}
eval "$(printf '%s' "$ftb_env" | base64 -d)" || exit 97
unset ftb_env
mkdir -p {q(run_dir)} || {{ echo "ftbundle: cannot create {run_dir} on $(hostname)" >&2; exit 96; }}
cd {q(node.workdir)} || {{ echo "ftbundle: workdir {node.workdir} missing on $(hostname)" >&2; exit 96; }}
rm -f {q(exitf)}
export FTB_LOG={q(log)} FTB_EXIT={q(exitf)}
{stop_function(node)}
FTB_JOB={q(marker)} setsid bash -c {q(job_runner(node))} ftb-node {argv} </dev/null >/dev/null 2>&1 &
pid=$!
echo "$pid {marker} $(hostname)" > {q(pidf)}
"""
    if detach:
        watcher = peer_watch_script(node, run_dir, marker)
        return head + (f"setsid bash -c {q(watcher)} ftb-watch $pid </dev/null >/dev/null 2>&1 &\n"
                       'echo "ftbundle: started pid $pid on $(hostname)" >&2\nexit 0\n')
    tail = ""
    if node.stream:
        tail = f"tail -n +1 -F -s 0.2 --pid=$pid {q(log)} 2>/dev/null &\ntailpid=$!\n"
    return head + tail + f"""( while kill -0 $pid 2>/dev/null; do echo {HEARTBEAT} >&2; sleep 1; done ) &
hbpid=$!
# (a background job reads /dev/null unless told otherwise: hand it our stdin explicitly)
( while IFS= read -r -t {WATCHDOG_S} _; do :; done; ftb_stop {q(marker)} ) <&0 &
wdpid=$!
wait $pid
rc=$?
kill $hbpid $wdpid 2>/dev/null
{"wait $tailpid 2>/dev/null" if node.stream else ""}
exit $rc
"""


STOP_REQUEST = "stop-requested"  # in the run directory: `ftbundle stop` asks every node to stop


def peer_watch_script(node: NodePlan, run_dir: str, marker: str) -> str:
    """A detached node's stand-in for the controller: it watches the run directory on
    shared storage and stops this node's job once any node has failed or a stop was
    requested, so a detached job still fails fast instead of hanging in a collective."""
    q = shlex.quote
    return stop_function(node) + f"""
pid=$1
while kill -0 "$pid" 2>/dev/null; do
  for f in {q(run_dir)}/node-*.exit; do
    [ -e "$f" ] && [ "$(cat "$f" 2>/dev/null)" != 0 ] && [ -n "$(cat "$f" 2>/dev/null)" ] && break 2
  done
  [ -e {q(run_dir + "/" + STOP_REQUEST)} ] && break
  sleep 2
done
kill -0 "$pid" 2>/dev/null && ftb_stop {q(marker)}
exit 0
"""


def stop_script(node: NodePlan, run_id: str) -> str:
    """Run on a node's host to stop its job from outside (teardown, `ftbundle stop`)."""
    return stop_function(node) + f"\nftb_stop {shlex.quote(job_marker(run_id, node.rank))}\n"
