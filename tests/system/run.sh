#!/bin/bash
# Whole-system test: install the .deb in a Debian 12 VM with real systemd, udevd and kernel modules,
# and check the daemon against the fake kubelet while devices come and go.
#
# Usage (as root, on an amd64 machine that can run qemu with the software CPU):
#   tests/system/build-image.sh [ARCH]                         # once; cached in .cache/vm/ARCH/
#   tests/system/run.sh [--arch ARCH] [--full] dist/ate-devplugd_*.deb
#       boots a fresh overlay of the ARCH image (amd64, the default, or arm64: an emulated aarch64
#       machine) and runs guest-test.sh there (of several .debs, the newest file is tested). --full
#       also runs the steps that the arm64 test leaves out by default, emulation making them slow.
#
# Output: the guest's test log, one "STEP n name: PASS|FAIL <ms> ms" line per step, then a summary
# whose last line is "N passed, M failed".
# Exit status: 0 when every step passed; non-zero otherwise (the guest journal is then printed).
# Artifacts (kept after every run): $SYSTEST_OUT, default build/system-test/ (arm64:
# build/system-test-arm64/) -- test.log, journal.txt
# (the guest's whole journal), kubelet.jsonl (the fake kubelet's events), console.log (the serial
# console), rc (the guest test's exit status).
#
# Environment:
#   SYSTEST_TIMEOUT     seconds before qemu is killed (default 900, arm64 1800; the guest stops its test
#                       60 s earlier)
#   SYSTEST_OUT         artifact directory (default <repo>/build/system-test, for arm64 -arm64 added)
#   SYSTEST_GUEST_TEST  the script to run in the guest (default tests/system/guest-test.sh)
#   SYSTEST_SMP, SYSTEST_MEM   guest CPUs (default 2) and memory in MiB (default 2048)
#
# The software CPU is used on purpose: on these machines /dev/kvm only runs specially built guest
# kernels. Its guest kernel gets KVM all the same: on amd64 "-cpu max" emulates AMD SVM (kvm_amd
# loads), on arm64 the virt machine gives it EL2 (see arch.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=tests/system/arch.sh
. "$here/arch.sh"

log() { printf 'system-test: %s\n' "$*"; }
die() { log "error: $*" >&2; exit 2; }

