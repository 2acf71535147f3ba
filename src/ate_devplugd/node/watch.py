"""The configured devices as the daemon follows them: udev's events for their subsystems, and the looks.

A udev event (netlink, on the loop) is only a hint: the registry looks at every device again
(``DeviceRegistry.reconcile``). After each look the device's CDI spec is brought up to date first
(``CdiSpecs.sync``), then the owner hears of it. ``watch`` comes before ``read``, at start and on
reload, so that no change after a look goes unseen; ``read`` follows ``cdi_dir`` (inotify) before its
looks write any spec, and a spec of ours removed, changed or made invalid there is written back (the
owner hears of that, of a spec that cannot be written, and of ``cdi_dir`` replaced, as of a look).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.node.cdi import CdiSpecs, DirMove
from ate_devplugd.node.cdispec import SpecState
from ate_devplugd.node.devices import DeviceRegistry, LookHook, Resource
from ate_devplugd.node.kernel import KernelView, UdevKernelView
from ate_devplugd.node.udev import MonitorLike, UdevWatcher, UEvent, default_monitor

log = logging.getLogger(__name__)

MonitorFactory = Callable[[], tuple[MonitorLike, str]]


class DeviceWatch:
    """The registry of the configured devices, their CDI specs and the udev monitor that wakes them.

    ``kernel`` None: the real kernel through udev, with its monitor (``monitor_factory`` or the default
    one); given (a test's), udev is watched only through ``monitor_factory``, if any. ``on_spec_restored``
    hears the resource each time its CDI spec is written back (the count in the metrics).
    """

    def __init__(
        self,
        config: Config,
        on_look: LookHook,
        kernel: KernelView | None,
        monitor_factory: MonitorFactory | None,
        on_spec_restored: Callable[[str], None] | None = None,
    ) -> None:
        if kernel is None:
            real = UdevKernelView()
            kernel, monitor_factory = real, monitor_factory or functools.partial(default_monitor, real.context)
        self._factory = monitor_factory
        self._on_look = on_look
        self._udev: UdevWatcher | None = None
        self._cdi = CdiSpecs(config.cdi_dir, on_spec_restored, self._spec_changed)
        self.registry = DeviceRegistry(config.dev_root, kernel, self._looked)

    def watch(self, devices: tuple[DeviceConfig, ...]) -> None:
        """Follow udev's events for these devices' subsystems (the monitor opened the first time)."""
        subsystems = {dev.subsystem for dev in devices}
        if self._udev is not None:
            self._udev.set_subsystems(subsystems)
        elif self._factory is not None:
            self._udev = UdevWatcher.open(self._factory, subsystems, self._on_uevents)

    def read(self, config: Config) -> None:
        """Hold exactly the config's devices, each looked at (its CDI spec written), in CDI's directory."""
        self._cdi.apply(config.cdi_dir, config.devices)
        self.registry.apply(config.devices, config.dev_root)

    def spec_state(self, name: str) -> SpecState:
        """Whether resource ``name``'s CDI spec is on disk and ours now (``SpecState.OURS``), cheaply."""
        return self._cdi.state(name)

    def spec_failure(self, name: str) -> str:
        """Why resource ``name``'s CDI spec cannot be written now ("" when it can)."""
        return self._cdi.failure(name)

    @property
    def spec_dir_moved(self) -> DirMove | None:
        """``cdi_dir``'s last move away while followed, None while it is the directory it was."""
        return self._cdi.moved

    def close(self) -> None:
        self._cdi.close()
        if self._udev is not None:
            self._udev.close()

    def _looked(self, resource: Resource, event: str | None) -> None:
        self._cdi.sync(resource)
        self._on_look(resource, event)

    def _spec_changed(self, resource: Resource) -> None:
        """A spec written back, failing, or its directory replaced, outside a look: the owner hears it as
        it hears a look (what is usable follows it)."""
        self._on_look(resource, None)

    def _on_uevents(self, uevents: list[UEvent]) -> None:
        for ue in uevents:
            log.debug("uevent %s %s/%s %s", ue.action, ue.subsystem, ue.sys_name, ue.device_node or "")
        self.registry.reconcile()
