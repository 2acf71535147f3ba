"""A record announced on a listening unix socket: every peer is told the current one, and a peer of our own
user may stay to hear each new one.

The socket is one the caller has bound and listens on (the instance lock's abstract name). Each peer that
connects gets the record as one line at once; a peer of another user is then closed. A peer of our own
user may write ``watch`` to be sent the record again (from then on it hears every change), then each
new record as a line of its own as soon as ``changed`` is called, until it closes; anything else it
writes, or a record it does not take (its buffer full), closes it. The record is rendered only when
someone is there to hear it, so an unheard change costs nothing.
Everything runs on the loop (``add_reader``); nothing blocks.

``fetch`` and ``follow`` are the other side: one record, or a record and every new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncGenerator, Callable
from typing import NamedTuple

#: What a peer writes to hear each new record.
WATCH = b"watch\n"
#: Peers of our own user held at once (watching, or not yet closed); more are told the record and closed.
MAX_PEERS = 16
#: The longest record a reader takes.
MAX_RECORD = 1 << 20
_CRED = struct.Struct("3i")


class Peer(NamedTuple):
    """Who is at the other end, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Peer(int(pid), int(uid))


class Announcer:
    """Tells the peers of ``listener`` the record ``render`` makes (one line of bytes, without its newline)."""

    def __init__(self, listener: socket.socket, render: Callable[[], bytes]) -> None:
        self._listener = listener
        self._render = render
        #: Peers of our own user still connected, by fd; the watching ones are in ``_watching``.
        self._peers: dict[int, socket.socket] = {}
        self._watching: set[int] = set()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(listener.fileno(), self._accept)

    def changed(self) -> None:
        """The record changed: the watching peers are sent the new one (rendered only if one watches)."""
        if not self._watching:
            return
        line = self._render() + b"\n"
        for fd in list(self._watching):
            self._send(fd, line)

    def stop_listening(self) -> None:
        """No new peer (the caller closes the listener: its name is free); the watching ones hear on."""
        if self._listener.fileno() >= 0:
            self._loop.remove_reader(self._listener.fileno())

    def close(self) -> None:
        """Every peer closed (the listener is the caller's)."""
        self.stop_listening()
        for fd in list(self._peers):
            self._drop(fd)

    def _accept(self) -> None:
        while True:
            try:
                peer, _ = self._listener.accept()
            except OSError:  # none left (EAGAIN), or the peer already gave up
                return
            try:
                who = peer_of(peer)
                peer.setblocking(False)
                peer.send(self._render() + b"\n")
            except OSError:
                peer.close()
                continue
            if who.uid != os.geteuid() or len(self._peers) >= MAX_PEERS:
                peer.close()
                continue
            self._peers[peer.fileno()] = peer
            self._loop.add_reader(peer.fileno(), self._heard, peer.fileno())

    def _heard(self, fd: int) -> None:
        try:
            data = self._peers[fd].recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == WATCH and fd not in self._watching:
            self._watching.add(fd)
            self._send(fd, self._render() + b"\n")  # the record as of now: no change after it is missed
        else:  # closed, or not a word we know
            self._drop(fd)

    def _send(self, fd: int, line: bytes) -> None:
        try:
            sent = self._peers[fd].send(line)
        except OSError:
            sent = -1
        if sent != len(line):  # a peer that does not take its records is dropped, never waited for
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        self._watching.discard(fd)
        peer = self._peers.pop(fd, None)
        if peer is not None:
            self._loop.remove_reader(fd)
            peer.close()


def _connected(name: bytes | str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        raise
    return sock


def holder(name: bytes | str, timeout: float = 1.0) -> Peer | None:
    """Who listens on ``name`` (whatever it announces, if anything); None when nobody answers there."""
    try:
        sock = _connected(name, timeout)
    except OSError:
        return None
    try:
        return peer_of(sock)
    except OSError:
        return None
    finally:
        sock.close()


async def fetch(name: bytes | str, timeout: float = 1.0) -> tuple[Peer, bytes] | None:
    """Who holds ``name`` and the record it announces; None when nobody answers there within ``timeout``.
    On the loop: a holder on this very loop (a test's) answers meanwhile."""
    try:
        sock = _connected(name, timeout)
    except OSError:
        return None
    try:
        who = peer_of(sock)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_RECORD)
    except OSError:
        sock.close()
        return None
    try:
        async with asyncio.timeout(timeout):
            line = await reader.readline()
        return (who, line[:-1]) if line.endswith(b"\n") else None
    except (TimeoutError, OSError, ValueError, asyncio.LimitOverrunError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def follow(name: bytes | str, timeout: float = 1.0) -> AsyncGenerator[tuple[Peer, bytes], None]:
    """The record announced on ``name`` as of the moment the holder hears us watch, then each new one, until
    the holder closes (its process ended, or it let go of the name). Raises OSError when nobody answers
    there. What the caller does after the first record (a signal to the holder) is seen in a later one."""
    sock = _connected(name, timeout)
    try:
        who = peer_of(sock)
        sock.sendall(WATCH)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_RECORD)
    except BaseException:
        sock.close()
        raise
    try:
        await reader.readline()  # the record as of the connect, before the holder read our WATCH
        while line := await reader.readline():
            if not line.endswith(b"\n"):
                return
            yield who, line[:-1]
    except (ConnectionError, asyncio.LimitOverrunError, ValueError):
        return
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
