"""The runtime's verdict as the daemon holds it between answers: kept while the runtime is away.

A runtime that has answered keeps its verdict until it answers again: one that is stopped, restarting or
busy creates no container meanwhile, and comes back with its config (a restart that changes it is heard
as the new answer). Only where no runtime has answered since the start, for the socket and ``cdi_dir``
asked, is the verdict ``unknown`` (saying so); a verdict drawn for another socket or directory is no
evidence for these. ``known`` is set once a verdict stands for them: an answer, one kept, or ``unknown``
where nothing can answer (no socket); not while a socket that is there has given no answer yet.

Each answer's ``since`` is the loop time after which the runtime that gave it started: the last time its
socket was seen gone before that socket file (``FileIdentity``) first answered; None where it was there
before the daemon looked. ``cri.usable`` compares it with the time ``cdi_dir`` was replaced.
"""

from __future__ import annotations

import asyncio
import dataclasses

from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport


class HeldVerdict:
    """The verdict for the socket and directory asked (``expect``), from each answer (``heard``)."""

    def __init__(self) -> None:
        self.report: RuntimeReport | None = None
        self.known = asyncio.Event()
        self._key: tuple[str, str] | None = None
        #: The (socket, cdi_dir) ``report`` stands for; the socket file that answered; when the runtime
        #: behind it started; the last time its socket was seen gone.
        self._asked: tuple[str, str] | None = None
        self._instance: FileIdentity | None = None
        self._since: float | None = None
        self._gone_at: float | None = None

    def expect(self, socket: str, cdi_dir: str) -> None:
        """The socket and directory asked from now on (a verdict for others is not known for these)."""
        self._key = (socket, cdi_dir)
        if self._asked != self._key:
            self.known.clear()

    def forget(self) -> None:
        """The check is off: nothing is held (the next verdict is new)."""
        self.report = self._asked = self._key = None
        self.known.clear()

    def gone(self) -> None:
        """The runtime's socket was seen gone now: a runtime that answers later started after this."""
        self._gone_at = asyncio.get_running_loop().time()

    def heard(self, answer: RuntimeReport) -> RuntimeReport:
        """The verdict after ``answer``: the runtime's own where it answered (with ``since``); else the one
        held for the socket and directory asked, marked ``away`` with why, or ``unknown``."""
        if answer.answered:
            instance = FileIdentity.of(answer.socket)
            if instance is None or instance != self._instance:
                self._instance, self._since = instance, self._gone_at
            return self._hold(dataclasses.replace(answer, since=self._since))
        if not answer.unanswered:
            self.gone()
        kept = self.report
        if kept is not None and kept.answered and self._asked == self._key:
            return self._hold(dataclasses.replace(kept, away=answer.reason))
        return self.unknown(answer.reason, answer.socket, known=not answer.unanswered)

    def unknown(self, why: str, socket: str = "", *, known: bool = True) -> RuntimeReport:
        """No runtime has answered since the start (for the socket and directory asked): ``unknown``, saying
        so; a verdict held for them stays."""
        kept = self.report
        if kept is not None and kept.answered and self._asked == self._key:
            return kept
        report = RuntimeReport(CdiVerdict.UNKNOWN, f"no runtime has answered since the start: {why}", socket=socket)
        return self._hold(report, known=known)

    def _hold(self, report: RuntimeReport, *, known: bool = True) -> RuntimeReport:
        self.report, self._asked = report, self._key
        if known:
            self.known.set()
        return report
