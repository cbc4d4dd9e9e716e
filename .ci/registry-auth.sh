#!/usr/bin/env bash
# A second local registry (Debian's docker-registry, distribution 2.8) that REQUIRES a
# login (htpasswd, bcrypt), with the CPU training image pushed to it: for the training_image
# role's registry login test.
#   FTB_PYTHON=.venv/bin/python bash .ci/registry-auth.sh
#     -> prints "<repo>@sha256:<digest>" as pushed to 127.0.0.1:PORT
# The test user is ftbundle-test; its password is made once, at random, and kept in
# $ROOT/password (mode 0600): it is never printed or put on a command line. The bcrypt
# hash is made with the python bcrypt module (in the project's venv through paramiko).
# Started once; reused while it answers.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${FTB_REGISTRY_AUTH_PORT:-5001}
# one registry per port (tests/support/testbed.py gives each checkout its own): its own storage and log
ROOT=/var/lib/ftbundle-registry-auth; LOG=/var/log/ftbundle-registry-auth.log
[ "$PORT" = 5001 ] || { ROOT="$ROOT-$PORT"; LOG="/var/log/ftbundle-registry-auth-$PORT.log"; }
PYTHON=${FTB_PYTHON:-python3}
USER_NAME=ftbundle-test
say() { echo "registry-auth: $*" >&2; }

# shellcheck source=.ci/apt.sh
. .ci/apt.sh
ftb_need docker-registry:docker-registry
# one caller at a time, from start to push (see registry.sh: concurrent pushes race)
exec 9>/var/lock/ftbundle-registry-auth-$PORT.lock
flock 9
mkdir -p "$ROOT"
chmod 0700 "$ROOT"
if [ ! -s "$ROOT/password" ]; then
    (umask 077; "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(18))' > "$ROOT/password")
fi
if [ ! -s "$ROOT/htpasswd" ]; then
    # the password goes through a file, never argv
    (umask 077; "$PYTHON" - "$USER_NAME" "$ROOT/password" > "$ROOT/htpasswd" <<'PY'
import sys
import bcrypt
user, path = sys.argv[1], sys.argv[2]
password = open(path, "rb").read().strip()
print(f"{user}:{bcrypt.hashpw(password, bcrypt.gensalt(rounds=10)).decode()}")
PY
)
fi
# 401 without credentials: it answers, and it asks for a login
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v2/" || true)
if [ "$code" != 401 ]; then
    cat > "$ROOT/config.yml" <<CONFIG
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $ROOT/data
  delete:
    enabled: true
auth:
  htpasswd:
    realm: ftbundle-test
    path: $ROOT/htpasswd
http:
  addr: :$PORT
CONFIG
    say "starting on :$PORT (htpasswd)"
    nohup docker-registry serve "$ROOT/config.yml" > "$LOG" 2>&1 9>&- &  # not holding the lock
    for _ in $(seq 30); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v2/" || true)
        [ "$code" = 401 ] && break; sleep 0.5
    done
    [ "$code" = 401 ] || { say "not answering 401 on :$PORT: $(tail -n 5 "$LOG")"; exit 1; }
fi
image=$(bash .ci/train-image.sh | tail -n 1)
repo="127.0.0.1:$PORT/ftbundle/train-cpu"
tag=${image#*:}
config=$(mktemp -d)
trap 'rm -rf "$config"' EXIT
docker --config "$config" login --username "$USER_NAME" --password-stdin "127.0.0.1:$PORT" < "$ROOT/password" >&2
docker tag "$image" "$repo:$tag"
out=$(docker --config "$config" push "$repo:$tag" 2>&1) || { say "push to :$PORT failed: $(tail -n 5 <<<"$out")"; exit 1; }
digest=$(tail -n 1 <<<"$out" | grep -o 'sha256:[0-9a-f]\{64\}' | head -n 1)
[ -n "$digest" ] || { say "push to :$PORT printed no digest: $(tail -n 5 <<<"$out")"; exit 1; }
echo "ftbundle/train-cpu@$digest"
