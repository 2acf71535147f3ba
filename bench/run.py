"""Benchmark ate-devplugd on both runtimes and print one table, each figure beside its floor.

    python bench/run.py [--quick] [--out FILE] [--runtime venv|debian|both]

For each runtime (the venv's python with current PyPI releases; /usr/bin/python3 with Debian's
packages) bench/measure.py runs the daemon as a subprocess against a kubelet-like client in a temp
directory, and the floors (bench/floors.py) on the same interpreter. Figures are median / p99 in
milliseconds unless the row says otherwise. Needs root and the kvm misc device. ``--quick`` is a
smoke run: few repetitions, a 2 s idle window; its figures are not to be quoted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RUNTIMES = {
    "venv": REPO / ".venv" / "bin" / "python",
    "debian": Path("/usr/bin/python3"),
}
#: What each watchdog ping costs the main thread at WatchdogSec=30s (a ping every 15 s).
WATCHDOG_WAKEUPS_PER_MIN = 4


def machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "kernel": platform.release(),
        "os": _os_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[0],
    }


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def run_runtime(name: str, python: Path, quick: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH", "")]))
    env["ATE_BENCH_LABEL"] = name
    print(f"== {name}: {python}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="ate-bench-") as tmp:
        # Byte-compiled first, as the package is installed (dh_python3 compiles it): with
        # PYTHONDONTWRITEBYTECODE set and no cache, every start would compile the daemon's modules again.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        subprocess.run(
            [str(python), "-m", "compileall", "-q", str(REPO / "src"), str(REPO / "tests"), str(BENCH)],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        out = Path(tmp) / "results.json"
        cmd = [str(python), str(BENCH / "measure.py"), "--out", str(out)]
        if quick:
            cmd.append("--quick")
        subprocess.run(cmd, env=env, check=True, timeout=600)
        return dict(json.loads(out.read_text()))


# -- the table -----------------------------------------------------------------------------------


def _ms(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def pair(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    return f"{_ms(stats['median_ms'])} / {_ms(stats['p99_ms'])}"


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, value, floor, target) for one runtime."""
    floor = r["floor"]
    law = r["list_and_watch"]
    idle = r["idle"]
    wake = idle["wakeups_per_min"]
    grpc_wake = sum(v for k, v in wake.items() if k != "main")
    window = idle["slices"]["total"] * idle["slices"]["of_s"]
    floor_idle = floor["idle_grpc_server"]
    floor_wake = sum(v for k, v in floor_idle["wakeups_per_min"].items() if k != "main")
    load = r["load"]
    rss = floor["rss_kib"]
    start_floor = floor.get("start_registered", floor["imports_ready"])
    out = [
        ("start -> READY=1", pair(r["start"]["ready"]), f"{pair(floor['imports_ready'])} (imports)", "<= 300 (Debian)"),
        (
            "start -> registered (kubelet up)",
            f"{pair(r['start']['registered'])} ({ratio(r['start']['registered'], start_floor)})",
            f"{pair(start_floor)} (imports, a server, Register)",
            "median <= 1.25 x floor",
        ),
        *upgrade_rows(r.get("upgrade"), floor.get("upgrade")),
        ("kubelet restart -> re-registered", pair(r["restart"]), pair(floor["register"]), "p99 <= 10"),
        ("kubelet restart -> device list back", pair(r["restart"].get("listed")), "", ""),
        (
            "device vanishes -> kubelet sees Unhealthy",
            pair(r["uevent"]["unhealthy"]),
            pair(floor["uevent"]),
            "p99 <= 20",
        ),
        ("device returns -> kubelet sees Healthy", pair(r["uevent"]["healthy"]), pair(floor["uevent"]), "p99 <= 20"),
    ]
    for callers in ("1", "16", "64"):
        out.append(
            (
                f"Allocate, {callers} concurrent caller{'s' if callers != '1' else ''}, back to back",
                pair(r["allocate"][callers]),
                pair(floor["allocate"][callers]),
                "p99 <= 1" if callers == "64" else "",
            )
        )
    if "64-open" in r["allocate"]:
        rate = r["allocate"]["64-open"]["offered_calls_per_s"]
        out.append(
            (
                f"Allocate, 64 callers at random, {rate}/s in all",
                pair(r["allocate"]["64-open"]),
                pair(floor["allocate"].get("64-open")),
                "",
            )
        )
    for count in ("4096", "65536"):
        m = law[count]
        out.append(
            (
                f"ListAndWatch message, {count} units: size",
                f"{m['bytes'] / 1024:.0f} KiB",
                "",
                "< 2048 KiB" if count == "65536" else "",
            )
        )
        times = " / ".join(_ms(m[k]["median_ms"]) for k in ("build", "rebuild", "encode") if k in m)
        out.append(("  first build / later builds / encode (median ms)", times, "", ""))
    out += [
        ("RSS after start", mib(r["rss_start_kib"]), f"{mib(rss['import_grpc'])} (import grpc)", ""),
        (
            f"RSS after {load['allocates']} Allocates + {load['kubelet_restarts']} restarts",
            mib(r["rss_loaded_kib"]),
            f"{mib(rss['libraries_and_server'])} (all libraries + a server)",
            "floor + 3.5 MiB",
        ),
    ]
    out += memory_rows(r)
    out += [
        (
            f"idle CPU (ms per minute, quiet slices of {window:.0f} s)",
            _ms(idle["cpu_ms_per_min"]),
            f"0; bare gRPC server {_ms(floor_idle['cpu_ms_per_min'])}",
            "<= 10",
        ),
        ("idle wake-ups per minute: main thread", f"{wake.get('main', 0):.0f}", "4 (watchdog)", "watchdog only"),
        (
            "idle wake-ups per minute: gRPC core threads",
            f"{grpc_wake:.0f}",
            f"0; bare gRPC server {floor_wake:.0f}",
            "",
        ),
    ]
    out += vm_rows(r.get("vm_lifecycles", {}))
    return out


