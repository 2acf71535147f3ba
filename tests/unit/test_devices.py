"""Device presence, health and the Resource model."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from pathlib import Path

import pytest

from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.node import devices
from ate_devplugd.node.devices import DeviceRegistry, Presence, Resource, Withheld, Withholding
from ate_devplugd.node.kernel import UdevKernelView
from tests.support import FakeKernel, make_kvm_node, recording_events

KVM = DeviceConfig("ate.dev/kvm", "/dev/kvm", count=4)


def char_node(kernel: FakeKernel, root: Path, name: str, devnum: tuple[int, int] = (1, 3)) -> Path:
    """A character node at root/dev/name in the kernel's table (no mknod, no root)."""
    node = root / "dev" / name
    node.parent.mkdir(parents=True, exist_ok=True)
    kernel.add_node(node, devnum)
    return node


def null_node(root: Path, name: str) -> Path:
    """A real character node (1:3, /dev/null) at root/dev/name; needs root."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    node = root / "dev" / name
    node.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    return node


def kernel_with(names: dict[tuple[int, int], str] | None = None, **static: tuple[int, int]) -> FakeKernel:
    kernel = FakeKernel()
    kernel.names = dict(names or {})
    kernel.static = {f"/dev/{k}": v for k, v in static.items()}
    return kernel


class TestProbe:
    def test_missing(self, tmp_path: Path) -> None:
        """No node: absent, and the reason names the path."""
        p = devices.presence(KVM, str(tmp_path), FakeKernel())
        assert (p.present, p.healthy) == (False, False)
        assert str(tmp_path / "dev/kvm") in p.reason

    def test_regular_file_is_not_a_device(self, tmp_path: Path) -> None:
        """A regular file at the path is not the device."""
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev/kvm").write_text("")
        p = devices.presence(KVM, str(tmp_path), FakeKernel())
        assert not p.present and "not a character device" in p.reason

    def test_directory_is_not_a_device(self, tmp_path: Path) -> None:
        """A directory at the path is not the device."""
        (tmp_path / "dev/kvm").mkdir(parents=True)
        assert not devices.presence(KVM, str(tmp_path), FakeKernel()).present

    def test_char_node_the_kernel_names(self, tmp_path: Path) -> None:
        """A char node whose major:minor the kernel gives this path is present and healthy."""
        kernel = kernel_with({(1, 3): "/dev/kvm"})
        char_node(kernel, tmp_path, "kvm")
        p = devices.presence(KVM, str(tmp_path), kernel)
        assert (p.present, p.healthy) == (True, True)

    def test_char_node_of_another_device(self, tmp_path: Path) -> None:
        """A char node that the kernel knows under another name is not our device."""
        kernel = kernel_with({(1, 3): "/dev/null"})
        char_node(kernel, tmp_path, "kvm")
        p = devices.presence(KVM, str(tmp_path), kernel)
        assert not p.present and "/dev/null" in p.reason

    def test_static_node(self, tmp_path: Path) -> None:
        """A static node listed in modules.devname counts as present (its module loads on open)."""
        kernel = kernel_with(kvm=(1, 3))
        char_node(kernel, tmp_path, "kvm")
        p = devices.presence(KVM, str(tmp_path), kernel)
        assert p.present and p.healthy and "static" in p.reason

    def test_unknown_number(self, tmp_path: Path) -> None:
        """A char node with a number the kernel does not provide is absent."""
        kernel = kernel_with(kvm=(10, 232))
        char_node(kernel, tmp_path, "kvm")
        p = devices.presence(KVM, str(tmp_path), kernel)
        assert not p.present and "does not provide" in p.reason

    def test_kvm_probe_on_a_non_kvm_node_is_unhealthy(self, tmp_path: Path) -> None:
        """probe = "kvm" on a node that does not answer KVM_GET_API_VERSION: present but unhealthy."""
        kernel = kernel_with({(1, 3): "/dev/kvm"})
        kernel.kvm_error = OSError(errno.ENOTTY, os.strerror(errno.ENOTTY))
        char_node(kernel, tmp_path, "kvm")
        dev = DeviceConfig("ate.dev/kvm", "/dev/kvm", probe="kvm")
        p = devices.presence(dev, str(tmp_path), kernel)
        assert (p.present, p.healthy) == (True, False)
        assert "KVM_GET_API_VERSION failed" in p.reason

    def test_kvm_probe_wrong_version_is_unhealthy(self, tmp_path: Path) -> None:
        """probe = "kvm" on a node that answers another API version: present but unhealthy."""
        kernel = kernel_with({(10, 232): "/dev/kvm"})
        kernel.kvm_version = 11
        char_node(kernel, tmp_path, "kvm", (10, 232))
        p = devices.presence(DeviceConfig("ate.dev/kvm", "/dev/kvm", probe="kvm"), str(tmp_path), kernel)
        assert (p.present, p.healthy) == (True, False) and "returned 11" in p.reason


class TestRealKernel:
    def test_real_non_kvm_node_fails_the_kvm_probe(self, tmp_path: Path) -> None:
        """The real ioctl on a node that is not KVM (/dev/null's number) fails: unhealthy, saying why."""
        null_node(tmp_path, "kvm")
        kernel = UdevKernelView()
        with pytest.raises(OSError):
            kernel.kvm_api_version(str(tmp_path / "dev" / "kvm"))

    def test_real_kvm_node_through_udev(self, dev_root: Path) -> None:
        """With pyudev on the real sysfs, a mknod'ed 10:232 node at dev/kvm is the kernel's kvm."""
        p = devices.presence(KVM, str(dev_root), UdevKernelView())
        assert (p.present, p.healthy) == (True, True), p.reason

    def test_real_kvm_api_probe(self, dev_root: Path) -> None:
        """The functional probe gets API version 12 from the real KVM driver."""
        dev = DeviceConfig("ate.dev/kvm", "/dev/kvm", probe="kvm")
        p = devices.presence(dev, str(dev_root), UdevKernelView())
        assert p.healthy and "KVM API 12" in p.reason, p.reason

    def test_kvm_node_under_another_name(self, dev_root: Path) -> None:
        """The real kvm number at another path is not that device."""
        os.rename(dev_root / "dev/kvm", dev_root / "dev/other")
        dev = DeviceConfig("ate.dev/other", "/dev/other")
        p = devices.presence(dev, str(dev_root), UdevKernelView())
        assert not p.present and "/dev/kvm" in p.reason
        make_kvm_node(dev_root)

    def test_modules_devname(self, tmp_path: Path) -> None:
        """modules.devname lines map /dev paths to static char numbers."""
        (tmp_path / "modules.devname").write_text(
            "# Device nodes to trigger on-demand module loading.\n"
            "fuse fuse c10:229\nvhost_net vhost-net c10:238\ntun net/tun c10:200\nloop loop-control c10:237\n"
            "bogus line\nblk sda b8:0\n"
        )
        view = UdevKernelView(modules_dir=str(tmp_path), static_nodes_conf=str(tmp_path / "none"))
        assert view.static_devnum("/dev/vhost-net") == (10, 238)
        assert view.static_devnum("/dev/net/tun") == (10, 200)
        assert view.static_devnum("/dev/sda") is None

    def test_static_nodes_conf(self, tmp_path: Path) -> None:
        """Where /lib/modules is hidden (ProtectKernelModules=), kmod's tmpfiles list serves instead."""
        (tmp_path / "static-nodes.conf").write_text(
            "c! /dev/fuse 0600 - - - 10:229\nd /dev/vfio 0755 - - -\nc! /dev/vhost-vsock 0600 - - - 10:241\n"
            "c! /dev/net/tun 0666 - - - 10:200\nbad\n"
        )
        view = UdevKernelView(
            modules_dir=str(tmp_path / "hidden"), static_nodes_conf=str(tmp_path / "static-nodes.conf")
        )
        assert view.static_devnum("/dev/vhost-vsock") == (10, 241)
        assert view.static_devnum("/dev/net/tun") == (10, 200)
        assert view.static_devnum("/dev/vfio") is None


class TestPreopen:
    def test_missing_node_names_the_path(self, tmp_path: Path) -> None:
        """preopen of a missing node reports why, and does not raise."""
        failure = devices.preopen(DeviceConfig("a.io/v", "/dev/vhost-net", preopen=True), str(tmp_path), FakeKernel())
        assert failure is not None and "vhost-net" in failure

    def test_opens_a_node(self, tmp_path: Path) -> None:
        """preopen of an openable node succeeds."""
        kernel = FakeKernel()
        node = char_node(kernel, tmp_path, "vhost-net", (10, 238))
        assert devices.preopen(DeviceConfig("a.io/v", "/dev/vhost-net"), str(tmp_path), kernel) is None
        assert kernel.opened == [str(node)]

    def test_opens_a_real_node(self, tmp_path: Path) -> None:
        """The real open of a real node succeeds (root: mknod)."""
        null_node(tmp_path, "vhost-net")
        assert UdevKernelView().open_node(str(tmp_path / "dev" / "vhost-net")) is None

    def test_denied_names_the_unit_setting(self, tmp_path: Path) -> None:
        """A denied open (the unit's DevicePolicy) says how to allow it."""
        kernel = FakeKernel()
        char_node(kernel, tmp_path, "vhost-net", (10, 238))
        kernel.open_error = PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        failure = devices.preopen(DeviceConfig("a.io/v", "/dev/vhost-net"), str(tmp_path), kernel)
        assert failure is not None and "DeviceAllow=" in failure


class TestResource:
    async def test_transitions_and_wakeups(self) -> None:
        """Health changes wake waiters and are named; same-health looks do not wake anyone."""
        res = Resource(KVM)
        assert res.update(Presence(False, False, "gone")) == "device-absent"
        waiter = res.change_event()
        assert res.update(Presence(True, True, "here")) == "device-added"
        assert waiter.is_set() and res.seen.is_set()
        quiet = res.change_event()
        assert res.update(Presence(True, True, "still here")) is None
        assert not quiet.is_set()
        assert res.update(Presence(True, False, "probe failed")) == "device-unhealthy"
        assert res.update(Presence(True, True, "fine")) == "device-healthy"
        assert res.update(Presence(False, False, "gone")) == "device-removed"
        assert res.update(Presence(True, True, "back")) == "device-added"
        assert quiet.is_set()
        await asyncio.sleep(0)

    def test_replace_config_wakes_and_rebinds(self) -> None:
        """A changed config of the same resource wakes the streams; its IDs follow the new count."""
        res = Resource(KVM)
        waiter = res.change_event()
        res.replace_config(DeviceConfig("ate.dev/kvm", "/dev/kvm", count=8))
        assert waiter.is_set() and res.is_known_id("kvm-7") and not Resource(KVM).is_known_id("kvm-7")

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
        kernel = kernel_with({(1, 3): "/dev/kvm"})
        char_node(kernel, tmp_path, "kvm")
        p = devices.presence(KVM, str(tmp_path), kernel)
        assert p.healthy and "dev/char/1:3 is missing" in p.note

    def test_link_present_no_note(self, tmp_path: Path) -> None:
        """With the link in place there is nothing to say."""
        kernel = kernel_with({(1, 3): "/dev/kvm"})
        char_node(kernel, tmp_path, "kvm")
        (tmp_path / "dev" / "char").mkdir()
        (tmp_path / "dev" / "char" / "1:3").symlink_to("../kvm")
        assert devices.presence(KVM, str(tmp_path), kernel).note == ""


class TestDeviceRegistry:
    async def test_apply_adds_changes_and_removes(self, fake_root: Path, kernel: FakeKernel) -> None:
        """apply() keeps a changed resource's object (its streams stay), adds new ones and drops removed ones."""
        changes: list[str | None] = []
        registry = DeviceRegistry(str(fake_root), kernel, lambda _resource, event: changes.append(event))
        tun = DeviceConfig("ate.dev/tun", "/dev/net/tun", preopen=True)
        registry.apply((KVM, tun), str(fake_root))
        kvm = registry.resources["ate.dev/kvm"]
        assert kvm.healthy and not registry.resources["ate.dev/tun"].seen.is_set() and changes
        registry.apply((DeviceConfig("ate.dev/kvm", "/dev/kvm", count=2),), str(fake_root))
        assert list(registry.resources) == ["ate.dev/kvm"] and registry.resources["ate.dev/kvm"] is kvm
        assert kvm.config.count == 2 and registry.subsystems() == {"misc"}

    async def test_reconcile_logs_each_transition_once(self, fake_root: Path, kernel: FakeKernel) -> None:
        """A node that goes and comes back is logged as device-removed, then device-added, with its fields."""
        registry = DeviceRegistry(str(fake_root), kernel, lambda _resource, _event: None)
        with recording_events() as events:
            registry.apply((KVM,), str(fake_root))
            node = fake_root / "dev" / "kvm"
            kernel.remove_node(node)
            registry.reconcile()
            registry.reconcile()
            kernel.add_node(node)
            registry.reconcile()
        names = [r.ATE_EVENT for r in events.records if getattr(r, "ATE_EVENT", None)]
        assert names == ["device-added", "device-removed", "device-added"]
        removed = events.named("device-removed")[0]
        assert (removed.levelname, removed.ATE_RESOURCE, removed.ATE_DEVICE) == ("WARNING", "ate.dev/kvm", "/dev/kvm")

    async def test_preopen_on_add_only(self, fake_root: Path, kernel: FakeKernel) -> None:
        """A preopen device is opened when it is added (or changed), not on every look."""
        node = char_node(kernel, fake_root, "vhost-net", (10, 238))
        registry = DeviceRegistry(str(fake_root), kernel, lambda _resource, _event: None)
        vhost = DeviceConfig("ate.dev/vhost-net", "/dev/vhost-net", preopen=True)
        registry.apply((vhost,), str(fake_root))
        registry.reconcile()
        registry.apply((vhost,), str(fake_root))
        assert kernel.opened == [str(node)]


def test_a_withheld_device_is_not_usable_and_wakes_its_streams() -> None:
    resource = Resource(DeviceConfig(resource="ate.dev/kvm", path="/dev/kvm"))
    resource.update(Presence(present=True, healthy=True, reason="character device 10:232"))
    assert resource.usable and resource.unusable_reason == ""
    woken = resource.change_event()
    why = Withholding(Withheld.SPEC_CONFLICT, "/etc/cdi/other.json also defines ate.dev/kvm=kvm")
    assert resource.withhold(why) is True
    assert woken.is_set()
    assert resource.healthy and not resource.usable
    assert resource.unusable_reason.startswith("withheld: spec-conflict: ")
    assert resource.withhold(why) is False  # the same withholding again changes nothing
    assert resource.withhold(None) is True
    assert resource.usable
