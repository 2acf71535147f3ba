"""A grpc.aio server on a unix socket path, for both modes: bound under a staging name, then linked into place.

gRPC removes whatever socket is at the path it binds, both before binding and when it stops. So it only
ever binds a hidden staging name next to the path (a dot-name: kubelet's plugin watcher ignores it, and
kubelet's device manager dials only the endpoint a plugin registers), and the bound socket is then
hard-linked to the path. link(2) fails if anything is there: a socket another process serves on is never
replaced, not even one that appears while we start; a stale file of a dead process is removed and the
link tried again. Once linked, the path answers at once, so kubelet never finds a socket that does not.
On stop the path is removed only while it is still the file we bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ate_devplugd.base.unixsock import FileIdentity, staging_path

#: Grace for in-flight RPCs (an Allocate, a NodePrepareResources) when a server stops.
STOP_GRACE = 0.2
#: How many times a stale file that keeps coming back at the path is removed before we give up.
PUBLISH_ATTEMPTS = 3


class SocketInUseError(Exception):
    """Another live process answers on our socket path (or something there cannot be ours)."""


class SocketGoneError(OSError):
    """Our socket was removed while the server was starting (kubelet wiping the directory, say)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} was removed while it was being served")


def check_socket_free(path: str) -> None:
    """Remove a stale file at our socket path; raise SocketInUseError if a live process answers there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise SocketInUseError(f"{path} is a directory")
    if stat.S_ISSOCK(st.st_mode):
        # Non-blocking, so the loop never waits: a listener answers or refuses at once, and one whose
        # backlog is full says EAGAIN (it listens: in use).
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            peer.connect(path)
        except BlockingIOError:
            raise SocketInUseError(f"another process is serving on {path}") from None
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise SocketInUseError(f"{path}: cannot tell whether it is in use: {exc.strerror}") from exc
        else:
            raise SocketInUseError(f"another process is serving on {path}")
        finally:
            peer.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class UnixServer:
    """One grpc.aio server on one unix socket path; the reference is kept until stop().

    A grpc server that is garbage-collected removes its socket (and kubelet then drops the plugin): its
    owner holds the UnixServer for as long as it serves.
    """

    def __init__(
        self,
        path: str,
        add_services: Callable[[grpc.aio.Server], None],
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.path = path
        self._add_services = add_services
        self._options = options
        #: The socket file we linked at the path, while we serve it.
        self.identity: FileIdentity | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Serve on the path: SocketInUseError (naming it) if another process serves there,
        SocketGoneError if our socket is removed before start returns, OSError if it cannot be bound."""
        check_socket_free(self.path)  # a stale file of an earlier run is removed
        staging = staging_path(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)  # ours by its name; gRPC would remove only a socket there
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *self._options])
        self._add_services(server)
        try:
            # unix:<path>: gRPC binds one up to sun_path's 107 bytes, a unix://<path> only up to 105.
            port = server.add_insecure_port("unix:" + os.path.abspath(staging))
        except RuntimeError:  # grpcio raises (1.51 and later) where it used to return 0
            port = 0
        if not port:
            await server.stop(None)  # never started; stopped, it is not left to the garbage collector
            raise _bind_failure(staging, self.path)
        self._server = server
        await server.start()
        try:
            # Only root (kubelet) connects; the unit's UMask already gives 0600, a shell may not.
            os.chmod(staging, 0o600)
            staged = os.lstat(staging).st_ino
            _publish(staging, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
        identity = FileIdentity.of(self.path)
        if identity is None:
            raise SocketGoneError(self.path)
        if identity.ino != staged:
            raise SocketInUseError(f"{self.path} was replaced while it was being served")
        self.identity = identity

    def is_ours(self) -> bool:
        """Whether the file at the path is still the one we linked there."""
        return self.identity is not None and FileIdentity.of(self.path) == self.identity

    async def stop(self, grace: float | None = STOP_GRACE) -> None:
        """Remove the socket (if it is still ours), then stop serving; safe to call twice."""
        server, self._server = self._server, None
        # Before the server stops: while it holds the socket's inode, no other file can have its identity.
        if self.is_ours():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.identity = None
        if server is not None:
            await server.stop(grace)


def _publish(staging: str, path: str) -> None:
    """Make the bound socket ``staging`` appear at ``path``, never replacing a live socket there."""
    for _ in range(PUBLISH_ATTEMPTS):
        try:
            os.link(staging, path)
        except FileExistsError:
            check_socket_free(path)  # a live one raises SocketInUseError; a stale one is removed
        else:
            return
    raise SocketInUseError(f"{path} keeps being re-created by another process")


def _bind_failure(staging: str, path: str) -> OSError:
    """Why a unix socket cannot be bound next to ``path`` (gRPC does not say): try it with a plain socket."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        peer.bind(staging)
    except OSError as exc:
        if exc.errno is None:  # Python's own check: the path does not fit in sun_path
            return OSError(errno.ENAMETOOLONG, f"cannot listen on {path}: {os.strerror(errno.ENAMETOOLONG)}")
        return OSError(exc.errno, f"cannot listen on {path}: {exc.strerror}")
    finally:
        peer.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)
    return OSError(errno.EADDRNOTAVAIL, f"cannot listen on {path}")
