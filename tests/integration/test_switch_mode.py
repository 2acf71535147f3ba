"""A node moved device-plugin -> DRA -> device-plugin with pods arriving throughout, time scaled down by ``SCALE``:
the real daemon in process (restarted as systemd would), the real ``switch-mode`` command, and around them the
fakes of what a node meets when it changes mode (docs/switching.md): kubelet's device manager (``FakeKubelet``:
units unhealthy the moment the plugin goes), its node-status update on its own period (``NodeStatusReporter``,
2-10 s scaled, varied per seed), its DRA plugin manager (``FakeDraKubelet``: slices deleted 30 s after a driver
goes), its pod side (``PodKubelet``: admission on unhealthy units, the 5-minute endpoint grace and the
checkpoint trap, unprepare through a registered driver only), and a scheduler choosing the path from the Node as
last reported (``Scheduler``). Each restart meets a burst of pods created the moment the old daemon stopped (as
a pod 1.3 s after the stop was seen to fail on a real node).

Every pod's path and wait is printed; the move by ``switch-mode`` loses none (0 failed, 0 stuck, 0
undeletable), a plain move (stop, edit, start) does. The seed is printed (``SWITCH_SEED`` sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from ate_devplugd import config as configmod
from ate_devplugd.commands import switch, switch_files
from ate_devplugd.commands.switch_files import HostFiles
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.fakes.dra_kubelet import FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.scheduler import NodeStatusReporter, Pod, PodKubelet, Scheduler
from tests.integration.dra_rig import DRIVER, NODE, POOL, TOKEN, short_dir, write_kubeconfig
from tests.support import DaemonInProcess, FakeKernel, daemon_in_process

#: One real second is this many test seconds.
SCALE = 0.02
RESOURCE = "ate.dev/kvm"
STATUS_PERIOD = (2.0, 10.0)  # kubelet's nodeStatusUpdateFrequency, varied per run (real seconds)
ENDPOINT_GRACE = 300.0
WIPING_DELAY = 30.0
POD_SYNC = 5.0
ARRIVAL = 2.5  # mean seconds between two pods
LIFETIME = (50.0, 150.0)
BURST = 3


def s(real: float) -> float:
    return real * SCALE


@dataclasses.dataclass
class Outcome:
    pods: list[Pod]
    unavailable: list[float]  # each window of spec.unschedulable, in test seconds

    def count(self, what: str) -> int:
        return len(self.of(what))

    def of(self, what: str) -> list[Pod]:
        return {
            "failed": [p for p in self.pods if p.phase == "Failed"],
            # never ran, nor failed: in its whole life (50-150 s scaled), or by the end
            "stuck": [p for p in self.pods if p.started is None and p.phase != "Failed"],
            "undeletable": [p for p in self.pods if p.deleted and not p.gone],
        }[what]


class FakeSystemd:
    """``systemctl`` for the daemon in process: restart stops it, then starts one on the config's file."""

    def __init__(self, config: Path, kernel: FakeKernel, stopped: Callable[[], None]) -> None:
        self._config, self._kernel, self._stopped = config, kernel, stopped
        self._stack: contextlib.AsyncExitStack | None = None
        self.daemon: DaemonInProcess | None = None

    async def start(self) -> None:
        stack = contextlib.AsyncExitStack()
        cfg = configmod.load(self._config)
        self.daemon = await stack.enter_async_context(daemon_in_process(cfg, self._kernel, source=self._config))
        self._stack = stack

    async def stop(self, *, burst: bool = True) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
        if burst:
            self._stopped()

    async def __call__(self, *words: str) -> None:
        if words[0] == "restart":
            await self.stop()
            await self.start()


