"""Write the metrics to a file node_exporter's textfile collector reads: atomically, coalesced, only on change.

``changed()`` (the metrics' ``on_change`` hook) arms one loop timer if none is armed. The first change
after a quiet interval is written ``FIRST_DELAY`` later (10 ms): a device that goes away shows at the
next scrape, every change of the same moment lands in that one write, and the write never comes
between the change and what kubelet is told of it (a ListAndWatch message, an Allocate answer, which
the loop sends first). Later counter changes wait until ``interval`` has passed since the last write,
so a burst of Allocates is written at most about once per interval, ending with the final state. A
change of *state* (``prompt``: registered, streams, health, the runtime's verdict) waits only
``PROMPT_INTERVAL`` since the last write: the file says what the daemon says (STATUS) within a tenth of
a second, not a second later, and a flapping device still costs at most ten writes a second. Nothing
is armed while nothing changes: an idle daemon neither writes nor wakes for metrics.

A write renders the metrics, writes them to a hidden temp file in the same directory (not ``*.prom``,
so the collector ignores it), makes it mode 0644 whatever the umask (node_exporter runs as another
user) and renames it over the file. No fsync: the file is rebuilt from live state at every start, and
a disk flush would stall the loop that answers Allocate and pings the watchdog. Nothing is locked or
waited for: readers see the old file or the new one, and a FIFO at the path is replaced, not opened.

Any OSError turns the writer off with one log line (info for a missing directory, which usually means
node_exporter is not installed; warning otherwise: read-only, full, no permission); the daemon serves
on. ``enable()`` (on reload) turns it on again and writes the current state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable

from ate_devplugd.base import atomicfile
from ate_devplugd.base.logs import EventLog

log = logging.getLogger(__name__)

#: Minimum seconds between two writes while changes keep coming.
INTERVAL = 1.0
#: Delay of the first write after a quiet interval (see the module doc).
FIRST_DELAY = 0.01
#: Minimum seconds between a write and the next one that carries a change of state.
PROMPT_INTERVAL = 0.1
FILE_MODE = 0o644
_MISSING_DIR = (errno.ENOENT, errno.ENOTDIR)


class TextfileWriter:
    """Keeps ``path`` equal to ``render()``, written on change; ``path=""`` means metrics are off."""

    def __init__(
        self,
        path: str,
        render: Callable[[], bytes],
        *,
        interval: float = INTERVAL,
        after_write: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self._render = render
        #: Called after each file written: the coalesced end of a burst of changes.
        self._after_write = after_write
        self.interval = interval
        self.enabled = bool(path)
        #: Files written (renames done) since construction.
        self.writes = 0
        self._dirty = bool(path)
        self._handle: asyncio.TimerHandle | None = None
        self._last_write: float | None = None
        self._written_path = ""
        #: Why metrics went off, as last said (the path and the errno): said again only when it changes.
        self._off: tuple[str, int | None] | None = None

    @property
    def pending(self) -> bool:
        """True while a write is scheduled (never while nothing changed since the last one)."""
        return self._handle is not None

    def start(self) -> None:
        """Write the initial state soon (call on the running loop)."""
        if self.enabled:
            self.changed()

    def changed(self, prompt: bool = False) -> None:
        """Something in the metrics changed (``prompt``: a change of state): write it soon, coalesced with
        what follows."""
        self._dirty = True
        if not self.enabled:
            return
        gap = min(PROMPT_INTERVAL, self.interval) if prompt else self.interval
        wait = 0.0 if self._last_write is None else self._last_write + gap - time.monotonic()
        loop = asyncio.get_running_loop()
        due = loop.time() + max(wait, FIRST_DELAY)
        if self._handle is not None:
            if self._handle.when() <= due:
                return
            self._handle.cancel()
        self._handle = loop.call_at(due, self._scheduled)

    def _scheduled(self) -> None:
        self._handle = None
        self.flush()

    def _cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _remove_written(self) -> None:
        if self._written_path:
            with contextlib.suppress(OSError):
                os.unlink(self._written_path)
            self._written_path = ""

    def flush(self) -> None:
        """Write now if anything changed since the last write (and the writer is on)."""
        self._cancel()
        if not (self.enabled and self._dirty):
            return
        self._dirty = False
        self._last_write = time.monotonic()
        try:
            # 0644 whatever the umask: the unit's UMask=0077 would leave it unreadable to node_exporter
            atomicfile.replace_file(self.path, self._render(), FILE_MODE)
        except OSError as exc:
            self._turn_off(exc)
            return
        self.writes += 1
        self._written_path = self.path
        self._off = None
        if self._after_write is not None:
            self._after_write()

    def _turn_off(self, exc: OSError) -> None:
        """Off until a reload; said once per cause (a reload that meets the same one says nothing again)."""
        self.enabled = False
        if self._off == (self.path, exc.errno):
            log.debug("metrics still off: %s: %s", self.path, exc.strerror or exc)
            return
        self._off = (self.path, exc.errno)
        events = EventLog(log)
        if exc.errno in _MISSING_DIR:
            events.info(
                "metrics-off",
                "metrics off: %s does not exist (is prometheus-node-exporter installed?); "
                'they stay off until a reload (metrics_file = "" turns them off for good)',
                os.path.dirname(self.path),
            )
        else:
            events.warning(
                "metrics-off",
                "metrics off: cannot write %s: %s; the daemon serves on, metrics stay off until a reload",
                self.path,
                exc.strerror or exc,
            )

    def enable(self, path: str) -> None:
        """Use ``path`` from now on (a reload): on again after an error, and the current state written soon.

        An empty path turns metrics off. A file written under another path before is removed.
        """
        if self._written_path != path:
            self._remove_written()
        self.path = path
        self.enabled = bool(path)
        if not self.enabled:
            self._cancel()
            return
        self.changed()

    def close(self, *, remove: bool = True) -> None:
        """Stop writing; with ``remove``, delete the file so a stopped daemon leaves no stale values."""
        self._cancel()
        self.enabled = False
        if remove:
            self._remove_written()
