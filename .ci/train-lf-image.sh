#!/usr/bin/env bash
# The CPU training image with LlamaFactory in it, for the day-zero walk
# (tests/cluster/test_day_zero.py): what a newcomer's `ftb_image` holds, made here without a
# registry or a download. It is the CPU training image (.ci/train-image.sh: bookworm's
# python3.11, CPU torch in /opt/torch) plus LlamaFactory and the packages it imports to
# train, copied from this checkout's .venv (the same cp311 wheels, already installed) into
# /opt/lf. Left out: the torch stack the base image has (its CUDA build here), and what only
# LlamaFactory's web UI and API server use (gradio, fastapi, uvicorn, modelscope, ...).
# LlamaFactory 0.9.5 imports torchaudio at the top of data/mm_plugin.py (every run), and uses it
# only for audio datasets; no torchaudio build for the base image's CPU torch 2.13 exists here
# (PyPI's wheels link CUDA's libcudart), so the image carries a placeholder module of that name
# that fails, saying why, on any use: what an audio dataset would need.
# The copy leaves the venv's bytecode out (__pycache__ above); the image compiles
# what a LlamaFactory rank imports instead (the RUN below): without it each rank's container
# compiled it again, 13.5 s against 5.0 s for the import here (+44 MB; all of it: +183 MB).
# Cached by a hash of this script, the base image and the venv's package versions.
# Prints the image reference (last line).
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(bash .ci/train-image.sh | tail -n 1)
PY=.venv/bin/python
# The distributions to copy: llamafactory and what it requires, transitively, less the skipped.
dists=$("$PY" - <<'PYTHON'
import importlib.metadata as md, re
skip = re.compile(r"^(torch|torchvision|torchaudio|torchdata|triton|nvidia-.*|cuda-.*|numpy|sympy|mpmath|networkx|"
                  r"gradio|gradio-client|fastapi|uvicorn|starlette|sse-starlette|modelscope|hf-transfer|"
                  r"deepspeed|setuptools|pip)$")
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
seen, todo = {}, ["llamafactory"]
while todo:
    name = norm(todo.pop())
    if name in seen or skip.match(name):
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    seen[name] = dist.version
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        todo.append(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PYTHON
)
hash=$( (cat .ci/train-lf-image.sh; echo "$base $dists") | sha256sum | cut -c1-12)
ref="ftbundle-train-lf:$hash"
if docker image inspect "$ref" >/dev/null 2>&1; then
    echo "$ref"; exit 0
fi
exec 9>/var/lock/ftbundle-train-lf-image.lock
flock 9
if docker image inspect "$ref" >/dev/null 2>&1; then
    echo "$ref"; exit 0
fi
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# every file each distribution installed (its RECORD), dist-info included (LlamaFactory checks
# its dependencies' versions through importlib.metadata)
read -ra dist_list <<<"$dists"
"$PY" - "$ctx/lf" "${dist_list[@]}" <<'PYTHON'
import importlib.metadata as md, os, shutil, sys
out = sys.argv[1]
for spec in sys.argv[2:]:
    dist = md.distribution(spec.split("==")[0])
    for f in dist.files or []:
        src = f.locate()
        rel = os.path.normpath(str(f))
        if rel.startswith("..") or not os.path.isfile(src) or "__pycache__" in rel or rel.endswith(".pyc"):
            continue  # scripts in bin/, compiled caches
        dst = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
PYTHON
mkdir -p "$ctx/lf/torchaudio"
cat > "$ctx/lf/torchaudio/__init__.py" <<'PYTHON'
"""Placeholder (ftbundle's CPU test image, .ci/train-lf-image.sh): no torchaudio for this torch."""
__version__ = "0+none"


def __getattr__(name):
    raise ImportError(f"torchaudio.{name}: this CPU test image has no torchaudio (audio datasets need it)")
PYTHON
cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM $base
COPY lf /opt/lf
ENV PYTHONPATH=/opt/torch:/opt/lf
RUN cd /tmp && python3 -c "import llamafactory.launcher, llamafactory.train.tuner, transformers.models.llama.modeling_llama, peft, trl"
LABEL org.ftbundle.recipe=$hash
CMD ["python3", "-c", "import llamafactory; print(llamafactory.__version__)"]
DOCKERFILE
DOCKER_BUILDKIT=0 docker build -q -t "$ref" "$ctx" >&2
docker tag "$ref" ftbundle-train-lf:latest
echo "$ref"
