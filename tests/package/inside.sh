#!/bin/bash
# Runs inside the booted Debian 12 or 13 container (started by tests/package/run.sh),
# as a oneshot unit once multi-user.target is reached. /mnt/share holds:
#   deb/ate-devplugd_*.deb   the package under test
#   previous/*.deb           the same tree built with a lower version (the upgrade's starting point)
#   src/                     the project's Python package (for the fakes)
#   tests/fakes/             the fakes (tests.fakes, on PYTHONPATH with src/): the fake kubelet among them
#   wait_event.py            waits for the fakes' log events and journal records
#   inplace.py               records file changes; checks and reports an upgrade or downgrade in place
#   control_plane.py         the node's control plane for switch-mode: API server, DRA plugin watcher,
#                            node-status update
# Each check appends "PASS|FAIL name (seconds)" to /mnt/share/results.txt, an in-place step and a
# switch-mode move also their figures (indented); "DONE" is appended last. The container journal goes
# to /mnt/share/journal.txt.
# Checks are functions run through check/must, which shellcheck cannot follow.
# shellcheck disable=SC2317
set -uo pipefail

share=/mnt/share
results=$share/results.txt
unit=ate-devplugd.service
plugin_dir=/var/lib/kubelet/device-plugins
sock=$plugin_dir/ate.dev-kvm.sock
conf=/etc/ate-devplugd/config.toml
metrics_file=/var/lib/prometheus/node-exporter/ate-devplugd.prom
cdi_spec=/run/cdi/ate.dev-kvm.json
klog=/run/fake-kubelet.jsonl
wait_event=(python3 "$share/wait_event.py")
pythonpath=$share/src:$share
export DEBIAN_FRONTEND=noninteractive
: >"$results"

say() { printf '%s\n' "$*" >&2; }

# check NAME CMD...: run CMD (a function), record PASS/FAIL with timing.
failed=0
check() {
    local name=$1; shift
    local start end rc
    say "--- $name"
    start=$(date +%s.%N)
    "$@"; rc=$?
    end=$(date +%s.%N)
    local secs; secs=$(awk "BEGIN { printf \"%.1f\", $end - $start }")
    if [ $rc = 0 ]; then
        printf 'PASS %s (%ss)\n' "$name" "$secs" | tee -a "$results" >&2
    else
        printf 'FAIL %s (%ss)\n' "$name" "$secs" | tee -a "$results" >&2
        failed=1
    fi
    return "$rc"
}

finish() {
    systemctl stop fake-kubelet.service fake-runtime.service fake-control-plane.service 2>/dev/null
    journalctl -b --no-pager -o short-monotonic >"$share/journal.txt" 2>&1
    echo DONE >>"$results"
    exit $failed
}

# must NAME CMD...: a check the later ones build on; on failure, stop here.
must() { check "$@" || { say "giving up after: $1"; finish; }; }

# wait_for SECONDS CMD...: poll CMD until it succeeds, or fail after SECONDS.
wait_for() {
    local timeout=$1; shift
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            say "timed out after ${timeout}s waiting for: $*"
            return 1
        fi
        sleep 0.2
    done
}

prop() { systemctl show -P "$1" "$unit"; }
expect_prop() {  # expect_prop NAME VALUE
    local got; got=$(prop "$1")
    [ "$got" = "$2" ] || { say "$1=$got, expected $2"; return 1; }
}
is_running() { [ "$(prop ActiveState)/$(prop SubState)" = active/running ]; }
now() { python3 -c 'import time; print(time.time())'; }
cursor() { journalctl -n 0 --show-cursor -q | sed -n 's/^-- cursor: //p'; }
kubelet_event() { "${wait_event[@]}" kubelet "$klog" "$@"; }
journal_record() { "${wait_event[@]}" journal "$unit" "$@"; }
# unit_log CURSOR: the unit's messages after CURSOR (not `journalctl -u U --after-cursor C`: see wait_event.py).
unit_log() { "${wait_event[@]}" journal-text "$unit" --after-cursor "$1"; }
set_count() { sed -i "s/^count = [0-9]*/count = $1/" "$conf"; }
total_after() {  # total_after T N: a ListAndWatch of N devices arrives after T
    kubelet_event --after "$1" --timeout 60 list resource=ate.dev/kvm total="$2" >/dev/null
}

# The device is healthy only when /dev/kvm answers in here (bound from the host).
kvm_ok=0
if [ -c /dev/kvm ] && python3 -c 'import fcntl, os; fd = os.open("/dev/kvm", os.O_RDONLY); assert fcntl.ioctl(fd, 0xAE00) == 12' 2>/dev/null; then
    kvm_ok=1
fi
say "/dev/kvm usable in the container: $kvm_ok"

# ---- the fake kubelet, as a unit of its own ---------------------------------------------------------
# Pods asking ate.dev/kvm arrive through its admission while SIGUSR1 has them on (pods_on, pods_off):
# an upgrade and a restart are each measured with pods arriving.
pod_rate=10
pods_toggle() { systemctl kill --kill-whom=main -s USR1 fake-kubelet.service; }
start_kubelet() {
    mkdir -p "$plugin_dir" && chmod 0750 "$plugin_dir"
    systemd-run --unit=fake-kubelet --collect -p KillSignal=SIGTERM \
        -E PYTHONPATH="$pythonpath" -E PYTHONUNBUFFERED=1 \
        python3 "$share/tests/fakes/kubelet.py" --dir "$plugin_dir" --log "$klog" --pods "ate.dev/kvm:$pod_rate" &&
        kubelet_event --timeout 30 listening >/dev/null
}
must "fake kubelet listening" start_kubelet

# ---- install, offline ----------------------------------------------------------------------------
# node_exporter's textfile directory, as prometheus-node-exporter's package makes it (root, 0755).
mkdir -p -m 0755 "$(dirname "$metrics_file")"
install_deb() {
    t_install=$(now)
    (cd "$share/deb" && apt-get install -y -q ./ate-devplugd_*.deb </dev/null)
}
must "apt-get install ./ate-devplugd_*.deb (offline)" install_deb

