"""A lean kubelet device manager for the benchmark: it stamps every step with CLOCK_MONOTONIC.

It does toward a plugin what kubelet does (and what tests/fakes/kubelet.py checks in detail): at
start it removes every socket in its directory and serves ``kubelet.sock``; on Register it dials the
endpoint back and calls GetDevicePluginOptions before answering; then it opens ListAndWatch and keeps
reading it. A new registration for a resource replaces the old one.

What it records is kept small (counts, not ID lists) so that recording costs next to nothing:
``Stamp(kind, t, ...)`` on ``events``, with ``t`` the time the step reached this process's Python code.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc

KUBELET_SOCKET = "kubelet.sock"
DIAL_TIMEOUT = 10.0
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
#: Device.health (field 2, length-delimited) as encoded on the wire.
HEALTHY_FIELD = b"\x12\x07Healthy"
UNHEALTHY_FIELD = b"\x12\x09Unhealthy"


@dataclass(frozen=True)
class Stamp:
    kind: str  # "socket", "register", "list", "stream-ended"
    t: float
    resource: str = ""
    healthy: int = 0
    total: int = 0


@dataclass
class _Endpoint:
    channel: grpc.aio.Channel
    stub: api_pb2_grpc.DevicePluginStub
    stream: asyncio.Task[None] | None = None


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: BenchKubelet) -> None:
        self._kubelet = kubelet

    async def Register(self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext) -> api_pb2.Empty:
        return await self._kubelet.handle_register(request, context)


class BenchKubelet:
    """Serves ``kubelet.sock`` in ``directory``; ``wipe=False`` leaves plugin sockets alone (floor runs)."""

    def __init__(self, directory: Path, *, wipe: bool = True) -> None:
        self.dir = directory
        self.wipe = wipe
        self.events: asyncio.Queue[Stamp] = asyncio.Queue()
        self.endpoints: dict[str, _Endpoint] = {}
        self._server: grpc.aio.Server | None = None

    @property
    def socket_path(self) -> Path:
        return self.dir / KUBELET_SOCKET

    def drain(self) -> None:
        while not self.events.empty():
            self.events.get_nowait()

    async def next(self, kind: str, timeout: float = 10.0, resource: str | None = None) -> Stamp:
        async with asyncio.timeout(timeout):
            while True:
                ev = await self.events.get()
                if ev.kind == kind and (resource is None or ev.resource == resource):
                    return ev

    def _wipe(self) -> None:
        for entry in self.dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()

    async def start(self) -> None:
        if self.wipe:
            self._wipe()
        else:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port("unix://" + str(self.socket_path))
        # The socket file exists from here on: this is when a plugin's inotify watch fires.
        self.events.put_nowait(Stamp("socket", time.monotonic()))
        await server.start()
        self._server = server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
        for endpoint in list(self.endpoints.values()):
            await self._drop(endpoint)
        self.endpoints.clear()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    @staticmethod
    async def _drop(endpoint: _Endpoint) -> None:
        if endpoint.stream is not None:
            endpoint.stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await endpoint.stream
        await endpoint.channel.close()

    async def handle_register(
        self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.Empty:
        t = time.monotonic()
        name = request.resource_name
        if request.version != "v1beta1" or not request.endpoint or "/" in request.endpoint:
            await context.abort(grpc.StatusCode.UNKNOWN, f"bad registration {request!r}")
        channel = grpc.aio.insecure_channel("unix://" + str(self.dir / request.endpoint))
        try:
            await asyncio.wait_for(channel.channel_ready(), DIAL_TIMEOUT)
            stub = api_pb2_grpc.DevicePluginStub(channel)
            await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=DIAL_TIMEOUT)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close()
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {exc}")
        old = self.endpoints.get(name)
        endpoint = _Endpoint(channel, stub)
        self.endpoints[name] = endpoint
        if old is not None:
            await self._drop(old)
        self.events.put_nowait(Stamp("register", t, name))
        endpoint.stream = asyncio.get_running_loop().create_task(self._list_and_watch(name, endpoint))
        return api_pb2.Empty()

    async def _list_and_watch(self, name: str, endpoint: _Endpoint) -> None:
        await asyncio.sleep(0)
        # Kept as bytes: kubelet decodes in Go, and a Python decode here would be counted against the
        # plugin. Each Device ends with its health field, so counting those tells healthy from total.
        list_and_watch = endpoint.channel.unary_stream(
            LIST_AND_WATCH, request_serializer=api_pb2.Empty.SerializeToString
        )
        call = list_and_watch(api_pb2.Empty())
        try:
            async for response in call:
                t = time.monotonic()
                healthy = response.count(HEALTHY_FIELD)
                total = healthy + response.count(UNHEALTHY_FIELD)
                self.events.put_nowait(Stamp("list", t, name, healthy, total))
        except grpc.aio.AioRpcError:
            self.events.put_nowait(Stamp("stream-ended", time.monotonic(), name))
        except asyncio.CancelledError:
            call.cancel()
            raise

    def stub(self, resource: str) -> api_pb2_grpc.DevicePluginStub:
        return self.endpoints[resource].stub
