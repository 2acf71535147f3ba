"""A fake kubelet device manager that behaves as kubelet's own code does toward a device plugin.

- start: removes every socket in its directory (not other files) in an order kubelet leaves open:
  ``CleanupPluginDirectory`` lists with ``Readdirnames``, which does not sort (tmpfs: newest first, ext4:
  hash order). So the order is ``wipe_order``: "random" (the default, from ``seed``), "name", or a
  function of the names; the stale ``kubelet.sock`` may go before or after any plugin's socket. Between
  removals, before the new ``kubelet.sock`` is bound and before it listens, it pauses for 0 to ``jitter``
  seconds now and then, so a plugin's look at the directory and its connect can fall anywhere in between;
- Register: checks the version ("v1beta1"), the extended resource name and that the endpoint is a bare
  file name; dials the endpoint back and calls GetDevicePluginOptions *before* replying; only then
  opens ListAndWatch, recording every message;
- a second registration for a resource becomes the *current* client (``endpoints``); one that arrives
  while the older stream is open is recorded as ``double-register``. What happens to the older client is
  ``swap``: "1.36" (the default; kubelet 1.36's handler, whose ``registerClient`` only swaps the map entry)
  keeps it running, its stream open, on a client kubelet no longer uses; "1.32" (what kubelet 1.32's
  manager was seen to do) ends its stream once the new client's Register has returned. When any client's
  stream ends, the current client is disconnected, as kubelet's ``runClient`` does (A7b): recorded as
  ``disconnected``, its connection closed, every unit unhealthy (``allocatable`` 0) until a plugin
  registers the name again. So under "1.36" a client that took the name and then went leaves it at 0 with
  no signal on the older stream; under "1.32" the older stream's end is the signal;
- ``restart()`` is a kubelet killed and started again: the old ``kubelet.sock`` stays behind, dead, until
  the new kubelet's wipe removes it; ``graceful=True`` removes it at the stop instead;
- the pod-resources API beside the directory (``<dir>/../pod-resources/kubelet.sock``, as kubelet serves it
  under its root directory): ``GetAllocatableResources`` lists the current clients' Healthy device IDs,
  as kubelet's ``GetAllocatableDevices`` does (none for a resource once disconnected, nor for one whose
  units are all Unhealthy); each question is recorded (``pod-resources``). Not modelled: kubelet also
  takes a swapped-out client's later device lists into the name's device set;
- the device manager's checkpoint (``kubelet_internal_checkpoint``), written as kubelet writes it (a dot
  temp file renamed into place) each time it takes in a current client's device list: its
  ``RegisteredDevices`` are each resource's Healthy IDs (a disconnect empties them without a write);
- ``lean=True`` (the benchmark) keeps each ListAndWatch message as bytes and only counts the units,
  so recording costs next to nothing.

Tests read ``events`` (an asyncio.Queue) with timeouts. Run as a script it serves a directory and
appends one JSON line per event to a log file; SIGHUP restarts it, SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

try:
    from ate_devplugd._pb import api_pb2, api_pb2_grpc
except ImportError:  # run from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd._pb.podresources.v1 import api_pb2 as pr_pb2
from ate_devplugd._pb.podresources.v1 import api_pb2_grpc as pr_grpc

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
DIAL_TIMEOUT = 10.0

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*\Z")
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")


def extended_resource_name_ok(name: str) -> bool:
    """kubelet's IsExtendedResourceName, written out independently of the daemon's copy."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    parts = ("requests." + name).split("/")
    if len(parts) != 2:
        return False
    prefix, rest = parts
    return 0 < len(rest) <= 63 and bool(_NAME.match(rest)) and len(prefix) <= 253 and bool(_SUBDOMAIN.match(prefix))


LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
#: Device.health (field 2, length-delimited) as encoded on the wire.
HEALTHY_FIELD = b"\x12\x07Healthy"
UNHEALTHY_FIELD = b"\x12\x09Unhealthy"