@contextlib.asynccontextmanager
async def node(
    seed: int, kernel: FakeKernel, fake_root: Path
) -> AsyncIterator[tuple[Callable[[str, bool], Awaitable[None]], Callable[[], Awaitable[Outcome]]]]:
    rng = random.Random(seed)
    async with short_dir() as base:
        api = FakeApiServer(NODE, token=TOKEN)
        await api.start()
        kubeconfig = write_kubeconfig(base / "kubeconfig", api.url)
        kubelet_dir = base / "kubelet"
        plugin_dir = kubelet_dir / "device-plugins"
        plugin_dir.mkdir(parents=True)
        config = base / "config.toml"
        config.write_text(
            "# the node's config: every byte but the mode line stays\n"
            'mode = "device-plugin"\n'
            f'plugin_dir = "{plugin_dir}"\ndev_root = "{fake_root}"\ncdi_dir = "{base / "cdi"}"\nmetrics_file = ""\n'
            f'runtime_socket = "{base / "runtime.sock"}"\n\n'
            f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\ncdi = true\n\n'
            f'[dra]\nnode_name = "{NODE}"\nkubeconfig = "{kubeconfig}"\nkubelet_dir = "{kubelet_dir}"\n'
            'sharing = "units"\n'
        )
        dp = FakeKubelet(plugin_dir, seed=seed)
        dra = FakeDraKubelet(kubelet_dir, on_wipe=api.wipe_driver, wiping_delay=s(WIPING_DELAY))
        pods_side = PodKubelet(
            api, dp, dra, RESOURCE, driver=DRIVER, pool=POOL, sync=s(POD_SYNC), endpoint_grace=s(ENDPOINT_GRACE)
        )
        scheduler = Scheduler(api, pods_side, RESOURCE, DRIVER, rng=rng, bind_delay=s(0.05))
        pods_side.scheduler = scheduler
        period = s(rng.uniform(*STATUS_PERIOD))
        reporter = NodeStatusReporter(api, dp, RESOURCE, period, phase=rng.uniform(0, period))
        pods: list[Pod] = []
        windows: list[float] = []
        cordoned_at: list[float] = []

        def watch_cordon(resource: str) -> None:
            if resource != "nodes":
                return
            down = bool((api.nodes[NODE].get("spec") or {}).get("unschedulable"))
            if down and not cordoned_at:
                cordoned_at.append(time.monotonic())
            elif not down and cordoned_at:
                windows.append(time.monotonic() - cordoned_at.pop())

        api.listeners.append(watch_cordon)

        def new_pod() -> None:
            pod = Pod(f"vm-{len(pods)}")
            pods.append(pod)
            scheduler.submit(pod)
            loop.call_later(rng.uniform(*map(s, LIFETIME)), pods_side.delete, pod)

        def burst() -> None:
            for _ in range(BURST):
                new_pod()

        loop = asyncio.get_running_loop()
        systemd = FakeSystemd(config, kernel, burst)
        (base / "dra-mode.conf").write_text("[Service]\n")
        files = HostFiles(str(config), str(base / "systemd" / "ate-devplugd.service.d"), str(base / "dra-mode.conf"))
        arriving = True

        async def arrivals() -> None:
            while arriving:
                new_pod()
                await asyncio.sleep(rng.expovariate(1 / s(ARRIVAL)))  # the next pod's arrival

        async def move(target: str, readme: bool) -> None:
            began = time.monotonic()
            if readme:  # README's recipe: stop, edit, start; the stop inside the Node's lag, as on a node
                async with reporter.just_reported():
                    await systemd.stop()
                switch_files.write_mode(files, target)
                await systemd.start()
            else:
                host = switch_files.Host(files, systemd, say=print)
                status = await switch.switch_mode(target, configmod.load(config), host, switch.Timing(10.0, s(2.0)))
                assert status == 0
            print(f"moved to {target} in {time.monotonic() - began:.2f} s")

        async def finish() -> Outcome:
            nonlocal arriving
            arriving = False
            await arriving_task
            with contextlib.suppress(TimeoutError):  # every pod bound has started or failed
                async with asyncio.timeout(s(60)):
                    while any(p.path and p.phase == "Pending" for p in pods if not p.deleted) or scheduler.pending:
                        pods_side.changed.clear()
                        await pods_side.changed.wait()
            for pod in pods:
                if not pod.deleted:
                    pods_side.delete(pod)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(s(60)):
                    while any(p.deleted and not p.gone and p.path for p in pods):
                        pods_side.changed.clear()
                        await pods_side.changed.wait()
            for pod in pods:
                if pod.deleted and not pod.path:
                    pod.gone = True
            return Outcome(list(pods), list(windows))

        # the node's runtime applies CDI and reads cdi_dir: DRA mode offers a device only on its word
        cri = FakeRuntime(base / "runtime.sock", "containerd", "2.1.9", containerd_info(True, [str(base / "cdi")]))
        await cri.start()
        await dp.start()
        await dra.start()
        await systemd.start()
        reporter.start()
        scheduler.start()
        print(f"seed {seed}: node-status period {period / SCALE:.1f} s (scaled {period:.3f} s)")
        registered = asyncio.Event()
        dp.on_register = registered.set
        async with asyncio.timeout(10):  # the device-plugin path registered and listed before any pod
            await registered.wait()
            await dp.next_event("list", resource=RESOURCE)
        reporter.report()
        arriving_task = loop.create_task(arrivals())
        try:
            yield move, finish
        finally:
            arriving = False
            arriving_task.cancel()
            await scheduler.stop()
            await reporter.stop()
            await pods_side.stop()
            await systemd.stop(burst=False)
            await dra.stop()
            await dp.stop()
            await api.stop()
            await cri.stop()


