"""What serves the resources to kubelet: the config's mode, and the part of the other mode that a node
moving between the two needs (``docs/switching.md``).

- DRA mode (``dra.mode.DraMode``) also keeps a *withheld device-plugin path*: each resource's device-plugin
  endpoint registered with every unit Unhealthy (``deviceplugin`` sessions with ``withheld``). kubelet then
  reports allocatable 0, so the scheduler takes the DRA path, and kubelet 1.36 still finds an endpoint for
  the name when its checkpoint holds a device-plugin allocation from before the move (without one, every
  new DRA container fails ``endpoint not found in cache``). Its sessions keep their own metrics: the
  daemon's per-resource gauges are DRA mode's.
- Device-plugin mode (``deviceplugin.plugins.DevicePlugins``), where the config has a ``[dra]`` table,
  also keeps DRA's kubelet plugin registered for *unprepare only*: no slice, every prepare refused, every
  unprepare answered, so DRA pods left on the node can still be deleted. Where kubelet's plugin
  directories cannot be written (the unit without ``dra-mode.conf``) it says so and goes on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import Config
from ate_devplugd.deviceplugin.plugins import DevicePlugins
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.node.devices import DeviceRegistry, Resource
from ate_devplugd.signals.metrics import Metrics

if TYPE_CHECKING:
    from ate_devplugd.dra.mode import DraMode

log = logging.getLogger(__name__)


class Modes:
    """The mode that serves (``primary``) and the other mode's part kept beside it (``companion``)."""

    def __init__(
        self,
        config: Config,
        registry: DeviceRegistry,
        watch: KubeletWatch,
        metrics: Metrics,
        on_state: Callable[[], None],
    ) -> None:
        self.primary: DevicePlugins | DraMode
        self._dra = config.dra
        self.companion: DevicePlugins | DraMode | None = None
        if config.dra is not None:
            from ate_devplugd.dra.mode import DraMode  # noqa: PLC0415 - aiohttp and PyYAML only with a [dra] table

        if config.dra is not None and config.mode == "dra":
            self.primary = DraMode(config.dra, registry, metrics, on_state, watch)
            self.companion = DevicePlugins(registry, watch, Metrics(), on_state, withheld=True)
        else:
            self.primary = DevicePlugins(registry, watch, metrics, on_state)
            if config.dra is not None:
                self.companion = DraMode(config.dra, registry, metrics, on_state, watch, unprepare_only=True)

    async def start(self, names: list[str] | tuple[str, ...]) -> None:
        """Serve these resources: the companion first (a withheld path registered before the slice is
        published), then the mode itself."""
        companion = self.companion
        if isinstance(companion, DevicePlugins):
            await companion.start(names)
        await self.primary.start(names)
        if companion is not None and not isinstance(companion, DevicePlugins):
            try:
                await companion.start(names)
            except OSError as exc:  # kubelet's plugin directories, writable only with dra-mode.conf
                await companion.stop()
                self.companion = None
                self._unprepare_unavailable(exc)

    def _unprepare_unavailable(self, exc: OSError) -> None:
        """No unprepare-only driver: a warning while kubelet's checkpoint may hold a claim of ours (DRA pods
        left here cannot be deleted), else one info line (``switch-mode`` removed the drop-in with none left)."""
        from ate_devplugd.kubelet.dra_state import CHECKPOINT, Claims, claims_of  # noqa: PLC0415 - only here

        assert self._dra is not None
        claims = claims_of(self._dra.kubelet_dir, self._dra.driver)
        events = EventLog(log)
        if claims is Claims.NONE:
            events.info(
                "dra-unprepare-unavailable",
                "no DRA unprepare served (%s): kubelet's %s records no claim of %s, none is owed",
                exc,
                CHECKPOINT,
                self._dra.driver,
            )
            return
        held = "records a claim of" if claims is Claims.RECORDED else "cannot be read to tell the claims of"
        events.warning(
            "dra-unprepare-unavailable",
            "cannot serve DRA unprepare for claims left on this node: %s; kubelet's %s %s %s, and DRA pods left "
            "here cannot be deleted until a DRA driver registers (keep dra-mode.conf linked after a switch)",
            exc,
            CHECKPOINT,
            held,
            self._dra.driver,
        )

    async def stop(self, names: list[str] | tuple[str, ...] | None = None) -> None:
        await self.primary.stop(names)
        if self.companion is not None:
            await self.companion.stop(names)

    def looked(self, resource: Resource) -> None:
        self.primary.looked(resource)
        if self.companion is not None:
            self.companion.looked(resource)

    def status_line(self) -> str:
        parts = [self.primary.status_line()]
        if self.companion is not None:
            parts.append(self.companion.status_line())
        return " | ".join(parts)
