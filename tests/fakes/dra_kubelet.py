"""A fake kubelet toward a DRA driver: its plugin watcher, registration handler and DRA manager calls.

It behaves as kubelet 1.36 does (``pkg/kubelet/pluginmanager`` and ``pkg/kubelet/cm/dra``; docs/dra.md):
- the plugin watcher watches ``<kubelet_dir>/plugins_registry`` (inotify, installed before the initial
  walk), ignores dot-names and anything that is not a socket, and removes the registration of a socket
  that goes away;
- registration: dial (10 s), GetInfo with kubelet's **1 s** deadline, check the type is ``DRAPlugin``,
  take the first supported version it knows (``known_versions``; kubelet 1.32 knows only
  ``v1beta1.DRAPlugin``) into the DRA manager, then NotifyRegistrationStatus (5 s) with the outcome (so
  a driver told it is registered is already one kubelet calls, as in kubelet's ``operation_generator.go``);
- prepare/unprepare through the chosen version on the returned endpoint, 45 s per call, and the
  v1alpha1 health stream (``watch_health``);
- ``restart()``: a kubelet started again registers every plugin socket anew;
- with ``device_plugin_dir``, kubelet's device manager as a DRA driver sees it: at start it removes the
  files of that directory (not its checkpoint) and listens on ``kubelet.sock`` there, in a process of its
  own (kubelet's); ``stop()`` ends that process (SIGTERM, as ``systemctl stop kubelet``), which leaves the
  socket behind, as a stopped kubelet does (kubelet_watch.py);
- with ``hold_health``, it opens the health stream of each driver it registers and holds it, as kubelet
  1.36 does (it ends with ``stop()``);
- ``register_lag``: kubelet's plugin manager registers a socket its watcher saw only at its reconciler's
  next pass (``pkg/kubelet/pluginmanager/reconciler``: once a second), so a registration comes up to a
  second after the socket; the lag is the awaitable this returns, called per socket (none: at once). A
  registration that fails (GetInfo not answered within its deadline, on a loaded node) is tried again at
  a later pass while the socket is there, as the reconciler does;
- a driver that deregisters has ``wiping_delay`` (kubelet's ``defaultWipingDelay``, 30 s, in
  pkg/kubelet/cm/dra/manager.go) to register again before kubelet deletes its ResourceSlices on this
  node (``on_wipe(driver)``, given the fake API server's ``wipe_driver``); a registration of the same
  driver within that time cancels the pending wipe. Kubelet also queues the wipe when the gRPC
  connection is lost with the socket left behind; this fake takes only the socket's removal, which is
  what a stopping daemon does.

Tests read ``events`` (an asyncio.Queue) with timeouts.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ate_devplugd._pb.dra.v1 import api_pb2 as v1_pb2
from ate_devplugd._pb.dra.v1 import api_pb2_grpc as v1_grpc
from ate_devplugd._pb.dra.v1beta1 import api_pb2 as v1beta1_pb2
from ate_devplugd._pb.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2 as health_pb2
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from ate_devplugd._pb.pluginregistration.v1 import api_pb2 as reg_pb2
from ate_devplugd._pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from ate_devplugd.base.inotify import DirEvent, DirWatcher

DIAL_TIMEOUT = 10.0
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
CALL_TIMEOUT = 45.0
WIPING_DELAY = 30.0
#: kubelet's device-manager checkpoint, which its start leaves in the device-plugin directory.
CHECKPOINT = "kubelet_internal_checkpoint"
#: kubelet's device manager as far as a DRA driver sees it: a process listening on kubelet.sock.
LISTENER = """
import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen()
print("listening", flush=True)
while True:
    server.accept()[0].close()