arch=amd64 full=0
while (($#)); do
    case $1 in
    --arch) (($# >= 2)) || die "--arch wants amd64 or arm64"; arch=$2; shift 2 ;;
    --full) full=1; shift ;;
    *) break ;;
    esac
done
systest_arch "$arch" || die "usage: $0 [--arch amd64|arm64] [--full] DEB"
(($# >= 1)) || die "usage: $0 [--arch amd64|arm64] [--full] DEB"
for d in "$@"; do
    [[ -f $d ]] || die "no such .deb: $d"
done
# "dist/ate-devplugd_*.deb" may match earlier builds too: the newest file is the one just built.
deb=$(ls -t -- "$@" | head -n1)
(($# == 1)) || log "$# packages given; testing the newest: $deb"
[[ $(id -u) == 0 ]] || die "must run as root"

default_timeout=900
[[ $ARCH == amd64 ]] || default_timeout=1800
timeout_s=${SYSTEST_TIMEOUT:-$default_timeout}
default_out=$repo/build/system-test
[[ $ARCH == amd64 ]] || default_out+=-$ARCH
out=${SYSTEST_OUT:-$default_out}
guest_test=${SYSTEST_GUEST_TEST:-$here/guest-test.sh}
[[ -f $guest_test ]] || die "no guest test script: $guest_test"

image_args=("$ARCH")
((full)) && image_args+=(--full)
imgdir=$("$here/build-image.sh" "${image_args[@]}")
for f in base.img vmlinuz initrd.img packages.txt mshv_standin.ko mshv_spare.ko; do
    [[ -f $imgdir/$f ]] || die "image incomplete: $imgdir/$f missing"
done
command -v "$QEMU" >/dev/null || die "$QEMU is not installed"

# Every dependency of the .deb must already be in the image: the guest has no network.
missing=()
depends=$(dpkg-deb -f "$deb" Depends 2>/dev/null || true)
while IFS= read -r alt; do
    alt=$(sed -e 's/([^)]*)//g' -e 's/\[[^]]*\]//g' <<<"$alt")
    [[ -n ${alt// /} ]] || continue
    ok=0
    IFS='|' read -ra names <<<"$alt"
    for n in "${names[@]}"; do
        n=${n// /}
        n=${n%%:*}
        awk -v p="$n" '$1 == p { found = 1 } END { exit !found }' "$imgdir/packages.txt" && ok=1
    done
    ((ok)) || missing+=("${alt// /}")
done < <(tr ',' '\n' <<<"$depends")
if ((${#missing[@]})); then
    die "the image lacks Depends of $(basename "$deb"): ${missing[*]} -- add them to packages in build-image.sh"
fi

# ---- the share ----------------------------------------------------------------------------------
rm -rf --one-file-system "$out"
mkdir -p "$out"
share=$out/share
mkdir -p "$share/out"
cp "$guest_test" "$share/guest-test.sh"
cp "$here/events.py" "$share/events.py" 2>/dev/null || true
if [[ -d $repo/tests/fakes ]]; then
    cp -r "$repo/tests/fakes" "$share/fakes"
    rm -rf "$share/fakes/__pycache__"
fi
# The containers' checker (a tiny VMM), static: the image it runs in holds nothing else but busybox.
host_install "${CROSS_PKGS[@]}" || die "cannot install ${CROSS_PKGS[*]}"
"${CROSS}gcc" -static -O2 -Wall -o "$share/kvmcheck" "$repo/tests/podman/kvmcheck.c" || die "cannot build the checker"
# The stand-ins for /dev/mshv, built with the image for its kernel.
cp "$imgdir/mshv_standin.ko" "$imgdir/mshv_spare.ko" "$share/"
cp "$deb" "$share/$(basename "$deb")"
basename "$deb" >"$share/deb-name"
echo "$full" >"$share/full"
# The guest stops its own test a little before the host gives up on the guest.
echo $((timeout_s > 120 ? timeout_s - 60 : timeout_s / 2)) >"$share/guest-timeout"

work=$(mktemp -d /tmp/systest.XXXXXX)
overlay=$work/overlay.qcow2
qemu-img create -q -f qcow2 -F raw -b "$imgdir/base.img" "$overlay"

qpid=
tpid=
cleanup() {
    if [[ -n $qpid ]] && kill -0 "$qpid" 2>/dev/null; then
        log "stopping qemu (pid $qpid)"
        kill "$qpid" 2>/dev/null || true
        wait "$qpid" 2>/dev/null || true
    fi
    [[ -n $tpid ]] && kill "$tpid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "image $imgdir"
log "booting the $ARCH guest (timeout ${timeout_s} s); artifacts in $out"
t0=$(date +%s.%N)
timeout --kill-after=10 "$timeout_s" \
    "$QEMU" \
    -nodefaults -no-user-config -display none -no-reboot \
    "${QEMU_MACHINE[@]}" -accel tcg,thread=multi \
    -smp "${SYSTEST_SMP:-2}" -m "${SYSTEST_MEM:-2048}" \
    -kernel "$imgdir/vmlinuz" -initrd "$imgdir/initrd.img" \
    -append "console=$CONSOLE root=/dev/vda rw panic=-1 systemd.show_status=1" \
    -drive "file=$overlay,if=virtio,format=qcow2,cache=unsafe" \
    -virtfs "local,path=$share,mount_tag=share,security_model=none,id=share" \
    -device virtio-rng-pci \
    -serial "file:$out/console.log" \
    -monitor none \
    </dev/null >"$out/qemu.log" 2>&1 &
qpid=$!
# Show the guest's test output as it is written (it ends when qemu does).
tail -n +1 -F --pid="$qpid" "$share/out/test.log" 2>/dev/null | sed -u 's/^/guest| /' &
tpid=$!

qrc=0
wait "$qpid" || qrc=$?
qpid=
t1=$(date +%s.%N)
wait "$tpid" 2>/dev/null || true
tpid=

for f in test.log journal.txt kubelet.jsonl rc entry-uptime; do
    [[ -f $share/out/$f ]] && cp "$share/out/$f" "$out/$f"
done
rm -rf --one-file-system "$share"

wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
log "qemu ran ${wall} s (exit $qrc)"
[[ -f $out/entry-uptime ]] && log "guest reached the test at uptime $(cat "$out/entry-uptime") s"

status=0
if ((qrc == 124 || qrc == 137)); then
    log "FAIL: the guest did not power off within ${timeout_s} s; qemu was killed"
    status=1
elif ((qrc != 0)); then
    log "FAIL: qemu exited with status $qrc"
    sed 's/^/qemu| /' "$out/qemu.log" || true
    status=1
fi
if [[ ! -f $out/rc ]]; then
    log "FAIL: the guest test left no exit status"
    status=1
else
    grc=$(cat "$out/rc")
    if [[ $grc == 124 ]]; then
        log "FAIL: the guest test ran out of time (guest-timeout) and was stopped"
        status=1
    elif [[ $grc != 0 ]]; then
        log "FAIL: the guest test exited with status $grc"
        status=1
    fi
fi

if ((status != 0)); then
    if [[ -f $out/journal.txt ]]; then
        log "---- guest journal ($out/journal.txt) ----"
        cat "$out/journal.txt"
        log "---- end of guest journal ----"
    else
        log "---- serial console, last 150 lines ($out/console.log) ----"
        tail -n 150 "$out/console.log" 2>/dev/null || true
        log "---- end of serial console ----"
    fi
fi

if [[ -f $out/test.log ]]; then
    log "summary:"
    grep -E '^(STEP [0-9]+ |RESULT: )' "$out/test.log" | sed 's/^/  /' || log "  (no steps ran)"
fi
steps_passed=$(grep -cE '^STEP [0-9]+ .*: PASS' "$out/test.log" 2>/dev/null || true)
steps_failed=$(grep -cE '^STEP [0-9]+ .*: FAIL' "$out/test.log" 2>/dev/null || true)
if ((status == 0)); then
    log "PASS ($ARCH guest, qemu ${wall} s)"
else
    log "FAIL (artifacts in $out)"
    # A run that failed outside its steps (qemu killed, no exit status) counts as one failure more.
    ((steps_failed > 0)) || steps_failed=1
fi
echo "${steps_passed:-0} passed, ${steps_failed:-0} failed"
exit "$status"