service_running() {
    wait_for 30 is_running &&
        expect_prop Type notify && expect_prop NotifyAccess main && expect_prop WatchdogUSec 30s &&
        expect_prop Restart on-failure &&
        [[ $(prop FragmentPath) == */lib/systemd/system/$unit ]] &&
        expect_prop UnitFileState enabled &&
        expect_prop ProtectSystem strict && expect_prop PrivateUsers yes &&
        expect_prop DevicePolicy closed && expect_prop NoNewPrivileges yes &&
        expect_prop CapabilityBoundingSet "" &&
        systemctl status --no-pager "$unit" | grep -q 'Active: active (running)'
}
must "service active (running) under the hardened unit" service_running

score_ok() {
    local score
    score=$(systemd-analyze security --no-pager "$unit" 2>&1 |
        sed -n 's/.*Overall exposure level for .*: \([0-9.]*\).*/\1/p')
    say "exposure of the running unit: $score"
    [ -n "$score" ] && python3 -c "import sys; sys.exit(not float('$score') <= 1.2)"
}
check "systemd-analyze security (running unit) <= 1.2" score_ok

registered() {
    kubelet_event --after "$t_install" --timeout 60 register resource=ate.dev/kvm \
        endpoint=ate.dev-kvm.sock &&
        total_after "$t_install" 4096 &&
        [ -S "$sock" ]
}
must "registered with the kubelet (4096 units)" registered

healthy() {
    if [ "$kvm_ok" = 1 ]; then
        kubelet_event --after "$t_install" --timeout 30 list resource=ate.dev/kvm healthy=4096 >/dev/null
    else
        say "no usable /dev/kvm here: expecting 0 healthy"
        kubelet_event --after "$t_install" --timeout 30 list resource=ate.dev/kvm healthy=0 >/dev/null
    fi
}
check "device health matches /dev/kvm (KVM probe under DevicePolicy=closed)" healthy

status_line() {
    wait_for 30 sh -c "systemctl status --no-pager $unit | grep -q '^ *Status: \"'" &&
        systemctl status --no-pager "$unit" | grep '^ *Status: "' >&2
}
check "systemctl status shows the STATUS line" status_line

journal_fields() {
    journal_record --timeout 30 ATE_RESOURCE=ate.dev/kvm ATE_EVENT=registered >/dev/null
}
check "journalctl -o json carries ATE_RESOURCE and ATE_EVENT" journal_fields

no_filter_line() {  # the monitor opened (kernel uevents: no udevd in here), and the filter went on it
    journalctl -u "$unit" -o cat | grep -qF "following kernel uevents instead" &&
        ! journalctl -u "$unit" -o cat | grep -F -e "no socket filter for KVM's VM announcements" \
            -e "cannot open a udev netlink monitor" >&2
}
check "socket filter for KVM's VM announcements in place under the hardened unit" no_filter_line

metrics_written() {
    wait_for 30 grep -qxF 'ate_devplugd_registered{resource="ate.dev/kvm"} 1' "$metrics_file" &&
        [ "$(stat -c %a "$metrics_file")" = 644 ]
}
check "metrics file for node_exporter written under the hardened unit (0644)" metrics_written

# ---- reload ------------------------------------------------------------------------------------
cp -a "$conf" /run/config.toml.orig
reload_applies() {
    local pid t c
    pid=$(prop MainPID); t=$(now); c=$(cursor)
    set_count 8
    systemctl reload "$unit" &&
        total_after "$t" 8 &&
        journal_record --after-cursor "$c" --timeout 30 ATE_EVENT=reload >/dev/null &&
        wait_for 30 is_running && expect_prop MainPID "$pid"
}
check "systemctl reload applies a changed count" reload_applies

cdi_written() {
    printf 'cdi = true\n' >>"$conf"
    systemctl reload "$unit" &&
        wait_for 30 test -s "$cdi_spec" &&
        grep -q '"cdiVersion": "0.3.0"' "$cdi_spec" && grep -q '"fileMode": 438' "$cdi_spec" &&
        [ "$(stat -c %a "$cdi_spec")" = 644 ] && cat "$cdi_spec" >&2
}
check "cdi = true: the CDI spec is written to /run/cdi under the hardened unit" cdi_written

# The runtime's CRI socket at containerd's usual path (runtime_socket's default): the sandbox must let
# the daemon ask it; a reload asks again, and a runtime that ignores CDI is a warning and a STATUS part.
runtime_asked() {
    local c; c=$(cursor)
    systemd-run --unit=fake-runtime --collect -p KillSignal=SIGTERM \
        -E PYTHONPATH="$pythonpath" -E PYTHONUNBUFFERED=1 \
        python3 "$share/tests/fakes/cri.py" --socket /run/containerd/containerd.sock --enable-cdi false &&
        wait_for 30 test -S /run/containerd/containerd.sock &&
        systemctl reload "$unit" &&
        journal_record --after-cursor "$c" --timeout 30 ATE_EVENT=cdi-not-applied >/dev/null &&
        wait_for 30 sh -c "systemctl show -P StatusText $unit | grep -q 'cdi: containerd 1.7.24~ds1 ignores CDI (enable_cdi = false)'" &&
        systemctl show -P StatusText "$unit" >&2
}
check "the runtime's CRI socket answers the sandboxed daemon: cdi-not-applied, STATUS" runtime_asked

# The file has cdi = true and leaves container_mode to its default: compared by value with the config the
# daemon's record holds, nothing differs (no "config file" warning, probe silent on stderr).
doctor_says() {
    local out rc err
    out=$(ate-devplugd doctor --json); rc=$?
    printf '%s\n' "$out" >&2
    err=$(ate-devplugd probe 2>&1 >/dev/null)
    [ -z "$err" ] || { say "probe on the untouched file says: $err"; return 1; }
    [ "$rc" = 1 ] &&
        printf '%s' "$out" | python3 -c '
import json, sys
doc = json.load(sys.stdin)
checks = {c["check"]: c for c in doc["checks"]}
assert checks["daemon"]["level"] == "OK", checks["daemon"]
assert "config file" not in checks, checks["config file"]
assert checks["switch-mode"]["level"] == "OK", checks["switch-mode"]
assert checks["socket ate.dev/kvm"]["level"] == "OK", checks["socket ate.dev/kvm"]
assert checks["registered ate.dev/kvm"]["level"] == "OK", checks["registered ate.dev/kvm"]
assert checks["runtime cdi"]["level"] == "FAIL", checks["runtime cdi"]
assert "enable_cdi = true" in checks["runtime cdi"]["remedy"]
'
}
check "ate-devplugd doctor --json: daemon, socket and registration OK, the untouched file differs in nothing; the runtime FAILs (exit 1)" doctor_says
systemctl stop fake-runtime.service 2>/dev/null

