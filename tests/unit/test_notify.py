"""sd_notify over a real datagram socket, without blocking; the watchdog interval."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from ate_devplugd.signals import notify
from ate_devplugd.signals.notify import Notifier


def receiver(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    sock.bind(str(path))
    return sock


def read_all(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


class TestNotifier:
    async def test_messages_reach_a_real_socket(self, tmp_path: Path, clean_env: None) -> None:
        """READY, STATUS (only on change), RELOADING with MONOTONIC_USEC, WATCHDOG, STOPPING."""
        path = tmp_path / "notify"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        sock.settimeout(5)
        os.environ["NOTIFY_SOCKET"] = str(path)
        notifier = Notifier.from_env()
        notifier.ready("a: 1/1 healthy")
        notifier.status("a: 1/1 healthy")  # unchanged: not sent
        notifier.status("a: 0/1 healthy")
        notifier.reloading()
        notifier.watchdog()
        notifier.stopping()
        got = [sock.recv(4096).decode() for _ in range(5)]
        sock.close()
        notifier.close()
        assert got[0] == "READY=1\nSTATUS=a: 1/1 healthy"
        assert got[1] == "STATUS=a: 0/1 healthy"
        assert got[2].startswith("RELOADING=1\nMONOTONIC_USEC=") and got[2].split("=")[-1].isdigit()
        assert got[3] == "WATCHDOG=1"
        assert got[4].startswith("STOPPING=1")

    def test_no_socket_is_a_no_op(self, clean_env: None) -> None:
        """Without NOTIFY_SOCKET nothing is sent and nothing fails."""
        os.environ.pop("NOTIFY_SOCKET", None)
        notifier = Notifier.from_env()
        assert not notifier.enabled
        notifier.ready("x")

    async def test_abstract_address(self, clean_env: None) -> None:
        """NOTIFY_SOCKET=@name is an abstract socket."""
        name = f"ate-devplugd-test-{os.getpid()}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind("\0" + name)
        sock.settimeout(5)
        os.environ["NOTIFY_SOCKET"] = "@" + name
        notifier = Notifier.from_env()
        notifier.ready("up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
        notifier.close()
        sock.close()

    async def test_a_stalled_reader_never_blocks(self, tmp_path: Path) -> None:
        """With the reader's queue full, sends return at once; what waits is merged (the latest STATUS,
        state changes kept in order) and goes out as soon as the reader makes room."""
        sock = receiver(tmp_path / "notify")
        notifier = Notifier(str(tmp_path / "notify"))
        notifier.ready("start")
        n = 1
        while not notifier.waiting:  # fill the kernel's queue (10 datagrams by default)
            notifier.status(f"filler {n}")
            n += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(1000):
            notifier.status(f"s{i}")
            notifier.watchdog()
        notifier.reloading()
        notifier.ready("after reload")
        notifier.status("latest")
        assert loop.time() - started < 1.0
        assert notifier.waiting == 4, "the STATUS burst merged into one, then RELOADING, READY, STATUS"
        got = read_all(sock)  # the queue empties: the loop now sees the socket writable
        async with asyncio.timeout(5):
            while "STATUS=latest" not in got:
                got.append((await loop.sock_recv(sock, 4096)).decode())
        assert notifier.waiting == 0
        tail = got[-4:]
        assert tail[0] == "STATUS=s999\nWATCHDOG=1" or tail[0].startswith("STATUS=filler")
        assert tail[1].startswith("RELOADING=1\nMONOTONIC_USEC=")
        assert tail[2:] == ["READY=1\nSTATUS=after reload", "STATUS=latest"]
        notifier.close()
        sock.close()

    async def test_socket_recreated_is_reconnected(self, tmp_path: Path) -> None:
        """systemd re-creating its notify socket costs nothing: the next message reaches the new one."""
        path = tmp_path / "notify"
        first = receiver(path)
        notifier = Notifier(str(path))
        notifier.ready("one")
        assert read_all(first) == ["READY=1\nSTATUS=one"]
        first.close()
        path.unlink()
        second = receiver(path)
        notifier.status("two")
        assert read_all(second) == ["STATUS=two"]
        notifier.close()
        second.close()

    def test_no_reader_is_logged_once(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """A notify socket nobody listens on is one warning, not one per message."""
        notifier = Notifier(str(tmp_path / "nobody"))
        for i in range(5):
            notifier.status(f"s{i}")
        assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1
        notifier.close()


class TestWatchdog:
    @pytest.mark.parametrize(
        ("env", "expected"),
        [
            ({}, None),
            ({"WATCHDOG_USEC": "3000000"}, 1.5),
            ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "42"}, 1.5),
            ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "43"}, None),
            ({"WATCHDOG_USEC": "0"}, None),
            ({"WATCHDOG_USEC": "junk"}, None),
        ],
    )
    def test_interval(self, env: dict[str, str], expected: float | None) -> None:
        """Half of WATCHDOG_USEC, only when meant for this process."""
        assert notify.watchdog_interval(env, pid=42) == expected
