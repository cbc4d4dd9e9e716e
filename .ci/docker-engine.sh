#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine (idempotent).
#
# - `docker info` works already: nothing to do.
# - otherwise install docker.io if dockerd is missing (apt-get update only when
#   the package cannot be found in the current lists), start dockerd in the
#   background (log: /var/log/ftbundle-dockerd.log) and wait up to 60 s.
#
# Never stops or restarts an engine that is already running.
set -euo pipefail

LOG=/var/log/ftbundle-dockerd.log
WAIT_S=${FTBUNDLE_DOCKERD_WAIT_S:-60}

say() { echo "docker-engine: $*" >&2; }

engine_up() { timeout 20 docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && engine_up; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    say "no Docker engine answers and we are not root: cannot start one"
    exit 1
fi

# shellcheck source=.ci/apt.sh
. "${BASH_SOURCE[0]%/*}/apt.sh"
ftb_need dockerd:docker.io docker:docker.io

# A dockerd may be running but still starting up (or answering slowly):
# only start one when none runs.
if ! pgrep -x dockerd >/dev/null 2>&1; then
    say "starting dockerd (log: $LOG)"
    mkdir -p "$(dirname "$LOG")"
    # setsid + nohup: the engine outlives this script and its session.
    nohup setsid dockerd >>"$LOG" 2>&1 </dev/null &
fi

deadline=$((SECONDS + WAIT_S))
while [ "$SECONDS" -lt "$deadline" ]; do
    if timeout 5 docker info >/dev/null 2>&1; then
        say "engine is up"
        exit 0
    fi
    sleep 1
done

say "Docker engine did not answer within ${WAIT_S}s; last lines of $LOG:"
tail -n 40 "$LOG" >&2 2>/dev/null || true
exit 1
