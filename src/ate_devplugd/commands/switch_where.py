"""Where a ``switch-mode`` run that did not finish leaves the node (a failure, a timeout, a signal, a lost
API server), said in three lines: what ended it; the Node's cordon, the config file's mode and the running
daemon, each as read now (the Node with a short deadline: an API server that does not answer leaves what
this run knew); and the ways on. The cordon is never lifted here: a node half-way takes no new pods.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, NamedTuple

from ate_devplugd import config as configmod
from ate_devplugd.commands import instance, switch_daemon
from ate_devplugd.commands.switch_files import CORDON_ANNOTATION, CORDON_VALUE, TARGET_ANNOTATION, HostFiles
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.dra.apiclient import ApiClient, ApiError, ApiUnavailable, node_path

#: How long the Node and the daemon's record are waited for here.
LOOK = 2.0


class Run(NamedTuple):
    """What the run knew when it ended."""

    target: str
    step: int
    #: Whether the cordon on the Node is the run's (an earlier run's counts), as far as it knew.
    cordoned: bool
    node_name: str
    files: HostFiles
    #: A guarded handover (``commands.guard``: switch-mode's steps around it, the mode kept), not a move.
    handover: bool = False

    @property
    def name(self) -> str:
        return f"the guarded handover ({self.target} mode)" if self.handover else f"switch-mode {self.target}"


def other(mode: str) -> str:
    return "device-plugin" if mode == "dra" else "dra"


async def lines(run: Run, why: str, config: Config, api: ApiClient | None) -> list[str]:
    """The three lines (two when nothing was changed)."""
    node = await _node(run, api)
    if run.step <= 1 and not run.cordoned and node != "cordoned":
        return [
            f"{run.name} did not start: {why}",
            "nothing was changed: the node is not cordoned by switch-mode, the config and the daemon are as they were",
        ]
    cordon = {
        "cordoned": f"cordoned by switch-mode toward {run.target} (it takes no new pods; the cordon stays)",
        "not cordoned": "not cordoned by switch-mode",
    }.get(node, node)
    return [
        f"{run.name} did not finish: {why}",
        f"where the node stands: {cordon}; {_file(run.files)}; {await _daemon(config)}",
        _ways(run),
    ]


def _ways(run: Run) -> str:
    if run.handover:  # switch-mode to the mode it is in: the cordon's steps to their end, a restart if none serves
        return (
            f"run `ate-devplugd switch-mode {run.target}` to finish: it starts the daemon if none serves, and lifts "
            "the cordon once kubelet holds it (`ate-devplugd doctor` says the same)"
        )
    return (
        f"run `ate-devplugd switch-mode {run.target}` again to finish, or `ate-devplugd switch-mode "
        f"{other(run.target)}` to go back (`ate-devplugd doctor` says the same)"
    )


async def _node(run: Run, api: ApiClient | None) -> str:
    """ "cordoned" (by switch-mode), "not cordoned", or what this run knew where the API server does not answer."""
    if api is not None:
        with contextlib.suppress(ApiError, ApiUnavailable, TimeoutError, OSError):
            async with asyncio.timeout(LOOK):
                node: dict[str, Any] = await api.request("GET", node_path(run.node_name))
            ours = (node["metadata"].get("annotations") or {}).get(CORDON_ANNOTATION) == CORDON_VALUE
            unschedulable = bool((node.get("spec") or {}).get("unschedulable"))
            target = (node["metadata"].get("annotations") or {}).get(TARGET_ANNOTATION)
            if ours and unschedulable:
                return "cordoned" if target in (None, run.target) else f"cordoned by switch-mode toward {target}"
            return "not cordoned"
    known = "cordoned by switch-mode" if run.cordoned else "not cordoned by switch-mode"
    return f"the API server does not answer; as this run last knew, the node is {known}"


def _file(files: HostFiles) -> str:
    try:
        return f'the config says mode = "{configmod.load(files.config).mode}"'
    except ConfigError as exc:
        return f"the config does not load ({exc.errors[0]})"


async def _daemon(config: Config) -> str:
    try:
        async with asyncio.timeout(LOOK):
            running = await instance.serving(config)
    except TimeoutError:
        running = None
    if running is None:
        return "no daemon serves the config"
    why = switch_daemon.unheld(running.record, [d.resource for d in config.devices], healthy=False)
    return why or f"the daemon (pid {running.pid}, {running.record.mode} mode) is held by kubelet"