"""
_VERSIONS: dict[str, tuple[Any, Any]] = {
    "v1.DRAPlugin": (v1_pb2, v1_grpc),
    "v1beta1.DRAPlugin": (v1beta1_pb2, v1beta1_grpc),
}


@dataclass
class Event:
    kind: str
    name: str = ""
    detail: str = ""


@dataclass
class Plugin:
    driver: str
    endpoint: str
    version: str
    socket: str
    channel: grpc.aio.Channel
    pb: Any = None
    stub: Any = None
    health: asyncio.Queue[health_pb2.NodeWatchResourcesResponse] = field(default_factory=asyncio.Queue)


class FakeDraKubelet:
    def __init__(
        self,
        kubelet_dir: Path,
        known_versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        *,
        on_wipe: Callable[[str], object] | None = None,
        wiping_delay: float = WIPING_DELAY,
        device_plugin_dir: Path | None = None,
        hold_health: bool = False,
        register_lag: Callable[[], Awaitable[object]] | None = None,
    ):
        self.register_lag = register_lag
        self.registry = kubelet_dir / "plugins_registry"
        self.device_plugin_dir = device_plugin_dir
        self.hold_health = hold_health
        #: The process listening on kubelet.sock (with ``device_plugin_dir``), while "kubelet" runs.
        self.process: asyncio.subprocess.Process | None = None
        self.known_versions = known_versions
        self.on_wipe = on_wipe
        self.wiping_delay = wiping_delay
        self._wipes: dict[str, asyncio.TimerHandle] = {}
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.plugins: dict[str, Plugin] = {}
        self._watch: DirWatcher | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        self._stopping = False
        if self.device_plugin_dir is not None:
            await self._start_device_manager(self.device_plugin_dir)
        self.registry.mkdir(parents=True, exist_ok=True)
        self._watch = DirWatcher(str(self.registry), self._on_dir_events)
        self._watch.start()  # the watch first, then the walk: no socket is missed in between
        for entry in sorted(os.listdir(self.registry)):
            self._spawn(self._consider(entry))

    async def _start_device_manager(self, directory: Path) -> None:
        """Remove the directory's files but the checkpoint (in no particular order), then listen on
        kubelet.sock in a process of its own."""
        for entry in os.listdir(directory):
            path = directory / entry
            if entry != CHECKPOINT and not path.is_dir():
                path.unlink(missing_ok=True)
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", LISTENER, str(directory / "kubelet.sock"), stdout=asyncio.subprocess.PIPE
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(10):
            assert await self.process.stdout.readline() == b"listening\n"
        self.events.put_nowait(Event("kubelet-sock", str(self.process.pid)))

    async def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            await self.process.wait()
            self.process = None
        self._stopping = True
        for handle in self._wipes.values():
            handle.cancel()
        self._wipes.clear()
        if self._watch is not None:
            self._watch.close()
        for task in list(self._tasks):
            task.cancel()
        for plugin in list(self.plugins.values()):
            await plugin.channel.close()
        self.plugins.clear()

    async def restart(self) -> None:
        """A new kubelet: every registration and stream of the old one gone, then the new plugin
        watcher's initial walk registers each socket again. (Its deletion of the node's slices is the
        API server's ``kubelet_restarted()``, so a test can order the two.)"""
        await self.stop()
        self._stopping = False
        self.events.put_nowait(Event("restart"))
        await self.start()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_dir_events(self, events: list[DirEvent]) -> None:
        for event in events:
            if event.kind == "created":
                self._spawn(self._consider(event.name))
            elif event.kind == "removed":
                self._spawn(self._deregister(event.name))

    async def _consider(self, name: str) -> None:
        path = self.registry / name
        if name.startswith("."):
            self.events.put_nowait(Event("ignored", name, "dot-name"))
            return
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            self.events.put_nowait(Event("ignored", name, "not a socket"))
            return
        if self.register_lag is None:
            await self._register(path)
            return
        while not self._stopping:
            await self.register_lag()  # the reconciler's next pass
            if not path.exists():
                return  # gone meanwhile: the reconciler finds nothing to register
            if await self._register(path):
                return

    async def _register(self, path: Path) -> bool:
        """One registration of the socket, in kubelet's order (``GenerateRegisterPluginFunc``): dial, GetInfo,
        validate; the plugin taken into kubelet's DRA manager *before* NotifyRegistrationStatus, so a driver
        told it is registered is one kubelet calls. Whether it ended (registered, or refused: kubelet keeps
        it as tried); False when it failed before kubelet knew the plugin (dial or GetInfo), which kubelet's
        reconciler tries again."""
        channel = grpc.aio.insecure_channel("unix://" + str(path))
        stub = reg_grpc.RegistrationStub(channel)
        try:
            try:
                async with asyncio.timeout(DIAL_TIMEOUT):
                    await channel.channel_ready()
                info = await stub.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                self.events.put_nowait(Event("register-failed", path.name, str(exc)))
                return False
            error = self._validate(info)
            if error:
                await self._notify(stub, path, error)
                self.events.put_nowait(Event("register-refused", info.name, error))
                return True
            self._take(info, path)
            await self._notify(stub, path, "")
            return True
        finally:
            await channel.close()

    async def _notify(self, stub: Any, path: Path, error: str) -> None:
        try:
            await stub.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=not error, error=error), timeout=NOTIFY_TIMEOUT
            )
        except (TimeoutError, grpc.aio.AioRpcError) as exc:  # the plugin stays as kubelet took it
            self.events.put_nowait(Event("notify-failed", path.name, str(exc)))

    def _take(self, info: reg_pb2.PluginInfo, path: Path) -> None:
        """The DRA manager's RegisterPlugin: the plugin's client made (a new one replaces the old)."""
        version = next(v for v in info.supported_versions if v in self.known_versions)
        pb, grpc_module = _VERSIONS[version]
        endpoint = info.endpoint or str(path)
        plugin_channel = grpc.aio.insecure_channel("unix://" + endpoint)
        plugin = Plugin(
            info.name, endpoint, version, path.name, plugin_channel, pb, grpc_module.DRAPluginStub(plugin_channel)
        )
        old = self.plugins.pop(info.name, None)
        if old is not None:
            self._spawn(old.channel.close())
        self.plugins[info.name] = plugin
        self.events.put_nowait(Event("registered", info.name, version))
        if self.hold_health:
            self.watch_health(info.name)
        pending = self._wipes.pop(info.name, None)
        if pending is not None:
            pending.cancel()
            self.events.put_nowait(Event("wipe-cancelled", info.name))

    def _validate(self, info: reg_pb2.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"unknown plugin type {info.type!r}"
        if not info.name:
            return "empty driver name"
        if not any(v in self.known_versions for v in info.supported_versions):
            return f"none of the versions {list(info.supported_versions)} is supported"
        if info.endpoint and not os.path.isabs(info.endpoint):
            return f"endpoint {info.endpoint!r} is not absolute"
        return ""

    async def _deregister(self, name: str) -> None:
        for driver, plugin in list(self.plugins.items()):
            if plugin.socket == name:
                del self.plugins[driver]
                await plugin.channel.close()
                self.events.put_nowait(Event("deregistered", driver))
                if self.on_wipe is not None and driver not in self._wipes:
                    loop = asyncio.get_running_loop()
                    self._wipes[driver] = loop.call_later(self.wiping_delay, self._wipe, driver)
                    self.events.put_nowait(Event("wipe-pending", driver, f"{self.wiping_delay:g} s"))

    def _wipe(self, driver: str) -> None:
        """The grace is over and the driver did not come back: its slices on this node go."""
        del self._wipes[driver]
        assert self.on_wipe is not None
        self.on_wipe(driver)
        self.events.put_nowait(Event("wiped", driver))

    # -- the DRA manager's calls ------------------------------------------------------------------------
    async def prepare(self, driver: str, *claims: tuple[str, str, str]) -> Any:
        """NodePrepareResources for (namespace, uid, name) claims, as the chosen version."""
        plugin = self.plugins[driver]
        request = plugin.pb.NodePrepareResourcesRequest(
            claims=[plugin.pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        )
        return await plugin.stub.NodePrepareResources(request, timeout=CALL_TIMEOUT)

    async def unprepare(self, driver: str, *claims: tuple[str, str, str]) -> Any:
        plugin = self.plugins[driver]
        request = plugin.pb.NodeUnprepareResourcesRequest(
            claims=[plugin.pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        )
        return await plugin.stub.NodeUnprepareResources(request, timeout=CALL_TIMEOUT)

    def watch_health(self, driver: str) -> asyncio.Queue[health_pb2.NodeWatchResourcesResponse]:
        """Open the v1alpha1 health stream; every message lands on the returned queue."""
        plugin = self.plugins[driver]
        stub = health_grpc.DRAResourceHealthStub(plugin.channel)

        async def read() -> None:
            call = stub.NodeWatchResources(health_pb2.NodeWatchResourcesRequest())
            try:
                async for response in call:
                    plugin.health.put_nowait(response)
                detail = "OK"
            except grpc.aio.AioRpcError as exc:
                detail = exc.code().name
            except (asyncio.CancelledError, UnboundLocalError):
                # grpc.aio raises CancelledError for a stream the server cancelled, too; grpcio 1.51's
                # reader UnboundLocalError when cancelled just as the stream ends OK (grpc/grpc#31227)
                call.cancel()
                if self._stopping:
                    raise asyncio.CancelledError from None
                detail = "CANCELLED"
            self.events.put_nowait(Event("health-ended", driver, detail))

        self._spawn(read())
        return plugin.health

    async def next_event(self, *kinds: str, timeout: float = 5.0) -> Event:
        async with asyncio.timeout(timeout):
            while True:
                event = await self.events.get()
                if not kinds or event.kind in kinds:
                    return event
