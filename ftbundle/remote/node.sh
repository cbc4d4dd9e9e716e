# ftbundle's node program: what runs on every host of a run.
#
# Shipped as this file's text: `bash -c "<this text>" ftb MODE ARGS...`. The text is fixed;
# every value arrives as an argument or in the environment, and nothing from a job file or
# an inventory is ever pasted into it.
#
# Modes:
#   node ARGV...   run the job's ARGV (see "the node channel" below)
#   job ARGV...    internal: the job itself, in its own session, output into the log
#   watch PID      internal: a detached node's watcher (peers' state on shared storage)
#   stall-watch PID  internal: a detached node's stall watchdog (progress files; rank 0 referees)
#   stop MARKER [CONTAINER]
#                  stop every process of one job on this host (teardown, `ftbundle stop`,
#                  fencing before a restart); exit 0 when none is left
#   state MARKER EXITFILE LOG     a node's state and last log line (`ftbundle status`)
#   follow MARKER LOG LINES       a node's log until its job ends (`ftbundle logs -f`)
#   resume-point DIR              the newest complete checkpoint-N (restarts)
#   stage DIR                     unpack a tar archive from stdin into DIR (the run dir)
#
# The node channel (mode `node`), one SSH channel from the controller:
#   stdin   first the environment: NAME=VALUE pairs, each ended by a NUL, then one more NUL
#           (secrets never appear on a command line); every line after it is a ping. When pings stop
#           for FTB_WATCHDOG seconds, or stdin closes, the node stops its job: a controller
#           that disappears (Ctrl-C, laptop lid, network cut) leaves nothing running.
#   stderr  `ftb-pid PID` once the job runs, then `ftb-hb [BYTES]` every FTB_HEARTBEAT seconds
#           (BYTES: how much the ranks have written so far, for the stall watchdog),
#           and `ftbundle: ...` messages. Rank 0's log travels on a channel of its own
#           (`tail`), so output can never hold a heartbeat back.
#   exit    the job's exit code (also written to FTB_EXIT on shared storage).
#
# Variables used (set by the controller, see ftbundle/launch/node.py):
#   FTB_RUN_DIR FTB_WORKDIR FTB_LOG FTB_EXIT FTB_PIDFILE FTB_HBFILE FTB_MARKER FTB_ATTEMPT
#   FTB_ENV_FILE FTB_PATH_PREPEND FTB_CONTAINER FTB_SECRET_NAMES FTB_MIN_SECRET_LEN
#   FTB_WATCHDOG FTB_HEARTBEAT FTB_STOP_GRACE FTB_DETACH FTB_STALE FTB_STOP_REQUEST
#   FTB_PROGRESS_FILES (space-separated paths and globs: the heartbeat carries their total size)
#   FTB_STALL_TIMEOUT (detached runs: the stall watchdog's limit; 0 or empty: off)
#   FTB_PROGRESS_STEPS (rank 0 of a LlamaFactory job: trainer_log.jsonl, the first step starts the stall clock)
set -u

