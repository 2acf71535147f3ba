#!/bin/bash
# Runs inside the guest (started by systest.service; see build-image.sh and run.sh), on x86-64 and on
# arm64 alike. Installs the .deb offline, runs the fake kubelet, and checks the daemon step by step
# while devices go and come back for real (kernel modules unloaded and loaded; where KVM is built into
# the kernel, its node), runs containers with podman on the unified cgroup hierarchy, starts and ends
# VMs against the daemon's socket filter, and serves a second hypervisor device, a stand-in for
# /dev/mshv with a dynamic misc minor. One line per step:
#   STEP n name: PASS|FAIL <latency> ms       or  STEP n name: SKIP (why)
# followed by indented details. Exit status: the number of failed steps (0 = all passed).
set -uo pipefail

share=${1:-/mnt/share}
work=/run/systest
plugin_dir=/var/lib/kubelet/device-plugins
cdi_dir=/var/run/cdi
klog=$work/kubelet.jsonl
unit=ate-devplugd.service
resources=(ate.dev/kvm ate.dev/vhost-net ate.dev/vhost-vsock ate.dev/mshv)
all=$(IFS=,; echo "${resources[*]}")
count=4096            # the configured default per resource: capacity must come back to this
machine=$(uname -m)
# --full (run.sh): also the steps an arm64 run leaves out by default (see leave_out).
full=$(cat "$share/full" 2>/dev/null || echo 0)
# The emulated aarch64 machine runs several times slower than the emulated x86-64 one: every bound
# on a latency or a wait widens with it.
slow=1
[[ $machine == aarch64 ]] && slow=3
register_limit_ms=$((5000 * slow))      # "registers as soon as kubelet does", with room for the software CPU
unhealthy_limit_ms=$((10000 * slow))    # from the kernel's uevent to kubelet's list; generous: the CPU is emulated
wait_s=$((20 * slow))                   # how long any one registration may take before the step fails
vm_lifecycles=100                       # VMs started and ended against the socket filter

mkdir -p "$work"
cp "$share/events.py" "$work/events.py"
rm -rf "$work/fakes"
[[ -d $share/fakes ]] && cp -r "$share/fakes" "$work/fakes"

failed=()
steps=0
now() { date +%s.%N; }
ms_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%d", (b - a) * 1000 }'; }
info() { printf '  %s\n' "$*"; }
ev() { python3 "$work/events.py" "$@"; }
# jget EXPR...: each Python expression on the JSON read from stdin (as d), one line each (one python3
# for all: in the emulated guest each start of it costs a fraction of a second).
jget() { python3 -c 'import json,sys; d=json.load(sys.stdin); [print(eval(e, {}, {"d": d})) for e in sys.argv[1:]]' "$@"; }

# report N NAME OK LATENCY_MS
report() {
    local n=$1 name=$2 ok=$3 lat=$4
    steps=$((steps + 1))
    if ((ok)); then
        echo "STEP $n $name: PASS $lat ms"
    else
        echo "STEP $n $name: FAIL $lat ms"
        failed+=("$n $name")
        diagnose
    fi
}

# An arm64 run leaves some steps and checks out unless --full: emulation makes them slow, and what
# they prove does not depend on the architecture (the amd64 run has them all).
short_run() { [[ $machine == aarch64 && $full != 1 ]]; }
# run_step N NAME FUNCTION [FULL_ONLY]: the step, or a SKIP line for one a short run leaves out.
run_step() {
    if [[ ${4:-} == full-only ]] && short_run; then
        echo "STEP $1 $2: SKIP (an arm64 run leaves it out; make e2e-arm64 FULL=1 runs it)"
        return
    fi
    "$3"
}

diagnose() {
    info "--- diagnostics ---"
    systemctl status --no-pager -n 30 "$unit" 2>&1 | sed 's/^/  | /'
    systemctl status --no-pager -n 10 fake-kubelet.service 2>&1 | sed 's/^/  | /'
    info "plugin dir:"; ls -la "$plugin_dir" 2>&1 | sed 's/^/  | /'
    info "last kubelet events:"; tail -n 15 "$klog" 2>/dev/null | sed 's/^/  | /'
    info "modules:"; lsmod | grep -E '^(kvm|vhost|mshv)' | sed 's/^/  | /'
}

# wait_until TIMEOUT_S COMMAND... : poll a condition; false if it never held.
wait_until() {
    local limit=$1; shift
    local end=$(( $(date +%s) + limit ))
    until "$@"; do
        (( $(date +%s) < end )) || return 1
        sleep 0.05
    done
}

