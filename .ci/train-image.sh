#!/usr/bin/env bash
# Build the small CPU training image used by the docker-runtime tests:
# the test-host image (Debian bookworm, python3.11) plus the CPU build of torch
# installed into /opt/torch (PYTHONPATH). Built locally (nothing can be pulled),
# cached by a hash of this recipe. Prints the image reference (last line).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${FTB_TRAIN_TORCH:-torch==2.13.0 numpy}
base=$(bash .ci/testhost-image.sh | tail -n 1)
hash=$( (cat .ci/train-image.sh; echo "$TORCH $base") | sha256sum | cut -c1-12)
ref="ftbundle-train-cpu:$hash"
if docker image inspect "$ref" >/dev/null 2>&1; then
    echo "$ref"; exit 0
fi
# one build at a time (parallel test workers, two checkouts): the others wait and reuse it
exec 9>/var/lock/ftbundle-train-image.lock
flock 9
if docker image inspect "$ref" >/dev/null 2>&1; then
    echo "$ref"; exit 0
fi
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# The controller's pip resolves torch and its pure-Python dependencies (cp311 wheels,
# the same ABI as bookworm's python3.11) into the build context.
python3 -m pip install -q --no-compile --target "$ctx/torch" $TORCH >&2
rm -rf "$ctx"/torch/bin
cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM $base
COPY torch /opt/torch
ENV PYTHONPATH=/opt/torch
LABEL org.ftbundle.recipe=$hash
CMD ["python3", "-c", "import torch; print(torch.__version__)"]
DOCKERFILE
DOCKER_BUILDKIT=0 docker build -q -t "$ref" "$ctx" >&2
docker tag "$ref" ftbundle-train-cpu:latest
echo "$ref"
