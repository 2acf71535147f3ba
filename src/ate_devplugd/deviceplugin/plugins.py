"""Device-plugin mode: one supervised ``Session`` per resource, in config order.

The daemon tells the mode which resources to serve (at start, and what a reload added or removed);
the mode starts a session task for each, waits for their first attempts, stops them, and describes
them for STATUS. Sessions restart themselves (kubelet restarts, lost sockets); a stopped session's
socket is removed. The sessions share one ``KubeletWord``: kubelet is asked what it offers on the plugin
directory's events that may change it (``KubeletWatch.on_changes``) and on each session's own changes, one
question for all of them (its pod-resources API; for DRA mode's withheld path, its checkpoint). When a
first attempt takes longer than ``READY_TIMEOUT``, start-up (READY=1) and a reload go on without it, and
say so: the ``ready`` event at warning, and a part of STATUS until that attempt ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
from collections.abc import Callable

from ate_devplugd.base.logs import EventLog
from ate_devplugd.deviceplugin.session import Session
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.kubelet.word import KubeletWord
from ate_devplugd.node.devices import DeviceRegistry, Resource
from ate_devplugd.signals.metrics import Metrics

log = logging.getLogger(__name__)

#: How long start-up (and a reload) waits for each new session's first attempt before going on.
READY_TIMEOUT = 20.0


class DevicePlugins:
    """The sessions of device-plugin mode, one per resource of the registry."""

    def __init__(
        self,
        registry: DeviceRegistry,
        watch: KubeletWatch,
        metrics: Metrics,
        on_state: Callable[[], None],
        *,
        withheld: bool = False,
    ) -> None:
        self._registry = registry
        #: DRA mode's withheld path: every session serves every unit Unhealthy (``servicer``).
        self._withheld = withheld
        self._watch = watch
        self._metrics = metrics
        self._on_state = on_state
        self._sessions: dict[str, Session] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: kubelet's word on what it offers, asked while a session runs (``_unhook``: the watch's events).
        self._word = KubeletWord(watch.plugin_dir, api=not withheld, checkpoint=withheld)
        self._unhook: Callable[[], None] | None = None
        #: The sessions whose first attempt outlasted READY_TIMEOUT (said in STATUS until it ends).
        self._late: set[str] = set()

    async def start(self, names: list[str] | tuple[str, ...]) -> None:
        """Serve and register these resources; return once each has made its first attempt."""
        loop = asyncio.get_running_loop()
        if self._unhook is None and names:
            self._unhook = self._watch.on_changes(self._word.seen)
        for name in names:
            resource = self._registry.resources[name]
            socket_path = posixpath.join(self._watch.plugin_dir, resource.config.socket_name)
            session = Session(
                resource,
                socket_path,
                self._watch,
                self._on_state,
                self._metrics,
                withheld=self._withheld,
                word=self._word,
            )
            self._sessions[name] = session
            self._tasks[name] = loop.create_task(session.run(), name=f"session {name}")
        waits = [self._sessions[name].first_attempt.wait() for name in names]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), READY_TIMEOUT)
        late = [name for name in names if not self._sessions[name].first_attempt.is_set()]
        if late:
            self._late.update(late)
            EventLog(log).warning(  # the event of READY: it goes out now, without these
                "ready",
                "ready after %g s without the first attempt of %s (see its state in STATUS)",
                READY_TIMEOUT,
                ", ".join(late),
            )

    async def stop(self, names: list[str] | tuple[str, ...] | None = None) -> None:
        """Stop these sessions (all, by default): their servers stop and their sockets go."""
        names = list(self._tasks) if names is None else names
        tasks = [self._tasks.pop(name) for name in names if name in self._tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for name in names:
            self._sessions.pop(name, None)
            self._late.discard(name)
        if not self._sessions and self._unhook is not None:
            self._unhook()
            self._unhook = None
            self._word.close()

    def looked(self, resource: Resource) -> None:
        """A look at a device, or a change of its withholding: its gauges (every unit offered once the
        device was first seen). Each session follows its resource itself (its change event)."""
        units = resource.config.count if resource.seen.is_set() else 0
        self._metrics.set_device(
            resource.name,
            present=resource.presence.present,
            healthy=resource.healthy,
            advertised_units=units,
            withheld=resource.withheld,
        )

    def status_line(self) -> str:
        """STATUS=: one part per resource, in config order (the registry's)."""
        parts = [
            f"{name}: {self._sessions[name].describe()}" for name in self._registry.resources if name in self._sessions
        ]
        self._late = {name for name in self._late if not self._sessions[name].first_attempt.is_set()}
        if self._late:
            parts.append(
                f"ready after {READY_TIMEOUT:g} s without the first attempt of {', '.join(sorted(self._late))}"
            )
        return " | ".join(parts) or "no devices"
