# ftbundle's node program: what runs on every host of a run.
# shellcheck shell=bash
#
# Shipped as this file's text: `bash -c "<this text>" ftb MODE ARGS...`. The text is fixed;
# every value arrives as an argument or in the environment, and nothing from a job file or
# an inventory is ever pasted into it.
#
# Modes:
#   node ARGV...   run the job's ARGV (see "the node channel" below); detached (FTB_DETACH=1),
#                  with its watcher beside it: FTB_WATCHER_PROGRAM (ftbundle/remote/watch.py)
#   job ARGV...    internal: the job itself, in its own session, output into the log
#   stop MARKER [CONTAINER]
#                  stop every process of one job on this host (teardown, `ftbundle stop`,
#                  fencing before a restart); exit 0 when none is left
#   state MARKER EXITFILE LOG STOPPEDFILE [GPU_FIELDS [GPU_IDS]]
#                  a node's state, its GPUs now, its last log line (`ftbundle status`)
#   follow MARKER LOG LINES       a node's log until its job ends (`ftbundle logs -f`)
#   resume-point DIR [look]       the newest complete checkpoint-N (restarts; look: remove nothing)
#   stage DIR MIN_FREE_MB [LEFTOVER...]
#                                 unpack a tar archive from stdin into DIR (the run dir)
#
# The node channel (mode `node`), one SSH channel from the controller:
#   stdin   first the environment: NAME=VALUE pairs, each ended by a NUL, then one more NUL
#           (secrets never appear on a command line); every line after it is a ping, but
#           `stop` (the controller's teardown). When pings stop for FTB_WATCHDOG seconds, or
#           stdin closes, or says stop, the node stops its job: a controller that disappears
#           (Ctrl-C, laptop lid, network cut) leaves nothing running; without `stop`, the node
#           says "launcher lost" in the log and in node-R.aN.stopped. A node program that
#           finds `stop` or a closed stdin already waiting never starts its job.
#   stderr  `ftb-gpu` on a host with nvidia-smi (a failed run reads its kernel log: ftb_xids),
#           `ftb-pid PID` once the job runs, then `ftb-hb [BYTES]` every FTB_HEARTBEAT seconds
#           (BYTES: how much the ranks have written so far, for the stall watchdog),
#           `ftb-steps LOCAL_RANK STEPS MEDIAN P90 [TOKENS SECONDS [PARAMS]][;...]` when the ranks' step times changed
#           (FTB_STEPS_FILE.<LOCAL_RANK>, local files; ftbundle/ui/stragglers.py),
#           `ftb-storage SECONDS` while shared storage does not answer, `ftb-storage ok` after,
#           `ftb-smi READING` every FTB_GPU_EVERY_MS on a GPU job's host (ftb_gpu_sampler),
#           and `ftbundle: ...` messages. Rank 0's log travels on a channel of its own
#           (`tail`), so output can never hold a heartbeat back.
#   exit    the job's exit code (also written to FTB_EXIT on shared storage).
#
# Variables (set by ftbundle/launch/node.py; every run-dir path is ftbundle/rundir.py's):
#   FTB_RUN_DIR FTB_LOG FTB_EXIT FTB_PIDFILE FTB_HBFILE FTB_STOPPED_FILE FTB_KEPT_STEPS_FILE
#   FTB_XIDS_FILE FTB_PROGRESS_FILE FTB_STACKED_FILE FTB_VERDICT_FILE FTB_STALLED_FILE FTB_STACKS_OUT
#   FTB_STACKS_PROGRAM FTB_PEER_{EXIT,HB,PROGRESS,STACKED}_GLOB FTB_REFEREE
#   FTB_WORKDIR FTB_MARKER FTB_ATTEMPT FTB_ENV_FILE FTB_PATH_PREPEND FTB_CONTAINER FTB_SECRET_NAMES
#   FTB_MIN_SECRET_LEN FTB_WATCHDOG FTB_HEARTBEAT FTB_STOP_GRACE FTB_DETACH FTB_STALE FTB_STOP_REQUEST
#   FTB_PROGRESS_FILES (paths and globs: the heartbeat carries their size every FTB_PROGRESS_EVERY beats)
#   FTB_STALL_TIMEOUT (detached: the stall watchdog's limit) FTB_PROGRESS_STEPS (trainer_log.jsonl)
#   FTB_GPU_EVERY_MS FTB_GPU_FIELDS FTB_GPU_IDS (a GPU job: its GPUs read this often, `ftb-smi ...`)
#   FTB_SHARED_DIR FTB_STORAGE_SLOW (shared storage unanswered this long: `ftb-storage`; see ftb_ask)
set -u

