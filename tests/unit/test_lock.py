"""The instance lock: one daemon per plugin directory, however many second daemons were refused."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from ate_devplugd.config import Config
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.kubelet.lock import InstanceLock, NoPermissionError, lock_name, make_plugin_dir
from tests.fault.harness import read_only_bind


async def test_refused_starts_never_wear_the_lock_out(tmp_path: Path) -> None:
    """Each refused start probes the holder (a connect); the holder answers on its loop, so the 30th
    second daemon is refused as the first was, not taken for a stranger's socket with a full queue."""
    held = InstanceLock(str(tmp_path))
    assert held.acquire()
    try:
        for _ in range(30):
            # In a thread, as another process would: the holder's loop runs meanwhile.
            assert await asyncio.to_thread(InstanceLock(str(tmp_path)).acquire) is False
    finally:
        held.release()
    again = InstanceLock(str(tmp_path))
    assert again.acquire()
    again.release()


async def test_another_directory_has_its_own_lock(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = InstanceLock(str(tmp_path / "a")), InstanceLock(str(tmp_path / "b"))
    assert first.acquire()
    try:
        assert second.acquire()
        second.release()
    finally:
        first.release()


def test_name_is_the_directory_or_a_digest_of_a_long_one(tmp_path: Path) -> None:
    """The name shows the directory (as ``ss -xl`` lists it); a path too long for an abstract name is
    named by its digest, and two such paths still get two names; a symlink gets its target's."""
    assert lock_name("/var/lib/kubelet/device-plugins") == b"\0ate-devplugd//var/lib/kubelet/device-plugins"
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert lock_name(str(tmp_path / "link")) == lock_name(str(tmp_path / "real"))
    deep = ["/" + "d" * 60 + "/" + "e" * 60 + f"/{i}" for i in range(2)]
    names = [lock_name(path) for path in deep]
    assert all(name.startswith(b"\0ate-devplugd/sha256:") and len(name) <= 108 for name in names)
    assert names[0] != names[1]


def test_each_mode_locks_the_directory_it_serves_in() -> None:
    """Device-plugin mode: kubelet's device-plugin directory. DRA mode: the driver's own plugin directory
    (where its dra.sock is), never kubelet's device-plugin directory, which it does not serve in."""
    dra = DraConfig(node_name="node-1", driver="kvm.ate.dev", kubelet_dir="/k")
    device_plugin = Config(plugin_dir="/k/device-plugins", dra=dra)
    assert InstanceLock.of(device_plugin).directory == "/k/device-plugins"
    lock = InstanceLock.of(Config(plugin_dir="/k/device-plugins", mode="dra", dra=dra))
    assert (lock.directory, lock.name) == ("/k/plugins/kvm.ate.dev", b"\0ate-devplugd//k/plugins/kvm.ate.dev")
    other_driver = DraConfig(node_name="node-1", driver="vhost.ate.dev", kubelet_dir="/k")
    assert InstanceLock.of(Config(mode="dra", dra=other_driver)).name != lock.name


class TestMakePluginDir:
    def test_made_0750(self, tmp_path: Path) -> None:
        """A missing directory is made with kubelet's mode, its parents too."""
        make_plugin_dir(str(tmp_path / "a" / "device-plugins"))
        assert (tmp_path / "a" / "device-plugins").stat().st_mode & 0o777 == 0o750

    def test_read_only_is_waited_for_not_refused(self, tmp_path: Path) -> None:
        """A read-only file system may be writable later (a remount): no error, the sessions wait."""
        if os.geteuid() != 0:
            pytest.skip("a read-only bind mount needs root")
        (tmp_path / "device-plugins").mkdir()
        with read_only_bind(tmp_path / "device-plugins"):
            make_plugin_dir(str(tmp_path / "device-plugins"))
            make_plugin_dir(str(tmp_path / "device-plugins" / "sub"))

    def test_permission_bits_refuse_a_user_that_is_not_root(self, tmp_path: Path) -> None:
        """Permission denied does not pass by itself: NoPermissionError, naming the directory."""
        if os.geteuid() == 0:
            pytest.skip("root passes the permission bits (tests/integration/test_not_root.py drops root)")
        (tmp_path / "device-plugins").mkdir(mode=0o555)
        plugin_dir = tmp_path / "device-plugins"
        with pytest.raises(NoPermissionError, match=re.escape(f"cannot write {plugin_dir}: permission denied")):
            make_plugin_dir(str(plugin_dir))
        with pytest.raises(NoPermissionError, match=re.escape(f"cannot create {plugin_dir}/sub: permission denied")):
            make_plugin_dir(str(tmp_path / "device-plugins" / "sub"))
