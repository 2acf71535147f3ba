"""The daemon: one asyncio loop that keeps every configured device served and registered.

Order at start: take the instance lock; watch the plugin directory (inotify) and the udev netlink
socket; only then probe the devices; then serve each present device and prove its socket answers; then
register. READY=1 goes out once every present device has been served, whether or not kubelet is there.

One ``Session`` per resource keeps it served and registered. Events from inotify and udev are hints:
each session re-reads the state it depends on (is our socket still ours? has a kubelet.sock been
created since we registered?) and the devices are re-probed, so lost or reordered events cannot leave
a wrong state. The only timer is the watchdog ping (and back-off after a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import posixpath
import signal
import socket
import struct
from collections.abc import Callable

import grpc

from ate_devplugd import devices, plugin
from ate_devplugd.config import Config, ConfigError, DeviceConfig
from ate_devplugd.devices import KernelView, Resource
from ate_devplugd.inotify import DirEvent, DirWatcher
from ate_devplugd.systemd import Notifier, event, watchdog_interval
from ate_devplugd.udev import MonitorLike, UdevWatcher, UEvent

log = logging.getLogger("ate_devplugd")

EX_OK = 0
EX_CANTCREAT = 73

#: How long start-up waits for every present device's first serve before READY=1 regardless.
READY_TIMEOUT = 20.0
#: Grace for in-flight RPCs (an Allocate) when a server stops.
STOP_GRACE = 0.2


class Backoff:
    """Retry delays: milliseconds at first, doubling while failures continue, capped."""

    def __init__(self, first: float = 0.005, cap: float = 30.0) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._cap, self._next * 2)
        return delay


class _Restart(Exception):
    """Serve anew and register again."""


class Session:
    """Keeps one resource served and registered with kubelet, through kubelet restarts."""

    def __init__(self, resource: Resource, daemon: Daemon) -> None:
        self.resource = resource
        self._daemon = daemon
        self.state = "absent"
        self.first_attempt = asyncio.Event()
        self.server: plugin.PluginServer | None = None
        self._kick = asyncio.Event()
        self._registered_gen = -1
        self._failures = 0

    @property
    def name(self) -> str:
        return self.resource.name

    @property
    def socket_path(self) -> str:
        return posixpath.join(self._daemon.config.plugin_dir, self.resource.config.socket_name)

    def kick(self) -> None:
        self._kick.set()

    def describe(self) -> str:
        if not self.resource.seen.is_set():
            return f"absent ({self.resource.presence.reason})"
        count = self.resource.config.count
        healthy = count if self.resource.healthy else 0
        text = f"{healthy}/{count} healthy"
        if not self.resource.healthy:
            text += f" ({self.resource.presence.reason})"
        return f"{text}, {self.state}"

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._daemon.update_status()

    async def _wait_kick(self, timeout: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._kick.wait(), timeout)
        self._kick.clear()

    async def run(self) -> None:
        backoff = Backoff(first=0.05)
        try:
            while True:
                if not self.resource.seen.is_set():
                    self._set_state("absent")
                    self.first_attempt.set()
                    await self.resource.seen.wait()
                if not os.path.isdir(self._daemon.config.plugin_dir):
                    self._set_state(f"waiting for {self._daemon.config.plugin_dir}")
                    self.first_attempt.set()
                    await self._wait_kick()
                    continue
                delay = 0.0
                served_gen = self._daemon.kubelet_gen
                try:
                    await self._serve()
                    await self._register()
                    backoff.reset()
                    await self._hold()
                except _Restart:
                    pass
                except plugin.SocketGoneError:
                    self._log_socket_gone(served_gen)
                except plugin.SocketInUseError as exc:
                    event(log, logging.ERROR, "socket-in-use", "%s", exc, resource=self.name)
                    self._set_state(f"socket in use: {exc}")
                    delay = backoff.next()
                except OSError as exc:
                    event(
                        log,
                        logging.ERROR,
                        "serve-failed",
                        "cannot serve %s on %s: %s",
                        self.name,
                        self.socket_path,
                        exc,
                        resource=self.name,
                    )
                    self._set_state(f"cannot serve: {exc.strerror or exc}")
                    delay = backoff.next()
                except Exception:  # noqa: BLE001 - the one supervisor boundary: log, back off, start afresh
                    event(
                        log,
                        logging.ERROR,
                        "session-error",
                        "unexpected error serving %s",
                        self.name,
                        resource=self.name,
                        exc_info=True,
                    )
                    self._set_state("internal error; retrying")
                    delay = backoff.next()
                finally:
                    self.first_attempt.set()
                    await self._teardown()
                if delay:
                    await self._wait_kick(delay)
        finally:
            await self._teardown()

    async def _serve(self) -> None:
        self._set_state("starting")
        server = plugin.PluginServer(self.resource, self.socket_path, self._streams_changed)
        self.server = server
        await server.start()
        event(
            log,
            logging.DEBUG,
            "serving",
            "serving %s on %s",
            self.name,
            self.socket_path,
            resource=self.name,
            device=self.resource.config.path,
        )

    async def _teardown(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.stop(STOP_GRACE)

    async def _register(self) -> None:
        assert self.server is not None
        delay = Backoff()
        kubelet_socket = posixpath.join(self._daemon.config.plugin_dir, plugin.KUBELET_SOCKET)
        while True:
            kubelet_there = os.path.exists(kubelet_socket)
            # Drained after the stat: a kubelet.sock seen there has had its create event counted in
            # kubelet_gen, so that event cannot later look like a newer kubelet (a second Register).
            self._daemon.sync_dir_events()
            if not self.server.socket_is_ours():
                self._log_socket_gone(self._daemon.kubelet_gen)
                raise _Restart
            gen = self._daemon.kubelet_gen
            if not kubelet_there:
                self._set_state("waiting for kubelet")
                self.first_attempt.set()
                await self._wait_kick()
                continue
            self._set_state("registering")
            self.first_attempt.set()
            try:
                await plugin.register(
                    kubelet_socket, self.resource.config.socket_name, self.name, plugin.REGISTER_TIMEOUT
                )
            except grpc.aio.AioRpcError as exc:
                self._failures += 1
                level = logging.WARNING if self._failures in (1, 10) or self._failures % 100 == 0 else logging.DEBUG
                event(
                    log,
                    level,
                    "register-failed",
                    "registering %s with kubelet failed (attempt %d): %s: %s",
                    self.name,
                    self._failures,
                    exc.code().name,
                    exc.details(),
                    resource=self.name,
                )
                self._set_state(f"register failed: {exc.details()}")
                if self._daemon.kubelet_gen != gen:
                    delay.reset()
                    continue
                await self._wait_kick(delay.next())
                if self._daemon.kubelet_gen != gen:
                    delay.reset()
                continue
            self._registered_gen = gen
            event(
                log,
                logging.INFO,
                "registered",
                "registered %s with kubelet (endpoint %s, %d units)",
                self.name,
                self.resource.config.socket_name,
                self.resource.config.count,
                resource=self.name,
                device=self.resource.config.path,
            )
            self._failures = 0
            self._set_state("registered")
            return

    def _streams_changed(self, streams: int) -> None:
        """Keep STATUS true: a registration kubelet no longer watches is not working."""
        if self.state.startswith("registered"):
            if streams:
                self._set_state("registered")
            else:
                # kubelet ends the stream when it stops; it never reopens it by itself, so until it
                # restarts (and we register anew) it sees every unit as unhealthy.
                event(
                    log,
                    logging.INFO,
                    "stream-ended",
                    "kubelet closed ListAndWatch for %s",
                    self.name,
                    resource=self.name,
                )
                self._set_state("registered, but kubelet closed its ListAndWatch stream")

    def _log_socket_gone(self, known_gen: int) -> None:
        """Our socket is gone: kubelet wiping the directory at its start, or someone else."""
        kubelet_socket = posixpath.join(self._daemon.config.plugin_dir, plugin.KUBELET_SOCKET)
        if self._daemon.kubelet_gen != known_gen or not os.path.exists(kubelet_socket):
            event(
                log,
                logging.INFO,
                "kubelet-restart",
                "kubelet restarted (it removed %s); serving %s anew",
                self.socket_path,
                self.name,
                resource=self.name,
            )
        else:
            event(
                log,
                logging.WARNING,
                "socket-removed",
                "%s was removed; serving %s anew",
                self.socket_path,
                self.name,
                resource=self.name,
            )

    async def _hold(self) -> None:
        """Wait until kubelet restarts or our socket goes; then return so the loop serves anew."""
        assert self.server is not None
        while True:
            await self._wait_kick()
            self._daemon.sync_dir_events()
            if not self.server.socket_is_ours():
                self._log_socket_gone(self._registered_gen)
                return
            if self._daemon.kubelet_gen != self._registered_gen:
                event(
                    log,
                    logging.INFO,
                    "kubelet-restart",
                    "kubelet.sock was re-created; registering %s anew",
                    self.name,
                    resource=self.name,
                )
                return


class _InstanceLock:
    """An abstract unix socket named after the plugin directory: one daemon per directory."""

    def __init__(self, plugin_dir: str) -> None:
        digest = hashlib.sha256(os.path.realpath(plugin_dir).encode()).hexdigest()[:32]
        self.name = b"\0ate-devplugd/" + digest.encode()
        self._sock: socket.socket | None = None

    def acquire(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.name)
            sock.listen(8)
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            uid = self._holder_uid()
            if uid == os.geteuid():
                return False
            # Abstract names have no permissions: any local user may bind this one first. A holder of
            # another user is not an ate-devplugd of ours; going on without the lock is safe, because
            # a live socket at our path still stops us.
            log.warning("the instance lock name is held by uid %s, not by us; going on without it", uid)
            return True
        self._sock = sock
        return True

    def _holder_uid(self) -> int | None:
        """The user of the process holding the lock name (an ate-devplugd listens on it), if it answers."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        probe.settimeout(1.0)
        try:
            probe.connect(self.name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
        finally:
            probe.close()
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Daemon:
    """Everything the running daemon owns; built once by the CLI and passed its dependencies."""

    def __init__(
        self,
        config: Config,
        *,
        reload_config: Callable[[], Config] | None = None,
        kernel: KernelView | None = None,
        monitor_factory: Callable[[], tuple[MonitorLike, str]] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self._reload_config = reload_config
        self._kernel = kernel
        self._monitor_factory = monitor_factory
        self.notifier = notifier or Notifier()
        self.resources: dict[str, Resource] = {}
        self.sessions: dict[str, Session] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.kubelet_gen = 0
        self._dirwatch: DirWatcher | None = None
        self._udev: UdevWatcher | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._reload_requested = False
        self._ready = False
        self._lock = _InstanceLock(config.plugin_dir)

    # -- signals: handlers only set flags --------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload_requested = True
        self._wake.set()

    # -- the run ---------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, handler in (
            (signal.SIGTERM, self.request_stop),
            (signal.SIGINT, self.request_stop),
            (signal.SIGHUP, self.request_reload),
        ):
            loop.add_signal_handler(sig, handler)
        try:
            async with plugin.grpc_runtime():
                return await self._run()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        plugin_dir = self.config.plugin_dir
        if not self._lock.acquire():
            log.error("another ate-devplugd is already running for %s; not starting", plugin_dir)
            return EX_CANTCREAT
        try:
            if not os.path.isdir(plugin_dir):
                try:
                    os.makedirs(plugin_dir, mode=0o750, exist_ok=True)
                    log.info("created %s", plugin_dir)
                except OSError as exc:
                    log.warning("cannot create %s (%s); waiting for it to appear", plugin_dir, exc.strerror)
            self._start_watches()
            for dev in self.config.devices:
                self.resources[dev.resource] = Resource(dev)
            self._preopen(self.config.devices)
            self.reconcile()
            busy = self._sockets_in_use(self.config.devices)
            if busy:
                for msg in busy:
                    log.error("%s; is another ate-devplugd running? Not starting", msg)
                return EX_CANTCREAT
            for dev in self.config.devices:
                self._start_session(dev.resource)
            await self._wait_first_attempts()
            self._ready = True
            self.notifier.ready(self.status_line())
            event(log, logging.INFO, "ready", "ready: %s", self.status_line())
            watchdog = self._start_watchdog()
            try:
                await self._main_loop()
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            self.notifier.stopping()
            event(log, logging.INFO, "stopping", "stopping")
            await self._stop_sessions(list(self._tasks))
            return EX_OK
        finally:
            await self._stop_sessions(list(self._tasks))
            if self._udev is not None:
                self._udev.close()
            if self._dirwatch is not None:
                self._dirwatch.close()
            self._lock.release()

    async def _main_loop(self) -> None:
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._reload_requested and not self._stop.is_set():
                self._reload_requested = False
                try:
                    await self.reload()
                except Exception:  # noqa: BLE001 - a failed reload must not take the running daemon down
                    event(
                        log,
                        logging.ERROR,
                        "reload-failed",
                        "reload failed; the daemon keeps running",
                        exc_info=True,
                    )
                    self.notifier.ready(self.status_line())

    def _start_watchdog(self) -> asyncio.Task[None] | None:
        interval = watchdog_interval()
        if interval is None or not self.notifier.enabled:
            return None

        async def ping() -> None:
            while True:
                self.notifier.watchdog()
                await asyncio.sleep(interval)

        return asyncio.get_running_loop().create_task(ping(), name="watchdog")

    # -- watches -------------------------------------------------------------------------------
    def _start_watches(self) -> None:
        self._dirwatch = DirWatcher(self.config.plugin_dir, self._on_dir_events)
        self._dirwatch.start()
        if self._kernel is None:
            kernel = devices.UdevKernelView()
            self._kernel = kernel
            if self._monitor_factory is None:
                from ate_devplugd.udev import default_monitor  # noqa: PLC0415

                context = kernel.context
                self._monitor_factory = lambda: default_monitor(context)
        if self._monitor_factory is not None:
            try:
                monitor, source = self._monitor_factory()
            except OSError as exc:
                failure: OSError | None = exc
            else:
                failure = None
            if failure is not None:
                log.error("cannot open a udev netlink monitor (%s); hotplug will not be seen", failure)
                return
            self._udev = UdevWatcher(monitor, self._subsystems(self.config.devices), self._on_uevents)
            self._udev.start()
            if source != "udev":
                log.warning("udevd is not running; following kernel uevents instead")

    @staticmethod
    def _subsystems(devs: tuple[DeviceConfig, ...]) -> set[str]:
        return {dev.subsystem for dev in devs}

    def sync_dir_events(self) -> None:
        """Read inotify events already queued, so a file seen by stat() has had its event counted."""
        if self._dirwatch is not None:
            self._dirwatch.read_pending()

    def _on_dir_events(self, events: list[DirEvent]) -> None:
        ours = {s.resource.config.socket_name for s in self.sessions.values()} | {plugin.KUBELET_SOCKET}
        relevant = False
        for ev in events:
            if ev.kind in ("overflow", "dir-back") or (ev.kind == "created" and ev.name == plugin.KUBELET_SOCKET):
                # a kubelet.sock we have not registered with (or may not have: events were lost)
                self.kubelet_gen += 1
                relevant = True
            elif ev.kind == "dir-gone" or (ev.kind in ("removed", "created") and ev.name in ours):
                # "created" too: a file renamed over our socket replaces it without a "removed" event
                relevant = True
            if ev.kind in ("dir-gone", "dir-back"):
                what = "was removed" if ev.kind == "dir-gone" else "is back"
                event(log, logging.WARNING, ev.kind, "%s %s", self.config.plugin_dir, what)
        if relevant:
            for session in self.sessions.values():
                session.kick()

    def _on_uevents(self, uevents: list[UEvent]) -> None:
        for ue in uevents:
            log.debug("uevent %s %s/%s %s", ue.action, ue.subsystem, ue.sys_name, ue.device_node or "")
        self.reconcile()

    # -- devices -------------------------------------------------------------------------------
    def _preopen(self, devs: tuple[DeviceConfig, ...]) -> None:
        for dev in devs:
            if dev.preopen:
                failure = devices.preopen(dev, self.config.dev_root)
                if failure:
                    event(
                        log,
                        logging.WARNING,
                        "preopen-failed",
                        "%s",
                        failure,
                        resource=dev.resource,
                        device=dev.path,
                    )

    def reconcile(self) -> None:
        """Re-probe every device; log and publish what changed."""
        assert self._kernel is not None
        changed = False
        for resource in self.resources.values():
            presence = devices.probe(resource.config, self.config.dev_root, self._kernel)
            name = resource.update(presence)
            if name is None:
                continue
            changed = True
            level = logging.INFO if presence.healthy or name == "device-absent" else logging.WARNING
            event(
                log,
                level,
                name,
                "%s %s: %s",
                resource.name,
                resource.config.path,
                presence.reason,
                resource=resource.name,
                device=resource.config.path,
            )
            if presence.note and presence.healthy:
                event(
                    log,
                    logging.WARNING,
                    "device-note",
                    "%s: %s",
                    resource.name,
                    presence.note,
                    resource=resource.name,
                    device=resource.config.path,
                )
        if changed:
            self.update_status()

    def _sockets_in_use(self, devs: tuple[DeviceConfig, ...]) -> list[str]:
        busy = []
        for dev in devs:
            try:
                plugin.check_socket_free(posixpath.join(self.config.plugin_dir, dev.socket_name))
            except plugin.SocketInUseError as exc:
                busy.append(str(exc))
            except OSError:
                continue
        return busy

    # -- sessions ------------------------------------------------------------------------------
    def _start_session(self, name: str) -> None:
        session = Session(self.resources[name], self)
        self.sessions[name] = session
        self._tasks[name] = asyncio.get_running_loop().create_task(session.run(), name=f"session {name}")

    async def _stop_sessions(self, names: list[str]) -> None:
        tasks = [self._tasks.pop(name) for name in names if name in self._tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for name in names:
            self.sessions.pop(name, None)

    async def _wait_first_attempts(self) -> None:
        waits = [s.first_attempt.wait() for s in self.sessions.values()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), READY_TIMEOUT)

    # -- status ----------------------------------------------------------------------------------
    def status_line(self) -> str:
        return " | ".join(f"{name}: {s.describe()}" for name, s in self.sessions.items()) or "no devices"

    def update_status(self) -> None:
        if self._ready:
            self.notifier.status(self.status_line())

    # -- reload ----------------------------------------------------------------------------------
    async def reload(self) -> None:
        """Apply a re-read config: add, remove and re-serve only the resources that changed."""
        self.notifier.reloading()
        if self._reload_config is None:
            self.notifier.ready(self.status_line())
            return
        try:
            new = self._reload_config()
        except ConfigError as exc:
            for line in exc.errors:
                event(log, logging.ERROR, "reload-failed", "config error, keeping the running config: %s", line)
            self.notifier.ready(self.status_line())
            return
        old = self.config
        logging.getLogger().setLevel(new.log_level.upper())
        if new.plugin_dir != old.plugin_dir:
            log.warning("plugin_dir changes only on restart; keeping %s", old.plugin_dir)
            new = Config(plugin_dir=old.plugin_dir, dev_root=new.dev_root, log_level=new.log_level, devices=new.devices)
        old_devs = {d.resource: d for d in old.devices}
        new_devs = {d.resource: d for d in new.devices}
        removed = [n for n in old_devs if n not in new_devs or new_devs[n] != old_devs[n]]
        added = [n for n in new_devs if n not in old_devs or new_devs[n] != old_devs[n]]
        busy = self._sockets_in_use(tuple(new_devs[n] for n in added if n not in old_devs))
        if busy:
            for msg in busy:
                event(log, logging.ERROR, "reload-failed", "%s; keeping the running config", msg)
            self.notifier.ready(self.status_line())
            return
        self.config = new
        await self._stop_sessions(removed)
        for name in removed:
            self.resources.pop(name, None)
        if self._udev is not None:
            self._udev.set_subsystems(self._subsystems(new.devices))
        self._preopen(tuple(new_devs[n] for n in added))
        for name in added:
            self.resources[name] = Resource(new_devs[name])
        # keep the configured order for STATUS
        self.resources = {d.resource: self.resources[d.resource] for d in new.devices}
        self.reconcile()
        for name in added:
            self._start_session(name)
        self.sessions = {d.resource: self.sessions[d.resource] for d in new.devices}
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(self.sessions[n].first_attempt.wait() for n in added)), READY_TIMEOUT
            )
        event(
            log,
            logging.INFO,
            "reload",
            "reloaded: %d added/changed, %d removed/changed, %d unchanged",
            len(added),
            len(removed),
            len(set(new_devs) & set(old_devs)) - len(set(added) & set(old_devs)),
        )
        self.notifier.ready(self.status_line())
