"""The daemon's metrics: what it counts, kept on its event loop, and the families they render as.

node_exporter's textfile collector publishes them (``signals.textfile.TextfileWriter`` writes the file); the
daemon opens no port. Every call here is made from the daemon's one asyncio loop: plain attribute
updates, no locks. ``on_change(prompt)`` is called after each call that changed a value (a counter always
changes; a gauge set to the value it has does not), so an idle daemon causes no write; ``prompt`` is
True for a change of state (a resource's gauges, the runtime's verdict, the series present), which the
file then shows sooner than a count.

Series exist per configured resource, from ``add_resource`` until ``remove_resource``. Calls naming a
resource that is not (or no longer) there are ignored, so a late callback from a stopped server
cannot bring back the series of a resource that left the config. The mode in use sets the device
gauges (what kubelet is offered differs by mode); a mode's own series (DRA mode's) are rendered after
these through ``add_source``.

The file is rendered in the text format 0.0.4 (``signals.promtext.exposition``) from the ``Family`` values
``Metrics.families`` builds on each render: one family per metric, a resource's samples there (at
zero) from the moment it is added and gone with it. A new series is one more ``Family`` in
``families``, with ``add_metric`` per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from ate_devplugd import __version__
from ate_devplugd.node.devices import Withheld, Withholding

if TYPE_CHECKING:
    from ate_devplugd.cri.facts import CdiVerdict
    from ate_devplugd.signals.promtext import Family

PREFIX = "ate_devplugd_"

#: The canonical gRPC status code names: the only values of the ``code`` label.
GRPC_CODES = frozenset(
    {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)
#: The codes Allocate answers with; their series start at 0, so the first error shows in increase().
ALLOCATE_ERROR_CODES = ("INVALID_ARGUMENT", "FAILED_PRECONDITION")


class MetricSource(Protocol):
    """A mode's own series (DRA mode's ``dra.metrics.DraMetrics``), rendered after the daemon's."""

    on_change: Callable[[], None] | None

    def families(self) -> Iterator[Family]: ...


class _Resource:
    """What the metrics hold of one resource (a plain class: made at start, a dataclass would cost its
    generated methods' compilation at every start)."""

    __slots__ = (
        "advertised_units",
        "allocate_errors",
        "allocations",
        "cdi_spec_rewrites",
        "health_transitions",
        "healthy",
        "looked",
        "present",
        "register_failures",
        "registered",
        "registrations",
        "reregistrations",
        "streams",
        "withheld",
    )

    def __init__(self) -> None:
        self.looked = False
        self.present = False
        self.healthy = False
        self.advertised_units = 0
        self.registered = False
        self.streams = 0
        self.registrations = 0
        self.register_failures = 0
        self.reregistrations = 0
        self.cdi_spec_rewrites = 0
        self.allocations = 0
        self.allocate_errors: dict[str, int] = dict.fromkeys(ALLOCATE_ERROR_CODES, 0)
        self.health_transitions = 0
        #: Why the device is withheld (``cri.usable``), None while it is not.
        self.withheld: Withheld | None = None


def _usable(r: _Resource) -> int:
    return int(r.healthy and r.withheld is None)


# (name without prefix, help, value) for the per-resource gauges and counters.
_GAUGES: tuple[tuple[str, str, Callable[[_Resource], float]], ...] = (
    ("device_present", "1 if the resource's device node is present on the node.", lambda r: r.present),
    ("device_healthy", "1 if the device is present and passes its probe (its units are Healthy).", lambda r: r.healthy),
    ("advertised_units", "Units offered to kubelet (0 before the device was present).", lambda r: r.advertised_units),
    ("healthy_units", "Advertised units that are Healthy (usable).", lambda r: r.advertised_units * _usable(r)),
    ("device_usable", "1 if the device is healthy and not withheld: a pod granted it gets a working device.", _usable),
    (
        "registered",
        "1 while kubelet holds a registration of the resource's current server, watches it (a ListAndWatch "
        "stream open) and by its own word (pod-resources) offers every unit served Healthy (DRA mode: the driver "
        "registered and the resource published): 0 while kubelet offers none or fewer.",
        lambda r: r.registered,
    ),
    ("listandwatch_streams", "ListAndWatch streams kubelet holds open (1 while it watches).", lambda r: r.streams),
)  # fmt: skip
_COUNTERS: tuple[tuple[str, str, Callable[[_Resource], float]], ...] = (
    ("registrations", "Register calls kubelet accepted.", lambda r: r.registrations),
    ("register_failures", "Register calls that failed (each is retried).", lambda r: r.register_failures),
    (
        "reregistrations",
        "Registrations made again because kubelet, still running, had dropped the resource (its stream ended, "
        "or its word said another client took the name).",
        lambda r: r.reregistrations,
    ),
    (
        "cdi_spec_rewrites",
        "Times the resource's CDI spec was written back after it was removed, changed or made invalid on disk.",
        lambda r: r.cdi_spec_rewrites,
    ),
    ("allocations", "Allocate calls answered with a device.", lambda r: r.allocations),
    ("health_transitions", "Changes of the device between Healthy and Unhealthy.", lambda r: r.health_transitions),
)


