#!/usr/bin/env bash
# Command-line tools the tests drive (idempotent), installed when missing: tmux (the test
# that reads the terminal screen of `ftbundle run`, tests/train/test_ux_run.py), curl (the local
# registry's liveness, .ci/registry.sh), ssh and ssh-keygen (the containerized hosts'
# keys and logins, tests/support/cluster.py), and what the tests' own scripts would otherwise
# install from parallel workers: docker-registry (.ci/registry*.sh) and shellcheck
# (.ci/shellcheck.sh), and pdsh, which tests/cluster/test_bench_quick.py runs beside ftbundle.
set -euo pipefail
# shellcheck source=.ci/apt.sh
. "${BASH_SOURCE[0]%/*}/apt.sh"
ftb_need tmux:tmux curl:curl ssh:openssh-client ssh-keygen:openssh-client docker-registry:docker-registry \
    shellcheck:shellcheck pdsh:pdsh
