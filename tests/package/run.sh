#!/bin/bash
# Package tests for ate-devplugd: the built .deb, a node-image bake, and the
# service under a real, booted systemd, on each Debian release we support.
#
#   tests/package/run.sh [--suite SUITE]... [DEB]
#
# SUITE is bookworm (Debian 12) or trixie (Debian 13); --suite may be given
# more than once, and without it both are tested, one after the other, with
# the same .deb. DEB defaults to a fresh build (packaging/build-deb.sh, lintian
# included). Needs root, mmdebstrap and systemd-container (installed when
# missing), and apt access for the first run; each release's tree is cached
# under .cache/nspawn/<suite>-<key>/, keyed on the suite, the package's Depends
# and the test unit.
#
# Checks, each printed as PASS/FAIL with its time:
#   - lintian shows no error or warning; dpkg-deb -c lists what must ship and
#     nothing else (no tests, bench or build-tree files); the conffile is one
# and then for each suite, marked [SUITE]:
#   - the shipped unit scores <= 1.2 in systemd-analyze security
#     --offline=true, with that release's systemd (its checks differ)
#   - bake: dpkg --root installs it into an image with no systemd running; the
#     unit is enabled there and nothing was started
#   - booted systemd (systemd-nspawn --boot): tests/package/inside.sh
# Ends with one count line per suite and a total. Exits non-zero when any check
# fails, and then prints the failing suite's container journal.
# ATE_PKGTEST_KEEP=1 keeps the work directory (packages, console logs, journals).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
all_suites=(bookworm trixie)
max_exposure=1.2
# DRA mode's drop-in (/usr/share/ate-devplugd/dra-mode.conf) adds Internet sockets, for the API server.
max_exposure_dra=1.5
boot_timeout=900

say() { printf 'package-test: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }
usage() { die "usage: $0 [--suite bookworm|trixie]... [DEB]"; }
suites=()
deb_arg=()
while [ $# -gt 0 ]; do
    case "$1" in
        --suite) [ $# -ge 2 ] || usage; suites+=("$2"); shift 2 ;;
        --suite=*) suites+=("${1#--suite=}"); shift ;;
        -*) usage ;;
        *) [ ${#deb_arg[@]} = 0 ] || usage; deb_arg=("$1"); shift ;;
    esac
done
[ ${#suites[@]} -gt 0 ] || suites=("${all_suites[@]}")
for suite in "${suites[@]}"; do
    [[ " ${all_suites[*]} " == *" $suite "* ]] || die "unknown suite $suite (known: ${all_suites[*]})"
done
release() {  # release SUITE: how the reports name it
    case "$1" in bookworm) echo "Debian 12 (bookworm)" ;; trixie) echo "Debian 13 (trixie)" ;; *) echo "$1" ;; esac
}
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, systemd-nspawn, dpkg --root)"