ftb_pids() { grep -lzxF "FTB_JOB=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; }

ftb_now_us() {  # microseconds (bash 5's EPOCHREALTIME; whole seconds on an older bash)
  local t=${EPOCHREALTIME:-}
  if [ -n "$t" ]; then echo "${t/[.,]/}"; else echo $(( SECONDS * 1000000 )); fi
}

ftb_sleep() {  # SECONDS: a wait that starts no process, for the loops that run every second
  # `read -t` on a pipe that nothing writes (opened once per shell); `sleep` where bash cannot
  # make one, with none of our streams: a killed loop must not leave one holding a channel open
  [ -n "${FTB_SLEEP_FD:-}" ] || { exec {FTB_SLEEP_FD}<> <(:); } 2>/dev/null || FTB_SLEEP_FD=none
  # shellcheck disable=SC2217  # (sleep's stdin from /dev/null on purpose: none of our streams)
  if [ "$FTB_SLEEP_FD" != none ]; then read -r -t "$1" -u "$FTB_SLEEP_FD" _
  else sleep "$1" </dev/null >/dev/null 2>&1; fi
  return 0
}

ftb_stop() {  # MARKER [CONTAINER]: SIGTERM, then SIGKILL after the grace period
  local p end
  p=$(ftb_pids "$1")
  # (CONT: a stopped process, under a debugger or SIGSTOP, gets its SIGTERM now, not at SIGKILL)
  # shellcheck disable=SC2086  # ($p: the job's PIDs, one word each)
  [ -n "$p" ] && { kill -TERM $p; kill -CONT $p; } 2>/dev/null
  [ -n "${2:-}" ] && docker rm -f "$2" >/dev/null 2>&1
  # the grace period is wall time: on a loaded host each look at /proc takes a while, and
  # counting looks instead would stretch the grace far past what the controller waits for
  end=$(( $(ftb_now_us) + ${FTB_STOP_GRACE:-3} * 1000000 ))
  while [ "$(ftb_now_us)" -lt "$end" ]; do
    p=$(ftb_pids "$1"); [ -z "$p" ] && return 0
    sleep 0.1
  done
  p=$(ftb_pids "$1")
  # shellcheck disable=SC2086  # ($p: PIDs, one word each)
  kill -KILL $p 2>/dev/null
  [ -n "${2:-}" ] && docker rm -f "$2" >/dev/null 2>&1
  sleep 0.2
  p=$(ftb_pids "$1")
  # shellcheck disable=SC2086  # ($p: PIDs, one word each)
  [ -z "$p" ] || { ftb_unkilled $p; return 1; }
}

ftb_unkilled() {  # PID...: processes a SIGKILL did not end, named on stderr with their state
  local p s out="" d=""
  for p; do
    s=""; { read -r s <"/proc/$p/stat"; } 2>/dev/null
    s=${s##*) }; s=${s%% *}
    out+=" $p (${s:-gone})"; [ "$s" = D ] && d=1
  done
  echo "ftbundle: still there on $HOSTNAME after SIGKILL:$out${d:+; D: waiting in the kernel, on storage or a device that does not answer (they end when it answers)}" >&2
}

ftb_progress() {  # FTB_P=" BYTES": the size of everything the job's ranks wrote (stall watchdog, ftbundle/launch/stall.py)
  # One stat for every rank of the node; empty when FTB_PROGRESS_FILES is unset (watchdog off).
  # Into a variable, not on stdout: a caller's $(...) would be one more process per reading.
  FTB_P=""
  [ -n "${FTB_PROGRESS_FILES:-}" ] || return 0
  local n sum=0 steps=""
  # (unquoted on purpose: the list holds globs, one for every local rank's output files)
  # shellcheck disable=SC2086
  for n in $(stat -c %s -- $FTB_PROGRESS_FILES 2>/dev/null); do sum=$((sum + n)); done
  # FTB_PROGRESS_STEPS (rank 0 of a LlamaFactory job): the trainer's log, whose first line is
  # the first step: the stall clock starts there, not at the model loading's output
  [ -n "${FTB_PROGRESS_STEPS:-}" ] && { steps=$(stat -c %s -- "$FTB_PROGRESS_STEPS" 2>/dev/null) || steps=0; }
  FTB_P=" $sum${steps:+ $steps}"
}

# -- shared storage that stops answering (a hung network filesystem) ---------------------------
# A process that touches a frozen NFS or sshfs waits in the kernel for as long as the freeze
# lasts, and a signal only turns it to D state (kill -9 leaves it there): so a loop that must go
# on (the heartbeat) never touches shared storage itself. It asks a child (ftb_ask), reads the
# answer on a later beat (ftb_answered), and never waits for a child that does not answer: it is
# abandoned, its pipe closed, and no second one is started while it hangs. The child stats a name
# never used before under FTB_SHARED_DIR (no cache can answer that) along with the ranks' output
# files (the stall watchdog's progress): one process serves both.
ftb_ask() {  # start a reading: FTB_ASK_FD (its stdout), FTB_ASKED (when, $SECONDS), FTB_ASK_PID
  FTB_ASKED=$SECONDS FTB_PSUM=0 FTB_PSTEPS=""
  # (unquoted on purpose: the list holds globs, one for every local rank's output files)
  # shellcheck disable=SC2086  # (FTB_PROGRESS_FILES: globs, unquoted on purpose as above)
  exec {FTB_ASK_FD}< <(exec stat -c '%s %n' -- "${FTB_SHARED_DIR:-$FTB_RUN_DIR}/.ftb-probe-$HOSTNAME-$BASHPID-$SECONDS-$RANDOM" \
    ${FTB_PROGRESS_FILES:-} ${FTB_PROGRESS_STEPS:+"$FTB_PROGRESS_STEPS"} </dev/null 2>/dev/null)
  FTB_ASK_PID=$!
}

ftb_why() {  # FTB_WHY: the reading asked by ftb_ask, not answered yet, as the kernel shows it (read
  # with bash's `read`: no process): "" when it is blocked in the kernel (S or D, in its stat: the
  # storage holds it), Z when it has just ended (answered: nothing to say), else " STATE WCHAN LOAD"
  # (R: runnable, not run; "-": not at its program yet; LOAD: /proc/loadavg's first): a host too busy
  # to run it, not a hung filesystem (ftbundle/remote/evidence.py decides, launch/storage.py words it).
  # Before its exec the child is still bash, expanding the progress globs: a readdir of the frozen
  # storage holds it there, asleep in the filesystem; said with where it waits (S/D WCHAN), so that
  # the evidence rule tells the storage from this host's own disk or memory
  local st="" w="" load="" state
  { read -r st <"/proc/$FTB_ASK_PID/stat"; } 2>/dev/null
  { read -r w <"/proc/$FTB_ASK_PID/wchan"; } 2>/dev/null
  { read -r load _ </proc/loadavg; } 2>/dev/null
  state=${st##*) }; state=${state%% *}
  case $st in
    "") FTB_WHY=Z ;;
    *"(stat) "*) case $state in S|D) FTB_WHY="" ;; Z|X) FTB_WHY=Z ;; *) FTB_WHY=" $state ${w:-0} ${load:-?}" ;; esac ;;
    *) case $state in S|D) FTB_WHY=" $state ${w:-0} ${load:-?}" ;; *) FTB_WHY=" - ${w:-0} ${load:-?}" ;; esac ;;
  esac
}

