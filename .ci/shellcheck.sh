#!/usr/bin/env bash
# Make sure Debian's shellcheck is installed (idempotent); print its path.
# Used by the export tests (tests/cluster/test_export_slurm.py, tests/cluster/test_export_pbs.py) to lint
# the scripts `ftbundle export` writes.
set -euo pipefail
# shellcheck source=.ci/apt.sh
. "${BASH_SOURCE[0]%/*}/apt.sh"
ftb_need shellcheck:shellcheck  # (tests call this from parallel workers: apt.sh's lock)
command -v shellcheck