work=$(mktemp -d "${TMPDIR:-/tmp}/ate-devplugd-pkgtest.XXXXXX")
cleanup() {
    local m
    for m in "$work"/*/bake/root "$work"/*/analyze/root "$work"/*/analyze-dra/root; do
        if mountpoint -q "$m" 2>/dev/null; then umount "$m"; fi
    done
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

# ---- the packages: the one under test, and a lower version to upgrade from ------------------------------
mkdir -p "$work/pkgs/deb" "$work/pkgs/previous"
if [ ${#deb_arg[@]} = 1 ]; then
    [ -f "${deb_arg[0]}" ] || die "no such file: ${deb_arg[0]}"
    cp "${deb_arg[0]}" "$work/pkgs/deb/"
else
    say "building the package"
    "$top/packaging/build-deb.sh" "$work/pkgs/deb" >"$work/build.log" 2>&1 ||
        { cat "$work/build.log" >&2; die "packaging/build-deb.sh failed"; }
fi
deb=$(ls "$work"/pkgs/deb/ate-devplugd_*_all.deb)
[ "$(printf '%s\n' "$deb" | wc -l)" = 1 ] || die "expected one .deb, got: $deb"
version=$(dpkg-deb -f "$deb" Version)
say "testing $(basename "$deb") on: ${suites[*]}"
# The same tree as a lower version: "~" sorts before anything, so X~pkgtest1 < X.
"$top/packaging/build-deb.sh" --no-lintian --version "$version~pkgtest1" "$work/pkgs/previous" \
    >"$work/build-previous.log" 2>&1 ||
    { cat "$work/build-previous.log" >&2; die "building the previous version failed"; }

# ---- static checks on the .deb -----------------------------------------------------------------
mkdir "$work/deb"
dpkg-deb -x "$deb" "$work/deb"
dpkg-deb -e "$deb" "$work/deb/DEBIAN"

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
                /usr/lib/systemd/system/ate-devplugd.service \
                /etc/ate-devplugd/config.toml \
                /usr/share/man/man8/ate-devplugd.8.gz \
                /usr/share/man/man5/ate-devplugd.toml.5.gz \
                /usr/share/doc/ate-devplugd/copyright \
                /usr/share/doc/ate-devplugd/changelog.gz \
                /usr/share/ate-devplugd/dra-mode.conf \
                /usr/share/ate-devplugd/ate-devplugd.rules.yml \
                /usr/lib/python3/dist-packages/ate_devplugd/__init__.py \
                /usr/lib/python3/dist-packages/ate_devplugd/cli.py \
                /usr/lib/python3/dist-packages/ate_devplugd/_pb/api_pb2.py \
                /usr/lib/python3/dist-packages/ate_devplugd/_pb/api_pb2_grpc.py; do
        grep -qxF "$path" <<<"$listing" || { say "missing from the package: $path"; rc=1; }
    done
    # Everything else must be one of these, or a directory leading to them.
    local allowed='^/(etc|etc/ate-devplugd|etc/ate-devplugd/config\.toml|usr|usr/bin|usr/bin/ate-devplugd|usr/lib|usr/lib/systemd|usr/lib/systemd/system|usr/lib/systemd/system/ate-devplugd\.service|usr/lib/python3|usr/lib/python3/dist-packages|usr/lib/python3/dist-packages/ate_devplugd(/[A-Za-z0-9_]+)*(/([A-Za-z0-9_]+\.py|py\.typed))?|usr/lib/python3/dist-packages/ate_devplugd-[0-9][^/]*\.dist-info(/[A-Za-z_.]+)?|usr/share|usr/share/doc|usr/share/doc/ate-devplugd|usr/share/doc/ate-devplugd/(copyright|changelog\.gz)|usr/share/man|usr/share/man/man[58]|usr/share/man/man8/ate-devplugd\.8\.gz|usr/share/man/man5/ate-devplugd\.toml\.5\.gz|usr/share/lintian|usr/share/lintian/overrides|usr/share/lintian/overrides/ate-devplugd|usr/share/ate-devplugd|usr/share/ate-devplugd/(dra-mode\.conf|ate-devplugd\.rules\.yml))$'
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
    for dep in python3-grpcio python3-protobuf python3-systemd python3-pyudev python3-aiohttp python3-yaml; do
        dpkg-deb -f "$deb" Depends | grep -q "$dep" || { say "Depends lacks $dep"; rc=1; }
    done
    return $rc
}
check "dpkg-deb -c: what must ship, and nothing of the build tree" contents

# ---- one tree per release, cached ------------------------------------------------------------------
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
cache=$top/.cache/nspawn
# build_tree: the tree of $suite at $tree ($cache/$suite-$key), unless it is there already.
build_tree() {
    [ -f "$tree/complete" ] && return 0
    say "building the $suite tree in $tree (include: $include)"
    rm -rf "$tree.tmp"
    mkdir -p "$tree.tmp"
    printf '%s\n' "$test_unit" >"$tree.tmp/ate-pkgtest.service"
    # shellcheck disable=SC2016 # the hooks expand "$1" (the tree) when mmdebstrap runs them
    mmdebstrap --variant=apt --include="$include" \
        --customize-hook='cp "'"$tree.tmp"'/ate-pkgtest.service" "$1/etc/systemd/system/"' \
        --customize-hook='chroot "$1" systemctl enable ate-pkgtest.service' \
        --customize-hook='mkdir -p "$1/mnt/share"' \
        "$suite" "$tree.tmp/root" >"$sdir/mmdebstrap.log" 2>&1 ||
        { tail -n 30 "$sdir/mmdebstrap.log" >&2; return 1; }
    # Trees of this release built for another package or test version are of no further use, nor
    # are those from before trees were named by release (a bare key).
    find "$cache" -mindepth 1 -maxdepth 1 -regextype posix-extended \
        \( -name "$suite-*" -o -regex '.*/[0-9a-f]{16}' \) -not -name "$suite-$key.tmp" -exec rm -rf {} +
    mv "$tree.tmp" "$tree"
    touch "$tree/complete"
}

