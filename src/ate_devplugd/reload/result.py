"""The outcome of each reload, in a small file the daemon keeps in its runtime directory.

The daemon writes it, each time in one step (a rename): when it is ready (generation 0, ``started``),
when a reload begins (``reloading``, with the number that reload has) and when that reload ends
(``applied``, ``refused`` or ``failed``, with the first error). Whoever asks for a reload reads the
generation before signalling, and the verdict on its own reload is the first ended record of the same
process with a higher generation: the reload that ran when the signal came is the record it read, so the
one after it read the file as it is now. The wait is on inotify events in the directory (and on the
process's end, through its pidfd), with a timeout; never a poll.
"""

from __future__ import annotations

import asyncio
import enum
import posixpath
from typing import NamedTuple

from ate_devplugd.base import atomicfile
from ate_devplugd.base.inotify import DirEvent, DirWatcher

FILE_NAME = "reload-result.json"
#: Readable by anyone, like the running config beside it (the unit's UMask=0077 would hide it).
FILE_MODE = 0o644


class Outcome(enum.Enum):
    STARTED = "started"
    RELOADING = "reloading"
    APPLIED = "applied"
    REFUSED = "refused"
    FAILED = "failed"


#: The outcomes that end a reload.
ENDED = frozenset({Outcome.APPLIED, Outcome.REFUSED, Outcome.FAILED})


class Result(NamedTuple):
    """One record: whose (``pid``), which reload (``generation``, 0 for the start), and how it went;
    ``error`` is the line to show for a refused or failed one (``config error: ...``)."""

    pid: int
    generation: int
    outcome: Outcome
    error: str = ""


def path_in(runtime_dir: str) -> str:
    return posixpath.join(runtime_dir, FILE_NAME)


def write(path: str, result: Result) -> None:
    """Replace the record in one step (a reader sees the old one or the new one, never a part)."""
    import json  # noqa: PLC0415 - only under the unit, once the daemon has started

    record = {"pid": result.pid, "generation": result.generation, "outcome": result.outcome.value}
    if result.error:
        record["error"] = result.error
    atomicfile.replace_file(path, (json.dumps(record) + "\n").encode(), FILE_MODE)


def read(path: str) -> Result | None:
    """The record at ``path``; None when there is none (or it is not one of ours)."""
    import json  # noqa: PLC0415

    try:
        with open(path, "rb") as fh:
            record = json.loads(fh.read(64 * 1024))
        return Result(
            pid=int(record["pid"]),
            generation=int(record["generation"]),
            outcome=Outcome(record["outcome"]),
            error=str(record.get("error", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def generation_of(path: str, pid: int) -> int:
    """The generation of ``pid``'s current record: the one a reload signalled now will exceed (0 when it
    has written none yet: its first reload is 1)."""
    result = read(path)
    return result.generation if result is not None and result.pid == pid else 0


async def wait(path: str, pid: int, after: int, timeout: float, pidfd: int | None = None) -> Result | None:
    """The first ended record of ``pid`` with a generation above ``after``; None when none comes within
    ``timeout`` seconds. Given the process's ``pidfd`` (opened before it was signalled), its end is an
    event too: ``ProcessLookupError`` when it ends first."""
    woken = asyncio.Event()

    def on_events(_events: list[DirEvent]) -> None:
        woken.set()

    loop = asyncio.get_running_loop()
    watcher = DirWatcher(posixpath.dirname(path), on_events)
    watcher.start()  # before the first read: a record written between the two is not missed
    ended = False

    def on_end() -> None:
        nonlocal ended
        ended = True
        woken.set()

    if pidfd is not None:
        loop.add_reader(pidfd, on_end)
    try:
        async with asyncio.timeout(timeout):
            while True:
                result = read(path)
                if result is not None and result.pid == pid and result.generation > after and result.outcome in ENDED:
                    return result
                if ended:
                    raise ProcessLookupError(pid, "the process ended")
                await woken.wait()
                woken.clear()
    except TimeoutError:
        return None
    finally:
        watcher.close()
        if pidfd is not None:
            loop.remove_reader(pidfd)
