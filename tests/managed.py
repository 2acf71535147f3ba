"""The daemon as a service under the fake service manager (``tests/fakes/servicemanager.py``: systemd's rules
for a ``Type=notify`` unit with ``NotifyAccess=main``), and pods arriving through the fake kubelet's
admission (``Arrivals``), or created in the API server and bound by the scheduler, which honours a cordon
(``Cluster``): what a handover, a guarded one and a restart are measured with, in the tests and in
``make bench``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.fakes.apiserver import FakeApiServer
from tests.fakes.dra_kubelet import FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.scheduler import NodeStatusReporter, Pod, PodKubelet, Scheduler
from tests.integration.dra_rig import DRIVER, NODE, POOL, TOKEN, write_kubeconfig
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


class Cluster:
    """The node's Kubernetes around the fake kubelet, for a guarded handover: the API server with the Node,
    kube-scheduler (it honours ``spec.unschedulable``; a pod bound 0-``bind_delay`` s after its node was
    chosen, cordon or not), kubelet's node-status updates (every 2-10 s, drawn per run, written on a
    change) and its pod side (a pod bound here is admitted, or fails for good with no healthy unit).
    ``rate`` pods a second are created; each one's outcome, and each window of the cordon."""

    def __init__(self, kubelet: FakeKubelet, base: Path, rate: float, seed: int, bind_delay: float = 0.05) -> None:
        self._rng = random.Random(seed)
        self._rate = rate
        self.api = FakeApiServer(NODE, token=TOKEN)
        self.kubeconfig = base / "kubeconfig"
        dra = FakeDraKubelet(base)  # never started: every pod here takes the device-plugin path
        self.pods_side = PodKubelet(
            self.api, kubelet, dra, RESOURCE, driver=DRIVER, pool=POOL, sync=1.0, endpoint_grace=300.0
        )
        self.scheduler = Scheduler(self.api, self.pods_side, RESOURCE, DRIVER, rng=self._rng, bind_delay=bind_delay)
        self.pods_side.scheduler = self.scheduler
        period = self._rng.uniform(2.0, 10.0)
        self.reporter = NodeStatusReporter(self.api, kubelet, RESOURCE, period, phase=self._rng.uniform(0, period))
        self.pods: list[Pod] = []
        #: Each window the Node was cordoned, in seconds.
        self.cordons: list[float] = []
        self._cordoned_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.api.listeners.append(self._node_changed)

    def dra_table(self, kubelet_dir: Path) -> str:
        """The config's ``[dra]`` table: this Node, and credentials for this API server."""
        return f'[dra]\nnode_name = "{NODE}"\nkubeconfig = "{self.kubeconfig}"\nkubelet_dir = "{kubelet_dir}"\n'

    async def start(self) -> None:
        await self.api.start()
        write_kubeconfig(self.kubeconfig, self.api.url)
        self.reporter.report(force=True)
        self.reporter.start()
        self.scheduler.start()

    def cordoned(self) -> bool:
        return bool((self.api.nodes[NODE].get("spec") or {}).get("unschedulable"))

    def _node_changed(self, resource: str) -> None:
        if resource != "nodes":
            return
        if self.cordoned() and self._cordoned_at is None:
            self._cordoned_at = time.monotonic()
        elif not self.cordoned() and self._cordoned_at is not None:
            self.cordons.append(time.monotonic() - self._cordoned_at)
            self._cordoned_at = None

    def arrive(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._arrive())

    async def _arrive(self) -> None:
        while True:
            pod = Pod(f"vm-{len(self.pods)}")
            self.pods.append(pod)
            self.scheduler.submit(pod)
            await asyncio.sleep(1 / self._rate)  # the next pod's arrival: load, not a wait for an event

    async def stop_arriving(self, timeout: float = 30.0) -> list[Pod]:
        """No more pods; once every pod made has run or failed: those that failed (TimeoutError: some
        never did)."""
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        async with asyncio.timeout(timeout):
            while any(p.phase == "Pending" for p in self.pods):
                self.pods_side.changed.clear()
                await self.pods_side.changed.wait()
        return [p for p in self.pods if p.phase == "Failed"]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.scheduler.stop()
        await self.reporter.stop()
        await self.pods_side.stop()
        await self.api.stop()
