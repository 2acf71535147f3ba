"""DraDriver: DRA mode's entry point for the daemon.

The daemon, in this order: writes the CDI spec of each resource (its CDI device IDs are inputs here),
builds a DraDriver, awaits ``start()`` (DRAPlugin on dra.sock, then the registration socket, then the
slice publisher), calls ``set_health()`` whenever a device node vanishes or returns, shows ``status()``
in STATUS=, and awaits ``stop()`` on the way out (both sockets removed, the publisher cancelled; the
slices stay, as kubelet removes them itself after 30 s without a driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from ate_devplugd._pb.dra.v1 import api_pb2_grpc as v1_grpc
from ate_devplugd._pb.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from ate_devplugd._pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import ConfigError
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import DraResource, build_pools, devices_text
from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.layout import LayoutChoice
from ate_devplugd.dra.metrics import DraMetrics
from ate_devplugd.dra.prepare import Preparer
from ate_devplugd.dra.presence import Presence
from ate_devplugd.dra.service import DraPluginV1, DraPluginV1beta1, DraServer, HealthServicer, RegistrationServicer
from ate_devplugd.dra.slices import SlicePublisher, SliceState

log = logging.getLogger(__name__)

#: How long a stop waits for the prepares already accepted (kubelet gives each 45 s).
PREPARE_GRACE = 5.0


#: What a driver serving unprepare only says (STATUS, and each prepare it refuses).
UNPREPARE_ONLY = "unprepare only (device-plugin mode: claims left on the node can be unprepared, none prepared)"


class KubeletLink(enum.Enum):
    """Where the driver stands with kubelet: whether a kubelet holds its registration (STATUS= says it)."""

    STOPPED = "stopped"
    #: Serving, and no kubelet has registered the driver yet (or a new kubelet has not yet).
    WAITING = "waiting for kubelet"
    REGISTERED = "registered with kubelet"
    REFUSED = "kubelet refused the registration"
    #: The kubelet that registered the driver stopped: nothing holds the registration until one starts.
    GONE = "kubelet gone, not registered"


class KubeletFollower(Protocol):
    """Whether the kubelet that registered the driver is still there (``presence.KubeletPresence``)."""

    def start(self) -> None: ...

    def registered(self) -> None: ...

    def holds(self) -> Presence: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DraStatus:
    """DRA mode's state for STATUS=: enums and counts; ``detail`` only says why."""

    kubelet: KubeletLink
    slices: SliceState
    devices: int
    sharing_dropped: bool = False
    detail: str = ""
    #: The slices' layout (None: it follows the cluster, and the API server has not answered yet).
    layout: LayoutChoice | None = None
    #: Serving unprepare only (device-plugin mode: nothing published, every prepare refused).
    unprepare_only: bool = False

    def __str__(self) -> str:
        if self.unprepare_only:
            return f"dra: {UNPREPARE_ONLY}, {self.kubelet.value}"
        if self.slices is SliceState.PUBLISHED:
            slices = (
                f"slice published ({devices_text(self.devices)})"
                if self.devices
                else "slice published (no device offered)"
            )
            if self.layout is not None:  # what the slices hold; until they are published, their state says more
                slices += f", layout {self.layout}"
        else:
            slices = f"slices {self.slices.value}"
            if self.detail:
                slices += f": {self.detail}"
        text = f"dra: {self.kubelet.value}, {slices}"
        if self.sharing_dropped:
            text += ", shared device made exclusive by the API server (DRAConsumableCapacity off)"
        return text


