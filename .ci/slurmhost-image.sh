#!/usr/bin/env bash
# Build the "Slurm host" image for tests/support/slurm.py: the test-host image
# (.ci/testhost-image.sh: sshd, python3, the controller interpreter's libraries)
# plus Debian's slurm-wlm, slurm-wlm-torque (qsub/pbsnodes over Slurm) and munge. A separate image, so that the other tests
# keep theirs.
#
# Packages come from the apt sources that debootstrap wrote into the test-host
# image (this machine's own mirror); nothing is pulled from a registry. The image
# is tagged ftbundle-slurmhost:<hash>, <hash> = first 12 hex chars of
# sha256(this script + the base image reference), so a new base or a new recipe
# makes a new image; an existing one is reused. The reference is the last line on
# stdout; everything else goes to stderr.
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
HERE=$(dirname "$SELF")
IMAGE_NAME=ftbundle-slurmhost
LOCK=/var/lock/ftbundle-slurmhost-image.lock
PACKAGES=(slurm-wlm slurm-wlm-torque munge)

say() { echo "slurmhost-image: $*" >&2; }

BASE=$(bash "$HERE/testhost-image.sh" | tail -n 1)
HASH=$({ cat "$SELF"; echo "$BASE"; } | sha256sum | cut -c1-12)
REF="$IMAGE_NAME:$HASH"

mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock 9

if docker image inspect "$REF" >/dev/null 2>&1; then
    say "reusing $REF"
    echo "$REF"
    exit 0
fi

START=$SECONDS
BUILD="ftbundle-slurmhost-build-$$"
trap 'docker rm -f "$BUILD" >/dev/null 2>&1 || true' EXIT
say "building $REF from $BASE: ${PACKAGES[*]}"
docker run --name "$BUILD" --entrypoint /bin/sh -e DEBIAN_FRONTEND=noninteractive "$BASE" -c '
    set -e
    apt-get update -q
    apt-get install -y -q --no-install-recommends "$@"
    apt-get clean
    rm -rf /var/lib/apt/lists/* /etc/munge/munge.key
' sh "${PACKAGES[@]}" >&2
docker commit \
    --change 'ENTRYPOINT ["/usr/sbin/ftbundle-testhost-entrypoint"]' \
    --change 'CMD ["/usr/sbin/sshd", "-D", "-e"]' \
    --change "LABEL org.ftbundle.slurmhost.recipe=$HASH" \
    "$BUILD" "$REF" >&2
say "built $REF in $((SECONDS - START))s"
echo "$REF"
