"""One malloc arena for every thread: threads that allocate at once share the main arena."""

from __future__ import annotations

import subprocess
import sys

from tests.support import subprocess_env

# Eight threads allocate at the same moment (past a barrier, with the GIL let go in between), then
# glibc's malloc_stats() lists the arenas on stderr, one "Arena N:" each.
THREADS = """
import ctypes, sys, threading, time
from ate_devplugd.base import malloc
if sys.argv[1] == "one":
    assert malloc.one_arena()
barrier = threading.Barrier(8)
kept = []
def work():
    barrier.wait()
    for _ in range(200):
        kept.append(bytearray(70000))
        time.sleep(0)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()
"""


def arenas(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", THREADS, mode], env=subprocess_env(), capture_output=True, text=True, check=True
    )
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_threads_share_the_main_arena() -> None:
    assert arenas("one") == 1
    # Without it glibc makes more, as the threads contend: the test can tell the two apart.
    assert max(arenas("default") for _ in range(3)) > 1