# A broken config: the unit's ExecReload (`ate-devplugd reload`) signals the daemon, which refuses it
# (STATUS ends with "reload refused HH:MM:SS: <first error>"), and waits for that verdict, so `systemctl
# reload` itself fails; the error is in `systemctl status`. probe meanwhile uses the config the daemon
# runs, from its record. A good reload afterwards clears the refusal from STATUS.
reload_refused() {
    local pid c out rc=0 status
    pid=$(prop MainPID); c=$(cursor)
    cp -a "$conf" /run/config.toml.good
    set_count 0
    if out=$(systemctl reload "$unit" 2>&1); then
        say "systemctl reload succeeded with count = 0"; rc=1
    fi
    say "systemctl reload (count = 0): $out"
    printf '%s' "$out" | grep -qF "$unit failed" || { say "systemctl did not say the job failed"; rc=1; }
    journal_record --after-cursor "$c" --timeout 30 ATE_EVENT=reload-failed >/dev/null || rc=1
    wait_for 30 sh -c "${wait_event[*]} journal-text $unit --after-cursor '$c' | grep -q 'config error, keeping the running config: .*count: 0 must be'" ||
        { say "the daemon's error is not in the unit's journal"; rc=1; }
    wait_for 30 sh -c "systemctl show -P StatusText $unit | grep -q ' | reload refused [0-9][0-9]:[0-9][0-9]:[0-9][0-9]: .*count: 0 must be'" ||
        { say "STATUS does not say the reload was refused: $(prop StatusText)"; rc=1; }
    status=$(systemctl status --no-pager --full -n 20 "$unit" 2>&1)
    printf '%s\n' "$status" >&2
    printf '%s' "$status" | grep -q '^ *Status: ".* | reload refused .*count: 0 must be' || rc=1
    printf '%s' "$status" | grep -q 'config error, keeping the running config: .*count: 0 must be' || rc=1
    out=$(ate-devplugd probe 2>&1 >/run/probe.out)
    say "probe on the broken file: $out"; cat /run/probe.out >&2
    printf '%s' "$out" | grep -q "probing the running daemon (pid $pid, device-plugin mode in /var/lib/kubelet/device-plugins, .*; $conf does not load: " ||
        rc=1
    awk '$1 == "ate.dev/kvm" && $3 ~ /\/8$/ { found = 1 } END { exit !found }' /run/probe.out || rc=1
    is_running && expect_prop MainPID "$pid" || rc=1
    cp -a /run/config.toml.good "$conf"
    systemctl reload "$unit" || { say "the good config's reload failed"; rc=1; }
    wait_for 30 sh -c "! systemctl show -P StatusText $unit | grep -q 'reload refused'" ||
        { say "STATUS still says refused after a good reload: $(prop StatusText)"; rc=1; }
    return "$rc"
}
check "broken config: systemctl reload fails with the error in systemctl status, STATUS says refused, probe uses the running config" reload_refused

# A valid file that changes a restart-only key (mode = "dra"; check-config passes it): the daemon refuses
# the reload whole, and `systemctl reload` fails all the same, with the one line that says why in the
# unit's journal and `systemctl status` (systemd shows no output of ExecReload on the terminal, only
# that the job failed). Nothing changed: same process, still device-plugin mode, STATUS says refused.
reload_restart_only() {
    local pid c out rc=0 status
    pid=$(prop MainPID); c=$(cursor)
    cp -a "$conf" /run/config.toml.good
    sed -i 's/^log_level = .*/&\nmode = "dra"/' "$conf"
    grep -qx 'mode = "dra"' "$conf" || { say "mode = \"dra\" not written into $conf"; return 1; }
    ate-devplugd check-config >/dev/null || { say "check-config refused the mode change itself"; rc=1; }
    if out=$(systemctl reload "$unit" 2>&1); then
        say "systemctl reload succeeded with a mode change"; rc=1
    fi
    say "systemctl reload (mode = \"dra\"): $out"
    printf '%s' "$out" | grep -qF "$unit failed" || { say "systemctl did not say the job failed"; rc=1; }
    journal_record --after-cursor "$c" --timeout 30 ATE_EVENT=reload-failed >/dev/null || rc=1
    wait_for 30 sh -c "${wait_event[*]} journal-text $unit --after-cursor '$c' | grep -qF \"mode = 'dra' (running: 'device-plugin')\"" ||
        { say "the daemon's refusal is not in the unit's journal"; rc=1; }
    status=$(systemctl status --no-pager --full -n 20 "$unit" 2>&1)
    printf '%s\n' "$status" >&2
    printf '%s' "$status" | grep -qF "mode = 'dra' (running: 'device-plugin'), [dra] added: change only on restart, so nothing of this reload was applied" ||
        { say "systemctl status does not show why the reload was refused"; rc=1; }
    printf '%s' "$status" | grep -q "^ *Status: \".* | reload refused [0-9][0-9]:[0-9][0-9]:[0-9][0-9]: mode = 'dra'" ||
        { say "STATUS does not say the reload was refused"; rc=1; }
    is_running && expect_prop MainPID "$pid" || rc=1
    out=$(ate-devplugd probe 2>&1 >/dev/null)
    printf '%s' "$out" | grep -qF "probing the running daemon (pid $pid, device-plugin mode in " ||
        { say "the daemon does not run device-plugin mode any more: $out"; rc=1; }
    printf '%s' "$out" | grep -qF "mode = 'dra' (switch-mode to apply)" ||
        { say "probe does not name switch-mode for the file's new mode: $out"; rc=1; }
    cp -a /run/config.toml.good "$conf"
    systemctl reload "$unit" || { say "the good config's reload failed"; rc=1; }
    wait_for 30 sh -c "! systemctl show -P StatusText $unit | grep -q 'reload refused'" ||
        { say "STATUS still says refused after a good reload: $(prop StatusText)"; rc=1; }
    return "$rc"
}
check "restart-only change (mode): systemctl reload fails, the reason in the journal and systemctl status, nothing applied" reload_restart_only

