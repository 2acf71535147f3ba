"""Advertised means usable: a device a sandbox on this node could not use now is withheld.

``decide`` says, for one configured device, whether a pod granted it now would get a working device,
from what the daemon knows of the path to the container (no I/O): the runtime's verdict
(``cri.check.RuntimeCheck``), the spec files of the directories it reads (``cri.conflicts.SpecCheck``),
whether our spec is on disk (or why it cannot be written), whether ``cdi_dir`` was replaced since the
runtime started, and how much the device needs CDI (``need``):

- ``cdi = false``: the DeviceSpec is its only path; nothing here withholds it.
- ``cdi = true``: a runtime that applies CDI but cannot resolve our name to our spec (another spec of the
  same directory defines it, a later directory's spec replaces it with a node the VMM cannot open, ours
  is refused or missing, the runtime does not read our directory or follows one that was replaced) fails
  the container or hands it another device: withheld. A runtime that ignores CDI, or one that tells
  nothing (``unknown``), still grants the host's node through the DeviceSpec, which a root VMM opens,
  so only a table that declares a VMM that is not root is withheld then (below).
- ``cdi = "required"``, a table that gives the node an owner in the container (``container_uid`` or
  ``container_gid``: the user a VMM that is not root runs as), and every device in DRA mode (CDI is DRA's
  only path): withheld whenever the runtime does not apply our names, and while nothing says it does
  (``unknown``: no runtime has answered since the start, or one whose handling of CDI is not known).
  ``container_mode`` alone does not count: every table has one (0o666 when not given, and
  ``check-config`` writes it out), so it cannot tell a VMM that is not root.

``Usability`` applies the decisions (``Resource.withhold``): a device is withheld the moment a decision
says so (or says another reason); only the way back to offered waits until the decision has held for
``HOLD`` seconds, so a runtime that flaps never offers the device in between. One loop timer per pending
offer, no polling. Each applied change is one event (``device-withheld``, a warning with the reason and
why; ``device-offered``, info).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import posixpath
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport, consequence
from ate_devplugd.cri.rules import DeviceNode, SpecProblem, Trouble
from ate_devplugd.node.cdispec import SpecState
from ate_devplugd.node.devices import Resource, Withheld, Withholding

if TYPE_CHECKING:
    from ate_devplugd.node.watch import DeviceWatch

log = logging.getLogger(__name__)

#: How long a decision to offer a withheld device again must hold before it is applied.
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
#: The reasons that are the spec's, not the runtime's: the ``spec_*`` values of the metric's verdict.
SPEC_WITHHELD = (
    Withheld.SPEC_DIR_REPLACED,
    Withheld.SPEC_CONFLICT,
    Withheld.SPEC_INVALID,
    Withheld.SPEC_REPLACED,
    Withheld.SPEC_MISSING,
)


class Need(enum.Enum):
    """How much a device needs its CDI names applied to be usable by a sandbox."""

    #: ``cdi = false``: the DeviceSpec is its path.
    NONE = "none"
    #: ``cdi = true`` without a container owner: a broken spec withholds, CDI off (or unknown) does not.
    SPEC = "spec"
    #: ``cdi = "required"``, a container owner (uid or gid), or DRA mode: CDI off or unknown withholds too.
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
    failure: str = "",
    dir_replaced: str = "",
    devnum: tuple[int, int] | None = None,
) -> Withholding | None:
    """The withholding ``dev`` calls for now, or None. ``report`` None: the runtime is not checked (no
    device uses CDI). ``written``: the daemon holds a spec for it (Allocate names its CDI device), else
    ``failure`` says why it cannot be written; ``on_disk``: that spec file is there; ``dir_replaced``: why
    the runtime follows another directory than ``cdi_dir`` ("" when it does not); ``devnum``: the host
    node's major:minor (a replacing spec's node is judged against it)."""
    needed = need(dev, mode)
    if needed is Need.NONE or report is None:
        return None
    if report.verdict is CdiVerdict.UNKNOWN:
        if needed is Need.REQUIRED:
            why = f"{report.describe()}: {qualified_name(dev)} works only where the runtime applies it"
            return Withholding(Withheld.CDI_UNKNOWN, why)
        return None
    if not written:  # Allocate names no CDI device: the container gets the DeviceSpec only
        if needed is Need.REQUIRED:
            cause = failure or "it could not be written"
            return Withholding(Withheld.SPEC_MISSING, f"the CDI spec of {dev.resource} is not on disk: {cause}")
        return None
    if report.verdict is CdiVerdict.NOT_APPLIED:
        if needed is Need.REQUIRED:
            return Withholding(Withheld.CDI_NOT_APPLIED, f"{report.describe()}: {consequence(report.verdict, mode)}")
        return None
    if report.verdict is CdiVerdict.DIR_NOT_READ:
        return Withholding(Withheld.DIR_NOT_READ, f"{report.describe()}: {consequence(report.verdict, mode)}")
    if dir_replaced:
        return Withholding(Withheld.SPEC_DIR_REPLACED, dir_replaced)
    found = spec_withholding(dev, problems, devnum)
    if found is None and not on_disk:
        why = f"{qualified_name(dev)} does not resolve (unresolvable CDI devices)"
        return Withholding(Withheld.SPEC_MISSING, f"our CDI spec for {dev.resource} is not on disk: {why}")
    return found


def spec_withholding(
    dev: DeviceConfig, problems: Sequence[SpecProblem], devnum: tuple[int, int] | None = None
) -> Withholding | None:
    """What the spec files do to our name where the runtime applies CDI: another spec of its directory
    defines it, ours is refused, or a later directory's replaces it with a node that does not serve the
    VMM (``replacement_unfit``); the first in that order, or None."""
    mine = [p for p in problems if p.name == qualified_name(dev)]
    for trouble, reason in _SPEC_REASONS:
        for found in (p for p in mine if p.trouble is trouble):
            if trouble is not Trouble.REPLACES:
                return Withholding(reason, found.describe())
            unfit = replacement_unfit(dev, found.nodes, devnum)
            if unfit:
                return Withholding(reason, f"{found.describe()} ({unfit})")
    return None


def replacement_unfit(  # noqa: PLR0911 - one return per way it falls short
    dev: DeviceConfig, nodes: Sequence[DeviceNode], devnum: tuple[int, int] | None
) -> str:
    """Why the node a replacing spec gives a container does not serve the VMM the table declares ("" when
    it does): it must be our device at our path, with our cgroup access, and a mode and owner that let the
    VMM open it. The VMM runs as the container's user, whom a runtime gives a node without ``uid`` (and
    ``gid``); a ``uid``/``gid`` in the node is the VMM's only where the table says the VMM is that user
    (``container_uid``/``container_gid``). The kernel then checks the owner's bits, else the group's, else
    the others'. A node without ``fileMode`` gets a mode that depends on the runtime: not counted on."""
    node = next((n for n in nodes if n.path == posixpath.normpath(dev.path)), None)
    if node is None:
        return f"it gives no node at {dev.path}"
    if node.major is not None or node.minor is not None:
        if devnum is None or (node.major, node.minor) != devnum:
            return f"its {dev.path} is {node.major}:{node.minor}, another device"
    elif posixpath.normpath(node.host_path or node.path) != posixpath.normpath(dev.path):
        return f"its {dev.path} is the host's {node.host_path}, another device"
    if node.type not in ("", "c"):
        return f"its {dev.path} is of type {node.type!r}, not a character device"
    if not set(dev.permissions) <= set(node.permissions or "rwm"):
        return f"its cgroup access {node.permissions} lacks the {dev.permissions} the table grants"
    if node.file_mode is None:
        return "it gives no fileMode, so the node's mode in the container depends on the runtime"
    vmm_owns = node.uid is None or node.uid == dev.container_uid
    vmm_group = node.gid is None or node.gid == dev.container_gid
    bits = (node.file_mode >> 6 if vmm_owns else node.file_mode >> 3 if vmm_group else node.file_mode) & 0o7
    wanted = (4 if "r" in dev.permissions else 0) | (2 if "w" in dev.permissions else 0)
    if bits & wanted != wanted:
        owner = f"{'-' if node.uid is None else node.uid}:{'-' if node.gid is None else node.gid}"
        return f"its node is mode {node.file_mode:04o} owned by {owner}, which the VMM cannot open"
    return ""