@dataclass
class Event:
    """One step, stamped with CLOCK_MONOTONIC when it reached this process's Python code."""

    kind: str
    resource: str = ""
    endpoint: str = ""
    ids: list[str] = field(default_factory=list)
    healthy: int = 0
    total: int = 0
    error: str = ""
    t: float = field(default_factory=time.monotonic)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": time.time(), "event": self.kind}
        if self.resource:
            out["resource"] = self.resource
        if self.endpoint:
            out["endpoint"] = self.endpoint
        if self.kind == "list":
            out["healthy"] = self.healthy
            out["total"] = self.total
            out["ids_digest"] = hashlib.sha256("\n".join(self.ids).encode()).hexdigest()[:16]
        if self.error:
            out["error"] = self.error
        return out


@dataclass
class Endpoint:
    resource: str
    socket_path: str
    channel: grpc.aio.Channel
    stub: api_pb2_grpc.DevicePluginStub
    options: api_pb2.DevicePluginOptions
    stream_task: asyncio.Task[None] | None = None
    latest: api_pb2.ListAndWatchResponse | None = None
    #: Set once kubelet has taken the client's first device list.
    listed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def streaming(self) -> bool:
        return self.stream_task is not None and not self.stream_task.done()


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def Register(self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext) -> api_pb2.Empty:
        return await self._kubelet.handle_register(request, context)