# ---- kubelet restart -----------------------------------------------------------------------------
kubelet_restart() {
    local pid t
    pid=$(prop MainPID); t=$(now)
    # Only the main process: signalling the whole cgroup fails with EIO on some hosts' hybrid
    # hierarchy inside nspawn, and the fake kubelet has no other process.
    systemctl kill --kill-whom=main -s HUP fake-kubelet.service &&
        kubelet_event --after "$t" --timeout 30 restart >/dev/null &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null &&
        kubelet_event --after "$t" --timeout 60 list resource=ate.dev/kvm >/dev/null &&
        wait_for 10 test -S "$sock" && expect_prop MainPID "$pid"
}
check "kubelet restart is followed by re-registration" kubelet_restart

# ---- switch-mode: to DRA mode and back -------------------------------------------------------------
# The node's control plane as a unit of its own (control_plane.py): the API server with this node's Node
# (kubelet's kubeconfig at the [dra] default path), kubelet's DRA plugin watcher on /var/lib/kubelet,
# and kubelet's node-status update, every second, from the fake kubelet's log. The administrator's
# one-time apply is what `dra-manifests --kubelet-credentials` prints; the operator's one-time edit is the
# [dra] table (docs/switching.md). The installed command then moves the node to DRA mode with the
# daemon stopped (the command starts it before it cordons), again (nothing to do), back while a DRA pod
# is left (the drop-in kept, doctor says why), and once that pod is gone removes the drop-in (a restart
# in device-plugin mode, under its own cordon); the conffile, the unit and the Node end as they were.
node_name=pkgtest-node
kubeconfig=/etc/kubernetes/kubelet.conf
driver=kvm.ate.dev
cplog=/run/control-plane.jsonl
dropin_dir=/etc/systemd/system/$unit.d
dropin=$dropin_dir/dra-mode.conf
switch_records=LOGGER=ate_devplugd.commands.switch_move  # switch-mode's journal records (see wait_event.py)
switch_timeout=60
control_plane=(env PYTHONPATH="$pythonpath" python3 "$share/control_plane.py")
cp_event() { "${wait_event[@]}" log "$cplog" "$@"; }
cp_state() { "${control_plane[@]}" state --node "$node_name" --kubeconfig "$kubeconfig" --driver "$driver"; }
cp_pod() { "${control_plane[@]}" pod "$@"; }
doctor_switch() {  # doctor_switch LEVEL TEXT: doctor's switch-mode line has LEVEL and TEXT in its message
    { ate-devplugd doctor --json || true; } | python3 -c '
import json, sys
(line,) = [c for c in json.load(sys.stdin)["checks"] if c["check"] == "switch-mode"]
print(line["level"], line["message"], "--", line["remedy"], file=sys.stderr)
assert line["level"] == sys.argv[1] and sys.argv[2] in line["message"], line
' "$1" "$2"
}
units=$(sed -n 's/^count = \([0-9]*\)$/\1/p' "$conf")
# switch_events CURSOR: switch-mode's ATE_EVENTs after CURSOR, in order, on one line.
switch_events() {
    "${wait_event[@]}" journal "$switch_records" --after-cursor "$1" --timeout 10 ATE_EVENT=switch-done >/dev/null
    "${wait_event[@]}" journal-text "$switch_records" --after-cursor "$1" --field ATE_EVENT | paste -sd ' '
}
expect_events() {  # expect_events CURSOR EVENT...
    local got; got=$(switch_events "$1"); shift
    [ "$got" = "$*" ] || { say "switch-mode's events: $got; expected: $*"; return 1; }
}
# mode_line_only BEFORE AFTER MODE: AFTER is BEFORE with its mode line set to MODE; where BEFORE had none,
# the line switch-mode adds (marked, with a blank line after it), and on the way back that line gone
# again; every other byte the same.
added='mode = "dra"  # added by ate-devplugd switch-mode'
mode_line_only() {
    local out
    out=$(diff "$1" "$2")
    printf '%s\n' "$out" | sed 's/^/  conffile: /' >&2
    if [ "$3" = device-plugin ] && ! grep -q '^mode *=' "$2"; then
        ! printf '%s\n' "$out" | grep '^[<>]' | grep -v -x -e "< $added" -e '< ' >&2
        return
    fi
    grep -qE "^mode = \"$3\"( .*)?$" "$2" &&
        ! printf '%s\n' "$out" | grep '^[<>]' | grep -v -E -x -e '< mode = ".*' -e "> mode = \"$3\"( .*)?" -e '> ' >&2
}
# move MODE: run the installed switch-mode, its output to stderr, its time to the results (a figure).
move() {
    local start rc=0 secs
    start=$(date +%s.%N)
    ate-devplugd switch-mode "$1" --timeout "$switch_timeout" >/run/switch.out 2>&1 || rc=$?
    secs=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
    sed 's/^/  /' /run/switch.out >&2
    printf '    switch-mode %s: %s s (exit %s)\n' "$1" "$secs" "$rc" | tee -a "$results" >&2
    return "$rc"
}
# cordon_figure MODE T: how long the Node was cordoned by the move to MODE started at T (a figure).
cordon_figure() {
    local secs
    secs=$("${control_plane[@]}" cordoned --log "$cplog" --after "$2") &&
        printf '    switch-mode %s: node cordoned for %s s\n' "$1" "$secs" | tee -a "$results" >&2
}
uncordoned() {
    local state; state=$(cp_state) || return 1
    printf '%s\n' "$state" | sed 's/^/  node: /' >&2
    grep -qx 'unschedulable false' <<<"$state" && grep -qx 'annotations {}' <<<"$state"
}

# DRA mode gives a device only through CDI, and offers it only on the runtime's word that it applies
# CDI names and reads /var/run/cdi: the node's runtime for the moves (containerd with CDI on).
cdi_runtime() {
    systemd-run --unit=fake-runtime --collect -p KillSignal=SIGTERM \
        -E PYTHONPATH="$pythonpath" -E PYTHONUNBUFFERED=1 \
        python3 "$share/tests/fakes/cri.py" --socket /run/containerd/containerd.sock --enable-cdi true &&
        wait_for 30 test -S /run/containerd/containerd.sock
}

