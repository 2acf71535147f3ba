"""``ate-devplugd switch-mode dra|device-plugin``: a node moved between the modes, with pods running and
arriving, none lost and none stranded (docs/switching.md has the why of each step).

1. cordon the Node (``spec.unschedulable``) unless it already is, noting in an annotation that we did;
2. wait until every pod bound here that asks our resources has been admitted (or prepared), held for
   ``settle`` seconds so that a binding the scheduler decided before the cordon lands first;
3. the config's ``mode`` and the unit's drop-in, then ``systemctl daemon-reload`` and ``restart``;
4. wait until the Node shows the new path: DRA: allocatable 0 and our slices published with devices;
   device-plugin: allocatable above 0 and no slice of ours (lingering ones deleted);
5. uncordon, only if we cordoned.

Each step is said on stdout and as a journal event; each is a no-op when already done, so the command
may be run again after a failure. The credentials are the ``[dra]`` kubeconfig's (kubelet's own by
default): get and patch its own Node, list and watch the pods on it, list, watch and delete its slices.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from ate_devplugd import config as configmod
from ate_devplugd.base.logs import EventLog
from ate_devplugd.commands import instance, switch_files, switch_wait
from ate_devplugd.commands.findings import config_error
from ate_devplugd.commands.switch_files import (
    CORDON_ANNOTATION,
    CORDON_VALUE,
    UNIT,
    Host,
    HostFiles,
    SwitchFailed,
    run_systemctl,
)
from ate_devplugd.commands.switch_wait import Wait
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.apiclient import NODES, PODS, SLICES, ApiClient, ApiError, ApiUnavailable, node_path, slice_path

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
#: The events of the steps (``_step``'s first argument), and of a failure.
EVENTS = (
    "switch-cordon",
    "switch-settled",
    "switch-applied",
    "switch-slice-deleted",
    "switch-path",
    "switch-done",
    "switch-failed",
)


@dataclasses.dataclass(frozen=True)
class Timing:
    timeout: float = 300.0
    settle: float = 2.0


def _asks(pod: dict[str, Any], resources: Sequence[str]) -> bool:
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        res = container.get("resources") or {}
        if any(name in (res.get("requests") or {}) or name in (res.get("limits") or {}) for name in resources):
            return True
    return False


def _admitted(pod: dict[str, Any]) -> bool:
    """Admitted by kubelet (and its claims prepared): its sandbox is made, or it ran, or it ended."""
    st = pod.get("status") or {}
    if st.get("phase") in ("Running", "Succeeded", "Failed"):
        return True
    conditions = st.get("conditions") or []
    return any(c.get("type") == "PodReadyToStartContainers" and c.get("status") == "True" for c in conditions)


def _is_dra(pod: dict[str, Any]) -> bool:
    return bool((pod.get("status") or {}).get("extendedResourceClaimStatus") or pod["spec"].get("resourceClaims"))


class Switch:
    """One run of ``switch-mode`` toward ``target``."""

    def __init__(self, target: str, config: Config, host: Host, timing: Timing) -> None:
        assert config.dra is not None
        self.target = target
        self._config = config
        self._dra: DraConfig = config.dra
        self._host = host
        self._timing = timing
        self._resources = [dev.resource for dev in config.devices]
        self._events = EventLog(log)
        self._api: ApiClient | None = None
        self.cordoned = False

    def _step(self, event: str, text: str) -> None:
        self._host.say(f"switch-mode {self.target}: {text}")
        self._events.info(event, "switch-mode %s: %s", self.target, text)

    def failed(self, text: str) -> None:
        """Say where a failed switch leaves the node, and the ways on."""
        for line in where_it_stands(self, text):
            self._host.say(line)
        self._events.error("switch-failed", "switch-mode %s failed: %s", self.target, text)

    async def run(self) -> None:
        self._api = ApiClient(kubeconfig.load(self._dra.kubeconfig))
        try:
            if await self._done_already():
                self._step("switch-done", f"already in {self.target} mode and the Node shows it: nothing to do")
                return
            await self._cordon()
            await self._settle()
            await self._apply()
            await self._wait_path()
            await self._uncordon()
        finally:
            await self._api.close()

    async def _done_already(self) -> bool:
        """The config, the drop-in and the running daemon are in the target mode, the Node shows its path and
        carries no cordon of ours: a run again after a finished move changes nothing, not even the cordon."""
        files = self._host.files
        if self._config.mode != self.target or await self._running_mode() != self.target:
            return False
        if self.target == "dra" and not switch_files.dropin_linked(files):
            return False
        assert self._api is not None
        node = await self._node()
        if (node["metadata"].get("annotations") or {}).get(CORDON_ANNOTATION) == CORDON_VALUE:
            return False
        selector = f"spec.nodeName={self._dra.node_name},spec.driver={self._dra.driver}"
        slices = (await self._api.request("GET", SLICES, params={"fieldSelector": selector})).get("items") or []
        return self._allocatable_wrong([node]) is None and self._slices_wrong(slices) is None

    async def _running_mode(self) -> str | None:
        """The mode of the daemon that serves the config, by its record (None: none serves it)."""
        running = await instance.serving(self._config)
        return running.record.mode if running is not None else None

    # -- 1 and 5: the cordon ------------------------------------------------------------------------
    async def _node(self) -> dict[str, Any]:
        assert self._api is not None
        return await self._api.request("GET", node_path(self._dra.node_name))

    async def _patch_node(self, body: dict[str, Any]) -> None:
        assert self._api is not None
        await self._api.request("PATCH", node_path(self._dra.node_name), body, content_type=MERGE_PATCH)

    async def _cordon(self) -> None:
        node = await self._node()
        ours = (node["metadata"].get("annotations") or {}).get(CORDON_ANNOTATION) == CORDON_VALUE
        if (node.get("spec") or {}).get("unschedulable"):
            self.cordoned = ours
            how = "by an earlier switch-mode: lifted at the end" if ours else "by someone else: left to them"
            self._step("switch-cordon", f"1/5 node {self._dra.node_name} is already cordoned ({how})")
            return
        annotation = {CORDON_ANNOTATION: CORDON_VALUE}
        await self._patch_node({"metadata": {"annotations": annotation}, "spec": {"unschedulable": True}})
        self.cordoned = True
        self._step("switch-cordon", f"1/5 cordoned node {self._dra.node_name}: it takes no new pods meanwhile")

    async def _uncordon(self) -> None:
        if not self.cordoned:
            self._step("switch-done", f"5/5 done: {self.target} mode; the cordon is not ours, left in place")
            return
        await self._patch_node(
            {"metadata": {"annotations": {CORDON_ANNOTATION: None}}, "spec": {"unschedulable": False}}
        )
        self.cordoned = False
        self._step("switch-done", f"5/5 uncordoned node {self._dra.node_name}: done, {self.target} mode")

    # -- 2: no pod caught between the paths ---------------------------------------------------------
    def _pods_waiting(self, pods: list[dict[str, Any]]) -> str | None:
        waiting = [
            f"{p['metadata'].get('namespace', '')}/{p['metadata']['name']}"
            for p in pods
            if _asks(p, self._resources) and not _admitted(p) and not p["metadata"].get("deletionTimestamp")
        ]
        return f"{len(waiting)} pod(s) not admitted yet: {', '.join(waiting[:5])}" if waiting else None

    async def _settle(self) -> None:
        selector = f"spec.nodeName={self._dra.node_name}"
        await self._until(PODS, selector, self._pods_waiting, "pods admitted", hold=self._timing.settle)
        self._step("switch-settled", "2/5 every pod bound here that asks our resources has been admitted")

    # -- 3: config, drop-in, restart ----------------------------------------------------------------
    async def _apply(self) -> None:
        files = self._host.files
        changed, _ = switch_files.write_mode(files, self.target)
        text = f'config {files.config}: mode = "{self.target}"' + ("" if changed else " (already)")
        if self.target == "dra":
            linked = switch_files.link_dropin(files)
            text += f"; drop-in {files.dropin} " + ("linked" if linked else "in place")
        else:
            left = await self._dra_pods()
            if left:
                linked = False  # the unprepare-only driver needs kubelet's plugin directories
                text += f"; drop-in kept while {left} DRA pod(s) are left (run again once they are gone)"
            else:
                linked = switch_files.remove_dropin(files)
                text += f"; drop-in {files.dropin} " + ("removed" if linked else "absent")
        restart = changed or linked or await self._running_mode() != self.target
        if linked:
            await self._host.systemctl("daemon-reload")
        if restart:
            await self._host.systemctl("restart", UNIT)
            text += f"; {UNIT} restarted"
        self._step("switch-applied", f"3/5 {text}")

    async def _dra_pods(self) -> int:
        assert self._api is not None
        listing = await self._api.request("GET", PODS, params={"fieldSelector": f"spec.nodeName={self._dra.node_name}"})
        return sum(1 for p in listing.get("items") or [] if _is_dra(p) and _asks(p, self._resources))

    # -- 4: the Node shows the new path -------------------------------------------------------------
    def _allocatable_wrong(self, nodes: list[dict[str, Any]]) -> str | None:
        if not nodes:
            return "the Node is not there"
        allocatable = (nodes[0].get("status") or {}).get("allocatable") or {}
        for name in self._resources:
            value = str(allocatable.get(name, "0"))
            if (value == "0") != (self.target == "dra"):
                return f"the Node says allocatable {name} {value}"
        return None

    def _slices_wrong(self, slices: list[dict[str, Any]]) -> str | None:
        with_devices = [s for s in slices if s["spec"].get("devices")]
        if self.target == "dra":
            return None if len(with_devices) >= len(self._resources) else "our slices are not published yet"
        return f"{len(slices)} slice(s) of {self._dra.driver} left" if slices else None

    async def _wait_path(self) -> None:
        node = self._dra.node_name
        if self.target == "device-plugin":
            await self._delete_slices()
        await self._until(NODES, f"metadata.name={node}", self._allocatable_wrong, "the Node's allocatable")
        slices = f"spec.nodeName={node},spec.driver={self._dra.driver}"
        await self._until(SLICES, slices, self._slices_wrong, "the slices")
        path = "DRA (allocatable 0, slices published)" if self.target == "dra" else "device-plugin (no slice)"
        self._step("switch-path", f"4/5 the Node shows the {path} path")

    async def _delete_slices(self) -> None:
        """This node's slices of our driver: kubelet keeps them while a driver of the name is registered
        (device-plugin mode's unprepare-only one), and the scheduler would take the DRA path by them."""
        assert self._api is not None
        selector = f"spec.nodeName={self._dra.node_name},spec.driver={self._dra.driver}"
        listing = await self._api.request("GET", SLICES, params={"fieldSelector": selector})
        for item in listing.get("items") or []:
            with contextlib.suppress(ApiError):  # gone already (404)
                await self._api.request("DELETE", slice_path(item["metadata"]["name"]))
            self._step("switch-slice-deleted", f"4/5 deleted slice {item['metadata']['name']}")

    # -- waiting on the API server ------------------------------------------------------------------
    async def _until(
        self, path: str, selector: str, wrong: Callable[[list[dict[str, Any]]], str | None], what: str, hold: float = 0
    ) -> None:
        assert self._api is not None

        def waiting(why: str) -> None:
            self._host.say(f"switch-mode {self.target}: waiting: {why}")

        await switch_wait.until(self._api, path, selector, wrong, Wait(what, self._timing.timeout, waiting, hold))


def where_it_stands(switch: Switch, exc: str) -> list[str]:
    """What a failed switch leaves, and the ways on."""
    other = "device-plugin" if switch.target == "dra" else "dra"
    cordon = "cordoned by switch-mode (new pods go elsewhere)" if switch.cordoned else "not cordoned by switch-mode"
    return [
        f"switch-mode {switch.target} failed: {exc}",
        f"the node is {cordon}; see `ate-devplugd doctor` for the config's mode and the running daemon's",
        f"run `ate-devplugd switch-mode {switch.target}` again to finish, "
        f"or `ate-devplugd switch-mode {other}` to go back",
    ]


async def switch_mode(target: str, config: Config, host: Host, timing: Timing) -> int:
    """The whole move; the exit status (0 done, 1 failed: where it stands is said)."""
    if config.dra is None:
        raise ConfigError(["dra: switch-mode needs the [dra] table (node_name, kubeconfig) in the config"])
    switch = Switch(target, config, host, timing)
    try:
        await switch.run()
    except (SwitchFailed, ApiError, ApiUnavailable, kubeconfig.KubeconfigError, OSError, ConfigError) as exc:
        text = "; ".join(exc.errors) if isinstance(exc, ConfigError) else str(exc)
        switch.failed(text)
        return 1
    return os.EX_OK


def main(args: argparse.Namespace) -> int:
    """``switch-mode``, as the command line gives it: the config file's, its unit's drop-in, systemctl."""
    from ate_devplugd.base import logs  # noqa: PLC0415

    try:
        cfg = configmod.load(args.config)
    except ConfigError as exc:
        return config_error(exc.errors)
    if os.path.exists("/run/systemd/journal/socket"):  # each step's event in the journal, besides stdout
        with contextlib.suppress(ImportError):
            logger = logging.getLogger(__name__)
            logger.addHandler(logs.JournalHandler())
            logger.setLevel(logging.INFO)
            logger.propagate = False
    files = HostFiles(args.config or configmod.DEFAULT_CONFIG_PATH, args.dropin_dir, args.dropin_source)

    async def systemctl(*words: str) -> None:
        await run_systemctl(args.systemctl, *words)

    if args.kubeconfig and cfg.dra is not None:
        cfg = dataclasses.replace(cfg, dra=dataclasses.replace(cfg.dra, kubeconfig=args.kubeconfig))
    try:
        return asyncio.run(switch_mode(args.mode, cfg, Host(files, systemctl), Timing(args.timeout, args.settle)))
    except ConfigError as exc:
        return config_error(exc.errors)
