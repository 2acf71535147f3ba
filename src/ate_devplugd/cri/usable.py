"""Advertised means usable: a device a sandbox on this node could not use now is withheld.

``decide`` says, for one configured device, whether a pod granted it now would get a working device,
from what the daemon knows of the path to the container (no I/O): the runtime's verdict
(``cri.check.RuntimeCheck``), the spec files of the directories it reads (``cri.conflicts.SpecCheck``),
whether our spec is on disk, and how much the device needs CDI (``need``):

- ``cdi = false``: the DeviceSpec is its only path; nothing here withholds it.
- ``cdi = true``: a runtime that applies CDI but cannot resolve our name to our spec (another spec of the
  same directory defines it, a later directory's spec replaces it, ours is refused or missing) fails the
  container or hands it another device: withheld. A runtime that ignores CDI still grants the host's
  node through the DeviceSpec, which a root VMM opens, so only a table that gives the node an owner in
  the container (``container_uid`` or ``container_gid``: the user a VMM that is not root runs as) is
  withheld then. ``container_mode`` alone does not count: every table has one (0o666 when not given,
  and ``check-config`` writes it out), so it cannot tell a VMM that is not root.
- ``cdi = "required"``, and every device in DRA mode (CDI is DRA's only path): withheld whenever the
  runtime does not apply our names.

A runtime not answering, or one whose handling of CDI is not known (``unknown``), never withholds: the
daemon does not guess against a device that works.

``Usability`` applies the decisions (``Resource.withhold``): a change is applied once it has held for
``HOLD`` seconds, each way, so a runtime that flaps (or restarts: its socket gone for a moment) does not
flap the node; one loop timer per pending change, no polling. Each applied change is one event
(``device-withheld``, a warning with the reason and why; ``device-offered``, info).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport, consequence
from ate_devplugd.cri.rules import SpecProblem, Trouble
from ate_devplugd.node.cdi import spec_path
from ate_devplugd.node.devices import Resource, Withheld, Withholding

if TYPE_CHECKING:
    from ate_devplugd.node.watch import DeviceWatch

log = logging.getLogger(__name__)

#: How long a change must hold before it is applied (to withhold and to offer again).
HOLD = 0.5

#: Journal events: a device withheld (or withheld for another reason), and offered again.
EVENT_WITHHELD = "device-withheld"
EVENT_OFFERED = "device-offered"

#: Which spec problem withholds with which reason, the first found in this order.
_SPEC_REASONS = (
    (Trouble.CONFLICT, Withheld.SPEC_CONFLICT),
    (Trouble.REFUSED, Withheld.SPEC_INVALID),
    (Trouble.REPLACES, Withheld.SPEC_REPLACED),
)


class Need(enum.Enum):
    """How much a device needs its CDI names applied to be usable by a sandbox."""

    #: ``cdi = false``: the DeviceSpec is its path.
    NONE = "none"
    #: ``cdi = true`` without a container owner: a broken spec withholds, CDI off does not.
    SPEC = "spec"
    #: ``cdi = "required"``, a container owner (uid or gid), or DRA mode: CDI off withholds too.
    REQUIRED = "required"


def need(dev: DeviceConfig, mode: str) -> Need:
    if not dev.cdi:
        return Need.NONE
    own = dev.container_uid is not None or dev.container_gid is not None
    return Need.REQUIRED if dev.cdi_required or own or mode == "dra" else Need.SPEC


def decide(  # noqa: PLR0911 - one return per finding
    dev: DeviceConfig,
    mode: str,
    report: RuntimeReport | None,
    problems: Sequence[SpecProblem] = (),
    *,
    written: bool = True,
    on_disk: bool = True,
) -> Withholding | None:
    """The withholding ``dev`` calls for now, or None. ``written``: the daemon holds a spec for it (Allocate
    names its CDI device); ``on_disk``: that spec file is there."""
    needed = need(dev, mode)
    if needed is Need.NONE or report is None or report.verdict is CdiVerdict.UNKNOWN:
        return None
    if not written:  # Allocate names no CDI device: the container gets the DeviceSpec only
        if needed is Need.REQUIRED:
            return Withholding(Withheld.SPEC_MISSING, f"the CDI spec of {dev.resource} could not be written")
        return None
    if report.verdict is CdiVerdict.NOT_APPLIED:
        if needed is Need.REQUIRED:
            return Withholding(Withheld.CDI_NOT_APPLIED, f"{report.describe()}: {consequence(report.verdict, mode)}")
        return None
    if report.verdict is CdiVerdict.DIR_NOT_READ:
        return Withholding(Withheld.CDI_NOT_APPLIED, f"{report.describe()}: {consequence(report.verdict, mode)}")
    name = qualified_name(dev)
    mine = [p for p in problems if p.name == name]
    for trouble, reason in _SPEC_REASONS:
        found = next((p for p in mine if p.trouble is trouble), None)
        if found is not None:
            return Withholding(reason, found.describe())
    if not on_disk:
        why = f"{name} does not resolve (unresolvable CDI devices)"
        return Withholding(Withheld.SPEC_MISSING, f"our CDI spec for {dev.resource} is not on disk: {why}")
    return None


def verdict(report: RuntimeReport | None, problems: Sequence[SpecProblem], missing: bool = False) -> str | None:
    """The runtime's verdict on our CDI names for the metric: the runtime's own, or, where it applies CDI,
    what stops one of our names from resolving to our spec (``spec_conflict``, ``spec_invalid``,
    ``spec_replaced``, ``spec_missing``). None while nothing is checked."""
    if report is None:
        return None
    if report.verdict is CdiVerdict.APPLIED:
        for trouble, reason in _SPEC_REASONS:
            if any(p.trouble is trouble for p in problems):
                return reason.value.replace("-", "_")
        if missing:
            return Withheld.SPEC_MISSING.value.replace("-", "_")
    return report.verdict.value


#: The values of the metric's ``verdict`` label: the runtime's verdicts, then the spec problems.
VERDICTS = (
    *(v.value for v in CdiVerdict),
    *(r.value.replace("-", "_") for r in (Withheld.SPEC_CONFLICT, Withheld.SPEC_INVALID, Withheld.SPEC_REPLACED)),
    Withheld.SPEC_MISSING.value.replace("-", "_"),
)


class Usability:
    """The daemon's decisions applied, each once it has held for ``HOLD``: see the module's docstring.
    ``on_change(resource, event)`` hears a resource after its withholding changed (the mode, its gauges and
    STATUS follow it); ``on_verdict(verdict, runtime)`` hears the verdict on our names at each update
    (``verdict``: for the metric)."""

    def __init__(
        self,
        on_change: Callable[[Resource, str | None], None],
        on_verdict: Callable[[str | None, str], None],
        hold: float = HOLD,
    ) -> None:
        self._on_change = on_change
        self._on_verdict = on_verdict
        self._hold = hold
        self._pending: dict[str, tuple[Withholding | None, asyncio.TimerHandle]] = {}

    def update(
        self,
        devices: DeviceWatch | None,
        config: Config,
        report: RuntimeReport | None,
        problems: Sequence[SpecProblem],
    ) -> None:
        """Decide each resource again; a decision that differs from what is applied is applied after
        ``HOLD`` unless it changes again before (a pending one that no longer differs is dropped)."""
        resources = devices.registry.resources if devices is not None else {}
        missing = False
        for resource in resources.values():
            dev = resource.config
            seen = resource.presence.devnum is not None or resource.cdi_device is not None
            written = resource.cdi_device is not None or not seen
            on_disk = not (dev.cdi and written and seen) or os.path.exists(spec_path(config.cdi_dir, dev))
            missing = missing or not on_disk
            self._want(resource, decide(dev, config.mode, report, problems, written=written, on_disk=on_disk))
        for name in set(self._pending) - set(resources):
            self._pending.pop(name)[1].cancel()
        self._on_verdict(verdict(report, problems, missing), report.runtime if report is not None else "")

    def _want(self, resource: Resource, target: Withholding | None) -> None:
        pending = self._pending.get(resource.name)
        if pending is not None and pending[0] == target:
            return
        if pending is not None:
            pending[1].cancel()
            del self._pending[resource.name]
        if target != resource.withheld:
            handle = asyncio.get_running_loop().call_later(self._hold, self._apply, resource, target)
            self._pending[resource.name] = (target, handle)

    def _apply(self, resource: Resource, target: Withholding | None) -> None:
        del self._pending[resource.name]
        before = resource.withheld
        resource.withhold(target)
        if target is None:
            assert before is not None
            resource.events.info(
                EVENT_OFFERED, "%s is offered again (it was withheld: %s)", resource.name, before.reason.value
            )
        else:
            resource.events.warning(
                EVENT_WITHHELD,
                "%s is withheld (%s): %s; its units are not offered while a pod granted one would not get it",
                resource.name,
                target.reason.value,
                target.detail,
            )
        self._on_change(resource, EVENT_OFFERED if target is None else EVENT_WITHHELD)

    def close(self) -> None:
        for _, handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