start_control_plane() {
    systemd-run --unit=fake-control-plane --collect -p KillSignal=SIGTERM \
        -E PYTHONPATH="$pythonpath" -E PYTHONUNBUFFERED=1 \
        python3 "$share/control_plane.py" serve --node "$node_name" --kubeconfig "$kubeconfig" \
        --kubelet-dir /var/lib/kubelet --kubelet-log "$klog" --log "$cplog" &&
        cp_event --timeout 30 listening >/dev/null &&
        cp_event --timeout 10 node-status >/dev/null &&
        ate-devplugd dra-manifests --kubelet-credentials | "${control_plane[@]}" apply --kubeconfig "$kubeconfig" >&2
}

# The move to DRA with the daemon stopped: the command starts it (and waits for kubelet to hold it)
# before it cordons, then trusts only the new daemon's record and the Node read after it.
to_dra() {
    local pid c t rc=0 state
    cp -a "$conf" /run/config.toml.before-dra
    printf '\n[dra]\nnode_name = "%s"\nkubeconfig = "%s"\nkubelet_dir = "/var/lib/kubelet"\n' \
        "$node_name" "$kubeconfig" >>"$conf"
    ate-devplugd check-config >/dev/null || { say "check-config refused the [dra] table"; return 1; }
    sha256sum <"$conf" >/run/config.sha256
    cp -a "$conf" /run/config.toml.with-dra
    systemctl stop "$unit" || return 1
    pid=$(prop MainPID); c=$(cursor); t=$(now)
    move dra || rc=1
    grep -q "1/6 $unit started (no daemon served the config)" /run/switch.out ||
        { say "switch-mode did not start the stopped daemon first"; rc=1; }
    cordon_figure dra "$t" || rc=1
    mode_line_only /run/config.toml.with-dra "$conf" dra ||
        { say "the conffile changed beyond its mode line"; rc=1; }
    [ "$(readlink "$dropin")" = /usr/share/ate-devplugd/dra-mode.conf ] ||
        { say "$dropin: $(ls -l "$dropin" 2>&1)"; rc=1; }
    { wait_for 30 is_running && [ "$(prop MainPID)" != "$pid" ]; } || { say "not restarted, or not running"; rc=1; }
    prop DropInPaths | tr ' ' '\n' | grep -qx "$dropin" || { say "DropInPaths: $(prop DropInPaths)"; rc=1; }
    expect_prop NeedDaemonReload no || rc=1
    cp_event --after "$t" --timeout 30 node unschedulable=True >/dev/null ||
        { say "the Node was not cordoned"; rc=1; }
    cp_event --after "$t" --timeout 30 dra-registered driver="$driver" >/dev/null || rc=1
    cp_event --after "$t" --timeout 30 slice-added driver="$driver" >/dev/null || rc=1
    # The device-plugin path withheld: registered, every unit unhealthy, so the Node says 0.
    kubelet_event --after "$t" --timeout 30 list resource=ate.dev/kvm healthy=0 total="$units" >/dev/null || rc=1
    state=$(cp_state) || rc=1
    { grep -qx 'allocatable ate.dev/kvm 0' <<<"$state" && grep -qE '^slice [^ ]+ [1-9][0-9]*$' <<<"$state"; } ||
        { say "the Node does not show the DRA path"; rc=1; }
    uncordoned || { say "the Node is still cordoned"; rc=1; }
    expect_events "$c" switch-checked switch-cordon switch-settled switch-applied switch-path switch-done || rc=1
    return "$rc"
}

dra_again() {
    local pid c t rc=0
    pid=$(prop MainPID); c=$(cursor); t=$(now)
    cp -a "$conf" /run/config.toml.dra
    move dra || rc=1
    grep -q 'nothing to do' /run/switch.out || { say "switch-mode did not say there was nothing to do"; rc=1; }
    cmp -s /run/config.toml.dra "$conf" || { say "the conffile changed"; rc=1; }
    { is_running && expect_prop MainPID "$pid"; } || { say "the daemon was restarted"; rc=1; }
    ! cp_event --after "$t" --timeout 0 node unschedulable=True >/dev/null 2>&1 ||
        { say "the Node was cordoned"; rc=1; }
    expect_events "$c" switch-done || rc=1
    return "$rc"
}

# Back to device-plugin mode while a DRA pod is left on the node: the drop-in is kept (the unprepare-only
# driver needs it), and doctor says why.
to_device_plugin() {
    local pid c t rc=0 state
    cp_pod vm-dra || return 1
    pid=$(prop MainPID); c=$(cursor); t=$(now)
    move device-plugin || rc=1
    cordon_figure device-plugin "$t" || rc=1
    mode_line_only /run/config.toml.dra "$conf" device-plugin ||
        { say "the conffile changed beyond its mode line"; rc=1; }
    grep -q "drop-in kept while 1 DRA pod(s) are left" /run/switch.out || { say "the drop-in not said kept"; rc=1; }
    [ -L "$dropin" ] || { say "$dropin not kept for the DRA pod left"; rc=1; }
    { wait_for 30 is_running && [ "$(prop MainPID)" != "$pid" ]; } || { say "not restarted, or not running"; rc=1; }
    cp_event --after "$t" --timeout 30 node unschedulable=True >/dev/null ||
        { say "the Node was not cordoned"; rc=1; }
    kubelet_event --after "$t" --timeout 30 list resource=ate.dev/kvm healthy="$units" total="$units" >/dev/null ||
        rc=1
    cp_event --after "$t" --timeout 30 dra-deregistered driver="$driver" >/dev/null || rc=1
    cp_event --after "$t" --timeout 30 slice-deleted driver="$driver" >/dev/null || rc=1
    state=$(cp_state) || rc=1
    { grep -qx "allocatable ate.dev/kvm $units" <<<"$state" && grep -qx 'slices 0' <<<"$state"; } ||
        { say "the Node does not show the device-plugin path"; rc=1; }
    uncordoned || { say "the Node is still cordoned"; rc=1; }
    expect_events "$c" switch-checked switch-cordon switch-settled switch-applied switch-slice-deleted switch-path \
        switch-done || rc=1
    doctor_switch OK "is kept while 1 DRA pod(s) are left" || rc=1
    return "$rc"
}

