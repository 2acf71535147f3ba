"""``ate-devplugd probe`` in DRA mode: what kubelet and the scheduler see of this node's driver.

Three looks, each on its own, none changing anything (no claim is prepared):
- kubelet's plugin watcher: the registration socket's GetInfo, within kubelet's own 1 s;
- kubelet's DRA manager: the plugin socket GetInfo names answers (a NodeUnprepareResources of no
  claim), and the health stream's first message (how many devices are healthy);
- the scheduler: this node's ResourceSlices of the driver, read with the ``[dra]`` kubeconfig, and the
  layout they should have (``layout.decide``: the configured one, or what the API server's answer to a
  dry-run create allows), beside the layout each one has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ate_devplugd._pb.dra.v1 import api_pb2 as v1_pb2
from ate_devplugd._pb.dra.v1 import api_pb2_grpc as v1_grpc
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2 as health_pb2
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from ate_devplugd._pb.pluginregistration.v1 import api_pb2 as reg_pb2
from ate_devplugd._pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from ate_devplugd.commands.findings import format_table
from ate_devplugd.config import pools
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.dra import kubeconfig, layout
from ate_devplugd.dra.apiclient import SLICES, ApiClient, ApiError, ApiUnavailable
from ate_devplugd.dra.service import PLUGIN_TYPE

#: kubelet's deadline for GetInfo (its plugin watcher gives up after this).
GET_INFO_TIMEOUT = 1.0
#: The resource a layout is asked about while no slice names one.
DEFAULT_RESOURCE = "ate.dev/kvm"


@dataclass
class Check:
    what: str
    where: str
    result: str
    ok: bool = True


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    slices: list[dict[str, Any]] = field(default_factory=list)
    #: The layout the slices should have (None: the API server could not be asked).
    choice: layout.LayoutChoice | None = None

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)


async def probe(
    config: DraConfig, timeout: float, load_credentials: Callable[[str], kubeconfig.Credentials] = kubeconfig.load
) -> Report:
    report = Report()
    endpoint = await _registration(config, min(timeout, GET_INFO_TIMEOUT), report)
    await _plugin(endpoint, timeout, report)
    await _slices(config, load_credentials, timeout, report)
    return report


async def _registration(config: DraConfig, timeout: float, report: Report) -> str:
    """GetInfo as kubelet's plugin watcher asks it; the endpoint it names (the configured one if none)."""
    path = config.registration_socket
    async with grpc.aio.insecure_channel("unix:" + path) as channel:
        try:
            info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            report.checks.append(Check("registration", path, f"ERROR {exc.code().name}: {exc.details()}", ok=False))
            return config.plugin_socket
    versions = " ".join(info.supported_versions)
    text = f"GetInfo: {info.type} {info.name}, {versions}, endpoint {info.endpoint}"
    ok = info.type == PLUGIN_TYPE and info.name == config.driver
    if not ok:
        text = f"ERROR not this driver's ({PLUGIN_TYPE} {config.driver}): {text}"
    report.checks.append(Check("registration", path, text, ok))
    return info.endpoint or config.plugin_socket


async def _plugin(path: str, timeout: float, report: Report) -> None:
    """The DRAPlugin (v1) answers, and the health stream's first message."""
    async with grpc.aio.insecure_channel("unix:" + path) as channel:
        try:
            await v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                v1_pb2.NodeUnprepareResourcesRequest(), timeout=timeout
            )
            call = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(health_pb2.NodeWatchResourcesRequest())
            try:
                first = await asyncio.wait_for(call.read(), timeout)
            finally:
                call.cancel()
        except grpc.aio.AioRpcError as exc:
            report.checks.append(Check("plugin", path, f"ERROR {exc.code().name}: {exc.details()}", ok=False))
            return
        except TimeoutError:
            report.checks.append(Check("plugin", path, f"ERROR no health report within {timeout:g}s", ok=False))
            return
    if first is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs lacks EOF
        report.checks.append(Check("plugin", path, "ERROR the health stream ended at once", ok=False))
        return
    healthy = sum(1 for d in first.devices if d.health == health_pb2.HEALTHY)
    text = f"DRAPlugin v1 answers; health: {healthy}/{len(first.devices)} devices healthy"
    report.checks.append(Check("plugin", path, text))


