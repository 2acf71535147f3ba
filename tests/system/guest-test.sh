#!/bin/bash
# Runs inside the guest (started by systest.service; see build-image.sh and run.sh).
# Installs the .deb offline, runs the fake kubelet, and checks the daemon through seven steps while
# kernel modules are unloaded and loaded for real; an eighth runs containers with podman on the
# unified cgroup hierarchy. One line per step:
#   STEP n name: PASS|FAIL <latency> ms
# followed by indented details. Exit status: the number of failed steps (0 = all passed).
set -uo pipefail

share=${1:-/mnt/share}
work=/run/systest
plugin_dir=/var/lib/kubelet/device-plugins
klog=$work/kubelet.jsonl
unit=ate-devplugd.service
resources=(ate.dev/kvm ate.dev/vhost-net ate.dev/vhost-vsock)
all=$(IFS=,; echo "${resources[*]}")
count=4096            # the configured default per resource: capacity must come back to this
register_limit_ms=5000      # "registers as soon as kubelet does", with room for the software CPU
unhealthy_limit_ms=10000     # from the kernel's uevent to kubelet's list; generous: the CPU is emulated
wait_s=20                   # how long any one registration may take before the step fails

mkdir -p "$work"
cp "$share/events.py" "$work/events.py"
rm -rf "$work/fakes"
[[ -d $share/fakes ]] && cp -r "$share/fakes" "$work/fakes"

failed=()
now() { date +%s.%N; }
ms_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%d", (b - a) * 1000 }'; }
info() { printf '  %s\n' "$*"; }
ev() { python3 "$work/events.py" "$@"; }
jget() { python3 -c 'import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1], {}, {"d": d}))' "$1"; }

# report N NAME OK LATENCY_MS
report() {
    local n=$1 name=$2 ok=$3 lat=$4
    if ((ok)); then
        echo "STEP $n $name: PASS $lat ms"
    else
        echo "STEP $n $name: FAIL $lat ms"
        failed+=("$n $name")
        diagnose
    fi
}

