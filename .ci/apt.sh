# shellcheck shell=bash
# Sourced by the .ci scripts: Debian packages a fresh machine may lack, installed by the
# project itself (`apt-get update` first only when the install fails without it, as on a
# fresh image whose package lists are empty).
ftb_install() {
    echo "ci: installing $*" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2 || {
        apt-get update -q >&2; DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; }
}

# `ftb_need CMD:PACKAGE ...`: install each PACKAGE whose CMD is not on PATH (one apt-get).
ftb_need() {
    local missing=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] || ftb_install "${missing[@]}"
}
