"""kubelet's own word on what it offers: the pod-resources API's allocatable devices per resource.

kubelet serves ``PodResourcesLister`` on ``<root-dir>/pod-resources/kubelet.sock`` (GA since 1.28; root only).
``GetAllocatableResources`` lists every device kubelet's device manager counts as healthy, for each
resource: the units the scheduler can have. That is the fact ``doctor`` wants when it asks whether kubelet
holds our registration; the daemon's own metrics can only say what the daemon believes.
"""

from __future__ import annotations

import os
import posixpath
from collections import Counter
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
    """kubelet's answer: healthy units per resource name (a resource it does not hold is absent)."""

    units: dict[str, int]


class Unanswered(Exception):
    """The API could not be asked (no socket, kubelet too old, no permission) or did not answer in time."""


async def allocatable(socket_path: str, timeout: float) -> Allocatable:
    """Ask kubelet which device units it holds as allocatable; raises ``Unanswered`` with the reason."""
    if look(socket_path) is Look.ABSENT:
        raise Unanswered(f"no {socket_path}")
    async with grpc.aio.insecure_channel(unix_target(socket_path), options=ONE_ATTEMPT) as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = await stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unanswered(f"{socket_path}: {exc.code().name}: {exc.details()}") from None
    units: Counter[str] = Counter()
    for devices in response.devices:
        units[devices.resource_name] += len(devices.device_ids)
    return Allocatable(dict(units))
