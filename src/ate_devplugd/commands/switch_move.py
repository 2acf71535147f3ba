"""``switch-mode``'s move, step by step (``commands.switch`` is the command around it; docs/switching.md
has the why of each step):

1. check, changing nothing: a daemon serves the config and kubelet holds it (the unit started first where
   none runs); for DRA, the cluster maps the name (``switch_check``);
2. cordon the Node (``spec.unschedulable``) unless it already is, noting in annotations that we did and
   the mode the move goes to;
3. wait until every pod bound here that asks our resources has been admitted (or prepared), held for
   ``settle`` seconds so that a binding the scheduler decided before the cordon lands first;
4. the config's ``mode`` and the unit's drop-in, then ``systemctl daemon-reload`` and ``restart``;
5. wait for the new daemon's own record that kubelet holds it in the new mode, then for the Node as the
   scheduler sees it, read after that record, showing the new path (``switch_path``);
6. uncordon, only if we cordoned, and take our annotations off.

A guarded handover (``commands.guard``) is the same run toward the mode the node is in, whose step 4 is the
daemon's handover to a new process instead of the mode's change and the restart; a handover the daemon
refused changed nothing, and the run lifts its own cordon before it says so.

Each step is said on stdout and as a journal event; each is a no-op when already done, so the command
may be run again after a failure. Where a move that did not finish leaves the node is ``switch_where``'s.
The credentials are the ``[dra]`` kubeconfig's (kubelet's own by default): get and patch its own Node,
list and watch the pods on it, list, watch and delete its slices, and read the DeviceClasses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ate_devplugd.base.logs import EventLog
from ate_devplugd.commands import (
    instance,
    switch_check,
    switch_daemon,
    switch_files,
    switch_path,
    switch_wait,
    switch_where,
)
from ate_devplugd.commands.switch_files import (
    CORDON_ANNOTATION,
    CORDON_VALUE,
    TARGET_ANNOTATION,
    UNIT,
    Host,
    NothingChanged,
)
from ate_devplugd.commands.switch_pods import dra_pods, pods_waiting
from ate_devplugd.commands.switch_wait import Wait
from ate_devplugd.config import Config
from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.apiclient import PODS, ApiClient, node_path

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
#: The events of the steps (``_step``'s first argument), and of a failure or an interruption.
EVENTS = (
    "switch-checked",
    "switch-cordon",
    "switch-settled",
    "switch-applied",
    "switch-slice-deleted",
    "switch-path",
    "switch-done",
    "switch-failed",
    "switch-interrupted",
)
STEPS = 6
#: A guarded handover's step 4: the handover of the daemon serving the config (None: none does), said in
#: what it returns.
HandOver = Callable[[instance.Running | None], Awaitable[str]]


@dataclasses.dataclass(frozen=True)
class Timing:
    timeout: float = 300.0
    settle: float = 2.0


class Switch:
    """One run of ``switch-mode`` toward ``target``."""

    def __init__(
        self,
        target: str,
        config: Config,
        host: Host,
        timing: Timing,
        own: Config | None = None,
        *,
        handover: HandOver | None = None,
    ) -> None:
        assert config.dra is not None
        self.target = target
        #: A guarded handover's step 4 (None: a move between the modes).
        self._handover = handover
        self._config = config
        self._dra = config.dra
        self._host = host
        self._timing = timing
        self._resources = [dev.resource for dev in config.devices]
        self._events = EventLog(log)
        self._api: ApiClient | None = None
        self._path: switch_path.Path | None = None
        #: The daemon's own credentials, where the command was given others (a DeviceClass read with them).
        self._own = own.dra.kubeconfig if own is not None and own.dra is not None else self._dra.kubeconfig
        #: Whether the cordon on the Node is ours, as far as this run knows; the step under way.
        self.cordoned = False
        self.step = 0

    @property
    def node_name(self) -> str:
        return self._dra.node_name

    @property
    def name(self) -> str:
        """What the run calls itself in its lines."""
        return "handover" if self._handover is not None else f"switch-mode {self.target}"

    def _step(self, event: str, text: str) -> None:
        self._host.say(f"{self.name}: {text}")
        self._events.info(event, "%s: %s", self.name, text)

    def _waiting(self, why: str) -> None:
        self._host.say(f"{self.name}: waiting: {why}")

    async def ended(self, text: str, event: str = "switch-failed") -> None:
        """Say where a move that did not finish leaves the node, and the ways on."""
        guarded = self._handover is not None
        run = switch_where.Run(self.target, self.step, self.cordoned, self.node_name, self._host.files, guarded)
        lines = await switch_where.lines(run, text, self._config, self._api)
        for line in lines:
            self._host.say(line)
        self._events.error(event, "%s", " ".join(lines))

    async def run(self) -> None:
        """The move (``close()`` after it, and after ``ended()`` where it did not finish)."""
        self._api = ApiClient(kubeconfig.load(self._dra.kubeconfig))
        self._path = switch_path.Path(self.target, self._config, self._api, self._step, self._waiting)
        node = await self._node()
        annotations = node["metadata"].get("annotations") or {}
        self.cordoned = annotations.get(CORDON_ANNOTATION) == CORDON_VALUE and bool(
            (node.get("spec") or {}).get("unschedulable")
        )
        if self._handover is None and await self._done_already(node):
            return
        started = await self._check(node)
        if started and self._handover is None and await self._done_already(await self._node()):
            return
        await self._cordon()
        await self._settle()
        restart = await self._apply()
        await self._wait_path(restart)
        await self._uncordon()

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()

    async def _done_already(self, node: dict[str, Any]) -> bool:
        """The config, the drop-in and the running daemon are in the target mode and kubelet holds it, the
        Node shows its path and carries no annotation of ours: a run again after a finished move changes
        nothing, not even the cordon. In device-plugin mode a drop-in kept for DRA pods stays while one is
        left; once none is, the drop-in's removal is a move of its own (a restart, under the cordon)."""
        assert self._path is not None
        running = await instance.serving(self._config)
        annotations = node["metadata"].get("annotations") or {}
        linked = switch_files.dropin_linked(self._host.files)
        done = (
            self._config.mode == self.target
            and running is not None
            and running.record.mode == self.target
            and switch_daemon.unheld(running.record, self._resources, healthy=self.target == "device-plugin") is None
            and annotations.get(CORDON_ANNOTATION) != CORDON_VALUE
            and TARGET_ANNOTATION not in annotations
            and (linked or self.target != "dra")
        )
        kept = self.target == "device-plugin" and linked
        left = await self._dra_pods() if done and kept else 0
        if not done or (kept and not left) or not await self._path.shown(node):
            return False
        why = f"; drop-in kept while {left} DRA pod(s) are left (run again once they are gone to remove it)"
        self._step(
            "switch-done", f"already in {self.target} mode and the Node shows it: nothing to do{why if kept else ''}"
        )
        return True

    # -- 1: what the move needs, before anything changes ----------------------------------------------
    async def _check(self, node: dict[str, Any]) -> bool:
        """Whether the unit had to be started (then the move may be done already)."""
        self.step = 1
        started = False
        if self.cordoned:
            text = f"a move is under way (node {self.node_name} cordoned by switch-mode): step 4 restarts the daemon"
        else:
            started, text = await switch_check.daemon(self._config, self._host, self._timing.timeout, self._waiting)
        if self.target == "dra" and self._handover is None:
            assert self._api is not None
            clients = [self._api]
            if self._own != self._dra.kubeconfig:
                clients.insert(0, ApiClient(kubeconfig.load(self._own)))
            try:
                text += "; " + await switch_check.cluster(
                    clients, self._dra, self._resources, node, self._host.proc_root
                )
            finally:
                for client in clients[:-1]:
                    await client.close()
        self._step("switch-checked", f"1/{STEPS} {text}")
        return started

    # -- 2 and 6: the cordon --------------------------------------------------------------------------
    async def _node(self) -> dict[str, Any]:
        assert self._api is not None
        return await self._api.request("GET", node_path(self.node_name))

    async def _patch_node(self, body: dict[str, Any]) -> None:
        assert self._api is not None
        await self._api.request("PATCH", node_path(self.node_name), body, content_type=MERGE_PATCH)

    async def _cordon(self) -> None:
        self.step = 2
        node = await self._node()
        annotations = node["metadata"].get("annotations") or {}
        ours = annotations.get(CORDON_ANNOTATION) == CORDON_VALUE
        target = {TARGET_ANNOTATION: self.target}
        if (node.get("spec") or {}).get("unschedulable"):
            self.cordoned = ours
            if annotations.get(TARGET_ANNOTATION) != self.target:
                await self._patch_node({"metadata": {"annotations": target}})
            how = "by an earlier switch-mode: lifted at the end" if ours else "by someone else: left to them"
            self._step("switch-cordon", f"2/{STEPS} node {self.node_name} is already cordoned ({how})")
            return
        annotations = {CORDON_ANNOTATION: CORDON_VALUE, **target}
        await self._patch_node({"metadata": {"annotations": annotations}, "spec": {"unschedulable": True}})
        self.cordoned = True
        self._step("switch-cordon", f"2/{STEPS} cordoned node {self.node_name}: it takes no new pods meanwhile")

    async def _uncordon(self) -> None:
        self.step = 6
        if not await self._lift():
            self._step("switch-done", f"6/{STEPS} done: {self.target} mode; the cordon is not ours, left in place")
            return
        self._step("switch-done", f"6/{STEPS} uncordoned node {self.node_name}: done, {self.target} mode")

    async def _lift(self) -> bool:
        """Our annotations off, and the cordon too where it is ours: whether it was."""
        if not self.cordoned:
            await self._patch_node({"metadata": {"annotations": {TARGET_ANNOTATION: None}}})
            return False
        annotations = {CORDON_ANNOTATION: None, TARGET_ANNOTATION: None}
        await self._patch_node({"metadata": {"annotations": annotations}, "spec": {"unschedulable": False}})
        self.cordoned = False
        return True

    # -- 3: no pod caught between the paths -----------------------------------------------------------
    async def _settle(self) -> None:
        self.step = 3

        def wrong(pods: list[dict[str, Any]]) -> str | None:
            return pods_waiting(pods, self._resources)

        await self._until(PODS, f"spec.nodeName={self.node_name}", wrong, "pods admitted", hold=self._timing.settle)
        self._step("switch-settled", f"3/{STEPS} every pod bound here that asks our resources has been admitted")

    # -- 4: config, drop-in, restart ------------------------------------------------------------------
    async def _apply(self) -> switch_daemon.Restart | None:
        """The host changed; the restart (None: none was needed)."""
        self.step = 4
        if self._handover is not None:
            return await self._hand_over(self._handover)
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
        before = await instance.serving(self._config)
        restart = None
        if linked:
            await self._host.systemctl("daemon-reload")
        if changed or linked or before is None or before.record.mode != self.target:
            restart = switch_daemon.Restart.now(before)
            await self._host.systemctl("restart", UNIT)
            text += f"; {UNIT} restarted"
        self._step("switch-applied", f"4/{STEPS} {text}")
        return restart

    async def _hand_over(self, handover: HandOver) -> switch_daemon.Restart:
        """A guarded handover's step 4; one the daemon refused lifts the cordon (nothing was changed)."""
        running = await instance.serving(self._config)
        restart = switch_daemon.Restart.now(running)
        try:
            text = await handover(running)
        except NothingChanged:
            await self._lift()
            self.step = 0
            raise
        self._step("switch-applied", f"4/{STEPS} {text}")
        return restart

    async def _dra_pods(self) -> int:
        assert self._api is not None
        listing = await self._api.request("GET", PODS, params={"fieldSelector": f"spec.nodeName={self.node_name}"})
        return dra_pods(listing.get("items") or [], self._resources)

    # -- 5: kubelet holds the new daemon, then the Node shows the new path (``switch_path``) -------------
    async def _wait_path(self, restart: switch_daemon.Restart | None) -> None:
        self.step = 5
        assert self._path is not None
        running = await self._path.wait(restart, self._timing.timeout, f"5/{STEPS}")
        path = "DRA (allocatable 0, slices published)" if self.target == "dra" else "device-plugin (no slice)"
        held = f"kubelet holds the daemon (pid {running.pid}, {self.target} mode)"
        self._step("switch-path", f"5/{STEPS} {held}; then the Node showed the {path} path")

    # -- waiting on the API server --------------------------------------------------------------------
    async def _until(
        self, path: str, selector: str, wrong: Callable[[list[dict[str, Any]]], str | None], what: str, hold: float = 0
    ) -> None:
        assert self._api is not None
        await switch_wait.until(self._api, path, selector, wrong, Wait(what, self._timing.timeout, self._waiting, hold))