# The DRA pod gone: doctor WARNs of the kept drop-in, and the next run removes it (a restart in
# device-plugin mode: the check, its own cordon, kubelet's word and the Node, the uncordon).
dropin_removed() {
    local pid c t rc=0
    cp_pod vm-dra --delete || return 1
    doctor_switch WARN "is kept, but no DRA pod is left" || rc=1
    pid=$(prop MainPID); c=$(cursor); t=$(now)
    move device-plugin || rc=1
    cordon_figure device-plugin "$t" || rc=1
    grep -q "drop-in $dropin removed" /run/switch.out || { say "the drop-in not said removed"; rc=1; }
    { [ ! -e "$dropin" ] && [ ! -L "$dropin" ]; } || { say "$dropin left"; rc=1; }
    { wait_for 30 is_running && [ "$(prop MainPID)" != "$pid" ]; } || { say "not restarted, or not running"; rc=1; }
    ! prop DropInPaths | tr ' ' '\n' | grep -qx "$dropin" || { say "DropInPaths: $(prop DropInPaths)"; rc=1; }
    expect_prop NeedDaemonReload no || rc=1
    kubelet_event --after "$t" --timeout 30 list resource=ate.dev/kvm healthy="$units" total="$units" >/dev/null ||
        rc=1
    uncordoned || { say "the Node is still cordoned"; rc=1; }
    expect_events "$c" switch-checked switch-cordon switch-settled switch-applied switch-path switch-done || rc=1
    doctor_switch OK "no move under way" || rc=1
    return "$rc"
}

nothing_left() {
    local rc=0
    sha256sum --quiet -c /run/config.sha256 <"$conf" >/dev/null 2>&1 || {
        say "the conffile is not as before the first switch (sha256 $(sha256sum <"$conf" | cut -c1-16)," \
            "was $(cut -c1-16 /run/config.sha256)):"
        diff /run/config.toml.with-dra "$conf" >&2
        rc=1
    }
    [ ! -e "$dropin_dir" ] || { say "left in $dropin_dir: $(ls -A "$dropin_dir")"; rc=1; }
    expect_prop NeedDaemonReload no || rc=1
    ! compgen -G "/var/lib/kubelet/plugins_registry/*" >/dev/null ||
        { say "left in kubelet's plugin registry: $(ls /var/lib/kubelet/plugins_registry)"; rc=1; }
    [ ! -e "/var/lib/kubelet/plugins/$driver/dra.sock" ] || { say "the DRA plugin socket is left"; rc=1; }
    uncordoned || rc=1
    return "$rc"
}

without_dra() {  # the conffile as the later checks expect it, and no drop-in, whatever the moves left
    local t; t=$(now)
    cp -a /run/config.toml.before-dra "$conf"
    rm -f "$dropin" && { rmdir "$dropin_dir" 2>/dev/null || true; }
    systemctl daemon-reload && systemctl restart "$unit" && is_running &&
        kubelet_event --after "$t" --timeout 60 list resource=ate.dev/kvm healthy="$units" >/dev/null &&
        systemctl stop fake-control-plane.service fake-runtime.service
}

# The Node's allocatable is the device manager's healthy units: without a usable /dev/kvm there are
# none, and the device-plugin path never shows; the moves are not tried then.
if [ "$kvm_ok" = 1 ]; then
    must "fake control plane serving (API server, DRA plugin watcher, node-status update)" start_control_plane
    must "the node's runtime answering, CDI on" cdi_runtime
    check "switch-mode dra, the daemon stopped: started before the cordon; mode line written, drop-in linked, restarted with it, DRA driver registered and its slice published, uncordoned" \
        to_dra
    check "switch-mode dra again: nothing to do (switch-done), no restart, no cordon" dra_again
    check "switch-mode device-plugin, a DRA pod left: mode line back, drop-in kept (doctor says why), $units units registered, no slice, uncordoned" \
        to_device_plugin
    check "switch-mode device-plugin once the DRA pod is gone (doctor WARNs before): drop-in removed, restarted without it, uncordoned" \
        dropin_removed
    check "switch-mode there and back: the conffile as it was (sha256), no drop-in, no annotation, no daemon-reload pending" \
        nothing_left
    must "the [dra] table removed again: restarted and registered" without_dra
else
    say "no usable /dev/kvm here: switch-mode's moves not tried"
fi

# ---- a bad configuration -------------------------------------------------------------------------
bad_config() {
    local c
    systemctl stop "$unit" || return 1
    set_count 0
    c=$(cursor)
    if systemctl start "$unit"; then say "start succeeded with a bad config"; return 1; fi
    expect_prop ExecMainStatus 78 && expect_prop Result exit-code &&
        expect_prop ActiveState failed && expect_prop SubState failed &&
        expect_prop NRestarts 0 &&
        journal_record --after-cursor "$c" --timeout 30 _PID="$(prop ExecMainPID)" >/dev/null &&
        unit_log "$c" | grep -i 'count' >&2 &&
        [ ! -e "$sock" ]
}
check "bad config: start fails with 78, error in journal, no restart" bad_config

restore() {
    local t; t=$(now)
    cp -a /run/config.toml.orig "$conf"
    systemctl reset-failed "$unit"
    systemctl start "$unit" && is_running &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null
}
check "good config: starts and registers again" restore

# ---- watchdog ----------------------------------------------------------------------------------
watchdog() {
    local pid n c t rc=0
    mkdir -p "/run/systemd/system/$unit.d"
    printf '[Service]\nWatchdogSec=3s\nRestartSec=1s\n' >"/run/systemd/system/$unit.d/50-watchdog-test.conf"
    systemctl daemon-reload && systemctl restart "$unit" && is_running || return 1
    expect_prop WatchdogUSec 3s || return 1
    pid=$(prop MainPID); n=$(prop NRestarts); c=$(cursor); t=$(now)
    # The daemon pings: systemd records a watchdog timestamp after READY=1.
    local ping; ping=$(prop WatchdogTimestampMonotonic)
    wait_for 10 sh -c "[ \"\$(systemctl show -P WatchdogTimestampMonotonic $unit)\" != '$ping' ]" ||
        { say "no watchdog ping seen"; rc=1; }
    kill -STOP "$pid"
    wait_for 30 sh -c "${wait_event[*]} journal-text $unit --after-cursor '$c' | grep -q 'Watchdog timeout'" &&
        wait_for 60 sh -c "${wait_event[*]} journal-text $unit --after-cursor '$c' | grep -q 'status=6/ABRT'" &&
        wait_for 60 sh -c "[ \"\$(systemctl show -P NRestarts $unit)\" = $((n + 1)) ]" &&
        wait_for 30 is_running &&
        [ "$(prop MainPID)" != "$pid" ] && ! kill -0 "$pid" 2>/dev/null &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null || rc=1
    unit_log "$c" | grep -E 'Watchdog|ABRT|Scheduled restart' >&2
    rm -f "/run/systemd/system/$unit.d/50-watchdog-test.conf"
    systemctl daemon-reload
    return "$rc"
}
check "frozen daemon (SIGSTOP): watchdog SIGABRT, then restarted" watchdog