async def _slices(
    config: DraConfig,
    load_credentials: Callable[[str], kubeconfig.Credentials],
    timeout: float,
    report: Report,
) -> None:
    """This node's slices of the driver, as the scheduler reads them."""
    try:
        credentials = load_credentials(config.kubeconfig)
    except kubeconfig.KubeconfigError as exc:
        report.checks.append(Check("slices", config.kubeconfig, f"ERROR {exc}", ok=False))
        return
    client = ApiClient(credentials)
    selector = f"spec.nodeName={config.node_name},spec.driver={config.driver}"
    try:
        async with asyncio.timeout(timeout):
            listing = await client.request("GET", SLICES, params={"fieldSelector": selector})
    except (ApiError, ApiUnavailable) as exc:
        report.checks.append(Check("slices", credentials.server, f"ERROR {exc}", ok=False))
        return
    except TimeoutError:
        report.checks.append(Check("slices", credentials.server, f"ERROR no answer within {timeout:g}s", ok=False))
        return
    finally:
        await client.close()
    report.slices = sorted(listing.get("items") or [], key=lambda o: pools.pool_of(o)[0])
    count = len(report.slices)
    text = f"{count} ResourceSlice{'' if count == 1 else 's'} of {config.driver} on node {config.node_name}"
    report.checks.append(Check("slices", credentials.server, text if count else f"ERROR {text}", ok=bool(count)))
    await _layout(config, load_credentials, timeout, report)


async def _layout(
    config: DraConfig, load_credentials: Callable[[str], kubeconfig.Credentials], timeout: float, report: Report
) -> None:
    """The layout the slices should have: the configured one, or the one the API server's answer allows."""
    resource = next((_resource(obj) for obj in report.slices if _resource(obj)), DEFAULT_RESOURCE)
    client = ApiClient(load_credentials(config.kubeconfig))
    try:
        async with asyncio.timeout(timeout):
            choice = await layout.decide(client, config, layout.trial_pool(config, resource))
    except (ApiError, ApiUnavailable) as exc:
        report.checks.append(Check("layout", client.credentials.server, f"ERROR cannot ask: {exc}", ok=False))
        return
    except TimeoutError:
        report.checks.append(
            Check("layout", client.credentials.server, f"ERROR no answer within {timeout:g}s", ok=False)
        )
        return
    finally:
        await client.close()
    report.choice = choice
    report.checks.append(Check("layout", client.credentials.server, str(choice)))


def _resource(obj: dict[str, Any]) -> str:
    """The resource a slice's first device offers ("" for none)."""
    for device in obj.get("spec", {}).get("devices") or []:
        return str(device.get("attributes", {}).get(pools.RESOURCE_ATTRIBUTE, {}).get("string", ""))
    return ""


def render(report: Report) -> str:
    text = format_table([("CHECK", "WHERE", "RESULT"), *((c.what, c.where, c.result) for c in report.checks)])
    if report.slices:
        rows: list[tuple[str, ...]] = [("SLICE", "POOL", "GENERATION", "DEVICES", "LAYOUT")]
        for obj in report.slices:
            pool, generation = pools.pool_of(obj)
            devices = obj.get("spec", {}).get("devices") or []
            name = str(obj.get("metadata", {}).get("name", ""))
            rows.append((name, pool, str(generation), str(len(devices)), _layout_of(devices)))
        text += "\n\n" + format_table(rows)
    return text


def _layout_of(devices: list[dict[str, Any]]) -> str:
    """What a published slice's devices say of its layout (a shared device the API server made exclusive: units)."""
    if not devices:
        return "-"
    if any(d.get("allowMultipleAllocations") for d in devices):
        return "shared"
    return "units"
