"""What the kernel says about device nodes: the one seam between the daemon and the node's devices.

Everything the daemon asks of the kernel about a device goes through a ``KernelView``: the node's
stat, the name the kernel gives a major:minor (through udev/sysfs), the static nodes it lists for
module autoload, the KVM API version a node answers, and the open that loads a module. Tests stand
in a table for it, so registration, hotplug and reload run without root and without /dev/kvm.
"""

from __future__ import annotations

import fcntl
import os
import posixpath
import stat
from typing import NamedTuple, Protocol

#: _IO(KVMIO, 0x00): returns the KVM API version, 12 on every kernel since 2.6.22.
KVM_GET_API_VERSION = 0xAE00
#: _IO(KVMIO, 0x01): creates a VM and returns its fd; fails where the CPU's virtualisation is off.
KVM_CREATE_VM = 0xAE01

#: Written at boot by kmod-static-nodes.service from modules.devname; readable where /lib/modules is not
#: (the unit's ProtectKernelModules= hides it).
STATIC_NODES_CONF = "/run/tmpfiles.d/static-nodes.conf"


class NodeStat(NamedTuple):
    """What a stat of a device path tells: a character device (with its numbers), or something else."""

    is_char: bool
    major: int = 0
    minor: int = 0


class KernelView(Protocol):
    """How the kernel names and answers for character devices."""

    def stat_node(self, path: str) -> NodeStat:
        """Stat ``path`` (following links); raises OSError (FileNotFoundError when there is nothing)."""

    def devnode(self, major: int, minor: int) -> str | None:
        """The device node path the kernel gives char device major:minor, or None if there is none."""

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        """major:minor of a static node the kernel lists for ``path`` (module autoload), or None."""

    def kvm_api_version(self, path: str) -> int:
        """The KVM API version the node at ``path`` answers; raises OSError."""

    def open_node(self, path: str) -> None:
        """Open and close the node (the kernel loads its module on first open); raises OSError."""

    def kvm_create_vm(self, path: str) -> None:
        """Create a VM through the node and close it at once (``doctor``); raises OSError."""


class UdevKernelView:
    """KernelView over the real nodes, pyudev (libudev reads sysfs; no udevd needed) and static nodes."""

    def __init__(
        self, context: object | None = None, modules_dir: str | None = None, static_nodes_conf: str | None = None
    ) -> None:
        import pyudev  # noqa: PLC0415 - imported lazily: only the daemon and `probe` need libudev

        self._pyudev = pyudev
        self._context = context if context is not None else pyudev.Context()
        self._modules_dir = modules_dir or posixpath.join("/lib/modules", os.uname().release)
        self._static_nodes_conf = static_nodes_conf or STATIC_NODES_CONF
        self._static: dict[str, tuple[int, int]] | None = None

    @property
    def context(self) -> object:
        return self._context

    def stat_node(self, path: str) -> NodeStat:
        st = os.stat(path)
        if not stat.S_ISCHR(st.st_mode):
            return NodeStat(is_char=False)
        return NodeStat(True, os.major(st.st_rdev), os.minor(st.st_rdev))

    def devnode(self, major: int, minor: int) -> str | None:
        try:
            device = self._pyudev.Devices.from_device_number(self._context, "char", os.makedev(major, minor))
        except self._pyudev.DeviceNotFoundError:
            return None
        node = device.device_node
        return str(node) if node else None

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        if self._static is None:
            self._static = read_static_nodes_conf(self._static_nodes_conf)
            self._static.update(read_modules_devname(posixpath.join(self._modules_dir, "modules.devname")))
        return self._static.get(path)

    def kvm_api_version(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            return fcntl.ioctl(fd, KVM_GET_API_VERSION)
        finally:
            os.close(fd)

    def open_node(self, path: str) -> None:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY))

    def kvm_create_vm(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.close(fcntl.ioctl(fd, KVM_CREATE_VM, 0))
        finally:
            os.close(fd)


def _read_lines(filename: str) -> list[str]:
    try:
        with open(filename, encoding="utf-8") as fh:
            return fh.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return []


def _devnum(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(":")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def read_modules_devname(filename: str) -> dict[str, tuple[int, int]]:
    """Parse ``modules.devname``: lines of ``module devname cMAJ:MIN``."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in _read_lines(filename):
        parts = line.split()
        if len(parts) == 3 and not line.startswith("#") and parts[2].startswith("c"):
            devnum = _devnum(parts[2][1:])
            if devnum is not None:
                nodes["/dev/" + parts[1]] = devnum
    return nodes


def read_static_nodes_conf(filename: str) -> dict[str, tuple[int, int]]:
    """Parse kmod's tmpfiles list of static nodes: ``c! /dev/vhost-net 0600 - - - 10:238``."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in _read_lines(filename):
        parts = line.split()
        if len(parts) == 7 and parts[0] in ("c", "c!") and parts[1].startswith("/dev/"):
            devnum = _devnum(parts[6])
            if devnum is not None:
                nodes[parts[1]] = devnum
    return nodes
