#!/usr/bin/python3
"""What an in-place upgrade (or downgrade) did to a running node: the figures, and whether they hold.

    inplace.py watch LOG DIR...
        Records every change to a file in the DIRs (created, written, attributes, moved in or out,
        deleted) as JSON lines {"t", "dir", "name", "what": [...]} in LOG. Prints "watching" once the
        watches are in place, then runs until killed.
    inplace.py report --kubelet-log KLOG --after T --resource R --healthy-before N --unit U
                      --old-pid PID --files LOG --spec PATH --metrics PATH --bound S
        Reads what happened after T (the fake kubelet's records; the journal: the unit's records and the
        old daemon's; the recorded file changes), prints the figures as "name: value" lines, and exits
        1 (with the reasons) unless:
          - the old daemon handed over once (its ``handover`` and ``handed-over`` events), the new one
            was ready, and systemd neither stopped nor started the unit (it followed MAINPID=);
          - kubelet saw one new registration of R, and the old stream ended only after the handover
            began (nothing stopped the old daemon earlier, e.g. during the package's unpack);
          - allocatable (R's healthy units as kubelet holds them) was 0 in one window only, inside
            the handover: from the old stream's end (kubelet marks a disconnected plugin's devices
            unhealthy) to the new daemon's first ListAndWatch message, and no longer than S seconds;
          - no pod arriving through kubelet's admission meanwhile (the fake kubelet's ``--pods``) had its
            Allocate cut off by the old stream's end (each that failed is counted, with why);
          - the CDI spec saw no change at all (never deleted, replaced or written);
          - the metrics file is there, written by the new daemon.

Only the standard library is used, so it runs with the container's python3. The kubelet log's "t" and
the journal's realtime stamps are the same clock (the container shares the host's).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.fakes.filewait import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    DirWatch,
)

IN_ATTRIB = 0x00000004
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
CHANGES = {
    IN_CREATE: "created",
    IN_MODIFY: "modified",
    IN_CLOSE_WRITE: "written",
    IN_ATTRIB: "attrib",
    IN_MOVED_FROM: "moved-out",
    IN_MOVED_TO: "moved-in",
    IN_DELETE: "deleted",
    IN_DELETE_SELF: "dir-deleted",
    IN_MOVE_SELF: "dir-moved",
}
#: systemd's catalog ids of the manager's unit messages (systemd/sd-messages.h). A restart job logs
#: "Stopped" and "Started" under the unit; its "Stopping" is not among them, so the stop's start is
#: the daemon's own record of SIGTERM (ATE_EVENT=stopping).
UNIT_STOPPED = "9d1aaa27d60140bd96365438aad20286"
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
Record = dict[str, Any]


def cmd_watch(args: argparse.Namespace) -> int:
    mask = 0
    for bit in CHANGES:
        mask |= bit
    watches = [(d, DirWatch(d, mask)) for d in args.dirs]
    print("watching", flush=True)
    # SIGTERM's default action ends it; every record is a whole line written at once (line-buffered).
    with open(args.log, "a", buffering=1, encoding="utf-8") as out:
        while True:
            ready, _, _ = select.select([w.fd for _, w in watches], [], [])
            t = time.time()
            for directory, watch in watches:
                if watch.fd not in ready:
                    continue
                for mask_bits, name in watch.events():
                    what = [label for bit, label in CHANGES.items() if mask_bits & bit]
                    out.write(json.dumps({"t": t, "dir": directory, "name": name, "what": what}) + "\n")


def read_lines(path: str, after: float) -> list[Record]:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.endswith("\n")]
    return [r for r in records if float(r.get("t", 0)) > after]


def journal(after: float, *match: str) -> list[Record]:
    """This boot's records that match, received after ``after``. Filtered here, not with --after-cursor:
    journalctl 252 with a cursor and a match missed a record that was there."""
    out = subprocess.run(
        ["journalctl", "--no-pager", "-b", "-o", "json", *match],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r for r in records if int(r["__REALTIME_TIMESTAMP"]) / 1e6 > after]


def zero_windows(records: list[Record], resource: str, start_healthy: int) -> list[tuple[float, float | None]]:
    """Spans in which kubelet held 0 healthy units of ``resource``, as its device manager does: a stream
    that ends marks the plugin's devices unhealthy, each ListAndWatch message sets them again."""
    windows: list[tuple[float, float | None]] = []
    healthy = start_healthy
    since: float | None = None
    for rec in records:
        if rec.get("resource") != resource:
            continue
        if rec["event"] == "stream-ended":
            healthy = 0
        elif rec["event"] == "list":
            healthy = int(rec["healthy"])
        else:
            continue
        if healthy == 0 and since is None:
            since = float(rec["t"])
        elif healthy > 0 and since is not None:
            windows.append((since, float(rec["t"])))
            since = None
    if since is not None:
        windows.append((since, None))
    return windows


