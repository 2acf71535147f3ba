"""``switch-mode``'s fifth step: kubelet's word first, then the Node as the scheduler sees it.

The wait takes, in order: the new daemon's own record that kubelet holds it in the target mode (a daemon
started after the restart; ``switch_daemon``); in device-plugin mode, kubelet's own word besides, its
pod-resources API offering units of each resource (the record says kubelet opened its stream, which comes
a moment before kubelet has the daemon's list of devices); then, read after those, the Node and this
node's slices showing the target's path (DRA: allocatable 0 for each resource and our slices published
with devices; device-plugin: allocatable above 0 and no slice of our driver, any left deleted); then the
record (and kubelet's word) once more, so that a daemon that crashed meanwhile is waited for again. A
reading taken before those never counts, and none taken before the restart is used at all
(docs/switching.md: what the Node can say after a restart, and why a status written before it may still
be read once kubelet holds the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from ate_devplugd.commands import instance, switch_daemon, switch_wait
from ate_devplugd.commands.instance import Running
from ate_devplugd.commands.switch_daemon import Restart
from ate_devplugd.commands.switch_files import SwitchFailed
from ate_devplugd.commands.switch_wait import Wait
from ate_devplugd.config import Config
from ate_devplugd.dra.apiclient import NODES, SLICES, ApiClient, ApiError, slice_path

#: The first and the longest wait before kubelet's pod-resources API is asked again, and each call's deadline.
FIRST_ASK = 0.02
LONGEST_ASK = 1.0
ASK_TIMEOUT = 5.0


class Path:
    """What the Node and the slices show of the ``target`` mode's path, and the wait for it."""

    def __init__(
        self,
        target: str,
        config: Config,
        api: ApiClient,
        step: Callable[[str, str], None],
        waiting: Callable[[str], None],
    ) -> None:
        assert config.dra is not None
        self._target, self._config, self._api = target, config, api
        self._node, self._driver = config.dra.node_name, config.dra.driver
        self._resources = [dev.resource for dev in config.devices]
        self._step, self._waiting = step, waiting
        self._unanswered = False

    @property
    def _selector(self) -> str:
        return f"spec.nodeName={self._node},spec.driver={self._driver}"

    def held(self, restart: Restart | None) -> Callable[[Running], str | None]:
        """Whether a record is the new daemon's, in the target mode, held by kubelet (None: it is)."""

        def accept(running: Running) -> str | None:
            if running.record.mode != self._target:
                return f"the daemon (pid {running.pid}) runs {running.record.mode} mode"
            if restart is not None and not restart.after(running.record):
                return f"the daemon that ran before the restart (pid {running.pid}) still answers"
            return switch_daemon.unheld(running.record, self._resources, healthy=self._target == "device-plugin")

        return accept

    def allocatable_wrong(self, nodes: list[dict[str, Any]]) -> str | None:
        if not nodes:
            return "the Node is not there"
        allocatable = (nodes[0].get("status") or {}).get("allocatable") or {}
        for name in self._resources:
            value = str(allocatable.get(name, "0"))
            if (value == "0") != (self._target == "dra"):
                return f"the Node says allocatable {name} {value}"
        return None

    def slices_wrong(self, slices: list[dict[str, Any]]) -> str | None:
        with_devices = [s for s in slices if s["spec"].get("devices")]
        if self._target == "dra":
            return None if len(with_devices) >= len(self._resources) else "our slices are not published yet"
        return f"{len(slices)} slice(s) of {self._driver} left" if slices else None

    async def slices(self) -> list[dict[str, Any]]:
        return (await self._api.request("GET", SLICES, params={"fieldSelector": self._selector})).get("items") or []

    async def shown(self, node: dict[str, Any]) -> bool:
        """Whether ``node`` (read by the caller) and the slices read now show the target's path."""
        return self.allocatable_wrong([node]) is None and self.slices_wrong(await self.slices()) is None

    async def wait(self, restart: Restart | None, timeout: float, step: str) -> Running:
        """Until kubelet holds the new daemon and, after that, the Node shows the path; the daemon held."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        accept = self.held(restart)

        def left() -> float:
            return max(deadline - loop.time(), 0.001)

        while True:
            await switch_daemon.until(self._config, accept, left(), self._waiting, "kubelet holding the daemon")
            if self._target == "device-plugin":
                await self.offered(left())
                await self._delete_slices(step)
            node = f"metadata.name={self._node}"
            await switch_wait.until(
                self._api, NODES, node, self.allocatable_wrong, self._wait("the Node's allocatable", left())
            )
            await switch_wait.until(
                self._api, SLICES, self._selector, self.slices_wrong, self._wait("the slices", left())
            )
            now = await instance.serving(self._config)
            why = accept(now) if now is not None else "the daemon ended"
            if why is None and self._target == "device-plugin":
                why = await self._not_offered()
            if now is not None and why is None:
                return now
            self._waiting(f"{why} (after the Node showed the path: kubelet's word again first)")

    async def offered(self, timeout: float) -> None:
        """Until kubelet's pod-resources API offers units of every resource (asked again after a back-off
        while it offers none yet); where that API cannot be asked (an older kubelet, no socket), the
        record's word stands, said once. SwitchFailed after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline, delay, said = loop.time() + timeout, FIRST_ASK, ""
        while (why := await self._not_offered()) is not None:
            if why != said:
                self._waiting(why)
                said = why
            if loop.time() >= deadline:
                raise SwitchFailed(f"kubelet offering the units: not within {timeout:g} s: {why}")
            await asyncio.sleep(min(delay, max(deadline - loop.time(), 0)))  # the back-off before it is asked again
            delay = min(delay * 2, LONGEST_ASK)

    async def _not_offered(self) -> str | None:
        """Why kubelet's own word does not say it offers every resource (None: it does, or cannot be asked)."""
        from ate_devplugd.kubelet import podresources  # noqa: PLC0415 - gRPC only for device-plugin mode

        try:
            held = await podresources.allocatable(podresources.socket_for(self._config.plugin_dir), ASK_TIMEOUT)
        except podresources.Unanswered as exc:
            if not self._unanswered:
                self._waiting(f"kubelet's pod-resources API cannot be asked ({exc}): the daemon's record stands")
                self._unanswered = True
            return None
        missing = [name for name in self._resources if not held.units.get(name)]
        return f"kubelet offers no unit of {missing[0]} yet (its pod-resources API)" if missing else None

    def _wait(self, what: str, timeout: float) -> Wait:
        return Wait(what, timeout, self._waiting)

    async def _delete_slices(self, step: str) -> None:
        """This node's slices of our driver: kubelet keeps them while a driver of the name is registered
        (device-plugin mode's unprepare-only one), and the scheduler would take the DRA path by them."""
        for item in await self.slices():
            with contextlib.suppress(ApiError):  # gone already (404)
                await self._api.request("DELETE", slice_path(item["metadata"]["name"]))
            self._step("switch-slice-deleted", f"{step} deleted slice {item['metadata']['name']}")
