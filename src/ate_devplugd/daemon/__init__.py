"""The daemon's lifecycle: start-up, the main loop, reload and shutdown, on one asyncio loop.

Start-up takes the instance lock, then applies the config from nothing; a reload applies a re-read one
over the running one. Both are ``Daemon._apply``: a plan (every step that can fail), then a commit (the
runtime's verdict on our CDI names, bounded: ``cri.check``; the state read; then serve: each socket proves
it answers before it registers), the config swapped last (``daemon.apply``). READY=1 goes out once every
present device has been served, kubelet there or not; the metrics file follows from then on. The main
loop sleeps until a signal's flag is set; the only timers are the watchdog ping, back-offs and coalescing
delays (the metrics file, the heap's trim, the runtime socket's directory and CDI's, a device offered
again: ``cri.usable``). A reload is applied whole or not at all (``reload.decision``); ``reload.report``
says how each went.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from ate_devplugd.base.grpc_compat import grpc_runtime
from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.malloc import Trim
from ate_devplugd.base.unixserver import SocketInUseError
from ate_devplugd.config import Config, ConfigDiff
from ate_devplugd.daemon import apply
from ate_devplugd.daemon.apply import start_failure
from ate_devplugd.daemon.modes import Modes
from ate_devplugd.kubelet.lock import InstanceLock, NoPermissionError
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.node.devices import Resource
from ate_devplugd.node.kernel import KernelView
from ate_devplugd.node.watch import DeviceWatch, MonitorFactory
from ate_devplugd.reload.decision import ReloadRefused, accept, sockets_in_use
from ate_devplugd.reload.report import ReloadReport
from ate_devplugd.reload.rundir import RuntimeFiles
from ate_devplugd.signals.metrics import Metrics
from ate_devplugd.signals.notify import Notifier, watchdog_interval
from ate_devplugd.signals.textfile import TextfileWriter

if TYPE_CHECKING:
    from ate_devplugd.cri.check import RuntimeCheck
    from ate_devplugd.cri.facts import RuntimeReport
    from ate_devplugd.cri.usable import Usability

log = logging.getLogger(__name__)


class Daemon:
    """Everything the running daemon owns; built once by the CLI (or a test) and given its dependencies."""

    def __init__(
        self,
        config: Config,
        *,
        reload_config: Callable[[], Config] | None = None,
        kernel: KernelView | None = None,
        monitor_factory: MonitorFactory | None = None,
        notifier: Notifier | None = None,
        running_config: str | None = None,
        reload_result: str | None = None,
    ) -> None:
        self.config = config
        self._reload_config = reload_config
        #: What `probe` and `reload` read in the runtime directory (the CLI gives the paths under systemd).
        self._files = RuntimeFiles(running_config, reload_result)
        self._kernel = kernel
        self._monitor_factory = monitor_factory
        self._notifier = notifier or Notifier.from_env()
        self._events = EventLog(log)
        self._lock = InstanceLock.of(config)
        self._metrics = Metrics()
        self._trim = Trim()
        self._metrics_file = TextfileWriter(config.metrics_file, self._metrics.render, after_write=self._trim.now)
        self._watch = KubeletWatch(config.plugin_dir, self._kubelet_started)
        #: The runtime's check and what it makes usable: made once CDI is used (``_ask_runtime``).
        self._runtime: RuntimeCheck | None = None
        self._usable: Usability | None = None
        self._reloads = ReloadReport(self._metrics, self._files)
        self._devices: DeviceWatch | None = None
        #: Device-plugin mode's sessions or DRA mode's driver, each with the other's part a move needs.
        self._mode: Modes | None = None
        self._stop_requested = False
        self._wake = asyncio.Event()
        self._reload_requested = False
        self._ready = False

    # -- signals: handlers only set flags --------------------------------------------------------
    def request_stop(self) -> None:
        self._stop_requested = True
        self._wake.set()

    def request_reload(self) -> None:
        self._reload_requested = True
        self._wake.set()

    # -- the run ---------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        handlers = {
            signal.SIGTERM: self.request_stop,
            signal.SIGINT: self.request_stop,
            signal.SIGHUP: self.request_reload,
        }
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler)
        try:
            async with grpc_runtime():
                return await self._run()
        finally:
            for sig in handlers:
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        if not self._lock.acquire():
            held = self._lock.directory
            self._events.error("already-running", "another ate-devplugd is already running for %s; not starting", held)
            return os.EX_CANTCREAT
        watchdog: asyncio.Task[None] | None = None
        try:
            status = await self._start()
            if status != os.EX_OK:
                return status
            watchdog = self._start_watchdog()
            await self._main_loop()
            self._notifier.stopping()
            self._events.info("stopping", "stopping")
            return os.EX_OK
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if self._runtime is not None and self._usable is not None:
                await self._runtime.close()
                self._usable.close()
            if self._mode is not None:
                await self._mode.stop()
            self._metrics_file.close()
            self._trim.close()
            if self._devices is not None:
                self._devices.close()
            self._watch.close()
            self._lock.release()
            self._notifier.close()
            self._files.forget()

    async def _start(self) -> int:
        """Start: the config applied from nothing (``_apply``); else the exit status by its cause
        (sysexits): 73 another process serves our sockets, 77 we may not, 71 any other error."""
        busy = sockets_in_use(self.config, self.config.devices)
        for msg in busy:
            self._events.error("already-running", "%s; is another ate-devplugd running? Not starting", msg)
        if busy:
            return os.EX_CANTCREAT
        self._devices = DeviceWatch(
            self.config, self._looked, self._kernel, self._monitor_factory, self._metrics.cdi_spec_rewrite
        )
        registry = self._devices.registry
        # The mode before the first look: it reports what each look means to kubelet (its gauges).
        self._mode = Modes(self.config, registry, self._watch, self._metrics, self._update_status)
        try:
            await self._apply(None, self.config)
        except NoPermissionError as exc:
            self._events.error("no-permission", "%s; not starting", exc)
            return os.EX_NOPERM
        except (SocketInUseError, OSError) as exc:  # DRA mode's sockets (sessions retry on their own)
            status, line = start_failure(exc)
            if status == os.EX_NOPERM:
                self._events.error("no-permission", "%s; not starting", line)
            else:
                self._events.error("serve-failed", "%s; not starting", line)
            return status
        return os.EX_OK

    # -- applying a config: at start and on reload -------------------------------------------------
    async def _apply(self, old: Config | None, new: Config) -> None:
        """Run ``new`` instead of ``old`` (None at start: from nothing), as ``daemon.apply`` plans and
        commits it; then the config is swapped, with its copy for ``probe``, and what follows it: READY=1
        at start, the metrics file, the outcome for ``reload``. A reload gets here only once
        ``reload.decision.accept`` took the new config."""
        assert self._mode is not None and self._devices is not None
        step = apply.plan(old, new, self._watch, self._devices)
        await apply.commit(step, self._mode, self._devices, self._metrics, self._ask_runtime(new))
        self.config = new
        self._files.keep_config(new)
        self._running(old is None, step.change)

    def _running(self, first: bool, change: ConfigDiff) -> None:
        """After the swap: say so, then what follows the config it runs."""
        if first:
            self._ready = True
            self._notifier.ready(self.status_line())
            self._events.info("ready", "ready: %s", self.status_line())
            # Metrics from now on: the first write comes after READY.
            self._metrics.on_change = self._counted
        self._metrics_file.enable(self.config.metrics_file)
        if first:
            self._reloads.started()
        else:
            self._reloads.applied(change)

    def _counted(self, prompt: bool = False) -> None:
        """A change the metrics count (a registration, an Allocate, ...): the metrics file follows, and the
        heap is trimmed once the burst has passed: after the file's coalesced write, else on its own timer."""
        self._metrics_file.changed(prompt)
        if not self._metrics_file.enabled:
            self._trim.poke()

    def _looked(self, resource: Resource, event: str | None) -> None:
        """After each look at a device (its CDI spec written) and each change of its withholding: whether
        it is usable (``cri.usable``), the mode (and the metrics it reports), and STATUS when it changed."""
        if self._runtime is not None and self._usable is not None:
            self._usable.update(self._devices, self.config, self._runtime.report, self._runtime.spec_problems)
        if self._mode is not None:
            self._mode.looked(resource)
        if event is not None:
            self._update_status()

    def _kubelet_started(self) -> None:
        self._metrics.kubelet_restart()
        self._ask_runtime()

    def _ask_runtime(self, config: Config | None = None) -> RuntimeCheck | None:
        """Ask the container runtime whether it applies our CDI names (at start and on reload before the
        looks, when kubelet starts; the check follows the runtime's own restarts by itself)."""
        cfg = config or self.config
        if self._runtime is None:
            if not cfg.checks_runtime:
                return None
            from ate_devplugd.cri.check import RuntimeCheck  # noqa: PLC0415 - the CRI modules only once CDI is used
            from ate_devplugd.cri.usable import Usability  # noqa: PLC0415

            self._runtime = RuntimeCheck(self._runtime_report)
            self._usable = Usability(self._looked, self._metrics.set_runtime_cdi)
        self._runtime.start(
            socket=cfg.runtime_socket,
            cdi_dir=cfg.cdi_dir,
            mode=cfg.mode,
            enabled=cfg.checks_runtime,
            devices=cfg.devices,
        )
        return self._runtime

    def _runtime_report(self, report: RuntimeReport | None) -> None:
        assert self._runtime is not None and self._usable is not None
        self._usable.update(self._devices, self.config, report, self._runtime.spec_problems)
        self._update_status()

    async def _main_loop(self) -> None:
        while not self._stop_requested:
            await self._wake.wait()
            self._wake.clear()
            if self._reload_requested and not self._stop_requested:
                self._reload_requested = False
                self._notifier.reloading()
                await self.reload()
                self._notifier.ready(self.status_line())

    def _start_watchdog(self) -> asyncio.Task[None] | None:
        interval = watchdog_interval()
        if interval is None or not self._notifier.enabled:
            return None

        async def ping() -> None:
            while True:
                self._notifier.watchdog()
                await asyncio.sleep(interval)

        return asyncio.get_running_loop().create_task(ping(), name="watchdog")

    # -- status ----------------------------------------------------------------------------------
    def status_line(self) -> str:
        """STATUS=: one part per resource in device-plugin mode, the driver's state in DRA mode; then what
        the runtime does with CDI names, once it has answered."""
        parts = [self._mode.status_line() if self._mode is not None else "starting"]
        if self._runtime is not None:
            parts += self._runtime.status_parts()
        return " | ".join(parts if self._reloads.note is None else [*parts, self._reloads.note])

    def _update_status(self) -> None:
        if self._ready:
            self._notifier.status(self.status_line())

    # -- reload ----------------------------------------------------------------------------------
    async def reload(self) -> bool:
        """Re-read the config and apply it (``_apply``): added resources served, removed ones stopped,
        changed ones kept serving. False when it was refused (``reload.decision``: nothing of it is
        applied) or failed; ``reload.report`` says so, in STATUS until the next good reload."""
        self._reloads.begin()
        try:
            new = accept(self.config, self._reload_config or (lambda: self.config))
            await self._apply(self.config, new)
        except ReloadRefused as refusal:
            self._reloads.refused(refusal)
            return False
        except Exception as exc:  # noqa: BLE001 - a failed reload must not take the running daemon down
            self._reloads.failed(exc)
            return False
        return True
