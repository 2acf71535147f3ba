"""The DevicePlugin gRPC service for one resource: N fungible units of one device node.

Everything runs on the one asyncio loop. The service reads the resource's live state on every call, so
a reload that changes the resource's config (count, path, permissions) reaches kubelet on the open
ListAndWatch stream and in the next Allocate, without a new registration.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.base.inflight import InFlight
from ate_devplugd.node.devices import HEALTHY, UNHEALTHY, Resource

Context = grpc.aio.ServicerContext[Any, Any]

#: Sent by our own tools (``probe``, ``doctor``) on their ListAndWatch calls: such a stream is not
#: kubelet's, so it neither counts as kubelet watching nor, when it ends, as kubelet letting go.
TOOL_METADATA = ("x-ate-devplugd-tool", "probe")


@functools.lru_cache(maxsize=32)
def device_list(prefix: str, count: int, health: str) -> api_pb2.ListAndWatchResponse:
    """The device list with every unit in one health state: made once, shared, never modified.

    It is kept as decoded from its encoding: the message built from Python objects holds about 1 MiB
    for 4096 units, the decoded one about 150 KiB, and either is sent without further work.
    """
    devices = [api_pb2.Device(ID=f"{prefix}{i}", health=health) for i in range(count)]
    encoded = api_pb2.ListAndWatchResponse(devices=devices).SerializeToString()
    return api_pb2.ListAndWatchResponse.FromString(encoded)


#: What a withheld device-plugin path says (DRA mode keeps one registered: see ``DevicePluginServicer``).
WITHHELD = "device-plugin path withheld (DRA mode)"


def list_response(resource: Resource, withheld: bool = False) -> api_pb2.ListAndWatchResponse:
    """What ListAndWatch sends for ``resource`` now (every unit Unhealthy while the path is withheld)."""
    health = HEALTHY if resource.usable and not withheld else UNHEALTHY
    return device_list(resource.config.id_prefix, resource.config.count, health)


class AllocateCounter(Protocol):
    """Hears each Allocate: granted, or refused with a gRPC status code's name (the metrics)."""

    def allocation(self, resource: str) -> None: ...
    def allocate_error(self, resource: str, code: str) -> None: ...


class _NoCounter:
    def allocation(self, resource: str) -> None:
        pass

    def allocate_error(self, resource: str, code: str) -> None:
        pass


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    """The DevicePlugin service for one resource; ``on_streams`` hears the number of kubelet's open streams,
    ``on_sent`` the Healthy units of each device list as it goes out on one of them.

    ``withheld``: the path is kept registered with every unit Unhealthy whatever the device's state, and
    Allocate refuses. DRA mode serves one so that the Node shows allocatable 0 (the scheduler takes the DRA
    path) while kubelet still finds an endpoint for the name (kubelet 1.36 fails a DRA container's start
    without one when its checkpoint holds an old device-plugin allocation: kubelet's
    ``pkg/kubelet/cm/devicemanager/manager.go``, ``isDevicePluginResource``; docs/switching.md).
    """

    def __init__(
        self,
        resource: Resource,
        on_streams: Callable[[int], None] | None = None,
        counter: AllocateCounter | None = None,
        *,
        withheld: bool = False,
        on_sent: Callable[[int], None] | None = None,
    ) -> None:
        self._resource = resource
        self._withheld = withheld
        self._on_sent = on_sent
        self._closing = asyncio.Event()
        self._streams = 0
        self._on_streams = on_streams
        self._counter = counter or _NoCounter()
        #: The calls being answered: a stop answers them before the streams end (``base.inflight``).
        self.in_flight = InFlight()

    @property
    def streams(self) -> int:
        """kubelet's ListAndWatch streams open now (our own tools' streams are not counted)."""
        return self._streams

    def close(self) -> None:
        """End every ListAndWatch stream (the server is going away)."""
        self._closing.set()

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Context) -> api_pb2.DevicePluginOptions:
        # Units are identical, so no preferred allocation; nothing to do before a container starts.
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: Context
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        # Returning would make kubelet drop the resource, so this only ends when the server closes
        # or kubelet cancels (which arrives here as CancelledError and is left to propagate).
        counted = TOOL_METADATA not in tuple(context.invocation_metadata() or ())
        if counted:
            self._set_streams(self._streams + 1)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            sent = None
            while not self._closing.is_set():
                changed = self._resource.change_event()
                response = list_response(self._resource, self._withheld)
                if response is not sent:
                    if counted and self._on_sent is not None:
                        usable = self._resource.usable and not self._withheld
                        self._on_sent(self._resource.config.count if usable else 0)
                    yield response
                    sent = response
                waiter = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait((waiter, closing), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
        finally:
            closing.cancel()
            if counted:
                self._streams -= 1
                if not self._closing.is_set():
                    self._set_streams(self._streams)

    def _set_streams(self, streams: int) -> None:
        self._streams = streams
        if self._on_streams is not None:
            self._on_streams(streams)

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Context) -> api_pb2.AllocateResponse:
        with self.in_flight.call():
            return await self._allocate(request, context)

    async def _allocate(self, request: api_pb2.AllocateRequest, context: Context) -> api_pb2.AllocateResponse:
        refusal = self._refusal(request)
        if refusal is not None:
            code, message = refusal
            self._counter.allocate_error(self._resource.name, code.name)
            await context.abort(code, message)
        dev = self._resource.config
        responses = []
        for _ in request.container_requests:
            spec = api_pb2.DeviceSpec(container_path=dev.path, host_path=dev.path, permissions=dev.permissions)
            response = api_pb2.ContainerAllocateResponse(devices=[spec])
            if self._resource.cdi_device is not None:
                # Both: a runtime with CDI on applies the spec (our owner and mode), one with CDI off
                # ignores the name and grants the node from the DeviceSpec.
                response.cdi_devices.add(name=self._resource.cdi_device)
            responses.append(response)
        self._counter.allocation(self._resource.name)
        return api_pb2.AllocateResponse(container_responses=responses)

    def _refusal(self, request: api_pb2.AllocateRequest) -> tuple[grpc.StatusCode, str] | None:
        """Why the request cannot be granted (status code and message), or None."""
        name = self._resource.name
        if self._withheld:
            return grpc.StatusCode.FAILED_PRECONDITION, f"Allocate: {name}: {WITHHELD}; it is served through DRA"
        if not request.container_requests:
            return grpc.StatusCode.INVALID_ARGUMENT, "Allocate: no container requests"
        for index, creq in enumerate(request.container_requests):
            if not creq.devices_ids:
                return grpc.StatusCode.INVALID_ARGUMENT, f"Allocate: container request {index} names no device"
            for device_id in creq.devices_ids:
                if not self._resource.is_known_id(device_id):
                    return (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"Allocate: unknown device ID {device_id[:80]!r} for {name}",
                    )
            if not self._resource.usable:
                why = self._resource.unusable_reason
                return (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Allocate: device {creq.devices_ids[0]!r} of {name} is not usable now: {why}",
                )
        return None

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
