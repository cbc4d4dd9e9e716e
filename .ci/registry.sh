#!/usr/bin/env bash
# A real local registry (Debian's docker-registry, distribution 2.8) for the provisioning
# tests, and the CPU training image pushed to it.
#   bash .ci/registry.sh        -> prints "<repo>@sha256:<digest>" as pushed to 127.0.0.1:PORT
#   bash .ci/registry.sh .ci/train-lf-image.sh   -> the same for the image that script builds
#                                   (ftbundle-train-lf:<hash> is pushed as ftbundle/train-lf)
# The registry listens on all addresses of this machine (test hosts reach it through their
# Docker network's gateway). Started once; reused while it answers.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${FTB_REGISTRY_PORT:-5000}
# one registry per port (tests/support/testbed.py gives each checkout its own): its own storage and log
ROOT=/var/lib/ftbundle-registry; LOG=/var/log/ftbundle-registry.log
[ "$PORT" = 5000 ] || { ROOT="$ROOT-$PORT"; LOG="/var/log/ftbundle-registry-$PORT.log"; }
say() { echo "registry: $*" >&2; }

# shellcheck source=.ci/apt.sh
. .ci/apt.sh
ftb_need docker-registry:docker-registry
# One caller at a time, from start to push (parallel test workers): the others find it
# answering and their push a no-op. Two concurrent pushes of one image race in the registry
# (both upload the config blob; one manifest PUT is refused "manifest blob unknown").
exec 9>/var/lock/ftbundle-registry-$PORT.lock
flock 9
if ! curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null 2>&1; then
    mkdir -p "$ROOT"
    cat > "$ROOT/config.yml" <<CONFIG
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $ROOT/data
  delete:
    enabled: true
http:
  addr: :$PORT
CONFIG
    say "starting on :$PORT"
    nohup docker-registry serve "$ROOT/config.yml" > "$LOG" 2>&1 9>&- &  # not holding the lock
    for _ in $(seq 30); do curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null 2>&1 && break; sleep 0.5; done
    curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null
fi
image=$(bash "${1:-.ci/train-image.sh}" | tail -n 1)
name=${image%%:*}; name=${name#ftbundle-}
repo="127.0.0.1:$PORT/ftbundle/$name"
tag=${image#*:}
docker tag "$image" "$repo:$tag"
out=$(docker push "$repo:$tag" 2>&1) || { say "push to :$PORT failed: $(tail -n 5 <<<"$out")"; exit 1; }
digest=$(tail -n 1 <<<"$out" | grep -o 'sha256:[0-9a-f]\{64\}' | head -n 1)
[ -n "$digest" ] || { say "push to :$PORT printed no digest: $(tail -n 5 <<<"$out")"; exit 1; }
echo "ftbundle/$name@$digest"