ftb_pids() { grep -lzxF "FTB_JOB=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; }

ftb_now_us() {  # microseconds (bash 5's EPOCHREALTIME; whole seconds on an older bash)
  local t=${EPOCHREALTIME:-}
  if [ -n "$t" ]; then echo "${t/[.,]/}"; else echo $(( SECONDS * 1000000 )); fi
}

ftb_stop() {  # MARKER [CONTAINER]: SIGTERM, then SIGKILL after the grace period
  local p end
  p=$(ftb_pids "$1")
  [ -n "$p" ] && kill -TERM $p 2>/dev/null
  [ -n "${2:-}" ] && docker rm -f "$2" >/dev/null 2>&1
  # the grace period is wall time: on a loaded host each look at /proc takes a while, and
  # counting looks instead would stretch the grace far past what the controller waits for
  end=$(( $(ftb_now_us) + ${FTB_STOP_GRACE:-3} * 1000000 ))
  while [ "$(ftb_now_us)" -lt "$end" ]; do
    p=$(ftb_pids "$1"); [ -z "$p" ] && return 0
    sleep 0.1
  done
  p=$(ftb_pids "$1")
  kill -KILL $p 2>/dev/null
  [ -n "${2:-}" ] && docker rm -f "$2" >/dev/null 2>&1
  sleep 0.2
  [ -z "$(ftb_pids "$1")" ]
}

ftb_progress() {  # " BYTES": the size of everything the job's ranks wrote (stall watchdog, ftbundle/launch/stall.py)
  # One stat for every rank of the node; nothing when FTB_PROGRESS_FILES is unset (watchdog off).
  [ -n "${FTB_PROGRESS_FILES:-}" ] || return 0
  local n sum=0 steps=""
  # (unquoted on purpose: the list holds globs, one for every local rank's output files)
  for n in $(stat -c %s -- $FTB_PROGRESS_FILES 2>/dev/null); do sum=$((sum + n)); done
  # FTB_PROGRESS_STEPS (rank 0 of a LlamaFactory job): the trainer's log, whose first line is
  # the first step: the stall clock starts there, not at the model loading's output
  [ -n "${FTB_PROGRESS_STEPS:-}" ] && { steps=$(stat -c %s -- "$FTB_PROGRESS_STEPS" 2>/dev/null) || steps=0; }
  echo " $sum${steps:+ $steps}"
}

ftb_env() {  # read the environment from stdin (up to the empty pair) and export it
  local kv ended=0
  local -a pairs=()
  while IFS= read -r -d '' kv; do
    if [ -z "$kv" ]; then ended=1; break; fi
    pairs+=("$kv")
  done
  [ "$ended" = 1 ] || { echo "ftbundle: no environment on stdin" >&2; exit 97; }
  for kv in "${pairs[@]}"; do
    case $kv in FTB_ENV_FILE=?*) export -- "$kv" ;; esac
  done
  # the host's NCCL env file first, so the job's own env wins over it
  if [ -n "${FTB_ENV_FILE:-}" ] && [ -r "$FTB_ENV_FILE" ]; then set -a; . "$FTB_ENV_FILE"; set +a; fi
  for kv in "${pairs[@]}"; do export -- "$kv"; done
  if [ -n "${FTB_PATH_PREPEND:-}" ]; then export PATH="$FTB_PATH_PREPEND:$PATH"; fi
}

# Replaces every secret value (>= FTB_MIN_SECRET_LEN characters) in the job's output with
# <redacted>, line by line, before it reaches the log. Literal matching (index, not regex);
# the values come from the environment.
FTB_REDACT_AWK='BEGIN { n = split(ENVIRON["FTB_SECRET_NAMES"], names, " ")
  for (i = 1; i <= n; i++) { v = ENVIRON[names[i]]; if (length(v) >= ENVIRON["FTB_MIN_SECRET_LEN"] + 0) secret[++m] = v } }
{ line = $0
  for (i = 1; i <= m; i++) {
    out = ""
    while ((p = index(line, secret[i])) > 0) {
      out = out substr(line, 1, p - 1) "<redacted>"; line = substr(line, p + length(secret[i]))
    }
    line = out line
  }
  print line; fflush() }'

mode_job() {  # the job: ARGV with its whole output appended to the log, then its exit code
  local rc
  if [ -n "${FTB_SECRET_NAMES:-}" ]; then
    "$@" 2>&1 </dev/null | awk "$FTB_REDACT_AWK" >>"$FTB_LOG"
    rc=${PIPESTATUS[0]}
  else
    "$@" >>"$FTB_LOG" 2>&1 </dev/null
    rc=$?
  fi
  echo "$rc" >"$FTB_EXIT"
  exit "$rc"
}

mode_watch() {  # a detached node: beat into FTB_HBFILE, stop when a peer fails or goes stale
  local pid=$1 beat=0 f v now
  local -A last_value=() last_change=()
  while kill -0 "$pid" 2>/dev/null; do
    beat=$((beat + 1))
    echo "$beat" >"$FTB_HBFILE.tmp" && mv -f "$FTB_HBFILE.tmp" "$FTB_HBFILE"
    for f in "$FTB_RUN_DIR"/node-*.a"$FTB_ATTEMPT".exit; do
      [ -e "$f" ] || continue
      v=$(cat "$f" 2>/dev/null)
      if [ -n "$v" ] && [ "$v" != 0 ]; then break 2; fi
    done
    [ -e "$FTB_STOP_REQUEST" ] && break
    now=$SECONDS
    for f in "$FTB_RUN_DIR"/node-*.a"$FTB_ATTEMPT".hb; do
      [ -e "$f" ] && [ "$f" != "$FTB_HBFILE" ] || continue
      [ -e "${f%.hb}.exit" ] && continue  # that node is done, not silent
      v=$(cat "$f" 2>/dev/null)  # read, not stat: NFS revalidates on open
      if [ "${last_value[$f]-}" != "$v" ]; then
        last_value[$f]=$v; last_change[$f]=$now
      elif [ $((now - ${last_change[$f]})) -ge "$FTB_STALE" ]; then
        echo "ftbundle: $f unchanged for ${FTB_STALE}s: that node is gone; stopping" >>"$FTB_LOG"
        break 2
      fi
    done
    sleep "$FTB_HEARTBEAT"
  done
  kill -0 "$pid" 2>/dev/null && ftb_stop "$FTB_MARKER" "${FTB_CONTAINER:-}"
  exit 0
}

