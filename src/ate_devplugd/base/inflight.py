"""The calls a server is answering: counted, so that a stop answers them before it ends its streams.

kubelet disconnects a plugin as soon as its stream ends (the ListAndWatch of a device plugin), and a call it
still waits for on that connection then fails (``Canceled: the client connection is closing``: a pod lost).
So a server stops in this order: it takes no new call, the calls already accepted are answered (``idle``,
bounded), and only then do its streams end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class InFlight:
    """The unary calls being answered now."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around one call's answer."""
        self._count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._count -= 1
            if not self._count:
                self._idle.set()

    async def idle(self, timeout: float) -> bool:
        """Until no call is being answered (False: some still were after ``timeout`` seconds)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        return self._idle.is_set()
