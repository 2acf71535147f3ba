"""``ate-devplugd reload --handover`` (and ``reload`` when the program on disk is another version than the
daemon's: an upgrade): ask the running daemon to hand its node over to a new process of the program on disk
(``daemon.handover``), and say how that went.

It watches the daemon's record, sends SIGUSR2, and follows the handover there: the successor's pid, then
the record's end (the predecessor exits once its successor serves), or the verdict of a handover that
failed (the daemon serving on, and why). Then it follows the successor's own record until it is ready
and kubelet holds every resource it serves. Nothing is waited for without a timeout, nothing is polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import NamedTuple

from ate_devplugd.base import announce
from ate_devplugd.commands import instance
from ate_devplugd.reload import record
from ate_devplugd.reload.record import Instance


class Handed(NamedTuple):
    """How a handover went: None ``failure`` when the successor serves; ``serving_on`` when the daemon
    said it could not hand over (and so serves on)."""

    failure: str | None
    successor: int = 0
    version: str = ""
    serving_on: bool = False
    #: Seconds from the signal to the successor's record saying kubelet holds what it serves.
    took: float = 0.0


class Said(NamedTuple):
    """A handover as the commands say it: their line; whether the successor serves; whether the daemon
    serves on as before (it refused, or was never signalled: nothing was changed)."""

    line: str
    done: bool
    serving_on: bool = False


async def hand_over_said(running: instance.Running, timeout: float) -> Said:
    """``hand_over``, its end in the line ``reload`` and the guard give (a refused signal included)."""
    try:
        handed = await hand_over(running, timeout)
    except ProcessLookupError:
        return Said(f"no daemon to hand over: no process {running.pid} is running", done=False)
    except PermissionError:
        line = f"cannot signal process {running.pid}: permission denied (run as root)"
        return Said(line, done=False, serving_on=True)
    except OSError:
        return Said(f"the daemon (pid {running.pid}) ended before it handed over", done=False)
    if handed.failure is not None:
        on = f"; the daemon (pid {running.pid}, {running.record.version}) serves on" if handed.serving_on else ""
        return Said(handed.failure + on, done=False, serving_on=handed.serving_on)
    return Said(
        f"handed over from pid {running.pid} ({running.record.version}) to pid {handed.successor} "
        f"({handed.version}): kubelet holds it {handed.took * 1000:.0f} ms after the request",
        done=True,
    )


def held(rec: Instance) -> bool:
    """Ready, and kubelet holds every resource it serves."""
    return rec.ready and bool(rec.serving) and all(s.registered for s in rec.serving)


async def hand_over(running: instance.Running, timeout: float) -> Handed:
    """Ask ``running`` to hand over, and follow it through (within ``timeout`` seconds in all)."""
    began = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            successor, failure = await _predecessor(running.name)
            if failure is not None:
                return Handed(failure, serving_on=True)
            if not successor:
                return Handed(f"the daemon (pid {running.pid}) ended before it handed over")
            found = next((r for r in await instance.every() if r.pid == successor), None)
            if found is None:
                return Handed(f"the new process (pid {successor}) does not serve: see journalctl -u ate-devplugd")
            async with contextlib.aclosing(announce.follow(found.name)) as records:
                async for _, line in records:
                    now = record.decode(line)
                    if now is not None and held(now):
                        return Handed(None, successor, now.version, took=time.monotonic() - began)
            return Handed(f"the new process (pid {successor}) ended before kubelet held what it serves")
    except TimeoutError:
        return Handed(f"the handover did not end within {timeout:g} s; see journalctl -u ate-devplugd")


async def _predecessor(name: bytes) -> tuple[int, str | None]:
    """Signal the daemon holding ``name`` and follow its record to its end: its successor's pid, and why
    the handover failed (None: it did not)."""
    after: int | None = None
    successor = 0
    async with contextlib.aclosing(announce.follow(name)) as records:
        async for peer, line in records:
            now = record.decode(line)
            if now is None:
                continue
            if after is None:  # the record as of our watch: the handover the signal starts comes after it
                after = now.reload.generation
                send_signal(peer.pid, signal.SIGUSR2)
                continue
            successor = now.successor or successor
            if now.reload.ended_after(after):
                return 0, now.reload.error or "the handover failed"
    return successor, None


def send_signal(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the daemon, through a pidfd where there is one (the pid cannot have been reused).
    ProcessLookupError: no such process; PermissionError: not ours to signal."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError:
        os.kill(pid, sig)
        return
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except PermissionError:  # a system-call filter may refuse the call itself; kill(2) says if the signal may go
        os.kill(pid, sig)
    finally:
        os.close(pidfd)
