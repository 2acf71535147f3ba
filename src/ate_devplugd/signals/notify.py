"""sd_notify without blocking: READY, STATUS, RELOADING, STOPPING, MAINPID and watchdog pings to systemd.

The notify socket is a datagram socket whose reader can stall (the kernel queues ten datagrams per
socket by default); a blocking send would then freeze the one event loop, and with it registration and
Allocate. So messages are sent without blocking. When the queue is full they wait until the socket is
writable (the loop watches it), merged: a later STATUS replaces an earlier one still waiting, while a
state change (READY, RELOADING, STOPPING) keeps its own datagram and its place.

Outside systemd (``NOTIFY_SOCKET`` unset) every call is a no-op, so the daemon runs the same in a
terminal, a test or a unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time

from ate_devplugd.base.logs import EventLog

log = logging.getLogger(__name__)

#: Keys that only describe the state: a later value replaces an earlier one still waiting.
_MERGEABLE = frozenset({"STATUS", "WATCHDOG"})


def notify_address(environ: dict[str, str] | None = None) -> str | None:
    """The socket address in ``NOTIFY_SOCKET`` (``@name`` is abstract), or None if unset or unusable."""
    value = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if value.startswith("@"):
        return "\0" + value[1:]
    return value if value.startswith("/") else None


def watchdog_interval(environ: dict[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or None if not asked for this process."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 2 / 1_000_000


class Notifier:
    """Sends sd_notify messages to ``address`` (None: nowhere) without ever blocking."""

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self._pending: list[dict[str, str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched = -1  # the fd the loop watches for writability, while datagrams wait
        self._status: str | None = None
        self._failing: int | None = None  # the errno last reported, so a broken socket is logged once
        self._drained: asyncio.Event | None = None  # set when the last waiting datagram went (``sent``)

    @classmethod
    def from_env(cls) -> Notifier:
        """To the socket systemd names in ``$NOTIFY_SOCKET``, if any."""
        return cls(notify_address())

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def waiting(self) -> int:
        """Datagrams waiting for the reader to make room."""
        return len(self._pending)

    def ready(self, status: str) -> None:
        self._status = status
        self._send({"READY": "1", "STATUS": status})

    def status(self, status: str) -> None:
        """Send STATUS= only when it changed."""
        if status != self._status:
            self._status = status
            self._send({"STATUS": status})

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send({"RELOADING": "1", "MONOTONIC_USEC": str(usec)})

    def stopping(self) -> None:
        self._status = "stopping"
        self._send({"STOPPING": "1", "STATUS": "stopping"})

    def watchdog(self) -> None:
        self._send({"WATCHDOG": "1"})

    def main_pid(self, pid: int) -> None:
        """MAINPID=: systemd follows ``pid`` as the service's main process from now on (a handover)."""
        self._send({"MAINPID": str(pid)})

    async def sent(self, timeout: float) -> bool:
        """Wait until nothing waits for the reader (False: still waiting after ``timeout`` seconds)."""
        if not self._pending:
            return True
        self._drained = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._drained.wait()
        return not self._pending

    def close(self) -> None:
        """Stop watching the socket and close it; what is still waiting is dropped."""
        self._pending.clear()
        self._drop_socket()

    def _send(self, fields: dict[str, str]) -> None:
        if self._address is None:
            return
        self._queue(fields)
        self._flush()

    def _queue(self, fields: dict[str, str]) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and set(fields) <= _MERGEABLE and set(last) <= _MERGEABLE:
            last.update(fields)
        else:
            self._pending.append(dict(fields))

    def _flush(self) -> None:
        while self._pending:
            if not self._try_send(self._pending[0]):
                self._watch(writable=True)
                return
            self._pending.pop(0)
        self._watch(writable=False)
        if self._drained is not None:
            self._drained.set()

    def _watch(self, *, writable: bool) -> None:
        """Have the loop call ``_flush`` when the socket can take a datagram (only while one waits)."""
        fd = self._sock.fileno() if writable and self._sock is not None else -1
        if fd == self._watched:
            return
        if self._watched >= 0 and self._loop is not None:
            self._loop.remove_writer(self._watched)
        if fd >= 0:
            self._loop = asyncio.get_running_loop()
            self._loop.add_writer(fd, self._flush)
        self._watched = fd

    def _try_send(self, fields: dict[str, str]) -> bool:
        """Send one datagram; False if the reader's queue is full (try again when writable)."""
        data = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        for attempt in (1, 2):
            try:
                self._connected().send(data)
            except BlockingIOError:
                return False
            except OSError as exc:
                # A notify socket re-created by systemd: connect anew once, then give the message up.
                if attempt == 1 and exc.errno in (errno.ECONNREFUSED, errno.ENOTCONN, errno.ENOENT):
                    self._drop_socket()
                    continue
                if exc.errno != self._failing:
                    self._failing = exc.errno
                    EventLog(log).warning(
                        "notify-failed", "sd_notify to %r failed: %s", self._address, exc.strerror or exc
                    )
                return True
            self._failing = None
            return True
        return True

    def _connected(self) -> socket.socket:
        # Connected, so that the loop's writability test asks the reader's queue, not our own buffer.
        if self._sock is None:
            assert self._address is not None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self._address)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        self._watch(writable=False)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
