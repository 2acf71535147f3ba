"""The daemon's lifecycle: start-up, the main loop, reload and shutdown, on one asyncio loop.

Start-up, in this order: take the instance lock; watch the plugin directory (inotify) and the udev
netlink socket; only then look at the devices (each look also writes the device's CDI spec when it has
one); then start the mode: device-plugin mode's sessions (``plugins.DevicePlugins``: each serves its
socket, proves it answers, then registers) or DRA mode's driver (``dra.mode.DraMode``). READY=1 goes out
once every present device has been served, whether or not kubelet is there; the metrics file follows
from then on, and so does the question to the container runtime whether it applies our CDI names
(``runtime_cdi.RuntimeCheck``: asked again on reload, when kubelet starts and when the runtime's socket
is created again; "unknown" as soon as it goes; never on a timer). The main loop sleeps until a signal's
flag is set; the only timers are the watchdog ping, the sessions' back-off and the coalescing delays of
the metrics file and of the runtime socket's events. Reload applies a config diff: added
resources are served, removed ones stopped, changed ones keep serving (their new list goes out on the
open ListAndWatch stream). A reload is applied whole or not at all: a config error, a socket another
process serves, or a changed restart-only key (``config.RESTART_ONLY``; in DRA mode also the set of
resources) refuses it before anything changes, and STATUS ends with ``reload refused HH:MM:SS: <why>``
until the next good reload. Under systemd the config it runs is kept in its runtime directory
(``running-config.toml``, rewritten at start and after each good reload) for ``probe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ate_devplugd import atomicfile
from ate_devplugd import config as configmod
from ate_devplugd.cdi import CdiSpecs
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.devices import DeviceRegistry, Resource
from ate_devplugd.grpc_compat import grpc_runtime
from ate_devplugd.kernel import KernelView, UdevKernelView
from ate_devplugd.kubelet_watch import KubeletWatch
from ate_devplugd.lock import InstanceLock, NoPermissionError, busy_sockets, make_plugin_dir, no_permission
from ate_devplugd.logs import EventLog
from ate_devplugd.metrics import Metrics
from ate_devplugd.notify import Notifier, watchdog_interval
from ate_devplugd.plugins import DevicePlugins
from ate_devplugd.runtime_cdi import RuntimeCheck, wanted
from ate_devplugd.runtime_facts import RuntimeReport
from ate_devplugd.textfile import TextfileWriter
from ate_devplugd.udev import MonitorLike, UdevWatcher, UEvent, default_monitor
from ate_devplugd.unixserver import SocketInUseError

if TYPE_CHECKING:
    from ate_devplugd.dra.mode import DraMode

log = logging.getLogger("ate_devplugd")

MonitorFactory = Callable[[], tuple[MonitorLike, str]]


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
    ) -> None:
        self.config = config
        self._reload_config = reload_config
        #: Where the config it runs is kept for `probe` (None: nowhere; the CLI gives it under systemd).
        self._running_config = running_config
        self._kernel = kernel
        self._monitor_factory = monitor_factory
        self._notifier = notifier or Notifier.from_env()
        self._events = EventLog(log)
        self._lock = InstanceLock.of(config)
        self._metrics = Metrics()
        self._metrics_file = TextfileWriter(config.metrics_file, self._metrics.render)
        self._cdi = CdiSpecs(config.cdi_dir)
        self._watch = KubeletWatch(config.plugin_dir, self._kubelet_started)
        self._runtime = RuntimeCheck(self._runtime_report)
        self._udev: UdevWatcher | None = None
        self._registry: DeviceRegistry | None = None
        #: Device-plugin mode's sessions, or DRA mode's driver: what serves the resources to kubelet.
        self._mode: DevicePlugins | DraMode | None = None
        self._stop_requested = False
        self._wake = asyncio.Event()
        self._reload_requested = False
        self._ready = False
        #: The end of STATUS after a reload that was refused or failed, until the next good one.
        self._reload_note: str | None = None

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
            log.error("another ate-devplugd is already running for %s; not starting", self._lock.directory)
            return os.EX_CANTCREAT
        watchdog: asyncio.Task[None] | None = None
        try:
            try:
                if not await self._start():
                    return os.EX_CANTCREAT
            except NoPermissionError as exc:
                self._events.error("no-permission", "%s; not starting", exc)
                return os.EX_NOPERM
            watchdog = self._start_watchdog()
            await self._main_loop()
            self._notifier.stopping()
            self._events.info("stopping", "stopping")
            return os.EX_OK
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._runtime.close()
            if self._mode is not None:
                await self._mode.stop()
            self._metrics_file.close()
            if self._udev is not None:
                self._udev.close()
            self._watch.close()
            self._lock.release()
            self._notifier.close()
            self._forget_running_config()

    async def _start(self) -> bool:
        """Watch, then read the state, then serve; False if another process serves our sockets."""
        if self.config.mode != "dra":  # DRA mode's server makes its own directories
            make_plugin_dir(self.config.plugin_dir)
        self._watch.start()
        kernel = self._start_udev()
        for dev in self.config.devices:
            self._metrics.add_resource(dev.resource)
        self._registry = DeviceRegistry(self.config.dev_root, kernel, self._looked)
        # The mode before the first look: it reports what each look means to kubelet (its gauges).
        if self.config.dra is not None and self.config.mode == "dra":
            from ate_devplugd.dra.mode import DraMode  # noqa: PLC0415 - aiohttp and PyYAML only in DRA mode

            self._mode = DraMode(self.config.dra, self._registry, self._metrics, self._update_status, self._watch)
        else:
            self._mode = DevicePlugins(self._registry, self._watch, self._metrics, self._update_status)
        self._registry.apply(self.config.devices, self.config.dev_root)
        busy = busy_sockets(self.config.plugin_dir, self.config.devices) if self.config.mode != "dra" else []
        for msg in busy:
            log.error("%s; is another ate-devplugd running? Not starting", msg)
        if busy:
            return False
        try:
            await self._mode.start([dev.resource for dev in self.config.devices])
        except PermissionError as exc:  # DRA mode makes its directories in kubelet's, as root only can
            if exc.errno != errno.EACCES or exc.filename is None:
                raise
            raise no_permission("create", str(exc.filename)) from exc
        except (SocketInUseError, OSError) as exc:  # DRA mode's sockets (sessions retry on their own)
            log.error("cannot serve: %s; is another ate-devplugd running? Not starting", exc)  # noqa: TRY400 - it says why
            return False
        self._ready = True
        self._keep_running_config()
        self._notifier.ready(self.status_line())
        self._events.info("ready", "ready: %s", self.status_line())
        # Metrics from now on: the first write comes after READY.
        self._metrics.on_change = self._metrics_file.changed
        self._metrics_file.start()
        self._ask_runtime()
        return True

    def _start_udev(self) -> KernelView:
        """Start the udev monitor (before the first look at the devices); returns the kernel view."""
        kernel, factory = self._kernel, self._monitor_factory
        if kernel is None:
            real = UdevKernelView()
            kernel, factory = real, factory or functools.partial(default_monitor, real.context)
        if factory is not None:
            subsystems = {dev.subsystem for dev in self.config.devices}
            self._udev = UdevWatcher.open(factory, subsystems, self._on_uevents)
        return kernel

    def _looked(self, resource: Resource, event: str | None) -> None:
        """After each look at a device: its CDI spec, the mode (and the metrics it reports), and STATUS
        when its health changed."""
        self._cdi.sync(resource)
        if self._mode is not None:
            self._mode.looked(resource)
        if event is not None:
            self._update_status()

    def _kubelet_started(self) -> None:
        self._metrics.kubelet_restart()
        self._ask_runtime()

    def _ask_runtime(self) -> None:
        """Ask the container runtime whether it applies our CDI names (at start, on reload, when kubelet
        starts; the check follows the runtime's own restarts by itself). It never delays anything."""
        cfg = self.config
        enabled = wanted(any(dev.cdi for dev in cfg.devices), cfg.mode)
        self._runtime.start(
            socket=cfg.runtime_socket, cdi_dir=cfg.cdi_dir, mode=cfg.mode, enabled=enabled, devices=cfg.devices
        )

    def _runtime_report(self, report: RuntimeReport | None) -> None:
        if report is None:
            self._metrics.set_runtime_cdi(None)
        else:
            self._metrics.set_runtime_cdi(report.verdict, report.runtime)
        self._update_status()

    def _on_uevents(self, uevents: list[UEvent]) -> None:
        for ue in uevents:
            log.debug("uevent %s %s/%s %s", ue.action, ue.subsystem, ue.sys_name, ue.device_node or "")
        if self._registry is not None:
            self._registry.reconcile()

    async def _main_loop(self) -> None:
        while not self._stop_requested:
            await self._wake.wait()
            self._wake.clear()
            if self._reload_requested and not self._stop_requested:
                self._reload_requested = False
                self._notifier.reloading()
                try:
                    applied = await self.reload()
                except Exception as exc:  # noqa: BLE001 - a failed reload must not take the running daemon down
                    self._events.error("reload-failed", "reload failed; the daemon keeps running", exc_info=True)
                    self._reload_note = f"reload failed {time.strftime('%H:%M:%S')}: {exc}"
                    applied = False
                if applied:
                    self._metrics.reload()
                else:
                    self._metrics.reload_failed()
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
        line = self._mode.status_line() if self._mode is not None else "starting"
        report = self._runtime.report
        if report is not None:
            line += f" | cdi: {report.describe()}"
        if specs := self._runtime.spec_status():
            line += f" | {specs}"
        return line if self._reload_note is None else f"{line} | {self._reload_note}"

    def _update_status(self) -> None:
        if self._ready:
            self._notifier.status(self.status_line())

    # -- reload ----------------------------------------------------------------------------------
    async def reload(self) -> bool:
        """Apply a re-read config: added resources served, removed ones stopped, changed ones kept serving.

        False when the new config is refused: nothing of it is applied, the running one is kept, and
        STATUS says why until the next good reload."""
        try:
            new = self._reload_config() if self._reload_config is not None else self.config
        except ConfigError as exc:
            for line in exc.errors:
                self._events.error("reload-failed", "config error, keeping the running config: %s", line)
            return self._refused(exc.errors[0])
        review = configmod.review(new)  # what check-config refuses (ExecReload fails on it too)
        for line in review.errors:
            self._events.error("reload-failed", "config error, keeping the running config: %s", line)
        if review.errors:
            return self._refused(review.errors[0])
        restart = configmod.restart_only_change(self.config, new)
        change = configmod.diff(self.config, new)
        if restart is None and self.config.mode == "dra" and (change.added or change.removed):
            names = [f"adding {name}" for name in change.added] + [f"removing {name}" for name in change.removed]
            restart = (
                f"DRA mode's set of resources changes only on restart ({', '.join(names)}), "
                "so nothing of this reload was applied"
            )
        if restart is not None:
            self._events.error("reload-failed", "%s", restart)
            return self._refused(restart)
        added = tuple(dev for dev in new.devices if dev.resource in change.added)
        busy = busy_sockets(new.plugin_dir, added) if new.mode != "dra" else []
        for msg in busy:
            self._events.error("reload-failed", "%s; keeping the running config", msg)
        if busy:
            return self._refused(busy[0])
        logging.getLogger().setLevel(new.log_level.upper())
        self.config = new
        self._reload_note = None
        assert self._mode is not None and self._registry is not None
        await self._mode.stop(change.removed)
        for name in change.removed:
            self._metrics.remove_resource(name)
        for name in change.added:
            self._metrics.add_resource(name)
        self._cdi.apply(new.cdi_dir, new.devices)
        self._registry.apply(new.devices, new.dev_root)
        self._metrics_file.enable(new.metrics_file)
        if self._udev is not None:
            self._udev.set_subsystems(self._registry.subsystems())
        await self._mode.start(change.added)
        self._ask_runtime()
        self._keep_running_config()
        self._events.info(
            "reload",
            "reloaded: %d added, %d changed, %d removed, %d unchanged",
            len(change.added),
            len(change.changed),
            len(change.removed),
            len(change.unchanged),
        )
        return True

    def _refused(self, why: str) -> bool:
        """A refused reload: STATUS ends with when and why (the first error) until the next good one."""
        self._reload_note = f"reload refused {time.strftime('%H:%M:%S')}: {why}"
        return False

    # -- the running config, for `probe` ----------------------------------------------------------
    def _keep_running_config(self) -> None:
        """Write the config being run (as TOML, in one step) where `probe` finds it when the file on disk
        does not parse."""
        if self._running_config is None:
            return
        try:
            atomicfile.replace_file(self._running_config, configmod.render(self.config).encode(), 0o644)
        except OSError as exc:
            self._events.warning(
                "running-config-failed",
                "cannot write %s (%s); probe reads only the config file",
                self._running_config,
                exc.strerror,
            )

    def _forget_running_config(self) -> None:
        """At the stop: no copy outlives the daemon (systemd removes its runtime directory too)."""
        if self._running_config is not None and self._ready:
            with contextlib.suppress(OSError):
                os.unlink(self._running_config)
