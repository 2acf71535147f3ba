#!/bin/bash
# Build (or reuse) the Debian 12 guest image for the whole-system test.
#
#   tests/system/build-image.sh [ARCH] [--full]
#       ARCH amd64 (default) or arm64; prints the image directory. --full: the image of a --full run
#       (run.sh), which holds what only that run needs too (FULL_PKGS in arch.sh).
#
# The image lives in .cache/vm/<arch>/<key>/ (.cache/vm/<arch>-full/ for --full with more packages) (base.img, vmlinuz, initrd.img, packages.txt and the
# stand-in modules of /dev/mshv, built for its kernel), where <key> is a hash of this script, the
# architecture's settings (arch.sh) and the package list, so editing either rebuilds it and nothing
# else does. The guest has the .deb's runtime dependencies preinstalled (the test installs the .deb
# offline), podman and runc (it boots systemd on the unified cgroup hierarchy, Debian 12's default), a
# small initrd (the root disk's bus, virtio disk and ext4 only), the 9p share mounted on /mnt/share,
# and a oneshot unit that runs /mnt/share/guest-test.sh once multi-user.target is reached and then
# powers the guest off. An arm64 tree is made on an amd64 host through qemu-user (binfmt_misc) for its
# maintainer scripts; its Python is byte-compiled by the host's interpreter of the same version.
#
# Environment:
#   SYSTEST_CACHE   cache directory (default: <repo>/.cache/vm/<arch>, or <arch>-full)
#   SYSTEST_MIRROR  apt mirror for mmdebstrap (default: none given, i.e. deb.debian.org with the
#                   bookworm updates and security suites)
#   SYSTEST_REBUILD=1  ignore a cached image
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=tests/system/arch.sh
. "$here/arch.sh"
systest_arch "${1:-amd64}"
extra=() variant=$ARCH
if [[ ${2:-} == --full && ${#FULL_PKGS[@]} -gt 0 ]]; then
    extra=("${FULL_PKGS[@]}") variant=$ARCH-full
fi
cache=${SYSTEST_CACHE:-$repo/.cache/vm/$variant}

# Runtime dependencies of the .deb, plus what a booted guest with udev and modules needs, plus a
# container runtime for the cgroup v2 step (podman with runc; busybox-static is the containers' shell
# and mknod), plus what a --full run needs. The guest has no network, so the image holds all of it.
packages=(
    systemd systemd-sysv udev kmod procps "$KERNEL_PKG"
    python3 python3-grpcio python3-protobuf python3-systemd python3-pyudev
    python3-aiohttp python3-yaml
    podman runc busybox-static "${extra[@]}"
)

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (mmdebstrap, mkfs.ext4 -d with ownership)"

# ---- host tools ---------------------------------------------------------------------------------
# The emulator, the image's tools, and a compiler for modules of the guest's kernel (kbuild's objtool
# links libelf).
host_install "$QEMU_PKG" qemu-utils mmdebstrap e2fsprogs make libelf1 "${CROSS_PKGS[@]}"
binfmt_ready || die "cannot register qemu-user for $ARCH programs in binfmt_misc"

# ---- cache key ----------------------------------------------------------------------------------
key=$( { cat "${BASH_SOURCE[0]}" "$here/arch.sh" "$here/mshv-standin.c"
         printf '%s\n' "$ARCH" "${packages[@]}" "${SYSTEST_MIRROR:-}"; } | sha256sum | cut -c1-16)
dest=$cache/$key
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

if [[ -f $dest/complete && ${SYSTEST_REBUILD:-0} != 1 ]]; then
    log "cached image $dest"
    printf '%s\n' "$dest"
    exit 0
fi

start=$(date +%s)
work=$(mktemp -d "$cache/.build.XXXXXX")
chmod 0755 "$work"   # apt's sandbox user must reach the chroot
cleanup() { rm -rf --one-file-system "$work"; }
trap cleanup EXIT
root=$work/root
mkdir "$root"

# Files placed before the packages are installed, so the kernel's postinst makes the small initrd
# once instead of a generic one that would be replaced.
setup_hook=$work/setup-hook.sh
cat >"$setup_hook" <<'HOOK'
#!/bin/sh
set -e
r=$1 modules=$2
mkdir -p "$r/etc/initramfs-tools/conf.d" "$r/etc/initramfs-tools/hooks"
cat >"$r/etc/initramfs-tools/conf.d/systest.conf" <<'EOF'
MODULES=list
COMPRESS=gzip
EOF
printf '%s\n' '#!/bin/sh' '[ "$1" = prereqs ] && exit 0' '. /usr/share/initramfs-tools/hook-functions' \
    "manual_add_modules $modules" >"$r/etc/initramfs-tools/hooks/systest"
chmod 0755 "$r/etc/initramfs-tools/hooks/systest"
HOOK

# Guest configuration, applied after all packages are installed; and the header packages of the
# kernel installed (the same version), fetched with the tree's own apt into $2 for the stand-in modules.
customize_hook=$work/customize-hook.sh
cat >"$customize_hook" <<'HOOK'
#!/bin/sh
set -e
r=$1
abi=$(ls "$r/lib/modules")
version=$(dpkg-query --admindir="$r/var/lib/dpkg" -W -f '${Version}' "linux-image-$abi")
series=$(echo "$abi" | cut -d. -f1,2)
mkdir -p "$2"
(cd "$2" && APT_CONFIG=$MMDEBSTRAP_APT_CONFIG apt-get -q -o APT::Sandbox::User=root download \
    "linux-headers-$abi=$version" "linux-headers-${abi%-*}-common=$version" "linux-kbuild-$series=$version")
echo systest >"$r/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tsystest\n' >"$r/etc/hosts"
# A fixed machine id: no first-boot preset run, the same journal namespace every boot.
echo 5e7c2a1f9b3d4e6f8a0b1c2d3e4f5a6b >"$r/etc/machine-id"
cat >"$r/etc/fstab" <<'EOF'
/dev/vda  /           ext4  rw,errors=remount-ro                                      0 1
share     /mnt/share  9p    trans=virtio,version=9p2000.L,msize=262144,cache=none,nofail  0 0
EOF
mkdir -p "$r/mnt/share"
mkdir -p "$r/etc/modules-load.d"
printf '9p\n9pnet_virtio\n' >"$r/etc/modules-load.d/systest-9p.conf"

cat >"$r/usr/local/sbin/systest-entry" <<'EOF'
#!/bin/bash
# Runs the test that the host put on the share, then leaves its results there:
# out/test.log (its output), out/journal.txt (this boot's journal), out/rc (its exit status).
share=/mnt/share
out=$share/out
mkdir -p "$out"
read -r up _ </proc/uptime
echo "$up" >"$out/entry-uptime"
limit=$(cat "$share/guest-timeout" 2>/dev/null || echo 900)
rc=0
if [ -r "$share/guest-test.sh" ]; then
    timeout --signal=TERM --kill-after=10 "$limit" bash "$share/guest-test.sh" "$share" 2>&1 \
        | tee "$out/test.log"
    rc=${PIPESTATUS[0]}
else
    echo "no $share/guest-test.sh on the share" | tee "$out/test.log"
    rc=2
fi
journalctl -b --no-pager -o short-monotonic >"$out/journal.txt" 2>&1
echo "$rc" >"$out/rc.tmp" && mv "$out/rc.tmp" "$out/rc"
sync
exit 0
EOF
chmod 0755 "$r/usr/local/sbin/systest-entry"

cat >"$r/etc/systemd/system/systest.service" <<'EOF'
[Unit]
Description=Whole-system test from the 9p share
After=multi-user.target
RequiresMountsFor=/mnt/share
SuccessAction=poweroff-force
FailureAction=poweroff-force

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/systest-entry
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=20min

[Install]
WantedBy=multi-user.target
EOF
chroot "$r" systemctl enable systest.service
# Nothing periodic may run during a test.
chroot "$r" systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
    e2scrub_reap.service systemd-timesyncd.service
# The guest has no network; do not wait for one.
chroot "$r" systemctl mask systemd-networkd-wait-online.service
HOOK
chmod 0755 "$setup_hook" "$customize_hook"

include=$(IFS=,; echo "${packages[*]}")
log "mmdebstrap bookworm (${#packages[@]} packages)"
mirror_args=()
[[ -n ${SYSTEST_MIRROR:-} ]] && mirror_args=("$SYSTEST_MIRROR")
mmdebstrap --variant=apt --include="$include" \
    --architectures="$ARCH" \
    --setup-hook="$setup_hook \"\$1\" '$INITRD_MODULES'" \
    --customize-hook="$customize_hook \"\$1\" '$work/kernel-debs'" \
    bookworm "$root" "${mirror_args[@]}" >&2

out=$work/out
mkdir "$out"
kernel=$(find "$root/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -n1)
initrd=$(find "$root/boot" -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -n1)
[[ -n $kernel && -n $initrd ]] || die "no kernel or initrd in $root/boot"
cp "$kernel" "$out/vmlinuz"
cp "$initrd" "$out/initrd.img"
dpkg-query --admindir="$root/var/lib/dpkg" -W -f '${Package} ${Version}\n' >"$out/packages.txt"

# Debian's packages ship no .pyc; their maintainer scripts write them, and whatever they left out
# would be compiled again at every start of a Python program (seconds for grpc in an emulated guest).
# The host's interpreter fills the gaps when it is the guest's version (a .pyc depends on the version,
# not on the machine); else the guest's, in the tree.
guest_py=$(cd "$root/usr/bin" && ls | grep -E '^python3\.[0-9]+$' | head -n1)
pydirs=(/usr/lib/python3 "/usr/lib/$guest_py")
pycs() { find "${pydirs[@]/#/$root}" -name '*.pyc' | wc -l; }
before=$(pycs) t=$(date +%s)
if [[ $(python3 -c 'import sys; print("python%d.%d" % sys.version_info[:2])' 2>/dev/null) == "$guest_py" ]]; then
    python3 -m compileall -q -j0 -s "$root" -p / "${pydirs[@]/#/$root}" >&2 || log "some files did not compile"
else
    chroot "$root" "/usr/bin/$guest_py" -m compileall -q "${pydirs[@]}" >&2 || log "some files did not compile"
fi
log "byte-compiled the guest's Python in $(( $(date +%s) - t )) s: $before .pyc files, now $(pycs)"

# The stand-in for /dev/mshv (mshv-standin.c), built against the headers of the image's kernel with
# their own kbuild tools (the guest architecture's: on a foreign host they run through qemu-user, which
# finds their libraries in the tree).
abi=$(ls "$root/lib/modules")
kb=$work/kbuild mod=$work/mshv
mkdir -p "$kb" "$mod"
for d in "$work/kernel-debs"/*.deb; do dpkg-deb -x "$d" "$kb"; done
cp "$here/mshv-standin.c" "$mod/mshv_standin.c"
printf '#define STANDIN_NAME "mshv-spare"\n#include "mshv_standin.c"\n' >"$mod/mshv_spare.c"
printf 'obj-m := mshv_standin.o mshv_spare.o\n' >"$mod/Kbuild"
QEMU_LD_PREFIX=$root make -s -C "$kb/usr/src/linux-headers-$abi" -f "$kb/usr/src/linux-headers-${abi%-*}-common/Makefile" \
    M="$mod" "${KBUILD_ARGS[@]}" modules >&2 || die "building the mshv stand-in for $abi failed"
cp "$mod/mshv_standin.ko" "$mod/mshv_spare.ko" "$out/"
log "built the mshv stand-in modules for $abi"
log "initrd $(du -h "$out/initrd.img" | cut -f1), kernel $(basename "$kernel")"

log "mkfs.ext4 -d (2G)"
mkfs.ext4 -q -F -L systest -d "$root" "$out/base.img" 2G >&2
date -u +%FT%TZ >"$out/complete"

rm -rf "$dest"
mv "$out" "$dest"
# Older images are never reused; drop them.
for old in "$cache"/*/; do
    [[ ${old%/} == "$dest" ]] || rm -rf --one-file-system "${old%/}"
done
log "built $dest in $(( $(date +%s) - start )) s"
printf '%s\n' "$dest"
