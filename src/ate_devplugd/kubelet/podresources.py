"""kubelet's own word on what it offers: the pod-resources API's allocatable devices per resource.

kubelet serves ``PodResourcesLister`` on ``<root-dir>/pod-resources/kubelet.sock`` (root only).
``GetAllocatableResources`` (KEP-2403: alpha in 1.21, beta and on by default from 1.23, GA in 1.28, its gate
removed in 1.30) lists every device kubelet's device manager counts as healthy, for each resource: the
units the scheduler can have (its ``GetAllocatableDevices``: every known device filtered by the healthy
set). A resource whose units are all Unhealthy is listed with none, exactly as one kubelet does not hold
at all. That is the fact ``doctor`` wants when it asks whether kubelet holds our registration, and the one
the daemon's sessions follow (``kubelet.word``); the daemon's own metrics can only say what it believes.
An older kubelet answers UNIMPLEMENTED (or, 1.21-1.22 with the gate off, an error).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

import grpc

from ate_devplugd._pb.podresources.v1 import api_pb2, api_pb2_grpc
from ate_devplugd.base.look import Look, look
from ate_devplugd.base.unixsock import ONE_ATTEMPT, unix_target

#: Beside the device-plugin directory, under kubelet's root directory.
SOCKET = "pod-resources/kubelet.sock"


def socket_for(plugin_dir: str) -> str:
    """Where the kubelet that owns ``plugin_dir`` (``<root>/device-plugins``) serves the pod-resources API."""
    return posixpath.join(posixpath.dirname(os.path.normpath(plugin_dir)), SOCKET)


@dataclass(frozen=True)
class Allocatable:
    """kubelet's answer: the healthy device IDs per resource name (a resource it does not hold is absent)."""

    ids: dict[str, frozenset[str]]

    @property
    def units(self) -> dict[str, int]:
        """How many units kubelet offers of each resource."""
        return {name: len(ids) for name, ids in self.ids.items()}


class Unanswered(Exception):
    """The API could not be asked (no socket, kubelet too old, no permission) or did not answer in time;
    ``lasting`` when asking again will not help (an older kubelet, a permission), not a kubelet starting."""

    def __init__(self, reason: str, *, lasting: bool = False) -> None:
        super().__init__(reason)
        self.lasting = lasting


#: Answers that asking again does not change: a kubelet without the call, a socket we may not use.
_LASTING = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


async def allocatable(socket_path: str, timeout: float) -> Allocatable:
    """Ask kubelet which device units it holds as allocatable; raises ``Unanswered`` with the reason."""
    if look(socket_path) is Look.ABSENT:
        raise Unanswered(f"no {socket_path}")
    async with grpc.aio.insecure_channel(unix_target(socket_path), options=ONE_ATTEMPT) as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = await stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            reason = f"{socket_path}: {exc.code().name}: {exc.details()}"
            raise Unanswered(reason, lasting=exc.code() in _LASTING) from None
    ids: dict[str, set[str]] = {}
    for devices in response.devices:
        ids.setdefault(devices.resource_name, set()).update(devices.device_ids)
    return Allocatable({name: frozenset(found) for name, found in ids.items()})
