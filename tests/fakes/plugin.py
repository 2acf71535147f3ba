"""Another device plugin for a resource name: the "other client" kubelet's device-manager handler swaps in
for the name (another plugin, or a stray instance of ours), as kubelet meets it.

It serves DevicePlugin on a socket of its own in kubelet's directory (a gRPC server bound in place, as a Go
plugin's listener is), registers the name with kubelet, and sends one device list (its own IDs, or ours
for a stray instance) until it goes. ``go()`` stops its server, which removes its socket file (as a Go
plugin's listener does on Close), so kubelet's stream to it ends and its ``runClient`` disconnects the
name's current client. (A plugin killed outright leaves its file: no event shows that, and it is not
modelled.) Tests wait on the fake kubelet's events for each step; nothing here sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc


class _Servicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, ids: list[str], health: str) -> None:
        self._response = api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=i, health=health) for i in ids])
        self.gone = asyncio.Event()

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions()

    async def ListAndWatch(self, request: api_pb2.Empty, context: Any) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        yield self._response
        await self.gone.wait()


class OtherPlugin:
    """A device plugin for ``resource`` on ``directory/socket_name`` serving ``ids`` (all ``health``)."""

    def __init__(
        self,
        directory: Path,
        resource: str,
        ids: list[str],
        *,
        socket_name: str = "other.sock",
        health: str = "Healthy",
    ) -> None:
        self.socket_path = directory / socket_name
        self.kubelet_socket = directory / "kubelet.sock"
        self.resource = resource
        self._servicer = _Servicer(ids, health)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Serve, then register the name with kubelet (which dials back before it answers)."""
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        server.add_insecure_port("unix://" + str(self.socket_path))
        await server.start()
        self._server = server
        request = api_pb2.RegisterRequest(
            version="v1beta1", endpoint=self.socket_path.name, resource_name=self.resource
        )
        async with grpc.aio.insecure_channel("unix://" + str(self.kubelet_socket)) as channel:
            await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=10)

    async def go(self) -> None:
        """Stop serving: its socket file goes, and kubelet's stream to it ends."""
        self._servicer.gone.set()
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
