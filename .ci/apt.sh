# shellcheck shell=bash
# Sourced by the .ci scripts: Debian packages a fresh machine may lack, installed by the
# project itself (`apt-get update` first only when the install fails without it, as on a
# fresh image whose package lists are empty).
#
# One install at a time on this machine: make test's workers and a second checkout may each
# find a package missing at once (two registries started together on a fresh machine: the
# second apt-get failed on dpkg's lock and the whole lived-in module errored). Our own lock
# serializes ours; apt's DPkg::Lock::Timeout waits out anyone else's (unattended-upgrades).
FTB_APT_LOCK=${FTB_APT_LOCK:-/var/lock/ftbundle-apt.lock}
ftb_apt() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@"; }
ftb_install() {
    echo "ci: installing $*" >&2
    (
        flock 8
        ftb_apt install -y -q "$@" >&2 || { ftb_apt update -q >&2; ftb_apt install -y -q "$@" >&2; }
    ) 8>"$FTB_APT_LOCK"
}

# `ftb_need CMD:PACKAGE ...`: install each PACKAGE whose CMD is not on PATH (one apt-get).
ftb_need() {
    local missing=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] || ftb_install "${missing[@]}"
}
