"""How each reload went, said everywhere it is said: the journal, the end of STATUS, the reload counters
and the outcome record that ``ate-devplugd reload`` waits for.

Reloads are numbered from 1 (the start is 0). A reload that begins is recorded as ``reloading`` at once,
so that a ``reload`` command that reads the record while one runs waits for the next; it ends
``applied``, ``refused`` (``reload.decision.ReloadRefused``: every line in the journal, the first in
STATUS as ``reload refused HH:MM:SS: <why>``) or ``failed`` (an exception: its traceback in the journal).
STATUS keeps the note until the next reload that is applied, or the daemon's restart.
"""

from __future__ import annotations

import logging
import time

from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import ConfigDiff
from ate_devplugd.reload.decision import ReloadRefused
from ate_devplugd.reload.result import Outcome
from ate_devplugd.reload.rundir import RuntimeFiles
from ate_devplugd.signals.metrics import Metrics

log = logging.getLogger(__name__)


class ReloadReport:
    """The daemon's account of its reloads."""

    def __init__(self, metrics: Metrics, files: RuntimeFiles) -> None:
        self._metrics = metrics
        self._files = files
        self._events = EventLog(log)
        #: The number of the latest reload (0: none yet).
        self.generation = 0
        #: The end of STATUS after a reload that was refused or failed, until the next good one.
        self.note: str | None = None

    def started(self) -> None:
        """The daemon runs its first config."""
        self._files.record(self.generation, Outcome.STARTED)

    def begin(self) -> None:
        self.generation += 1
        self._files.record(self.generation, Outcome.RELOADING)

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
        self._files.record(self.generation, Outcome.APPLIED)

    def refused(self, refusal: ReloadRefused) -> None:
        for line in refusal.journal_lines():
            self._events.error("reload-failed", "%s", line)
        self.note = f"reload refused {time.strftime('%H:%M:%S')}: {refusal.first}"
        self._metrics.reload_failed()
        self._files.record(self.generation, Outcome.REFUSED, refusal.message())

    def failed(self, exc: Exception) -> None:
        self._events.error("reload-failed", "reload failed; the daemon keeps running", exc_info=True)
        self.note = f"reload failed {time.strftime('%H:%M:%S')}: {exc}"
        self._metrics.reload_failed()
        self._files.record(self.generation, Outcome.FAILED, f"reload failed: {exc}")
