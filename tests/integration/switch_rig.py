"""A node for ``switch-mode``, its time scaled down by ``SCALE``: the real daemon in process, started,
restarted and crashed as systemd would (``FakeSystemd``), the real command, and around them the fakes of what a
node meets when it changes mode (docs/switching.md):

- kubelet's device manager (``FakeKubelet``: units unhealthy the moment the plugin goes; each Register
  handled in 0.2-1 s, varied per run, as on a loaded node);
- its node-status update (``NodeStatusReporter``: computed every 2-10 s, varied per run, written only on a
  change or every 5 minutes, as kubelet 1.36 does with node leases; the Node carries kubelet's version);
- its DRA plugin manager (``FakeDraKubelet``: a driver's socket registered at the reconciler's next pass,
  0-1 s later, each time drawn; slices deleted 30 s after a driver goes), unless a test gives the lag;
- its pod side (``PodKubelet``: admission on unhealthy units, the 5-minute endpoint grace and the checkpoint
  trap, unprepare through a registered driver only, every failed prepare kept on the pod);
- a scheduler choosing the path from the Node as last written and the stored DeviceClasses (``Scheduler``);
- the API server with the DeviceClasses and the read-only role of ``dra-manifests --kubelet-credentials``,
  its DRAExtendedResource gate as a test sets it;
- kubelet's process as ``/proc`` shows it (``proc/``): its command line and config file, whose feature gates
  ``switch-mode`` reads; which release and where its gates are set is drawn per run.

Each restart meets a burst of pods created the moment the old daemon stopped (as a pod 1.3 s after the
stop was seen to fail on a real node). A pod runs for its lifetime (50-150 s) from its start, as a VM pod
does: one that waits under a cordon waits for its node, and is stuck only if it never runs. The seed is
printed (``SWITCH_SEED`` sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from ate_devplugd import config as configmod
from ate_devplugd.commands import instance, manifests, switch, switch_files
from ate_devplugd.commands.switch_files import HostFiles, SwitchFailed
from ate_devplugd.config.dra import DraConfig
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.fakes.dra_kubelet import FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.scheduler import NodeStatusReporter, Pod, PodKubelet, Scheduler
from tests.integration.dra_rig import DRIVER, NODE, POOL, TOKEN, short_dir, write_kubeconfig
from tests.support import DaemonInProcess, FakeKernel, NotifyReceiver, daemon_in_process

#: One real second is this many test seconds.
SCALE = 0.02
RESOURCE = "ate.dev/kvm"
STATUS_PERIOD = (2.0, 10.0)  # kubelet's nodeStatusUpdateFrequency, varied per run (real seconds)
REPORT_EVERY = 300.0  # nodeStatusReportFrequency
ENDPOINT_GRACE = 300.0
WIPING_DELAY = 30.0
POD_SYNC = 5.0
ARRIVAL = 2.5  # mean seconds between two pods
LIFETIME = (50.0, 150.0)
BURST = 3
REGISTER = (0.2, 1.0)  # kubelet's handling of a Register (real seconds), varied per run
RECONCILE = 1.0  # kubelet's plugin reconciler: a pass a second
RESTART_SEC = (2.0, 5.0)  # the unit's RestartSec=5s (a crash restarted after it)
#: kubelet's releases and where their DRAExtendedResource gate is on: (version, flag, config file's featureGates).
KUBELETS = (
    ("v1.36.2", "", ""),
    ("v1.35.3", "--feature-gates=DRAExtendedResource=true", ""),
    ("v1.34.2", "", "featureGates:\n  DRAExtendedResource: true\n"),
)


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
            # never ran, nor failed, by the end
            "stuck": [p for p in self.pods if p.started is None and p.phase != "Failed"],
            "undeletable": [p for p in self.pods if p.deleted and not p.gone],
            # a failed prepare: kubelet tries again only at a later sync (62-74 s on a real node)
            "delayed": [p for p in self.pods if p.prepare_failures],
        }[what]

    def lost(self) -> dict[str, int]:
        return {what: self.count(what) for what in ("failed", "stuck", "undeletable", "delayed")}


class FakeSystemd:
    """``systemctl`` for the daemon in process, as systemd runs the unit (Type=notify, Restart=on-failure):
    ``start`` (nothing when it runs), ``restart`` (a stop, then a start), each job done once the daemon's
    READY=1 came; ``stop``; ``daemon-reload``; ``crash()`` ends the daemon on its own, and systemd starts it
    again after RestartSec unless a job came first. ``start_fails`` makes a start fail as a unit that
    exits at once does."""

    def __init__(self, config: Path, kernel: FakeKernel, base: Path, stopped: Callable[[], None]) -> None:
        self._config, self._kernel, self._stopped = config, kernel, stopped
        self._notify = base / "notify.sock"
        self._receiver: NotifyReceiver | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._pending: asyncio.TimerHandle | None = None
        self.daemon: DaemonInProcess | None = None
        self.calls: list[tuple[str, ...]] = []
        self.start_fails = False
        self.crashes = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        return self._stack is not None

    async def start(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self.running:
            return
        if self.start_fails:
            raise SwitchFailed("systemctl start ate-devplugd.service exited 1")
        if self._receiver is None:
            self._receiver = NotifyReceiver(self._notify)
        self._receiver.forget()
        stack = contextlib.AsyncExitStack()
        cfg = configmod.load(self._config)
        self.daemon = await stack.enter_async_context(
            daemon_in_process(cfg, self._kernel, source=self._config, notify=self._notify)
        )
        self._stack = stack
        await self._receiver.wait_for(lambda fields: fields.get("READY") == "1")  # Type=notify: the job ends here

    async def stop(self, *, burst: bool = True) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
        if burst:
            self._stopped()

    def crash(self, restart_sec: float) -> None:
        """The daemon ends on its own (a crash, a watchdog kill), from now; systemd starts it again after
        ``restart_sec`` unless a job came first."""
        self.crashes += 1
        loop = asyncio.get_running_loop()

        async def crashed() -> None:
            await self.stop()
            self._pending = loop.call_later(restart_sec, lambda: self._spawn(self.start()))

        self._spawn(crashed())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await self.stop(burst=False)
        if self._receiver is not None:
            await self._receiver.close()

    async def __call__(self, *words: str) -> None:
        self.calls.append(words)
        if words[0] == "restart":
            await self.stop()
            await self.start()
        elif words[0] == "start":
            await self.start()
        elif words[0] == "stop":
            await self.stop()


def kubelet_proc(base: Path, version: str, flag: str, file_gates: str) -> Path:
    """A ``/proc`` with kubelet's process: its command line, working directory and config file."""
    proc = base / "proc"
    entry = proc / "4242"
    entry.mkdir(parents=True)
    kubelet_config = base / "kubelet-config.yaml"
    kubelet_config.write_text(f"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n{file_gates}")
    (entry / "comm").write_text("kubelet\n")
    argv = ["/usr/bin/kubelet", f"--config={kubelet_config}", *([flag] if flag else []), "--v=2"]
    (entry / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    (entry / "cwd").symlink_to("/")
    print(f"kubelet {version} {flag or '(no --feature-gates)'} {file_gates.strip() or '(no featureGates)'}")
    return proc


@dataclasses.dataclass
class Rig:
    """The node, its fakes and the pods; ``move`` runs the command."""

    rng: random.Random
    api: FakeApiServer
    dp: FakeKubelet
    dra: FakeDraKubelet
    pods_side: PodKubelet
    scheduler: Scheduler
    reporter: NodeStatusReporter
    systemd: FakeSystemd
    files: HostFiles
    config: Path
    base: Path
    proc: Path
    pods: list[Pod] = dataclasses.field(default_factory=list)
    windows: list[float] = dataclasses.field(default_factory=list)
    output: list[str] = dataclasses.field(default_factory=list)
    arriving: bool = True
    #: What each move took (test seconds): (target, status, duration).
    moves: list[tuple[str, int, float]] = dataclasses.field(default_factory=list)
    #: Set at each line the command says.
    said: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def line(self, text: str, since: int = 0, timeout: float = 10.0) -> str:
        """The first line the command said from index ``since`` on that holds ``text``, once said."""
        async with asyncio.timeout(timeout):
            while True:
                found = [line for line in self.output[since:] if text in line]
                if found:
                    return found[0]
                self.said.clear()
                await self.said.wait()

    def new_pod(self) -> Pod:
        pod = Pod(f"vm-{len(self.pods)}", lifetime=self.rng.uniform(*map(s, LIFETIME)))
        self.pods.append(pod)
        self.scheduler.submit(pod)
        return pod

    def host(self) -> switch_files.Host:
        def say(line: str) -> None:
            self.output.append(line)
            self.said.set()
            print(line)

        return switch_files.Host(self.files, self.systemd, say=say, proc_root=str(self.proc))

    async def move(self, target: str, *, timeout: float = 30.0, **options: Any) -> int:
        """``switch-mode target``: its exit status."""
        began = time.monotonic()
        cfg = configmod.load(self.config)
        timing = switch.Timing(timeout, s(2.0))
        status = await switch.switch_mode(target, cfg, self.host(), timing, **options)
        took = time.monotonic() - began
        self.moves.append((target, status, took))
        print(f"switch-mode {target}: exit {status} in {took:.3f} s (real {took / SCALE:.1f} s at this scale)")
        return status

    async def readme_move(self, target: str) -> None:
        """README's recipe: stop, edit, start; the stop inside the Node's lag, as on a node."""
        async with self.reporter.just_reported():
            await self.systemd.stop()
        switch_files.write_mode(self.files, target)
        await self.systemd.start()

    async def until(self, done: Callable[[], bool], timeout: float) -> None:
        """Until ``done()`` after a change of the pods (their kubelet's events)."""
        async with asyncio.timeout(timeout):
            while not done():
                self.pods_side.changed.clear()
                await self.pods_side.changed.wait()

    async def no_dra_pod_left(self) -> None:
        await self.until(lambda: not any(p.path == "dra" and not p.gone for p in self.pods), s(200))

    def cordoned(self) -> bool:
        return bool((self.api.nodes[NODE].get("spec") or {}).get("unschedulable"))

    async def finish(self) -> Outcome:
        self.arriving = False
        with contextlib.suppress(TimeoutError):  # every pod bound has started or failed
            await self.until(
                lambda: (
                    not (
                        any(p.path and p.phase == "Pending" for p in self.pods if not p.deleted)
                        or self.scheduler.pending
                    )
                ),
                s(60),
            )
        for pod in self.pods:
            if not pod.deleted:
                self.pods_side.delete(pod)
        with contextlib.suppress(TimeoutError):
            await self.until(lambda: not any(p.deleted and not p.gone and p.path for p in self.pods), s(60))
        for pod in self.pods:
            if pod.deleted and not pod.path:
                pod.gone = True
        return Outcome(list(self.pods), list(self.windows))


@contextlib.asynccontextmanager
async def node(
    seed: int,
    kernel: FakeKernel,
    fake_root: Path,
    *,
    kubelet: tuple[str, str, str] | None = None,
    register_lag: Callable[[Rig], Callable[[], Any]] | None = None,
) -> AsyncIterator[Rig]:
    """The node in device-plugin mode, registered and listed, pods arriving; ``kubelet`` picks kubelet's
    release and gates (drawn from KUBELETS without), ``register_lag`` the DRA reconciler's lag."""
    rng = random.Random(seed)
    async with short_dir() as base:
        api = FakeApiServer(NODE, token=TOKEN)
        await api.start()
        dra_cfg = DraConfig(node_name=NODE)
        api.create(*(d for d in manifests_docs(dra_cfg)))
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
        version, flag, file_gates = kubelet or rng.choice(KUBELETS)
        proc = kubelet_proc(base, version, flag, file_gates)
        dp = FakeKubelet(plugin_dir, seed=seed)
        dp.register_delay = s(rng.uniform(*REGISTER))
        dra = FakeDraKubelet(kubelet_dir, on_wipe=api.wipe_driver, wiping_delay=s(WIPING_DELAY))
        pods_side = PodKubelet(
            api, dp, dra, RESOURCE, driver=DRIVER, pool=POOL, sync=s(POD_SYNC), endpoint_grace=s(ENDPOINT_GRACE)
        )
        scheduler = Scheduler(api, pods_side, RESOURCE, DRIVER, rng=rng, bind_delay=s(0.05))
        pods_side.scheduler = scheduler
        period = s(rng.uniform(*STATUS_PERIOD))
        reporter = NodeStatusReporter(
            api, dp, RESOURCE, period, phase=rng.uniform(0, period), report_every=s(REPORT_EVERY), version=version
        )
        (base / "dra-mode.conf").write_text("[Service]\n")
        files = HostFiles(str(config), str(base / "systemd" / "ate-devplugd.service.d"), str(base / "dra-mode.conf"))
        rig: Rig

        def burst() -> None:
            for _ in range(BURST):
                rig.new_pod()

        systemd = FakeSystemd(config, kernel, base, burst)
        rig = Rig(rng, api, dp, dra, pods_side, scheduler, reporter, systemd, files, config, base, proc)
        dra.register_lag = (register_lag or reconciler)(rig)
        cordoned_at: list[float] = []

        def watch_cordon(resource: str) -> None:
            if resource != "nodes":
                return
            down = rig.cordoned()
            if down and not cordoned_at:
                cordoned_at.append(time.monotonic())
            elif not down and cordoned_at:
                rig.windows.append(time.monotonic() - cordoned_at.pop())

        api.listeners.append(watch_cordon)

        async def arrivals() -> None:
            while True:
                if rig.arriving:
                    rig.new_pod()
                await asyncio.sleep(rng.expovariate(1 / s(ARRIVAL)))  # the next pod's arrival

        # the node's runtime applies CDI and reads cdi_dir: DRA mode offers a device only on its word
        cri = FakeRuntime(base / "runtime.sock", "containerd", "2.1.9", containerd_info(True, [str(base / "cdi")]))
        await cri.start()
        await dp.start()
        await dra.start()
        await systemd.start()
        reporter.start()
        scheduler.start()
        print(f"seed {seed}: node-status period {period / SCALE:.1f} s (scaled {period:.3f} s)")
        async with asyncio.timeout(10):  # the device-plugin path registered and listed before any pod
            while await instance.serving(configmod.load(config)) is None or not dp.allocatable(RESOURCE):
                await dp.next_event("list", resource=RESOURCE)
        reporter.report()
        arriving_task = asyncio.get_running_loop().create_task(arrivals())
        try:
            yield rig
        finally:
            arriving_task.cancel()
            await scheduler.stop()
            await reporter.stop()
            await pods_side.stop()
            await systemd.close()
            await dra.stop()
            await dp.stop()
            await api.stop()
            await cri.stop()


def manifests_docs(dra: DraConfig) -> list[dict[str, Any]]:
    """What an administrator applied once per cluster: the DeviceClasses and the nodes' read of them."""
    return [manifests.device_class(dra, RESOURCE), *manifests.node_read_objects(dra)]


def reconciler(rig: Rig) -> Callable[[], Any]:
    """kubelet's plugin reconciler: a socket registered at its next pass, 0 to a second later."""

    def lag() -> Any:
        return asyncio.sleep(s(rig.rng.uniform(0, RECONCILE)))

    return lag


def report(name: str, outcome: Outcome) -> None:
    print(f"--- {name}: {len(outcome.pods)} pods")
    for pod in outcome.pods:
        wait = f"{pod.wait:.3f} s (real {pod.wait / SCALE:.1f} s)" if pod.wait is not None else "-"
        first = pod.prepare_failures[0] if pod.prepare_failures else ""
        failures = f" ({len(pod.prepare_failures)} failed prepare(s), the first: {first})" if first else ""
        print(f"{pod.name:8} {pod.path or 'unscheduled':13} {pod.phase:8} wait {wait:24} {pod.reason}{failures}")
    waits = [p.wait for p in outcome.pods if p.wait is not None]
    if waits:
        print(f"longest wait {max(waits):.3f} s (real {max(waits) / SCALE:.1f} s)")
    for window in outcome.unavailable:
        print(f"node cordoned for {window:.3f} s (real {window / SCALE:.1f} s at this scale)")
    print(outcome.lost())


def seed() -> int:
    return int(os.environ.get("SWITCH_SEED") or random.randrange(1 << 32))