ftb_answered() {  # [WAIT]: whether the reading asked by ftb_ask has answered (waiting for it up to
  # WAIT seconds; none: only a look); its progress into FTB_P
  # (stat's output is one write at its exit: lines ready means its end is a moment away)
  local line rc
  [ -n "${1:-}" ] || read -r -t 0 -u "$FTB_ASK_FD" || return 1
  while :; do
    IFS= read -r -t "${1:-1}" -u "$FTB_ASK_FD" line; rc=$?
    [ "$rc" -gt 128 ] && return 1  # (not ended yet: looked at again next beat)
    if [ -n "$line" ]; then
      if [ "${line#* }" = "${FTB_PROGRESS_STEPS:-}" ]; then FTB_PSTEPS=${line%% *}
      else FTB_PSUM=$((FTB_PSUM + ${line%% *})); fi
    fi
    [ "$rc" = 0 ] || break
  done
  exec {FTB_ASK_FD}<&-; FTB_ASK_FD=""
  FTB_P=""
  [ -z "${FTB_PROGRESS_FILES:-}" ] || FTB_P=" $FTB_PSUM${FTB_PROGRESS_STEPS:+ ${FTB_PSTEPS:-0}}"
  return 0
}

ftb_steps() {  # FTB_S: the local ranks' step times, "LOCAL_RANK STEPS MEDIAN P90" joined by ';'
  # (shims/steptimes.py writes FTB_STEPS_FILE.<LOCAL_RANK> on this host's own disk, never on shared
  # storage: a read here cannot hang the heartbeat; a glob and bash's `read`, no process)
  FTB_S=""
  [ -n "${FTB_STEPS_FILE:-}" ] || return 0
  local f l
  for f in "$FTB_STEPS_FILE".[0-9]*; do
    case $f in *.tmp|*"]"*) continue ;; esac
    l=""; { IFS= read -r l <"$f"; } 2>/dev/null
    [ -n "$l" ] && FTB_S+="${FTB_S:+;}$l"
  done
}

