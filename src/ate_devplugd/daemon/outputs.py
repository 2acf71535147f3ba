"""What the daemon says of itself, in one place: READY and STATUS to systemd with the watchdog's pings,
the metrics and the file node_exporter reads (the heap trimmed after its writes), and, on every change of
these, its record on the instance lock (``reload.record``: the caller's ``record_changed``).

Before READY the daemon says nothing but READY itself: STATUS and the metrics file follow from then on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ate_devplugd.base.malloc import Trim
from ate_devplugd.config import Config
from ate_devplugd.signals.metrics import Metrics
from ate_devplugd.signals.notify import Notifier, watchdog_interval
from ate_devplugd.signals.textfile import TextfileWriter


class Outputs:
    """systemd's notifications, the metrics and their file, and the hook of the daemon's record."""

    def __init__(self, config: Config, notifier: Notifier, record_changed: Callable[[], None]) -> None:
        self.notifier = notifier
        self.metrics = Metrics()
        self._trim = Trim()
        self._file = TextfileWriter(config.metrics_file, self.metrics.render, after_write=self._trim.now)
        self._record_changed = record_changed
        self._watchdog: asyncio.Task[None] | None = None
        #: READY=1 has gone out.
        self.ready = False
        #: The metrics file outlives the daemon (it handed over: the file is its successor's now).
        self.keep_file = False

    def say_ready(self, status: str) -> None:
        """READY=1 with the first STATUS; the metrics count from now on (the file's first write follows)."""
        self.ready = True
        self.notifier.ready(status)
        self.metrics.on_change = self._counted
        self._record_changed()

    def status(self, status: str) -> None:
        if self.ready:
            self.notifier.status(status)
            self._record_changed()

    def follow(self, config: Config) -> None:
        """The metrics file of ``config`` (at start and after each reload: on again after an error)."""
        self._file.enable(config.metrics_file)

    def _counted(self, prompt: bool = False) -> None:
        """A change the metrics count (a registration, an Allocate, ...): the metrics file follows, and the
        heap is trimmed once the burst has passed: after the file's coalesced write, else on its own timer."""
        self._file.changed(prompt)
        if not self._file.enabled:
            self._trim.poke()
        self._record_changed()

    def start_watchdog(self) -> None:
        """WATCHDOG=1 at half of systemd's interval, where systemd asks for it."""
        interval = watchdog_interval()
        if interval is None or not self.notifier.enabled:
            return

        async def ping() -> None:
            while True:
                self.notifier.watchdog()
                await asyncio.sleep(interval)

        self._watchdog = asyncio.get_running_loop().create_task(ping(), name="watchdog")

    def close(self) -> None:
        """No more pings, writes or trims; the metrics file removed, the notify socket closed."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._file.close(remove=not self.keep_file)
        self._trim.close()
        self.notifier.close()
