"""What the daemon is asked to do by signals: stop (SIGTERM, SIGINT), reload its config (SIGHUP) or hand
over to a successor (SIGUSR2). A handler only records the request and wakes the main loop, which takes
the requests one at a time; once a stop is asked for, nothing else is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import signal
from collections.abc import Iterator


class Request(enum.Enum):
    STOP = "stop"
    RELOAD = "reload"
    HANDOVER = "handover"


SIGNALS = {
    signal.SIGTERM: Request.STOP,
    signal.SIGINT: Request.STOP,
    signal.SIGHUP: Request.RELOAD,
    signal.SIGUSR2: Request.HANDOVER,
}


class Requests:
    """The requests not yet taken, and the main loop's wake-up."""

    def __init__(self) -> None:
        self._asked: set[Request] = set()
        self._wake = asyncio.Event()

    def ask(self, request: Request) -> None:
        self._asked.add(request)
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return Request.STOP in self._asked

    def take(self, request: Request) -> bool:
        """Whether ``request`` was asked for since it was last taken (never once a stop is asked for)."""
        if request not in self._asked or self.stopping:
            return False
        self._asked.discard(request)
        return True

    async def next(self) -> None:
        """Until something is asked for."""
        await self._wake.wait()
        self._wake.clear()

    @contextlib.contextmanager
    def from_signals(self) -> Iterator[None]:
        """The signals' handlers on the running loop, while the block runs."""
        loop = asyncio.get_running_loop()
        for sig, request in SIGNALS.items():
            loop.add_signal_handler(sig, self.ask, request)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