ftb_steps_away() {  # the ranks' step-time files and their folder on this host, once the job is over
  [ -n "${FTB_STEPS_FILE:-}" ] || return 0
  rm -f -- "$FTB_STEPS_FILE".[0-9]* 2>/dev/null
  case ${FTB_STEPS_FILE%/*} in /tmp/ftb-steps-?*) rmdir -- "${FTB_STEPS_FILE%/*}" 2>/dev/null ;; esac
  return 0
}

# -- ftb_env, ftb_env_file_secrets, mode_job: node_env.sh's, put here by launch/node.py program() --

ftb_write() {  # FILE TEXT: whole or not at all (a full disk leaves no 0-byte file)
  { echo "$2" >"$1.tmp" && mv -f -- "$1.tmp" "$1"; } 2>/dev/null || { rm -f -- "$1.tmp"; return 1; }
}

ftb_disk_full() {  # DIR: say so (exit 0) when the filesystem under DIR has less than 64 KiB free
  # asked of a child, answered within 2 s or not at all: a frozen network filesystem is not full,
  # and this program must still end (the child is abandoned; see ftb_ask)
  local fd free=()
  exec {fd}< <(exec stat -f -c '%a %S' -- "$1" </dev/null 2>/dev/null)
  read -r -t 2 -u "$fd" -a free
  exec {fd}<&-
  [ "${#free[@]}" = 2 ] && [ $((free[0] * free[1] / 1024)) -lt 64 ]
}

mode_node() {
  ftb_env
  # The gate: what the launcher said while this program was on its way (a slow session
  # start, a late channel). `stop` or a closed stdin: the launcher is stopping (or gone),
  # and a job started now would run beside the next attempt. Pings are just pings.
  # (read -t 0 only looks: no wait when nothing is pending, the usual case)
  local line
  while read -r -t 0; do
    if ! IFS= read -r line; then
      echo "ftbundle: not starting on $(hostname): the launcher's connection closed before it began here" >&2; exit 95
    fi
    if [ "$line" = stop ]; then
      echo "ftbundle: not starting on $(hostname): the launcher stopped attempt ${FTB_ATTEMPT:-?} before it began here" >&2; exit 95
    fi
  done
  [ -d "$FTB_RUN_DIR" ] || mkdir -p -- "$FTB_RUN_DIR" || { echo "ftbundle: cannot create $FTB_RUN_DIR on $(hostname)" >&2; exit 96; }
  cd -- "$FTB_WORKDIR" || { echo "ftbundle: workdir $FTB_WORKDIR missing on $(hostname)" >&2; exit 96; }
  if [ "${FTB_DETACH:-0}" = 1 ] && ! command -v python3 >/dev/null; then  # (its watcher's; a lookup, no process)
    echo "ftbundle: no python3 on $(hostname): a detached run's watcher (ftbundle/remote/watch.py) needs one" >&2; exit 96
  fi
  [ ! -e "$FTB_EXIT" ] || rm -f -- "$FTB_EXIT"  # (rm is a process: only when there is one)
  # the stall watchdog's baseline, read before the job can write anything (empty when it is off)
  local base=""; [ -z "${FTB_PROGRESS_FILES:-}" ] || { ftb_progress; base=$FTB_P; }
  FTB_NOTIFY_WEBHOOK='' FTB_NOTIFY_COMMAND='' FTB_JOB=$FTB_MARKER \
    setsid bash -c "$BASH_EXECUTION_STRING" ftb job "$@" </dev/null >/dev/null 2>&1 &  # (the watcher's, not the job's)
  local pid=$!
  echo "$pid $FTB_MARKER $(hostname)" >"$FTB_PIDFILE"
  # the run's claims on this host hold while its job runs (remote/claims.py): marked started
  [ ! -d "${FTB_CLAIM_DIR:-}" ] || { : >"$FTB_CLAIM_DIR/${FTB_RUN_DIR##*/}.started"; } 2>/dev/null
  # (a GPU host: a failed run's summary reads its kernel log for Xids, ftb_xids; a lookup, no process)
  if command -v nvidia-smi >/dev/null 2>&1; then echo "ftb-gpu" >&2; fi
  echo "ftb-pid $pid" >&2
  if [ "${FTB_DETACH:-0}" = 1 ]; then
    # the detached watcher (heartbeats, rank 0's referee, the stall watchdog): a Python program
    # staged in the run directory (ftbundle/remote/watch.py), given this program's text for its
    # `stop` and `xids` (an argument, as it is ours: in the environment, a look for FTB_JOB= would
    # find it there)
    setsid python3 -I -S "$FTB_WATCHER_PROGRAM" "$pid" "$base" "$BASH_EXECUTION_STRING" </dev/null >/dev/null 2>&1 &
    exit 0
  fi
  # the first heartbeat is the baseline (the launcher's stall clock starts at the first change)
  [ -z "$base" ] || echo "ftb-hb$base" >&2
  local smipid="" smiloop=""
  if [ "${FTB_GPU_EVERY_MS:-0}" != 0 ] && command -v nvidia-smi >/dev/null 2>&1; then ftb_gpu_sampler; fi
  # A beat costs no process: the wait is ftb_sleep's, and the progress and shared storage (a
  # `stat`, ftb_ask) are read every FTB_PROGRESS_EVERY beats (stall_timeout / 30, at most 10 s,
  # at least every beat), not on every one: three processes a second on every node were nearly
  # all of an idle node's CPU (3 ms a second). A reading not answered for FTB_STORAGE_SLOW
  # seconds is said every beat (`ftb-storage SECONDS`, with how it waits when that is not the
  # storage: ftb_why) until it answers (`ftb-storage ok`); the heartbeat goes on (launch/storage.py).
  ( beats=0 said=0 FTB_ASK_FD="" waited=0 steps_said=""
    while kill -0 "$pid" 2>/dev/null; do
      ftb_steps
      [ "$FTB_S" = "$steps_said" ] || { echo "ftb-steps $FTB_S" >&2; steps_said=$FTB_S; }
      FTB_P=""
      if [ -n "$FTB_ASK_FD" ]; then
        if ftb_answered; then
          [ "$said" = 0 ] || { echo "ftb-storage ok" >&2; said=0; }
        elif [ $((waited = SECONDS - FTB_ASKED)) -ge "${FTB_STORAGE_SLOW:-5}" ]; then
          ftb_why  # (how it waits: the storage, or this host too busy to run it)
          [ "$FTB_WHY" = Z ] || { echo "ftb-storage $waited$FTB_WHY" >&2; said=1; }
        fi
      fi
      echo "ftb-hb$FTB_P" >&2
      [ -n "$FTB_ASK_FD" ] || [ $((beats % ${FTB_PROGRESS_EVERY:-1})) != 0 ] || ftb_ask
      beats=$((beats + 1))
      ftb_sleep "$FTB_HEARTBEAT"
    done ) &
  local hbpid=$!
  # (a background job reads /dev/null unless told otherwise: hand it our stdin explicitly)
  # The watchdog: `stop` from the launcher stops the job quietly; a closed stdin or no
  # ping for FTB_WATCHDOG seconds means the launcher is lost: that is written into the
  # job's log and beside its exit file (node-R.aN.stopped; `ftbundle runs` and `status`).
  # It tells this program (USR1) before it stops the job: the job's main process may end at
  # the SIGTERM while a rank that ignores it lives on, and this program then waits for the
  # watchdog's SIGKILL instead of ending first. So when this program exits, nothing of the
  # job is left on this host, and the launcher needs no second channel to make sure of it.
  local stopping=0
  trap 'stopping=1' USR1
  ( why='' rc=0
    while :; do
      IFS= read -r -t "$FTB_WATCHDOG" line; rc=$?
      if [ "$rc" = 0 ]; then [ "$line" = stop ] && break; continue; fi
      if [ "$rc" -gt 128 ]; then why="no ping from the launcher for ${FTB_WATCHDOG}s"; else why="the launcher's connection closed"; fi
      break
    done
    kill -USR1 $$ 2>/dev/null  # ($$: the node program, not this subshell)
    if [ -n "$why" ]; then
      echo "ftbundle: launcher lost ($why): stopping the job on $(hostname)" >>"$FTB_LOG"
      ftb_write "$FTB_STOPPED_FILE" "launcher lost: $why"
    fi
    ftb_stop "$FTB_MARKER" "${FTB_CONTAINER:-}" ) <&0 &
  local wdpid=$!
  wait "$pid"
  local rc=$?
  # (a USR1 ends that wait with 138 while the job may still run: wait again; 127 from the
  # second wait: the job itself had ended with 138)
  if [ "$rc" = 138 ] && [ "$stopping" = 1 ]; then wait "$pid"; local again=$?; [ "$again" = 127 ] || rc=$again; fi
  kill "$hbpid" 2>/dev/null
  [ -z "$smipid" ] || kill "$smipid" "$smiloop" 2>/dev/null
  if [ -n "${FTB_STEPS_FILE:-}" ]; then  # the ranks' last step times (written at the trainer's end), then away
    ftb_steps; [ -z "$FTB_S" ] || echo "ftb-steps $FTB_S" >&2
    ftb_steps_away
  fi
  if [ "$stopping" = 1 ]; then
    wait "$wdpid"  # its stop ends with a SIGKILL to whatever is left
    # an attached run's rank 0: if it was its launcher that was lost, nobody else will say the run
    # ended (remote/tell.py reads why from the stopped file, off this program: it may be on a storage
    # that does not answer; it says nothing of a stop its launcher asked for)
    if [ -n "${FTB_TELLER_PROGRAM:-}" ] && command -v python3 >/dev/null; then
      setsid python3 -I -S "$FTB_TELLER_PROGRAM" "$SECONDS" </dev/null >/dev/null 2>&1 &
    fi
  else
    kill "$wdpid" 2>/dev/null
    # the job's main process ended by itself: a rank or helper it left behind goes with it
    [ -z "$(ftb_pids "$FTB_MARKER")" ] || ftb_stop "$FTB_MARKER" "${FTB_CONTAINER:-}"
  fi
  if [ "$rc" != 0 ] && ftb_disk_full "$FTB_RUN_DIR"; then
    echo "ftbundle: no space left on the device under $FTB_RUN_DIR on $(hostname) (ENOSPC): the job's log and exit record may be cut" >&2
  fi
  ftb_release
  exit "$rc"
}

