"""A planned restart whose window is only the old process's stop and one registration: the running daemon
(the predecessor) hands the node over to a new process of the program on disk (its successor).

1. Asked to (SIGUSR2: ``ate-devplugd reload --handover``, or ``systemctl reload`` with another version on
   disk), the predecessor starts its successor with its own command line and one end of a socketpair,
   and goes on serving.
2. The successor imports, loads and checks its config and makes what touches nothing of the node's
   (``spawn``/``Successor``), then says ``ready`` on the pair and waits.
3. The predecessor stops serving (in-flight calls answered, then its streams end, its sockets go),
   tells systemd that the successor is the main process now (``MAINPID=``), lets go of its instance lock
   and ends its side of the pair (``Spawned.release``).
4. The successor, at that end, takes the lock, serves and registers, then says ``serving``
   (``Successor.serving``), and the predecessor exits.

kubelet allows no make-before-break (the end of any older client's stream disconnects the newer one), so
the old stream must end before the new Register; what the handover saves is everything else a start
costs, above all the imports, which a busy node pays for in seconds. A successor that ends, or is not
ready within ``READY_TIMEOUT``, is stopped and leaves the predecessor serving, and the reload that asked
for it fails, saying why. Nothing here blocks the loop: the pair is read with ``add_reader``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence

from ate_devplugd.base.logs import EventLog
from ate_devplugd.signals.notify import Notifier

log = logging.getLogger(__name__)

#: The successor's environment: ``<predecessor pid>:<fd of its end of the pair>``.
ENV = "ATE_DEVPLUGD_HANDOVER"
READY = b"ready\n"
SERVING = b"serving\n"
#: What a successor that cannot take over says first, then why.
REFUSED = b"refused: "
#: How long a successor may take to be ready (its imports and config on a loaded node: seconds).
READY_TIMEOUT = 60.0
#: How long a successor may take, once released, to hold the lock and serve.
SERVING_TIMEOUT = 30.0
#: How long a successor that refused (or ended its side) has to exit before it is killed.
EXIT_GRACE = 5.0


class HandoverFailed(Exception):
    """The successor could not take over; the predecessor serves on."""


async def _line(sock: socket.socket, timeout: float) -> bytes:
    """The next line the pair gives (b"" at its end), read on the loop."""
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(sock.fileno(), readable.set)
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while not data.endswith(b"\n"):
                readable.clear()
                try:
                    chunk = sock.recv(64)
                except BlockingIOError:
                    await readable.wait()
                    continue
                if not chunk:
                    return b""
                data += chunk
    finally:
        loop.remove_reader(sock.fileno())
    return data


class Spawned:
    """The predecessor's side: its successor's process and the pair to it."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc = proc
        self._sock = sock

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the successor says it is ready; HandoverFailed (the successor stopped) when it ends first
        or is not ready in time."""
        try:
            said = await _line(self._sock, timeout)
        except TimeoutError:
            await self.abort()
            raise HandoverFailed(f"the new process (pid {self.pid}) was not ready within {timeout:g} s") from None
        if said != READY:  # it refused, or ended: it is on its way out
            status = await self.abort(grace=EXIT_GRACE)
            why = said.removeprefix(REFUSED).decode(errors="replace").strip() if said.startswith(REFUSED) else ""
            raise HandoverFailed(
                f"the new process (pid {self.pid}) exited {status} before it was ready" + (f": {why}" if why else "")
            )

    def release(self) -> None:
        """The node is the successor's: it may take the lock (it reads the end of our side)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    async def serving(self, timeout: float = SERVING_TIMEOUT) -> bool:
        """Until the successor serves (True) or ends (False)."""
        try:
            return await _line(self._sock, timeout) == SERVING
        except TimeoutError:
            return False
        finally:
            self._sock.close()

    async def abort(self, grace: float = 0.0) -> int | None:
        """Stop the successor that did not take over (killed unless it exits within ``grace`` seconds);
        its exit status."""
        self._sock.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                return await self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        return await self.proc.wait()


