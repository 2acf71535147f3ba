"""Device presence, health and the Resource model."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from ate_devplugd import devices
from ate_devplugd.config import DeviceConfig
from ate_devplugd.devices import Presence, Resource
from tests.conftest import make_kvm_node

KVM = DeviceConfig("ate.dev/kvm", "/dev/kvm", count=4)


class FakeKernel:
    """A KernelView with a table instead of sysfs."""

    def __init__(
        self,
        nodes: dict[tuple[int, int], str] | None = None,
        static: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.nodes = nodes or {}
        self.static = static or {}

    def devnode(self, major: int, minor: int) -> str | None:
        return self.nodes.get((major, minor))

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        return self.static.get(path)


def null_node(root: Path, name: str) -> Path:
    """A real character node (1:3, /dev/null) at root/dev/name; needs root."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    node = root / "dev" / name
    node.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))
    return node


class TestProbe:
    def test_missing(self, tmp_path: Path) -> None:
        """No node: absent, and the reason names the path."""
        p = devices.probe(KVM, str(tmp_path), FakeKernel())
        assert (p.present, p.healthy) == (False, False)
        assert str(tmp_path / "dev/kvm") in p.reason

    def test_regular_file_is_not_a_device(self, tmp_path: Path) -> None:
        """A regular file at the path is not the device."""
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev/kvm").write_text("")
        p = devices.probe(KVM, str(tmp_path), FakeKernel())
        assert not p.present and "not a character device" in p.reason

    def test_directory_is_not_a_device(self, tmp_path: Path) -> None:
        """A directory at the path is not the device."""
        (tmp_path / "dev/kvm").mkdir(parents=True)
        assert not devices.probe(KVM, str(tmp_path), FakeKernel()).present

    def test_char_node_the_kernel_names(self, tmp_path: Path) -> None:
        """A char node whose major:minor the kernel gives this path is present and healthy."""
        null_node(tmp_path, "kvm")
        p = devices.probe(KVM, str(tmp_path), FakeKernel({(1, 3): "/dev/kvm"}))
        assert (p.present, p.healthy) == (True, True)

    def test_char_node_of_another_device(self, tmp_path: Path) -> None:
        """A char node that the kernel knows under another name is not our device."""
        null_node(tmp_path, "kvm")
        p = devices.probe(KVM, str(tmp_path), FakeKernel({(1, 3): "/dev/null"}))
        assert not p.present and "/dev/null" in p.reason

    def test_static_node(self, tmp_path: Path) -> None:
        """A static node listed in modules.devname counts as present (its module loads on open)."""
        null_node(tmp_path, "kvm")
        p = devices.probe(KVM, str(tmp_path), FakeKernel(static={"/dev/kvm": (1, 3)}))
        assert p.present and p.healthy and "static" in p.reason

    def test_unknown_number(self, tmp_path: Path) -> None:
        """A char node with a number the kernel does not provide is absent."""
        null_node(tmp_path, "kvm")
        p = devices.probe(KVM, str(tmp_path), FakeKernel(static={"/dev/kvm": (10, 232)}))
        assert not p.present and "does not provide" in p.reason

    def test_kvm_probe_on_a_non_kvm_node_is_unhealthy(self, tmp_path: Path) -> None:
        """probe = "kvm" on a node that does not answer KVM_GET_API_VERSION: present but unhealthy."""
        null_node(tmp_path, "kvm")
        dev = DeviceConfig("ate.dev/kvm", "/dev/kvm", probe="kvm")
        p = devices.probe(dev, str(tmp_path), FakeKernel({(1, 3): "/dev/kvm"}))
        assert (p.present, p.healthy) == (True, False)
        assert "KVM_GET_API_VERSION failed" in p.reason


