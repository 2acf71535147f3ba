"""Capture what a program sends to journald, without touching a real journal.

Run inside a private mount namespace whose /run/systemd is a fresh tmpfs (see ``capture_command``):
binds the native-protocol datagram socket at /run/systemd/journal/socket, runs the command, forwards
SIGTERM/SIGINT to it, and when it exits writes every record received as a JSON list of field maps.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys

JOURNAL_SOCKET = "/run/systemd/journal/socket"


def parse_native(data: bytes) -> dict[str, str]:
    """One datagram of journald's native protocol: ``KEY=value`` lines, or ``KEY\\n<le64 size><value>\\n``."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        newline = data.index(b"\n", pos)
        line = data[pos:newline]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            pos = newline + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", data, newline + 1)
            start = newline + 1 + 8
            value = data[start : start + size]
            pos = start + size + 1
        fields[key.decode()] = value.decode(errors="replace")
    return fields


def capture_command(out: str, *command: str) -> list[str]:
    """The command line that runs ``command`` with its journal captured into ``out``."""
    setup = "mkdir -p /run/systemd && mount -t tmpfs tmpfs /run/systemd && mkdir /run/systemd/journal"
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{setup} && exec "$@"',
        "sh",
        sys.executable,
        os.path.abspath(__file__),
        out,
        "--",
        *command,
    ]


def main() -> int:
    out, sep, *command = sys.argv[1:]
    assert sep == "--"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(JOURNAL_SOCKET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    records = []
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            records.append(parse_native(sock.recv(1 << 20)))
        elif child.poll() is not None:
            break
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(records, fh)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
