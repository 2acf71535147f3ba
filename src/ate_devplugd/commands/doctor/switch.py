"""``doctor`` on a node half-way through ``switch-mode``: the file's mode against the mode of the daemon
that serves it (its record: ``commands.instance``), and, where the config has a ``[dra]`` table, a cordon
that ``switch-mode`` put on the Node and has not lifted (its annotation), read with the ``[dra]``
kubeconfig. Either says how to finish the move and how to go back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ate_devplugd.commands.findings import Finding, ok, warn
from ate_devplugd.commands.instance import Found
from ate_devplugd.commands.switch_files import CORDON_ANNOTATION, CORDON_VALUE
from ate_devplugd.config.dra import DraConfig

CHECK = "switch-mode"


def _ways(toward: str) -> str:
    """How to finish a move toward ``toward`` (the mode the file names), and how to go back."""
    back = "device-plugin" if toward == "dra" else "dra"
    return f"finish with `ate-devplugd switch-mode {toward}`, or go back with `ate-devplugd switch-mode {back}`"


async def findings(found: Found, timeout: float) -> list[Finding]:
    out: list[Finding] = []
    file = found.file
    running = found.running.record.mode if found.running is not None else None
    toward = file.mode if file is not None else running
    if file is not None and running is not None and toward is not None and running != file.mode:
        out.append(
            warn(
                CHECK,
                f"half-way: the file says mode {file.mode}, the daemon runs {running} mode",
                _ways(toward),
            )
        )
    cfg = file or found.config
    dra = cfg.dra if cfg is not None else None
    node = await _node(dra, timeout) if dra is not None else None
    if dra is not None and node is not None and toward is not None:
        ours = (node.get("metadata", {}).get("annotations") or {}).get(CORDON_ANNOTATION) == CORDON_VALUE
        if ours and (node.get("spec") or {}).get("unschedulable"):
            out.append(warn(CHECK, f"node {dra.node_name} is cordoned by an unfinished switch-mode", _ways(toward)))
    if not out and running is not None:
        out.append(ok(CHECK, f"no move under way: the file and the running daemon are in {running} mode"))
    return out


async def _node(dra: DraConfig, timeout: float) -> dict[str, Any] | None:
    """This node's Node, or None where the API server does not answer (the DRA checks say why)."""
    from ate_devplugd.dra import kubeconfig  # noqa: PLC0415 - aiohttp only with a [dra] table
    from ate_devplugd.dra.apiclient import ApiClient, ApiError, ApiUnavailable, node_path  # noqa: PLC0415

    try:
        async with asyncio.timeout(timeout):
            api = ApiClient(kubeconfig.load(dra.kubeconfig))
            try:
                return await api.request("GET", node_path(dra.node_name))
            finally:
                await api.close()
    except (ApiError, ApiUnavailable, kubeconfig.KubeconfigError, TimeoutError, OSError):
        return None
