#!/usr/bin/python3
"""Wait for an event in the fake kubelet's JSON-lines log, or for a journal record.

    wait_event.py kubelet LOG [--after T] [--timeout S] EVENT [KEY=VALUE ...]
    wait_event.py journal UNIT [--after-cursor C] [--timeout S] [FIELD=VALUE ...]

The first record that matches (every KEY=VALUE equal to the record's value, as
text) is printed as JSON and the exit status is 0; after the timeout the
status is 1 and the last records read are printed to stderr. Only the standard
library is used, so it runs with any python3.
"""

import argparse
import json
import subprocess
import sys
import time


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


def read_journal(unit: str, cursor: str | None) -> list[dict]:
    cmd = ["journalctl", "--no-pager", "-o", "json", "-u", unit]
    if cursor:
        cmd += ["--after-cursor", cursor]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


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

    deadline = time.monotonic() + args.timeout
    records: list[dict] = []
    while True:
        if args.source == "kubelet":
            records = read_kubelet(args.where, args.after)
        else:
            records = read_journal(args.where, args.after_cursor)
        for record in records:
            if matches(record, wanted):
                print(json.dumps(record))
                return 0
        if time.monotonic() >= deadline:
            print(f"no record matching {wanted} within {args.timeout:g}s; last records:", file=sys.stderr)
            for record in records[-10:]:
                print("  " + json.dumps(record)[:300], file=sys.stderr)
            return 1
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
