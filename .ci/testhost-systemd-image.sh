#!/usr/bin/env bash
# The test-host image with systemd as PID 1 (molecule/systemd): the image of
# .ci/testhost-image.sh plus `systemd systemd-sysv dbus` (and firewalld, disabled: the firewall
# role's refusal of a running firewalld is tested on these hosts), installed with apt from the
# mirror that image's sources.list names (no debootstrap of its own).
#
# Tagged ftbundle-testhost-systemd:<hash>, <hash> = first 12 hex chars of
# sha256(this script + the base image's reference); an existing one is reused. The
# reference is the last line on stdout. Run it with --cgroupns=private, --tmpfs /run,
# /run/lock, SYS_ADMIN, apparmor and seccomp unconfined, and NOT /sys/fs/cgroup bind-mounted
# from the host (as shared/ENVIRONMENT.md's "Hosts with systemd as PID 1" has it): under
# cgroup v1 every such container's systemd then writes the host's one /system.slice, so two
# hosts' units share cgroups, and one host stopping a unit empties the cgroup of the other's
# ("Failed to attach to cgroup /system.slice/ftbundle-firewall.service", status=219/CGROUP,
# seen in make test). The entrypoint instead makes the container's own cgroup mounts
# (rooted at its private namespace: the host's docker/<id>) writable, then starts systemd.
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
HERE=$(dirname "$SELF")
NAME=ftbundle-testhost-systemd
LOCK=/var/lock/ftbundle-testhost-systemd-image.lock
say() { echo "testhost-systemd-image: $*" >&2; }

BASE=$(bash "$HERE/testhost-image.sh" | tail -n1)
HASH=$({ cat "$SELF"; echo "$BASE"; } | sha256sum | cut -c1-12)
REF="$NAME:$HASH"

mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock 9
if docker image inspect "$REF" >/dev/null 2>&1; then
    say "reusing $REF"
    echo "$REF"
    exit 0
fi

START=$SECONDS
BUILDER="ftbundle-systemd-build-$$"
trap 'docker rm -f "$BUILDER" >/dev/null 2>&1 || true' EXIT
say "building $REF from $BASE"
docker run --name "$BUILDER" --entrypoint /bin/sh "$BASE" -c '
    set -e
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends systemd systemd-sysv dbus firewalld
    # installed for the refusal test of the firewall role, started by that test alone
    systemctl disable firewalld.service >/dev/null 2>&1 || true
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
    # what a container cannot do, and what the test hosts start by other means
    systemctl mask systemd-udevd.service systemd-udevd-kernel.socket systemd-udevd-control.socket \
        getty.target console-getty.service systemd-logind.service sys-kernel-config.mount \
        sys-kernel-debug.mount sys-kernel-tracing.mount >/dev/null 2>&1 || true
    # NFSv3 locking, no use without a kernel NFS client; under cgroup v1 its start can hang
    # for 3 minutes ("New main PID does not belong to service"), and the boot with it
    systemctl mask rpc-statd.service rpc-statd-notify.service >/dev/null 2>&1 || true
    systemctl enable ssh.service >/dev/null 2>&1 || true
    : > /etc/machine-id
    cat >/usr/sbin/ftbundle-systemd-entrypoint <<"EOF"
#!/bin/sh
# ftbundle test host with systemd: its own cgroups writable (see .ci/testhost-systemd-image.sh)
set -e
mount -o remount,rw /sys/fs/cgroup
for hierarchy in /sys/fs/cgroup/*; do
    if mountpoint -q "$hierarchy"; then mount -o remount,rw,bind "$hierarchy"; fi
done
exec /usr/sbin/ftbundle-testhost-entrypoint "$@"
EOF
    chmod 0755 /usr/sbin/ftbundle-systemd-entrypoint' >&2
docker commit \
    --change 'ENTRYPOINT ["/usr/sbin/ftbundle-systemd-entrypoint"]' \
    --change 'CMD ["/lib/systemd/systemd"]' \
    --change "LABEL org.ftbundle.testhost-systemd.recipe=$HASH" \
    "$BUILDER" "$REF" >&2
say "built $REF in $((SECONDS - START))s"
echo "$REF"
