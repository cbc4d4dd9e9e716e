#!/usr/bin/env bash
# Build the Debian bookworm "test host" image used by the containerized test
# cluster (tests/support/cluster.py): sshd with key-only root login, python3, docker.io,
# nftables and the shared libraries that the controller's Python needs, so that
# the controller's venv (bind-mounted read-only with its sys.base_prefix) runs
# inside the hosts.
#
# No registry is reachable, so the root filesystem is made with debootstrap from
# the apt mirror this machine already uses, then `docker import`ed.
#
# The image is tagged ftbundle-testhost:<hash>, <hash> = first 12 hex chars of
# sha256(this script + package list), and ftbundle-testhost:latest. An existing
# image with that hash is reused. The image reference is the last line printed
# on stdout; everything else goes to stderr.
#
# Environment (all optional):
#   FTBUNDLE_PYTHON       interpreter whose shared-library needs are added
#                         (default: <repo>/.venv/bin/python, else python3)
#   FTBUNDLE_APT_MIRROR   debootstrap mirror (default: read from apt sources)
#   FTBUNDLE_TESTHOST_REBUILD=1  rebuild even if the hash tag exists
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
HERE=$(dirname "$SELF")
REPO=$(dirname "$HERE")
IMAGE_NAME=ftbundle-testhost
SUITE=bookworm
LOCK=/var/lock/ftbundle-testhost-image.lock

say() { echo "testhost-image: $*" >&2; }

# What the test hosts run.
BASE_PACKAGES=(
    python3 openssh-server sudo iproute2 docker.io nftables ca-certificates
    procps psmisc iputils-ping netcat-openbsd iperf3 rsync
    nfs-kernel-server nfs-common openssh-client python3-apt
    sshfs  # a network filesystem the tests can freeze (no NFS in this kernel: tests/cluster/test_storage_hang.py)
)
# Shared libraries that a CPython built outside Debian (pyenv) links to (see
# `ldd` of the interpreter and of _ssl, _ctypes, _sqlite3, _lzma, _bz2, readline,
# _uuid, _curses, _dbm/_gdbm); libstdc++6 for C++ wheels (torch bundles the rest).
# The libraries of the actual controller interpreter are added below as detected.
PYLIB_PACKAGES=(
    libssl3 libffi8 libsqlite3-0 liblzma5 libbz2-1.0 zlib1g libreadline8
    libgdbm6 libuuid1 libncursesw6 libtinfo6 libstdc++6 libexpat1
)

# --- the controller interpreter's library needs (best effort) ------------------
pick_python() {
    if [ -n "${FTBUNDLE_PYTHON:-}" ]; then
        echo "$FTBUNDLE_PYTHON"
    elif [ -x "$REPO/.venv/bin/python" ]; then
        echo "$REPO/.venv/bin/python"
    else
        command -v python3 || true
    fi
}

