"""``switch-mode``'s first step, before it cordons: what the move needs, or a refusal that changes nothing.

- **The daemon.** A daemon serves the config and kubelet holds it (``switch_daemon.unheld``): with none
  running, the command starts the unit first and waits for it; one that is starting or not held yet
  (a watchdog restart, a crash, kubelet away) is waited for. A move that is already under way (the node
  cordoned by ``switch-mode``) needs none of this: its restart is still to come.
- **A move to DRA: the cluster maps the name.** Each resource's DeviceClass is read back from the API
  server, which drops ``extendedResourceName`` while its ``DRAExtendedResource`` gate is off; kubelet's own
  gates are read from its command line and config file (``commands.gates``), with the version from the
  Node (``status.nodeInfo.kubeletVersion``: kubelet's own word). A gate that is off, or that cannot be
  seen to be on, refuses the move with the gate named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ate_devplugd.commands import gates, instance, switch_daemon
from ate_devplugd.commands.gates import Mapping
from ate_devplugd.commands.switch_files import UNIT, Host, SwitchFailed
from ate_devplugd.config import Config
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import class_name
from ate_devplugd.cri import ask as runtime_ask
from ate_devplugd.cri.facts import parse_version
from ate_devplugd.dra.apiclient import ApiClient, ApiError, ApiErrorKind

DEVICE_CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
LIST_CLASSES = "kubectl get deviceclass -o custom-columns=NAME:.metadata.name,RESOURCE:.spec.extendedResourceName"


async def daemon(config: Config, host: Host, timeout: float, waiting: Callable[[str], None]) -> tuple[bool, str]:
    """A daemon serving ``config`` that kubelet holds, the unit started first where none runs: whether it
    was started, and what was found; or SwitchFailed (nothing changed)."""
    resources = [dev.resource for dev in config.devices]
    started = ""
    if await instance.serving(config) is None:
        await host.systemctl("start", UNIT)
        started = f"{UNIT} started (no daemon served the config); "
    try:
        running = await switch_daemon.until(
            config,
            lambda r: switch_daemon.unheld(r.record, resources, healthy=False),
            timeout,
            waiting,
            "the daemon before the move",
        )
    except SwitchFailed as exc:
        raise SwitchFailed(f"{exc}; see systemctl status {UNIT} and journalctl -u {UNIT}") from None
    return bool(started), f"{started}the daemon (pid {running.pid}, {running.record.mode} mode) is held by kubelet"


async def cluster(
    clients: Sequence[ApiClient], dra: DraConfig, resources: Sequence[str], node: dict[str, Any], proc_root: str
) -> str:
    """For a move to DRA: the stored DeviceClasses map each resource, and kubelet has the gates on; what
    was found, or SwitchFailed naming what is missing."""
    classes = await _device_classes(clients)
    for resource in resources:
        verdict = gates.mapping(classes, resource, dra.driver, class_name(resource))
        if verdict.mapping is Mapping.DROPPED:
            raise SwitchFailed(f"{gates.dropped_line(verdict.name, resource)}; {gates.DROPPED_REMEDY}")
        if verdict.mapping is Mapping.OTHER_DRIVER:
            raise SwitchFailed(
                f"DeviceClass {verdict.name} maps {resource} but selects no device of {dra.driver}: pods would "
                f"be sent to another driver's devices; {APPLY_HINT}"
            )
        if verdict.mapping is Mapping.NONE:
            raise SwitchFailed(f"no DeviceClass maps {resource} (extendedResourceName); {APPLY_HINT}")
    return f"the DeviceClasses map {', '.join(resources)} (read back); {kubelet(dra, node, proc_root)}"


APPLY_HINT = "apply them (ate-devplugd dra-manifests --kubelet-credentials | kubectl apply -f -) and read them back"


async def _device_classes(clients: Sequence[ApiClient]) -> dict[str, Any]:
    """The stored DeviceClasses, read with the first credentials that may (the daemon's, then the
    command's); SwitchFailed where none may."""
    refused = []
    for client in clients:
        try:
            return await client.request("GET", DEVICE_CLASSES)
        except ApiError as exc:
            if ApiErrorKind.of_status(exc.status) is not ApiErrorKind.FORBIDDEN:
                raise
            refused.append(exc.message or str(exc))
    raise SwitchFailed(
        "cannot read the DeviceClasses back, so nothing proves the cluster maps the resources to the DRA path ("
        + "; ".join(refused)
        + "): let nodes read them (ate-devplugd dra-manifests --kubelet-credentials | kubectl apply -f -: a "
        "read-only role for the group system:nodes), or give --kubeconfig a credential that may; an "
        f"administrator sees them with: {LIST_CLASSES}"
    )


def kubelet(dra: DraConfig, node: dict[str, Any], proc_root: str) -> str:
    """kubelet's gates for DRA mode, as its process shows them; SwitchFailed for one off or not seen on."""
    names = gates.needed(dra.sharing is Layout.SHARED)
    info = (node.get("status") or {}).get("nodeInfo") or {}
    version_text = str(info.get("kubeletVersion") or "")
    version = parse_version(version_text) if version_text else None
    process = runtime_ask.read_kubelet(proc_root)
    if process is None:
        found = [gates.default(name, version) for name in names]
        seen = f"no kubelet process in {proc_root}; "
    else:
        found = gates.kubelet_gates(process, names, version)
        seen = f"kubelet (pid {process.pid}"
        seen += f", {version_text}); " if version_text else "); "
    off = [gate for gate in found if not gate.on]
    if off:
        what = "; ".join(str(gate) for gate in off)
        raise SwitchFailed(
            f"kubelet would fail every pod sent down the DRA path: {seen}{what}; {gates.turn_on(off, process)}"
        )
    return f"kubelet: {seen}" + ", ".join(str(gate) for gate in found)
