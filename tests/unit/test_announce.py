"""The record announced on a listening unix socket: every peer told the current one, a peer of our own user
allowed to watch each new one, nothing ever waited for; and the instance locks found on the host."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ate_devplugd.base import announce
from ate_devplugd.base.announce import Announcer
from ate_devplugd.kubelet.lock import InstanceLock, held_names, lock_name


class Record:
    """A record that changes, and how often it was rendered."""

    def __init__(self) -> None:
        self.value = b"one"
        self.renders = 0

    def render(self) -> bytes:
        self.renders += 1
        return self.value


@contextlib.asynccontextmanager
async def announcing(tmp_path: Path, record: Record) -> AsyncIterator[tuple[str, Announcer]]:
    name = "\0" + str(tmp_path / "announce")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    sock.bind(name)
    sock.listen(8)
    announcer = Announcer(sock, record.render)
    try:
        yield name, announcer
    finally:
        announcer.close()
        sock.close()


async def test_each_peer_is_told_the_record(tmp_path: Path) -> None:
    """fetch: who holds the name (the kernel's pid) and the record as of now; nobody there: None."""
    record = Record()
    async with announcing(tmp_path, record) as (name, _):
        assert await announce.fetch(name) == (announce.Peer(os.getpid(), os.geteuid()), b"one")
        record.value = b"two"
        assert await announce.fetch(name) == (announce.Peer(os.getpid(), os.geteuid()), b"two")
        assert announce.holder(name) == announce.Peer(os.getpid(), os.geteuid())
    assert await announce.fetch(name) is None
    assert announce.holder(name) is None


async def test_a_watcher_hears_every_change_and_nothing_is_rendered_unheard(tmp_path: Path) -> None:
    """follow: the record as of the watch, then each change once; while nobody watches, a change renders
    nothing; the holder's close ends the follow."""
    record = Record()
    async with announcing(tmp_path, record) as (name, announcer):
        announcer.changed()
        assert record.renders == 0
        records = announce.follow(name)
        peer, first = await anext(records)
        assert (peer.pid, first) == (os.getpid(), b"one")
        for value in (b"two", b"three"):
            record.value = value
            announcer.changed()
            assert (await anext(records))[1] == value
    async with asyncio.timeout(5):
        assert [line async for _, line in records] == []


async def test_a_peer_that_does_not_read_is_dropped_not_waited_for(tmp_path: Path) -> None:
    """A watcher whose buffer is full is dropped at the next change; the others go on hearing."""
    record = Record()
    record.value = b"x" * 200_000
    async with announcing(tmp_path, record) as (name, announcer):
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stuck.connect(name)
        stuck.sendall(announce.WATCH)
        records = announce.follow(name)
        await anext(records)
        for _ in range(20):  # far more than a unix socket's buffer holds
            announcer.changed()
            await anext(records)
        # The stuck peer: its first lines, then the end (dropped), never a wait of the announcer.
        stuck.settimeout(5)
        got = await until_closed(stuck)
        assert 0 < got.count(b"\n") < 22
        stuck.close()
        await records.aclose()


def connected(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(name)
    return sock


async def until_closed(sock: socket.socket) -> bytes:
    """What the peer is sent until the announcer closes it (read off the loop, which must go on)."""
    data = b""
    while chunk := await asyncio.to_thread(sock.recv, 1 << 20):
        data += chunk
    return data


async def test_garbage_closes_the_peer_and_peers_are_bounded(tmp_path: Path) -> None:
    """A peer that writes anything but `watch` is closed; more than MAX_PEERS held at once: the next is told
    the record and closed at once."""
    async with announcing(tmp_path, Record()) as (name, _):
        noisy = connected(name)
        noisy.sendall(b"handover now\n")
        assert await until_closed(noisy) == b"one\n"
        held = []
        for _ in range(announce.MAX_PEERS):
            peer = connected(name)
            assert await asyncio.to_thread(peer.recv, 100) == b"one\n"
            held.append(peer)
        extra = connected(name)
        assert await until_closed(extra) == b"one\n"
        for peer in [*held, extra, noisy]:
            peer.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to be another user")
async def test_another_user_reads_but_may_not_watch(tmp_path: Path) -> None:
    """A peer of another user (nobody) is told the record and closed: it may not stay for the changes."""
    script = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5); "
        "s.connect(sys.argv[1].encode().replace(b'@', b'\\0', 1)); d = s.recv(100)\n"
        "try:\n s.sendall(b'watch\\n')\n while c := s.recv(100): d += c\nexcept ConnectionError: pass\nprint(d)"
    )
    async with announcing(tmp_path, Record()) as (name, _):
        proc = await asyncio.create_subprocess_exec(
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            script,
            "@" + name[1:],
            stdout=subprocess.PIPE,
        )
        async with asyncio.timeout(20):
            out, _ = await proc.communicate()
    assert out.strip() == b"b'one\\n'", out


async def test_the_lock_announces_and_is_found(tmp_path: Path) -> None:
    """The instance lock announces the record it is given; held_names lists it among the host's listening
    sockets (kernel's /proc/net/unix), and no more once released."""
    lock = InstanceLock(str(tmp_path / "device-plugins"))
    assert lock.acquire(lambda: b'{"a": 1}')
    try:
        assert lock.name in held_names()
        assert await announce.fetch(lock.name) == (announce.Peer(os.getpid(), os.geteuid()), b'{"a": 1}')
    finally:
        lock.release()
    assert lock.name not in held_names()


def test_held_names_reads_only_listening_locks(tmp_path: Path) -> None:
    """Only listening sockets (__SO_ACCEPTCON) named @ate-devplugd/...; connected ones and others are not."""
    table = tmp_path / "unix"
    table.write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 1001 @ate-devplugd//var/lib/kubelet/device-plugins\n"
        "0000000000000000: 00000003 00000000 00000000 0001 03 1002 @ate-devplugd//var/lib/kubelet/device-plugins\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 1003 @other/name\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 1004 /run/some.sock\n"
        "0000000000000000: 00000002 00000000 00010000 0001 01 1005\n"
    )
    assert held_names(str(table)) == [lock_name("/var/lib/kubelet/device-plugins")]
