"""journald records as operators filter them, and hotplug through a real udevd with real uevents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.journald import capture_command
from tests.fakes.kubelet import FakeKubelet
from tests.support import kvm_uevent, make_kvm_node, subprocess_env, wait_for_path, write_config

UDEVD = Path("/lib/systemd/systemd-udevd")
UDEV_CONTROL = Path("/run/udev/control")


class TestJournal:
    async def test_records_carry_ate_fields(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """Under --log-target journal every event has ATE_EVENT (and ATE_RESOURCE where it applies),
        a PRIORITY and the identifier; filtering by the fields tells one resource's story."""
        if shutil.which("unshare") is None or os.geteuid() != 0:
            pytest.skip("needs unshare and root for a private /run/systemd")
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        out = tmp_path / "journal.json"
        cmd = capture_command(
            str(out),
            sys.executable,
            "-m",
            "ate_devplugd",
            "run",
            "--config",
            str(cfg),
            "--log-target",
            "journal",
        )
        proc = await asyncio.create_subprocess_exec(*cmd, env=subprocess_env())
        try:
            await kubelet.next_event("list")
            await kubelet.restart()
            await kubelet.next_event("list")
            (dev_root / "dev" / "kvm").unlink()
            kvm_uevent()
            assert (await kubelet.next_event("list")).healthy == 0
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                assert await proc.wait() == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await kubelet.stop()
        records = json.loads(out.read_text())
        assert all(r["SYSLOG_IDENTIFIER"] == "ate-devplugd" and r["PRIORITY"].isdigit() for r in records)
        kvm = [r for r in records if r.get("ATE_RESOURCE") == "ate.dev/kvm"]
        story = [r["ATE_EVENT"] for r in kvm]
        for expected in ("device-added", "registered", "kubelet-restart", "device-removed"):
            assert expected in story, story
        assert story.index("device-added") < story.index("registered") < story.index("kubelet-restart")
        registered = [r for r in records if r.get("ATE_EVENT") == "registered"]
        assert len(registered) == 2
        assert all(r["ATE_DEVICE"] == "/dev/kvm" and r["PRIORITY"] == "6" for r in registered)
        removed = next(r for r in kvm if r["ATE_EVENT"] == "device-removed")
        assert removed["PRIORITY"] == "4" and "does not exist" in removed["MESSAGE"]
        assert any(r.get("ATE_EVENT") == "stopping" for r in records)


@pytest.fixture(scope="module")
def udevd() -> Iterator[None]:
    """A running udevd: the host's if there is one, else one started for these tests and stopped after.

    Starting udevd changes nothing by itself (no coldplug is triggered); the change events the tests
    send for kvm may re-apply its rules, so /dev/kvm's mode and group are restored afterwards.
    """
    if UDEV_CONTROL.exists():
        yield
        return
    if not UDEVD.exists() or os.geteuid() != 0:
        pytest.skip("udevd is not installed (apt-get install udev) or not root")
    kvm = Path("/dev/kvm")
    saved = kvm.stat() if kvm.exists() else None
    proc = subprocess.Popen([str(UDEVD)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_for_path(UDEV_CONTROL, timeout=20))
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree("/run/udev", ignore_errors=True)
        if saved is not None and kvm.exists():
            os.chown(kvm, saved.st_uid, saved.st_gid)
            os.chmod(kvm, saved.st_mode & 0o7777)


def udev_change_kvm() -> None:
    """A real udev event: udevadm asks the kernel for a change uevent, udevd runs rules and broadcasts it."""
    subprocess.run(["udevadm", "trigger", "--action=change", "--sysname-match=kvm"], check=True)


class TestUdevHotplug:
    async def test_vanish_and_return_through_udevd(
        self, udevd: None, tmp_path: Path, plugin_dir: Path, dev_root: Path
    ) -> None:
        """With udevd running, udev-source events (after rules) drive Unhealthy and Healthy, 20 times."""
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        env = subprocess_env()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ate_devplugd",
            "run",
            "--config",
            str(cfg),
            "--log-target",
            "console",
            "--log-level",
            "debug",
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            first = await kubelet.next_event("list")
            assert first.healthy == 4096
            loop = asyncio.get_running_loop()
            delays = []
            for _ in range(20):
                (dev_root / "dev" / "kvm").unlink()
                start = loop.time()
                await asyncio.to_thread(udev_change_kvm)
                gone = await kubelet.next_event("list")
                delays.append(loop.time() - start)
                assert (gone.healthy, gone.ids) == (0, first.ids)
                make_kvm_node(dev_root)
                await asyncio.to_thread(udev_change_kvm)
                assert (await kubelet.next_event("list")).healthy == 4096
            delays.sort()
            print(
                f"udev change -> kubelet sees Unhealthy: median {delays[10] * 1000:.1f} ms (includes running udevadm)"
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await proc.communicate()
            await kubelet.stop()
        assert b"following kernel uevents" not in err, "the daemon should use udevd's events"
