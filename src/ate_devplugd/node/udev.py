"""udev netlink events on the asyncio loop: every event that can change a device is a hint to look again.

The monitor's fd goes on the loop with ``add_reader``; when it is readable every queued event is
drained with ``poll(timeout=0)`` and the owner is called once for the batch. Lost messages (ENOBUFS)
are reported as a hint too, so looking again puts the state right whatever was dropped. KVM's own VM
announcements are not hints (``node.kvm_events``): the kernel drops them on the monitor's socket, and any
that get through are left out of the batch.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.look import Look, look
from ate_devplugd.node import kvm_events

log = logging.getLogger(__name__)

#: libudev ignores a udev-source monitor when udevd is not running; this file says whether it is.
UDEVD_CONTROL = "/run/udev/control"
RECEIVE_BUFFER = 4 * 1024 * 1024


class UEvent(NamedTuple):
    """The parts of a udev event worth logging."""

    action: str
    subsystem: str
    sys_name: str
    device_node: str | None


class MonitorLike(Protocol):
    """What we use of ``pyudev.Monitor``."""

    def fileno(self) -> int: ...
    def filter_by(self, subsystem: str) -> None: ...
    def remove_filter(self) -> None: ...
    def start(self) -> None: ...
    def poll(self, timeout: float | None = None) -> Any: ...


def default_monitor(context: object) -> tuple[MonitorLike, str]:
    """A netlink monitor: udev source when udevd runs (events after its rules ran), else kernel."""
    import pyudev  # noqa: PLC0415 - libudev is loaded only by the daemon

    source = "udev" if look(UDEVD_CONTROL) is not Look.ABSENT else "kernel"
    monitor = pyudev.Monitor.from_netlink(context, source=source)
    try:
        monitor.set_receive_buffer_size(RECEIVE_BUFFER)
    except OSError as exc:
        log.debug("cannot enlarge the netlink receive buffer (%s); lost events only cost another look", exc)
    return monitor, source


class UdevWatcher:
    """Feeds netlink uevents for a set of subsystems to ``on_hint`` from the event loop."""

    def __init__(
        self,
        monitor: MonitorLike,
        subsystems: Iterable[str],
        on_hint: Callable[[list[UEvent]], None],
    ) -> None:
        self._monitor = monitor
        self._subsystems = frozenset(subsystems)
        self._on_hint = on_hint
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        #: KVM VM announcements read and left out (the ones the kernel filter did not drop).
        self.vm_announcements = 0
        self._kernel_filter = True

    @classmethod
    def open(
        cls,
        factory: Callable[[], tuple[MonitorLike, str]],
        subsystems: Iterable[str],
        on_hint: Callable[[list[UEvent]], None],
    ) -> UdevWatcher | None:
        """A started watcher on the monitor ``factory`` opens; None (logged) if netlink cannot be opened."""
        try:
            monitor, source = factory()
        except OSError as exc:
            EventLog(log).error("udev-off", "cannot open a udev netlink monitor (%s); hotplug will not be seen", exc)
            return None
        watcher = cls(monitor, subsystems, on_hint)
        watcher.start()
        if source != "udev":
            EventLog(log).warning("udev-kernel", "udevd is not running; following kernel uevents instead")
        return watcher

    @property
    def subsystems(self) -> frozenset[str]:
        return self._subsystems

    def start(self) -> None:
        """Start receiving; call before the first look at the devices so no change falls between the two."""
        for subsystem in sorted(self._subsystems):
            self._monitor.filter_by(subsystem)
        self._monitor.start()
        self._fd = self._monitor.fileno()
        self._drop_vm_announcements()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)

    def _drop_vm_announcements(self) -> None:
        """Put the VM-announcement filter in front of libudev's own (which libudev installs at start and
        replaces on each new match); without it they are still left out, only after being read."""
        if not self._kernel_filter:
            return
        try:
            kvm_events.drop_in_kernel(self._monitor.fileno())
        except OSError as exc:
            self._kernel_filter = False
            log.info("no socket filter for KVM's VM announcements (%s): they are left out after they are read", exc)

    def set_subsystems(self, subsystems: Iterable[str]) -> None:
        """Change the in-kernel filter (on reload); libudev's new one gets the VM-announcement filter in
        front. A filter the kernel refuses (OSError) leaves the old one in place, and is raised."""
        wanted = frozenset(subsystems)
        if wanted == self._subsystems:
            return
        try:
            self._filter(wanted)
        except OSError:
            self._filter(self._subsystems)
            raise
        self._subsystems = wanted

    def _filter(self, subsystems: frozenset[str]) -> None:
        try:
            self._monitor.remove_filter()
        except OSError as exc:
            # Nothing to detach (no socket filter in place); the match list is cleared anyway.
            log.debug("removing the udev filter: %s", exc)
        for subsystem in sorted(subsystems):
            self._monitor.filter_by(subsystem)
        self._drop_vm_announcements()

    def close(self) -> None:
        if self._loop is not None and self._fd >= 0:
            self._loop.remove_reader(self._fd)
        self._fd = -1

    def _drain(self) -> None:
        events: list[UEvent] = []
        announcements = 0
        lost = False
        # Bounded: a flood cannot hold the loop; what is left is read on the next wake-up.
        for _ in range(1024):
            try:
                device = self._monitor.poll(timeout=0)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    lost = True
                    continue
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    break
                raise
            if device is None:
                break
            event = UEvent(
                action=str(device.action or ""),
                subsystem=str(device.subsystem or ""),
                sys_name=str(device.sys_name or ""),
                device_node=device.device_node,
            )
            if kvm_events.is_vm_announcement(event.action, event.subsystem, event.sys_name, device.properties):
                announcements += 1
            else:
                events.append(event)
        if announcements:
            self.vm_announcements += announcements
            log.debug("%d KVM VM announcement(s) left out: a VM's start or end changes no device", announcements)
        if lost:
            EventLog(log).warning("udev-lost", "udev events were lost (receive buffer full); re-probing every device")
            events.append(UEvent("lost", "", "", None))
        if events:
            self._on_hint(events)
