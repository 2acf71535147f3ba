"""A service manager as systemd is toward one ``Type=notify`` service with ``NotifyAccess=main``.

    python3 servicemanager.py --notify SOCKET -- COMMAND [ARG]...

It starts COMMAND with ``NOTIFY_SOCKET`` set and follows it as systemd follows a unit's main process:

- it is the service's subreaper (``PR_SET_CHILD_SUBREAPER``): a process of the service whose parent ends
  is re-parented here, and reaped here, as systemd's cgroup keeps it;
- it reads the notify socket with the sender's credentials: a datagram from the main process is taken,
  one from any other process refused (``NotifyAccess=main``);
- ``MAINPID=<pid>`` from the main process makes ``pid`` the main process if it is alive and a process of
  the service (a descendant of this one), and is refused otherwise;
- when the main process exits, every other process of the service is killed (``KillMode=control-group``)
  and this one exits with the main process's status; SIGTERM and SIGINT go to the main process.

One JSON line per event on stdout, flushed at once: ``{"event": "main"|"notify"|"refused"|"exit", "pid": N,
"fields": {...}, "status": N, "t": CLOCK_MONOTONIC}``. It blocks in one ``select`` loop of its own, so
that a test's event loop never inherits the service's processes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
_CRED = struct.Struct("3i")


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor``'s descendant (its parent chain in /proc reaches it)."""
    while pid > 1:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if pid == ancestor:
            return True
    return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Manager:
    def __init__(self, notify: str, command: list[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.notify = notify
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(notify)
        self.sock.bind(notify)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        self.proc = subprocess.Popen(command, env={**os.environ, "NOTIFY_SOCKET": notify})
        self.main = self.proc.pid
        say("main", pid=self.main)

    def datagram(self) -> None:
        data, ancillary, _flags, _addr = self.sock.recvmsg(65536, socket.CMSG_SPACE(_CRED.size))
        sender = 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = _CRED.unpack(payload[: _CRED.size])[0]
        fields = dict(line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line)
        if sender != self.main:
            say("refused", pid=sender, fields=fields, why="not the main process")
            return
        new = fields.get("MAINPID", "")
        if new.isdigit() and int(new) != self.main:
            if alive(int(new)) and descends_from(int(new), os.getpid()):
                self.main = int(new)
                say("main", pid=self.main, fields=fields)
            else:
                say("refused", pid=sender, fields=fields, why=f"MAINPID {new} is no process of the service")
        say("notify", pid=sender, fields=fields)

    def reap(self) -> int | None:
        """Reap what ended; the main process's status once it has."""
        ended = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return ended
            if pid == 0:
                return ended
            code = os.waitstatus_to_exitcode(status)
            say("exit", pid=pid, status=code, main=pid == self.main)
            if pid == self.main:
                ended = code

    def run(self) -> int:
        while True:
            readable, _, _ = select.select([self.sock, self.wake_r], [], [])
            if self.sock in readable:
                self.datagram()
            if self.wake_r in readable:
                signals = os.read(self.wake_r, 64)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    if sig in signals:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self.main, sig)
                status = self.reap()
                if status is not None:
                    self.kill_the_rest()
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.notify)
                    return status

    def kill_the_rest(self) -> None:
        """Every process still of the service: killed and reaped (KillMode=control-group)."""
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                for pid in map(int, (task / "children").read_text().split()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        say("killed", pid=pid)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, 0)[0] > 0:
                pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--notify", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return Manager(args.notify, command).run()


if __name__ == "__main__":
    sys.exit(main())
