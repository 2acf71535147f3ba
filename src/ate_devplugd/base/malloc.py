"""glibc's malloc for a long-running daemon with helper threads: one arena for every thread, and the
heap trimmed after a burst of work (``Trim``).

gRPC core runs threads of its own (timers, an event engine, executors). glibc gives each thread that
allocates while the arenas it has are busy a new arena, up to eight per core, and memory freed in an
arena stays with it: after a burst of calls the daemon kept about 1 MiB more per such arena than with
one arena for all (``make bench``: RSS after load). The threads of this daemon seldom allocate at the
same moment (one Python thread under the GIL, gRPC's few), so sharing one costs no measurable speed
(Allocate figures alike). The same as ``MALLOC_ARENA_MAX=1`` in the environment, set from inside so
that any way of starting the daemon gets it.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

#: mallopt(3) parameter: the most arenas glibc creates (malloc.h).
M_ARENA_MAX = -8


def one_arena() -> bool:
    """Make threads created from now on share the main arena; False where this is not glibc's malloc.

    Call before any other thread starts (threads keep the arena they have).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, 1))


#: How long after the first change of a burst the heap is trimmed: later changes of the burst ride along.
TRIM_DELAY = 0.5


class Trim:
    """Give the heap's free pages back to the system once a burst of work has passed (``malloc_trim(3)``).

    After a burst (a kubelet restart, thousands of Allocates) glibc keeps the memory freed in the heap
    mapped: about 1 MiB of RSS that the daemon no longer uses (``make bench``: RSS after load). ``poke()``
    after each piece of work: the first one of a burst schedules one trim ``TRIM_DELAY`` later, the others
    ride along, and the work that comes after a trim schedules the next, so the last trim comes after the
    last piece of work; or ``now()`` where another coalesced step (the metrics file's write) ends the
    burst, with no timer of its own. Nothing where this is not glibc's malloc. A trim of this heap takes
    well under a millisecond.
    """

    def __init__(self, delay: float = TRIM_DELAY, call: Callable[[], object] | None = None) -> None:
        """``call``: what a trim does (a test's own; by default glibc's ``malloc_trim(0)``)."""
        self._delay = delay
        self._handle: asyncio.TimerHandle | None = None
        self._call = call
        if call is None:
            try:
                trim = ctypes.CDLL(None).malloc_trim
            except AttributeError:
                return
            trim.argtypes = [ctypes.c_size_t]
            trim.restype = ctypes.c_int
            self._call = lambda: trim(0)

    def poke(self) -> None:
        if self._call is not None and self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self._delay, self.now)

    def now(self) -> None:
        """Trim now (what a pending ``poke`` does when its time comes)."""
        self.close()
        if self._call is not None:
            self._call()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