# ---- stop --------------------------------------------------------------------------------------
stop_clean() {
    systemctl stop "$unit" && expect_prop ActiveState inactive && expect_prop Result success &&
        [ ! -e "$sock" ] && ! compgen -G "$plugin_dir/ate.*" >/dev/null && [ ! -e "$metrics_file" ]
}
check "systemctl stop: exit 0, no socket and no metrics file left" stop_clean

# ---- purge -------------------------------------------------------------------------------------
purge() {
    local files rc=0 f
    files=$(dpkg-query -L ate-devplugd | grep -v -E '^/(\.|etc|lib|usr|usr/bin|usr/lib|usr/share|usr/share/doc|usr/share/man|usr/share/man/man[0-9]|usr/lib/systemd|usr/lib/systemd/system|usr/lib/python3|usr/lib/python3/dist-packages|usr/share/lintian|usr/share/lintian/overrides)$')
    local out
    out=$(apt-get purge -y -q ate-devplugd </dev/null 2>&1) || { printf '%s\n' "$out"; return 1; }
    # Debian 13's dpkg warns of a directory of ours it cannot remove (a unit under /lib once did this).
    if grep -i 'not empty' <<<"$out"; then say "purge warned of a directory left not empty"; rc=1; fi
    for f in $files; do
        if [ -e "$f" ] || [ -L "$f" ]; then say "left behind: $f"; rc=1; fi
    done
    for f in /etc/ate-devplugd /etc/systemd/system/multi-user.target.wants/$unit \
             /var/lib/systemd/deb-systemd-helper-enabled/$unit \
             /var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/$unit \
             /usr/lib/python3/dist-packages/ate_devplugd "$sock"; do
        if [ -e "$f" ] || [ -L "$f" ]; then say "left behind: $f"; rc=1; fi
    done
    if dpkg-query -W -f '${db:Status-Status}\n' ate-devplugd 2>/dev/null | grep -qv not-installed; then
        say "still known to dpkg: $(dpkg-query -W -f '${db:Status-Abbrev}' ate-devplugd)"; rc=1
    fi
    [ "$(systemctl show -P LoadState "$unit")" = not-found ] || { say "unit still loaded"; rc=1; }
    return "$rc"
}
check "apt-get purge removes everything" purge

# ---- in place: from the previous version, on a node the daemon serves --------------------------------
# The node as an operator runs it: the previous version installed and registered, an edited conffile
# (CDI on, another count, a comment), the CDI spec and the metrics file written. Then the package under
# test goes over it with apt-get install, back again with a downgrade, and away with remove and purge.
# Each step is one handover (the postinst's): the figures (the handover, kubelet's gap, the time
# allocatable is 0, the pods arriving at $pod_rate/s and how many failed) are printed.
restart_bound=30      # seconds allocatable may stay 0 during one restart; generous, the figure is printed
count_in_place=16
watch_log=/run/file-changes.jsonl
inplace=(python3 "$share/inplace.py")
spec_stat() { python3 -c 'import os, sys; s = os.stat(sys.argv[1]); print(s.st_ino, s.st_mtime_ns)' "$cdi_spec"; }
conffile_kept() {
    grep -q '^# local change kept across upgrades$' "$conf" && grep -q "^count = $count_in_place\$" "$conf" &&
        grep -q '^cdi = true$' "$conf" && ! compgen -G "$conf.dpkg-*" >/dev/null && ! compgen -G "$conf.ucf-*" >/dev/null
}

previous_installed() {
    local t; t=$(now)
    (cd "$share/previous" && apt-get install -y -q ./ate-devplugd_*.deb </dev/null) &&
        say "installed $(dpkg-query -W -f '${Version}' ate-devplugd)" &&
        wait_for 30 is_running &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null
}
must "previous version installed and registered" previous_installed

node_state() {
    local t; t=$(now)
    printf '# local change kept across upgrades\ncdi = true\n' >>"$conf"
    set_count "$count_in_place"
    systemctl reload "$unit" && total_after "$t" "$count_in_place" &&
        wait_for 30 test -s "$cdi_spec" &&
        wait_for 30 grep -qxF 'ate_devplugd_registered{resource="ate.dev/kvm"} 1' "$metrics_file"
}
must "edited conffile (cdi = true, count = $count_in_place) applied: CDI spec and metrics file written" node_state

