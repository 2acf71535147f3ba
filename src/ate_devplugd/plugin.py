"""One device plugin: the DevicePlugin gRPC service for one resource, its server and its Register call.

Everything runs on the one asyncio loop (grpc.aio). Register is awaited on that loop: kubelet dials our
socket and calls GetDevicePluginOptions before it answers Register, so the server must be serving and
the loop free while the call is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import importlib
import logging
import os
import posixpath
import socket
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.config import max_request_bytes
from ate_devplugd.devices import HEALTHY, UNHEALTHY, Resource

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
#: grpcio's error for a batch of operations on a call that failed (a private name; absent, nothing matches).
_CYGRPC = importlib.import_module("grpc._cython.cygrpc")
_EXECUTE_BATCH_ERROR: type[BaseException] | tuple[()] = getattr(_CYGRPC, "ExecuteBatchError", ())
#: Channel options for our calls: gRPC itself does not retry them. The daemon retries Register with
#: back-off, and a new kubelet.sock ends the wait. With gRPC's retries on (its default), grpcio 1.85
#: sometimes never finished a Register cut off by a stopping kubelet's GOAWAY and allocated without
#: bound until the call's deadline: over 4 GB in 15 s, in 4 of 13 storms of 1,000 kubelet restarts; in
#: none of 20 with them off.
_ONE_ATTEMPT = (("grpc.enable_retries", 0),)
#: kubelet itself waits up to 10 s to dial back; a Register slower than this has failed.
#: The environment variable ATE_DEVPLUGD_REGISTER_TIMEOUT (seconds) overrides it; the fault tests
#: use it to stand a hung kubelet for less than 15 s.
REGISTER_TIMEOUT = float(os.environ.get("ATE_DEVPLUGD_REGISTER_TIMEOUT") or 15.0)
#: How long our own server may take to answer its first connection.
SELF_DIAL_TIMEOUT = 5.0


class SocketInUseError(Exception):
    """Another live process answers on our socket path."""


class SocketGoneError(Exception):
    """Our socket was removed while the server was starting (kubelet wiping the directory, say)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} was removed while it was being served")


def unix_target(path: str) -> str:
    return "unix://" + os.path.abspath(path)


@dataclass(frozen=True)
class FileIdentity:
    """Tells one file from a later file at the same path (inode numbers are reused)."""

    dev: int
    ino: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> FileIdentity | None:
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_ctime_ns)


@functools.lru_cache(maxsize=32)
def _device_list(prefix: str, count: int, health: str) -> api_pb2.ListAndWatchResponse:
    """The device list with every unit in one health state: made once, shared, never modified.

    It is kept as decoded from its encoding: the message built from Python objects holds about 1 MiB
    for 4096 units, the decoded one about 150 KiB, and either is sent without further work.
    """
    devices = [api_pb2.Device(ID=f"{prefix}{i}", health=health) for i in range(count)]
    encoded = api_pb2.ListAndWatchResponse(devices=devices).SerializeToString()
    return api_pb2.ListAndWatchResponse.FromString(encoded)


