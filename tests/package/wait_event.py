#!/usr/bin/python3
"""Wait for an event in the fake kubelet's JSON-lines log, or for a journal record.

    wait_event.py kubelet LOG [--after T] [--timeout S] EVENT [KEY=VALUE ...]
    wait_event.py journal UNIT [--after-cursor C] [--timeout S] [FIELD=VALUE ...]

The first record that matches (every KEY=VALUE equal to the record's value, as
text) is printed as JSON and the exit status is 0; after the timeout the
status is 1 and the last records read are printed to stderr. Only the standard
library is used, so it runs with any python3. It runs from the test's share,
beside the fakes/ directory: the log is re-read when inotify says its directory
changed, and the journal is followed by journalctl --follow.
"""

import argparse
import json
import os
import select
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakes.filewait import DirWatch


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


def follow_journal(unit: str, cursor: str | None, wanted: dict[str, str], timeout: float) -> int:
    cmd = ["journalctl", "--no-pager", "--no-tail", "--follow", "-o", "json", "-u", unit]
    if cursor:
        cmd += ["--after-cursor", cursor]
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", choices=["kubelet", "journal"])
    parser.add_argument("where", help="kubelet log file, or unit name")
    parser.add_argument("--after", type=float, default=0.0, help="kubelet records after this time")
    parser.add_argument("--after-cursor", help="journal records after this cursor")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("match", nargs="*", help="EVENT (kubelet only), then KEY=VALUE ...")
    args = parser.parse_intermixed_args()

    terms = list(args.match)
    wanted: dict[str, str] = {}
    if args.source == "kubelet":
        if not terms:
            parser.error("kubelet needs an EVENT")
        wanted["event"] = terms.pop(0)
    for term in terms:
        key, sep, value = term.partition("=")
        if not sep:
            parser.error(f"not KEY=VALUE: {term}")
        wanted[key] = value

    if args.source == "kubelet":
        return wait_kubelet(args.where, args.after, wanted, args.timeout)
    return follow_journal(args.where, args.after_cursor, wanted, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
