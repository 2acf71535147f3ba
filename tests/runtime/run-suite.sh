#!/bin/bash
# The test suite on a Debian release's own Python and packages, from this checkout.
#
#   tests/runtime/run-suite.sh SUITE [PYTEST_ARG ...]      # SUITE: trixie, bookworm, ...
#   tests/runtime/run-suite.sh --build-only SUITE          # only build (or find) the tree; print its path
#
# Builds (once, cached) a tree of Debian SUITE with the daemon's runtime packages, pytest and
# hypothesis, and the tools the suite uses; then runs, as root,
#
#   PYTHONPATH=src python3 -m pytest -p no:cacheprovider PYTEST_ARG...
#
# in the checkout, chrooted into a throwaway overlay of that tree, and exits with pytest's status.
# The arguments after SUITE go to pytest (make test-trixie passes $(PYTEST_ARGS) here), and so do
# the ATE_* variables (ATE_TEST_SEED, ATE_TEST_TIMEOUT, ATE_SOAK, ...).
#
# Why a chroot and not systemd-nspawn: the suite needs what it has on the host: /dev, /proc and a
# writable /sys (kvm uevents are made by writing /sys/class/misc/kvm/uevent), the host's network
# namespace (kernel uevents over netlink), mknod'ed device nodes that open the real driver, mount
# namespaces (unshare -m), ptrace (strace), and a udevd of the release's own that may touch
# /dev/kvm. Under systemd-nspawn (even with SYSTEMD_NSPAWN_API_VFS_WRITABLE=1) its device policy
# refuses to open the mknod'ed nodes and udevd's events never arrive: 4 failures and 1 error in the
# 98 tests that use these, where the chroot passes all, as the host does. The chroot lives in a
# private mount namespace (unshare -m), so the overlay, the bind mounts and every mount a test
# makes vanish when the run ends, and the cached tree is never written.
# SYSTEMD_IGNORE_CHROOT=1 tells udevadm that it may act although /proc/1/root is not its root.
#
# The tree is cached in .cache/runtime/<suite>-<key>/, where <key> hashes the suite, the package
# lists and this script; building takes about 20 s (apt access needed), under a lock, so
# concurrent runs share one build. Older trees of the same suite are removed.
# Needs root, mmdebstrap (installed when missing) and util-linux's unshare.
set -euo pipefail

# The daemon's runtime as the .deb gets it from the release, and the test runner. More runtime
# packages are added here, in this one list.
runtime_packages=(
    python3 python3-grpcio python3-protobuf python3-systemd python3-pyudev
    python3-pytest python3-hypothesis python3-cryptography
    python3-prometheus-client python3-yaml python3-aiohttp
)
# What the suite calls besides Python: udevd/udevadm (udev hotplug tests), strace (idle test),
# mount (bind/tmpfs faults), chattr (immutable-directory fault), the release's podman with runc and
# a static libc for its checker (CDI), its containerd (CRI; the suite on Debian 12 runs trixie's
# containerd 1.7 from this tree too: tests/runtimes/containerd.py), node_exporter and promtool
# (metrics). setpriv and unshare come with util-linux, which every tree has.
test_tools=(udev strace mount e2fsprogs podman runc containerd gcc libc6-dev prometheus-node-exporter prometheus)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
script=$here/$(basename "${BASH_SOURCE[0]}")

say() { printf 'run-suite: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }
build_only=0
if [ "${1:-}" = --build-only ]; then build_only=1; shift; fi
[ $# -ge 1 ] || die "usage: $0 [--build-only] SUITE [PYTEST_ARG ...]   (SUITE: trixie, bookworm, ...)"
suite=$1; shift
[[ $suite =~ ^[a-z]+$ ]] || die "not a suite name: $suite"
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, chroot, mknod in the tests)"

if ! command -v mmdebstrap >/dev/null; then
    say "installing mmdebstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 install -y -q mmdebstrap >&2 || {
        apt-get -o DPkg::Lock::Timeout=300 update -q >&2
        apt-get -o DPkg::Lock::Timeout=300 install -y -q mmdebstrap >&2
    }
fi

