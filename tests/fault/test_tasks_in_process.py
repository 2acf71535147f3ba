"""asyncio tasks: the daemon run in this process, so that its tasks can be counted.

The subprocess tests count fds, threads and memory; tasks are only visible from inside the loop. Here
the daemon (with a stand-in for sysfs, no udev monitor) and the fake kubelet share one loop: after each
burst of kubelet restarts, socket removals and reloads has settled, the loop holds exactly as many
tasks as in the same settled state before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from pathlib import Path

import pytest

from ate_devplugd.config import Config, DeviceConfig
from ate_devplugd.daemon import Daemon
from tests.fault.harness import SOCKET, assert_one_current_registration, scale, settled
from tests.support import started_kubelet


class KvmOnly:
    """The kernel's view, for the one kvm node."""

    def devnode(self, major: int, minor: int) -> str | None:
        return "/dev/kvm" if (major, minor) == (10, 232) else None

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        return None


def kvm_config(plugin_dir: Path, dev_root: Path, count: int = 4096) -> Config:
    return Config(
        plugin_dir=str(plugin_dir),
        dev_root=str(dev_root),
        devices=(DeviceConfig("ate.dev/kvm", "/dev/kvm", count=count),),
    )


def task_names() -> list[str]:
    return sorted(
        t.get_name().split(" ")[0] if t.get_name().startswith("session") else "other" for t in asyncio.all_tasks()
    )


async def test_tasks_do_not_accumulate(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """Kubelet restarts, our socket removed, reloads with a changed count: the task count comes back."""
    if os.stat(dev_root / "dev" / "kvm").st_rdev != os.makedev(10, 232):
        pytest.skip("the stand-in kernel view knows only 10:232")
    rng = random.Random(tmp_path.name)
    counts = iter([4096, 64] * 1000)
    current = next(counts)
    kubelet = await started_kubelet(plugin_dir)
    daemon = Daemon(
        kvm_config(plugin_dir, dev_root, current),
        reload_config=lambda: kvm_config(plugin_dir, dev_root, current),
        kernel=KvmOnly(),
    )
    run = asyncio.get_running_loop().create_task(daemon.run())
    try:
        await settled(kubelet, quiet=0.3)
        baseline = len(asyncio.all_tasks())
        rounds = scale(10, 100)
        for _ in range(rounds):
            action = rng.choice(["restart", "restart", "unlink", "reload"])
            if action == "restart":
                for _ in range(rng.randint(1, 4)):
                    await kubelet.restart()
            elif action == "unlink":
                with contextlib.suppress(FileNotFoundError):
                    (plugin_dir / SOCKET).unlink()
            else:
                current = next(counts)
                daemon.request_reload()
            await settled(kubelet, quiet=0.3)
            assert_one_current_registration(kubelet, healthy=current, total=current)
            now = len(asyncio.all_tasks())
            assert now == baseline, (action, baseline, now, task_names())
        print(f"leak-check asyncio-tasks: {rounds} rounds; tasks {baseline}->{len(asyncio.all_tasks())}")
        daemon.request_stop()
        async with asyncio.timeout(10):
            assert await run == 0
        assert not (plugin_dir / SOCKET).exists()
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        await kubelet.stop()
