#!/usr/bin/env bash
# Build the small CPU training image used by the docker-runtime tests:
# the test-host image's Debian (bookworm, python3.11) without what only a test host needs
# (its Docker engine, sshd's entrypoint, docs), plus the CPU build of torch installed into
# /opt/torch (PYTHONPATH). Built locally (nothing can be pulled), cached by a hash of this
# recipe. Prints the image reference (last line).
# Every provisioning test host pulls it from a registry (gzip, then unpack): each 100 MB
# less is about 1.2 s of CPU per host and pull, so it carries nothing a rank does not use.
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
# ... and in the image, the bytecode of what torchrun and a rank import (the RUN below): without
# it every container (each rank's, each torchrun's) compiled torch again, 3.0 s against 1.2 s for
# `import torch` here; all of torch compiled would add 147 MB to every pull, this adds 20 MB
rm -rf "$ctx"/torch/bin "$ctx"/torch/torch/test  # pip's scripts; torch's own test suite (83 MB)
cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM $base AS os
# the test host's Docker engine (about 250 MB) and documentation: never used by a rank
RUN dpkg --purge docker.io containerd runc >/dev/null \\
 && rm -rf /usr/share/doc /usr/share/man /usr/share/info /usr/share/locale /var/lib/apt/lists/* \\
    /usr/sbin/ftbundle-testhost-entrypoint /var/lib/docker /var/lib/containerd
FROM scratch
COPY --from=os / /
COPY torch /opt/torch
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PYTHONPATH=/opt/torch
RUN cd /tmp && python3 -c "import torch, torch.distributed.run, torch.nn.parallel, torch.optim, torch.utils.data"
LABEL org.ftbundle.recipe=$hash
CMD ["python3", "-c", "import torch; print(torch.__version__)"]
DOCKERFILE
DOCKER_BUILDKIT=0 docker build -q -t "$ref" "$ctx" >&2
docker tag "$ref" ftbundle-train-cpu:latest
echo "$ref"
