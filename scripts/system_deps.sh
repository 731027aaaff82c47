#!/usr/bin/env bash
# Installs the system packages that tests start for real. Never fails the build: a missing
# package makes the tests that need it skip with a reason.
set -u
need=()
for pkg in "$@"; do need+=("$pkg"); done
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps: apt-get not found; tests needing ${need[*]} will skip" >&2
    exit 0
fi
missing=()
for pkg in "${need[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
echo "system_deps: installing ${missing[*]}" >&2
($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    --no-install-recommends "${missing[@]}") >/dev/null 2>&1 \
    || echo "system_deps: could not install ${missing[*]}; tests needing them will skip" >&2
exit 0