def verdict(report: RuntimeReport | None, reasons: Sequence[Withheld] = (), missing: bool = False) -> str | None:
    """The runtime's verdict on our CDI names for the metric: the runtime's own, or, where it applies CDI,
    what stops one of our names from resolving to our spec (the first of ``SPEC_WITHHELD`` among the
    decisions' ``reasons``; ``spec_missing`` also where a spec that is not on disk withholds nothing, as
    for a root VMM). None while nothing is checked."""
    if report is None:
        return None
    if report.verdict is CdiVerdict.APPLIED:
        found = next((r for r in SPEC_WITHHELD if r in reasons), Withheld.SPEC_MISSING if missing else None)
        if found is not None:
            return found.value.replace("-", "_")
    return report.verdict.value


#: The values of the metric's ``verdict`` label: the runtime's verdicts, then the spec problems.
VERDICTS = (*(v.value for v in CdiVerdict), *(r.value.replace("-", "_") for r in SPEC_WITHHELD))


class Usability:
    """The daemon's decisions applied: a withholding at once, an offer once it has held for ``HOLD`` (see
    the module's docstring). ``on_change(resource, event)`` hears a resource after its withholding changed
    (the mode, its gauges and STATUS follow it); ``on_verdict(verdict, runtime)`` hears the verdict on our
    names at each update (``verdict``: for the metric)."""

    def __init__(
        self,
        on_change: Callable[[Resource, str | None], None],
        on_verdict: Callable[[str | None, str], None],
        hold: float = HOLD,
    ) -> None:
        self._on_change = on_change
        self._on_verdict = on_verdict
        self._hold = hold
        self._pending: dict[str, asyncio.TimerHandle] = {}

    def update(
        self,
        devices: DeviceWatch | None,
        config: Config,
        report: RuntimeReport | None,
        problems: Sequence[SpecProblem],
    ) -> None:
        """Decide each resource again: a withholding that differs from the one applied is applied now; an
        offer after ``HOLD`` unless the decision changes before (a pending offer then is dropped)."""
        resources = devices.registry.resources if devices is not None else {}
        moved = devices.spec_dir_moved if devices is not None else None
        replaced = ""
        if moved is not None and report is not None and report.answered and (report.since or -1.0) < moved.at:
            replaced = f"{moved.detail}, after {report.runtime} started: {REPLACED_EFFECT}"
        decided: list[tuple[Resource, Withholding | None]] = []
        missing = False
        for resource in resources.values():
            dev = resource.config
            seen = resource.presence.devnum is not None or resource.cdi_device is not None
            failure = devices.spec_failure(resource.name) if devices is not None else ""
            written = resource.cdi_device is not None or (not seen and not failure)
            on_disk = not (dev.cdi and written and seen) or (
                devices is not None and devices.spec_state(resource.name) is SpecState.OURS
            )
            missing = missing or (dev.cdi and seen and (not on_disk or bool(failure)))
            target = decide(
                dev,
                config.mode,
                report,
                problems,
                written=written,
                on_disk=on_disk,
                failure=failure,
                dir_replaced=replaced,
                devnum=resource.presence.devnum,
            )
            decided.append((resource, target))
        for name in set(self._pending) - set(resources):
            self._pending.pop(name).cancel()
        reasons = [target.reason for _, target in decided if target is not None]
        self._on_verdict(verdict(report, reasons, missing), report.runtime if report is not None else "")
        for resource, target in decided:
            self._want(resource, target)

    def _want(self, resource: Resource, target: Withholding | None) -> None:
        pending = self._pending.pop(resource.name, None)
        if target == resource.withheld:
            if pending is not None:
                pending.cancel()
            return
        if target is not None:  # withholding takes effect at once
            if pending is not None:
                pending.cancel()
            self._apply(resource, target)
        elif pending is not None:  # an offer already held
            self._pending[resource.name] = pending
        else:
            self._pending[resource.name] = asyncio.get_running_loop().call_later(self._hold, self._offer, resource)

    def _offer(self, resource: Resource) -> None:
        del self._pending[resource.name]
        self._apply(resource, None)

    def _apply(self, resource: Resource, target: Withholding | None) -> None:
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
        for handle in self._pending.values():
            handle.cancel()
        self._pending.clear()


#: What a replaced spec directory does to the runtime (the CDI library's cache, containerd 1.7 and 2.x).
REPLACED_EFFECT = (
    "the runtime's CDI cache follows the directory that was moved away and never reads the new one, so our "
    "name does not resolve (unresolvable CDI devices) until the runtime is restarted"
)
