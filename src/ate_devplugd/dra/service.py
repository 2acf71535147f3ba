"""The gRPC side toward kubelet: DRAPlugin v1 and v1beta1, device health, and plugin registration.

Each server is a ``base.unixserver.UnixServer``: bound under a hidden staging name (kubelet's plugin watcher
ignores dot-names), started, then linked into place, so kubelet never finds a socket that does not
answer yet; a socket another process serves on is never replaced, and one that is not ours is never
removed. The handlers only read state and await; nothing blocks the loop (kubelet gives GetInfo 1 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from ate_devplugd._pb.dra.v1 import api_pb2 as v1_pb2
from ate_devplugd._pb.dra.v1 import api_pb2_grpc as v1_grpc
from ate_devplugd._pb.dra.v1beta1 import api_pb2 as v1beta1_pb2
from ate_devplugd._pb.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2 as health_pb2
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from ate_devplugd._pb.pluginregistration.v1 import api_pb2 as reg_pb2
from ate_devplugd._pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from ate_devplugd.base.unixserver import UnixServer
from ate_devplugd.config.pools import Pool
from ate_devplugd.dra.prepare import ClaimRef, Preparer

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

#: Services on dra.sock, preferred first: kubelet takes the first one it knows (1.32 knows only v1beta1).
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE = "DRAPlugin"
#: How long kubelet may trust a health report. Health here follows udev events, not a periodic check, and
#: kubelet forgets all of it when the stream ends; so a report holds until the next one (kubelet 1.36
#: honours this; older ones fall back to their 30 s default and show Unknown after it).
HEALTH_TIMEOUT_SECONDS = 100 * 365 * 24 * 3600


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


class _PrepareMixin:
    """NodePrepareResources/NodeUnprepareResources over ``pb`` (one generated module per version)."""

    pb: Any
    has_share_id = False

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    async def NodePrepareResources(self, request: Any, context: Context) -> Any:
        with self._preparer.in_flight.call():
            results = await self._preparer.prepare(_claims(request))
        response = self.pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error:
                entry.error = result.error
                continue
            for device in result.devices:
                out = entry.devices.add(
                    request_names=device.request_names,
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=device.cdi_device_ids,
                )
                if device.share_id is not None and self.has_share_id:
                    out.share_id = device.share_id
        return response

    async def NodeUnprepareResources(self, request: Any, context: Context) -> Any:
        with self._preparer.in_flight.call():
            results = await self._preparer.unprepare(_claims(request))
        response = self.pb.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            response.claims[uid].error = error
        return response


class DraPluginV1(_PrepareMixin, v1_grpc.DRAPluginServicer):
    pb = v1_pb2
    has_share_id = True


class DraPluginV1beta1(_PrepareMixin, v1beta1_grpc.DRAPluginServicer):
    pb = v1beta1_pb2


class HealthServicer(health_grpc.DRAResourceHealthServicer):
    """NodeWatchResources: every device with its health at once, then again after each change."""

    def __init__(
        self,
        pool_list: Sequence[Pool],
        present: Callable[[str], bool],
        on_ended: Callable[[], None] | None = None,
    ) -> None:
        self._pools = list(pool_list)
        self._present = present
        #: Called when kubelet ends a stream (it does when it stops): a hint that kubelet may be gone.
        self._on_ended = on_ended
        self._changed = asyncio.Event()
        #: Streams end while this is set; the driver clears it when it starts (again).
        self.closed = False

    def changed(self) -> None:
        """Wake every open stream (the health of some resource changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """End every open stream (the driver stops)."""
        self.closed = True
        self.changed()

    def snapshot(self) -> health_pb2.NodeWatchResourcesResponse:
        now = int(time.time())
        devices = []
        for pool in self._pools:
            present = self._present(pool.resource)
            health = health_pb2.HEALTHY if present else health_pb2.UNHEALTHY
            message = "" if present else f"the device of {pool.resource} is absent"
            for name in pool.devices:
                devices.append(
                    health_pb2.DeviceHealth(
                        device=health_pb2.DeviceIdentifier(pool_name=pool.name, device_name=name),
                        health=health,
                        last_updated_time=now,
                        health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                        message=message,
                    )
                )
        return health_pb2.NodeWatchResourcesResponse(devices=devices)

    async def NodeWatchResources(
        self, request: health_pb2.NodeWatchResourcesRequest, context: Context
    ) -> AsyncIterator[health_pb2.NodeWatchResourcesResponse]:
        # Ends only when kubelet cancels (CancelledError, left to propagate) or close() is called.
        try:
            while not self.closed:
                changed = self._changed  # taken before the state is read, so no change is missed
                yield self.snapshot()
                await changed.wait()
        finally:
            if not self.closed and self._on_ended is not None:
                self._on_ended()


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """What kubelet's plugin watcher asks: who we are, then whether it took us."""

    def __init__(self, driver: str, endpoint: str, on_status: Callable[[bool, str], None]) -> None:
        self._info = reg_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=list(SUPPORTED_VERSIONS)
        )
        self._on_status = on_status

    async def GetInfo(self, request: reg_pb2.InfoRequest, context: Context) -> reg_pb2.PluginInfo:
        return self._info

    async def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: Context
    ) -> reg_pb2.RegistrationStatusResponse:
        self._on_status(request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()


class DraServer(UnixServer):
    """One of the driver's two servers (DRAPlugin on dra.sock, registration in plugins_registry), in a
    directory made 0750 if missing: ``<driver>``'s under plugins is ours to make, and plugins_registry
    may not be there before kubelet's plugin watcher first starts."""

    async def start(self) -> None:
        os.makedirs(posixpath.dirname(self.path), mode=0o750, exist_ok=True)
        await super().start()