ftb_gpu_sampler() {  # smipid smiloop: the job's GPUs (FTB_GPU_IDS) read every FTB_GPU_EVERY_MS by one
  # nvidia-smi loop (-lms: one process for the run), a reading (a line a GPU) sent as one `ftb-smi`
  # line, ';' between GPUs (ftbundle/gpu_metrics.py). A reading is whole when the first GPU's index
  # comes again or after 0.2 s without a line; between readings the loop waits in `read`. (Not
  # awk: mawk holds a pipe's lines until its buffer fills.)
  local fd line all
  exec {fd}< <(exec nvidia-smi --query-gpu="$FTB_GPU_FIELDS" --format=csv,noheader,nounits \
    ${FTB_GPU_IDS:+-i "$FTB_GPU_IDS"} -lms "$FTB_GPU_EVERY_MS" </dev/null 2>/dev/null)
  smipid=$!
  ( all="" first="" rc=0
    while :; do
      if [ -n "$all" ]; then IFS= read -r -t 0.2 -u "$fd" line; else IFS= read -r -u "$fd" line; fi
      rc=$?
      if [ "$rc" = 0 ] && { [ -z "$all" ] || [ "${line%%,*}" != "$first" ]; }; then
        [ -n "$all" ] || first=${line%%,*}
        all+="${all:+;}$line"; continue
      fi
      [ -z "$all" ] || echo "ftb-smi $all" >&2
      all="" first=${line%%,*}
      if [ "$rc" = 0 ]; then all=$line; elif [ "$rc" -le 128 ]; then break; fi
    done ) &
  smiloop=$!
  exec {fd}<&-
}

