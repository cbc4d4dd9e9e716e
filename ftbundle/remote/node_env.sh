# ftbundle's node program, its part on the job's environment and output: the environment the
# launcher sends on stdin and the host's env file (ftb_env), their secrets (ftb_env_file_secrets),
# and the job itself with its output filtered of them (mode_job).
# shellcheck shell=bash
#
# Not a program of its own: ftbundle/launch/node.py program() puts this text into node.sh's at
# its marker line (`# -- ftb_env, ...`), before the modes that call it; node.sh's header says
# what the program is, its modes and its variables.

ftb_env() {  # read the environment from stdin (up to the empty pair) and export it
  local kv ended=0
  local -a pairs=()
  while IFS= read -r -d '' kv; do
    if [ -z "$kv" ]; then ended=1; break; fi
    pairs+=("$kv")
  done
  [ "$ended" = 1 ] || { echo "ftbundle: no environment on stdin" >&2; exit 97; }
  for kv in "${pairs[@]}"; do
    # shellcheck disable=SC2163  # (kv is NAME=VALUE: export it as such)
    case $kv in FTB_ENV_FILE=?*) export -- "$kv" ;; esac
  done
  # the host's NCCL env file first, so the job's own env wins over it
  # shellcheck source=/dev/null  # (the host's env file, written by the nccl role)
  if [ -n "${FTB_ENV_FILE:-}" ] && [ -r "$FTB_ENV_FILE" ]; then set -a; . "$FTB_ENV_FILE"; set +a; fi
  # shellcheck disable=SC2163  # (kv is NAME=VALUE: export it as such)
  for kv in "${pairs[@]}"; do export -- "$kv"; done
  if [ -n "${FTB_PATH_PREPEND:-}" ]; then export PATH="$FTB_PATH_PREPEND:$PATH"; fi
  ftb_env_file_secrets
}

# The env file's secrets join the job's (FTB_SECRET_NAMES, the log filter's list): a variable
# secret by its name (job.py SECRET_MARKERS), and the password of any URL in a value
# (scheme://user:PASSWORD@host, job.py URL_PASSWORD_RE), which travels as FTB_URL_SECRET_Fn.
# The launcher never sees this file, so only this program can know them.
ftb_env_file_secrets() {
  [ -n "${FTB_ENV_FILE:-}" ] && [ -r "$FTB_ENV_FILE" ] || return 0
  local line name value n=0
  local url='[A-Za-z][A-Za-z0-9_+.-]*://[^/?#@[:space:]:]*:([^/?#@[:space:]]+)@'
  local -a names=()
  while IFS= read -r line || [ -n "$line" ]; do
    [[ $line =~ ^[[:space:]]*(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)= ]] || continue
    name=${BASH_REMATCH[2]}
    value=${!name-}
    case ${name^^} in
      *TOKEN*|*KEY*|*SECRET*|*PASSWORD*|*PASSWD*|*CREDENTIAL*|*AUTH*) names+=("$name"); continue ;;
    esac
    while [[ $value =~ $url ]]; do
      export "FTB_URL_SECRET_F$n=${BASH_REMATCH[1]}"; names+=("FTB_URL_SECRET_F$n"); n=$((n + 1))
      value=${value#*"${BASH_REMATCH[0]}"}
    done
  done <"$FTB_ENV_FILE"
  [ "${#names[@]}" = 0 ] || export FTB_SECRET_NAMES="${FTB_SECRET_NAMES:+$FTB_SECRET_NAMES }${names[*]}"
}

# Replaces every secret value (>= FTB_MIN_SECRET_LEN characters) in the job's output with
# <redacted>, line by line, before it reaches the log. Literal matching (index, not regex);
# the values come from the environment.
# shellcheck disable=SC2016  # (an awk program: its $ are awk's)
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
  ftb_write "$FTB_EXIT" "$rc"
  exit "$rc"
}
