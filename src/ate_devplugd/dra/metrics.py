"""DRA mode's own metrics, and the shared per-resource counters its events stand for.

DRA mode has no Register, Allocate or ListAndWatch; what an operator of it watches is kubelet's
prepares and unprepares, the slice writes and the API server. This module keeps those series
(``ate_devplugd_dra_*``) and renders them after the daemon's own (``Metrics.add_source``), and turns
DRA's events into the shared counters that mean the same in both modes: a claim prepared with a
device of a resource is an allocation of it, and kubelet's registration notice a registration (or a
failed one). The shared gauges (registered, advertised and healthy units) are state, set by
``mode.DraMode`` from the driver's status.

Every series exists from the start, counters at 0 for each label value they can take, so the first
error shows in ``increase()``; all label values are enums: ``ClaimProblem`` here (``prepare`` raises
it), ``PublishReason`` from ``slice_plan`` (the plan decides it). This module sits below ``prepare`` and
``slices``, which feed it, and imports neither.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from ate_devplugd.config.dra import Layout
from ate_devplugd.dra.apiclient import ApiErrorKind
from ate_devplugd.dra.slice_plan import PublishReason
from ate_devplugd.signals.promtext import Family

if TYPE_CHECKING:
    from ate_devplugd.signals.metrics import Metrics

PREFIX = "ate_devplugd_dra_"
#: Upper bounds (seconds) of the prepare latency histogram: kubelet measures 25-30 ms for a prepare of
#: this driver, and gives each call 45 s.
PREPARE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 45.0)


#: The ``sharing`` label while the layout follows the cluster and the API server has not told it yet.
UNDECIDED = "undecided"


class ClaimProblem(enum.Enum):
    """Why a claim could not be prepared (the ``reason`` of the prepare error counter; ``prepare`` says it)."""

    NOT_FOUND = "not_found"
    NOT_ALLOCATED = "not_allocated"
    UID_MISMATCH = "uid_mismatch"
    API = "api_error"  # the claim could not be read: no connection yet, refused, unreachable
    UNKNOWN_DEVICE = "unknown_device"  # a pool or device this node does not serve
    DEVICE_ABSENT = "device_absent"


class DraMetrics:
    """Counts DRA mode's events; ``shared`` (the daemon's Metrics, if any) gets the shared counters."""

    def __init__(
        self, driver: str, sharing: Layout | None, resources: Sequence[str] = (), shared: Metrics | None = None
    ) -> None:
        self.driver = driver
        #: The layout, None until it is decided (where the config leaves it to the cluster).
        self.sharing = sharing
        self.resources = tuple(resources)
        self._shared = shared
        #: Called after each change (the daemon's Metrics sets it when the source is added).
        self.on_change: Callable[[], None] | None = None
        self.prepares = 0
        self.unprepares = 0
        self.prepare_errors = dict.fromkeys(ClaimProblem, 0)
        self.publishes = {(r, reason): 0 for r in self.resources for reason in PublishReason}
        self.api_errors = dict.fromkeys(ApiErrorKind, 0)
        self._prepare_buckets = [0] * len(PREPARE_BUCKETS)
        self._prepare_calls = 0
        self._prepare_seconds = 0.0
        #: Whether the API server refuses the daemon's credentials (401) now.
        self.refused = False

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- events ----------------------------------------------------------------------------------------
    def claim_prepared(self, resources: Iterable[str]) -> None:
        """A claim prepared: one allocation of each resource it got a device of."""
        self.prepares += 1
        if self._shared is not None:
            for resource in sorted(set(resources)):
                self._shared.allocation(resource)
        self._changed()

    def claim_failed(self, problem: ClaimProblem) -> None:
        self.prepare_errors[problem] += 1
        self._changed()

    def prepare_call(self, seconds: float) -> None:
        """One NodePrepareResources call answered after ``seconds``."""
        self._prepare_calls += 1
        self._prepare_seconds += seconds
        for i, bound in enumerate(PREPARE_BUCKETS):
            if seconds <= bound:
                self._prepare_buckets[i] += 1
                break
        self._changed()

    def claims_unprepared(self, count: int) -> None:
        if count:
            self.unprepares += count
            self._changed()

    def slice_written(self, resource: str, reason: PublishReason) -> None:
        key = (resource, reason)
        self.publishes[key] = self.publishes.get(key, 0) + 1
        self._changed()

    def api_error(self, kind: ApiErrorKind) -> None:
        self.api_errors[kind] += 1
        self._changed()

    def credentials_refused(self, refused: bool) -> None:
        """The API server refuses the credentials (401, not in the moment after its start), or no longer."""
        if refused != self.refused:
            self.refused = refused
            self._changed()

    def layout_decided(self, layout: Layout) -> None:
        if layout is not self.sharing:
            self.sharing = layout
            self._changed()

    def registration(self, accepted: bool) -> None:
        """kubelet's notice: it took the driver (a registration of every resource) or refused it."""
        if self._shared is not None:
            for resource in self.resources:
                if accepted:
                    self._shared.registration(resource)
                else:
                    self._shared.register_failure(resource)

    # -- exposition ------------------------------------------------------------------------------------
    def families(self) -> Iterator[Family]:
        info = Family.gauge(
            PREFIX + "info",
            "Always 1 in DRA mode; the driver name and its layout (sharing: units, shared, or undecided while "
            "the API server has not answered the start's question).",
            "driver",
            "sharing",
        )
        info.add_metric([self.driver, str(self.sharing) if self.sharing is not None else UNDECIDED], 1)
        yield info
        refused = Family.gauge(
            PREFIX + "credentials_refused",
            "1 while the API server refuses the daemon's credentials (401: an expired token, or one whose Node "
            "was deleted or created again).",
        )
        refused.add_metric([], 1 if self.refused else 0)
        yield refused
        for name, doc, labels, counts in (
            ("prepares", "Claims prepared for kubelet (NodePrepareResources).", (), {(): self.prepares}),
            ("unprepares", "Claims unprepared for kubelet (NodeUnprepareResources).", (), {(): self.unprepares}),
            (
                "prepare_errors",
                "Claims that could not be prepared, by reason.",
                ("reason",),
                {(problem.value,): count for problem, count in self.prepare_errors.items()},
            ),
            (
                "slice_publishes",
                "ResourceSlice writes, by resource and reason (created, republished, updated).",
                ("resource", "reason"),
                {(resource, reason.value): count for (resource, reason), count in self.publishes.items()},
            ),
            (
                "api_errors",
                "API server calls that failed, by what the server answered.",
                ("reason",),
                {(kind.value,): count for kind, count in self.api_errors.items()},
            ),
        ):
            family = Family.counter(PREFIX + name, doc, *labels)
            for values, count in counts.items():
                family.add_metric(values, count)
            yield family
        cumulative, buckets = 0, []
        for bound, count in zip(PREPARE_BUCKETS, self._prepare_buckets, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        buckets.append((math.inf, self._prepare_calls))
        yield Family.histogram(
            PREFIX + "prepare_duration_seconds",
            "Time to answer a NodePrepareResources call (every claim in it read from the API server).",
            buckets,
            self._prepare_seconds,
        )
