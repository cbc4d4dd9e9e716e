#!/usr/bin/env bash
# Make sure Debian's shellcheck is installed (idempotent); print its path.
# Used by the export tests (tests/test_export_slurm.py, tests/test_export_pbs.py) to lint
# the scripts `ftbundle export` writes.
set -euo pipefail
if ! command -v shellcheck >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    # update the lists only when they offer no candidate for the package
    if ! apt-cache policy shellcheck 2>/dev/null | grep "Candidate: [^(]" >/dev/null; then
        apt-get update -q >&2
    fi
    apt-get install -y -q shellcheck >&2
fi
command -v shellcheck
