#!/usr/bin/env python3
"""Wait on and check the fake kubelet's event log (JSON lines) from the guest test.

Every record has "t" (time.time() in the guest) and "event"; register, register-rejected, list and
stream-ended records also have "resource", list records have "healthy", "total" and "ids_digest".

  events.py wait LOG --since T --event E [--resources A,B] [--health full|zero|degraded] [--timeout S]
      Waits until, for every resource, an event E at or after T matches; prints one JSON object
      {"t": latest matching t, "latency_ms": ..., "events": {resource: record}}. Exit 1 on timeout,
      with what was last seen per resource on stderr.
  events.py last LOG --event E --resource R
      Prints the last matching record (JSON) or exits 1.
  events.py check LOG [--since T]
      Fails on any "register-rejected" or "double-register" (a registration that arrived while the
      previous one's stream of the same resource was still open) at or after T.
  events.py uevents LOG
      Records the kernel's uevents (netlink, as they arrive, no udevd involved) in LOG as records
      {"t", "event": "uevent", "action", "subsystem", "devname", "devpath"}; prints "listening" once
      bound, then runs until killed. A step measures from the kernel's event, not from a command that
      caused it (modprobe -r alone takes half a second under the software CPU).
  events.py wait ... --where KEY=VALUE
      Also requires the record's KEY to equal VALUE (repeatable), e.g. --where devname=kvm.
  events.py allocate SOCKET
      What kubelet does before it creates a container: the first ListAndWatch message, then a real
      Allocate of one healthy unit, through the installed package's generated stubs; prints
      {"id", "ms" (the Allocate), "devices": [{host_path, container_path, permissions}], "cdi_devices": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # beside the fakes/ directory
from fakes.filewait import DirWatch

Record = dict[str, Any]


def read_records(path: Path, offset: int = 0) -> tuple[list[Record], int]:
    """Complete JSON lines from byte offset on, and the offset after the last complete line."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"events: unreadable line: {line!r}", file=sys.stderr)
    return records, offset + end


def health_ok(rec: Record, health: str | None) -> bool:
    if health is None:
        return True
    healthy, total = rec.get("healthy"), rec.get("total")
    if not isinstance(healthy, int) or not isinstance(total, int):
        return False
    if health == "full":
        return total > 0 and healthy == total
    if health == "zero":
        return total > 0 and healthy == 0
    if health == "degraded":
        return healthy != total
    raise ValueError(health)


def matches(rec: Record, event: str, since: float, health: str | None, where: dict[str, str]) -> bool:
    return (
        rec.get("event") == event
        and float(rec.get("t", 0)) >= since
        and health_ok(rec, health)
        and all(str(rec.get(k)) == v for k, v in where.items())
    )


def cmd_wait(args: argparse.Namespace) -> int:
    resources = [r for r in args.resources.split(",") if r] if args.resources else [None]
    deadline = time.monotonic() + args.timeout
    with DirWatch(args.log.resolve().parent) as watch:
        return wait_loop(args, resources, watch, deadline)


def wait_loop(args: argparse.Namespace, resources: list[str | None], watch: DirWatch, deadline: float) -> int:
    found: dict[str | None, Record] = {}
    seen: dict[str | None, Record] = {}
    offset = 0
    while True:
        records, offset = read_records(args.log, offset)
        for rec in records:
            for res in resources:
                if res in found or (res is not None and rec.get("resource") != res):
                    continue
                if rec.get("event") == args.event and float(rec.get("t", 0)) >= args.since:
                    seen[res] = rec
                if matches(rec, args.event, args.since, args.health, args.where):
                    found[res] = rec
        if len(found) == len(resources):
            t = max(float(r["t"]) for r in found.values())
            out = {
                "t": t,
                "latency_ms": round((t - args.since) * 1000),
                "events": {str(k): v for k, v in found.items()},
            }
            print(json.dumps(out, sort_keys=True))
            return 0
        if time.monotonic() >= deadline:
            for res in resources:
                if res not in found:
                    last = seen.get(res)
                    print(
                        f"events: no {args.event} ({args.health or 'any'}) for {res} after "
                        f"{args.since:.3f} within {args.timeout} s; last such event: "
                        f"{json.dumps(last) if last else 'none'}",
                        file=sys.stderr,
                    )
            return 1
        watch.wait(deadline - time.monotonic())