ftb_release() {  # the run's claims on this host (remote/claims.py: KEY@RUN), once its job is over here
  local run=${FTB_RUN_DIR##*/} f
  [ -d "${FTB_CLAIM_DIR:-}" ] || return 0
  local -a mine=()
  for f in "$FTB_CLAIM_DIR"/*@"$run" "$FTB_CLAIM_DIR/$run.started"; do [ ! -e "$f" ] || mine+=("$f"); done
  [ "${#mine[@]}" = 0 ] || rm -f -- "${mine[@]}"
}

mode_state() {  # MARKER EXITFILE LOG STOPPEDFILE [GPU_FIELDS [GPU_IDS]]: running | exited N | stopped[: why],
  # then (a GPU job running here) one reading of its GPUs as `ftb-smi` lines, then the log's last line
  if [ -n "$(ftb_pids "$1")" ]; then
    echo running
    if [ -n "${5:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
      # ("ftb-smi -": it gave nothing within 2 s: hung, as on a GPU that stopped responding)
      timeout 2 nvidia-smi --query-gpu="$5" --format=csv,noheader,nounits ${6:+-i "$6"} 2>/dev/null |
        sed 's/^/ftb-smi /' | grep . || echo "ftb-smi -"
    fi
  elif [ -s "$2" ]; then echo "exited $(cat -- "$2")"
  elif [ -s "$4" ]; then echo "stopped: $(cat -- "$4")"
  elif ftb_disk_full "$(dirname -- "$2")"; then echo "stopped: no space left on $(dirname -- "$2") on $(hostname) (ENOSPC)"
  else echo stopped; fi
  # (not the model card's words the trainer prints at its end: "Dropping the following result ...",
  # then its dict {'task': {'name': 'Causal Language ...)
  tail -n 4 -- "$3" 2>/dev/null | tr '\r' '\n' |
    grep -v -e '^[[:space:]]*$' -e "^{'task': " -e '>> Dropping the following result as it' | tail -n 1
  exit 0
}

ftb_follow() {  # MARKER STORAGE TAIL_ARGS...: `tail TAIL_ARGS` (a -F of files on shared storage
  # STORAGE) until the job MARKER is gone (`ftbundle logs -f`). tail's output reaches our stdout
  # through a `cat` of its own: a tail that the storage holds (D state: not even SIGKILL ends it
  # while the storage does not answer) then holds only that pipe, never the channel, and the
  # follow still ends. While the storage does not answer (a stat in a child never waited on, as
  # the heartbeat's: ftb_ask), stderr says so after FTB_STORAGE_SLOW seconds and every 30 s after,
  # and once when it answers again. tail ends by its --pid, a stand-in ended with the job: it reads
  # its files once more first (coreutils), so the job's last line is never lost to a kill that
  # comes before tail's next poll. Exit 0; 3 when the log's end could not be read.
  local marker=$1 FTB_SHARED_DIR=$2 FTB_PROGRESS_FILES="" FTB_PROGRESS_STEPS="" FTB_ASK_FD="" FTB_ASKED=0
  local said=0 next=${FTB_STORAGE_SLOW:-5} waited fd tpid cpid spid st n
  shift 2
  hash grep cut stat cat tail 2>/dev/null  # (looked up now: PATH may lead onto the storage)
  ( while kill -0 "$$" 2>/dev/null; do ftb_sleep 1; done ) </dev/null >/dev/null 2>&1 &  # (dies with us)
  spid=$!
  exec {fd}< <(exec tail --pid="$spid" "$@" 2>/dev/null)
  tpid=$!
  cat <&"$fd" &
  cpid=$!
  exec {fd}<&-
  while [ -n "$(ftb_pids "$marker")" ]; do
    if [ -n "$FTB_ASK_FD" ]; then
      if ftb_answered; then
        [ "$said" = 0 ] || echo "ftbundle: shared storage $FTB_SHARED_DIR on $HOSTNAME answers again" >&2
        said=0 next=${FTB_STORAGE_SLOW:-5}
      elif [ $((waited = SECONDS - FTB_ASKED)) -ge "$next" ]; then
        echo "ftbundle: shared storage $FTB_SHARED_DIR on $HOSTNAME not answering for ${waited}s: the log cannot be read (and every rank that writes there waits too)" >&2
        said=1 next=$((waited + 30))
      fi
    fi
    [ -n "$FTB_ASK_FD" ] || ftb_ask
    ftb_sleep 1
  done
  # (the job ended: its last processes may have waited on the storage, which answers again then)
  if [ "$said" = 1 ] && [ -n "$FTB_ASK_FD" ] && ftb_answered 3; then
    echo "ftbundle: shared storage $FTB_SHARED_DIR on $HOSTNAME answers again" >&2
  fi
  kill -KILL "$spid" 2>/dev/null
  wait "$spid" 2>/dev/null  # (reaped: a zombie would still answer tail's kill -0)
  for n in {1..15}; do  # cat ends once tail has (its next poll, a second, and its last read);
    st=""; { read -r st </proc/"$cpid"/stat; } 2>/dev/null; st=${st##*) }  # a tail the storage holds does not
    case "${st%% *}" in ""|Z) return 0 ;; esac
    ftb_sleep 0.2
  done
  kill "$tpid" "$cpid" 2>/dev/null
  echo "ftbundle: the end of the log could not be read: shared storage $FTB_SHARED_DIR on $HOSTNAME does not answer" >&2
  return 3
}

mode_follow() {  # MARKER LOG LINES [STORAGE]: the log, followed until the job is gone (ftb_follow)
  ftb_follow "$1" "${4:-${2%/*}}" -n "$3" -F -- "$2"
  exit $?
}

mode_tail_ranks() {  # LINES FOLLOW MARKER LOG RANKS_DIR STORAGE LOCAL...: for each local rank
  # asked, its output file(s): local rank 0's is the node's log (with torchrun's own lines),
  # another's are its stdout and stderr in torchrun's --log-dir (the newest attempt's); then
  # `tail -v` of them all (==> path <== headers), and with FOLLOW=1 ftb_follow of them until the
  # node's job is gone (`ftbundle logs --all`)
  local lines=$1 follow=$2 marker=$3 log=$4 ranks=$5 storage=$6 files want l d
  shift 6
  collect() {
    files=() want=0
    for l in "$@"; do
      if [ "$l" = 0 ]; then files+=("$log"); want=$((want + 1)); continue; fi
      want=$((want + 2))
      # shellcheck disable=SC2012  # (newest by time; the names are torchrun's own: digits and _)
      d=$(ls -1td -- "$ranks"/*/attempt_*/"$l" 2>/dev/null | head -n 1)
      if [ -n "$d" ]; then files+=("$d/stdout.log" "$d/stderr.log"); fi
    done
  }
  collect "$@"
  if [ "$follow" = 1 ]; then  # a job just started: torchrun makes the ranks' files a moment later
    for _ in $(seq 60); do
      [ "${#files[@]}" -ge "$want" ] && break
      [ -n "$(ftb_pids "$marker")" ] || break
      sleep 0.5; collect "$@"
    done
  fi
  [ "${#files[@]}" -gt 0 ] || exit 0
  if [ "$follow" = 0 ]; then exec tail -v -n "$lines" -- "${files[@]}" 2>/dev/null; fi
  ftb_follow "$marker" "$storage" -v -n "$lines" -F -- "${files[@]}"
  exit $?
}

