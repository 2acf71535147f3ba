"""The udev watcher's loop integration, with a monitor backed by a real pipe fd."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from dataclasses import dataclass
from typing import Any

from ate_devplugd.udev import UdevWatcher, UEvent


@dataclass
class FakeDevice:
    action: str
    subsystem: str = "misc"
    sys_name: str = "kvm"
    device_node: str | None = "/dev/kvm"


class PipeMonitor:
    """Stands in for pyudev.Monitor: a real fd that becomes readable when an event is queued."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.queue: list[Any] = []
        self.filters: list[str] = []
        self.started = False

    def fileno(self) -> int:
        return self._r

    def filter_by(self, subsystem: str) -> None:
        self.filters.append(subsystem)

    def remove_filter(self) -> None:
        self.filters.clear()

    def start(self) -> None:
        self.started = True

    def trigger(self, *items: Any) -> None:
        self.queue.extend(items)
        os.write(self._w, b"x")

    def poll(self, timeout: float | None = None) -> Any:
        with contextlib.suppress(BlockingIOError):
            os.read(self._r, 1)
        if not self.queue:
            return None
        item = self.queue.pop(0)
        if isinstance(item, OSError):
            raise item
        return item

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class TestUdevWatcher:
    async def test_events_are_drained_in_one_batch(self) -> None:
        """Everything queued is drained at one wake-up and handed over as one hint."""
        monitor = PipeMonitor()
        batches: asyncio.Queue[list[UEvent]] = asyncio.Queue()
        watcher = UdevWatcher(monitor, {"misc"}, batches.put_nowait)
        watcher.start()
        try:
            assert monitor.started and monitor.filters == ["misc"]
            monitor.trigger(FakeDevice("remove"), FakeDevice("add"))
            async with asyncio.timeout(5):
                batch = await batches.get()
            assert [e.action for e in batch] == ["remove", "add"]
            assert batch[0] == UEvent("remove", "misc", "kvm", "/dev/kvm")
        finally:
            watcher.close()
            monitor.close()

    async def test_lost_events_still_hint(self) -> None:
        """ENOBUFS (events dropped by the kernel) becomes a hint to re-probe, not an error."""
        monitor = PipeMonitor()
        batches: asyncio.Queue[list[UEvent]] = asyncio.Queue()
        watcher = UdevWatcher(monitor, {"misc"}, batches.put_nowait)
        watcher.start()
        try:
            monitor.trigger(OSError(errno.ENOBUFS, "No buffer space available"))
            async with asyncio.timeout(5):
                batch = await batches.get()
            assert [e.action for e in batch] == ["lost"]
        finally:
            watcher.close()
            monitor.close()

    def test_filter_update(self) -> None:
        """Changing the subsystems replaces the in-kernel filter."""
        monitor = PipeMonitor()
        watcher = UdevWatcher(monitor, {"misc"}, lambda _: None)
        watcher.set_subsystems({"misc", "drm"})
        assert sorted(monitor.filters) == ["drm", "misc"]
        monitor.close()