# overlay NAME: mount a throwaway overlay of the tree on $sdir/NAME/root (unmounted by the caller).
overlay() {
    local merged=$sdir/$1/root
    mkdir -p "$sdir/$1/upper" "$sdir/$1/work" "$merged"
    mount -t overlay overlay -o "lowerdir=$root,upperdir=$sdir/$1/upper,workdir=$sdir/$1/work" "$merged"
}

# ---- the unit's exposure, as this release's systemd-analyze scores it --------------------------------
# score NAME MAX [DROP-IN]: the unit (with DROP-IN from the package, as docs/switching.md installs it) scored in
# a throwaway overlay of the tree; at most MAX.
score() {
    local name=$1 max=$2 dropin=${3:-} merged=$sdir/$1/root out score
    overlay "$name" || return 1
    mkdir -p "$merged/etc/systemd/system/ate-devplugd.service.d"
    cp "$work/deb/usr/lib/systemd/system/ate-devplugd.service" "$merged/etc/systemd/system/"
    [ -z "$dropin" ] || cp "$work/deb/$dropin" "$merged/etc/systemd/system/ate-devplugd.service.d/"
    out=$(chroot "$merged" systemd-analyze security --offline=true --no-pager ate-devplugd.service 2>&1) || true
    say "[$suite] $(chroot "$merged" systemd-analyze --version | head -n 1)"
    umount "$merged"
    score=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for .*: \([0-9.]*\).*/\1/p')
    say "[$suite] exposure${dropin:+ with $dropin}: ${score:-unknown} (at most $max)"
    if [ -z "$score" ] || ! awk "BEGIN { exit !($score <= $max) }"; then
        printf '%s\n' "$out" | grep -v '^✓' >&2
        return 1
    fi
}
exposure() { score analyze "$max_exposure"; }
# DRA mode's drop-in adds Internet sockets (for the API server) and kubelet's plugin directories.
exposure_dra() { score analyze-dra "$max_exposure_dra" usr/share/ate-devplugd/dra-mode.conf; }

