"""glibc's malloc for a long-running daemon with helper threads: one arena for every thread.

gRPC core runs threads of its own (timers, an event engine, executors). glibc gives each thread that
allocates while the arenas it has are busy a new arena, up to eight per core, and memory freed in an
arena stays with it: after a burst of calls the daemon kept about 1 MiB more per such arena than with
one arena for all (``make bench``: RSS after load). The threads of this daemon seldom allocate at the
same moment (one Python thread under the GIL, gRPC's few), so sharing one costs no measurable speed
(Allocate figures alike). The same as ``MALLOC_ARENA_MAX=1`` in the environment, set from inside so
that any way of starting the daemon gets it.
"""

from __future__ import annotations

import ctypes

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
