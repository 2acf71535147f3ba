#!/bin/bash
# Runs inside the guest (started by systest.service; see build-image.sh and run.sh).
# Installs the .deb offline, runs the fake kubelet, and checks the daemon through seven steps while
# kernel modules are unloaded and loaded for real. One line per step:
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

# ---- summary ---------------------------------------------------------------------------------------
ev check "$klog" || info "event log invariants broken over the whole run (see above)"
info "daemon tracebacks in the journal: $(journalctl -u "$unit" --no-pager -o cat | grep -c '^Traceback')"
kubelet_stop
cp "$klog" "$share/out/kubelet.jsonl" 2>/dev/null
if ((${#failed[@]})); then
    echo "RESULT: FAIL (${#failed[@]} of 7: ${failed[*]})"
else
    echo "RESULT: PASS (7 of 7)"
fi
exit "${#failed[@]}"
