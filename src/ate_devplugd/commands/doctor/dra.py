"""``ate-devplugd doctor`` in DRA mode: what the API server holds for this node.

With the daemon's own credentials (the ``[dra]`` kubeconfig): the API server answers; each resource has
a DeviceClass whose ``extendedResourceName`` is the resource (what lets a pod's ``ate.dev/kvm: 1`` become
a claim; a class of ours stored without it is the API server's DRAExtendedResource gate off, named as
such); this node's slice of each resource is published, with devices in it. Whether kubelet holds the
driver's registration is the daemon's to say (its metrics, read by ``commands.doctor.daemon.registration_finding``).

kubelet's own credentials may not read DeviceClasses (neither the Node authorizer nor any default RBAC
binding grants a node that) until the read-only role of ``dra-manifests --kubelet-credentials`` is
applied; the service account of ``dra-manifests`` may. Where they may not, the DeviceClass check is one
WARN that says so and gives the command an administrator runs instead.

The layout the slices should have (``layout.decide``: ``sharing`` as set, or what the API server's
answer to a dry-run create allows) is said, and a published slice of the other layout is a WARN: a
daemon that decided before the cluster's gate changed (it decides at start), or a shared device the API
server made exclusive.

Credentials the API server does not accept (401) are a FAIL that says what to do: a token expired, or
bound to a Node that was deleted or created again, is replaced by a new one (the README's recipe); a
client certificate that expired points at kubelet's certificate rotation.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ate_devplugd.commands import gates
from ate_devplugd.commands.findings import Finding, fail, ok, warn
from ate_devplugd.commands.gates import Mapping
from ate_devplugd.config import Config, pools
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import class_name, pool_name
from ate_devplugd.dra import kubeconfig, layout
from ate_devplugd.dra.apiclient import SLICES, ApiClient, ApiError, ApiErrorKind, ApiUnavailable

DEVICE_CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
APPLY = "ate-devplugd dra-manifests --kubelet-credentials | kubectl apply -f -"
#: What an administrator runs where these credentials may not look: each DeviceClass and the resource it maps.
LIST_CLASSES = "kubectl get deviceclass -o custom-columns=NAME:.metadata.name,RESOURCE:.spec.extendedResourceName"
#: What to do about a token the API server refuses: mint one bound to this node (docs/dra.md, Credentials for DRA mode).
MINT = (
    "mint a new node-bound token and write it to the kubeconfig's tokenFile: kubectl create token ate-devplugd "
    "-n ate-devplugd --bound-object-kind Node --bound-object-name {node} --duration 24h "
    "(docs/dra.md: Credentials for DRA mode; the daemon picks it up without a restart)"
)
RENEW_CERTIFICATE = "kubelet's client certificate: check its rotation (/var/lib/kubelet/pki) and the kubeconfig"


async def findings(cfg: Config, dra: DraConfig, timeout: float) -> list[Finding]:
    try:
        credentials = kubeconfig.load(dra.kubeconfig)
    except kubeconfig.KubeconfigError as exc:
        return [fail("apiserver", str(exc), f"fix {dra.kubeconfig} (the [dra] kubeconfig)")]
    client = ApiClient(credentials)
    try:
        async with asyncio.timeout(timeout * 3):
            return await _examine(client, cfg, dra)
    except TimeoutError:
        return [fail("apiserver", f"{credentials.server} did not answer within {timeout * 3:g}s")]
    finally:
        await client.close()


async def _examine(client: ApiClient, cfg: Config, dra: DraConfig) -> list[Finding]:
    server = client.credentials.server
    selector = f"spec.nodeName={dra.node_name},spec.driver={dra.driver}"
    try:
        slices = await client.request("GET", SLICES, params={"fieldSelector": selector})
    except ApiUnavailable as exc:
        return [
            fail("apiserver", f"{server} cannot be reached: {exc}", "IPAddressAllow= in dra-mode.conf; the network")
        ]
    except ApiError as exc:
        if ApiErrorKind.of_status(exc.status) is ApiErrorKind.UNAUTHORIZED:
            return [_unauthorized(client, dra, exc)]
        return [fail("apiserver", f"{server} refuses these credentials: {exc}", f"check {dra.kubeconfig}")]
    out = [ok("apiserver", f"{server} answers with {dra.kubeconfig}")]
    classes: dict[str, Any] | None
    try:
        classes = await client.request("GET", DEVICE_CLASSES)
    except ApiError as exc:
        classes = None
        out.append(_classes_refused(exc))
    except ApiUnavailable as exc:
        classes = None
        out.append(warn("deviceclass", f"cannot list DeviceClasses: {exc}", f"an administrator runs: {LIST_CLASSES}"))
    by_pool = {obj.get("spec", {}).get("pool", {}).get("name"): obj for obj in slices.get("items") or []}
    choice = None
    if cfg.devices:
        choice, finding = await _layout(client, dra, cfg.devices[0].resource)
        out.append(finding)
    for dev in cfg.devices:
        if classes is not None:
            out.append(_device_class(classes, dev.resource, dra))
        obj = by_pool.get(pool_name(dra.node_name, dev.resource))
        check = f"slice {dev.resource}"
        if obj is None:
            out.append(
                fail(check, f"no ResourceSlice of {dra.driver} for {dra.node_name}", "systemctl status ate-devplugd")
            )
            continue
        count = len(obj.get("spec", {}).get("devices") or [])
        name = obj.get("metadata", {}).get("name", "?")
        if count:
            out.append(ok(check, f"{name} published with {count} device(s)"))
            if choice is not None:
                out.extend(_published_layout(check, name, obj, choice))
        else:
            out.append(fail(check, f"{name} holds no device (the device is absent)", "see the device line"))
    return out


def _unauthorized(client: ApiClient, dra: DraConfig, exc: ApiError) -> Finding:
    server = client.credentials.server
    if client.credentials.token:
        return fail(
            "apiserver",
            f"{server} does not accept the token of {dra.kubeconfig} ({exc}): it expired, or the Node it is "
            "bound to was deleted or created again",
            MINT.format(node=dra.node_name),
        )
    return fail(
        "apiserver",
        f"{server} does not accept the credentials of {dra.kubeconfig} ({exc}): an expired client certificate?",
        RENEW_CERTIFICATE,
    )


def _classes_refused(exc: ApiError) -> Finding:
    remedy = f"an administrator runs: {LIST_CLASSES}"
    if ApiErrorKind.of_status(exc.status) is not ApiErrorKind.FORBIDDEN:
        return warn("deviceclass", f"cannot list DeviceClasses: {exc}", remedy)
    return warn(
        "deviceclass",
        "these credentials may not list DeviceClasses, so no resource's DeviceClass is checked here "
        "(kubelet's own may once the read-only role of dra-manifests --kubelet-credentials is applied; the "
        "service account that dra-manifests sets up may): " + exc.message,
        f"{remedy}; or let nodes read them: {APPLY}",
    )


def _device_class(classes: dict[str, Any], resource: str, dra: DraConfig) -> Finding:
    """The stored classes as ``switch-mode`` reads them back (``commands.gates.mapping``): mapped; named
    by a class of another driver; or not mapped, where a class of ours stored without the field is the API
    server's DRAExtendedResource gate, not a missing manifest."""
    check = f"deviceclass {resource}"
    verdict = gates.mapping(classes, resource, dra.driver, class_name(resource))
    if verdict.mapping is Mapping.MAPPED:
        return ok(check, f"{verdict.name} has extendedResourceName {resource}")
    if verdict.mapping is Mapping.OTHER_DRIVER:
        return fail(check, f"{verdict.name} names {resource} but does not select driver {dra.driver}", APPLY)
    if verdict.mapping is Mapping.DROPPED:
        return fail(check, gates.dropped_line(verdict.name, resource), gates.DROPPED_REMEDY)
    return fail(check, f"no DeviceClass has extendedResourceName {resource}", APPLY)


async def _layout(client: ApiClient, dra: DraConfig, resource: str) -> tuple[layout.LayoutChoice | None, Finding]:
    try:
        choice = await layout.decide(client, dra, layout.trial_pool(dra, resource))
    except (ApiError, ApiUnavailable) as exc:
        return None, warn("layout", f"cannot ask the API server which layout it keeps: {exc}")
    return choice, ok("layout", str(choice))


def _published_layout(check: str, name: str, obj: dict[str, Any], choice: layout.LayoutChoice) -> list[Finding]:
    """A WARN when the published slice has not the layout chosen now."""
    devices = obj.get("spec", {}).get("devices") or []
    shared = any(d.get("allowMultipleAllocations") for d in devices)
    if shared == (choice.layout is Layout.SHARED):
        return []
    have = "one shared device" if shared else f"{len(devices)} exclusive device(s)"
    if choice.why is layout.Why.CONFIG:
        remedy = f'enable the {pools.CONSUMABLE_CAPACITY_GATE} feature gate, or set sharing = "units"'
    else:
        remedy = "systemctl restart ate-devplugd (the layout is decided at start)"
    return [warn(check, f"{name} holds {have}, not the layout {choice}", remedy)]