diagnose() {
    info "--- diagnostics ---"
    systemctl status --no-pager -n 30 "$unit" 2>&1 | sed 's/^/  | /'
    systemctl status --no-pager -n 10 fake-kubelet.service 2>&1 | sed 's/^/  | /'
    info "plugin dir:"; ls -la "$plugin_dir" 2>&1 | sed 's/^/  | /'
    info "last kubelet events:"; tail -n 15 "$klog" 2>/dev/null | sed 's/^/  | /'
    info "modules:"; lsmod | grep -E '^(kvm|vhost)' | sed 's/^/  | /'
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
    REG_MS=$(jget 'd["latency_ms"]' <<<"$out")
    info "registered: $(jget '" ".join(k + "@" + format(v["t"], ".3f") for k, v in d["events"].items())' <<<"$out")"
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

echo "guest: $(uname -r), uptime $(cut -d' ' -f1 /proc/uptime) s, $(nproc) CPUs"

# ---- preparation ----------------------------------------------------------------------------------
# kvm_amd loads by itself once udev has seen the CPU, which can take a while under the software CPU.
t=$(now)
if wait_until 90 module_loaded kvm_amd && wait_until 30 test -c /dev/kvm; then
    info "kvm_amd loaded and /dev/kvm present (waited $(ms_since "$t") ms)"
else
    info "kvm_amd did not load within 120 s; /dev/kvm: $(ls -l /dev/kvm 2>&1)"
fi
udevadm settle --timeout=60

mkdir -p /etc/ate-devplugd
cat >/etc/ate-devplugd/config.toml <<'EOF'
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
EOF
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
if ! wait_until 60 active; then
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
if out=$(ev wait "$klog" --since "$t" --event listening --timeout 30); then
    t_listen=$(jget 'd["t"]' <<<"$out")
    info "fake kubelet listening after $(jget 'd["latency_ms"]' <<<"$out") ms"
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

# ---- 2. kvm module unload / reload ------------------------------------------------------------------
# Latencies run from the kernel's own uevent (recorded as it arrives), not from modprobe's start: the
# unload itself takes about half a second under the software CPU, and seconds when the host is busy.
ok=1 lat=-
ulog=$work/uevents.jsonl
# ms_between A B: milliseconds from time A to time B (never below 0: the recorder may be scheduled
# after the daemon has already answered).
ms_between() { awk -v a="$1" -v b="$2" 'BEGIN { d = (b - a) * 1000; printf "%d", d < 0 ? 0 : d }'; }
# kvm_uevent ACTION SINCE: the time of the kernel's ACTION uevent for /dev/kvm at or after SINCE.
kvm_uevent() {
    local out
    out=$(ev wait "$ulog" --since "$2" --event uevent --where devname=kvm --where action="$1" --timeout 15) || return 1
    jget 'd["t"]' <<<"$out"
}
if ! module_loaded kvm_amd; then
    ok=0; info "kvm_amd is not loaded; nothing to unload"
else
    : >"$ulog"
    ev uevents "$ulog" >"$work/uevents.out" 2>&1 &
    umon=$!
    wait_until 10 grep -q '^listening' "$work/uevents.out" || info "the uevent recorder did not start: $(cat "$work/uevents.out")"
    # The kvm probe opens /dev/kvm for an instant; an unload that meets it is retried briefly, but
    # a node held open for longer fails the step.
    unload_kvm() { t=$(now); modprobe -r kvm_amd kvm 2>"$work/modprobe.err"; }
    if wait_until 5 unload_kvm; then
        info "modprobe -r kvm_amd kvm took $(ms_since "$t") ms; /dev/kvm $( [[ -e /dev/kvm ]] && echo present || echo gone)"
        if t_ue=$(kvm_uevent remove "$t"); then
            info "kernel remove uevent for kvm $(ms_between "$t" "$t_ue") ms after modprobe -r began"
            if out=$(ev wait "$klog" --since "$t" --event list --resources ate.dev/kvm --health zero --timeout 15); then
                lat=$(ms_between "$t_ue" "$(jget 'd["t"]' <<<"$out")")
                info "ate.dev/kvm unhealthy $lat ms after the uevent (limit $unhealthy_limit_ms ms)"
                ((lat <= unhealthy_limit_ms)) || ok=0
            else
                ok=0
            fi
        else
            ok=0; info "no kernel remove uevent for kvm within 15 s"
        fi
    else
        ok=0; info "modprobe -r failed: $(cat "$work/modprobe.err") (is /dev/kvm held open?)"
        holders /dev/kvm
    fi
    t=$(now)
    if modprobe kvm_amd 2>"$work/modprobe.err"; then
        info "modprobe kvm_amd took $(ms_since "$t") ms"
        if t_ue=$(kvm_uevent add "$t") &&
           out=$(ev wait "$klog" --since "$t" --event list --resources ate.dev/kvm --health full --timeout 30); then
            back=$(ms_between "$t_ue" "$(jget 'd["t"]' <<<"$out")")
            info "ate.dev/kvm healthy again $back ms after the add uevent"
        else
            ok=0; info "no add uevent for kvm, or no full list, after modprobe kvm_amd"
        fi
    else
        ok=0; info "modprobe kvm_amd failed: $(cat "$work/modprobe.err")"
    fi
    kill "$umon" 2>/dev/null; wait "$umon" 2>/dev/null
fi
report 2 kvm-unload "$ok" "$lat"

# ---- 3. vhost modules: static nodes ----------------------------------------------------------------
# /dev/vhost-net and /dev/vhost-vsock are static nodes (kmod-static-nodes): they stay when the modules
# go, and opening one loads its module. Policy: such a device stays present (healthy); preopen loads
# the module again when the daemon starts.
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

# ---- 4. kubelet restart -----------------------------------------------------------------------------
ok=1
kpid=$(systemctl show -p MainPID --value fake-kubelet.service)
t=$(now)
if [[ $kpid =~ ^[1-9][0-9]*$ ]] && kill -HUP "$kpid"; then
    if out=$(ev wait "$klog" --since "$t" --event restart --timeout 30); then
        t_restart=$(jget 'd["t"]' <<<"$out")
        registered_since "$t_restart" || ok=0
        for r in "${resources[@]}"; do
            rec=$(ev last "$klog" --event list --resource "$r")
            total=$(jget 'd["total"]' <<<"$rec"); healthy=$(jget 'd["healthy"]' <<<"$rec")
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
printf '[Service]\nWatchdogSec=3s\n' >"/etc/systemd/system/$unit.d/50-systest-watchdog.conf"
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
    if wait_until 90 new_instance; then
        info "new MainPID $(main_pid) active $(ms_since "$t") ms after SIGSTOP to $pid"
        registered_since "$t" || ok=0
    else
        ok=0; info "no new instance within 90 s"
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
ev wait "$klog" --since "$t" --event listening --timeout 30 >/dev/null || ok=0
t=$(now)
systemctl start "$unit" || { ok=0; info "systemctl start failed"; }
info "$unit active $(ms_since "$t") ms after systemctl start ($(startup_ms) ms after exec)"
registered_since "$t" || ok=0
ev check "$klog" --since "$t" || ok=0
report 7 cold-start "$ok" "$REG_MS"

# ---- 8. cgroup v2: the device program is the gate, and the daemon's CDI grant opens it ------------
# On the unified hierarchy a container's device access is an eBPF program on its cgroup, which refuses
# every node the runtime was not told to allow, whatever the file's mode or the process's capabilities.
# podman (runc) runs an image holding kvmcheck (tests/podman/kvmcheck.c, a tiny VMM) and busybox:
#   a. uid 1000, no supplementary group, the CDI name the daemon's Allocate returned: opens /dev/kvm,
#      and boots a guest if the emulated CPU's nested KVM runs it (reported either way);
#   b. the same without the CDI name: no node (the grant removed);
#   c. the DeviceSpec alone (the host's 0660 root:kvm node): EACCES for uid 1000;
#   d. root with CAP_MKNOD makes c 10:232 itself, mode 0666, with no grant: EPERM on open (the program);
#   e. the same with the cgroup rule c 10:232 rw: it opens (so d's refusal is the device program's).
ok=1 lat=-
step8() {
    local fstype img=localhost/ate-kvmcheck:e2e dir=$work/image alloc cdi out t vm sock=$plugin_dir/ate.dev-kvm.sock
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
    if ! alloc=$(ev allocate "$sock"); then
        ok=0; info "no Allocate answer from $sock"; return
    fi
    info "Allocate (a real gRPC call on $sock): $alloc"
    cdi=$(jget 'd["cdi_devices"][0] if d["cdi_devices"] else ""' <<<"$alloc")
    [[ -n $cdi ]] || { ok=0; info "Allocate named no CDI device"; return; }
    prun() { timeout 300 podman run --rm --network none --pull never "$@"; }
    # kv JSON EXPR: evaluate EXPR on the checker's line.
    kv() { jget "$2" <<<"$1"; }

    t=$(now)
    if out=$(prun --user 1000:1000 --device "$cdi" "$img" /kvmcheck 2>"$work/podman.err"); then
        lat=$(ms_since "$t")
        info "a. --user 1000:1000 --device $cdi ($lat ms): $out"
        [[ $(kv "$out" 'd["uid"], d["gid"], [g for g in d["groups"] if g != 1000]') == "(1000, 1000, [])" ]] ||
            { ok=0; info "a. not uid/gid 1000 without supplementary groups"; }
        [[ $(kv "$out" 'd["open_errno"], d["api_version"]') == "(0, 12)" ]] ||
            { ok=0; info "a. /dev/kvm did not open (KVM_GET_API_VERSION 12 expected)"; }
        vm=$(kv "$out" '"none" if not d.get("vm") else "ran" if d["vm"]["failed_step"] is None else "failed"')
        if [[ $vm == ran ]]; then
            info "a. KVM_RUN in the nested guest: yes; the guest wrote $(kv "$out" 'repr(d["vm"]["output"])')" \
                 "in $(kv "$out" 'd["vm"]["exits"]') exits"
            [[ $(kv "$out" 'd["vm"]["output"]') == "kvm guest: hello from real mode" ]] ||
                { ok=0; info "a. the guest's output is not the expected text"; }
        elif [[ $vm == failed ]]; then
            info "a. KVM_RUN in the nested guest: no (this emulated CPU's nested KVM:" \
                 "$(kv "$out" 'd["vm"]')); the KVM_GET_API_VERSION check stands"
        fi
    else
        ok=0; info "a. podman run failed: $(cat "$work/podman.err")"
    fi
    t=$(now)
    if out=$(prun --user 1000:1000 "$img" /kvmcheck 2>"$work/podman.err"); then
        info "b. without the CDI name ($(ms_since "$t") ms): $out"
        [[ $(kv "$out" 'd["open_errno"]') == 2 ]] || { ok=0; info "b. expected ENOENT: no node without the grant"; }
    else
        ok=0; info "b. podman run failed: $(cat "$work/podman.err")"
    fi
    t=$(now)
    if out=$(prun --user 1000:1000 --device /dev/kvm "$img" /kvmcheck 2>"$work/podman.err"); then
        info "c. the DeviceSpec alone, --device /dev/kvm ($(ms_since "$t") ms): $out"
        [[ $(kv "$out" 'd["open_errno"]') == 13 ]] || { ok=0; info "c. expected EACCES on the host's root:kvm 0660 node"; }
    else
        ok=0; info "c. podman run failed: $(cat "$work/podman.err")"
    fi
    local mk='/busybox cat /proc/self/cgroup >&2 && /busybox mknod -m 666 /dev/kvm c 10 232 && exec /kvmcheck /dev/kvm'
    t=$(now)
    # The host's cgroup namespace (the device program is the same), so the container's cgroup shows
    # which manager made it: machine.slice/libpod-<id>.scope is systemd's, machine/libpod-<id> cgroupfs'.
    if out=$(prun --cap-add MKNOD --cgroupns host "$img" /busybox sh -c "$mk" 2>"$work/podman.err"); then
        info "d. root, CAP_MKNOD, mknod c 10:232 itself, no grant ($(ms_since "$t") ms): $out"
        info "d. the container's cgroup: $(tr '\n' ' ' <"$work/podman.err")"
        [[ $(kv "$out" 'd["uid"], d["stat"]["chr"], d["stat"]["major"], d["stat"]["minor"], oct(d["stat"]["mode"])') == \
           "(0, True, 10, 232, '0o666')" ]] || { ok=0; info "d. not root with a 0666 node c 10:232"; }
        [[ $(kv "$out" 'd["open_errno"]') == 1 ]] || { ok=0; info "d. expected EPERM from the device program"; }
    else
        ok=0; info "d. podman run failed: $(cat "$work/podman.err")"
    fi
    t=$(now)
    if out=$(prun --cap-add MKNOD --device-cgroup-rule 'c 10:232 rw' "$img" /busybox sh -c "$mk" 2>"$work/podman.err"); then
        info "e. the same with --device-cgroup-rule 'c 10:232 rw' ($(ms_since "$t") ms): $out"
        [[ $(kv "$out" 'd["open_errno"], d["api_version"]') == "(0, 12)" ]] ||
            { ok=0; info "e. expected the node to open with the rule"; }
    else
        ok=0; info "e. podman run failed: $(cat "$work/podman.err")"
    fi
}
t8=$(now)
step8
info "step 8 took $(ms_since "$t8") ms"
report 8 cgroup2-podman "$ok" "$lat"

# ---- summary ---------------------------------------------------------------------------------------
ev check "$klog" || info "event log invariants broken over the whole run (see above)"
info "daemon tracebacks in the journal: $(journalctl -u "$unit" --no-pager -o cat | grep -c '^Traceback')"
kubelet_stop
cp "$klog" "$share/out/kubelet.jsonl" 2>/dev/null
if ((${#failed[@]})); then
    echo "RESULT: FAIL (${#failed[@]} of 8: ${failed[*]})"
else
    echo "RESULT: PASS (8 of 8)"
fi
exit "${#failed[@]}"
