"""Device presence and health: what the node really has, and the resources advertised for it.

A configured device is *present* when its path under ``dev_root`` is a character device whose
major:minor is the one the kernel gives that path, or is a static node the kernel lists in
``modules.devname`` (it autoloads its module on first open). A present device is *healthy* unless its
functional probe (``probe = "kvm"``) fails. Every look re-reads the node (through the ``KernelView``): the registry
looks again on any hint, so the answer never depends on which events arrived.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import posixpath
from collections.abc import Callable
from typing import NamedTuple

from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.look import Look, look
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.node.kernel import KernelView

log = logging.getLogger(__name__)

#: The events a look at a device logs when what it finds changes (``Resource.update`` names them).
EVENTS = ("device-added", "device-removed", "device-unhealthy", "device-healthy", "device-absent")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KVM_API_VERSION = 12


class Presence(NamedTuple):
    """What one look at one device found."""

    present: bool
    healthy: bool
    reason: str
    #: Something an operator should fix that does not make the device unhealthy.
    note: str = ""
    #: major:minor of the node, when it is the kernel's device.
    devnum: tuple[int, int] | None = None


UNKNOWN = Presence(present=False, healthy=False, reason="not looked at yet")


class Withheld(enum.Enum):
    """Why a present, healthy device is not offered: a pod granted it now would not get a working device
    (or, while a node changes mode, would be sent down the path that is going). The value is the
    ``reason`` label of the metrics and the word in STATUS."""

    #: The runtime kubelet uses drops our CDI names (CDI off, too old for CDI).
    CDI_NOT_APPLIED = "cdi-not-applied"
    #: The runtime applies CDI names but does not read our spec directory: no container is created.
    DIR_NOT_READ = "dir-not-read"
    #: No runtime has answered since the start, or it is one whose handling of CDI is not known: nothing
    #: says a device that needs its CDI name applied would get it.
    CDI_UNKNOWN = "cdi-unknown"
    #: Another spec in the same directory defines our name: the CDI library refuses to resolve it.
    SPEC_CONFLICT = "spec-conflict"
    #: A spec in a later directory defines our name with a node the VMM cannot open (or another device).
    SPEC_REPLACED = "spec-replaced"
    #: Our spec is not on disk, or cannot be written (the cause is in the detail).
    SPEC_MISSING = "spec-missing"
    #: Our spec on disk is one the CDI library refuses.
    SPEC_INVALID = "spec-invalid"
    #: ``cdi_dir`` was replaced (renamed away) after the runtime started: its CDI cache follows the old
    #: directory and never reads the new one until the runtime is restarted.
    SPEC_DIR_REPLACED = "spec-dir-replaced"
    #: The node is moving to the other mode: new pods must take the path that stays.
    MODE_SWITCH = "mode-switch"


class Withholding(NamedTuple):
    """A device withheld: why (the enum a caller branches on) and the words an operator reads."""

    reason: Withheld
    detail: str


def node_path(dev: DeviceConfig, dev_root: str) -> str:
    """Where ``dev.path`` is looked up: under ``dev_root`` (``/`` on a real node)."""
    return posixpath.join(dev_root, dev.path.lstrip("/"))


def presence(dev: DeviceConfig, dev_root: str, kernel: KernelView) -> Presence:  # noqa: PLR0911 - one return per finding
    """Look at one device now: is it there, and does it work."""
    node = node_path(dev, dev_root)
    try:
        st = kernel.stat_node(node)
    except FileNotFoundError:
        return Presence(False, False, f"{node} does not exist")
    except OSError as exc:
        return Presence(False, False, f"{node}: {exc.strerror}")
    if not st.is_char:
        return Presence(False, False, f"{node} is not a character device")
    major, minor = st.major, st.minor
    kernel_node = kernel.devnode(major, minor)
    if kernel_node is None:
        if kernel.static_devnum(dev.path) != (major, minor):
            return Presence(False, False, f"{node} is {major}:{minor}, which the kernel does not provide")
        where = f"static node {major}:{minor} (its module loads on first open)"
    elif kernel_node != dev.path:
        return Presence(False, False, f"{node} is {major}:{minor}, which the kernel names {kernel_node}")
    else:
        where = f"character device {major}:{minor}"
    if dev.probe == "kvm":
        failure = _check_kvm(node, kernel)
        if failure:
            return Presence(True, False, f"{where}, but {failure}", devnum=(major, minor))
        where += ", KVM API 12"
    link = posixpath.join(dev_root, f"dev/char/{major}:{minor}")
    note = ""
    if look(link, follow=False) is Look.ABSENT:
        # With the systemd cgroup driver, `systemctl daemon-reload` rebuilds device rules from
        # /dev/char links; without one, running containers can lose the device.
        note = f"{link} is missing: running containers may lose the device on a systemd daemon-reload"
    return Presence(True, True, where, note, (major, minor))


def _check_kvm(node: str, kernel: KernelView) -> str | None:
    """None if ``node`` answers KVM_GET_API_VERSION with 12, else why not."""
    try:
        version = kernel.kvm_api_version(node)
    except OSError as exc:
        return f"KVM_GET_API_VERSION failed: {exc.strerror}"
    if version != KVM_API_VERSION:
        return f"KVM_GET_API_VERSION returned {version}, not {KVM_API_VERSION}"
    return None


def preopen(dev: DeviceConfig, dev_root: str, kernel: KernelView) -> str | None:
    """Open the node once so the kernel autoloads its module; None on success, else why not."""
    node = node_path(dev, dev_root)
    try:
        kernel.open_node(node)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return f"opening {node} was denied ({exc.strerror}); allow it with DeviceAllow= in the unit"
        return f"opening {node} failed: {exc.strerror}"
    return None


class Resource:
    """The live state of one configured device, as advertised to kubelet.

    Waiters on ``change_event()`` wake whenever what kubelet sees may have changed (health, or the
    config through a reload). A device that has been present once stays advertised: it turns
    Unhealthy when it goes, so its IDs never change and kubelet's capacity stays while allocatable drops.
    """

    def __init__(self, config: DeviceConfig) -> None:
        self.config = config
        self.presence = UNKNOWN
        self.seen = asyncio.Event()
        self.events = EventLog(log, resource=config.resource, device=config.path)
        #: The CDI device Allocate names (``ate.dev/kvm=kvm``) while its spec is in place, else None.
        self.cdi_device: str | None = None
        self._withheld: Withholding | None = None
        self._changed = asyncio.Event()

    @property
    def name(self) -> str:
        return self.config.resource

    @property
    def healthy(self) -> bool:
        """Present and passing its probe: the device itself works."""
        return self.presence.healthy

    @property
    def withheld(self) -> Withholding | None:
        """Why the device is not offered although it works, or None."""
        return self._withheld

    @property
    def usable(self) -> bool:
        """Offered: healthy and not withheld, so a pod granted a unit now gets a working device."""
        return self.presence.healthy and self._withheld is None

    @property
    def unusable_reason(self) -> str:
        """Why the device is not usable, in an operator's words ("" when it is)."""
        if not self.presence.healthy:
            return self.presence.reason
        if self._withheld is not None:
            return f"withheld: {self._withheld.reason.value}: {self._withheld.detail}"
        return ""

    def withhold(self, withholding: Withholding | None) -> bool:
        """Withhold the device (or offer it again, with None); True if what kubelet sees may have changed."""
        if withholding == self._withheld:
            return False
        was_usable = self.usable
        self._withheld = withholding
        self._wake()
        return was_usable != self.usable

    def update(self, presence: Presence) -> str | None:
        """Record what a look found; return the event name if the health kubelet sees changed, else None."""
        before = self.presence
        self.presence = presence
        if presence.present:
            self.seen.set()
        if before.healthy == presence.healthy:
            if before is UNKNOWN and not presence.present:
                return "device-absent"
            return None
        self._wake()
        if presence.healthy:
            return "device-added" if not before.present else "device-healthy"
        return "device-removed" if not presence.present else "device-unhealthy"

    def replace_config(self, config: DeviceConfig) -> None:
        """Take a changed config of the same resource (a reload); streams send the new list, if it differs."""
        assert config.resource == self.name
        self.config = config
        self.events = EventLog(log, resource=config.resource, device=config.path)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def change_event(self) -> asyncio.Event:
        """An Event set at the next change; take it *before* reading the state, so no change is lost."""
        return self._changed

    def is_known_id(self, device_id: str) -> bool:
        """Whether ``device_id`` is one of this resource's IDs (``kvm-0`` ... ``kvm-<count-1>``)."""
        prefix = self.config.id_prefix
        if not device_id.startswith(prefix):
            return False
        number = device_id[len(prefix) :]
        if not (number.isascii() and number.isdigit()) or len(number) > len(str(self.config.count)):
            return False
        return str(int(number)) == number and int(number) < self.config.count


