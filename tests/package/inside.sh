#!/bin/bash
# Runs inside the booted Debian 12 or 13 container (started by tests/package/run.sh),
# as a oneshot unit once multi-user.target is reached. /mnt/share holds:
#   deb/ate-devplugd_*.deb   the package under test
#   upgrade/*.deb            the same package rebuilt with a higher version
#   src/                     the project's Python package (for the fake kubelet)
#   fakes/kubelet.py         the fake kubelet
#   wait_event.py            waits for kubelet log events and journal records
# Each check appends "PASS|FAIL name (seconds)" to /mnt/share/results.txt;
# "DONE" is appended last. The container journal goes to /mnt/share/journal.txt.
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
    systemctl stop fake-kubelet.service 2>/dev/null
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
start_kubelet() {
    mkdir -p "$plugin_dir" && chmod 0750 "$plugin_dir"
    systemd-run --unit=fake-kubelet --collect -p KillSignal=SIGTERM \
        -E PYTHONPATH="$share/src" -E PYTHONUNBUFFERED=1 \
        python3 "$share/fakes/kubelet.py" --dir "$plugin_dir" --log "$klog" &&
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

# ---- kubelet restart -----------------------------------------------------------------------------
kubelet_restart() {
    local pid t
    pid=$(prop MainPID); t=$(now)
    systemctl kill -s HUP fake-kubelet.service &&
        kubelet_event --after "$t" --timeout 30 restart >/dev/null &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null &&
        kubelet_event --after "$t" --timeout 60 list resource=ate.dev/kvm >/dev/null &&
        wait_for 10 test -S "$sock" && expect_prop MainPID "$pid"
}
check "kubelet restart is followed by re-registration" kubelet_restart

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
        journalctl -u "$unit" --after-cursor "$c" --no-pager -o cat | grep -i 'count' >&2 &&
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
    wait_for 30 sh -c "journalctl -u $unit --after-cursor '$c' -o cat | grep -q 'Watchdog timeout'" &&
        wait_for 60 sh -c "journalctl -u $unit --after-cursor '$c' -o cat | grep -q 'status=6/ABRT'" &&
        wait_for 60 sh -c "[ \"\$(systemctl show -P NRestarts $unit)\" = $((n + 1)) ]" &&
        wait_for 30 is_running &&
        [ "$(prop MainPID)" != "$pid" ] && ! kill -0 "$pid" 2>/dev/null &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null || rc=1
    journalctl -u "$unit" --after-cursor "$c" -o cat --no-pager | grep -E 'Watchdog|ABRT|Scheduled restart' >&2
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

# ---- upgrade -----------------------------------------------------------------------------------
upgrade() {
    local old_version new_version pid t
    systemctl start "$unit" || return 1
    printf '# local change kept across upgrades\n' >>"$conf"
    set_count 16
    t=$(now)
    systemctl reload "$unit" && total_after "$t" 16 || return 1
    pid=$(prop MainPID); old_version=$(dpkg-query -W -f '${Version}' ate-devplugd)
    t=$(now)
    (cd "$share/upgrade" && apt-get install -y -q ./ate-devplugd_*.deb </dev/null) || return 1
    new_version=$(dpkg-query -W -f '${Version}' ate-devplugd)
    say "upgraded $old_version -> $new_version"
    dpkg --compare-versions "$new_version" gt "$old_version" &&
        grep -q '^# local change kept across upgrades$' "$conf" && grep -q '^count = 16$' "$conf" &&
        [ ! -e "$conf.dpkg-dist" ] && [ ! -e "$conf.dpkg-new" ] &&
        wait_for 30 is_running && [ "$(prop MainPID)" != "$pid" ] &&
        kubelet_event --after "$t" --timeout 60 register resource=ate.dev/kvm >/dev/null &&
        total_after "$t" 16
}
check "upgrade to a higher version keeps the changed conffile and the registration" upgrade

# ---- purge -------------------------------------------------------------------------------------
purge() {
    local files rc=0 f
    files=$(dpkg-query -L ate-devplugd | grep -v -E '^/(\.|etc|lib|usr|usr/bin|usr/lib|usr/share|usr/share/doc|usr/share/man|usr/share/man/man[0-9]|lib/systemd|lib/systemd/system|usr/lib/python3|usr/lib/python3/dist-packages|usr/share/lintian|usr/share/lintian/overrides)$')
    apt-get purge -y -q ate-devplugd </dev/null || return 1
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

finish