class DraDriver:
    """Serves kubelet's DRA plugin API and publishes this node's ResourceSlices."""

    def __init__(
        self,
        config: DraConfig,
        resources: Sequence[DraResource],
        *,
        load_credentials: Callable[[str], kubeconfig.Credentials] = kubeconfig.load,
        backoff: tuple[float, float] = (0.5, 30.0),
        on_status: Callable[[DraStatus], None] | None = None,
        metrics: DraMetrics | None = None,
        kubelet: KubeletFollower | None = None,
        unprepare_only: bool = False,
    ) -> None:
        """``unprepare_only``: kubelet's plugin API is served and registered so that the claims of DRA pods
        left on a node now in device-plugin mode can be unprepared (kubelet deletes no such pod without a
        registered driver of the name); no slice is published and every prepare is refused."""
        pools, errors = build_pools(config, resources)
        if errors:
            raise ConfigError(errors)  # config.parse makes the same check: only a caller bypassing it gets here
        self.config = config
        self.pools = pools
        self._on_status = on_status
        self.metrics = metrics or DraMetrics(config.driver, config.sharing, [p.resource for p in pools])
        self.kubelet = KubeletLink.STOPPED
        self._kubelet_detail = ""
        #: Follows the kubelet that registered the driver (None: the registration is taken as it was told).
        self._follower = kubelet
        self._ever_registered = False
        self.publisher = SlicePublisher(
            config,
            pools,
            load_credentials=load_credentials,
            backoff=backoff,
            on_change=self._notify,
            metrics=self.metrics,
        )
        # Health covers both layouts' devices where the layout is the cluster's to decide: a restart may
        # change it while claims of the other are still allocated.
        either = pools if config.sharing else [*pools, *(p.laid_out(Layout.SHARED) for p in pools)]
        self.health = HealthServicer(either, lambda r: self.publisher.present.get(r, False), self.kubelet_changed)
        self.preparer = Preparer(config.driver, pools, self.publisher.files, self.publisher.present, self.metrics)
        self.unprepare_only = unprepare_only
        if unprepare_only:
            self.preparer.refusal = UNPREPARE_ONLY
        self._plugin = DraServer(config.plugin_socket, self._add_plugin_services)
        self._registration = DraServer(config.registration_socket, self._add_registration_service)
        self._publisher_task: asyncio.Task[None] | None = None

    def _add_plugin_services(self, server: grpc.aio.Server) -> None:
        v1_grpc.add_DRAPluginServicer_to_server(DraPluginV1(self.preparer), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(DraPluginV1beta1(self.preparer), server)
        health_grpc.add_DRAResourceHealthServicer_to_server(self.health, server)

    def _add_registration_service(self, server: grpc.aio.Server) -> None:
        servicer = RegistrationServicer(self.config.driver, self.config.plugin_socket, self._registration_status)
        reg_grpc.add_RegistrationServicer_to_server(servicer, server)

    async def start(self) -> None:
        """Serve dra.sock, then the registration socket (kubelet may call at once), then publish."""
        self.health.closed = False
        try:
            await self._plugin.start()
            await self._registration.start()
        except BaseException:
            await self._registration.stop(None)
            await self._plugin.stop(None)
            raise
        self.kubelet = KubeletLink.WAITING
        if self._follower is not None:
            self._follower.start()
        EventLog(log).info(
            "dra-serving",
            "dra: serving %s; registration socket %s",
            self.config.plugin_socket,
            self.config.registration_socket,
        )
        if not self.unprepare_only:
            self._publisher_task = asyncio.ensure_future(self.publisher.run())
        self._notify()

    def set_health(self, resource: str, healthy: bool, why: str = "") -> None:
        """``resource``'s device became unusable (False: its node vanished or fails its probe, or it is
        withheld, ``why``) or usable again (True).

        The pool's slice is written again without its devices (or with them), so the scheduler places
        no new claim on a device a pod could not use; prepared claims are left alone. kubelet's health
        stream (if open) hears it at once.
        """
        if resource not in self.publisher.present:
            raise KeyError(resource)
        if self.publisher.present[resource] == healthy:
            return
        EventLog(log, resource=resource).info(
            "dra-device-healthy" if healthy else "dra-device-unhealthy",
            "dra: %s is %s: its devices are %s",
            resource,
            "usable again" if healthy else f"not usable ({why or 'unhealthy'})",
            "published again" if healthy else "withdrawn from its slice",
        )
        self.publisher.set_present(resource, healthy)
        self.health.changed()
        self._notify()

    def set_cdi_id(self, resource: str, cdi_id: str) -> None:
        """The CDI device ``resource``'s spec defines now (a reload may rename it): claims get it from now on."""
        if self.preparer.set_cdi_id(resource, cdi_id):
            self.pools = [replace(p, cdi_id=cdi_id) if p.resource == resource else p for p in self.pools]
            log.info("dra: claims of %s are prepared with CDI device %s from now on", resource, cdi_id)

    def status(self) -> DraStatus:
        pub = self.publisher
        detail = self._kubelet_detail if self.kubelet is KubeletLink.REFUSED else pub.detail
        devices = sum(pub.published.values())
        return DraStatus(self.kubelet, pub.state, devices, pub.sharing_dropped, detail, pub.layout, self.unprepare_only)

    async def stop(self) -> None:
        """Stop the publisher and both servers; the sockets are gone when this returns. The registration
        socket goes first (kubelet sends no new call), the plugin server takes none from then on, and
        the prepares already accepted are answered before the health streams end."""
        task, self._publisher_task = self._publisher_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._registration.stop()
        stopping = asyncio.ensure_future(self._plugin.stop(PREPARE_GRACE))
        await asyncio.sleep(0)  # the server's shutdown begun: no new call
        await self.preparer.in_flight.idle(PREPARE_GRACE)
        self.health.close()
        await stopping
        await self.preparer.close()
        if self._follower is not None:
            self._follower.close()
        self.kubelet = KubeletLink.STOPPED
        self._notify()

    def kubelet_changed(self) -> None:
        """A hint that the kubelet which registered the driver may be gone (its process ended, it ended
        its health stream, its kubelet.sock went or came): look, and say so if it is no longer there.
        kubelet registers the driver again when it starts (``NotifyRegistrationStatus``)."""
        if self._follower is None or not self._ever_registered or self.kubelet is KubeletLink.STOPPED:
            return
        seen = self._follower.holds()
        if seen is Presence.HOLDS:
            return
        state = KubeletLink.GONE if seen is Presence.GONE else KubeletLink.WAITING
        if state is self.kubelet:
            return
        self.kubelet = state
        self._kubelet_detail = ""
        if state is KubeletLink.GONE:
            EventLog(log).info(
                "dra-kubelet-gone",
                "dra: kubelet is gone; %s is registered again when kubelet starts",
                self.config.driver,
            )
        else:
            EventLog(log).info(
                "dra-kubelet-restart", "dra: kubelet started again; waiting for it to register %s", self.config.driver
            )
        self._notify()

    def _registration_status(self, registered: bool, error: str) -> None:
        self.metrics.registration(registered)
        self._ever_registered = True
        if self._follower is not None:
            self._follower.registered()  # this kubelet, remembered and followed from now on
        if registered:
            self.kubelet = KubeletLink.REGISTERED
            self._kubelet_detail = ""
            EventLog(log).info("dra-registered", "dra: registered with kubelet as %s", self.config.driver)
        else:
            self.kubelet = KubeletLink.REFUSED
            self._kubelet_detail = error
            EventLog(log).error(
                "dra-register-failed", "dra: kubelet refused the registration of %s: %s", self.config.driver, error
            )
        self._notify()

    def _notify(self) -> None:
        if self._on_status is not None:
            self._on_status(self.status())