#: Called after each look at a resource, with the event name when the health kubelet sees changed.
LookHook = Callable[[Resource, str | None], None]


class DeviceRegistry:
    """The configured resources, in config order: looked at again on every hint, changed by reloads.

    ``on_look`` hears every resource after every look (the CDI writer, the metrics and STATUS follow
    it); it runs before the loop can run anything else, so a session never sees a device present
    before what depends on the look is done.
    """

    def __init__(self, dev_root: str, kernel: KernelView, on_look: LookHook) -> None:
        self.dev_root = dev_root
        self._kernel = kernel
        self._on_look = on_look
        self.resources: dict[str, Resource] = {}

    def subsystems(self) -> set[str]:
        """The udev subsystems whose events are hints for these devices."""
        return {resource.config.subsystem for resource in self.resources.values()}

    def apply(self, devices: tuple[DeviceConfig, ...], dev_root: str) -> None:
        """Make the registry hold exactly ``devices``: new ones added (and preopened), changed ones updated."""
        self.dev_root = dev_root
        current = self.resources
        self.resources = {}
        for dev in devices:
            resource = current.get(dev.resource)
            if resource is None:
                resource = Resource(dev)
                self._preopen(resource)
            elif resource.config != dev:
                resource.replace_config(dev)
                self._preopen(resource)
            self.resources[dev.resource] = resource
        self.reconcile()

    def _preopen(self, resource: Resource) -> None:
        if resource.config.preopen:
            failure = preopen(resource.config, self.dev_root, self._kernel)
            if failure:
                resource.events.warning("preopen-failed", "%s", failure)

    def reconcile(self) -> None:
        """Look at every device again; log what changed, and tell ``on_look``."""
        for resource in self.resources.values():
            now = presence(resource.config, self.dev_root, self._kernel)
            name = resource.update(now)
            if name is not None:
                level = logging.INFO if now.healthy or name == "device-absent" else logging.WARNING
                resource.events.log(level, name, "%s %s: %s", resource.name, resource.config.path, now.reason)
                if now.note and now.healthy:
                    resource.events.warning("device-note", "%s: %s", resource.name, now.note)
            self._on_look(resource, name)
