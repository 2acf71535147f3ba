# Sourced by build-image.sh and run.sh: what differs between the guest architectures, in one place,
# and the host tools both scripts install.
#
#   systest_arch ARCH      ARCH is Debian's name, amd64 or arm64; sets
#     ARCH              the same
#     KERNEL_PKG        the guest's kernel package
#     FULL_PKGS         (array) what else the image of a --full run holds (a separate image)
#     INITRD_MODULES    what the small initrd holds (the root disk's bus, virtio_blk, ext4)
#     QEMU, QEMU_PKG    the host's system emulator and the Debian package that has it
#     QEMU_MACHINE      (array) machine and CPU: a software CPU whose guest kernel gets KVM
#     CONSOLE           the guest's serial console
#     CROSS, CROSS_PKGS the host's compiler prefix for the guest's programs ("" when native) and its packages
#     KBUILD_ARGS       (array) make arguments for a module of the guest's kernel
#     BINFMT            qemu-user's binfmt_misc entry that runs the guest's programs on the host ("" when native)
#   host_install PKG...    apt-get install, updating the package lists first if that fails
#   binfmt_ready           qemu-user registered for the guest's programs (a foreign architecture only)

systest_arch() {
    ARCH=$1
    case $ARCH in
    amd64)
        KERNEL_PKG=linux-image-amd64
        FULL_PKGS=()
        INITRD_MODULES="virtio_pci virtio_blk ext4 crc32c_generic"
        QEMU=qemu-system-x86_64 QEMU_PKG=qemu-system-x86
        # "-cpu max" gives the guest an emulated AMD SVM: kvm_amd and /dev/kvm work inside.
        QEMU_MACHINE=(-machine pc -cpu max)
        CONSOLE=ttyS0
        CROSS="" CROSS_PKGS=(gcc libc6-dev)
        KBUILD_ARGS=()
        BINFMT=""
        ;;
    arm64)
        KERNEL_PKG=linux-image-arm64
        # Debian's own VMM, which "make e2e-arm64 FULL=1" runs in a container with -accel kvm.
        FULL_PKGS=(qemu-system-arm)
        INITRD_MODULES="virtio_pci virtio_mmio virtio_blk ext4 crc32c_generic"
        QEMU=qemu-system-aarch64 QEMU_PKG=qemu-system-arm
        # virtualization=on gives the guest EL2, so its kernel brings KVM up; a nested guest needs the
        # in-kernel GICv3. cortex-a72, not "max": pointer authentication makes "max" 3-4 times slower.
        QEMU_MACHINE=(-machine virt,virtualization=on,gic-version=3 -cpu cortex-a72)
        CONSOLE=ttyAMA0
        CROSS=aarch64-linux-gnu- CROSS_PKGS=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
        KBUILD_ARGS=(ARCH=arm64 CROSS_COMPILE=aarch64-linux-gnu-)
        BINFMT=qemu-aarch64
        ;;
    *)
        printf 'unknown guest architecture %q (amd64 or arm64)\n' "$ARCH" >&2
        return 2
        ;;
    esac
}

host_install() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    printf 'installing %s\n' "${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    local apt=(apt-get -o DPkg::Lock::Timeout=300)
    "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2 ||
        { "${apt[@]}" update -q >&2 && "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2; }
}

# qemu-user-static ships the handler's line in /usr/lib/binfmt.d; its postinst registers it only through
# binfmt-support or a running systemd, so it is registered here when neither did. mmdebstrap checks a
# foreign architecture with arch-test.
binfmt_ready() {
    [[ -n $BINFMT ]] || return 0
    host_install qemu-user-static arch-test
    local dir=/proc/sys/fs/binfmt_misc name=$BINFMT
    [[ -e $dir/register ]] || mount -t binfmt_misc binfmt_misc "$dir"
    if [[ ! -e $dir/$name ]]; then
        printf 'registering %s in binfmt_misc\n' "$name" >&2
        cat "/usr/lib/binfmt.d/$name.conf" >"$dir/register"
    fi
    grep -qx enabled "$dir/$name"
}
