"""The daemon's lifecycle: start-up, the main loop, reload and shutdown, on one asyncio loop.

Start-up is a list of named steps (``daemon.steps``: each logged at debug with its time, each owing the
shutdown step that undoes it): the instance lock, where the daemon's record of itself is announced from
then on (``reload.record``); the devices and the mode; the config applied from nothing; READY. A reload
applies a re-read config over the running one. Both are a plan (every step that can fail), then a commit
(watch, then the state read: the container runtime's verdict on our CDI names first, bounded, so that
the first answers already carry it: ``cri.check``; ``_prepare``), then serving (each socket proves it
answers before it registers) with the config swapped last (``_serve``; ``daemon.apply``). A successor
(``daemon.handover``) reads the node before its predecessor lets go of it, and serves once it has. READY=1
goes out once every present device has been served, kubelet there or not; STATUS, the metrics file and
the record follow every change from then on (``daemon.outputs``). The main loop sleeps until a signal's
flag is set; the only timers are the watchdog ping, back-offs and coalescing delays (the metrics file, the
heap's trim, the runtime socket's directory and CDI's, a device offered again: ``cri.usable``). A reload
is applied whole or not at all (``reload.decision``); ``reload.report`` says how each went.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

from ate_devplugd import __version__
from ate_devplugd import config as configmod
from ate_devplugd.base.grpc_compat import grpc_runtime
from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.unixserver import SocketInUseError
from ate_devplugd.config import Config, ConfigDiff
from ate_devplugd.daemon import apply, handover
from ate_devplugd.daemon.apply import start_failure
from ate_devplugd.daemon.modes import Modes
from ate_devplugd.daemon.outputs import Outputs
from ate_devplugd.daemon.requests import Request, Requests
from ate_devplugd.daemon.runtime import RuntimeLink
from ate_devplugd.daemon.steps import Steps
from ate_devplugd.kubelet.lock import InstanceLock, NoPermissionError
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.node.devices import Resource
from ate_devplugd.node.kernel import KernelView
from ate_devplugd.node.watch import DeviceWatch, MonitorFactory
from ate_devplugd.reload import record
from ate_devplugd.reload.decision import ReloadRefused, accept, sockets_in_use
from ate_devplugd.reload.report import ReloadReport
from ate_devplugd.signals.metrics import Metrics
from ate_devplugd.signals.notify import Notifier

log = logging.getLogger(__name__)


class Daemon:
    """Everything the running daemon owns; built once by the CLI (or a test) and given its dependencies.
    ``source`` is the config file it was started from ("" for the built-in defaults) and ``overrides`` what
    its command line set over it, for its record; ``argv`` its own command line, which a handover starts
    the successor with (None: it hands over to none); ``successor`` the handover it was started for."""

    def __init__(
        self,
        config: Config,
        *,
        source: str = "",
        overrides: Mapping[str, str] | None = None,
        reload_config: Callable[[], Config] | None = None,
        kernel: KernelView | None = None,
        monitor_factory: MonitorFactory | None = None,
        notifier: Notifier | None = None,
        argv: Sequence[str] | None = None,
        successor: handover.Successor | None = None,
    ) -> None:
        self.config = config
        self._source = (source, dict(overrides or {}))
        self._reload_config = reload_config
        #: The node's seams (a test's fake kernel and udev monitor), for the devices made at start.
        self._seams = (kernel, monitor_factory)
        self._started = time.time()
        self._events = EventLog(log)
        self._lock = InstanceLock.of(config)
        self._out = Outputs(config, notifier or Notifier.from_env(), self._lock.changed)
        self._watch = KubeletWatch(config.plugin_dir, self._kubelet_started)
        self._runtime = RuntimeLink(
            lambda: (self._devices, self.config), self._looked, self._out.metrics.set_runtime_cdi, self._update_status
        )
        self._reloads = ReloadReport(self._out.metrics, self._lock.changed)
        self._devices: DeviceWatch | None = None
        #: Device-plugin mode's sessions or DRA mode's driver, each with the other's part a move needs.
        self._mode: Modes | None = None
        self._steps = Steps()
        self._requests = Requests()
        self._handover = handover.Handover(argv, successor, self._lock.changed)

    @property
    def metrics(self) -> Metrics:
        return self._out.metrics

    # -- what signals ask (``daemon.requests``) ----------------------------------------------------
    def request_stop(self) -> None:
        self._requests.ask(Request.STOP)

    def request_reload(self) -> None:
        self._requests.ask(Request.RELOAD)

    def request_handover(self) -> None:
        self._requests.ask(Request.HANDOVER)

    # -- the run ---------------------------------------------------------------------------------
    async def run(self) -> int:
        with self._requests.from_signals():
            async with grpc_runtime():
                return await self._run()

    async def _run(self) -> int:
        try:
            status = await self._start()
            if status != os.EX_OK:
                return status
            if await self._main_loop():
                self._events.info("handed-over", "handed over to pid %d; stopping", self._handover.handing_to)
            else:
                self._out.notifier.stopping()
                self._events.info("stopping", "stopping")
            return os.EX_OK
        finally:
            await self._steps.stop()

    async def _start(self) -> int:
        """Start, step by step; else the exit status by its cause (sysexits): 73 another process serves our
        sockets, 77 we may not, 71 any other error."""
        steps, successor = self._steps, self._handover.successor
        steps.on_stop("outputs", self._out.close)
        try:
            if successor is not None:  # the node read, but not taken, until the predecessor lets go of it
                plan = await self._read_node(steps)
                await steps.run("handover", successor.take_over)
            if not await steps.run("lock", lambda: self._lock.acquire(self._record)):
                held = f"another ate-devplugd is already running for {self._lock.directory}"
                self._events.error("already-running", "%s; not starting", held)
                return os.EX_CANTCREAT
            steps.on_stop("lock", self._lock.release)
            busy = await steps.run("sockets", lambda: sockets_in_use(self.config, self.config.devices))
            for msg in busy:
                self._events.error("already-running", "%s; is another ate-devplugd running? Not starting", msg)
            if busy:
                return os.EX_CANTCREAT
            if successor is None:
                plan = await self._read_node(steps)
            await steps.run("serve", lambda: self._serve(plan))
        except NoPermissionError as exc:
            self._events.error("no-permission", "%s; not starting", exc)
            return os.EX_NOPERM
        except (SocketInUseError, OSError) as exc:  # DRA mode's sockets (sessions retry on their own)
            status, line = start_failure(exc)
            self._events.error("no-permission" if status == os.EX_NOPERM else "serve-failed", "%s; not starting", line)
            return status
        steps.on_stop("runtime", self._runtime.close)
        await steps.run("watchdog", self._out.start_watchdog)
        if successor is not None:
            successor.serving()
        return os.EX_OK

    async def _read_node(self, steps: Steps) -> apply.Plan:
        """The devices and the mode made, the node watched and read (``_prepare``): nothing served yet."""
        await steps.run("devices", self._make_devices)
        await steps.run("modes", self._make_modes)
        steps.on_stop("kubelet watch", self._watch.close)
        return await steps.run("read", lambda: self._prepare(None, self.config))

    def _make_devices(self) -> None:
        kernel, monitor_factory = self._seams
        metrics = self._out.metrics
        self._devices = DeviceWatch(self.config, self._looked, kernel, monitor_factory, metrics.cdi_spec_rewrite)
        self._steps.on_stop("devices", self._devices.close)

    def _make_modes(self) -> None:
        assert self._devices is not None
        # The mode before the first look: it reports what each look means to kubelet (its gauges).
        registry = self._devices.registry
        self._mode = Modes(self.config, registry, self._watch, self._out.metrics, self._update_status)
        self._steps.on_stop("modes", self._mode.stop)

    # -- applying a config: at start and on reload -------------------------------------------------
    async def _prepare(self, old: Config | None, new: Config) -> apply.Plan:
        """``new`` instead of ``old`` (None at start: from nothing), as ``daemon.apply`` plans and commits
        it, up to serving: watched, removed resources stopped, the state read. A reload gets here only once
        ``reload.decision.accept`` took the new config."""
        assert self._mode is not None and self._devices is not None
        step = apply.plan(old, new, self._watch, self._devices)
        await apply.commit(step, self._mode, self._devices, self._out.metrics, self._runtime.ask(new))
        return step

    async def _serve(self, step: apply.Plan) -> None:
        """The added resources served (each registers once its socket answers); then the config is swapped,
        and what follows it: READY=1 at start, the metrics file, the runtime asked again, the record."""
        assert self._mode is not None
        await self._mode.start(step.change.added)
        self.config = step.new
        self._running(step.old is None, step.change)

    def _running(self, first: bool, change: ConfigDiff) -> None:
        """After the swap: say so, then what follows the config it runs."""
        if first:
            self._out.say_ready(self.status_line())
            self._events.info("ready", "ready: %s", self.status_line())
        self._out.follow(self.config)
        if not first:
            self._reloads.applied(change)

    def _looked(self, resource: Resource, event: str | None) -> None:
        """After each look at a device (its CDI spec written) and each change of its withholding: whether
        it is usable (``cri.usable``), the mode (and the metrics it reports), and STATUS when it changed."""
        self._runtime.decide()
        if self._mode is not None:
            self._mode.looked(resource)
        if event is not None:
            self._update_status()

    def _kubelet_started(self) -> None:
        self._out.metrics.kubelet_restart()
        self._runtime.ask()

    async def _main_loop(self) -> bool:
        """Until a stop is asked for, or a handover is done (True)."""
        requests = self._requests
        while not requests.stopping:
            await requests.next()
            if requests.take(Request.RELOAD):
                self._out.notifier.reloading()
                await self.reload()
                self._out.notifier.ready(self.status_line())
            if requests.take(Request.HANDOVER) and await self._hand_over():
                return True
        return False

    async def _hand_over(self) -> bool:
        """Hand the node over to a successor (``daemon.handover``), numbered and told as a reload is; False
        (this daemon serving on) when the successor could not take over."""
        self._reloads.begin()
        failure = await self._handover.to_successor(self._stop_serving, self._out.notifier, self._lock.let_go)
        if failure is not None:
            self._reloads.handover_failed(failure)
        return failure is None

    async def _stop_serving(self) -> None:
        """The node's part of the shutdown, before the successor takes it; the metrics file stays theirs."""
        assert self._mode is not None
        self._out.keep_file = True
        await self._mode.stop()

    # -- what it says of itself ------------------------------------------------------------------
    def status_line(self) -> str:
        """STATUS=: one part per resource in device-plugin mode, the driver's state in DRA mode; then what
        the runtime does with CDI names, once it has answered."""
        parts = [self._mode.status_line() if self._mode is not None else "starting"]
        parts += self._runtime.status_parts()
        return " | ".join(parts if self._reloads.note is None else [*parts, self._reloads.note])

    def _update_status(self) -> None:
        self._out.status(self.status_line())

    def _record(self) -> bytes:
        """The record announced on the instance lock (rendered only when someone is there to hear it)."""
        served = tuple(record.Serving(*row) for row in self._out.metrics.served())
        instance = record.Instance(
            pid=os.getpid(),
            version=__version__,
            mode=self.config.mode,
            started=self._started,
            source=self._source[0],
            overrides=self._source[1],
            config=configmod.values(self.config),
            ready=self._out.ready,
            status=self.status_line(),
            serving=served,
            reload=self._reloads.last,
            predecessor=self._handover.predecessor,
            successor=self._handover.handing_to,
        )
        return record.encode(instance)

    # -- reload ----------------------------------------------------------------------------------
    async def reload(self) -> bool:
        """Re-read the config and apply it (``_prepare``, ``_serve``): added resources served, removed ones stopped,
        changed ones kept serving. False when it was refused (``reload.decision``: nothing of it is
        applied) or failed; ``reload.report`` says so, in STATUS until the next good reload."""
        self._reloads.begin()
        try:
            new = accept(self.config, self._reload_config or (lambda: self.config))
            await self._serve(await self._prepare(self.config, new))
        except ReloadRefused as refusal:
            self._reloads.refused(refusal)
            return False
        except Exception as exc:  # noqa: BLE001 - a failed reload must not take the running daemon down
            self._reloads.failed(exc)
            return False
        return True
