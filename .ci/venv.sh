#!/usr/bin/env bash
# Create (or reuse) the project's Python environment at .venv.
# Reused as long as its dependency set is unchanged: the stamp is a hash of
# pyproject.toml, this script and the base interpreter's version.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
want=$( (cat pyproject.toml .ci/venv.sh; "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
stamp=.venv/.ftbundle-deps
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "venv: .venv is up to date ($want)"
    exit 0
fi
echo "venv: creating .venv for dependency set $want (takes a few minutes the first time)"
# Debian's python3 makes no venv without python3-venv (ensurepip): installed when missing
if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    # shellcheck source=.ci/apt.sh
    . .ci/apt.sh
    ftb_install python3-venv
fi
rm -rf .venv
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# (pip warns about every missing local index folder of this machine's config: noise)
# (DS_BUILD_OPS=0: DeepSpeed installs without compiling its CUDA ops, which this machine cannot)
# (pipefail: a failed install fails this script; only the filter's "nothing left" is forgiven)
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -e '.[train,dev,deepspeed]' 2>&1 | { grep -v "^WARNING: Location" || true; }
# Every module a test imports with pytest.importorskip is checked here: a broken install
# must fail now, not turn into skipped tests (tests/unit/test_ci_scripts_unit.py keeps this list whole).
.venv/bin/python -c 'import ftbundle, llamafactory, fabric, ansible, molecule, deepspeed, kubernetes_validate, tokenizers, transformers, torch'
echo "$want" > "$stamp"
echo "venv: ready"
