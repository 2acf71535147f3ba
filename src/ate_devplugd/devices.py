"""Device presence and health: what the node really has, read from the node and the kernel.

A configured device is *present* when its path under ``dev_root`` is a character device whose
major:minor is the one the kernel reports for that path (through udev/sysfs), or is a static node the
kernel lists in ``modules.devname`` (it autoloads its module on first open). A present device is
*healthy* unless its functional probe fails. Every call re-reads the node: callers re-probe on any
hint, so the answer never depends on which events arrived.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import posixpath
import stat
from dataclasses import dataclass
from typing import Protocol

from ate_devplugd.config import DeviceConfig

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

#: _IO(KVMIO, 0x00): returns the KVM API version, 12 on every kernel since 2.6.22.
KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12


class KernelView(Protocol):
    """How the kernel names character devices; a seam so tests can stand in for sysfs."""

    def devnode(self, major: int, minor: int) -> str | None:
        """The device node path the kernel gives char device major:minor, or None if there is none."""

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        """major:minor of a static node the kernel lists for ``path`` (module autoload), or None."""


@dataclass(frozen=True)
class Presence:
    """The result of one probe of one device."""

    present: bool
    healthy: bool
    reason: str
    #: Something an operator should fix that does not make the device unhealthy.
    note: str = ""

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


UNKNOWN = Presence(present=False, healthy=False, reason="not probed yet")


#: Written at boot by kmod-static-nodes.service from modules.devname; readable where /lib/modules is not
#: (the unit's ProtectKernelModules= hides it).
STATIC_NODES_CONF = "/run/tmpfiles.d/static-nodes.conf"


class UdevKernelView:
    """KernelView over pyudev (libudev reads sysfs; no udevd needed) and the kernel's static nodes."""

    def __init__(
        self, context: object | None = None, modules_dir: str | None = None, static_nodes_conf: str | None = None
    ) -> None:
        import pyudev  # noqa: PLC0415 - imported lazily: only the daemon and the probe need libudev

        self._pyudev = pyudev
        self._context = context if context is not None else pyudev.Context()
        self._modules_dir = modules_dir or posixpath.join("/lib/modules", os.uname().release)
        self._static_nodes_conf = static_nodes_conf or STATIC_NODES_CONF
        self._static: dict[str, tuple[int, int]] | None = None

    @property
    def context(self) -> object:
        return self._context

    def devnode(self, major: int, minor: int) -> str | None:
        try:
            device = self._pyudev.Devices.from_device_number(self._context, "char", os.makedev(major, minor))
        except self._pyudev.DeviceNotFoundError:
            return None
        node = device.device_node
        return str(node) if node else None

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        if self._static is None:
            self._static = _read_static_nodes_conf(self._static_nodes_conf)
            self._static.update(_read_modules_devname(posixpath.join(self._modules_dir, "modules.devname")))
        return self._static.get(path)


def _read_lines(filename: str) -> list[str]:
    try:
        with open(filename, encoding="utf-8") as fh:
            return fh.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return []


def _devnum(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(":")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def _read_modules_devname(filename: str) -> dict[str, tuple[int, int]]:
    """Parse ``modules.devname``: lines of ``module devname cMAJ:MIN``."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in _read_lines(filename):
        parts = line.split()
        if len(parts) == 3 and not line.startswith("#") and parts[2].startswith("c"):
            devnum = _devnum(parts[2][1:])
            if devnum is not None:
                nodes["/dev/" + parts[1]] = devnum
    return nodes


def _read_static_nodes_conf(filename: str) -> dict[str, tuple[int, int]]:
    """Parse kmod's tmpfiles list of static nodes: ``c! /dev/vhost-net 0600 - - - 10:238``."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in _read_lines(filename):
        parts = line.split()
        if len(parts) == 7 and parts[0] in ("c", "c!") and parts[1].startswith("/dev/"):
            devnum = _devnum(parts[6])
            if devnum is not None:
                nodes[parts[1]] = devnum
    return nodes


def node_path(dev: DeviceConfig, dev_root: str) -> str:
    """Where ``dev.path`` is looked up: under ``dev_root`` (``/`` on a real node)."""
    return posixpath.join(dev_root, dev.path.lstrip("/"))


def probe(dev: DeviceConfig, dev_root: str, kernel: KernelView) -> Presence:  # noqa: PLR0911 - one return per finding
    """Probe one device now."""
    node = node_path(dev, dev_root)
    try:
        st = os.stat(node)
    except FileNotFoundError:
        return Presence(False, False, f"{node} does not exist")
    except OSError as exc:
        return Presence(False, False, f"{node}: {exc.strerror}")
    if not stat.S_ISCHR(st.st_mode):
        return Presence(False, False, f"{node} is not a character device")
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
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
        failure = _probe_kvm(node)
        if failure:
            return Presence(True, False, f"{where}, but {failure}")
        where += ", KVM API 12"
    link = posixpath.join(dev_root, f"dev/char/{major}:{minor}")
    if not os.path.lexists(link):
        # With the systemd cgroup driver, `systemctl daemon-reload` rebuilds device rules from
        # /dev/char links; without one, running containers can lose the device.
        note = f"{link} is missing: running containers may lose the device on a systemd daemon-reload"
        return Presence(True, True, where, note)
    return Presence(True, True, where)


def _probe_kvm(node: str) -> str | None:
    """None if ``node`` answers KVM_GET_API_VERSION with 12, else why not."""
    try:
        fd = os.open(node, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        return f"opening it failed: {exc.strerror}"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return f"KVM_GET_API_VERSION failed: {exc.strerror}"
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return f"KVM_GET_API_VERSION returned {version}, not {KVM_API_VERSION}"
    return None


def preopen(dev: DeviceConfig, dev_root: str) -> str | None:
    """Open the node once so the kernel autoloads its module; None on success, else why not."""
    node = node_path(dev, dev_root)
    try:
        fd = os.open(node, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return f"opening {node} was denied ({exc.strerror}); allow it with DeviceAllow= in the unit"
        return f"opening {node} failed: {exc.strerror}"
    os.close(fd)
    return None


class Resource:
    """The live state of one configured device, as advertised to kubelet.

    ``version`` increases whenever what kubelet sees changes (health); waiters on ``changed()`` wake
    then. A device that has been present once stays advertised: it turns Unhealthy when it goes, so
    its IDs never change and kubelet's capacity stays while allocatable drops.
    """

    def __init__(self, config: DeviceConfig) -> None:
        self.config = config
        self.presence = UNKNOWN
        self.version = 0
        self.seen = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def name(self) -> str:
        return self.config.resource

    @property
    def healthy(self) -> bool:
        return self.presence.healthy

    def update(self, presence: Presence) -> str | None:
        """Record a probe; return the event name if what kubelet sees changed, else None."""
        before = self.presence
        self.presence = presence
        if presence.present:
            self.seen.set()
        if before.healthy == presence.healthy:
            if before is UNKNOWN and not presence.present:
                return "device-absent"
            return None
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        if presence.healthy:
            return "device-added" if not before.present else "device-healthy"
        return "device-removed" if not presence.present else "device-unhealthy"

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
