"""A plugin endpoint: one resource's gRPC server on its unix socket, and its Register call to kubelet.

Everything runs on the one asyncio loop (grpc.aio). Register is awaited on that loop: kubelet dials our
socket and calls GetDevicePluginOptions before it answers Register, so the server must be serving and
the loop free while the call is in flight.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
from collections.abc import Callable

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.base.unixserver import STOP_GRACE, SocketGoneError, UnixServer
from ate_devplugd.base.unixsock import ONE_ATTEMPT, unix_target
from ate_devplugd.config.device import max_request_bytes
from ate_devplugd.deviceplugin.servicer import AllocateCounter, DevicePluginServicer
from ate_devplugd.node.devices import Resource

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
#: kubelet itself waits up to 10 s to dial back; a Register slower than this has failed.
#: The environment variable ATE_DEVPLUGD_REGISTER_TIMEOUT (seconds) overrides it; the fault tests
#: use it to stand a hung kubelet for less than 15 s.
REGISTER_TIMEOUT = float(os.environ.get("ATE_DEVPLUGD_REGISTER_TIMEOUT") or 15.0)
#: How long our own server may take to answer its first connection.
SELF_DIAL_TIMEOUT = 5.0


class PluginServer:
    """A grpc.aio server for one resource on its unix socket (``base.unixserver``); start() proves it answers."""

    def __init__(
        self,
        resource: Resource,
        socket_path: str,
        on_streams: Callable[[int], None] | None = None,
        counter: AllocateCounter | None = None,
        *,
        withheld: bool = False,
        on_sent: Callable[[int], None] | None = None,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.servicer = DevicePluginServicer(resource, on_streams, counter, withheld=withheld, on_sent=on_sent)
        self._unix = UnixServer(
            socket_path,
            functools.partial(api_pb2_grpc.add_DevicePluginServicer_to_server, self.servicer),
            options=[("grpc.max_receive_message_length", max_request_bytes(resource.config))],
        )

    async def start(self) -> None:
        """Serve on the socket path (never taking a live process's), then dial it once."""
        await self._unix.start()
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
        return self._unix.is_ours()

    async def stop(self, grace: float | None = STOP_GRACE) -> None:
        """Stop serving and remove our socket; safe to call twice. No new call is taken, the Allocates
        already accepted are answered, and only then do the ListAndWatch streams end: kubelet closes the
        connection at a stream's end, and a call it still waited for on it would fail."""
        stopping = asyncio.ensure_future(self._unix.stop(grace))
        await asyncio.sleep(0)  # the server's shutdown begun: no new call
        if grace:
            await self.servicer.in_flight.idle(grace)
        self.servicer.close()
        await stopping


class Refusals:
    """Failed Register attempts toward one kubelet, and how loudly each is said.

    kubelet.sock refusing connections is part of every kubelet start (a killed kubelet's socket stays until
    the new one's wipe; the new one is bound a moment before it listens), and a kubelet stopping cancels the
    call in flight: a warning only once that lasts toward one kubelet (its tenth attempt, after about 2.5 s
    of back-off), while an error kubelet answers with (or a deadline it lets pass) is one at once. Each new
    kubelet starts again at 0, as the retry delay does, so a storm of short kubelet lives never adds up to
    the warning that a kubelet refusing for seconds deserves.
    """

    def __init__(self) -> None:
        self._count = 0
        self._kubelet: object = None

    def failed(self, kubelet: object, code: grpc.StatusCode) -> tuple[int, int]:
        """One more failure toward ``kubelet``: its attempt number and the level to log it at."""
        if kubelet != self._kubelet:
            self._kubelet, self._count = kubelet, 0
        self._count += 1
        transient = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        first = self._count == 1 and not transient
        loud = first or self._count == 10 or self._count % 100 == 0
        return self._count, logging.WARNING if loud else logging.DEBUG

    def reset(self) -> None:
        """A Register succeeded."""
        self._count = 0


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