def _response(resource: Resource) -> api_pb2.ListAndWatchResponse:
    health = HEALTHY if resource.healthy else UNHEALTHY
    return _device_list(resource.config.id_prefix, resource.config.count, health)


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    """The DevicePlugin service for one resource: N fungible units of one device node."""

    def __init__(self, resource: Resource, on_streams: Callable[[int], None] | None = None) -> None:
        self._resource = resource
        self._closing = asyncio.Event()
        self.streams = 0
        self._on_streams = on_streams

    def close(self) -> None:
        """End every ListAndWatch stream (the server is going away)."""
        self._closing.set()

    def snapshot(self) -> api_pb2.ListAndWatchResponse:
        """The current device list (made once per health state)."""
        return _response(self._resource)

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Context) -> api_pb2.DevicePluginOptions:
        # Units are identical, so no preferred allocation; nothing to do before a container starts.
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: Context
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        # Returning would make kubelet drop the resource, so this only ends when the server closes
        # or kubelet cancels (which arrives here as CancelledError and is left to propagate).
        self.streams += 1
        if self._on_streams is not None:
            self._on_streams(self.streams)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            while not self._closing.is_set():
                changed = self._resource.change_event()
                yield self.snapshot()
                waiter = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait((waiter, closing), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
        finally:
            closing.cancel()
            self.streams -= 1
            if self._on_streams is not None and not self._closing.is_set():
                self._on_streams(self.streams)

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Context) -> api_pb2.AllocateResponse:
        if not request.container_requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Allocate: no container requests")
        dev = self._resource.config
        responses = []
        for index, creq in enumerate(request.container_requests):
            if not creq.devices_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"Allocate: container request {index} names no device"
                )
            for device_id in creq.devices_ids:
                if not self._resource.is_known_id(device_id):
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"Allocate: unknown device ID {device_id[:80]!r} for {dev.resource}",
                    )
            if not self._resource.healthy:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Allocate: device {creq.devices_ids[0]!r} of {dev.resource} is unhealthy: "
                    f"{self._resource.presence.reason}",
                )
            spec = api_pb2.DeviceSpec(container_path=dev.path, host_path=dev.path, permissions=dev.permissions)
            responses.append(api_pb2.ContainerAllocateResponse(devices=[spec]))
        return api_pb2.AllocateResponse(container_responses=responses)

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: Context
    ) -> api_pb2.PreferredAllocationResponse:
        # Not advertised (units are identical), but a valid answer if called: the required IDs
        # first, then any available ones, up to the size asked for.
        responses = []
        for creq in request.container_requests:
            if creq.allocation_size < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "allocation_size must not be negative")
            chosen = list(dict.fromkeys(creq.must_include_deviceIDs))
            taken = set(chosen)
            for device_id in creq.available_deviceIDs:
                if len(chosen) >= creq.allocation_size:
                    break
                if device_id not in taken:
                    chosen.append(device_id)
                    taken.add(device_id)
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: Context
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # grpcio failing to send a stream's final status because kubelet or the server went first: raised
    # in grpcio's own task for the RPC, where nothing of ours can catch it; the stream is over anyway.
    if isinstance(context.get("exception"), _EXECUTE_BATCH_ERROR):
        log.debug("a stream ended as kubelet or the server went away (its final status was not sent)")
        return
    loop.default_exception_handler(context)


@contextlib.asynccontextmanager
async def grpc_runtime() -> AsyncIterator[None]:
    """Hold grpc.aio's runtime (its poller thread and completion queue) for the daemon's life.

    grpc.aio starts it with the first channel or server and shuts it down when the last one closes.
    Between one kubelet's departure and the next registration the daemon can have neither, so every
    kubelet restart would stop the poller thread and start another (a storm of 1,000 restarts costs
    about 15 % more CPU that way).

    Meanwhile grpcio's report of a stream cut off by a departing kubelet or a stop is one debug line,
    not an error with a traceback (it can come at any kubelet restart that races a stream's end, and
    would look like a fault to an operator reading the journal); anything else keeps its usual report.
    """
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(_loop_exception)
    try:
        async with _runtime_held():
            yield
    finally:
        loop.set_exception_handler(previous)


@contextlib.asynccontextmanager
async def _runtime_held() -> AsyncIterator[None]:
    """A reference on the runtime, as each channel and server takes one (grpcio 1.51 to 1.85 at least).

    Without that hook an idle channel that never connects does the same, at a cost: on grpcio 1.51 it
    wakes gRPC's timer thread about once a second more when idle.
    """
    hold = getattr(_CYGRPC, "init_grpc_aio", None)
    release = getattr(_CYGRPC, "shutdown_grpc_aio", None)
    if callable(hold) and callable(release):
        hold()
        try:
            yield
        finally:
            release()
    else:
        async with grpc.aio.insecure_channel("unix:" + os.devnull):
            yield


def check_socket_free(path: str) -> None:
    """Remove a stale file at our socket path; raise SocketInUseError if a live process answers there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise SocketInUseError(f"{path} is a directory")
    if stat.S_ISSOCK(st.st_mode):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise SocketInUseError(f"{path}: cannot tell whether it is in use: {exc.strerror}") from exc
        else:
            raise SocketInUseError(f"another process is serving on {path}")
        finally:
            probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class PluginServer:
    """A grpc.aio server for one resource on one unix socket; start() proves it answers."""

    def __init__(self, resource: Resource, socket_path: str, on_streams: Callable[[int], None] | None = None) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.servicer = DevicePluginServicer(resource, on_streams)
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
        options = (("grpc.use_local_subchannel_pool", 1), *_ONE_ATTEMPT)
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

    async def stop(self, grace: float | None = 0.2) -> None:
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
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.bind(staging)
    except OSError as exc:
        return OSError(exc.errno, f"cannot listen on {path}: {exc.strerror}")
    finally:
        probe.close()
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
    async with grpc.aio.insecure_channel(unix_target(kubelet_socket), options=_ONE_ATTEMPT) as channel:
        try:
            await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return exc.with_traceback(None)
    return None
