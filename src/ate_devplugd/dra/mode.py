"""DRA mode in the daemon: the registry's resources published through one ``DraDriver``.

It stands where device-plugin mode's sessions stand (``plugins.DevicePlugins``): the daemon starts it
once the CDI specs are written (DRA hands devices to containers only through CDI), tells it after each
look at a device whether the device is healthy, shows its status, and stops it. The set of resources
and the ``[dra]`` table are read at start; a reload applies the device tables (their CDI specs, and
the CDI device a claim is prepared with) and says that a changed resource set takes a restart.

It also keeps the daemon's per-resource gauges true for DRA mode, from state, after each look and each
status change of the driver: registered = kubelet holds the driver's registration; advertised units =
the devices in the resource's published slice (healthy units the same, while the device is healthy).
DRA's own series come from ``dra.metrics.DraMetrics``, rendered with the daemon's.

kubelet registers the driver once and says nothing when it stops: ``dra.presence.KubeletPresence``
follows the kubelet that registered it (its process, its kubelet.sock in the daemon's watched plugin
directory, its health stream), so STATUS and the registered gauge say "kubelet gone, not registered" when
it stops, and registered again when the next kubelet registers the driver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.device import qualified_name
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.config.pools import DraResource
from ate_devplugd.dra.driver import DraDriver, DraStatus, KubeletLink
from ate_devplugd.dra.metrics import DraMetrics
from ate_devplugd.dra.presence import KubeletPresence
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.node.devices import DeviceRegistry, Resource
from ate_devplugd.signals.metrics import Metrics

log = logging.getLogger(__name__)


class DraMode:
    """The DRA driver of this node, fed by the device registry."""

    def __init__(
        self,
        config: DraConfig,
        registry: DeviceRegistry,
        metrics: Metrics,
        on_state: Callable[[], None],
        watch: KubeletWatch | None = None,
        *,
        unprepare_only: bool = False,
    ) -> None:
        self._config = config
        #: Device-plugin mode's leftover-claims driver (``DraDriver``'s ``unprepare_only``): the gauges
        #: are device-plugin mode's then, and device health means nothing to it.
        self._unprepare_only = unprepare_only
        self._registry = registry
        self._metrics = metrics
        self._on_state = on_state
        #: The daemon's watch of the device-plugin directory: kubelet.sock there is kubelet's, in DRA mode too.
        self._watch = watch
        self._driver: DraDriver | None = None

    async def start(self, names: list[str] | tuple[str, ...]) -> None:
        """At start: serve kubelet's DRA plugin API for these resources and publish them. Later: a reload."""
        if self._driver is not None:
            if names and not self._unprepare_only:
                EventLog(log).error(
                    "reload-failed",
                    "DRA mode publishes its resources as they were at start: %s takes a restart",
                    ", ".join(names),
                )
            return
        resources = [self._registry.resources[name] for name in names]
        offered = [DraResource(r.name, qualified_name(r.config)) for r in resources]
        dra_metrics = DraMetrics(self._config.driver, self._config.sharing, names, shared=self._metrics)
        follower = KubeletPresence(self._watch, self._kubelet_hint) if self._watch is not None else None
        self._driver = DraDriver(
            self._config,
            offered,
            on_status=self._status_changed,
            metrics=dra_metrics,
            kubelet=follower,
            unprepare_only=self._unprepare_only,
        )
        if not self._unprepare_only:
            self._metrics.add_source(dra_metrics)
        for resource in resources:
            self.looked(resource)
        await self._driver.start()

    async def stop(self, names: list[str] | tuple[str, ...] | None = None) -> None:
        """Stop serving (both sockets gone); a reload that removes resources takes a restart."""
        if names is None and self._driver is not None:
            await self._driver.stop()
        elif names and not self._unprepare_only:
            EventLog(log).error(
                "reload-failed",
                "DRA mode publishes its resources as they were at start: removing %s takes a restart",
                ", ".join(names),
            )

    def looked(self, resource: Resource) -> None:
        """After a look at a device (its CDI spec written just before): claims get the CDI device its
        table names now (a reload may change the node's name), and its devices are withdrawn from the
        slice while it is not usable (unhealthy, or withheld: ``cri.usable``)."""
        if self._unprepare_only:
            return
        if self._driver is not None and resource.name in self._driver.publisher.present:
            self._driver.set_cdi_id(resource.name, qualified_name(resource.config))
            self._driver.set_health(resource.name, resource.usable, resource.unusable_reason)
        self._update_metrics()

    def _kubelet_hint(self) -> None:
        if self._driver is not None:
            self._driver.kubelet_changed()

    def status_line(self) -> str:
        if self._driver is None:
            return "dra: starting"
        if self._unprepare_only:
            return str(self._driver.status())
        resources = self._registry.resources.values()
        withheld = [f"{r.name}: withheld: {r.withheld.reason.value}" for r in resources if r.withheld is not None]
        return " | ".join([str(self._driver.status()), *withheld])

    def _status_changed(self, status: DraStatus) -> None:
        if not self._unprepare_only:
            self._update_metrics()
        self._on_state()

    def _update_metrics(self) -> None:
        """The shared gauges from the registry and the driver's state (see the module doc)."""
        driver = self._driver
        published = driver.publisher.published if driver is not None else {}
        registered = driver is not None and driver.kubelet is KubeletLink.REGISTERED
        for name, resource in self._registry.resources.items():
            self._metrics.set_device(
                name,
                present=resource.presence.present,
                healthy=resource.healthy,
                advertised_units=published.get(name, 0),
                withheld=resource.withheld,
            )
            self._metrics.set_registered(name, registered and name in published)
