"""The rest of a node's Kubernetes around the daemon, as a node switching modes meets it (docs/switching.md):

- ``NodeStatusReporter``: kubelet 1.36's node-status update (``pkg/kubelet/kubelet_node_status.go``,
  ``tryUpdateNodeStatus``): every ``period`` (``nodeStatusUpdateFrequency``, 10 s by default) it computes
  the status from what kubelet's device manager says *then* (``FakeKubelet.allocatable``), and writes it
  only when it changed, or once ``report_every`` (``nodeStatusReportFrequency``, 5 min by default with
  node leases) passed since the last write. So the Node lags kubelet by up to a period, and a restart
  whose gap falls between two computations writes nothing at all. The Node carries
  ``status.nodeInfo.kubeletVersion`` (``version``);
- ``Scheduler``: one node, pods asking ``ate.dev/kvm: 1``, as kube-scheduler 1.36 ``filterExtendedResources``
  chooses: ``spec.unschedulable`` is honoured; allocatable above 0 in the Node *as last reported* is the
  device-plugin path; 0 where a stored DeviceClass maps the name (``extendedResourceName``) and the
  scheduler's DRAExtendedResource gate is on (``extended_resource``) is the DRA path, through a device of our
  slice (a claim is made and allocated); neither: the pod waits (``Insufficient ate.dev/kvm``). A pod is
  bound a moment after its path was chosen (``bind_delay``), cordon or not, as a scheduler's assumed pod is;
- ``PodKubelet``: kubelet's pod side on the node. Device-plugin path: admission fails at once
  (``UnexpectedAdmissionError``, terminal) when the device manager has no healthy unit, else Allocate on
  the plugin and a device-plugin allocation in the checkpoint (kept after the pod ends, as kubelet 1.36
  keeps it). DRA path: NodePrepareResources through the registered driver, retried every ``sync`` while
  it is not registered or refuses (``FailedPrepareDynamicResources``); then the container start, which
  fails (``CreateContainerConfigError: endpoint not found in cache``, retried) while the checkpoint holds a
  device-plugin allocation of the resource and no endpoint of it is registered or within its grace
  (``endpoint_grace``, kubelet's 5 minutes); deletion of a DRA pod needs NodeUnprepareResources through a
  registered driver (retried every ``sync``). Every failed prepare is kept on the pod (``prepare_failures``):
  on a real node kubelet tries again only at a later sync (62-74 s seen), so a pod that meets one starts
  late. With kubelet's DRAExtendedResource gate off (``extended_resource``) a pod sent down the DRA path
  is admitted as a device-plugin one, and fails (``UnexpectedAdmissionError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tests.fakes.apiserver import FakeApiServer
from tests.fakes.dra_kubelet import FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet


@dataclass
class Pod:
    name: str
    created: float = field(default_factory=time.monotonic)
    path: str = ""  # "device-plugin" or "dra", once scheduled
    phase: str = "Pending"
    reason: str = ""
    started: float | None = None
    deleted: bool = False
    gone: bool = False
    uid: str = ""
    device: str = ""
    #: Each failed NodePrepareResources, its reason.
    prepare_failures: list[str] = field(default_factory=list)
    #: How long it runs once started (None: until deleted); then it is deleted, as a finished VM's pod.
    lifetime: float | None = None

    @property
    def wait(self) -> float | None:
        return None if self.started is None else self.started - self.created


class NodeStatusReporter:
    """kubelet's node-status updates (module doc): computed every ``period``, written on a change or after
    ``report_every``."""

    def __init__(
        self,
        api: FakeApiServer,
        kubelet: FakeKubelet,
        resource: str,
        period: float,
        phase: float,
        *,
        report_every: float = 300.0,
        version: str = "v1.36.2",
    ) -> None:
        self._api, self._kubelet, self._resource = api, kubelet, resource
        self.period, self._phase = period, phase
        self.report_every, self.version = report_every, version
        self._task: asyncio.Task[None] | None = None
        self._written: tuple[int, int] | None = None
        self._written_at = 0.0
        #: Each status written, as (time, allocatable).
        self.writes: list[tuple[float, int]] = []
        self._written_event = asyncio.Event()

    def report(self, *, force: bool = False) -> None:
        """One computation of the status: written when it changed or is due (or ``force``)."""
        allocatable = self._kubelet.allocatable(self._resource)
        capacity = max(
            allocatable,
            int((self._api.nodes[self._api.node_name].get("status") or {}).get("capacity", {}).get(self._resource, 0)),
        )
        now = time.monotonic()
        due = now - self._written_at >= self.report_every
        if force or due or self._written != (allocatable, capacity):
            self._api.set_node_status(
                {self._resource: str(allocatable)}, {self._resource: str(capacity)}, kubelet_version=self.version
            )
            self._written, self._written_at = (allocatable, capacity), now
            self.writes.append((now, allocatable))
            self._written_event.set()

    async def next_write(self) -> None:
        """Until kubelet next writes the Node's status."""
        self._written_event.clear()
        await self._written_event.wait()

    def start(self, phase: float | None = None) -> None:
        """Report every ``period``, the first one ``phase`` from now (the constructor's phase if None)."""

        async def run() -> None:
            await asyncio.sleep(self._phase if phase is None else phase)
            while True:
                self.report()
                await asyncio.sleep(self.period)  # kubelet's own timer, nodeStatusUpdateFrequency

        self._task = asyncio.get_running_loop().create_task(run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @contextlib.asynccontextmanager
    async def just_reported(self) -> AsyncIterator[None]:
        """Run the body right after a node-status update, the next one a full period after it ends: the
        Node shows what it showed before the body for a whole period. With time scaled down, a daemon's
        stop or start (real milliseconds, not scaled) would otherwise span scaled seconds of lag; on a
        real node it is far shorter than a period, so a stop always lands inside the lag."""
        await self.stop()
        self.report(force=True)
        try:
            yield
        finally:
            self.start(phase=self.period)


class Scheduler:
    """kube-scheduler for one node and one resource (module doc)."""

    def __init__(
        self,
        api: FakeApiServer,
        kubelet: PodKubelet,
        resource: str,
        driver: str,
        *,
        rng: random.Random,
        bind_delay: float,
    ) -> None:
        self._api, self._kubelet, self._resource, self._driver = api, kubelet, resource, driver
        self._rng, self._bind_delay = rng, bind_delay
        #: kube-scheduler's DRAExtendedResource gate.
        self.extended_resource = True
        self._queue: list[Pod] = []
        self._wake = asyncio.Event()
        self._taken: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        api.listeners.append(lambda resource: self._wake.set() if resource in ("nodes", "resourceslices") else None)

    def submit(self, pod: Pod) -> None:
        self._queue.append(pod)
        self._wake.set()

    def release(self, device: str) -> None:
        self._taken.discard(device)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _path(self) -> tuple[str, str] | None:
        """The path a pod takes on the node now, and for DRA the free device it gets (None: no fit)."""
        node = self._api.nodes[self._api.node_name]
        if (node.get("spec") or {}).get("unschedulable"):
            return None
        allocatable = int(((node.get("status") or {}).get("allocatable") or {}).get(self._resource, "0"))
        if allocatable > 0:
            return ("device-plugin", "")
        if not self.extended_resource or not self._mapped():
            return None  # Insufficient ate.dev/kvm
        for piece in self._api.node_slices():
            if piece["spec"]["driver"] != self._driver:
                continue
            for device in piece["spec"].get("devices") or []:
                if device["name"] not in self._taken:
                    return ("dra", device["name"])
        return None

    def _mapped(self) -> bool:
        """A stored DeviceClass maps the resource (the API server keeps the field only with its gate on)."""
        return any(
            kind == "DeviceClass" and (obj.get("spec") or {}).get("extendedResourceName") == self._resource
            for (kind, _, _), obj in self._api.objects.items()
        )

    def start(self) -> None:
        async def run() -> None:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue and (chosen := self._path()) is not None:
                    pod = self._queue.pop(0)
                    if pod.deleted:
                        pod.gone = True
                        continue
                    pod.path, pod.device = chosen
                    if pod.device:
                        self._taken.add(pod.device)
                    asyncio.get_running_loop().call_later(
                        self._rng.uniform(0, self._bind_delay), self._kubelet.bound, pod
                    )

        self._task = asyncio.get_running_loop().create_task(run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class PodKubelet:
    """kubelet's pod side on the node (module doc)."""

    def __init__(
        self,
        api: FakeApiServer,
        dp: FakeKubelet,
        dra: FakeDraKubelet,
        resource: str,
        *,
        driver: str,
        pool: str,
        sync: float,
        endpoint_grace: float,
    ) -> None:
        self._api, self._dp, self._dra = api, dp, dra
        self._resource, self._driver, self._pool = resource, driver, pool
        self._sync, self._grace = sync, endpoint_grace
        #: kubelet's device-manager checkpoint: resources with a device-plugin allocation recorded.
        self.checkpoint: set[str] = set()
        self.scheduler: Scheduler | None = None
        #: kubelet's DRAExtendedResource gate.
        self.extended_resource = True
        self._held: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()
        self._stopping = False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _put(self, pod: Pod, *, ready: bool = False) -> None:
        status: dict[str, Any] = {"phase": pod.phase, "reason": pod.reason}
        if ready:
            status["conditions"] = [{"type": "PodReadyToStartContainers", "status": "True"}]
        if pod.uid:
            status["extendedResourceClaimStatus"] = {"resourceClaimName": pod.name + "-claim"}
        container = {"name": "vm", "resources": {"requests": {self._resource: "1"}, "limits": {self._resource: "1"}}}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"namespace": "default", "name": pod.name},
            "spec": {"nodeName": self._api.node_name, "containers": [container]},
            "status": status,
        }
        if pod.deleted:
            body["metadata"]["deletionTimestamp"] = "now"
        self._api.put_pod(body)
        self.changed.set()

    def bound(self, pod: Pod) -> None:
        """The scheduler's binding arrived: the pod is the node's now (unless deleted meanwhile)."""
        if pod.gone:
            return
        if pod.path == "dra":
            result = {"request": "kvm", "driver": self._driver, "pool": self._pool, "device": pod.device}
            pod.uid = self._api.add_claim("default", pod.name + "-claim", [result])
        self._put(pod)
        self._spawn(self._admit(pod))

    def _endpoint_in_cache(self) -> bool:
        """Whether the device manager has an endpoint for the resource: registered now, or stopped less
        than the grace ago."""
        if self._resource in self._dp.endpoints:
            return True
        ended = [
            e.t for e in self._dp.history if e.resource == self._resource and e.kind in ("stream-ended", "disconnected")
        ]
        return bool(ended) and time.monotonic() - ended[-1] < self._grace

    def hold_admission(self) -> None:
        """Pods bound from now on wait before their admission until ``release_admission()`` (kubelet busy)."""
        self._held = asyncio.Event()

    def release_admission(self) -> None:
        if self._held is not None:
            self._held.set()
        self._held = None

    async def _admit(self, pod: Pod) -> None:
        if self._held is not None:
            await self._held.wait()
        if pod.path == "dra" and not self.extended_resource:  # taken for the device plugin's, whose units are withheld
            return self._fail(pod, "UnexpectedAdmissionError: Allocate failed due to no healthy devices present")
        if pod.path == "device-plugin":
            if self._dp.allocatable(self._resource) < 1:
                return self._fail(pod, "UnexpectedAdmissionError: Allocate failed due to no healthy devices present")
            endpoint = self._dp.endpoints[self._resource]
            healthy = [d.ID for d in endpoint.latest.devices if d.health == "Healthy"] if endpoint.latest else []
            try:
                await self._dp.allocate(self._resource, [random.choice(healthy)])
            except grpc.aio.AioRpcError as exc:
                return self._fail(pod, f"UnexpectedAdmissionError: {exc.details()}")
            self.checkpoint.add(self._resource)
            return self._run(pod)
        while not pod.deleted:
            error = await self._prepare(pod)
            if not error:
                self._put(pod, ready=True)  # the sandbox is made; then the container
                if self._resource in self.checkpoint and not self._endpoint_in_cache():
                    error = (
                        "CreateContainerConfigError: endpoint not found in cache for a registered resource: "
                        + self._resource
                    )
                else:
                    return self._run(pod)
            pod.reason = error
            if error.startswith("FailedPrepareDynamicResources"):
                pod.prepare_failures.append(error)
            await asyncio.sleep(self._sync)  # kubelet's next pod sync

    async def _prepare(self, pod: Pod) -> str:
        if self._driver not in self._dra.plugins:
            return f"FailedPrepareDynamicResources: DRA driver {self._driver} is not registered"
        try:
            response = await self._dra.prepare(self._driver, ("default", pod.uid, pod.name + "-claim"))
        except grpc.aio.AioRpcError as exc:
            return f"FailedPrepareDynamicResources: {exc.details()}"
        except asyncio.CancelledError:
            self._cancelled()
            return "FailedPrepareDynamicResources: the driver's connection closed"
        error = response.claims[pod.uid].error
        return f"FailedPrepareDynamicResources: {error}" if error else ""

    def _fail(self, pod: Pod, reason: str) -> None:
        pod.phase, pod.reason = "Failed", reason
        self._put(pod)

    def _run(self, pod: Pod) -> None:
        pod.phase, pod.reason, pod.started = "Running", "", time.monotonic()
        self._put(pod, ready=True)
        if pod.lifetime is not None:
            asyncio.get_running_loop().call_later(pod.lifetime, self.delete, pod)

    def delete(self, pod: Pod) -> None:
        """The pod deleted: its containers stop, then (DRA) its claim is unprepared, then it is gone."""
        if pod.deleted:
            return
        pod.deleted = True
        if pod.path == "":
            return  # never scheduled: the scheduler's queue forgets it
        self._spawn(self._remove(pod))

    async def _remove(self, pod: Pod) -> None:
        while pod.path == "dra" and pod.uid:
            if self._driver in self._dra.plugins:
                try:
                    response = await self._dra.unprepare(self._driver, ("default", pod.uid, pod.name + "-claim"))
                    if not response.claims[pod.uid].error:
                        break
                except grpc.aio.AioRpcError:
                    pass
                except asyncio.CancelledError:
                    self._cancelled()
            pod.reason = f"unprepare dynamic resources: DRA driver {self._driver} is not registered"
            await asyncio.sleep(self._sync)
        if pod.device and self.scheduler is not None:
            self.scheduler.release(pod.device)
        pod.gone = True
        self._api.remove_pod("default", pod.name)
        self.changed.set()

    def _cancelled(self) -> None:
        """A call ended by the fake DRA kubelet closing the driver's channel (a new registration): grpc.aio
        raises CancelledError for it; kubelet retries. Our own stop is a cancel to pass on."""
        if self._stopping:
            raise asyncio.CancelledError

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