async def spawn(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> Spawned:
    """Start the successor: ``argv`` (the daemon's own command line) with one end of a new pair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    try:
        env = {**environ, ENV: f"{os.getpid()}:{theirs.fileno()}"}
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Spawned(proc, ours)


class Successor:
    """The successor's side: who it takes over from, and the pair to it."""

    def __init__(self, predecessor: int, sock: socket.socket) -> None:
        self.predecessor = predecessor
        self._sock = sock

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str] = os.environ) -> Successor | None:
        """The handover this process was started for (None: an ordinary start). The predecessor's
        watchdog becomes ours: systemd follows this process once it is the main one."""
        value = environ.pop(ENV, "")
        pid, _, fd = value.partition(":")
        if not (pid.isdigit() and fd.isdigit()):
            return None
        if environ.get("WATCHDOG_PID") == pid:
            environ["WATCHDOG_PID"] = str(os.getpid())
        sock = socket.socket(fileno=int(fd))
        sock.setblocking(False)
        return cls(int(pid), sock)

    async def take_over(self, timeout: float = SERVING_TIMEOUT + READY_TIMEOUT) -> None:
        """Say we are ready, then wait until the predecessor has let go of the node (or ended)."""
        self._sock.send(READY)
        with contextlib.suppress(TimeoutError):
            while await _line(self._sock, timeout):
                pass

    def refuse(self, line: str) -> None:
        """We cannot take over (our config does not load): the predecessor serves on, and says why."""
        with contextlib.suppress(OSError):
            self._sock.send(REFUSED + line.replace("\n", " ").encode()[:4000] + b"\n")
        self._sock.close()

    def serving(self) -> None:
        """We hold the lock and serve: the predecessor may exit."""
        with contextlib.suppress(OSError):
            self._sock.send(SERVING)
        self._sock.close()


class Handover:
    """A daemon's handovers: the command line it starts a successor with (None: it cannot), the handover
    it was itself started for (``successor``: its side of it), and the successor it is handing over to
    (``handing_to``: its pid, 0 while none). ``on_change`` hears each change of these (the record)."""

    def __init__(self, argv: Sequence[str] | None, successor: Successor | None, on_change: Callable[[], None]) -> None:
        self.argv = argv
        self.successor = successor
        self.handing_to = 0
        self._on_change = on_change

    @property
    def predecessor(self) -> int:
        """The daemon this one took over from (0: none)."""
        return self.successor.predecessor if self.successor is not None else 0

    async def to_successor(
        self, stop_serving: Callable[[], Awaitable[None]], notifier: Notifier, release: Callable[[], None]
    ) -> str | None:
        """Hand over (``hand_over``); None when the successor has the node, else why it could not."""
        if self.argv is None:
            return "handover failed: this daemon was not started from a command line to run again"
        try:
            await hand_over(self.argv, stop_serving, notifier, release, self._spawned)
        except (HandoverFailed, OSError) as exc:
            self.handing_to = 0
            self._on_change()
            return f"handover failed: {exc}"
        return None

    def _spawned(self, pid: int) -> None:
        self.handing_to = pid
        EventLog(log).info("handover", "handing over to pid %d (%s), which is starting", pid, " ".join(self.argv or ()))
        self._on_change()


async def hand_over(
    argv: Sequence[str],
    stop_serving: Callable[[], Awaitable[None]],
    notifier: Notifier,
    release: Callable[[], None],
    on_spawned: Callable[[int], None],
) -> None:
    """The predecessor's part, whole: the successor started (``on_spawned`` hears its pid) and ready,
    then ``stop_serving``, MAINPID= to systemd, ``release`` (the instance lock), the pair's end, and the
    successor serving. HandoverFailed, with nothing stopped, when the successor is not ready."""
    spawned = await spawn(argv)
    on_spawned(spawned.pid)
    await spawned.ready()
    await stop_serving()
    notifier.main_pid(spawned.pid)
    await notifier.sent(1.0)
    release()
    spawned.release()
    await spawned.serving()
