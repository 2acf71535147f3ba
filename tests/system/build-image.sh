#!/bin/bash
# Build (or reuse) the Debian 12 guest image for the whole-system test.
#
#   tests/system/build-image.sh            # prints the image directory on stdout
#
# The image lives in .cache/vm/<key>/ (base.img, vmlinuz, initrd.img, packages.txt), where <key> is a
# hash of this script and the package list, so editing either rebuilds it and nothing else does.
# The guest has the .deb's runtime dependencies preinstalled (the test installs the .deb offline),
# podman and runc (it boots systemd on the unified cgroup hierarchy, Debian 12's default), a small initrd (virtio disk + ext4 only), the 9p share mounted on /mnt/share, and a oneshot unit
# that runs /mnt/share/guest-test.sh once multi-user.target is reached and then powers the guest off.
#
# Environment:
#   SYSTEST_CACHE   cache directory (default: <repo>/.cache/vm)
#   SYSTEST_MIRROR  apt mirror for mmdebstrap (default: none given, i.e. deb.debian.org with the
#                   bookworm updates and security suites)
#   SYSTEST_REBUILD=1  ignore a cached image
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${SYSTEST_CACHE:-$repo/.cache/vm}

# Runtime dependencies of the .deb, plus what a booted guest with udev and modules needs, plus a
# container runtime for the cgroup v2 step (podman with runc; busybox-static is the containers' shell
# and mknod). The guest has no network, so the image holds all of it.
packages=(
    systemd systemd-sysv udev kmod procps linux-image-amd64
    python3 python3-grpcio python3-protobuf python3-systemd python3-pyudev
    python3-aiohttp python3-yaml
    podman runc busybox-static
)

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (mmdebstrap, mkfs.ext4 -d with ownership)"

# ---- host tools ---------------------------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
if ((${#need[@]})); then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${need[@]}" >&2; then
        apt-get update -q >&2
        apt-get install -y -q --no-install-recommends "${need[@]}" >&2
    fi
fi

# ---- cache key ----------------------------------------------------------------------------------
key=$( { cat "${BASH_SOURCE[0]}"; printf '%s\n' "${packages[@]}" "${SYSTEST_MIRROR:-}"; } \
       | sha256sum | cut -c1-16)
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
r=$1
mkdir -p "$r/etc/initramfs-tools/conf.d" "$r/etc/initramfs-tools/hooks"
cat >"$r/etc/initramfs-tools/conf.d/systest.conf" <<'EOF'
MODULES=list
COMPRESS=gzip
EOF
cat >"$r/etc/initramfs-tools/hooks/systest" <<'EOF'
#!/bin/sh
[ "$1" = prereqs ] && exit 0
. /usr/share/initramfs-tools/hook-functions
manual_add_modules virtio_pci virtio_blk ext4 crc32c_generic
EOF
chmod 0755 "$r/etc/initramfs-tools/hooks/systest"
HOOK

# Guest configuration, applied after all packages are installed.
customize_hook=$work/customize-hook.sh
cat >"$customize_hook" <<'HOOK'
#!/bin/sh
set -e
r=$1
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
    --setup-hook="$setup_hook \"\$1\"" \
    --customize-hook="$customize_hook \"\$1\"" \
    bookworm "$root" "${mirror_args[@]}" >&2

out=$work/out
mkdir "$out"
kernel=$(find "$root/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -n1)
initrd=$(find "$root/boot" -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -n1)
[[ -n $kernel && -n $initrd ]] || die "no kernel or initrd in $root/boot"
cp "$kernel" "$out/vmlinuz"
cp "$initrd" "$out/initrd.img"
chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$out/packages.txt"
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
