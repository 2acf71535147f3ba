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
from tests.support import (
    Udevd,
    assert_vms_made_no_hint,
    daemon,
    kvm_uevent,
    make_kvm_node,
    started_kubelet,
    subprocess_env,
    vm_storm_then_removal,
    wait_for_content,
    write_config,
)


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
    """A running udevd for these tests (``tests.support.Udevd``)."""
    if not Udevd.can_start():
        pytest.skip("udevd is not installed (apt-get install udev) or not root")
    udevd = Udevd()
    try:
        udevd.start()
        asyncio.run(udevd.ready())
        yield
    finally:
        udevd.stop()


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

    async def test_vm_announcements_through_udevd(
        self, udevd: None, tmp_path: Path, plugin_dir: Path, dev_root: Path
    ) -> None:
        """udevd re-sends each of KVM's VM announcements after its rules: the socket filter drops those
        too, so 300 VMs started and stopped make the daemon look again for none of them."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                # udevd handles one device's events in order: our change comes after its announcements.
                log, other_kvm = await vm_storm_then_removal(kubelet, proc, dev_root, 300, udev_change_kvm)
        finally:
            await kubelet.stop()
        assert "following kernel uevents" not in log, "the daemon should use udevd's events"
        assert_vms_made_no_hint(log, other_kvm)

    async def test_udev_touching_the_node_is_not_a_new_node(
        self, udevd: None, tmp_path: Path, plugin_dir: Path
    ) -> None:
        """On each event udevd applies the kvm rule again (group, mode) and touches the node: its ctime
        moves. The daemon, looking at the host's own /dev/kvm after each change, finds the same device:
        no device event, the CDI spec and the metrics file stay as they were."""
        kubelet = await started_kubelet(plugin_dir)
        devices = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\nprobe = "kvm"\ncdi = true\n'
        metrics = tmp_path / "m.prom"
        cfg = write_config(tmp_path / "c.toml", plugin_dir, Path("/"), devices, metrics_file=metrics)
        spec = tmp_path / "cdi" / "ate.dev-kvm.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ate_devplugd", "run", "--config", str(cfg), "--log-target", "console",
            "--log-level", "debug", stderr=asyncio.subprocess.PIPE, env=subprocess_env(),
        )  # fmt: skip
        assert proc.stderr is not None
        lines: list[str] = []

        async def next_hint() -> None:
            assert proc.stderr is not None
            async with asyncio.timeout(10):
                while " uevent change misc/kvm" not in (line := (await proc.stderr.readline()).decode()):
                    assert line, "the daemon ended"
                    lines.append(line)

        try:
            assert (await kubelet.next_event("list")).healthy == 4096
            # the metrics file at rest: kubelet watching and the runtime's verdict in (each a change)
            await wait_for_content(metrics, 'ate_devplugd_listandwatch_streams{resource="ate.dev/kvm"} 1\n')
            await wait_for_content(metrics, 'verdict="unknown"} 1\n')
            before = [os.stat(p) for p in ("/dev/kvm", spec, metrics)]
            for _ in range(5):
                await asyncio.to_thread(udev_change_kvm)
                await next_hint()
            after = [os.stat(p) for p in ("/dev/kvm", spec, metrics)]
        finally:
            proc.send_signal(signal.SIGTERM)
            await proc.communicate()
            await kubelet.stop()
        assert after[0].st_ctime_ns > before[0].st_ctime_ns, "udevd should have touched /dev/kvm"
        for old, new in zip(before[1:], after[1:], strict=True):
            assert (new.st_ino, new.st_mtime_ns) == (old.st_ino, old.st_mtime_ns)
        looked = "".join(lines[next(i for i, line in enumerate(lines) if "ready" in line) :])
        assert "event=device-" not in looked, looked
