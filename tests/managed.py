"""The daemon as a service under the fake service manager (``tests/fakes/servicemanager.py``: systemd's rules
for a ``Type=notify`` unit with ``NotifyAccess=main``), and pods arriving through the fake kubelet's
admission: what a handover and a restart are measured with, in the tests and in ``make bench``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.fakes.kubelet import FakeKubelet
from tests.support import RESOURCE, subprocess_env

MANAGER = Path(__file__).resolve().parent / "fakes" / "servicemanager.py"


class Service:
    """The daemon as a service: the fake service manager's events, and its main process."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.history: list[dict[str, Any]] = []
        self.main = 0
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            if event["event"] == "main":
                self.main = event["pid"]
            self.history.append(event)
            self.events.put_nowait(event)

    async def next(self, kind: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                event = await self.events.get()
                if event["event"] == kind and all(event.get(k) == v for k, v in match.items()):
                    return event

    async def ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next READY=1 the manager took (from the main process)."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.next("notify")
                if event["fields"].get("READY") == "1":
                    return event


@contextlib.asynccontextmanager
async def service(
    config: Path, base: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> AsyncIterator[Service]:
    """The daemon run on ``config`` by the fake service manager (its notify socket in ``base``; ``args``
    after run's own, its output to ``log`` if given)."""
    command = [sys.executable, "-m", "ate_devplugd", "run", "--config", str(config), "--log-target", "console", *args]
    output = open(log, "ab") if log is not None else None  # noqa: SIM115 - handed to the child
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(MANAGER),
        "--notify",
        str(base / "notify"),
        "--",
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=output,
        env=env or subprocess_env(),
    )
    if output is not None:
        output.close()
    managed = Service(proc)
    try:
        yield managed
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(20):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        managed._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await managed._reader


class Arrivals:
    """Pods asking one unit each, ``rate`` a second, through kubelet's admission: each one's outcome."""

    def __init__(self, kubelet: FakeKubelet, rate: float, resource: str = RESOURCE) -> None:
        self._kubelet = kubelet
        self._resource = resource
        self._rate = rate
        self.outcomes: list[str] = []
        self._pending: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._arrive())

    async def _admit(self) -> None:
        self.outcomes.append(await self._kubelet.admit(self._resource))

    async def _arrive(self) -> None:
        while True:
            task = asyncio.get_running_loop().create_task(self._admit())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            await asyncio.sleep(1 / self._rate)  # the next pod's arrival: load, not a wait for an event

    async def stop(self) -> list[str]:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._pending:
            await asyncio.wait(self._pending, timeout=20)
        return [outcome for outcome in self.outcomes if outcome]
