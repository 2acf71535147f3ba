"""The instance lock: one daemon per plugin directory, however many second daemons were refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ate_devplugd.lock import InstanceLock, lock_name


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
