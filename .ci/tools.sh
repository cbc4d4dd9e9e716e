#!/usr/bin/env bash
# Command-line tools the tests drive (idempotent): tmux, for the test that reads the
# terminal screen of `ftbundle run` (tests/test_ux_run.py).
set -euo pipefail
if ! command -v tmux >/dev/null; then
    echo "tools: installing tmux" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q tmux >&2 || {
        apt-get update -q >&2; DEBIAN_FRONTEND=noninteractive apt-get install -y -q tmux >&2; }
fi