detect_python_packages() {
    local py info base exe f lib
    py=$(pick_python)
    [ -n "$py" ] && [ -x "$py" ] || return 0
    command -v dpkg >/dev/null 2>&1 || return 0
    info=$("$py" -c 'import os, sys; print(sys.base_prefix); print(os.path.realpath(sys.executable))' 2>/dev/null) || return 0
    base=${info%%$'\n'*}
    exe=${info#*$'\n'}
    # Debian's own python3 is in the image anyway.
    case "$base" in /usr|/) return 0 ;; esac
    local files=("$exe")
    shopt -s nullglob
    files+=("$base"/lib/libpython3*.so* "$base"/lib/python3*/lib-dynload/*.so)
    shopt -u nullglob
    # libraries outside the Python prefix, under every name dpkg may know them by
    # (/lib and /usr/lib are aliases since usrmerge)
    local -a cands=()
    while read -r lib; do
        case "$lib" in "$base"/*) continue ;; esac
        f=$(readlink -f "$lib" 2>/dev/null || echo "$lib")
        cands+=("$lib" "$f" "/usr$lib" "/usr$f" "${lib#/usr}" "${f#/usr}")
    done < <(
        for f in "${files[@]}"; do
            case "$f" in *_tkinter*) continue ;; esac   # GUI: not on test hosts
            ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
        done | sort -u)
    [ "${#cands[@]}" -gt 0 ] || return 0
    local -a pkgs
    # "pkg:arch[, pkg2:arch]: /path"; diversions are not packages
    mapfile -t pkgs < <(dpkg -S "${cands[@]}" 2>/dev/null | grep -v '^diversion' |
        sed -E 's/: \/.*$//' | tr ',' '\n' | sed -E 's/^ +//; s/:.*$//' | awk 'NF' | sort -u)
    [ "${#pkgs[@]}" -gt 0 ] || return 0
    # only what the archive has (a locally built library cannot be installed)
    apt-cache policy "${pkgs[@]}" 2>/dev/null | awk '
        /^[^ ].*:$/ { sub(/:$/, ""); name = $0; next }
        $1 == "Candidate:" && $2 != "(none)" { print name }'
}

mapfile -t DETECTED < <(detect_python_packages | sort -u)
mapfile -t PACKAGES < <(printf '%s\n' "${BASE_PACKAGES[@]}" "${PYLIB_PACKAGES[@]}" ${DETECTED[@]+"${DETECTED[@]}"} | awk 'NF && !seen[$0]++')

ZIPCACHE="$HERE/testhost/ftb_test_zipcache.py"
HASH=$({ cat "$SELF" "$ZIPCACHE"; printf '%s\n' "${PACKAGES[@]}"; } | sha256sum | cut -c1-12)
REF="$IMAGE_NAME:$HASH"

# --- engine -------------------------------------------------------------------
bash "$HERE/docker-engine.sh" >&2

# One build at a time on this machine; the second waits, then reuses.
mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock 9

if [ "${FTBUNDLE_TESTHOST_REBUILD:-0}" != 1 ] && docker image inspect "$REF" >/dev/null 2>&1; then
    docker tag "$REF" "$IMAGE_NAME:latest"
    say "reusing $REF"
    echo "$REF"
    exit 0
fi

# --- tools --------------------------------------------------------------------
# shellcheck source=.ci/apt.sh
. "$HERE/apt.sh"
ftb_need debootstrap:debootstrap

# --- mirror: whatever this machine's apt uses ----------------------------------
mirror_from_sources() {
    local f
    shopt -s nullglob
    for f in /etc/apt/sources.list.d/*.sources; do
        awk -v suite="$SUITE" '
            function flush() {
                if (!found && enabled && types ~ /(^|[ \t])deb([ \t]|$)/ &&
                    (" " suites " ") ~ ("[ \t]" suite "[ \t]") && uris != "") {
                    split(uris, u, " "); print u[1]; found = 1
                }
                types = ""; suites = ""; uris = ""; enabled = 1
            }
            BEGIN { enabled = 1 }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]*#/ { next }
            tolower($1) == "types:"   { $1 = ""; types = $0 }
            tolower($1) == "suites:"  { $1 = ""; suites = $0 }
            tolower($1) == "uris:"    { $1 = ""; uris = $0 }
            tolower($1) == "enabled:" { enabled = (tolower($2) != "no") }
            END { flush() }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) print $i
            }' "$f"
    done
    shopt -u nullglob
}

MIRROR=${FTBUNDLE_APT_MIRROR:-$(mirror_from_sources | head -n1)}
if [ -z "$MIRROR" ]; then
    say "no apt source for '$SUITE' found in /etc/apt/sources.list{,.d/}; set FTBUNDLE_APT_MIRROR"
    exit 1
fi

# --- build --------------------------------------------------------------------
WORK=$(mktemp -d /var/tmp/ftbundle-testhost.XXXXXX)
ROOTFS="$WORK/rootfs"
cleanup() {
    # debootstrap may leave /proc, /sys ... mounted in the rootfs on failure
    if [ -d "$ROOTFS" ]; then
        awk -v r="$ROOTFS" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r |
            while read -r m; do umount -l "$m" 2>/dev/null || true; done
    fi
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

START=$SECONDS
INCLUDE=$(IFS=,; echo "${PACKAGES[*]}")
say "building $REF from $MIRROR ($SUITE, minbase)"
say "packages: $INCLUDE"
if ! debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1; then
    say "debootstrap failed; last lines of its log:"
    tail -n 60 "$WORK/debootstrap.log" >&2
    [ -f "$ROOTFS/debootstrap/debootstrap.log" ] && tail -n 40 "$ROOTFS/debootstrap/debootstrap.log" >&2
    exit 1
fi

# sshd: key-only root login; host keys are made per container at start.
mkdir -p "$ROOTFS/etc/ssh/sshd_config.d"
cat >"$ROOTFS/etc/ssh/sshd_config.d/ftbundle-testhost.conf" <<'EOF'
# ftbundle test host (tests/support/cluster.py)
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
# many parallel sessions from the launcher and Ansible
MaxStartups 200:30:400
MaxSessions 100
# host keys made per container at start (the entrypoint): ed25519 and ecdsa only
HostKey /etc/ssh/ssh_host_ed25519_key
HostKey /etc/ssh/ssh_host_ecdsa_key
EOF
rm -f "$ROOTFS"/etc/ssh/ssh_host_*
# pam_loginuid cannot write /proc/self/loginuid in an unprivileged container.
if [ -f "$ROOTFS/etc/pam.d/sshd" ]; then
    sed -i -E 's/^(session\s+)required(\s+pam_loginuid\.so)/\1optional\2/' "$ROOTFS/etc/pam.d/sshd"
fi

# Entrypoint (outside /usr/local, which may be a bind-mounted Python prefix).
cat >"$ROOTFS/usr/sbin/ftbundle-testhost-entrypoint" <<'EOF'
#!/bin/sh
# ftbundle test host: sshd runtime dir and per-container host keys, then the command.
# ed25519 and ecdsa keys take milliseconds; an RSA key (ssh-keygen -A) about 0.3 s of CPU,
# on every one of the ~290 container starts of a make test (97 s of CPU, process accounting).
set -e
mkdir -p /run/sshd
chmod 0755 /run/sshd
for type in ed25519 ecdsa; do
    [ -f /etc/ssh/ssh_host_${type}_key ] || ssh-keygen -q -t $type -N '' -f /etc/ssh/ssh_host_${type}_key
done
exec "$@"
EOF
chmod 0755 "$ROOTFS/usr/sbin/ftbundle-testhost-entrypoint"

# Ansible's modules compiled once per host, not on every task (see the file; test hosts only).
# In Debian's dist-packages, not /usr/local (which may be a bind-mounted Python prefix).
install -m 0644 "$ZIPCACHE" "$ROOTFS/usr/lib/python3/dist-packages/ftb_test_zipcache.py"
echo "import ftb_test_zipcache" >"$ROOTFS/usr/lib/python3/dist-packages/ftb-test-zipcache.pth"

mkdir -p "$ROOTFS/root/.ssh"
chmod 0700 "$ROOTFS/root" "$ROOTFS/root/.ssh"
: >"$ROOTFS/etc/machine-id"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/log/*.log "$ROOTFS/debootstrap"

say "importing into docker"
tar -C "$ROOTFS" --numeric-owner --one-file-system -c . |
    docker import \
        --change 'ENTRYPOINT ["/usr/sbin/ftbundle-testhost-entrypoint"]' \
        --change 'CMD ["/usr/sbin/sshd", "-D", "-e"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'EXPOSE 22' \
        --change "LABEL org.ftbundle.testhost.recipe=$HASH" \
        --message "ftbundle test host ($SUITE minbase, recipe $HASH)" \
        - "$REF" >&2
docker tag "$REF" "$IMAGE_NAME:latest"
say "built $REF in $((SECONDS - START))s"
# Older recipes are dead weight (about 500 MB each). Keep those made in the
# last 6 hours (a test session may still be about to use one) and those used
# by a container (rmi without -f refuses them).
now=$(date +%s)
docker image ls --format '{{.Repository}}:{{.Tag}}' "$IMAGE_NAME" |
    grep -v -x -e "$REF" -e "$IMAGE_NAME:latest" |
    while read -r old; do
        created=$(date -d "$(docker image inspect -f '{{.Created}}' "$old" 2>/dev/null)" +%s 2>/dev/null) || continue
        if [ $((now - created)) -gt 21600 ] && docker rmi "$old" >/dev/null 2>&1; then
            say "removed old $old"
        fi
    done || true
echo "$REF"
