#!/usr/bin/env bash
# The `gpu` tests on a lent GPU machine, in one call of the device tool (docs/testing.md):
#
#     .ci/gpu-wheels.sh                      # here, once: the wheels into .whl/
#     device run, carry [".whl"], timeout_s 540, command: OUT=$OUT .ci/gpu-check.sh
#
# There: the wheels go into /tmp/ftb-site (first on PYTHONPATH, so LlamaFactory's pins win over
# the image's newer packages), then `pytest -m gpu tests/gpu/test_gpu.py` runs with the image's
# torch. What comes back in $OUT (the tool returns at most 8 files): env.txt (GPU, driver,
# versions), pytest.log (each test's figures), recorded.tgz (the nvidia-smi readings and the
# burn-in figures the tests recorded into tests/data/nvidia-smi/recorded/: commit them).
# Without a GPU the tests are skipped and this says so (exit 0): a dry run of the script.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
PY=${PY:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=$(command -v python3)
LIMIT_S=${LIMIT_S:-480}
WHEELS=${WHEELS:-.whl}  # (a dry run without the wheels: WHEELS=none)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=/tmp/ftb-site
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || { echo "gpu-check: installing $WHEELS/ into $SITE failed" | tee "$OUT/env.txt"; exit 1; }
    PYDIR=$(dirname "$PY")
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PYDIR:$PATH"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
{
    echo "== date"; date -u
    echo "== nvidia-smi -L"; timeout 30 nvidia-smi -L 2>&1
    echo "== python $PY"; "$PY" -c 'import sys; print(sys.version)'
    echo "== versions as the tests import them"
    timeout 120 "$PY" -c '
import importlib, time
t = time.time()
for name in ("torch", "transformers", "peft", "accelerate", "datasets", "trl", "llamafactory", "fabric", "paramiko"):
    try:
        m = importlib.import_module(name)
        print(f"{name:13} {m.__version__:16} {m.__file__}")
    except Exception as e:
        print(f"{name:13} FAILED: {type(e).__name__}: {e}")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      f"(imports {time.time() - t:.1f}s)")' 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
set -o pipefail
timeout -k 10 "$LIMIT_S" "$PY" -m pytest -m gpu tests/gpu/test_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
rc=$?
if [ -d tests/data/nvidia-smi/recorded ]; then
    tar -czf "$OUT/recorded.tgz" -C tests/data/nvidia-smi recorded
fi
echo "gpu-check: pytest exit $rc$([ "$rc" = 124 ] && echo " (ran past ${LIMIT_S}s)")"
exit "$rc"