class Report:
    """Figures ("name: value" lines) and problems (each one fails the report)."""

    def __init__(self) -> None:
        self.figures: list[str] = []
        self.problems: list[str] = []

    def figure(self, name: str, since: float, until: float) -> None:
        self.figures.append(f"{name}: {(until - since) * 1000:.0f} ms")


def check_handover(report: Report, entries: list[Record]) -> tuple[float | None, float | None]:
    """One handover: the old daemon logged its start and its end once, the new one was ready, and systemd
    logged no stop and no start of the unit. Returns when the handover began and when the new one was
    ready."""

    def stamps(field: str, value: str) -> list[float]:
        """When the matching records were sent (the kernel's stamp on the datagram), else received."""
        return [
            float(e.get("_SOURCE_REALTIME_TIMESTAMP", e["__REALTIME_TIMESTAMP"])) / 1e6
            for e in entries
            if e.get(field) == value
        ]

    began, handed = stamps("ATE_EVENT", "handover"), stamps("ATE_EVENT", "handed-over")
    ready = [t for t in stamps("ATE_EVENT", "ready") if began and t > began[0]]
    stopped, started = stamps("MESSAGE_ID", UNIT_STOPPED), stamps("MESSAGE_ID", UNIT_STARTED)
    if len(began) != 1 or len(handed) != 1 or len(ready) != 1 or stopped or started:
        report.problems.append(
            f"handover begun {len(began)} time(s), ended {len(handed)}, the new daemon ready {len(ready)} "
            f"time(s); systemd logged {len(stopped)} stop(s) and {len(started)} start(s) of the unit (a handover "
            "is one of the first three, none of the last two); the journal had: "
            + "; ".join(f"[{e.get('_PID')}] {e.get('MESSAGE', '')[:60]}" for e in entries)
        )
        return (began[0] if began else None), None
    report.figure("handover (asked -> the new daemon ready)", began[0], ready[0])
    return began[0], ready[0]


def check_pods(report: Report, args: argparse.Namespace, kubelet: list[Record]) -> None:
    """The pods that arrived through kubelet's admission: how many, how many failed and why; none may
    have been cut off in flight (its Allocate cancelled as the old stream ended)."""
    pods = [r for r in kubelet if r["event"] == "pod" and r.get("resource") == args.resource]
    failed = [r for r in pods if r.get("error")]
    whys: dict[str, int] = {}
    for r in failed:
        why = str(r["error"]).split(" desc = ")[0]
        whys[why] = whys.get(why, 0) + 1
    report.figures.append(f"pods: {len(pods)} arrived, {len(failed)} failed" + (f" ({whys})" if whys else ""))
    report.problems += [f"a pod's Allocate was cut off: {r['error']}" for r in failed if "CANCELLED" in r["error"]]


