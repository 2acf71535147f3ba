"""The udev watcher's loop integration, with a monitor backed by a real pipe fd (tests.support.FakeMonitor)."""

from __future__ import annotations

import asyncio
import errno

from ate_devplugd.node import kvm_events
from ate_devplugd.node.udev import UdevWatcher, UEvent
from tests.support import FakeMonitor


class TestUdevWatcher:
    async def test_events_are_drained_in_one_batch(self) -> None:
        """Everything queued is drained at one wake-up and handed over as one hint."""
        monitor = FakeMonitor()
        batches: asyncio.Queue[list[UEvent]] = asyncio.Queue()
        watcher = UdevWatcher(monitor, {"misc"}, batches.put_nowait)
        watcher.start()
        try:
            assert monitor.started and monitor.filters == {"misc"}
            monitor.emit("remove")
            monitor.emit("add")
            async with asyncio.timeout(5):
                batch = await batches.get()
            assert [e.action for e in batch] == ["remove", "add"]
            assert batch[0] == UEvent("remove", "misc", "kvm", "/dev/kvm")
        finally:
            watcher.close()
            monitor.close()

    async def test_lost_events_still_hint(self) -> None:
        """ENOBUFS (events dropped by the kernel) becomes a hint to re-probe, not an error."""
        monitor = FakeMonitor()
        batches: asyncio.Queue[list[UEvent]] = asyncio.Queue()
        watcher = UdevWatcher(monitor, {"misc"}, batches.put_nowait)
        watcher.start()
        try:
            monitor.fail(OSError(errno.ENOBUFS, "No buffer space available"))
            async with asyncio.timeout(5):
                batch = await batches.get()
            assert [e.action for e in batch] == ["lost"]
        finally:
            watcher.close()
            monitor.close()

    def test_filter_update(self) -> None:
        """Changing the subsystems replaces the in-kernel filter."""
        monitor = FakeMonitor()
        watcher = UdevWatcher(monitor, {"misc"}, lambda _: None)
        watcher.set_subsystems({"misc", "drm"})
        assert sorted(monitor.filters) == ["drm", "misc"]
        monitor.close()

    async def test_vm_announcements_are_not_hints(self) -> None:
        """KVM's change uevents for a VM's start and end are left out (and counted); a change on misc/kvm
        without their properties, and any other action, is still a hint."""
        monitor = FakeMonitor()
        batches: asyncio.Queue[list[UEvent]] = asyncio.Queue()
        watcher = UdevWatcher(monitor, {"misc"}, batches.put_nowait)
        watcher.start()
        try:
            for pid in range(100, 150):
                monitor.emit_vm("create", pid)
                monitor.emit_vm("destroy", pid, count=0)
            monitor.emit("change", EVENT="create")  # EVENT alone is not KVM's announcement
            monitor.emit("remove")
            hints: list[UEvent] = []
            async with asyncio.timeout(5):
                while len(hints) < 2:
                    batch = await batches.get()
                    assert batch, "a batch of announcements alone must make no hint"
                    hints += batch
            assert [e.action for e in hints] == ["change", "remove"]
            assert watcher.vm_announcements == 100
            assert batches.empty()
        finally:
            watcher.close()
            monitor.close()

    async def test_real_monitor_keeps_the_socket_filter(self) -> None:
        """On pyudev's own netlink socket the VM-announcement filter is in place after start and after a
        reload changes the subsystems (libudev clears the socket's filter then)."""
        import pyudev

        monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        watcher = UdevWatcher(monitor, {"misc"}, lambda _: None)
        prefix = kvm_events.drop_program()
        watcher.start()
        try:
            assert kvm_events.installed_program(monitor.fileno())[: len(prefix)] == prefix
            watcher.set_subsystems({"misc", "net"})
            assert kvm_events.installed_program(monitor.fileno())[: len(prefix)] == prefix
        finally:
            watcher.close()