# -- the stall watchdog of a detached run (ftbundle/launch/stall.py does it for attached runs) --
ftb_has_ranks() {  # whether any rank process (torchrun's children: LOCAL_RANK) of the job is left
  local p
  for p in $(ftb_pids "$FTB_MARKER"); do
    grep -qz '^LOCAL_RANK=' "/proc/$p/environ" 2>/dev/null && return 0
  done
  return 1
}

mode_stall_watch() {  # PID: every node writes its ranks' progress to node-R.aN.progress; rank 0
  # referees: no change in any node's file for FTB_STALL_TIMEOUT seconds (after the first
  # change) and it writes stalled.aN; every node then collects its ranks' state and stacks
  # (FTB_RUN_DIR/stacks.py, staged at launch) into stacks/aN-stall-detached/, and rank 0
  # asks every node to stop (FTB_STOP_REQUEST, which each node's watcher obeys).
  local pid=$1 v last="" all prev="" changed=$SECONDS started=0 n continue_wait
  local -a files
  local progress="${FTB_HBFILE%.hb}.progress" request="$FTB_RUN_DIR/stalled.a$FTB_ATTEMPT"
  local out="$FTB_RUN_DIR/stacks/a$FTB_ATTEMPT-stall-detached"
  while kill -0 "$pid" 2>/dev/null; do
    v=$(ftb_progress)
    if [ "$v" != "$last" ]; then echo "$v" >"$progress.tmp" && mv -f "$progress.tmp" "$progress"; last=$v; fi
    if [ -e "$request" ]; then
      python3 -S - --env "$out" <"$FTB_RUN_DIR/stacks.py" >/dev/null 2>&1
      echo done >"${FTB_HBFILE%.hb}.stacked"
      break
    fi
    files=("$FTB_RUN_DIR"/node-*.a"$FTB_ATTEMPT".progress)
    case $v in *" "*" "0|*" "*" ") continue_wait=1 ;; *) continue_wait=0 ;; esac  # (no trainer step yet)
    if [ "${NODE_RANK:-}" = 0 ] && [ -e "${files[0]}" ] && [ "${#files[@]}" -ge "${NNODES:-1}" ] \
        && { [ -z "${FTB_PROGRESS_STEPS:-}" ] || [ "$continue_wait" = 0 ]; }; then
      # (only once every node has written one: a node's first file is not progress)
      all=$(cat -- "${files[@]}" 2>/dev/null)
      if [ "$all" != "$prev" ]; then
        [ -n "$prev" ] && started=1
        prev=$all; changed=$SECONDS
      elif [ "$started" = 1 ] && [ $((SECONDS - changed)) -gt "$FTB_STALL_TIMEOUT" ]; then
        if [ -z "${FTB_CONTAINER:-}" ] && ! ftb_has_ranks; then  # ranks done, torchrun ending: not a stall
          changed=$SECONDS; sleep 2; continue
        fi
        echo "ftbundle: no progress from any rank for ${FTB_STALL_TIMEOUT}s: stalled; every rank's stack into $out, then every node stops" >>"$FTB_LOG"
        echo "$((SECONDS - changed))" >"$request"
        python3 -S - --env "$out" <"$FTB_RUN_DIR/stacks.py" >/dev/null 2>&1
        echo done >"${FTB_HBFILE%.hb}.stacked"
        for n in $(seq 60); do  # the other nodes' collections, for at most a minute
          [ "$(ls "$FTB_RUN_DIR"/node-*.a"$FTB_ATTEMPT".stacked 2>/dev/null | wc -l)" -ge "${NNODES:-1}" ] && break
          sleep 1
        done
        echo "stalled" >"$FTB_STOP_REQUEST"
        break
      fi
    fi
    sleep 2
  done
  exit 0
}

