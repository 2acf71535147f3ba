"""How a reload went: its number, its outcome and, for one that was not applied, why.

The daemon numbers its reloads from 1 (its start is 0). A reload that begins is ``reloading`` with its
number at once, then ``applied``, ``refused`` or ``failed``; the latest is part of the daemon's record of
itself (``reload.record``). Whoever asks for a reload reads the number before signalling, and the
verdict on its own reload is the first ended result with a higher one: the reload that ran when the
signal came is the one it read, so the one after it read the file as it is now.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Outcome(enum.Enum):
    STARTED = "started"
    RELOADING = "reloading"
    APPLIED = "applied"
    REFUSED = "refused"
    FAILED = "failed"


#: The outcomes that end a reload.
ENDED = frozenset({Outcome.APPLIED, Outcome.REFUSED, Outcome.FAILED})


class Result(NamedTuple):
    """Which reload (``generation``, 0 for the start), and how it went; ``error`` is the line to show for a
    refused or failed one (``config error: ...``)."""

    generation: int
    outcome: Outcome
    error: str = ""

    def ended_after(self, generation: int) -> bool:
        """Whether this is the verdict on a reload numbered above ``generation``."""
        return self.generation > generation and self.outcome in ENDED