# ---- the tree, cached ------------------------------------------------------------------------
cache=$top/.cache/runtime
key=$( { printf '%s\n' "$suite" "${runtime_packages[*]}" "${test_tools[*]}"; cat "$script"; } |
    sha256sum | cut -c1-16)
tree=$cache/$suite-$key
mkdir -p "$cache"
# Exclusive while a tree is built and older ones are removed; shared while one is in use, so that a
# run of another version of this script never removes the tree under a running suite.
exec 9>"$cache/$suite.lock"
flock 9
if [ ! -f "$tree/complete" ]; then
    start=$SECONDS
    include=$(IFS=,; echo "${runtime_packages[*]},${test_tools[*]}")
    say "building the $suite tree in $tree (include: $include)"
    rm -rf --one-file-system "$tree.tmp"
    mkdir -p "$tree.tmp"
    chmod 0755 "$tree.tmp"   # apt's sandbox user must reach the tree
    mmdebstrap --variant=apt --include="$include" "$suite" "$tree.tmp/root" \
        >"$tree.tmp/mmdebstrap.log" 2>&1 ||
        { tail -n 30 "$tree.tmp/mmdebstrap.log" >&2; die "mmdebstrap $suite failed"; }
    # What the tree holds, for the record (and for anyone comparing runtimes).
    # shellcheck disable=SC2016 # a dpkg-query format
    chroot "$tree.tmp/root" dpkg-query -W -f '${Package} ${Version}\n' >"$tree.tmp/packages.txt"
    find "$cache" -mindepth 1 -maxdepth 1 -name "$suite-*" -not -name "$suite-$key.tmp" \
        -exec rm -rf --one-file-system {} +
    mv "$tree.tmp" "$tree"
    touch "$tree/complete"
    say "built in $((SECONDS - start))s"
fi
flock -s 9
if [ "$build_only" = 1 ]; then
    say "the $suite tree is $tree"
    echo "$tree"
    exit 0
fi

# ---- the run -------------------------------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/ate-devplugd-runtime.XXXXXX")
trap 'rm -rf --one-file-system "$work"' EXIT
mkdir "$work/upper" "$work/work" "$work/root" "$work/tmp"
chmod 1777 "$work/tmp"

# Only ATE_* settings and the usual basics reach the tests.
env_args=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
          LC_ALL=C.UTF-8 TERM="${TERM:-dumb}" PYTHONPATH=src PYTHONPYCACHEPREFIX=/var/cache/pycache
          SYSTEMD_IGNORE_CHROOT=1)
while IFS= read -r var; do env_args+=("$var=${!var}"); done < <(compgen -e | grep '^ATE_' || true)

say "suite on $suite: $(sed -n 's/^\(python3\|python3-grpcio\|python3-protobuf\|python3-pyudev\|python3-systemd\|udev\) /\1 /p' \
    "$tree/packages.txt" | paste -sd, - | sed 's/,/, /g')"
# In a private mount namespace: the overlay (tree below, this run's changes above), the host's
# /dev, /proc and /sys, the checkout at the same path, a /tmp on the same file system as the
# host's, a fresh /run; then chroot. Everything is unmounted when the namespace ends.
rc=0
# shellcheck disable=SC2016 # the inner scripts expand their own arguments
unshare -m --propagation private -- /bin/bash -euo pipefail -c '
    tree=$1 work=$2 top=$3; shift 3
    r=$work/root
    mount -t overlay overlay -o "lowerdir=$tree/root,upperdir=$work/upper,workdir=$work/work" "$r"
    mount --rbind /dev "$r/dev"
    mount -t proc proc "$r/proc"
    mount --rbind /sys "$r/sys"
    mount -t tmpfs -o mode=0755 tmpfs "$r/run"
    mount --bind "$work/tmp" "$r/tmp"
    mkdir -p "$r$top"
    mount --bind "$top" "$r$top"
    cd "$r$top"
    exec chroot "$r" /usr/bin/env -i "$@"
' run-suite "$tree" "$work" "$top" "${env_args[@]}" /bin/sh -c 'cd "$0" && exec "$@"' "$top" \
    python3 -m pytest -p no:cacheprovider "$@" 9>&- || rc=$?
exit "$rc"