def cmd_last(args: argparse.Namespace) -> int:
    records, _ = read_records(args.log)
    for rec in reversed(records):
        if rec.get("event") == args.event and rec.get("resource") == args.resource:
            print(json.dumps(rec, sort_keys=True))
            return 0
    return 1


def cmd_check(args: argparse.Namespace) -> int:
    records, _ = read_records(args.log)
    problems = [
        f"{rec['event']}: {json.dumps(rec, sort_keys=True)}"
        for rec in records
        if rec.get("event") in ("double-register", "register-rejected") and float(rec["t"]) >= args.since
    ]
    for p in problems:
        print(f"events: {p}", file=sys.stderr)
    return 1 if problems else 0


NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1  # the kernel's own uevents; udevd re-sends processed ones on group 2


def cmd_uevents(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.bind((0, KERNEL_GROUP))
    print("listening", flush=True)
    with args.log.open("a", buffering=1) as out:
        while True:
            data = sock.recv(65536)
            t = time.time()
            fields = dict(f.split("=", 1) for f in data.decode(errors="replace").split("\0")[1:] if "=" in f)
            rec = {
                "t": t,
                "event": "uevent",
                "action": fields.get("ACTION", ""),
                "subsystem": fields.get("SUBSYSTEM", ""),
                "devname": fields.get("DEVNAME", ""),
                "devpath": fields.get("DEVPATH", ""),
            }
            out.write(json.dumps(rec, sort_keys=True) + "\n")


def cmd_allocate(args: argparse.Namespace) -> int:
    import grpc  # the guest's python3-grpcio, and the stubs of the package under test

    from ate_devplugd._pb import api_pb2, api_pb2_grpc

    with grpc.insecure_channel(f"unix://{args.socket}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        call = stub.ListAndWatch(api_pb2.Empty(), timeout=args.timeout)
        first = next(call)
        call.cancel()
        healthy = [d.ID for d in first.devices if d.health == "Healthy"]
        if not healthy:
            print(f"events: no healthy unit on {args.socket}", file=sys.stderr)
            return 1
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=healthy[:1])]
        )
        t = time.monotonic()
        (answer,) = stub.Allocate(request, timeout=args.timeout).container_responses
        out = {
            "id": healthy[0],
            "ms": round((time.monotonic() - t) * 1000, 1),
            "devices": [
                {"host_path": d.host_path, "container_path": d.container_path, "permissions": d.permissions}
                for d in answer.devices
            ],
            "cdi_devices": [d.name for d in answer.cdi_devices],
        }
    print(json.dumps(out, sort_keys=True))
    return 0


def where_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--where wants KEY=VALUE, not {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("log", type=Path)
    w.add_argument("--since", type=float, required=True)
    w.add_argument("--event", required=True)
    w.add_argument("--resources", default="")
    w.add_argument("--health", choices=["full", "zero", "degraded"])
    w.add_argument("--timeout", type=float, default=30.0)
    w.add_argument("--where", action="append", default=[], metavar="KEY=VALUE")
    w.set_defaults(func=cmd_wait)
    la = sub.add_parser("last")
    la.add_argument("log", type=Path)
    la.add_argument("--event", required=True)
    la.add_argument("--resource", required=True)
    la.set_defaults(func=cmd_last)
    c = sub.add_parser("check")
    c.add_argument("log", type=Path)
    c.add_argument("--since", type=float, default=0.0)
    c.set_defaults(func=cmd_check)
    u = sub.add_parser("uevents")
    u.add_argument("log", type=Path)
    u.set_defaults(func=cmd_uevents)
    al = sub.add_parser("allocate")
    al.add_argument("socket")
    al.add_argument("--timeout", type=float, default=30.0)
    al.set_defaults(func=cmd_allocate)
    args = ap.parse_args(argv)
    if args.cmd == "wait":
        args.where = where_pairs(args.where)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