def ratio(stats: dict[str, Any], floor: dict[str, Any]) -> str:
    return f"x{stats['median_ms'] / floor['median_ms']:.2f}" if floor.get("median_ms") else "-"


def upgrade_rows(up: dict[str, Any] | None, floor: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """The upgrade window (old process stopped, new one started, as systemd does it), from the stop
    request, beside the floor's handover (serve-register processes)."""
    if not up or not floor:
        return []
    return [
        *lost_rows(up.get("lost") or {}, floor),
        ("upgrade: stop -> old process gone", pair(up["stopped"]), pair(floor["stopped"]), ""),
        ("upgrade: stop -> new one registered", pair(up["registered"]), pair(floor["registered"]), ""),
        (
            "upgrade: stop -> allocatable back (the window)",
            f"{pair(up['allocatable'])} ({ratio(up['allocatable'], floor['allocatable'])})",
            pair(floor["allocatable"]),
            "",
        ),
    ]


def lost_rows(lost: dict[str, Any], floor: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Per upgrade (a restart as systemd makes it, a handover, a guarded one), pods arriving at a rate: the
    window with no healthy unit (its median), a guarded one's cordon (its median), and the pods that failed
    (mean, most); a handover's window beside the floor's break-before-make one (its stop -> allocatable
    back)."""
    out = []
    for name, v in lost.items():
        target = ""
        if name.startswith("handover") and "10/s" in name:
            target = "<= 1.4 (a tenth of 14 at 10/s, busy)"
        elif name.startswith("guarded"):
            target = "0"
        floor_window = pair(floor["allocatable"]) if name.startswith(("handover", "guarded")) else ""
        value = f"{v['lost_mean']:g} (most {v['lost_max']}) of {v['arrived_mean']:g}; window {_ms(v['window_ms'])}"
        if v.get("cordon_ms"):
            value += f", cordon {_ms(v['cordon_ms'])}"
        out.append((f"upgrade by {name}: pods lost", value, floor_window, target))
    return out


def _over(kib: int, floor: int) -> str:
    return f"{(kib - floor) / 1024:+.1f}"


def memory_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """RSS per mode after start and after load, each over its floor; then the imports group by group."""
    rss = r["floor"]["rss_kib"]
    modes = r.get("rss_by_mode")
    out = []
    if modes:
        plugin_floor, dra_floor = rss["libraries_and_server"], rss["dra_libraries_and_server"]
        for label, start, loaded, floor, floor_label in (
            (
                "device-plugin, metrics on",
                r["rss_start_kib"],
                r["rss_loaded_kib"],
                plugin_floor,
                "libraries + a server",
            ),
            (
                "device-plugin, metrics off",
                modes["metrics_off"]["start_kib"],
                modes["metrics_off"]["loaded_kib"],
                plugin_floor,
                "libraries + a server",
            ),
            (
                f"DRA mode (load: {modes['dra']['claims']} claims)",
                modes["dra"]["start_kib"],
                modes["dra"]["loaded_kib"],
                dra_floor,
                "+ aiohttp, PyYAML",
            ),
        ):
            out.append(
                (
                    f"RSS over floor, start / loaded: {label}",
                    f"{_over(start, floor)} / {_over(loaded, floor)} MiB",
                    f"{mib(floor)} ({floor_label})",
                    "<= 3.5 MiB loaded" if label == "device-plugin, metrics on" else "",
                )
            )
    groups = r["floor"].get("import_groups_kib")
    if groups:
        previous = 0
        for group, kib in groups["dp"].items():
            if group == "prometheus_client":
                continue
            label = f"imports: + {group}" if previous else f"imports: {group}"
            out.append((label, f"{_over(kib, previous)} MiB" if previous else mib(kib), "", ""))
            previous = kib
        dra = list(groups["dra"].items())
        out.append((f"imports: + {dra[-1][0]}", f"{_over(dra[-1][1], dra[-2][1])} MiB", "DRA mode only", ""))
        dp = list(groups["dp"].items())
        out.append(("imports: + prometheus_client", f"{_over(dp[-1][1], dp[-2][1])} MiB", "not loaded", ""))
    return out


def vm_rows(lifecycles: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Daemon CPU and main-thread wake-ups per 1,000 VM lifecycles, beside a quiet window as long."""
    out = []
    for key, label in (("kernel", "kernel uevents"), ("udevd", "udevd")):
        v = lifecycles.get(key)
        if not v or "skipped" in v:
            out.append((f"1,000 VM lifecycles ({label}): daemon CPU ms", "-", "", ""))
            continue
        low, high = v["quiet_cpu_ms_range"]
        out.append(
            (
                f"1,000 VM lifecycles ({label}): daemon CPU ms",
                _ms(v["cpu_ms_per_1000"]),
                f"idle as long ({v['window_s_per_1000']:.1f} s): {_ms(v['quiet_cpu_ms'])} ({_ms(low)}-{_ms(high)})",
                "within noise of idle",
            )
        )
        out.append(
            (
                f"1,000 VM lifecycles ({label}): main-thread wake-ups",
                f"{v['main_wakeups_per_1000']:.0f}",
                f"idle as long: {v['quiet_main_wakeups']:.0f}",
                "",
            )
        )
    return out


def table(results: dict[str, Any]) -> str:
    names = [n for n, r in results["runtimes"].items() if "error" not in r]
    per = {n: rows(results["runtimes"][n]) for n in names}
    head = ["figure (median / p99 ms)"]
    for n in names:
        r = results["runtimes"][n]
        head += [f"{n} (grpcio {r['grpcio']}, protobuf {r['protobuf']})", "floor"]
    head.append("target")
    body = []
    first = per[names[0]] if names else []
    for i, (figure, *_rest) in enumerate(first):
        line = [figure]
        for n in names:
            _, value, floor, _ = per[n][i]
            line += [value, floor]
        line.append(first[i][3])
        body.append(line)
    widths = [max(len(row[c]) for row in [head, *body]) for c in range(len(head))]

    def fmt(row: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)) + " |"

    lines = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt(row) for row in body]
    return "\n".join(lines)