WipeOrder = str | Callable[[list[str]], list[str]]


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def GetAllocatableResources(
        self, request: pr_pb2.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr_pb2.AllocatableResourcesResponse:
        # one entry per device, as kubelet answers
        self._kubelet._record(Event("pod-resources"))
        response = pr_pb2.AllocatableResourcesResponse()
        for resource, endpoint in self._kubelet.endpoints.items():
            if endpoint.streaming and endpoint.latest is not None:
                for device in endpoint.latest.devices:
                    if device.health == "Healthy":
                        response.devices.add(resource_name=resource, device_ids=[device.ID])
        return response


class FakeKubelet:
    """kubelet's device manager on ``directory``; ``wipe=False`` leaves plugin sockets alone (bench floors)."""

    def __init__(
        self,
        directory: Path | str,
        *,
        log: Any = None,
        wipe: bool = True,
        lean: bool = False,
        wipe_order: WipeOrder = "random",
        seed: int | str | None = None,
        jitter: float = 0.002,
        swap: str = "1.36",
    ) -> None:
        if swap not in ("1.36", "1.32"):
            raise ValueError(f"swap {swap!r}")
        self.swap = swap
        self.dir = Path(directory)
        self.wipe_at_start = wipe
        self.wipe_order = wipe_order
        self.rng = random.Random(seed)
        self.jitter = jitter
        self.lean = lean
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.history: list[Event] = []
        #: The current client per resource (kubelet's map); older clients of a resource that kubelet
        #: has not closed are in ``_older``.
        self.endpoints: dict[str, Endpoint] = {}
        self._older: list[Endpoint] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: The device manager's healthy IDs per resource, as its checkpoint records them.
        self.registered_devices: dict[str, list[str]] = {}
        self._stopping = False
        self.register_delay = 0.0
        #: When Register's reply goes out: "at once" (once the client's ListAndWatch is started), or "after
        #: its list" (once kubelet took the client's first list and wrote its checkpoint). kubelet leaves
        #: this open: the client's goroutine runs beside the reply.
        self.register_reply = "at once"
        self.reject_register: str | None = None
        #: Called when a Register arrives, before anything else (a test's look at that moment).
        self.on_register: Any = None
        self._server: grpc.aio.Server | None = None
        self._pod_resources: grpc.aio.Server | None = None
        self._log = log
        # One number per kubelet "process": a Register still being handled when this fake restarts
        # belongs to a kubelet that is gone, and must leave nothing behind in the new one.
        self._incarnation = 0

    @property
    def socket_path(self) -> Path:
        return self.dir / KUBELET_SOCKET

    @property
    def pod_resources_path(self) -> Path:
        return self.dir.parent / "pod-resources" / KUBELET_SOCKET

    def _record(self, ev: Event) -> None:
        self.history.append(ev)
        self.events.put_nowait(ev)
        if self._log is not None:
            self._log.write(json.dumps(ev.as_json()) + "\n")
            self._log.flush()

    def ordered(self, names: list[str]) -> list[str]:
        """The directory's names in the order this kubelet's wipe takes them."""
        if callable(self.wipe_order):
            return self.wipe_order(list(names))
        if self.wipe_order == "name":
            return sorted(names)
        if self.wipe_order == "random":
            names = sorted(names)
            self.rng.shuffle(names)
            return names
        raise ValueError(f"wipe_order {self.wipe_order!r}")

    async def _pause(self) -> None:
        """Now and then a moment in which a plugin runs (kubelet's steps are not atomic)."""
        if self.jitter and self.rng.random() < 0.5:
            await asyncio.sleep(self.rng.uniform(0.0, self.jitter))

    async def wipe(self) -> None:
        """What kubelet's device manager does at start: remove every socket in the directory, in
        ``wipe_order`` (the listing is taken once, first, as ``Readdirnames`` does)."""
        self.dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        for name in self.ordered(os.listdir(self.dir)):
            if name == CHECKPOINT:
                continue
            entry = self.dir / name
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
                    await self._pause()

    async def start(self) -> None:
        self._incarnation += 1
        self._stopping = False
        # kubelet's readCheckpoint: every recorded resource starts with no healthy unit
        self.registered_devices = {name: [] for name in self.registered_devices}
        if self.wipe_at_start:
            await self.wipe()
        else:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        await self._pause()
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        # Bound under another name and linked into place: gRPC unlinks the path it bound when it stops,
        # and a killed kubelet leaves its socket file behind (stop(graceful=False) does the same).
        staging = self.dir / ".kubelet.sock.binding"
        server.add_insecure_port("unix://" + str(staging.resolve()))
        os.link(staging, self.socket_path)
        staging.unlink()
        # The socket file exists from here on: this is when a plugin's inotify watch fires.
        self._record(Event("socket"))
        await self._pause()
        await server.start()
        self._server = server
        self._record(Event("listening"))
        if not self.lean:
            await self._serve_pod_resources()

    async def _serve_pod_resources(self) -> None:
        """The pod-resources API, where the directory's parent lets it be (a kubelet root of the test's)."""
        try:
            self.pod_resources_path.parent.mkdir(mode=0o750, exist_ok=True)
            server = grpc.aio.server()
            pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
            server.add_insecure_port("unix://" + str(self.pod_resources_path))
        except (OSError, RuntimeError):
            return
        await server.start()
        self._pod_resources = server

    async def stop(self, *, graceful: bool = True) -> None:
        """Stop serving; ``graceful=False`` leaves the dead ``kubelet.sock`` behind, as a killed kubelet does."""
        self._stopping = True
        pod_resources, self._pod_resources = self._pod_resources, None
        if pod_resources is not None:
            await pod_resources.stop(None)
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
            if graceful:
                with contextlib.suppress(OSError):  # as Go's listener Close: gone or read-only is fine
                    self.socket_path.unlink()
        clients = [*self.endpoints.values(), *self._older]
        self.endpoints.clear()
        self._older.clear()
        for endpoint in clients:
            await self._drop(endpoint)

    async def restart(self, *, graceful: bool = False) -> None:
        await self.stop(graceful=graceful)
        self._record(Event("restart"))
        await self.start()

    async def _drop(self, endpoint: Endpoint) -> None:
        if endpoint.stream_task is not None:
            endpoint.stream_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await endpoint.stream_task
        await endpoint.channel.close()

    async def handle_register(
        self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.Empty:
        received = time.monotonic()
        if self.on_register is not None:
            self.on_register()
        incarnation = self._incarnation
        name = request.resource_name
        if self.register_delay:
            await asyncio.sleep(self.register_delay)
        if self.reject_register:
            self._record(Event("register-rejected", name, error=self.reject_register))
            await context.abort(grpc.StatusCode.UNKNOWN, self.reject_register)
        if request.version != "v1beta1":
            msg = f'requested API version "{request.version}" is not supported by kubelet'
            self._record(Event("register-rejected", name, error=msg))
            await context.abort(grpc.StatusCode.UNKNOWN, msg)
        if not extended_resource_name_ok(name):
            msg = f'the ResourceName "{name}" is invalid'
            self._record(Event("register-rejected", name, error=msg))
            await context.abort(grpc.StatusCode.UNKNOWN, msg)
        if not request.endpoint or "/" in request.endpoint or request.endpoint in (".", ".."):
            msg = f"endpoint {request.endpoint!r} is not a file name in {self.dir}"
            self._record(Event("register-rejected", name, error=msg))
            await context.abort(grpc.StatusCode.UNKNOWN, msg)

        socket_path = str((self.dir / request.endpoint).resolve())
        # A connection of its own, as each kubelet ClientConn has: gRPC in Python shares one per address
        # among a process's channels, with its failures and reconnect back-off, so after a storm of plugin
        # sockets wiped under it a new dial could wait out a back-off grown past the 10 s dial timeout.
        channel = grpc.aio.insecure_channel("unix://" + socket_path, options=(("grpc.use_local_subchannel_pool", 1),))
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can turn this kubelet's own stop (a
            # cancel) into a timeout, and a dying kubelet would answer as a live one that could not dial.
            async with asyncio.timeout(DIAL_TIMEOUT):
                await channel.channel_ready()
            stub = api_pb2_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=DIAL_TIMEOUT)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close()
            if incarnation != self._incarnation:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarted while handling Register")
            msg = f"failed to dial device plugin: {str(exc) or 'context deadline exceeded'}"
            self._record(Event("register-rejected", name, request.endpoint, error=msg))
            await context.abort(grpc.StatusCode.UNKNOWN, msg)

        if incarnation != self._incarnation:
            await channel.close()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarted while handling Register")
        old = self.endpoints.get(name)
        endpoint = Endpoint(name, socket_path, channel, stub, options)
        self.endpoints[name] = endpoint
        swapped = old is not None and old.streaming
        if old is not None and swapped:
            # kubelet leaves the older client running; when its stream ends, the new one goes (A7b)
            self._record(Event("double-register", name, request.endpoint))
            self._older.append(old)
        elif old is not None:
            await self._drop(old)
        self._record(Event("register", name, request.endpoint, t=received))
        # kubelet starts ListAndWatch only after Register has returned.
        loop = asyncio.get_running_loop()
        endpoint.stream_task = loop.create_task(self._list_and_watch(endpoint))
        if old is not None and swapped and self.swap == "1.32":
            task = loop.create_task(self.cut(old))  # 1.32: the older client's stream ends
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await self._reply_when(endpoint)
        return api_pb2.Empty()

    async def _reply_when(self, endpoint: Endpoint) -> None:
        """Hold Register's reply as ``register_reply`` says."""
        if self.register_reply == "after its list":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DIAL_TIMEOUT):
                    await endpoint.listed.wait()

    async def _list_and_watch(self, endpoint: Endpoint) -> None:
        await asyncio.sleep(0)
        if self.lean:
            # Kept as bytes: kubelet decodes in Go, and a Python decode here would be counted against the
            # plugin. Each Device ends with its health field, so counting those tells healthy from total.
            call = endpoint.channel.unary_stream(LIST_AND_WATCH, request_serializer=api_pb2.Empty.SerializeToString)(
                api_pb2.Empty()
            )
        else:
            call = endpoint.stub.ListAndWatch(api_pb2.Empty())
        try:
            async for response in call:
                self._record(self._list_event(endpoint, response))
                endpoint.listed.set()
        except grpc.aio.AioRpcError as exc:
            self._record(Event("stream-ended", endpoint.resource, error=exc.code().name))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except UnboundLocalError:
            # grpcio 1.51's reader, cancelled just as the stream ends OK (grpc/grpc#31227): a cancel.
            raise asyncio.CancelledError from None
        else:
            self._record(Event("stream-ended", endpoint.resource, error="returned"))
        self._client_ended(endpoint)

    def _client_ended(self, ended: Endpoint) -> None:
        """kubelet's ``runClient`` once a client's ListAndWatch has ended: it disconnects the resource's
        *current* client, whichever client's stream it was (A7b)."""
        if ended in self._older:
            self._older.remove(ended)
        current = self.endpoints.pop(ended.resource, None)
        if current is None or self._stopping:
            return
        self.registered_devices[ended.resource] = []  # PluginDisconnected: no write
        older = current is not ended
        self._record(Event("disconnected", ended.resource, error="an older client's stream ended" if older else ""))
        if older:
            # Disconnect closes the current client's connection: its stream ends too, and its own
            # runClient then finds no client to disconnect.
            asyncio.get_running_loop().create_task(self._drop(current))
        else:
            asyncio.get_running_loop().create_task(current.channel.close())

    async def cut(self, client: Endpoint) -> None:
        """The connection to ``client`` breaks: its ListAndWatch ends (kubelet's Recv fails), and kubelet's
        ``runClient`` goes on as it does after any stream's end."""
        await self._drop(client)
        self._record(Event("stream-ended", client.resource, error="CANCELLED"))
        self._client_ended(client)

    def allocatable(self, resource: str) -> int:
        """What kubelet would offer the scheduler: the current client's Healthy units, 0 once disconnected."""
        endpoint = self.endpoints.get(resource)
        if endpoint is None or not endpoint.streaming or endpoint.latest is None:
            return 0
        return sum(1 for d in endpoint.latest.devices if d.health == "Healthy")

    def _list_event(self, endpoint: Endpoint, response: Any) -> Event:
        if self.lean:
            healthy = response.count(HEALTHY_FIELD)
            return Event("list", endpoint.resource, healthy=healthy, total=healthy + response.count(UNHEALTHY_FIELD))
        endpoint.latest = response
        ids = [d.ID for d in response.devices]
        healthy = [d.ID for d in response.devices if d.health == "Healthy"]
        if self.endpoints.get(endpoint.resource) is endpoint:
            self.registered_devices[endpoint.resource] = healthy
            self._write_checkpoint()
        return Event("list", endpoint.resource, ids=ids, healthy=len(healthy), total=len(ids))

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / CHECKPOINT

    def _write_checkpoint(self) -> None:
        """kubelet's ``writeCheckpoint``: a temp file renamed into place (its pods' entries not modelled)."""
        data = {"Data": {"PodDeviceEntries": None, "RegisteredDevices": self.registered_devices}, "Checksum": 0}
        staging = self.dir / f".{CHECKPOINT}.{os.getpid()}"
        with contextlib.suppress(OSError):  # a directory removed under a test: kubelet logs and goes on
            staging.write_text(json.dumps(data))
            os.replace(staging, self.checkpoint_path)

    def stub(self, resource: str) -> api_pb2_grpc.DevicePluginStub:
        return self.endpoints[resource].stub

    async def allocate(self, resource: str, *id_lists: list[str]) -> api_pb2.AllocateResponse:
        endpoint = self.endpoints[resource]
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in id_lists]
        )
        response: api_pb2.AllocateResponse = await endpoint.stub.Allocate(request, timeout=10)
        return response

    async def admit(self, resource: str) -> str:
        """A pod asking one unit of ``resource``, as kubelet 1.36's admission takes it: "" once Allocate
        answered, else why it failed (for a bare pod, for good): no client holding the resource or no
        Healthy unit of it (``no healthy devices present``), or Allocate refused or cut off."""
        endpoint = self.endpoints.get(resource)
        latest = endpoint.latest if endpoint is not None and endpoint.streaming else None
        healthy = [d.ID for d in latest.devices if d.health == "Healthy"] if latest is not None else []
        if endpoint is None or not healthy:
            return "Allocate failed due to no healthy devices present"
        try:
            await endpoint.stub.Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[healthy[0]])]
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError as exc:
            return f"Allocate failed due to rpc error: code = {exc.code().name} desc = {exc.details()}"
        return ""

    # -- waiting helpers for tests ---------------------------------------------------------------
    async def next_event(self, *kinds: str, resource: str | None = None, timeout: float = 10.0) -> Event:
        """The next event of one of ``kinds`` (for ``resource``), skipping others."""
        async with asyncio.timeout(timeout):
            while True:
                ev = await self.events.get()
                if (not kinds or ev.kind in kinds) and (resource is None or ev.resource == resource):
                    return ev

    def drain(self) -> list[Event]:
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out