mode_node() {
  ftb_env
  [ -d "$FTB_RUN_DIR" ] || mkdir -p -- "$FTB_RUN_DIR" || { echo "ftbundle: cannot create $FTB_RUN_DIR on $(hostname)" >&2; exit 96; }
  cd -- "$FTB_WORKDIR" || { echo "ftbundle: workdir $FTB_WORKDIR missing on $(hostname)" >&2; exit 96; }
  [ ! -e "$FTB_EXIT" ] || rm -f -- "$FTB_EXIT"  # (rm is a process: only when there is one)
  FTB_JOB=$FTB_MARKER setsid bash -c "$BASH_EXECUTION_STRING" ftb job "$@" </dev/null >/dev/null 2>&1 &
  local pid=$!
  echo "$pid $FTB_MARKER $(hostname)" >"$FTB_PIDFILE"
  echo "ftb-pid $pid" >&2
  if [ "${FTB_DETACH:-0}" = 1 ]; then
    setsid bash -c "$BASH_EXECUTION_STRING" ftb watch "$pid" </dev/null >/dev/null 2>&1 &
    if [ "${FTB_STALL_TIMEOUT:-0}" != 0 ]; then
      setsid bash -c "$BASH_EXECUTION_STRING" ftb stall-watch "$pid" </dev/null >/dev/null 2>&1 &
    fi
    exit 0
  fi
  # (sleep gets none of our streams: a killed loop must not leave one holding the channel open)
  ( while kill -0 "$pid" 2>/dev/null; do echo "ftb-hb$(ftb_progress)" >&2; sleep "$FTB_HEARTBEAT" </dev/null >/dev/null 2>&1; done ) &
  local hbpid=$!
  # (a background job reads /dev/null unless told otherwise: hand it our stdin explicitly)
  ( while IFS= read -r -t "$FTB_WATCHDOG" _; do :; done; ftb_stop "$FTB_MARKER" "${FTB_CONTAINER:-}" ) <&0 &
  local wdpid=$!
  wait "$pid"
  local rc=$?
  kill "$hbpid" "$wdpid" 2>/dev/null
  exit "$rc"
}

mode_state() {  # MARKER EXITFILE LOG: running | exited N | stopped, then the log's last line
  if [ -n "$(ftb_pids "$1")" ]; then echo running
  elif [ -s "$2" ]; then echo "exited $(cat -- "$2")"
  else echo stopped; fi
  tail -n 1 -- "$3" 2>/dev/null | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -n 1
  exit 0
}

mode_follow() {  # MARKER LOG LINES: the log, followed until the job is gone
  tail -n "$3" -F -- "$2" 2>/dev/null &
  local t=$!
  while [ -n "$(ftb_pids "$1")" ]; do sleep 1; done
  sleep 1; kill "$t" 2>/dev/null; wait "$t" 2>/dev/null
  exit 0
}

mode_resume_point() {  # DIR: drop an incomplete newest checkpoint, print the newest complete one
  local last
  last=$(ls -1 -- "$1" 2>/dev/null | grep -E '^checkpoint-[0-9]+$' | sort -t- -k2 -n | tail -n 1)
  if [ -n "$last" ] && [ ! -e "$1/$last/trainer_state.json" ]; then
    rm -rf -- "${1:?}/$last"; echo "removed incomplete checkpoint $last" >&2
  fi
  ls -1 -- "$1" 2>/dev/null | grep -E '^checkpoint-[0-9]+$' | sort -t- -k2 -n | tail -n 1
  exit 0
}

mode_stage() {  # DIR [LEFTOVER...]: create DIR, unpack the tar archive on stdin into it,
  # then remove the LEFTOVER paths (the check's sentinels: one round trip for both)
  local dir=$1; shift
  mkdir -p -- "$dir" && tar -xf - -C "$dir" || exit $?
  if [ $# -gt 0 ]; then rm -rf -- "$@"; fi
  exit 0
}

mode=${1:-}; shift || true
case $mode in
  node) mode_node "$@" ;;
  job) mode_job "$@" ;;
  watch) mode_watch "$@" ;;
  stall-watch) mode_stall_watch "$@" ;;
  stop) ftb_stop "$@"; exit $? ;;
  state) mode_state "$@" ;;
  follow) mode_follow "$@" ;;
  resume-point) mode_resume_point "$@" ;;
  stage) mode_stage "$@" ;;
  *) echo "ftbundle node program: unknown mode '$mode'" >&2; exit 2 ;;
esac