class Metrics:
    """The daemon's metrics: per-resource state and counters, rendered on demand."""

    def __init__(self, version: str = __version__, on_change: Callable[[bool], None] | None = None) -> None:
        self.version = version
        self.on_change = on_change
        self._resources: dict[str, _Resource] = {}
        self.kubelet_restarts = 0
        self.reloads = 0
        self.reload_failures = 0
        #: The verdict on our CDI names (``cri.usable.verdict``) and the runtime (``containerd 1.7.24``);
        #: None while nothing is checked.
        self._runtime_cdi: tuple[str, str] | None = None
        self._sources: list[MetricSource] = []

    def _changed(self, prompt: bool = False) -> None:
        """A value changed; ``prompt`` for a change of state (not a count), which the file shows sooner."""
        if self.on_change is not None:
            self.on_change(prompt)

    @property
    def resources(self) -> tuple[str, ...]:
        return tuple(self._resources)

    def served(self) -> Iterator[tuple[str, int, int, bool, str]]:
        """Each resource as kubelet is offered it: name, units, units Healthy, registered, withheld reason."""
        for name, r in self._resources.items():
            withheld = r.withheld.value if r.withheld is not None else ""
            yield name, r.advertised_units, r.advertised_units * _usable(r), r.registered, withheld

    # -- resources ---------------------------------------------------------------------------------
    def add_resource(self, resource: str) -> None:
        """Create the resource's series (all zero); no-op if it has them."""
        if resource not in self._resources:
            self._resources[resource] = _Resource()
            self._changed(prompt=True)

    def remove_resource(self, resource: str) -> None:
        """Drop every series of a resource that left the config."""
        if self._resources.pop(resource, None) is not None:
            self._changed(prompt=True)

    def add_source(self, source: MetricSource) -> None:
        """Render ``source``'s series after ours; its changes count as ours (``on_change``)."""
        self._sources.append(source)
        source.on_change = self._changed
        self._changed()

    # -- state -------------------------------------------------------------------------------------
    def set_device(
        self, resource: str, *, present: bool, healthy: bool, advertised_units: int, withheld: Withholding | None = None
    ) -> None:
        """The device's state after a look (or a change of its withholding, ``cri.usable``); healthy units
        are the advertised ones while usable. A change of health after the first look counts as a health
        transition."""
        r = self._resources.get(resource)
        new = (present, healthy and present, advertised_units, withheld.reason if withheld is not None else None)
        if r is None or ((r.present, r.healthy, r.advertised_units, r.withheld) == new and r.looked):
            return
        if r.looked and r.healthy != new[1]:
            r.health_transitions += 1
        r.present, r.healthy, r.advertised_units, r.withheld = new
        r.looked = True
        self._changed(prompt=True)

    def set_registered(self, resource: str, registered: bool) -> None:
        r = self._resources.get(resource)
        if r is not None and r.registered != registered:
            r.registered = registered
            self._changed(prompt=True)

    def set_streams(self, resource: str, streams: int) -> None:
        """How many ListAndWatch streams kubelet has open on the resource's current server."""
        r = self._resources.get(resource)
        if r is not None and r.streams != streams:
            r.streams = streams
            self._changed(prompt=True)

    # -- counters ----------------------------------------------------------------------------------
    def registration(self, resource: str) -> None:
        self._count(resource, "registrations")

    def register_failure(self, resource: str) -> None:
        self._count(resource, "register_failures")

    def reregistration(self, resource: str) -> None:
        self._count(resource, "reregistrations")

    def cdi_spec_rewrite(self, resource: str) -> None:
        self._count(resource, "cdi_spec_rewrites")

    def allocation(self, resource: str) -> None:
        self._count(resource, "allocations")

    def allocate_error(self, resource: str, code: str) -> None:
        """An Allocate answered with an error; ``code`` is the gRPC status code's name (``INVALID_ARGUMENT``)."""
        r = self._resources.get(resource)
        if r is not None:
            key = code if code in GRPC_CODES else "UNKNOWN"
            r.allocate_errors[key] = r.allocate_errors.get(key, 0) + 1
            self._changed()

    def _count(self, resource: str, attr: str) -> None:
        r = self._resources.get(resource)
        if r is not None:
            setattr(r, attr, getattr(r, attr) + 1)
            self._changed()

    def kubelet_restart(self) -> None:
        self.kubelet_restarts += 1
        self._changed()

    def reload(self) -> None:
        self.reloads += 1
        self._changed()

    def reload_failed(self) -> None:
        self.reload_failures += 1
        self._changed()

    def set_runtime_cdi(self, verdict: CdiVerdict | str | None, runtime: str = "") -> None:
        """What becomes of our CDI names (one of ``cri.usable.VERDICTS``; None: not checked, no series)."""
        new = None if verdict is None else (verdict if isinstance(verdict, str) else verdict.value, runtime)
        if new != self._runtime_cdi:
            self._runtime_cdi = new
            self._changed(prompt=True)

    # -- exposition ---------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The metrics in the Prometheus text format (version 0.0.4), as node_exporter reads them."""
        from ate_devplugd.signals.promtext import exposition  # noqa: PLC0415 - the text format only once the file is written (after READY; never with metrics off)

        return exposition(self.families())

    def families(self) -> Iterator[Family]:
        from ate_devplugd.signals.promtext import Family  # noqa: PLC0415 - the text format only once the file is written (after READY; never with metrics off)

        res = self._resources
        info = Family.gauge(PREFIX + "build_info", "Always 1; the daemon's version.", "version")
        info.add_metric([self.version], 1)
        yield info
        for name, doc, value in _GAUGES:
            gauge = Family.gauge(PREFIX + name, doc, "resource")
            for resource, r in res.items():
                gauge.add_metric([resource], value(r))
            yield gauge
        for name, doc, value in _COUNTERS:
            counter = Family.counter(PREFIX + name, doc, "resource")
            for resource, r in res.items():
                counter.add_metric([resource], value(r))
            yield counter
        errors = Family.counter(
            PREFIX + "allocate_errors",
            "Allocate calls answered with an error, by gRPC status code.",
            "resource",
            "code",
        )
        for resource, r in res.items():
            for code, count in sorted(r.allocate_errors.items()):
                errors.add_metric([resource, code], count)
        yield errors
        withheld = Family.gauge(
            PREFIX + "device_withheld",
            "1 for the reason the healthy device is withheld (not offered: a pod granted it would not get "
            "a working device), 0 for the others.",
            "resource",
            "reason",
        )
        for resource, r in res.items():
            for reason in Withheld:
                withheld.add_metric([resource, reason.value], int(r.withheld is reason))
        yield withheld
        for name, doc, count in (
            ("kubelet_restarts", "kubelet starts seen by the daemon (a new kubelet.sock).", self.kubelet_restarts),
            ("reloads", "Config reloads applied.", self.reloads),
            ("reload_failures", "Config reloads refused (the running config stayed).", self.reload_failures),
        ):  # fmt: skip
            family = Family.counter(PREFIX + name, doc)
            family.add_metric([], count)
            yield family
        if self._runtime_cdi is not None:
            from ate_devplugd.cri.usable import VERDICTS  # noqa: PLC0415 - the CRI modules only where a resource has CDI

            current, runtime = self._runtime_cdi
            cdi = Family.gauge(
                PREFIX + "runtime_cdi",
                "1 for what becomes of the daemon's CDI names (the runtime's verdict, or a spec_* problem that "
                "stops one resolving to our spec where it applies CDI), 0 for the other verdicts.",
                "verdict",
                "runtime",
            )
            for verdict in VERDICTS:
                cdi.add_metric([verdict, runtime], int(verdict == current))
            yield cdi
        for source in self._sources:
            yield from source.families()