class PodArrivals:
    """Pods asking one unit of a resource each, ``rate`` a second, through ``admit`` while on (SIGUSR1
    turns them on and off): one ``pod`` event per pod, with why it failed (none: admitted)."""

    def __init__(self, kubelet: FakeKubelet, resource: str, rate: float) -> None:
        self._kubelet, self._resource, self._rate = kubelet, resource, rate
        self._task: asyncio.Task[None] | None = None
        self._pods: set[asyncio.Task[None]] = set()

    def toggle(self) -> None:
        if self._task is None:
            self._kubelet._record(Event("pods-on", self._resource))
            self._task = asyncio.get_running_loop().create_task(self._arrive())
        else:
            self._task.cancel()
            self._task = None
            self._kubelet._record(Event("pods-off", self._resource))

    async def _admit(self) -> None:
        error = await self._kubelet.admit(self._resource)
        self._kubelet._record(Event("pod", self._resource, error=error))

    async def _arrive(self) -> None:
        while True:
            task = asyncio.get_running_loop().create_task(self._admit())
            self._pods.add(task)
            task.add_done_callback(self._pods.discard)
            await asyncio.sleep(1 / self._rate)  # the next pod's arrival: load, not a wait for an event


async def _serve_forever(directory: str, log_path: str | None, pods: tuple[str, float] | None = None) -> int:
    log = open(log_path, "a", encoding="utf-8") if log_path else sys.stdout  # noqa: SIM115
    kubelet = FakeKubelet(directory, log=log)
    stop = asyncio.Event()
    restart = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, restart.set)
    if pods is not None:
        loop.add_signal_handler(signal.SIGUSR1, PodArrivals(kubelet, *pods).toggle)
    await kubelet.start()
    while not stop.is_set():
        stopping = asyncio.ensure_future(stop.wait())
        restarting = asyncio.ensure_future(restart.wait())
        await asyncio.wait((stopping, restarting), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        restarting.cancel()
        if restart.is_set() and not stop.is_set():
            restart.clear()
            await kubelet.restart()
    await kubelet.stop()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(kubelet.socket_path)
    kubelet._record(Event("stopped"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="A fake kubelet device manager for tests.")
    parser.add_argument("--dir", required=True, help="the device-plugin directory to serve")
    parser.add_argument("--log", help="append JSON lines here (default stdout)")
    parser.add_argument(
        "--pods", metavar="RESOURCE:RATE", help="pods asking RESOURCE, RATE a second, while SIGUSR1 has them on"
    )
    args = parser.parse_args()
    pods = None
    if args.pods:
        resource, _, rate = args.pods.rpartition(":")
        pods = (resource, float(rate))
    return asyncio.run(_serve_forever(args.dir, args.log, pods))


if __name__ == "__main__":
    sys.exit(main())
