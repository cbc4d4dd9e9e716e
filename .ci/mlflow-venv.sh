#!/usr/bin/env bash
# Create (or reuse) .venv-mlflow: the full `mlflow` package, whose `mlflow server` is the MLflow
# tracking server the tests run a LoRA against (tests/train/test_quickstart.py `mlflow_server`).
# Apart from .venv on purpose: the ranks run mlflow-skinny (a client without the server or
# SQLAlchemy, as a slim training image has it), and the check's refusals are judged on that.
# Reused while this script and the base interpreter are unchanged (a stamp of both).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-mlflow
want=$( (cat .ci/mlflow-venv.sh; "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
stamp=$VENV/.ftbundle-deps
if [ -x $VENV/bin/mlflow ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "mlflow-venv: $VENV is up to date ($want)"
    exit 0
fi
echo "mlflow-venv: creating $VENV ($want; about a minute)"
if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    # shellcheck source=.ci/apt.sh
    . .ci/apt.sh
    ftb_install python3-venv
fi
rm -rf $VENV
"$PYTHON" -m venv $VENV
$VENV/bin/python -m pip install -q --upgrade pip
# (pip warns about every missing local index folder of this machine's config: noise)
$VENV/bin/python -m pip install -q 'mlflow>=3.7,<4' 2>&1 | { grep -v "^WARNING: Location" || true; }
$VENV/bin/mlflow --version
echo "$want" > "$stamp"
echo "mlflow-venv: ready"
