"""The udev watcher's loop integration, with a monitor backed by a real pipe fd (tests.support.FakeMonitor)."""

from __future__ import annotations

import asyncio
import errno

from ate_devplugd.udev import UdevWatcher, UEvent
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