class TestRealKernel:
    def test_real_kvm_node_through_udev(self, dev_root: Path) -> None:
        """With pyudev on the real sysfs, a mknod'ed 10:232 node at dev/kvm is the kernel's kvm."""
        p = devices.probe(KVM, str(dev_root), devices.UdevKernelView())
        assert (p.present, p.healthy) == (True, True), p.reason

    def test_real_kvm_api_probe(self, dev_root: Path) -> None:
        """The functional probe gets API version 12 from the real KVM driver."""
        dev = DeviceConfig("ate.dev/kvm", "/dev/kvm", probe="kvm")
        p = devices.probe(dev, str(dev_root), devices.UdevKernelView())
        assert p.healthy and "KVM API 12" in p.reason, p.reason

    def test_kvm_node_under_another_name(self, dev_root: Path) -> None:
        """The real kvm number at another path is not that device."""
        os.rename(dev_root / "dev/kvm", dev_root / "dev/other")
        dev = DeviceConfig("ate.dev/other", "/dev/other")
        p = devices.probe(dev, str(dev_root), devices.UdevKernelView())
        assert not p.present and "/dev/kvm" in p.reason
        make_kvm_node(dev_root)

    def test_modules_devname(self, tmp_path: Path) -> None:
        """modules.devname lines map /dev paths to static char numbers."""
        (tmp_path / "modules.devname").write_text(
            "# Device nodes to trigger on-demand module loading.\n"
            "fuse fuse c10:229\nvhost_net vhost-net c10:238\ntun net/tun c10:200\nloop loop-control c10:237\n"
            "bogus line\nblk sda b8:0\n"
        )
        view = devices.UdevKernelView(modules_dir=str(tmp_path), static_nodes_conf=str(tmp_path / "none"))
        assert view.static_devnum("/dev/vhost-net") == (10, 238)
        assert view.static_devnum("/dev/net/tun") == (10, 200)
        assert view.static_devnum("/dev/sda") is None

    def test_static_nodes_conf(self, tmp_path: Path) -> None:
        """Where /lib/modules is hidden (ProtectKernelModules=), kmod's tmpfiles list serves instead."""
        (tmp_path / "static-nodes.conf").write_text(
            "c! /dev/fuse 0600 - - - 10:229\nd /dev/vfio 0755 - - -\nc! /dev/vhost-vsock 0600 - - - 10:241\n"
            "c! /dev/net/tun 0666 - - - 10:200\nbad\n"
        )
        view = devices.UdevKernelView(
            modules_dir=str(tmp_path / "hidden"), static_nodes_conf=str(tmp_path / "static-nodes.conf")
        )
        assert view.static_devnum("/dev/vhost-vsock") == (10, 241)
        assert view.static_devnum("/dev/net/tun") == (10, 200)
        assert view.static_devnum("/dev/vfio") is None


class TestPreopen:
    def test_missing_node_names_the_path(self, tmp_path: Path) -> None:
        """preopen of a missing node reports why, and does not raise."""
        failure = devices.preopen(DeviceConfig("a.io/v", "/dev/vhost-net", preopen=True), str(tmp_path))
        assert failure is not None and "vhost-net" in failure

    def test_opens_a_node(self, tmp_path: Path) -> None:
        """preopen of an openable node succeeds."""
        null_node(tmp_path, "vhost-net")
        assert devices.preopen(DeviceConfig("a.io/v", "/dev/vhost-net"), str(tmp_path)) is None


class TestResource:
    async def test_transitions_and_wakeups(self) -> None:
        """Health changes bump the version and wake waiters; same-health probes do not."""
        res = Resource(KVM)
        assert res.update(Presence(False, False, "gone")) == "device-absent"
        waiter = res.change_event()
        assert res.update(Presence(True, True, "here")) == "device-added"
        assert waiter.is_set() and res.seen.is_set()
        assert res.update(Presence(True, True, "still here")) is None
        assert res.update(Presence(True, False, "probe failed")) == "device-unhealthy"
        assert res.update(Presence(True, True, "fine")) == "device-healthy"
        assert res.update(Presence(False, False, "gone")) == "device-removed"
        assert res.update(Presence(True, True, "back")) == "device-added"
        assert res.version == 5
        await asyncio.sleep(0)

    @pytest.mark.parametrize(
        ("device_id", "known"),
        [
            ("kvm-0", True),
            ("kvm-3", True),
            ("kvm-4", False),
            ("kvm-00", False),
            ("kvm--1", False),
            ("kvm-", False),
            ("kvm-٣", False),
            ("tun-0", False),
            ("kvm-1 ", False),
            ("", False),
        ],
    )
    def test_known_ids(self, device_id: str, known: bool) -> None:
        """Only the exact IDs kvm-0 ... kvm-<count-1> are ours."""
        assert Resource(KVM).is_known_id(device_id) is known


class TestCharLink:
    def test_missing_dev_char_link_is_a_note(self, tmp_path: Path) -> None:
        """A present device without its /dev/char/MAJ:MIN link stays healthy, with a note saying why it matters."""
        null_node(tmp_path, "kvm")
        p = devices.probe(KVM, str(tmp_path), FakeKernel({(1, 3): "/dev/kvm"}))
        assert p.healthy and "dev/char/1:3 is missing" in p.note

    def test_link_present_no_note(self, tmp_path: Path) -> None:
        """With the link in place there is nothing to say."""
        null_node(tmp_path, "kvm")
        (tmp_path / "dev" / "char").mkdir()
        (tmp_path / "dev" / "char" / "1:3").symlink_to("../kvm")
        assert devices.probe(KVM, str(tmp_path), FakeKernel({(1, 3): "/dev/kvm"})).note == ""