mode_resume_point() {  # DIR [look]: drop an incomplete newest checkpoint, print the newest complete
  # one; with `look` (the check) nothing is removed: what a run would remove is said
  local last
  last=$(ftb_newest_checkpoint "$1")
  if [ -n "$last" ] && [ ! -e "$1/$last/trainer_state.json" ]; then
    if [ "${2:-}" = look ]; then
      echo "incomplete checkpoint $last: the run removes it" >&2
      ftb_newest_checkpoint "$1" complete
      exit 0
    fi
    rm -rf -- "${1:?}/$last"; echo "removed incomplete checkpoint $last" >&2
  fi
  ftb_newest_checkpoint "$1"
  exit 0
}

ftb_newest_checkpoint() {  # DIR [complete]: the name of its checkpoint-N with the highest N (nothing
  # when none); with `complete`, of those holding a trainer_state.json
  local f n best=-1 name=""
  for f in "$1"/checkpoint-*; do
    n=${f##*/checkpoint-}
    [[ $n =~ ^[0-9]+$ ]] || continue
    [ "${2:-}" != complete ] || [ -e "$f/trainer_state.json" ] || continue
    if [ "$((10#$n))" -gt "$best" ]; then best=$((10#$n)); name=${f##*/}; fi
  done
  [ -z "$name" ] || echo "$name"
}

mode_stage() {  # DIR MIN_FREE_MB [LEFTOVER...]: create DIR, unpack the tar archive on stdin
  # into it, then remove the LEFTOVER paths (the check's sentinels: one round trip for both).
  # Refused when DIR's filesystem has less than MIN_FREE_MB free. The files are unpacked
  # beside DIR's and renamed into place: whole, or not there (a full disk, a killed tar).
  # (5 processes: staging holds every node's start, so each one counts)
  local dir=$1 min=$2 tmp=$1/.stage.$$ free at; shift 2
  if [ "$min" -gt 0 ]; then
    # the space df calls available: blocks free to users x their size (one process, not df|awk),
    # read before anything is created: a refused start leaves no empty run directory behind
    at=$dir
    while [ ! -e "$at" ] && [ "${at%/*}" != "$at" ]; do at=${at%/*}; at=${at:-/}; done
    read -r -a free <<<"$(stat -f -c '%a %S' -- "$at" 2>/dev/null)"
    if [ "${#free[@]}" = 2 ] && [ $((free[0] * free[1] / 1048576)) -lt "$min" ]; then
      echo "only $((free[0] * free[1] / 1048576)) MB free under $dir on $(hostname) (a run needs at least $min MB for its logs and records)" >&2
      exit 28
    fi
  fi
  mkdir -p -- "$tmp" || exit $?
  { tar -xf - -C "$tmp" && mv -f -- "$tmp"/* "$dir"/; } || { rc=$?; rm -rf -- "$tmp"; exit "$rc"; }
  rmdir -- "$tmp"
  if [ $# -gt 0 ]; then rm -rf -- "$@"; fi
  exit 0
}

ftb_xids() {  # WINDOW_S [SINCE]: on a host with nvidia-smi (its node program said ftb-gpu), what a
  # failed run's summary reads (launch/supervisor.py, and runs.py for a detached run): "uptime
  # SECONDS" (the kernel's clock, which the log's stamps count), the GPUs' index, UUID and PCI
  # address ("smi: " lines, nvidia-smi's CSV with its header: a GPU fallen off the bus may make it
  # slow, so 2 s at most), then the kernel log's NVRM Xid lines (dmesg; where dmesg is refused, the
  # journal's kernel messages of the window). With SINCE (the kernel's uptime in whole seconds when
  # the job began) only the lines stamped from then on, and nothing at all when there is none.
  # Nothing on a host without nvidia-smi.
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  local up _ line s
  local -a found=()
  { read -r up _ </proc/uptime; } 2>/dev/null
  while IFS= read -r line; do
    if [ -n "${2:-}" ]; then
      s=${line#*[}; s=${s%%]*}; s=${s// /}; s=${s%%.*}
      { [[ $s =~ ^[0-9]+$ ]] && [ "$s" -ge "$2" ]; } || continue
    fi
    found+=("$line")
  done < <({ dmesg 2>/dev/null || journalctl -k -o short-monotonic --no-pager --since="-${1:-3600}s" 2>/dev/null; } |
           grep -F 'NVRM: Xid' | tail -n 100)
  [ -z "${2:-}" ] || [ "${#found[@]}" -gt 0 ] || return 0
  echo "uptime ${up:-}"
  timeout 2 nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv 2>/dev/null | while IFS= read -r line; do
    echo "smi: $line"
  done
  [ "${#found[@]}" = 0 ] || printf '%s\n' "${found[@]}"
}

mode=${1:-}; shift || true
case $mode in
  node) mode_node "$@" ;;
  job) mode_job "$@" ;;
  stop) ftb_stop "$@"; exit $? ;;
  state) mode_state "$@" ;;
  follow) mode_follow "$@" ;;
  tail-ranks) mode_tail_ranks "$@" ;;
  resume-point) mode_resume_point "$@" ;;
  stage) mode_stage "$@" ;;
  xids) ftb_xids "$@"; exit 0 ;;
  *) echo "ftbundle node program: unknown mode '$mode'" >&2; exit 2 ;;
esac
