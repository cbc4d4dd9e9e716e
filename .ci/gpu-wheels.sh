#!/usr/bin/env bash
# Wheels for a lent GPU machine (no network there): every package that `pytest -m gpu
# tests/gpu/test_gpu.py` and a LlamaFactory run need and the machine's image lacks or holds at a
# version LlamaFactory refuses, at the versions of this checkout's venv (what CI tests), built
# for the machine's Python 3.12 on x86-64. Into .whl/ (ignored by git); .ci/gpu-check.sh
# installs them there. Run `make venv` (or .ci/venv.sh) first.
#
#     .ci/gpu-wheels.sh            # then: device run, carry [".whl"], command .ci/gpu-check.sh
#
# Left out (SKIP below): what the image has built for its own torch and CUDA (torch 2.11 +
# cu130, as ../shared/gpu/RUN-2026-11-27.md ran) and its numeric stack; what training never
# imports (LlamaFactory's web UI and video); what the image holds at a version that does.
# Carried although the image has them: LlamaFactory 0.9.5's pins (transformers <= 5.6.0,
# accelerate <= 1.11.0, tokenizers <= 0.22 through transformers, peft, fsspec for datasets).
# The device tool carries 64 MiB with the tree: this script stops if the wheels pass 40.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-.whl}
[ -x "$PY" ] || { echo "gpu-wheels: $PY is missing: run .ci/venv.sh first" >&2; exit 2; }
# the image's own builds (its torch and CUDA; its numeric stack), LlamaFactory's web UI and
# video (gradio, av: never imported by training), hf-transfer (used only when asked for)
SKIP='^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|numpy|scipy|pandas|pyarrow|matplotlib|contourpy|kiwisolver|fonttools|cycler|pillow|sympy|mpmath|networkx|setuptools|gradio|gradio-client|ruff|av|pydub|ffmpy|safehttpx|groovy|semantic-version|tomlkit|python-multipart|brotli|orjson|modelscope|modelscope-hub|pyparsing|python-dateutil|pytz|tzdata|six|hf-transfer'
# and what the image holds at a version these need (KINDS.md's package list of 2026-11-17):
SKIP+='|hf-xet|regex|safetensors|sentencepiece|tiktoken|pyyaml|psutil|protobuf|xxhash|wrapt|pytest|pluggy|iniconfig|pytest-timeout|charset-normalizer|markupsafe|certifi|idna|urllib3|requests|pygments|typing-extensions)$'
# the closure of what the GPU tests run, at this venv's versions (NAME==VERSION, one a line)
pins=$("$PY" - "$SKIP" <<'EOF'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

skip = re.compile(sys.argv[1])
def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()
seen, stack = {}, ["llamafactory", "fabric", "pyyaml", "rich", "clustershell", "py-spy", "ansible-core",
                   "pytest-timeout"]
while stack:
    name = norm(stack.pop())
    if name in seen or skip.match(name):
        continue
    seen[name] = md.distribution(name).version
    for text in md.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            stack.append(req.name)
for name, version in sorted(seen.items()):
    print(f"{name}=={version}")
EOF
)
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# shellcheck disable=SC2086  # (one pin a word)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$OUT_DIR" $pins
count=$(find "$OUT_DIR" -name '*.whl' | wc -l)
mib=$(du -sm "$OUT_DIR" | cut -f1)
echo "gpu-wheels: $count wheels, ${mib} MiB in $OUT_DIR: $(echo "$pins" | tr '\n' ' ')"
if [ "$mib" -gt 40 ]; then
    echo "gpu-wheels: ${mib} MiB is more than the 40 this script allows (the device tool carries 64 MiB with the tree)" >&2
    exit 1
fi