def check_kubelet(report: Report, args: argparse.Namespace, kubelet: list[Record], stopping: float | None) -> None:
    """One new registration; allocatable 0 only once, within the restart, and within the bound."""
    mine = [r for r in kubelet if r.get("resource") == args.resource]
    registers = [r for r in mine if r["event"] == "register"]
    ended = [r for r in mine if r["event"] == "stream-ended"]
    report.problems += [
        f"kubelet: {json.dumps(r)}" for r in kubelet if r["event"] in ("double-register", "register-rejected")
    ]
    if len(registers) != 1 or len(ended) != 1:
        report.problems.append(f"kubelet saw {len(registers)} registration(s) and {len(ended)} stream end(s)")
        return
    registered, stream_end = float(registers[0]["t"]), float(ended[0]["t"])
    report.figure("kubelet: old stream ended -> new registration", stream_end, registered)
    report.figure("apt-get install start -> new registration", args.after, registered)
    if stopping is not None and stream_end < stopping:
        report.problems.append("the old daemon's stream ended before the handover began")
    if args.healthy_before == 0:
        report.figures.append("allocatable: 0 before the upgrade (no usable /dev/kvm here), its window not measured")
        return
    windows = zero_windows(kubelet, args.resource, args.healthy_before)
    first_new = next((float(r["t"]) for r in mine if r["event"] == "list" and float(r["t"]) > registered), None)
    if len(windows) != 1 or windows[0][1] is None:
        report.problems.append(f"allocatable was 0 in these windows, not in one that closed: {windows}")
        return
    since, until = windows[0]
    assert until is not None
    report.figure("allocatable 0 for", since, until)
    if until - since > args.bound:
        report.problems.append(f"allocatable 0 for {until - since:.3f} s (bound {args.bound:g} s)")
    if stopping is not None and since < stopping:
        report.problems.append("allocatable dropped to 0 before the handover began")
    if until != first_new:
        report.problems.append("allocatable came back other than with the new daemon's first ListAndWatch message")


def check_files(report: Report, args: argparse.Namespace, changes: list[Record]) -> None:
    """The CDI spec untouched; the metrics file written again by the new daemon."""
    spec_dir, spec_name = os.path.split(args.spec)
    spec_changes = [c for c in changes if c["dir"] == spec_dir and c["name"] in (spec_name, "")]
    report.figures.append(f"CDI spec changes: {len(spec_changes)}")
    report.problems += [f"the CDI spec changed: {json.dumps(c)}" for c in spec_changes]
    metrics_dir, metrics_name = os.path.split(args.metrics)
    metrics = [c for c in changes if c["dir"] == metrics_dir and c["name"] == metrics_name]
    gone = [float(c["t"]) for c in metrics if "deleted" in c["what"]]
    back = [float(c["t"]) for c in metrics if "moved-in" in c["what"]]
    if not back or not os.path.exists(args.metrics):
        report.problems.append("the new daemon did not write the metrics file")
    if gone:
        report.problems.append("the metrics file was removed (a handover's old daemon leaves it to the new one)")


def cmd_report(args: argparse.Namespace) -> int:
    report = Report()
    # The old daemon's records by its pid: one that exits right after logging can leave records journald
    # no longer ties to the unit (it reads the unit from the sender's cgroup, gone with the process).
    entries = journal(args.after, "-u", args.unit) + journal(args.after, f"_PID={args.old_pid}")
    began, _ = check_handover(report, list({e["__CURSOR"]: e for e in entries}.values()))
    kubelet = read_lines(args.kubelet_log, args.after)
    check_kubelet(report, args, kubelet, began)
    check_pods(report, args, kubelet)
    check_files(report, args, read_lines(args.files, args.after))
    for line in report.figures:
        print(line)
    for problem in report.problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if report.problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("log")
    w.add_argument("dirs", nargs="+")
    w.set_defaults(func=cmd_watch)
    r = sub.add_parser("report")
    r.add_argument("--kubelet-log", required=True)
    r.add_argument("--after", type=float, required=True)
    r.add_argument("--resource", required=True)
    r.add_argument("--healthy-before", type=int, required=True, help="kubelet's healthy units at T")
    r.add_argument("--unit", required=True)
    r.add_argument("--old-pid", required=True, help="the old daemon's pid")
    r.add_argument("--files", required=True)
    r.add_argument("--spec", required=True)
    r.add_argument("--metrics", required=True)
    r.add_argument("--bound", type=float, required=True, help="seconds allocatable may stay 0")
    r.set_defaults(func=cmd_report)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