active() { [[ $(systemctl is-active "$unit") == active ]]; }
# From the main process's exec to "active" (READY=1), by systemd's own clock.
startup_ms() {
    local a b
    a=$(systemctl show -p ExecMainStartTimestampMonotonic --value "$unit")
    b=$(systemctl show -p ActiveEnterTimestampMonotonic --value "$unit")
    echo $(( (b - a) / 1000 ))
}
main_pid() { systemctl show -p MainPID --value "$unit"; }
# Processes holding any of the given nodes open.
holders() {
    local n fd pid
    for n in "$@"; do
        while IFS= read -r fd; do
            pid=${fd#/proc/}; pid=${pid%%/*}
            info "| $n is open in pid $pid ($(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null))"
        done < <(find /proc/[0-9]*/fd -lname "$n" 2>/dev/null)
    done
}
module_loaded() { [[ -d /sys/module/$1 ]]; }

# Waits for register + a full list of every resource after T; sets REG_MS (register latency from T).
REG_MS=-
registered_since() {
    local since=$1 limit=${2:-$wait_s} out
    REG_MS=-
    if ! out=$(ev wait "$klog" --since "$since" --event register --resources "$all" --timeout "$limit"); then
        info "daemon status: $(systemctl show -p StatusText --value "$unit")"
        return 1
    fi
    { read -r REG_MS; read -r out; } < <(jget 'd["latency_ms"]' '" ".join(k + "@" + format(v["t"], ".3f") for k, v in d["events"].items())' <<<"$out")
    info "registered: $out"
    if ! out=$(ev wait "$klog" --since "$since" --event list --resources "$all" --health full --timeout "$limit"); then
        info "daemon status: $(systemctl show -p StatusText --value "$unit")"
        return 1
    fi
    info "full lists: $(jget '" ".join(k + "=" + str(v["healthy"]) + "/" + str(v["total"]) for k, v in d["events"].items())' <<<"$out")"
}

kubelet_start() {
    systemctl reset-failed fake-kubelet.service 2>/dev/null
    systemd-run --quiet --unit=fake-kubelet --collect -p Type=exec \
        python3 "$work/fakes/kubelet.py" --dir "$plugin_dir" --log "$klog"
}
kubelet_stop() { systemctl stop fake-kubelet.service 2>/dev/null; }

digests() {
    local r
    for r in "${resources[@]}"; do
        ev last "$klog" --event list --resource "$r" | jget 'd["ids_digest"]'
    done
}

# ms_between A B: milliseconds from time A to time B (never below 0: the recorder may be scheduled
# after the daemon has already answered).
ms_between() { awk -v a="$1" -v b="$2" 'BEGIN { d = (b - a) * 1000; printf "%d", d < 0 ? 0 : d }'; }

# The kernel's uevents (or, with "--source udev", udevd's) recorded as they arrive, by events.py.
# recorder_start LOG [--source udev]: sets REC_PID once it listens; recorder_stop ends it.
REC_PID=
recorder_start() {
    local log=$1; shift
    : >"$log"
    ev uevents "$log" "$@" >"$log.out" 2>&1 &
    REC_PID=$!
    wait_until $((10 * slow)) grep -q '^listening' "$log.out" || info "the uevent recorder did not start: $(cat "$log.out")"
}
recorder_stop() { [[ -n $REC_PID ]] && kill "$REC_PID" 2>/dev/null && wait "$REC_PID" 2>/dev/null; REC_PID=; }
# uevent_at LOG DEVNAME ACTION SINCE: the time of the first such uevent at or after SINCE.
uevent_at() {
    local out
    out=$(ev wait "$1" --since "$4" --event uevent --where devname="$2" --where action="$3" --where kvm_event= \
          --timeout $((15 * slow))) || return 1
    jget 'd["t"]' <<<"$out"
}
# list_after LOG DEVNAME ACTION SINCE RESOURCE HEALTH: the kernel's ACTION uevent for DEVNAME (in LOG,
# at or after SINCE), and kubelet's list of RESOURCE with HEALTH (at or after SINCE too: the recorder
# may see the uevent after the daemon has answered); LAT is the time from the one to the other.
LAT=-
list_after() {
    local t_ue out
    LAT=-
    if ! t_ue=$(uevent_at "$1" "$2" "$3" "$4"); then
        info "no kernel $3 uevent for $2 within $((15 * slow)) s"
        return 1
    fi
    info "kernel $3 uevent for $2 $(ms_between "$4" "$t_ue") ms after the command began"
    out=$(ev wait "$klog" --since "$4" --event list --resources "$5" --health "$6" --timeout $((30 * slow))) || return 1
    LAT=$(ms_between "$t_ue" "$(jget 'd["t"]' <<<"$out")")
    info "$5 $6 $LAT ms after the uevent"
}

# The daemon's journal since time T (unix seconds, to the microsecond), "TIME MESSAGE" per line.
daemon_journal_since() {
    journalctl -u "$unit" --since "@${1%.*}" --no-pager -o short-unix 2>&1 |
        awk -v t="$1" '$1 + 0 >= t + 0 { sub(/^[^ ]+ [^ ]+ [^ ]+ /, $1 " "); print }'
}
# misc_minor NAME: the misc minor the kernel gave NAME (/proc/misc).
misc_minor() { awk -v n="$1" '$2 == n { print $1 }' /proc/misc; }
node_numbers() { [[ -c $1 ]] && printf '%d:%d' "0x$(stat -c %t "$1")" "0x$(stat -c %T "$1")"; }

# Containers: podman (runc) with an image holding kvmcheck (tests/podman/kvmcheck.c, a tiny VMM) and
# busybox, made in step 8. crun LABEL CHECK STATUS PODMAN_ARGS...: one container; its line (JSON)
# in OUT; CHECK, a Python expression on the line d, must be true and podman's exit status STATUS.
img=localhost/ate-kvmcheck:e2e
prun() { timeout $((300 * slow)) podman run --rm --network none --pull never "$@"; }
OUT=
crun() {
    local label=$1 check=$2 want=$3 t rc=0; shift 3
    t=$(now)
    OUT=$(prun "$@" 2>"$work/podman.err") || rc=$?
    info "$label ($(ms_since "$t") ms, exit $rc): $OUT"
    [[ -s $work/podman.err ]] && info "$label: podman's stderr: $(tr '\n' ' ' <"$work/podman.err")"
    if ((rc != want)); then
        info "$label: expected exit status $want"
        return 1
    fi
    [[ $(jget "$check" <<<"$OUT" 2>&1) == True ]] || { info "$label: expected $check"; return 1; }
}
# allocate RESOURCE: the CDI name a real Allocate on RESOURCE's socket returns, as kubelet asks it.
allocate() {
    local sock=$plugin_dir/${1/\//-}.sock alloc
    alloc=$(ev allocate "$sock") || { info "no Allocate answer from $sock" >&2; return 1; }
    info "Allocate (a real gRPC call on $sock): $alloc" >&2
    jget 'd["cdi_devices"][0] if d["cdi_devices"] else ""' <<<"$alloc"
}

echo "guest: $machine, $(uname -r), uptime $(cut -d' ' -f1 /proc/uptime) s, $(nproc) CPUs"

# ---- preparation ----------------------------------------------------------------------------------
# Where KVM is a module (amd64), kvm_amd loads by itself once udev has seen the CPU, which can take a
# while under the software CPU. Debian's arm64 kernel has KVM built in (CONFIG_KVM=y): it comes up at
# boot, given EL2.
kvm_builtin=0
grep -q '/kvm\.ko$' "/lib/modules/$(uname -r)/modules.builtin" 2>/dev/null && kvm_builtin=1
t=$(now)
if ((kvm_builtin)); then
    if wait_until $((30 * slow)) test -c /dev/kvm; then
        info "KVM is built into this kernel (modules.builtin: kvm.ko); /dev/kvm present (waited $(ms_since "$t") ms)"
    else
        info "KVM is built into this kernel, but there is no /dev/kvm"
    fi
    dmesg | grep -E 'kvm \[[0-9]+\]: (Hyp|VHE|.*mode)' | head -n 3 | sed 's/^/  | /'
elif wait_until 90 module_loaded kvm_amd && wait_until 30 test -c /dev/kvm; then
    info "kvm_amd loaded and /dev/kvm present (waited $(ms_since "$t") ms)"
else
    info "kvm_amd did not load within 120 s; /dev/kvm: $(ls -l /dev/kvm 2>&1)"
fi
# The stand-in for /dev/mshv (mshv-standin.c): a misc device of that name with a dynamic minor, as the
# Microsoft hypervisor's driver registers it on a Hyper-V root partition, loaded at boot as it would be.
if insmod "$share/mshv_standin.ko" 2>"$work/insmod.err" && wait_until $((30 * slow)) test -c /dev/mshv; then
    info "mshv stand-in loaded: /proc/misc has mshv at minor $(misc_minor mshv);" \
         "/dev/mshv $(stat -c '%A %U:%G' /dev/mshv) $(node_numbers /dev/mshv)"
else
    info "the mshv stand-in did not load: $(cat "$work/insmod.err")"
fi
udevadm settle --timeout=60

mkdir -p /etc/ate-devplugd
cat >/etc/ate-devplugd/config.toml <<'CONF'
# Written by the whole-system test.
plugin_dir = "/var/lib/kubelet/device-plugins"
log_level = "debug"

[[device]]
resource = "ate.dev/kvm"
path = "/dev/kvm"
probe = "kvm"
cdi = true

[[device]]
resource = "ate.dev/vhost-net"
path = "/dev/vhost-net"
preopen = true

[[device]]
resource = "ate.dev/vhost-vsock"
path = "/dev/vhost-vsock"

# The Microsoft hypervisor's device, as docs/operating.md gives it: no probe (the KVM probe asks KVM's
# API), CDI for a VMM that is not root, and no DeviceAllow= drop-in (the daemon only looks at it).
[[device]]
resource = "ate.dev/mshv"
path = "/dev/mshv"
cdi = true
CONF
# The unit opens no device node but /dev/kvm (read-only, for the probe); preopen needs the node
# allowed, as the shipped config.toml tells the operator.
mkdir -p "/etc/systemd/system/$unit.d"
printf '[Service]\nDeviceAllow=/dev/vhost-net rw\n' >"/etc/systemd/system/$unit.d/50-systest-preopen.conf"

# ---- 1. boot ----------------------------------------------------------------------------------------
# The package is installed with no kubelet around: its service must start and reach "active" on its
# own (Type=notify), and register as soon as kubelet's socket appears.
ok=1
deb=$share/$(cat "$share/deb-name")
t=$(now)
if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$deb" >"$work/apt.log" 2>&1; then
    info "installed $(basename "$deb") offline in $(ms_since "$t") ms"
else
    rc=$?
    info "apt-get install failed (status $rc):"; sed 's/^/  | /' "$work/apt.log"
    report 1 boot 0 -
    echo "RESULT: FAIL (the package could not be installed; later steps skipped)"
    exit 7
fi
if ! [[ -f $work/fakes/kubelet.py ]]; then
    info "no fakes/kubelet.py on the share"
    report 1 boot 0 -
    echo "RESULT: FAIL (no fake kubelet; later steps skipped)"
    exit 7
fi
if ! ate-devplugd check-config >"$work/check-config.log" 2>&1; then
    ok=0; info "ate-devplugd check-config rejected the test's config:"; sed 's/^/  | /' "$work/check-config.log"
fi
enabled=$(systemctl is-enabled "$unit" 2>&1)
info "after install: is-enabled=$enabled is-active=$(systemctl is-active "$unit")"
[[ $enabled == enabled ]] || { ok=0; info "the package did not enable $unit"; }
if ! wait_until $((60 * slow)) active; then
    ok=0
    info "$unit did not reach active after install; starting it"
    systemctl start "$unit" || info "systemctl start failed"
fi
info "$(systemctl show -p Type -p WatchdogUSec -p Restart -p NRestarts "$unit" | tr '\n' ' ')"
active || ok=0
info "started by the package: active $(startup_ms) ms after exec, with no kubelet"
[[ -e $plugin_dir/kubelet.sock ]] && { ok=0; info "kubelet.sock exists before the fake kubelet ran"; }
t=$(now)
kubelet_start || { ok=0; info "could not start the fake kubelet"; }
if out=$(ev wait "$klog" --since "$t" --event listening --timeout $((30 * slow))); then
    { read -r t_listen; read -r out; } < <(jget 'd["t"]' 'd["latency_ms"]' <<<"$out")
    info "fake kubelet listening after $out ms"
    if registered_since "$t_listen"; then
        ((REG_MS <= register_limit_ms)) || { ok=0; info "registration took over $register_limit_ms ms"; }
    else
        ok=0
    fi
else
    ok=0
fi
ev check "$klog" || ok=0
# Every record the daemon logs must reach the journal.
errors=$(journalctl -u "$unit" --no-pager -o cat | grep -c -e '--- Logging error ---')
((errors == 0)) || { ok=0; info "the daemon failed to log $errors record(s) (\"--- Logging error ---\" in its journal)"; }
report 1 boot "$ok" "$REG_MS"

# ---- 2. kvm hotplug ---------------------------------------------------------------------------------
# Latencies run from the kernel's own uevent (recorded as it arrives), not from the command's start:
# an unload itself takes about half a second under the software CPU, and seconds when the host is busy.
ulog=$work/uevents.jsonl

# Where KVM is a module: modprobe -r kvm_amd kvm removes /dev/kvm for real, modprobe brings it back.
kvm_unload() {
    local ok=1 lat
    LAT=-
    if ! module_loaded kvm_amd; then
        info "kvm_amd is not loaded; nothing to unload"
        report 2 kvm-unload 0 -
        return
    fi
    recorder_start "$ulog"
    # The kvm probe opens /dev/kvm for an instant; an unload that meets it is retried briefly, but
    # a node held open for longer fails the step.
    unload_kvm() { t=$(now); modprobe -r kvm_amd kvm 2>"$work/modprobe.err"; }
    if wait_until 5 unload_kvm; then
        info "modprobe -r kvm_amd kvm took $(ms_since "$t") ms; /dev/kvm $( [[ -e /dev/kvm ]] && echo present || echo gone)"
        list_after "$ulog" kvm remove "$t" ate.dev/kvm zero && ((LAT <= unhealthy_limit_ms)) || ok=0
    else
        ok=0; info "modprobe -r failed: $(cat "$work/modprobe.err") (is /dev/kvm held open?)"
        holders /dev/kvm
    fi
    lat=$LAT
    t=$(now)
    if modprobe kvm_amd 2>"$work/modprobe.err"; then
        info "modprobe kvm_amd took $(ms_since "$t") ms"
        list_after "$ulog" kvm add "$t" ate.dev/kvm full || ok=0
    else
        ok=0; info "modprobe kvm_amd failed: $(cat "$work/modprobe.err")"
    fi
    recorder_stop
    info "limit on unhealthy after the uevent: $unhealthy_limit_ms ms"
    report 2 kvm-unload "$ok" "$lat"
}

# Where KVM is built in (Debian's arm64 kernel): there is no module to unload, and nothing else in a
# running kernel takes /dev/kvm away (its misc device is deregistered only by kvm's module exit). The
# equivalent: what a daemon sees of a removal, the node gone from devtmpfs and the kernel's uevent for
# it, then the node made again and the kernel's add uevent, on which udevd's rules give it its group
# and mode.
kvm_node() {
    local ok=1 lat
    LAT=-
    info "KVM is built in (CONFIG_KVM=y): no module to unload, and nothing in a running kernel removes" \
         "/dev/kvm; the node is taken out of devtmpfs and made again instead, each with the kernel's uevent"
    recorder_start "$ulog"
    t=$(now)
    if rm /dev/kvm && echo change >/sys/class/misc/kvm/uevent; then
        list_after "$ulog" kvm change "$t" ate.dev/kvm zero && ((LAT <= unhealthy_limit_ms)) || ok=0
    else
        ok=0; info "could not remove /dev/kvm or send its uevent"
    fi
    lat=$LAT
    t=$(now)
    if mknod -m 0600 /dev/kvm c 10 232 && echo add >/sys/class/misc/kvm/uevent; then
        list_after "$ulog" kvm add "$t" ate.dev/kvm full || ok=0
    else
        ok=0; info "could not make /dev/kvm again"
    fi
    recorder_stop
    udevadm settle --timeout=$((30 * slow))
    info "/dev/kvm after udevd's rules: $(stat -c '%a %U:%G' /dev/kvm) $(node_numbers /dev/kvm)"
    [[ $(stat -c '%a %U:%G' /dev/kvm) == "660 root:kvm" ]] || { ok=0; info "udevd did not give the node its group and mode"; }
    info "limit on unhealthy after the uevent: $unhealthy_limit_ms ms"
    report 2 kvm-node "$ok" "$lat"
}
if ((kvm_builtin)); then kvm_node; else kvm_unload; fi

# ---- 3. vhost modules: static nodes ----------------------------------------------------------------
# /dev/vhost-net and /dev/vhost-vsock are static nodes (kmod-static-nodes): they stay when the modules
# go, and opening one loads its module. Policy: such a device stays present (healthy); preopen loads
# the module again when the daemon starts.
vhost_unload() {
    ok=1 lat=-
    if ! { modprobe vhost_vsock && modprobe vhost_net; }; then ok=0; info "could not load vhost_vsock/vhost_net"; fi
    udevadm settle --timeout=30
    : >"$work/udev.log"
    udevadm monitor --kernel --udev --subsystem-match=misc >"$work/udev.log" 2>&1 &
    mon=$!
    wait_until 10 grep -q '^UDEV - the event' "$work/udev.log" || info "udevadm monitor did not start"
    t=$(now)
    if modprobe -r vhost_vsock vhost_net 2>"$work/modprobe.err"; then
        remove_seen() {
            grep -Eq '^UDEV .*remove +/devices/virtual/misc/vhost-net ' "$work/udev.log" &&
                grep -Eq '^UDEV .*remove +/devices/virtual/misc/vhost-vsock ' "$work/udev.log"
        }
        if wait_until 15 remove_seen; then
            info "udev remove events for vhost-net and vhost-vsock within $(ms_since "$t") ms"
        else
            ok=0; info "udev remove events not seen:"; sed 's/^/  | /' "$work/udev.log"
        fi
    else
        ok=0; info "modprobe -r failed: $(cat "$work/modprobe.err") (is a vhost node held open?)"
        holders /dev/vhost-net /dev/vhost-vsock
    fi
    kill "$mon" 2>/dev/null; wait "$mon" 2>/dev/null
    udevadm settle --timeout=30
    info "vhost_net $(module_loaded vhost_net && echo loaded || echo unloaded)," \
         "vhost_vsock $(module_loaded vhost_vsock && echo loaded || echo unloaded);" \
         "nodes: $(stat -c '%n %F' /dev/vhost-net /dev/vhost-vsock 2>&1 | tr '\n' ' ')"
    [[ -c /dev/vhost-net && -c /dev/vhost-vsock ]] || { ok=0; info "a static node is gone"; }
    info "kmod static nodes: $(grep -h vhost /run/tmpfiles.d/static-nodes.conf 2>/dev/null | tr '\n' ';')"
    # What the daemon says must not change: a degraded list within this window would break the policy.
    if ev wait "$klog" --since "$t" --event list --resources ate.dev/vhost-net --health degraded --timeout 3 &>/dev/null ||
       ev wait "$klog" --since "$t" --event list --resources ate.dev/vhost-vsock --health degraded --timeout 0 &>/dev/null; then
        ok=0; info "the daemon reported a vhost device unhealthy after the unload"
    fi
    for r in ate.dev/vhost-net ate.dev/vhost-vsock; do
        info "$r last list: $(ev last "$klog" --event list --resource "$r")"
    done
    info "ate-devplugd probe:"
    ate-devplugd probe 2>&1 | sed 's/^/  | /'
    daemon_log=$(journalctl -u "$unit" --since "@${t%.*}" --no-pager -o cat 2>&1)
    info "daemon log since the unload:"
    tail -n 20 <<<"$daemon_log" | sed 's/^/  | /'
    for n in vhost-net vhost-vsock; do
        grep -Eqi "remove.*$n" <<<"$daemon_log" || { ok=0; info "the daemon's log shows no remove event for $n"; }
    done
    t=$(now)
    systemctl restart "$unit" || { ok=0; info "systemctl restart failed"; }
    if wait_until 30 module_loaded vhost_net; then
        lat=$(ms_since "$t")
        info "vhost_net loaded again $lat ms after the restart (preopen)"
    else
        ok=0; info "vhost_net not loaded after the restart: preopen did not open /dev/vhost-net"
    fi
    info "vhost_vsock (no preopen) $(module_loaded vhost_vsock && echo loaded || echo unloaded) after the restart"
    registered_since "$t" || ok=0
    report 3 vhost-unload "$ok" "$lat"
}
run_step 3 vhost-unload vhost_unload full-only

# ---- 4. kubelet restart -----------------------------------------------------------------------------
ok=1
kpid=$(systemctl show -p MainPID --value fake-kubelet.service)
t=$(now)
if [[ $kpid =~ ^[1-9][0-9]*$ ]] && kill -HUP "$kpid"; then
    if out=$(ev wait "$klog" --since "$t" --event restart --timeout $((30 * slow))); then
        t_restart=$(jget 'd["t"]' <<<"$out")
        registered_since "$t_restart" || ok=0
        for r in "${resources[@]}"; do
            read -r total healthy < <(ev last "$klog" --event list --resource "$r" | jget 'd["total"], d["healthy"]' | tr -d '(),')
            info "$r capacity $total allocatable $healthy (expected $count)"
            [[ $total == "$count" && $healthy == "$count" ]] || ok=0
        done
    else
        ok=0; info "the fake kubelet logged no restart"
    fi
else
    ok=0; info "no fake kubelet to restart (MainPID=$kpid)"
fi
ev check "$klog" --since "$t" || ok=0
report 4 kubelet-restart "$ok" "$REG_MS"

# ---- 5. daemon restart: same device IDs, one instance at a time -----------------------------------
ok=1
before=$(digests)
pid=$(main_pid)
t=$(now)
systemctl restart "$unit" || { ok=0; info "systemctl restart failed"; }
registered_since "$t" || ok=0
after=$(digests)
info "MainPID $pid -> $(main_pid)"
if [[ -n $before && $before == "$after" ]]; then
    info "ids_digest unchanged: ${after//$'\n'/ }"
else
    ok=0; info "ids_digest changed: before [${before//$'\n'/ }] after [${after//$'\n'/ }]"
fi
ev check "$klog" --since "$t" || ok=0
report 5 daemon-restart "$ok" "$REG_MS"

# ---- 6. watchdog ------------------------------------------------------------------------------------
ok=1
printf '[Service]\nWatchdogSec=%ds\n' $((3 * slow)) >"/etc/systemd/system/$unit.d/50-systest-watchdog.conf"
systemctl daemon-reload
t=$(now)
systemctl restart "$unit" || { ok=0; info "systemctl restart failed"; }
registered_since "$t" || ok=0
info "$(systemctl show -p WatchdogUSec "$unit")"
pid=$(main_pid)
restarts=$(systemctl show -p NRestarts --value "$unit")
new_instance() { local p; p=$(main_pid); [[ $p != 0 && $p != "$pid" ]] && active; }
t=$(now)
if [[ $pid =~ ^[1-9][0-9]*$ ]] && kill -STOP "$pid"; then
    if wait_until $((90 * slow)) new_instance; then
        info "new MainPID $(main_pid) active $(ms_since "$t") ms after SIGSTOP to $pid"
        registered_since "$t" || ok=0
    else
        ok=0; info "no new instance within $((90 * slow)) s"
        kill -CONT "$pid" 2>/dev/null
    fi
else
    ok=0; info "no daemon process to stop (MainPID=$pid)"
fi
now_restarts=$(systemctl show -p NRestarts --value "$unit")
info "NRestarts $restarts -> $now_restarts"
((now_restarts > restarts)) || ok=0
status=$(systemctl status --no-pager -n 40 "$unit" 2>&1)
sed 's/^/  | /' <<<"$status"
journal=$(journalctl -u "$unit" --since "@${t%.*}" --no-pager -o short-monotonic 2>&1)
if grep -qi 'watchdog timeout' <<<"$journal"; then
    info "journal: $(grep -i 'watchdog timeout' <<<"$journal" | head -n1)"
else
    ok=0; info "the journal does not mention the watchdog timeout"
fi
grep -qi watchdog <<<"$status" || { ok=0; info "systemctl status does not mention the watchdog"; }
rm -f "/etc/systemd/system/$unit.d/50-systest-watchdog.conf"
systemctl daemon-reload
ev check "$klog" --since "$t" || ok=0
report 6 watchdog "$ok" "$REG_MS"

# ---- 7. reboot-equivalent: kubelet first, then the daemon ------------------------------------------
ok=1
systemctl stop "$unit" || { ok=0; info "systemctl stop failed"; }
kubelet_stop
info "stopped: $unit $(systemctl is-active "$unit"), fake-kubelet $(systemctl is-active fake-kubelet.service)"
info "left in the plugin dir: $(ls -A "$plugin_dir" | tr '\n' ' ')"
t=$(now)
kubelet_start || { ok=0; info "could not start the fake kubelet"; }
ev wait "$klog" --since "$t" --event listening --timeout $((30 * slow)) >/dev/null || ok=0
t=$(now)
systemctl start "$unit" || { ok=0; info "systemctl start failed"; }
info "$unit active $(ms_since "$t") ms after systemctl start ($(startup_ms) ms after exec)"
registered_since "$t" || ok=0
ev check "$klog" --since "$t" || ok=0
report 7 cold-start "$ok" "$REG_MS"

# ---- 8. cgroup v2: the device program is the gate, and the daemon's CDI grant opens it ------------
# On the unified hierarchy a container's device access is an eBPF program on its cgroup, which refuses
# every node the runtime was not told to allow, whatever the file's mode or the process's capabilities.
# podman (runc) runs an image holding kvmcheck (tests/podman/kvmcheck.c, a tiny VMM built for the
# guest's architecture) and busybox:
#   a. uid 1000, no supplementary group, the CDI name the daemon's Allocate returned: opens /dev/kvm,
#      and boots a guest if the emulated CPU's nested KVM runs it (reported either way on x86-64; on
#      arm64 it must: kvmcheck --expect-guest exits 0 only when the guest's last exit came as expected);
#   b. the same without the CDI name: no node (the grant removed);
#   c. the DeviceSpec alone (the host's 0660 root:kvm node): EACCES for uid 1000;
#   d. root with CAP_MKNOD makes c 10:232 itself, mode 0666, with no grant: EPERM on open (the program);
#   e. the same with the cgroup rule c 10:232 rw: it opens (so d's refusal is the device program's);
#   f. (arm64, --full) a real VMM: Debian's own qemu-system-aarch64 -accel kvm as uid 1000 with the CDI
#      name, in a container whose root is an overlay of the guest's, boots this kernel as a second-level
#      guest whose init prints a token the test made and powers off; qemu's exit status and the token
#      are checked.
guest_text="kvm guest: hello from real mode"
[[ $machine == aarch64 ]] && guest_text="kvm guest: hello from aarch64"
step8() {
    local fstype dir=$work/image cdi t vm expect=() mk
    fstype=$(stat -fc %T /sys/fs/cgroup)
    info "stat -fc %T /sys/fs/cgroup: $fstype"
    [[ $fstype == cgroup2fs ]] || { ok=0; info "systemd did not boot on the unified cgroup hierarchy"; }
    # The image's podman with runc (crun is not in the image), and otherwise its defaults.
    mkdir -p /etc/containers
    printf '[engine]\nruntime = "runc"\n' >/etc/containers/containers.conf
    rm -rf "$dir"; mkdir -p "$dir/dev" "$dir/tmp"
    install -m 0755 "$share/kvmcheck" "$dir/kvmcheck"
    install -m 0755 /bin/busybox "$dir/busybox"
    t=$(now)
    if ! tar -C "$dir" -cf "$work/image.tar" . || ! podman import --quiet "$work/image.tar" "$img" >/dev/null; then
        ok=0; info "podman import failed"; return
    fi
    info "podman: image imported in $(ms_since "$t") ms"
    info "podman info: $(podman info --format 'podman {{.Version.Version}}, cgroup manager {{.Host.CgroupManager}}, cgroups {{.Host.CgroupsVersion}}, runtime {{.Host.OCIRuntime.Name}} {{.Host.OCIRuntime.Version}}' | head -n1)"
    cdi=$(allocate ate.dev/kvm) && [[ -n $cdi ]] || { ok=0; info "Allocate named no CDI device"; return; }
    [[ $machine == aarch64 ]] && expect=(--expect-guest)

    t=$(now)
    if crun "a. --user 1000:1000 --device $cdi" \
        '(d["uid"], d["gid"], [g for g in d["groups"] if g != 1000], d["open_errno"], d["api_version"]) == (1000, 1000, [], 0, 12)' \
        0 --user 1000:1000 --device "$cdi" "$img" /kvmcheck "${expect[@]}"; then
        lat=$(ms_since "$t")
    else
        ok=0; info "a. expected uid/gid 1000 without supplementary groups, /dev/kvm open, KVM_GET_API_VERSION 12"
    fi
    { read -r vm; read -r out; } < <(jget '"none" if not d.get("vm") else "ran" if d["vm"]["failed_step"] is None else "failed"' \
        '"the guest wrote {output!r} in {exits} exits, the last KVM_EXIT_* {exit_reason} (finished: {finished})".format(**d["vm"]) if d.get("vm") else ""' \
        <<<"$OUT" 2>/dev/null)
    if [[ $vm == ran ]]; then
        info "a. KVM_RUN in the nested $machine guest: yes; $out"
        [[ $out == "the guest wrote '$guest_text\n' "* ]] || { ok=0; info "a. the guest's output is not the expected text"; }
    elif [[ $vm == failed ]]; then
        info "a. KVM_RUN in the nested guest: no (this emulated CPU's nested KVM: $out)"
        ((${#expect[@]})) || info "a. the KVM_GET_API_VERSION check stands"
    fi
    crun "b. without the CDI name" 'd["open_errno"] == 2' 0 --user 1000:1000 "$img" /kvmcheck ||
        { ok=0; info "b. expected ENOENT: no node without the grant"; }
    crun "c. the DeviceSpec alone, --device /dev/kvm" 'd["open_errno"] == 13' 0 \
        --user 1000:1000 --device /dev/kvm "$img" /kvmcheck || { ok=0; info "c. expected EACCES on the host's root:kvm 0660 node"; }
    if short_run; then
        info "d., e. (root's own c 10:232 refused by the device program, then opened with the cgroup rule):" \
             "an arm64 run leaves them out; make e2e-arm64 FULL=1 runs them"
        return
    fi
    mk='/busybox cat /proc/self/cgroup >&2 && /busybox mknod -m 666 /dev/kvm c 10 232 && exec /kvmcheck /dev/kvm'
    # The host's cgroup namespace (the device program is the same), so the container's cgroup shows
    # which manager made it: machine.slice/libpod-<id>.scope is systemd's, machine/libpod-<id> cgroupfs'.
    crun "d. root, CAP_MKNOD, mknod c 10:232 itself, no grant" \
        '(d["uid"], d["stat"]["chr"], d["stat"]["major"], d["stat"]["minor"], oct(d["stat"]["mode"]), d["open_errno"]) == (0, True, 10, 232, "0o666", 1)' \
        0 --cap-add MKNOD --cgroupns host "$img" /busybox sh -c "$mk" ||
        { ok=0; info "d. expected root with a 0666 node c 10:232 and EPERM from the device program"; }
    crun "e. the same with --device-cgroup-rule 'c 10:232 rw'" '(d["open_errno"], d["api_version"]) == (0, 12)' 0 \
        --cap-add MKNOD --device-cgroup-rule 'c 10:232 rw' "$img" /busybox sh -c "$mk" ||
        { ok=0; info "e. expected the node to open with the rule"; }
    [[ $machine == aarch64 ]] && { real_vmm "$cdi" || ok=0; }
}
# real_vmm CDI_NAME: f. above. The second-level guest is booted quiet: under emulation every byte on
# its serial console is an exit.
real_vmm() {
    local l2=/var/tmp/systest-l2 token rc=0 t
    token=$(cat /proc/sys/kernel/random/uuid)
    rm -rf "$l2"; mkdir -p "$l2/root/bin" "$l2/root/dev"
    install -m 0755 /bin/busybox "$l2/root/bin/busybox"
    printf '#!/bin/busybox sh
/bin/busybox echo "second-level guest: %s on $(/bin/busybox uname -m)"
/bin/busybox poweroff -f
' \
        "$token" >"$l2/root/init"
    chmod 0755 "$l2/root/init"
    (cd "$l2/root" && find . | busybox cpio -o -H newc 2>/dev/null) >"$l2/initrd.cpio"
    cp "/boot/vmlinuz-$(uname -r)" "$l2/vmlinuz"
    chmod -R a+rX "$l2"
    t=$(now)
    OUT=$(prun --user 1000:1000 --device "$1" --rootfs /:O \
        qemu-system-aarch64 -accel kvm -machine virt,gic-version=3 -cpu host -smp 1 -m 256 \
        -nodefaults -no-user-config -display none -no-reboot -serial stdio \
        -kernel "$l2/vmlinuz" -initrd "$l2/initrd.cpio" -append "console=ttyAMA0 quiet panic=-1 rdinit=/init" \
        2>"$work/podman.err") || rc=$?
    info "f. Debian's qemu-system-aarch64 -accel kvm as uid 1000 with $1 ($(ms_since "$t") ms, exit $rc):"
    sed 's/^/  | /' <<<"$OUT"
    [[ -s $work/podman.err ]] && sed 's/^/  | stderr: /' "$work/podman.err"
    ((rc == 0)) && grep -q "^second-level guest: $token on aarch64" <<<"$OUT" ||
        { info "f. expected qemu to exit 0 after its guest printed the token $token"; return 1; }
}
ok=1 lat=-
t8=$(now)
step8
info "step 8 took $(ms_since "$t8") ms"
report 8 cgroup2-podman "$ok" "$lat"

# ---- 9. the KVM probe ----------------------------------------------------------------------------
# The daemon's probe (probe = "kvm": KVM_GET_API_VERSION on the node, in its sandbox) is what keeps
# ate.dev/kvm healthy; doctor, run as root, also creates a VM (KVM_CREATE_VM) through the package's
# code on this machine's python3. The latency is doctor's run.
kvm_probe() {
    local ok=1 lat out
    out=$(daemon_journal_since 0 | grep 'KVM API 12' | tail -n 1)
    [[ -n $out ]] || { ok=0; info "the daemon's log never says KVM API 12"; }
    info "the daemon, last: ${out#* }"
    ate-devplugd probe 2>&1 | sed 's/^/  | /'
    t=$(now)
    ate-devplugd doctor --json >"$work/doctor.json" 2>"$work/doctor.err"
    lat=$(ms_since "$t")
    while read -r out; do
        info "doctor: $out"
        [[ $out == *"'level': 'OK'"* ]] || { ok=0; info "doctor's check is not OK"; }
    done < <(jget "[c for c in d['checks'] if c['check'] == 'device ate.dev/kvm']" \
                  "[c for c in d['checks'] if c['check'] == 'kvm ate.dev/kvm']" <"$work/doctor.json" 2>&1)
    grep -q '"message": "KVM API 12; KVM_CREATE_VM works"' "$work/doctor.json" || { ok=0; info "doctor did not create a VM"; }
    report 9 kvm-probe "$ok" "$lat"
}
kvm_probe

# ---- 10. KVM's VM announcements against the socket filter -----------------------------------------
# Every KVM_CREATE_VM and every VM's end makes the kernel send a change uevent on misc/kvm, which udevd
# runs its rules on and sends on. The daemon's socket filter drops them in the kernel (node/kvm_events.py):
# for N VM lifecycles the kernel and udevd each send 2N, and none reaches the daemon. A plain change
# uevent on kvm after them (which udevd handles after them, in order) must: it shows the daemon was
# listening all along. The latency is from udevd's sending it on (what the daemon hears) to the
# daemon's hint.
vm_announcements() {
    local ok=1 lat=- n=$vm_lifecycles klog_k=$work/kernel-uevents.jsonl klog_u=$work/udev-uevents.jsonl
    local kpid upid t0 out t_marker t_hint hints leftout c
    recorder_start "$klog_k"; kpid=$REC_PID
    recorder_start "$klog_u" --source udev; upid=$REC_PID
    t0=$(now)
    out=$(ev vms /dev/kvm "$n") || { ok=0; info "the VM loop failed"; }
    info "$n VMs started and ended: $out"
    t=$(now)
    echo change >/sys/class/misc/kvm/uevent
    if t_marker=$(uevent_at "$klog_u" kvm change "$t"); then
        info "udevd sent the plain change on after its rules $(ms_between "$t" "$t_marker") ms after it was sent"
    else
        ok=0; info "udevd did not send the plain change on"; t_marker=$t
    fi
    hint() { daemon_journal_since "$t0" | grep ' uevent change misc/kvm' | tail -n 1; }
    hinted() { [[ -n $(hint) ]]; }
    if wait_until $((30 * slow)) hinted; then
        t_hint=$(hint); t_hint=${t_hint%% *}
        lat=$(ms_between "$t_marker" "$t_hint")
        info "the daemon's hint for it $lat ms after udevd sent it on"
    else
        ok=0; info "the daemon logged no hint for the plain change uevent"
    fi
    kill "$kpid" "$upid" 2>/dev/null; wait "$kpid" "$upid" 2>/dev/null
    for source in kernel udevd; do
        c=$klog_k; [[ $source == udevd ]] && c=$klog_u
        out="$(ev count "$c" --event uevent --since "$t0" --where kvm_event=create) created," 
        out+=" $(ev count "$c" --event uevent --since "$t0" --where kvm_event=destroy) ended"
        info "$source sent: $out"
        [[ $out == "$n created, $n ended" ]] || { ok=0; info "expected $n of each from $source"; }
    done
    hints=$(daemon_journal_since "$t0" | grep -c ' uevent change misc/kvm')
    leftout=$(daemon_journal_since "$t0" | grep -c 'announcement(s) left out')
    info "the daemon woke for $hints change(s) on misc/kvm (the plain one: 1 expected), and read and left out" \
         "$leftout batch(es) of announcements (0 expected: the socket filter dropped them all)"
    ((hints == 1 && leftout == 0)) || ok=0
    out=$(daemon_journal_since 0 | grep 'no socket filter for KVM' | tail -n 1)
    [[ -z $out ]] || { ok=0; info "the daemon said it has no socket filter: ${out#* }"; }
    report 10 vm-announcements "$ok" "$lat"
}
vm_announcements

# ---- 11. a second hypervisor device: /dev/mshv, a dynamic misc minor -------------------------------
# The stand-in (mshv-standin.c) is a misc device named mshv with a dynamic minor, as the Microsoft
# hypervisor's driver registers it; no Hyper-V host is involved. The daemon serves it with CDI, no
# probe and no DeviceAllow= drop-in. The device goes (rmmod: Unhealthy) and comes back at another
# minor (a second stand-in takes the freed one first): the CDI spec follows the new minor, and uid
# 1000 opens the node through it, before and after; without the name there is no node, and the
# DeviceSpec alone gives the host's 0600 root node (EACCES).
mshv_spec_minor() { jget 'd["devices"][0]["containerEdits"]["deviceNodes"][0]["minor"]' <"$cdi_dir/ate.dev-mshv.json" 2>/dev/null; }
mshv_opens() {
    local label=$1 minor=$2 cdi
    cdi=$(allocate ate.dev/mshv) && [[ -n $cdi ]] || { info "$label: Allocate named no CDI device"; return 1; }
    crun "$label --user 1000:1000 --device $cdi" \
        "(d['stat']['major'], d['stat']['minor'], oct(d['stat']['mode']), d['uid'], d['open_errno'], d['ioctl_errno']) == (10, $minor, '0o666', 1000, 0, 25)" \
        0 --user 1000:1000 --device "$cdi" "$img" /kvmcheck /dev/mshv ||
        { info "$label: expected 10:$minor (0666) opened by uid 1000, and ENOTTY from the stand-in's ioctl"; return 1; }
}
mshv_step() {
    local ok=1 lat=- before after mlog=$work/mshv-uevents.jsonl
    LAT=-
    before=$(misc_minor mshv)
    info "/proc/misc: mshv at minor ${before:-none}; /dev/mshv $(stat -c '%A %U:%G' /dev/mshv 2>&1) $(node_numbers /dev/mshv)"
    info "the unit's DeviceAllow=: $(systemctl show -p DeviceAllow --value "$unit" | tr '\n' ' ')"
    info "CDI spec: minor $(mshv_spec_minor)"
    [[ -n $before && $(mshv_spec_minor) == "$before" ]] || { ok=0; info "the spec does not name minor $before"; }
    mshv_opens a. "$before" || ok=0
    recorder_start "$mlog"
    t=$(now)
    rmmod mshv_standin || { ok=0; info "rmmod mshv_standin failed"; }
    list_after "$mlog" mshv remove "$t" ate.dev/mshv zero && ((LAT <= unhealthy_limit_ms)) || ok=0
    lat=$LAT
    t=$(now)
    insmod "$share/mshv_spare.ko" && insmod "$share/mshv_standin.ko" || { ok=0; info "insmod failed"; }
    list_after "$mlog" mshv add "$t" ate.dev/mshv full || ok=0
    recorder_stop
    after=$(misc_minor mshv)
    info "/proc/misc: mshv-spare at minor $(misc_minor mshv-spare), mshv now at minor $after"
    [[ -n $after && $after != "$before" ]] || { ok=0; info "mshv did not come back at another minor"; }
    spec_names_after() { [[ $(mshv_spec_minor) == "$after" ]]; }
    if wait_until $((30 * slow)) spec_names_after; then
        info "CDI spec rewritten: minor $after"
    else
        ok=0; info "the CDI spec still names minor $(mshv_spec_minor)"
    fi
    mshv_opens b. "$after" || ok=0
    if short_run; then
        info "c., d. (no node without the name; EACCES with the DeviceSpec alone): an arm64 run leaves them out;" \
             "make e2e-arm64 FULL=1 runs them"
        report 11 mshv "$ok" "$lat"
        return
    fi
    crun "c. without the CDI name" 'd["open_errno"] == 2' 0 --user 1000:1000 "$img" /kvmcheck /dev/mshv ||
        { ok=0; info "c. expected ENOENT: no node without the grant"; }
    crun "d. the DeviceSpec alone, --device /dev/mshv" 'd["open_errno"] == 13' 0 \
        --user 1000:1000 --device /dev/mshv "$img" /kvmcheck /dev/mshv || { ok=0; info "d. expected EACCES on the host's 0600 node"; }
    report 11 mshv "$ok" "$lat"
}
mshv_step

# ---- summary ---------------------------------------------------------------------------------------
ev check "$klog" || info "event log invariants broken over the whole run (see above)"
info "daemon tracebacks in the journal: $(journalctl -u "$unit" --no-pager -o cat | grep -c '^Traceback')"
kubelet_stop
cp "$klog" "$share/out/kubelet.jsonl" 2>/dev/null
if ((${#failed[@]})); then
    echo "RESULT: FAIL (${#failed[@]} of $steps: ${failed[*]})"
else
    echo "RESULT: PASS ($steps of $steps)"
fi
exit "${#failed[@]}"