def report(name: str, outcome: Outcome) -> None:
    print(f"--- {name}: {len(outcome.pods)} pods")
    for pod in outcome.pods:
        wait = f"{pod.wait:.3f} s (real {pod.wait / SCALE:.1f} s)" if pod.wait is not None else "-"
        print(f"{pod.name:8} {pod.path or 'unscheduled':13} {pod.phase:8} wait {wait:24} {pod.reason}")
    waits = [p.wait for p in outcome.pods if p.wait is not None]
    if waits:
        print(f"longest wait {max(waits):.3f} s (real {max(waits) / SCALE:.1f} s)")
    for window in outcome.unavailable:
        print(f"node cordoned for {window:.3f} s (real {window / SCALE:.1f} s at this scale)")
    print({what: outcome.count(what) for what in ("failed", "stuck", "undeletable")})


async def both_ways(seed: int, kernel: FakeKernel, fake_root: Path, *, readme: bool) -> Outcome:
    async with node(seed, kernel, fake_root) as (move, finish):
        await asyncio.sleep(s(50))  # pods arrive in device-plugin mode
        await move("dra", readme)
        await asyncio.sleep(s(ENDPOINT_GRACE + 50))  # past kubelet's endpoint grace, pods still arriving
        await move("device-plugin", readme)
        await asyncio.sleep(s(WIPING_DELAY + 70))
        if not readme:  # once more: a finished move is left alone, not even cordoned
            await move("device-plugin", readme)
        return await finish()


def seed() -> int:
    return int(os.environ.get("SWITCH_SEED") or random.randrange(1 << 32))


async def test_switch_mode_loses_no_pod_both_ways(kernel: FakeKernel, fake_root: Path) -> None:
    value = seed()
    outcome = await both_ways(value, kernel, fake_root, readme=False)
    report(f"switch-mode, seed {value}", outcome)
    paths = {p.path for p in outcome.pods if p.phase == "Running"}
    assert paths == {"device-plugin", "dra"}, paths
    assert not outcome.of("failed") and not outcome.of("stuck") and not outcome.of("undeletable"), value
    assert len(outcome.unavailable) == 2


async def test_readme_recipe_loses_pods(kernel: FakeKernel, fake_root: Path) -> None:
    value = seed()
    outcome = await both_ways(value, kernel, fake_root, readme=True)
    report(f"README recipe, seed {value}", outcome)
    assert outcome.of("failed"), "a pod bound in the Node's lag fails admission (DP -> DRA)"
    assert outcome.of("stuck"), "a pod sent down the DRA path after the driver went waits for ever (DRA -> DP)"
