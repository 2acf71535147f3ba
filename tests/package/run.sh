#!/bin/bash
# Package tests for ate-devplugd: the built .deb, a node-image bake, and the
# service under a real, booted systemd.
#
#   tests/package/run.sh [DEB]
#
# DEB defaults to a fresh build (packaging/build-deb.sh, lintian included).
# Needs root, mmdebstrap and systemd-container (installed when missing), and
# apt access for the first run; the Debian 12 tree is cached under
# .cache/nspawn/, keyed on the package's Depends and this script.
#
# Checks, each printed as PASS/FAIL with its time:
#   - the shipped unit scores <= 1.2 in systemd-analyze security --offline=true
#   - lintian shows no error or warning; dpkg-deb -c lists what must ship and
#     nothing else (no tests, bench or build-tree files); the conffile is one
#   - bake: dpkg --root installs it into an image with no systemd running; the
#     unit is enabled there and nothing was started
#   - booted systemd (systemd-nspawn --boot): tests/package/inside.sh
# Exits non-zero when any check fails, and then prints the container journal.
# ATE_PKGTEST_KEEP=1 keeps the work directory (packages, console log, journal).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
suite=bookworm
max_exposure=1.2
boot_timeout=900

say() { printf 'package-test: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, systemd-nspawn, dpkg --root)"
[ $# -le 1 ] || die "usage: $0 [DEB]"

work=$(mktemp -d "${TMPDIR:-/tmp}/ate-devplugd-pkgtest.XXXXXX")
cleanup() {
    if mountpoint -q "$work/bake/root" 2>/dev/null; then umount "$work/bake/root"; fi
    if [ "${ATE_PKGTEST_KEEP:-0}" = 1 ]; then say "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

failed=0
results=$work/results.txt
: >"$results"
# check NAME CMD...: run CMD, print and record PASS/FAIL with timing.
check() {
    local name=$1; shift
    local start rc=0
    start=$(date +%s.%N)
    "$@" || rc=$?
    local secs; secs=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
    if [ $rc = 0 ]; then
        printf 'PASS %s (%ss)\n' "$name" "$secs" | tee -a "$results"
    else
        printf 'FAIL %s (%ss)\n' "$name" "$secs" | tee -a "$results"
        failed=1
    fi
}

need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v lintian >/dev/null || need+=(lintian)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 install -y -q "${need[@]}" >&2 || {
        apt-get -o DPkg::Lock::Timeout=300 update -q >&2
        apt-get -o DPkg::Lock::Timeout=300 install -y -q "${need[@]}" >&2
    }
fi

# ---- the packages: the one under test, and a higher version for the upgrade ----------------------------
mkdir -p "$work/share/deb" "$work/share/upgrade"
if [ $# = 1 ]; then
    [ -f "$1" ] || die "no such file: $1"
    cp "$1" "$work/share/deb/"
else
    say "building the package"
    "$top/packaging/build-deb.sh" "$work/share/deb" >"$work/build.log" 2>&1 ||
        { cat "$work/build.log" >&2; die "packaging/build-deb.sh failed"; }
fi
deb=$(ls "$work"/share/deb/ate-devplugd_*_all.deb)
[ "$(printf '%s\n' "$deb" | wc -l)" = 1 ] || die "expected one .deb, got: $deb"
version=$(dpkg-deb -f "$deb" Version)
say "testing $(basename "$deb")"
"$top/packaging/build-deb.sh" --no-lintian --version "$version+pkgtest1" "$work/share/upgrade" \
    >"$work/build-upgrade.log" 2>&1 ||
    { cat "$work/build-upgrade.log" >&2; die "building the upgrade package failed"; }

# ---- static checks on the .deb -----------------------------------------------------------------
mkdir "$work/deb"
dpkg-deb -x "$deb" "$work/deb"
dpkg-deb -e "$deb" "$work/deb/DEBIAN"

exposure() {
    local out score
    out=$(systemd-analyze security --offline=true --no-pager \
        "$work/deb/lib/systemd/system/ate-devplugd.service" 2>&1) || true
    score=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for .*: \([0-9.]*\).*/\1/p')
    say "exposure: ${score:-unknown} (at most $max_exposure)"
    if [ -z "$score" ] || ! awk "BEGIN { exit !($score <= $max_exposure) }"; then
        printf '%s\n' "$out" | grep -v '^✓' >&2
        return 1
    fi
}
check "systemd-analyze security --offline=true <= $max_exposure" exposure

lintian_clean() {
    local report
    report=$(lintian -EvIL +pedantic --fail-on none "$deb" 2>/dev/null)
    [ -z "$report" ] || printf '%s\n' "$report" | sed 's/^/  lintian: /' >&2
    ! printf '%s\n' "$report" | grep -q '^[EW]: '
}
check "lintian -EvIL +pedantic: no error, no warning" lintian_clean

contents() {
    local listing rc=0 path
    listing=$(dpkg-deb -c "$deb" | awk '{ print $6 }' | sed 's|^\./|/|; s|/$||' | grep -v '^/\?$')
    for path in /usr/bin/ate-devplugd \
                /lib/systemd/system/ate-devplugd.service \
                /etc/ate-devplugd/config.toml \
                /usr/share/man/man8/ate-devplugd.8.gz \
                /usr/share/man/man5/ate-devplugd.toml.5.gz \
                /usr/share/doc/ate-devplugd/copyright \
                /usr/share/doc/ate-devplugd/changelog.gz \
                /usr/lib/python3/dist-packages/ate_devplugd/__init__.py \
                /usr/lib/python3/dist-packages/ate_devplugd/cli.py \
                /usr/lib/python3/dist-packages/ate_devplugd/_pb/api_pb2.py \
                /usr/lib/python3/dist-packages/ate_devplugd/_pb/api_pb2_grpc.py; do
        grep -qxF "$path" <<<"$listing" || { say "missing from the package: $path"; rc=1; }
    done
    # Everything else must be one of these, or a directory leading to them.
    local allowed='^/(etc|etc/ate-devplugd|etc/ate-devplugd/config\.toml|lib|lib/systemd|lib/systemd/system|lib/systemd/system/ate-devplugd\.service|usr|usr/bin|usr/bin/ate-devplugd|usr/lib|usr/lib/python3|usr/lib/python3/dist-packages|usr/lib/python3/dist-packages/ate_devplugd(/[A-Za-z0-9_]+)*(/([A-Za-z0-9_]+\.py|py\.typed))?|usr/lib/python3/dist-packages/ate_devplugd-[0-9][^/]*\.dist-info(/[A-Za-z_.]+)?|usr/share|usr/share/doc|usr/share/doc/ate-devplugd|usr/share/doc/ate-devplugd/(copyright|changelog\.gz)|usr/share/man|usr/share/man/man[58]|usr/share/man/man8/ate-devplugd\.8\.gz|usr/share/man/man5/ate-devplugd\.toml\.5\.gz|usr/share/lintian|usr/share/lintian/overrides|usr/share/lintian/overrides/ate-devplugd)$'
    while IFS= read -r path; do
        [[ $path =~ $allowed ]] || { say "unexpected in the package: $path"; rc=1; }
        case "$path" in
            */tests|*/tests/*|*/bench|*/bench/*|*/__pycache__*|*.pyc|*/.pybuild*|*/build/*|*/debian/*|*/packaging/*)
                say "build-tree or test file in the package: $path"; rc=1 ;;
        esac
    done <<<"$listing"
    grep -qxF /etc/ate-devplugd/config.toml "$work/deb/DEBIAN/conffiles" ||
        { say "/etc/ate-devplugd/config.toml is not a conffile"; rc=1; }
    cmp -s "$work/deb/etc/ate-devplugd/config.toml" "$top/packaging/config.toml" ||
        { say "shipped config differs from packaging/config.toml"; rc=1; }
    local dep
    for dep in python3-grpcio python3-protobuf python3-systemd python3-pyudev python3-prometheus-client; do
        dpkg-deb -f "$deb" Depends | grep -q "$dep" || { say "Depends lacks $dep"; rc=1; }
    done
    return $rc
}
check "dpkg-deb -c: what must ship, and nothing of the build tree" contents

# ---- the Debian 12 tree, cached --------------------------------------------------------------------
# Runtime dependencies of the package (names only), so that the install works offline.
depends=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed 's/^[[:space:]]*//; s/[[:space:](|].*//; s/:any$//' |
    grep -v '^$' | sort -u | paste -sd, -)
include="systemd,systemd-sysv,dbus,$depends"
test_unit='[Unit]
Description=ate-devplugd package test
After=multi-user.target
ConditionPathExists=/mnt/share/inside.sh

[Service]
Type=oneshot
ExecStart=/bin/bash /mnt/share/inside.sh
ExecStopPost=/bin/systemctl poweroff --no-block
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=15min

[Install]
WantedBy=multi-user.target'
key=$(printf '%s\n' "$suite" "$include" "$test_unit" | sha256sum | cut -c1-16)
cache=$top/.cache/nspawn
root=$cache/$key/root
build_tree() {
    [ -f "$cache/$key/complete" ] && return 0
    say "building the $suite tree in $cache/$key (include: $include)"
    rm -rf "$cache/$key.tmp"
    mkdir -p "$cache/$key.tmp"
    printf '%s\n' "$test_unit" >"$cache/$key.tmp/ate-pkgtest.service"
    # shellcheck disable=SC2016 # the hooks expand "$1" (the tree) when mmdebstrap runs them
    mmdebstrap --variant=apt --include="$include" \
        --customize-hook='cp "'"$cache/$key.tmp"'/ate-pkgtest.service" "$1/etc/systemd/system/"' \
        --customize-hook='chroot "$1" systemctl enable ate-pkgtest.service' \
        --customize-hook='mkdir -p "$1/mnt/share"' \
        "$suite" "$cache/$key.tmp/root" >"$work/mmdebstrap.log" 2>&1 ||
        { tail -n 30 "$work/mmdebstrap.log" >&2; return 1; }
    # Trees built for another package or test version are of no further use.
    find "$cache" -mindepth 1 -maxdepth 1 -not -name "$key.tmp" -exec rm -rf {} +
    mv "$cache/$key.tmp" "$cache/$key"
    touch "$cache/$key/complete"
}
mkdir -p "$cache"
exec 9>"$cache/../nspawn.lock"
flock 9
check "Debian 12 tree for systemd-nspawn (cached)" build_tree
[ -f "$cache/$key/complete" ] || { cat "$results"; exit 1; }

# ---- node-image bake: install with no systemd running ----------------------------------------------
bake() {
    local merged=$work/bake/root rc=0 pid
    mkdir -p "$work/bake/upper" "$work/bake/work" "$merged"
    mount -t overlay overlay -o "lowerdir=$root,upperdir=$work/bake/upper,workdir=$work/bake/work" "$merged"
    [ ! -e "$merged/run/systemd/system" ] || { say "image has /run/systemd/system"; rc=1; }
    DEBIAN_FRONTEND=noninteractive dpkg --root="$merged" -i "$deb" >"$work/bake.log" 2>&1 ||
        { cat "$work/bake.log" >&2; rc=1; }
    [ -L "$merged/etc/systemd/system/multi-user.target.wants/ate-devplugd.service" ] ||
        { say "unit not enabled in the image"; rc=1; }
    # shellcheck disable=SC2016 # a dpkg-query format, not a shell expression
    [ "$(chroot "$merged" dpkg-query -W -f '${db:Status-Status}' ate-devplugd)" = installed ] ||
        { say "package not configured in the image"; rc=1; }
    # Not started: no process lives in the image, and ExecStartPre never ran.
    for pid in /proc/[0-9]*; do
        if [ "$(readlink "$pid/root" 2>/dev/null)" = "$merged" ]; then
            say "process running in the image: $(tr '\0' ' ' <"$pid/cmdline")"; rc=1
        fi
    done
    [ ! -e "$merged/var/lib/kubelet/device-plugins" ] || { say "the service was started"; rc=1; }
    umount "$merged"
    return $rc
}
check "bake: dpkg --root install enables the unit, starts nothing" bake

# ---- booted systemd ----------------------------------------------------------------------------
share=$work/share
cp "$here/inside.sh" "$here/wait_event.py" "$share/"
cp -a "$top/tests/fakes" "$share/fakes"
cp -a "$top/src" "$share/src"
find "$share/src" "$share/fakes" -name __pycache__ -prune -exec rm -rf {} +

booted() {
    local args=(-q -D "$root" --boot --register=no --keep-unit --volatile=overlay --private-network
                --bind="$share:/mnt/share" --console=pipe)
    # Read-only: a writable bind lets the container's tmpfiles change the host's node.
    [ ! -c /dev/kvm ] || args+=(--bind-ro=/dev/kvm)
    say "booting $root"
    timeout --kill-after=30 "$boot_timeout" systemd-nspawn "${args[@]}" </dev/null >"$work/console.log" 2>&1 ||
        say "systemd-nspawn exited with status $?"
    [ -f "$share/results.txt" ] || { say "the test unit did not run"; return 1; }
    grep -v '^DONE$' "$share/results.txt" | sed 's/^/  /'
    grep -qx DONE "$share/results.txt" || { say "the test unit did not finish"; return 1; }
    ! grep -q '^FAIL' "$share/results.txt"
}
check "booted systemd (systemd-nspawn --boot): service lifecycle" booted

echo
cat "$results"
inner=$(cat "$share/results.txt" 2>/dev/null || true)
count() { grep -c "$1" || true; }
passed=$(( $(count '^PASS' <"$results") + $(count '^ *PASS' <<<"$inner") ))
failures=$(( $(count '^FAIL' <"$results") + $(count '^ *FAIL' <<<"$inner") ))
echo "package-test: $passed passed, $failures failed"
if [ $failed != 0 ]; then
    if [ -s "$share/journal.txt" ]; then
        echo "---- container journal"; cat "$share/journal.txt"
    elif [ -s "$work/console.log" ]; then
        echo "---- container console"; cat "$work/console.log"
    fi
    exit 1
fi
