"""The daemon's start-up and shutdown as named steps, each logged at debug with the time it took.

A start-up step that sets something up names, once it has, the shutdown step that undoes it
(``on_stop``); the shutdown runs those in the reverse order, each once and each on its own: one that
raises is logged with its traceback and the next one runs. So a start that fails half-way undoes what it
did, and nothing else.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from ate_devplugd.base.logs import EventLog

log = logging.getLogger(__name__)

T = TypeVar("T")


class Steps:
    """The steps run so far, and the shutdown steps they owe."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], object]]] = []

    @overload
    async def run(self, name: str, step: Callable[[], Awaitable[T]]) -> T: ...
    @overload
    async def run(self, name: str, step: Callable[[], T]) -> T: ...

    async def run(self, name: str, step: Callable[[], Any]) -> Any:
        """Run one start-up step (a function, or a coroutine function) and log how long it took."""
        began = time.perf_counter()
        try:
            result = step()
            if inspect.isawaitable(result):
                result = await result
            return result
        finally:
            log.debug("start step %s: %.1f ms", name, (time.perf_counter() - began) * 1000)

    def on_stop(self, name: str, step: Callable[[], object]) -> None:
        """What the shutdown runs for a step that has set something up."""
        self._undo.append((name, step))

    async def stop(self) -> None:
        """Every shutdown step owed, the last set up first."""
        while self._undo:
            name, step = self._undo.pop()
            began = time.perf_counter()
            try:
                result = step()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failed step must not keep the others from running
                EventLog(log).error("stop-step-failed", "stop step %s failed; the others run", name, exc_info=True)
            log.debug("stop step %s: %.1f ms", name, (time.perf_counter() - began) * 1000)