def notes(results: dict[str, Any]) -> str:
    out = []
    m = results["machine"]
    out.append(
        f"machine: {m['cores']} cores, {m['cpu']}, kernel {m['kernel']}, {m['os']}; {results['mode']} run; "
        f"load average {m['loadavg_at_start']} at start"
    )
    for name, r in results["runtimes"].items():
        if "error" in r:
            out.append(f"{name}: not run: {r['error']}")
            continue
        threads = ", ".join(f"{k} {v:.0f}" for k, v in r["idle"]["wakeups_per_min"].items())
        slices = r["idle"]["slices"]
        out.append(
            f"{name}: uevents from {r['uevent']['source']}; idle wake-ups/min by thread: {threads}; "
            f"misc uevents from elsewhere during the idle window: {r['idle']['misc_uevents_seen']} "
            f"(in {slices['with_foreign_uevents']} of {slices['total']} slices of {slices['of_s']:.0f} s, left out: "
            f"{r['idle']['window_s']:.0f} s counted)"
        )
        for key, v in r.get("vm_lifecycles", {}).items():
            if "skipped" in v:
                out.append(f"{name}: VM lifecycles with {key}: skipped: {v['skipped']}")
                continue
            out.append(
                f"{name}: VM lifecycles ({key}, daemon reading {v['source']} events): {v['lifecycles']} VMs in "
                f"{v['rounds']} rounds at {v['vm_per_s']}/s; daemon CPU per 1,000 by round: "
                f"{', '.join(_ms(x) for x in v['busy_cpu_ms_all'])} ms; other kvm uevents meanwhile: "
                f"{v['other_kvm_uevents']}{'; netlink overflow in the bench' if v['lost'] else ''}"
            )
        trace = r.get("idle_strace", {})
        if "syscalls" in trace:
            calls = "; ".join(
                f"{who}: " + ", ".join(f"{s} {c}" for s, c in sorted(per.items()))
                for who, per in trace["syscalls"].items()
            )
            out.append(f"{name}: syscalls in {trace['window_s']:.0f} s idle (strace -f): {calls or 'none'}")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repetitions, short idle window")
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON results (default bench/results.json; build/bench-quick.json with --quick, so a smoke run "
        "never overwrites the figures of a full one)",
    )
    parser.add_argument("--runtime", choices=("venv", "debian", "both"), default="both")
    args = parser.parse_args()
    if args.out is None:
        args.out = REPO / "build" / "bench-quick.json" if args.quick else BENCH / "results.json"
    if os.geteuid() != 0 or not Path("/sys/class/misc/kvm/dev").exists():
        # Like the tests that need them: skipped, not failed, where there is no kvm or no root.
        print("bench: skipped: it needs root (mknod, /sys writes) and the kvm misc device")
        return 0
    chosen = list(RUNTIMES) if args.runtime == "both" else [args.runtime]
    results: dict[str, Any] = {"machine": machine(), "mode": "quick" if args.quick else "full", "runtimes": {}}
    started = time.monotonic()
    failed = False
    for name in chosen:
        python = RUNTIMES[name]
        if not python.exists():
            results["runtimes"][name] = {"error": f"{python} does not exist (make dev)"}
            failed = True
            continue
        try:
            results["runtimes"][name] = run_runtime(name, python, args.quick)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            results["runtimes"][name] = {"error": str(exc)}
            failed = True
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(args.out)
    if any("error" not in r for r in results["runtimes"].values()):
        print(table(results))
    print(notes(results))
    print(f"({results['elapsed_s']:.0f} s; results in {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
