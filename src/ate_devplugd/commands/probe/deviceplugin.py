"""``ate-devplugd probe`` in device-plugin mode: ask every plugin socket what kubelet would, and print
what the node offers: units, the DeviceSpecs and the CDI devices a trial Allocate answers with, or why
a device of ours is withheld (``cri.usable``).
(DRA mode's probe is ``commands/probe/dra.py``.)"""

from __future__ import annotations

import asyncio
import os
import posixpath
import re
import stat
from dataclasses import dataclass

import grpc

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.base.unixsock import unix_target
from ate_devplugd.commands.findings import format_table
from ate_devplugd.deviceplugin.servicer import TOOL_METADATA
from ate_devplugd.kubelet.watch import KUBELET_SOCKET
from ate_devplugd.node.devices import HEALTHY


@dataclass
class Row:
    resource: str
    socket: str
    healthy: int = 0
    total: int = 0
    grants: str = ""
    #: The CDI devices the trial Allocate names (what a runtime with CDI on resolves), "" for none.
    cdi: str = ""
    error: str = ""


def plugin_sockets(plugin_dir: str) -> list[str]:
    """Socket files in the directory, kubelet's own excepted."""
    names = []
    for name in sorted(os.listdir(plugin_dir)):
        if name == KUBELET_SOCKET:
            continue
        try:
            if stat.S_ISSOCK(os.lstat(posixpath.join(plugin_dir, name)).st_mode):
                names.append(name)
        except OSError:
            continue
    return names


async def probe_socket(plugin_dir: str, name: str, resource: str | None, timeout: float) -> Row:
    """GetDevicePluginOptions, the first ListAndWatch message and, for our own sockets, a trial Allocate."""
    row = Row(resource=resource or "-", socket=name)
    async with grpc.aio.insecure_channel(unix_target(posixpath.join(plugin_dir, name))) as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=timeout)
            call = stub.ListAndWatch(api_pb2.Empty(), metadata=(TOOL_METADATA,))
            try:
                first = await asyncio.wait_for(call.read(), timeout)
            finally:
                call.cancel()
            if first is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs lacks EOF
                row.error = "ListAndWatch ended without a device list"
                return row
            healthy = [d.ID for d in first.devices if d.health == HEALTHY]
            row.healthy, row.total = len(healthy), len(first.devices)
            if resource is None:
                row.grants = "(not ours: no trial Allocate)"
            elif not healthy:
                row.grants = "(no healthy unit to allocate)"
            else:
                request = api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[healthy[0]])]
                )
                response = await stub.Allocate(request, timeout=timeout)
                specs = [s for c in response.container_responses[:1] for s in c.devices]
                row.grants = ", ".join(f"{s.host_path} -> {s.container_path} ({s.permissions})" for s in specs)
                row.cdi = ", ".join(d.name for c in response.container_responses[:1] for d in c.cdi_devices)
        except grpc.aio.AioRpcError as exc:
            row.error = f"{exc.code().name}: {exc.details()}"
        except TimeoutError:
            row.error = f"no answer within {timeout:g}s"
    return row


async def probe_all(plugin_dir: str, ours: dict[str, str], timeout: float = 5.0, metrics_file: str = "") -> list[Row]:
    """Every socket probed; where one of ours offers no healthy unit, why the daemon withholds it (its
    metrics file's ``ate_devplugd_device_withheld``: ListAndWatch carries no reason)."""
    names = plugin_sockets(plugin_dir)
    rows = list(await asyncio.gather(*(probe_socket(plugin_dir, n, ours.get(n), timeout) for n in names)))
    text = _read(metrics_file)
    for row in rows:
        reason = withheld_reason(text, row.resource) if row.total and not row.healthy else None
        if reason is not None and not row.error:
            row.grants = f"(withheld: {reason}; no unit offered)"
    return rows


def withheld_reason(metrics: str, resource: str) -> str | None:
    """The reason the daemon's metrics file gives for withholding ``resource``, or None."""
    for m in _WITHHELD.finditer(metrics):
        labels: dict[str, str] = dict(_LABEL.findall(m[1]))
        if labels.get("resource") == resource and "reason" in labels:
            return labels["reason"]
    return None


_WITHHELD = re.compile(r"^ate_devplugd_device_withheld\{([^}]*)\} 1(?:\.0)?$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def render(rows: list[Row]) -> str:
    table = [("RESOURCE", "SOCKET", "HEALTHY/TOTAL", "CDI", "GRANTS")]
    for row in rows:
        units = f"{row.healthy}/{row.total}" if not row.error else "-"
        grants = row.grants if not row.error else f"ERROR {row.error}"
        table.append((row.resource, row.socket, units, row.cdi or "-", grants))
    return format_table(table)
