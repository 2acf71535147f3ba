"""How each reload went, said everywhere it is said: the journal, the end of STATUS, the reload counters
and the daemon's record of itself, where ``ate-devplugd reload`` waits for it (``reload.record``).

Reloads are numbered from 1 (the start is 0). A reload that begins is recorded as ``reloading`` at once,
so that a ``reload`` command that reads the record while one runs waits for the next; it ends
``applied``, ``refused`` (``reload.decision.ReloadRefused``: every line in the journal, the first in
STATUS as ``reload refused HH:MM:SS: <why>``) or ``failed`` (an exception: its traceback in the journal).
STATUS keeps the note until the next reload that is applied, or the daemon's restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import ConfigDiff
from ate_devplugd.reload.decision import ReloadRefused
from ate_devplugd.reload.result import Outcome, Result
from ate_devplugd.signals.metrics import Metrics

log = logging.getLogger(__name__)


class ReloadReport:
    """The daemon's account of its reloads."""

    def __init__(self, metrics: Metrics, on_result: Callable[[], None]) -> None:
        self._metrics = metrics
        self._on_result = on_result
        self._events = EventLog(log)
        #: The latest reload's result (the start's until the first reload).
        self.last = Result(0, Outcome.STARTED)
        #: The end of STATUS after a reload that was refused or failed, until the next good one.
        self.note: str | None = None

    @property
    def generation(self) -> int:
        """The number of the latest reload (0: none yet)."""
        return self.last.generation

    def _record(self, outcome: Outcome, error: str = "", generation: int | None = None) -> None:
        self.last = Result(self.generation if generation is None else generation, outcome, error)
        self._on_result()

    def begin(self) -> None:
        self._record(Outcome.RELOADING, generation=self.generation + 1)

    def applied(self, change: ConfigDiff) -> None:
        self.note = None
        self._events.info(
            "reload",
            "reloaded: %d added, %d changed, %d removed, %d unchanged",
            len(change.added),
            len(change.changed),
            len(change.removed),
            len(change.unchanged),
        )
        self._metrics.reload()
        self._record(Outcome.APPLIED)

    def refused(self, refusal: ReloadRefused) -> None:
        for line in refusal.journal_lines():
            self._events.error("reload-failed", "%s", line)
        self.note = f"reload refused {time.strftime('%H:%M:%S')}: {refusal.first}"
        self._metrics.reload_failed()
        self._record(Outcome.REFUSED, refusal.message())

    def handover_failed(self, line: str) -> None:
        """A handover the successor could not take: this daemon serves on."""
        self._events.error("handover-failed", "%s; this daemon serves on", line)
        self.note = f"{line.replace('handover failed', 'handover failed ' + time.strftime('%H:%M:%S'), 1)}"
        self._metrics.reload_failed()
        self._record(Outcome.FAILED, line)

    def failed(self, exc: Exception) -> None:
        self._events.error("reload-failed", "reload failed; the daemon keeps running", exc_info=True)
        self.note = f"reload failed {time.strftime('%H:%M:%S')}: {exc}"
        self._metrics.reload_failed()
        self._record(Outcome.FAILED, f"reload failed: {exc}")
