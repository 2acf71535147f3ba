"""A plugin endpoint: one resource's gRPC server on its unix socket, and its Register call to kubelet.

Everything runs on the one asyncio loop (grpc.aio). Register is awaited on that loop: kubelet dials our
socket and calls GetDevicePluginOptions before it answers Register, so the server must be serving and
the loop free while the call is in flight.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import socket
import stat
from collections.abc import Callable

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.device_config import max_request_bytes
from ate_devplugd.devices import Resource
from ate_devplugd.servicer import AllocateCounter, DevicePluginServicer
from ate_devplugd.unixsock import ONE_ATTEMPT, FileIdentity, unix_target

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
#: kubelet itself waits up to 10 s to dial back; a Register slower than this has failed.
#: The environment variable ATE_DEVPLUGD_REGISTER_TIMEOUT (seconds) overrides it; the fault tests
#: use it to stand a hung kubelet for less than 15 s.
REGISTER_TIMEOUT = float(os.environ.get("ATE_DEVPLUGD_REGISTER_TIMEOUT") or 15.0)
#: How long our own server may take to answer its first connection.
SELF_DIAL_TIMEOUT = 5.0
#: Grace for in-flight RPCs (an Allocate) when a server stops.
STOP_GRACE = 0.2


class SocketInUseError(Exception):
    """Another live process answers on our socket path."""


class SocketGoneError(Exception):
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
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            peer.settimeout(1.0)
            peer.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise SocketInUseError(f"{path}: cannot tell whether it is in use: {exc.strerror}") from exc
        else:
            raise SocketInUseError(f"another process is serving on {path}")
        finally:
            peer.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class PluginServer:
    """A grpc.aio server for one resource on one unix socket; start() proves it answers."""

    def __init__(
        self,
        resource: Resource,
        socket_path: str,
        on_streams: Callable[[int], None] | None = None,
        counter: AllocateCounter | None = None,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.servicer = DevicePluginServicer(resource, on_streams, counter)
        self.identity: FileIdentity | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind a staging name, then hard-link it to the socket path (which fails if anything is there).

        gRPC removes whatever socket is at the path it binds, both before binding and when it stops; so
        it only ever binds the staging name, and another process's live socket is never removed.
        """
        check_socket_free(self.socket_path)
        staging = posixpath.join(posixpath.dirname(self.socket_path), "." + posixpath.basename(self.socket_path))
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", max_request_bytes(self.resource.config)),
            ]
        )
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        try:
            port = server.add_insecure_port(unix_target(staging))
        except RuntimeError:  # grpcio raises (1.51 and later) where it used to return 0
            port = 0
        if not port:
            raise _bind_failure(staging, self.socket_path)
        self._server = server
        await server.start()
        try:
            # Only root (kubelet) connects; the unit's UMask already gives 0600, a shell may not.
            os.chmod(staging, 0o600)
            staged = os.lstat(staging).st_ino
            _publish(staging, self.socket_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
        identity = FileIdentity.of(self.socket_path)
        if identity is None:
            raise SocketGoneError(self.socket_path)
        if identity.ino != staged:
            raise SocketInUseError(f"{self.socket_path} was replaced while it was being served")
        self.identity = identity
        await self._dial_self()

    async def _dial_self(self) -> None:
        """Prove the socket answers with one RPC; fail at once (no reconnect wait) if it does not."""
        # gRPC shares one connection per address among channels, with its last failure and reconnect
        # back-off: a check just after one that found the socket wiped by kubelet would fail at once,
        # unattempted. A local subchannel pool gives this check a connection of its own; and it is one
        # attempt, as Register is.
        options = (("grpc.use_local_subchannel_pool", 1), *ONE_ATTEMPT)
        async with grpc.aio.insecure_channel(unix_target(self.socket_path), options=options) as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)
            try:
                await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=SELF_DIAL_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                if not self.socket_is_ours():
                    raise SocketGoneError(self.socket_path) from None
                raise OSError(
                    errno.ECONNREFUSED, f"{self.socket_path} does not answer: {exc.code().name}: {exc.details()}"
                ) from None

    def socket_is_ours(self) -> bool:
        """Whether the file at our socket path is still the one we bound."""
        return self.identity is not None and FileIdentity.of(self.socket_path) == self.identity

    async def stop(self, grace: float | None = STOP_GRACE) -> None:
        """Stop serving (ending ListAndWatch streams) and remove our socket; safe to call twice."""
        server, self._server = self._server, None
        self.servicer.close()
        # Before the server stops: while it holds the socket's inode, no other file can have its identity.
        if self.socket_is_ours():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self.identity = None
        if server is not None:
            await server.stop(grace)


def _publish(staging: str, path: str) -> None:
    """Make the bound socket ``staging`` appear at ``path``, never replacing a live socket there."""
    for _ in range(3):
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
        return OSError(exc.errno, f"cannot listen on {path}: {exc.strerror}")
    finally:
        peer.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)
    return OSError(errno.EADDRNOTAVAIL, f"cannot listen on {path}")


async def register(kubelet_socket: str, endpoint: str, resource_name: str, timeout: float) -> None:
    """Register with kubelet, awaited on the loop; raises grpc.aio.AioRpcError on failure."""
    request = api_pb2.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=api_pb2.DevicePluginOptions(),
    )
    failure = await _register_once(kubelet_socket, request, timeout)
    if failure is not None:
        raise failure


async def _register_once(
    kubelet_socket: str, request: api_pb2.RegisterRequest, timeout: float
) -> grpc.aio.AioRpcError | None:
    """One Register call; its error is returned without a traceback.

    In grpcio 1.51 (Debian 12) an AioRpcError is its own ``args``, a reference cycle; with its traceback
    it would keep the call, the channel and the connection to kubelet open until a full garbage
    collection: one fd per failed attempt while kubelet keeps refusing.
    """
    async with grpc.aio.insecure_channel(unix_target(kubelet_socket), options=ONE_ATTEMPT) as channel:
        try:
            await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return exc.with_traceback(None)
    return None
