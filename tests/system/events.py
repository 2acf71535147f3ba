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
  events.py count LOG --event E [--since T] [--where KEY=VALUE]...
      Prints how many records match.
  events.py check LOG [--since T]
      Fails on any "register-rejected" or "double-register" (a registration that arrived while the
      previous one's stream of the same resource was still open) at or after T.
  events.py uevents LOG [--source kernel|udev]
      Records the kernel's uevents (netlink, as they arrive, no udevd involved) in LOG as records
      {"t", "event": "uevent", "action", "subsystem", "devname" (as the kernel gives it, without /dev/),
      "devpath", "kvm_event"}; prints
      "listening" once bound, then runs until killed. A step measures from the kernel's event, not from
      a command that caused it (modprobe -r alone takes half a second under the software CPU).
      --source udev records what udevd sends on after its rules instead (libudev's messages).
      "kvm_event" is the EVENT property KVM's VM announcements carry (create, destroy), else "".
  events.py vms NODE N
      Starts and ends N VMs on the kvm node NODE (KVM_CREATE_VM, then the close of the VM's fd): the
      kernel announces each start and end. The first is held until the others, one after another, have
      ended, so that KVM switches the CPUs' virtualisation on once, not for every VM (on the emulated
      x86-64 machine doing that again and again was seen to hang the guest). Prints {"vms": N, "ms": ...}.
  events.py wait ... --where KEY=VALUE
      Also requires the record's KEY to equal VALUE (repeatable), e.g. --where devname=kvm.
  events.py allocate SOCKET
      What kubelet does before it creates a container: the first ListAndWatch message, then a real
      Allocate of one healthy unit, through the installed package's generated stubs; prints
      {"id", "ms" (the Allocate), "devices": [{host_path, container_path, permissions}], "cdi_devices": [...]}.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import struct
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


def cmd_count(args: argparse.Namespace) -> int:
    records, _ = read_records(args.log)
    print(sum(matches(rec, args.event, args.since, None, args.where) for rec in records))
    return 0


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
#: The kernel's own uevents on group 1; udevd re-sends each after its rules on group 2.
GROUPS = {"kernel": 1, "udev": 2}
#: libudev's messages start with this; their properties follow its header (properties_off in it).
LIBUDEV_PREFIX = b"libudev\0"
KVM_CREATE_VM = 0xAE01  # _IO(KVMIO, 0x01): the same number on x86-64 and arm64


def uevent_properties(data: bytes) -> dict[str, str]:
    """KEY=VALUE properties of a kernel uevent ("action@devpath" first) or of a libudev message."""
    if data.startswith(LIBUDEV_PREFIX):
        (start,) = struct.unpack_from("=I", data, 16)  # header: prefix, magic, header_size, properties_off
        items = data[start:].split(b"\0")
    else:
        items = data.split(b"\0")[1:]
    return dict(f.split("=", 1) for f in (i.decode(errors="replace") for i in items) if "=" in f)


def cmd_uevents(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    sock.bind((0, GROUPS[args.source]))
    print("listening", flush=True)
    with args.log.open("a", buffering=1) as out:
        while True:
            data = sock.recv(65536)
            t = time.time()
            fields = uevent_properties(data)
            rec = {
                "t": t,
                "event": "uevent",
                "action": fields.get("ACTION", ""),
                "subsystem": fields.get("SUBSYSTEM", ""),
                "devname": fields.get("DEVNAME", "").removeprefix("/dev/"),  # udevd gives the path
                "devpath": fields.get("DEVPATH", ""),
                "kvm_event": fields.get("EVENT", "") if "CREATED" in fields else "",
            }
            out.write(json.dumps(rec, sort_keys=True) + "\n")


def cmd_vms(args: argparse.Namespace) -> int:
    fd = os.open(args.node, os.O_RDWR | os.O_CLOEXEC)
    t = time.monotonic()
    try:
        held = fcntl.ioctl(fd, KVM_CREATE_VM, 0)
        try:
            for _ in range(args.count - 1):
                os.close(fcntl.ioctl(fd, KVM_CREATE_VM, 0))
        finally:
            os.close(held)
    finally:
        os.close(fd)
    print(json.dumps({"vms": args.count, "ms": round((time.monotonic() - t) * 1000)}))
    return 0


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
    n = sub.add_parser("count")
    n.add_argument("log", type=Path)
    n.add_argument("--event", required=True)
    n.add_argument("--since", type=float, default=0.0)
    n.add_argument("--where", action="append", default=[], metavar="KEY=VALUE")
    n.set_defaults(func=cmd_count)
    c = sub.add_parser("check")
    c.add_argument("log", type=Path)
    c.add_argument("--since", type=float, default=0.0)
    c.set_defaults(func=cmd_check)
    u = sub.add_parser("uevents")
    u.add_argument("log", type=Path)
    u.add_argument("--source", choices=sorted(GROUPS), default="kernel")
    u.set_defaults(func=cmd_uevents)
    v = sub.add_parser("vms")
    v.add_argument("node")
    v.add_argument("count", type=int)
    v.set_defaults(func=cmd_vms)
    al = sub.add_parser("allocate")
    al.add_argument("socket")
    al.add_argument("--timeout", type=float, default=30.0)
    al.set_defaults(func=cmd_allocate)
    args = ap.parse_args(argv)
    if args.cmd in ("wait", "count"):
        args.where = where_pairs(args.where)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