# in_place WHAT DIR [APT-OPTION...]: apt-get install DIR's package over the running one, then check and
# report what kubelet, systemd and the files saw (inplace.py report).
in_place() {
    local what=$1 dir=$2; shift 2
    local before_version after_version pid spec_before t watcher rc=0 healthy=0
    before_version=$(dpkg-query -W -f '${Version}' ate-devplugd)
    pid=$(prop MainPID); spec_before=$(spec_stat)
    [ "$kvm_ok" = 1 ] && healthy=$count_in_place
    : >"$watch_log"
    "${inplace[@]}" watch "$watch_log" "$(dirname "$cdi_spec")" "$(dirname "$metrics_file")" >/run/watch.out 2>&1 &
    watcher=$!
    wait_for 10 grep -qx watching /run/watch.out || { say "the file watcher did not start"; kill "$watcher"; return 1; }
    t=$(now)
    pods_toggle
    (cd "$share/$dir" && apt-get install -y -q "$@" ./ate-devplugd_*.deb </dev/null) >/run/apt.log 2>&1 ||
        { cat /run/apt.log >&2; pods_toggle; kill "$watcher"; return 1; }
    say "apt-get install took $(awk "BEGIN { printf \"%.1f\", $(now) - $t }") s"
    after_version=$(dpkg-query -W -f '${Version}' ate-devplugd)
    say "$what: $before_version -> $after_version"
    # What kubelet and node_exporter need before the report: the new registration and the new file.
    kubelet_event --after "$t" --timeout 60 list resource=ate.dev/kvm total="$count_in_place" >/dev/null &&
        wait_for 30 grep -qxF 'ate_devplugd_registered{resource="ate.dev/kvm"} 1' "$metrics_file" || rc=1
    pods_toggle
    grep -q 'handed over from pid' /run/apt.log || { say "the postinst did not hand over"; cat /run/apt.log >&2; rc=1; }
    kill "$watcher"; wait "$watcher" 2>/dev/null
    "${inplace[@]}" report --kubelet-log "$klog" --after "$t" --resource ate.dev/kvm --healthy-before "$healthy" \
        --unit "$unit" --old-pid "$pid" --files "$watch_log" --spec "$cdi_spec" --metrics "$metrics_file" \
        --bound "$restart_bound" >/run/report.txt || rc=1
    # The figures go beside the checks in the results (indented: not counted as checks).
    sed "s/^/    $what: /" /run/report.txt | tee -a "$results" >&2
    if [ "$what" = upgrade ]; then
        dpkg --compare-versions "$after_version" gt "$before_version" || { say "not an upgrade"; rc=1; }
    else
        dpkg --compare-versions "$after_version" lt "$before_version" || { say "not a downgrade"; rc=1; }
    fi
    conffile_kept || { say "the edited conffile was not kept as it was"; rc=1; }
    ! grep -qi 'configuration file' /run/apt.log || { say "dpkg asked about the conffile"; rc=1; }
    [ "$(prop MainPID)" != "$pid" ] && is_running || { say "not one running new process"; rc=1; }
    [ "$(spec_stat)" = "$spec_before" ] || { say "CDI spec inode/mtime $spec_before -> $(spec_stat)"; rc=1; }
    [ "$(stat -c %a "$metrics_file")" = 644 ] || rc=1
    return "$rc"
}
check "upgrade in place (apt-get install ./new.deb): one handover, one registration, pods counted, spec and conffile kept" \
    in_place upgrade deb
check "downgrade in place (apt-get install --allow-downgrades): the same" in_place downgrade previous --allow-downgrades

# The same node, a plain restart with pods arriving (what an upgrade cost before handovers), for the figures;
# and a handover whose successor refuses the config: the old daemon serves on, the command says why.
restart_with_pods() {
    local t pid failed arrived; t=$(now); pid=$(prop MainPID)
    pods_toggle
    systemctl restart "$unit" &&
        kubelet_event --after "$t" --timeout 60 list resource=ate.dev/kvm total="$count_in_place" >/dev/null
    pods_toggle
    arrived=$(python3 -c 'import json, sys
t = float(sys.argv[2])
pods = [r for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "pod" and float(r["t"]) > t]
print(len(pods), sum(1 for r in pods if r.get("error")))' "$klog" "$t")
    say "    restart: pods: ${arrived% *} arrived, ${arrived#* } failed (a plain systemctl restart, at $pod_rate/s)"
    printf '    restart: pods: %s arrived, %s failed\n' "${arrived% *}" "${arrived#* }" >>"$results"
    [ "$(prop MainPID)" != "$pid" ] && is_running
}
check "systemctl restart with pods arriving: restarted, pods counted" restart_with_pods

handover_refused() {
    local pid out rc=0
    pid=$(prop MainPID)
    cp -a "$conf" /run/config.toml.good
    set_count 0
    if out=$(ate-devplugd reload --handover 2>&1); then say "a handover with count = 0 succeeded"; rc=1; fi
    say "reload --handover (count = 0): $out"
    printf '%s' "$out" | grep -q "handover failed: the new process (pid [0-9]*) exited 78 before it was ready: config error: .*count: 0" ||
        { say "the command did not say why"; rc=1; }
    is_running && expect_prop MainPID "$pid" || rc=1
    wait_for 30 grep -qxF 'ate_devplugd_registered{resource="ate.dev/kvm"} 1' "$metrics_file" || rc=1
    cp -a /run/config.toml.good "$conf"
    return "$rc"
}
check "a handover whose new process refuses the config: the old daemon serves on, the command says why" handover_refused

remove_keeps_spec() {
    local spec_before t rc=0
    spec_before=$(spec_stat); t=$(now)
    apt-get remove -y -q ate-devplugd </dev/null >/run/apt.log 2>&1 || { cat /run/apt.log >&2; return 1; }
    # shellcheck disable=SC2016 # a dpkg-query format, not a shell expression
    [ "$(dpkg-query -W -f '${db:Status-Status}' ate-devplugd)" = config-files ] || { say "not in config-files"; rc=1; }
    [ "$(systemctl show -P LoadState "$unit")" = not-found ] || { say "unit still loaded"; rc=1; }
    kubelet_event --after "$t" --timeout 30 stream-ended resource=ate.dev/kvm >/dev/null || rc=1
    [ ! -e "$sock" ] && [ ! -e "$metrics_file" ] || { say "socket or metrics file left"; rc=1; }
    [ "$(spec_stat)" = "$spec_before" ] || { say "the CDI spec was removed or rewritten"; rc=1; }
    conffile_kept || { say "remove did not keep the edited conffile"; rc=1; }
    return "$rc"
}
check "apt-get remove: stopped, conffile kept, CDI spec left for the pods that hold it" remove_keeps_spec

purge_after_remove() {
    local f rc=0
    apt-get purge -y -q ate-devplugd </dev/null >/run/apt.log 2>&1 || { cat /run/apt.log >&2; return 1; }
    for f in /etc/ate-devplugd /var/lib/systemd/deb-systemd-helper-enabled/$unit \
             /var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/$unit \
             /usr/lib/python3/dist-packages/ate_devplugd; do
        if [ -e "$f" ] || [ -L "$f" ]; then say "left behind: $f"; rc=1; fi
    done
    if dpkg-query -W -f '${db:Status-Status}\n' ate-devplugd 2>/dev/null | grep -qv not-installed; then
        say "still known to dpkg"; rc=1
    fi
    [ -s "$cdi_spec" ] || { say "purge removed the CDI spec"; rc=1; }
    return "$rc"
}
check "apt-get purge after remove: config gone, the CDI spec stays (removed by hand)" purge_after_remove

finish
