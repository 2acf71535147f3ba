"""asyncio tasks: the daemon run in this process, so that its tasks can be counted.

The subprocess tests count fds, threads and memory; tasks are only visible from inside the loop. Here
the daemon (with a table standing in for the kernel, no udev monitor) and the fake kubelet share one
loop: after each burst of kubelet restarts, socket removals and reloads has settled, the loop holds
exactly as many tasks as in the same settled state before it. No root needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

from tests.fault.harness import SOCKET, assert_one_current_registration, scale, settled
from tests.support import FakeKernel, daemon_in_process, kvm_config, started_kubelet


def task_names() -> list[str]:
    return sorted(
        t.get_name().split(" ")[0] if t.get_name().startswith("session") else "other" for t in asyncio.all_tasks()
    )


async def test_tasks_do_not_accumulate(plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
    """Kubelet restarts, our socket removed, reloads with a changed count: the task count comes back."""
    rng = random.Random(plugin_dir.parent.name)
    counts = iter([4096, 64] * 1000)
    current = next(counts)
    kubelet = await started_kubelet(plugin_dir)
    config = kvm_config(plugin_dir, fake_root, current)
    try:
        async with daemon_in_process(
            config, kernel, reload_config=lambda: kvm_config(plugin_dir, fake_root, current)
        ) as running:
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
                    running.daemon.request_reload()
                await settled(kubelet, quiet=0.3)
                assert_one_current_registration(kubelet, healthy=current, total=current)
                now = len(asyncio.all_tasks())
                assert now == baseline, (action, baseline, now, task_names())
            print(f"leak-check asyncio-tasks: {rounds} rounds; tasks {baseline}->{len(asyncio.all_tasks())}")
            assert await running.stop() == 0
        assert not (plugin_dir / SOCKET).exists()
    finally:
        await kubelet.stop()
