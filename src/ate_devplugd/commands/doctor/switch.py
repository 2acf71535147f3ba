"""``doctor`` on a node half-way through ``switch-mode``, or left with what a move keeps for later.

- **A move under way or interrupted**: ``switch-mode`` notes on the Node, from its cordon to its end, the
  mode it moves to (its target annotation, read with the ``[dra]`` kubeconfig). That is the way to finish,
  whatever the file says yet: a move to DRA interrupted during its settle still has a file in
  device-plugin mode. The other mode is the way back.
- **The file and the running daemon in different modes** (the daemon's record: ``commands.instance``):
  half-way, the file's mode is the way to finish.
- **The drop-in kept** (``dra-mode.conf`` beside a daemon in device-plugin mode): the move back keeps it
  while DRA pods are left, whose claims the unprepare-only driver serves; once none is left it only keeps
  DRA mode's wider sandbox, and a WARN says so with the command that removes it.

For a mode difference the remedy is always ``switch-mode``, never a restart: a restart is the recipe that
loses the pods arriving meanwhile (docs/switching.md).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from typing import Any

from ate_devplugd.commands.findings import Finding, ok, warn
from ate_devplugd.commands.instance import Found
from ate_devplugd.commands.switch_files import CORDON_ANNOTATION, CORDON_VALUE, DROPIN_NAME, TARGET_ANNOTATION
from ate_devplugd.commands.switch_pods import dra_pods
from ate_devplugd.config.dra import DraConfig

CHECK = "switch-mode"


def _ways(toward: str) -> str:
    """How to finish a move toward ``toward``, and how to go back."""
    back = "device-plugin" if toward == "dra" else "dra"
    return f"finish with `ate-devplugd switch-mode {toward}`, or go back with `ate-devplugd switch-mode {back}`"


async def findings(found: Found, timeout: float, dropin_dir: str) -> list[Finding]:
    out: list[Finding] = []
    file = found.file
    running = found.running.record.mode if found.running is not None else None
    cfg = file or found.config
    dra = cfg.dra if cfg is not None else None
    resources = [dev.resource for dev in cfg.devices] if cfg is not None else []
    node, pods = await _cluster(dra, resources, timeout) if dra is not None else (None, None)
    annotations = ((node or {}).get("metadata") or {}).get("annotations") or {}
    ours = annotations.get(CORDON_ANNOTATION) == CORDON_VALUE and bool(
        ((node or {}).get("spec") or {}).get("unschedulable")
    )
    target = annotations.get(TARGET_ANNOTATION)
    daemon = f"the daemon runs {running} mode" if running is not None else "no daemon runs"
    state = f"the file says mode {file.mode if file is not None else '(the file does not load)'}, {daemon}"
    if dra is not None and target in ("dra", "device-plugin"):
        cordon = "is cordoned by" if ours else "carries the target of"
        out.append(
            warn(
                CHECK,
                f"node {dra.node_name} {cordon} an unfinished switch-mode toward {target} ({state})",
                _ways(target),
            )
        )
    elif dra is not None and ours:  # a cordon of an older switch-mode, which noted no target
        toward = file.mode if file is not None else running or "dra"
        out.append(
            warn(CHECK, f"node {dra.node_name} is cordoned by an unfinished switch-mode ({state})", _ways(toward))
        )
    elif file is not None and running is not None and running != file.mode:
        out.append(
            warn(CHECK, f"half-way: the file says mode {file.mode}, the daemon runs {running} mode", _ways(file.mode))
        )
    dropin = posixpath.join(dropin_dir, DROPIN_NAME)
    if not out and running == "device-plugin" and dra is not None and os.path.lexists(dropin):
        out.append(_kept(dropin, dra, pods))
    if not out and running is not None:
        out.append(ok(CHECK, f"no move under way: the file and the running daemon are in {running} mode"))
    return out


def _kept(dropin: str, dra: DraConfig, pods: int | None) -> Finding:
    """The drop-in beside a daemon in device-plugin mode: kept for the DRA pods left, or for nothing."""
    if pods:
        return ok(
            CHECK,
            f"{dropin} is kept while {pods} DRA pod(s) are left on node {dra.node_name} (the unprepare-only driver "
            "serves their claims); switch-mode device-plugin removes it once they are gone",
        )
    left = "no DRA pod is left" if pods == 0 else "the API server cannot be asked whether DRA pods are left"
    return warn(
        CHECK,
        f"{dropin} is kept, but {left} on node {dra.node_name}: the unit keeps DRA mode's wider sandbox (TCP to "
        "the API server, kubelet's plugin directories writable)",
        "ate-devplugd switch-mode device-plugin",
    )


async def _cluster(dra: DraConfig, resources: list[str], timeout: float) -> tuple[dict[str, Any] | None, int | None]:
    """This node's Node and how many pods bound to it took the DRA path; None for what the API server does
    not answer (the DRA checks say why)."""
    from ate_devplugd.dra import kubeconfig  # noqa: PLC0415 - aiohttp only with a [dra] table
    from ate_devplugd.dra.apiclient import PODS, ApiClient, ApiError, ApiUnavailable, node_path  # noqa: PLC0415

    try:
        api = ApiClient(kubeconfig.load(dra.kubeconfig))
    except (kubeconfig.KubeconfigError, OSError):
        return None, None
    node = pods = None
    try:
        async with asyncio.timeout(timeout):
            node = await api.request("GET", node_path(dra.node_name))
            listing = await api.request("GET", PODS, params={"fieldSelector": f"spec.nodeName={dra.node_name}"})
            pods = dra_pods(listing.get("items") or [], resources)
    except (ApiError, ApiUnavailable, TimeoutError, OSError):
        pass
    finally:
        await api.close()
    return node, pods
