#!/usr/bin/python3
"""Wait for an event in a fake's JSON-lines log, or for a journal record.

    wait_event.py kubelet LOG [--after T] [--timeout S] EVENT [KEY=VALUE ...]
    wait_event.py log LOG [--after T] [--timeout S] EVENT [KEY=VALUE ...]
    wait_event.py journal UNIT [--after-cursor C] [--timeout S] [FIELD=VALUE ...]
    wait_event.py journal-text UNIT --after-cursor C [--field FIELD]


The first record that matches (every KEY=VALUE equal to the record's value, as
text) is printed as JSON and the exit status is 0; after the timeout the
status is 1 and the last records read are printed to stderr. Only the standard
library is used, so it runs with any python3. It runs from the test's share,
beside tests/fakes/: the log is re-read when inotify says its directory
changed, and the journal is followed by journalctl --follow. "log" reads any
fake's log of that form (the fake kubelet's, the fake control plane's: a "t"
and an "event" per line), as "kubelet" does. journal-text prints the messages
(or the FIELD) of the unit's records after the cursor, one per line.

The unit's records are picked here, never with journalctl's own matches: with
a cursor and a match (-u UNIT, or _SYSTEMD_UNIT=UNIT), journalctl 252 (Debian
12) skipped a record that was there and that the unfiltered output showed.
"""

import argparse
import json
import os
import select
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.fakes.filewait import DirWatch


def matches(record: dict, wanted: dict[str, str]) -> bool:
    return all(key in record and str(record[key]) == value for key, value in wanted.items())


def read_kubelet(path: str, after: float) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        if not line.endswith("\n"):
            break  # a record still being written
        record = json.loads(line)
        if record.get("t", 0) > after:
            records.append(record)
    return records


def of_unit(record: dict, unit: str) -> bool:
    """What journalctl -u shows: the unit's own processes, and systemd's messages about the unit. UNIT may
    be FIELD=VALUE instead: the records with that field (a command that exits right after logging can
    leave records journald no longer ties to its unit: it reads the unit from the sender's cgroup)."""
    field, sep, value = unit.partition("=")
    if sep:
        return record.get(field) == value
    return record.get("_SYSTEMD_UNIT") == unit or (record.get("_PID") == "1" and record.get("UNIT") == unit)


def journal_cmd(cursor: str | None, *extra: str) -> list[str]:
    cmd = ["journalctl", "--no-pager", "-o", "json", *extra]
    return [*cmd, "--after-cursor", cursor] if cursor else cmd


def follow_journal(unit: str, cursor: str | None, wanted: dict[str, str], timeout: float) -> int:
    cmd = journal_cmd(cursor, "--no-tail", "--follow") if cursor else journal_cmd(None, "-b", "--no-tail", "--follow")
    deadline = time.monotonic() + timeout
    records: list[dict] = []
    pending = b""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # journalctl ended
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if not line.startswith(b"{"):
                        continue
                    record = json.loads(line)
                    if not of_unit(record, unit):
                        continue
                    records.append(record)
                    if matches(record, wanted):
                        print(json.dumps(record))
                        return 0
        finally:
            proc.kill()
    return timed_out(wanted, timeout, records)


def wait_kubelet(path: str, after: float, wanted: dict[str, str], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    with DirWatch(os.path.dirname(os.path.abspath(path))) as watch:
        while True:
            records = read_kubelet(path, after)
            for record in records:
                if matches(record, wanted):
                    print(json.dumps(record))
                    return 0
            if not watch.wait(deadline - time.monotonic()):
                return timed_out(wanted, timeout, read_kubelet(path, after))


def timed_out(wanted: dict[str, str], timeout: float, records: list[dict]) -> int:
    print(f"no record matching {wanted} within {timeout:g}s; last records:", file=sys.stderr)
    for record in records[-10:]:
        print("  " + json.dumps(record)[:300], file=sys.stderr)
    return 1


def journal_text(unit: str, cursor: str | None, field: str = "MESSAGE") -> int:
    out = subprocess.run(journal_cmd(cursor, "-b"), check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if of_unit(record, unit) and isinstance(record.get(field), str):
                print(record[field])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", choices=["kubelet", "log", "journal", "journal-text"])
    parser.add_argument("where", help="a fake's log file, or unit name (or FIELD=VALUE: see of_unit)")
    parser.add_argument("--after", type=float, default=0.0, help="log records after this time")
    parser.add_argument("--after-cursor", help="journal records after this cursor")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--field", default="MESSAGE", help="journal-text: the field printed")
    parser.add_argument("match", nargs="*", help="EVENT (a log only), then KEY=VALUE ...")
    args = parser.parse_intermixed_args()

    if args.source == "journal-text":
        return journal_text(args.where, args.after_cursor, args.field)
    terms = list(args.match)
    wanted: dict[str, str] = {}
    if args.source in ("kubelet", "log"):
        if not terms:
            parser.error(f"{args.source} needs an EVENT")
        wanted["event"] = terms.pop(0)
    for term in terms:
        key, sep, value = term.partition("=")
        if not sep:
            parser.error(f"not KEY=VALUE: {term}")
        wanted[key] = value

    if args.source in ("kubelet", "log"):
        return wait_kubelet(args.where, args.after, wanted, args.timeout)
    return follow_journal(args.where, args.after_cursor, wanted, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
