"""``doctor`` on a node half-way through ``switch-mode``: the config's mode against the running daemon's
(from the copy of its config in its runtime directory), and, where the config has a ``[dra]`` table, a
cordon that ``switch-mode`` put on the Node and has not lifted (its annotation), read with the ``[dra]``
kubeconfig. Either says how to finish the move and how to go back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ate_devplugd.commands.findings import Finding, ok, warn
from ate_devplugd.commands.switch_files import CORDON_ANNOTATION, CORDON_VALUE, running_mode
from ate_devplugd.config import Config
from ate_devplugd.config.dra import DraConfig

CHECK = "switch-mode"


def _ways(mode: str) -> str:
    other = "device-plugin" if mode == "dra" else "dra"
    return f"finish with `ate-devplugd switch-mode {mode}`, or go back with `ate-devplugd switch-mode {other}`"


async def findings(cfg: Config, running_config: str, timeout: float) -> list[Finding]:
    found: list[Finding] = []
    running = running_mode(running_config)
    if running is not None and running != cfg.mode:
        found.append(
            warn(
                CHECK,
                f"half-way: the config says mode {cfg.mode}, the running daemon runs {running} mode",
                _ways(cfg.mode),
            )
        )
    node = await _node(cfg.dra, timeout) if cfg.dra is not None else None
    if cfg.dra is not None and node is not None:
        ours = (node.get("metadata", {}).get("annotations") or {}).get(CORDON_ANNOTATION) == CORDON_VALUE
        if ours and (node.get("spec") or {}).get("unschedulable"):
            found.append(
                warn(CHECK, f"node {cfg.dra.node_name} is cordoned by an unfinished switch-mode", _ways(cfg.mode))
            )
    if not found and running is not None:
        found.append(ok(CHECK, f"no move under way: the config and the running daemon are in {cfg.mode} mode"))
    return found


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