# ---- node-image bake: install with no systemd running ----------------------------------------------
bake() {
    local merged=$sdir/bake/root rc=0 pid
    overlay bake || return 1
    [ ! -e "$merged/run/systemd/system" ] || { say "image has /run/systemd/system"; rc=1; }
    DEBIAN_FRONTEND=noninteractive dpkg --root="$merged" -i "$deb" >"$sdir/bake.log" 2>&1 ||
        { cat "$sdir/bake.log" >&2; rc=1; }
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

# ---- booted systemd ----------------------------------------------------------------------------
booted() {
    local args=(-q -D "$root" --boot --register=no --keep-unit --volatile=overlay --private-network
                --bind="$share:/mnt/share" --console=pipe)
    # Read-only: a writable bind lets the container's tmpfiles change the host's node.
    [ ! -c /dev/kvm ] || args+=(--bind-ro=/dev/kvm)
    say "booting $root"
    timeout --kill-after=30 "$boot_timeout" systemd-nspawn "${args[@]}" </dev/null >"$sdir/console.log" 2>&1 ||
        say "systemd-nspawn exited with status $?"
    [ -f "$share/results.txt" ] || { say "the test unit did not run"; return 1; }
    grep -v '^DONE$' "$share/results.txt" | sed 's/^/  /'
    grep -qx DONE "$share/results.txt" || { say "the test unit did not finish"; return 1; }
    ! grep -q '^FAIL' "$share/results.txt"
}

mkdir -p "$cache"
# Held to the end: a run of another package version must not replace a tree that is in use.
exec 9>"$cache/../nspawn.lock"
flock 9
failed_suites=()
for suite in "${suites[@]}"; do
    echo "== $(release "$suite")"
    sdir=$work/$suite
    share=$sdir/share
    mkdir -p "$share"
    key=$(printf '%s\n' "$suite" "$include" "$test_unit" | sha256sum | cut -c1-16)
    tree=$cache/$suite-$key
    root=$tree/root
    failed_before=$failed
    failed=0
    check "[$suite] $(release "$suite") tree for systemd-nspawn (cached)" build_tree
    if [ -f "$tree/complete" ]; then
        check "[$suite] systemd-analyze security --offline=true <= $max_exposure" exposure
        check "[$suite] the same with DRA mode's drop-in <= $max_exposure_dra" exposure_dra
        check "[$suite] bake: dpkg --root install enables the unit, starts nothing" bake
        cp -a "$work/pkgs/deb" "$work/pkgs/previous" "$share/"
        cp "$here/inside.sh" "$here/wait_event.py" "$here/inplace.py" "$here/control_plane.py" "$share/"
        # The fakes as the package tests.fakes (they import each other so), beside the project's package.
        mkdir -p "$share/tests"
        cp "$top/tests/__init__.py" "$share/tests/"
        cp -a "$top/tests/fakes" "$share/tests/fakes"
        cp -a "$top/src" "$share/src"
        find "$share/src" "$share/tests" -name __pycache__ -prune -exec rm -rf {} +
        check "[$suite] booted systemd (systemd-nspawn --boot): service lifecycle" booted
    fi
    [ $failed = 0 ] || failed_suites+=("$suite")
    failed=$((failed | failed_before))
done

echo
cat "$results"
count() { grep -c "$1" || true; }
# count_suite SUITE: "N passed, M failed" for SUITE's checks, its booted ones included.
passed_all=$(count '^PASS' <"$results"); failed_all=$(count '^FAIL' <"$results")
for suite in "${suites[@]}"; do
    inner=$(cat "$work/$suite/share/results.txt" 2>/dev/null || true)
    p=$(( $(count "^PASS \[$suite\]" <"$results") + $(count '^ *PASS' <<<"$inner") ))
    f=$(( $(count "^FAIL \[$suite\]" <"$results") + $(count '^ *FAIL' <<<"$inner") ))
    passed_all=$((passed_all + $(count '^ *PASS' <<<"$inner")))
    failed_all=$((failed_all + $(count '^ *FAIL' <<<"$inner")))
    echo "package-test $suite: $p passed, $f failed"
done
echo "package-test: $passed_all passed, $failed_all failed"
if [ $failed != 0 ]; then
    for suite in "${failed_suites[@]}"; do
        if [ -s "$work/$suite/share/journal.txt" ]; then
            echo "---- $(release "$suite"): container journal"; cat "$work/$suite/share/journal.txt"
        elif [ -s "$work/$suite/console.log" ]; then
            echo "---- $(release "$suite"): container console"; cat "$work/$suite/console.log"
        fi
    done
    exit 1
fi
