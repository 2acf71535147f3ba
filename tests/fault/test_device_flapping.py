"""The device node flapping: removed and re-created again and again, with real kernel uevents.

Cycles come in three kinds: settled (remove, uevent, wait for kubelet to see Unhealthy; re-create,
uevent, wait for Healthy), bursts (several remove/re-create pairs with their uevents, faster than the
daemon reacts) and lost events (remove/re-create with no uevent at all). After every group the node is
left present or absent at random and one uevent is sent: kubelet's last list must then match the node,
and nothing may contradict it while the test holds that state.

Throughout, kubelet must never see Healthy for a node that was absent for the whole of the preceding
LAG seconds (a list already on its way when the node went is allowed, a stale one is not); every list
keeps all 4096 IDs. Nothing leaks.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import (
    RESOURCE,
    SOCKET,
    ProcFigures,
    assert_no_leak,
    assert_one_current_registration,
    daemon_log_clean,
    expected_ids,
    scale,
    settled,
    sockets_in,
)
from tests.support import daemon, kvm_uevent, make_kvm_node, started_kubelet, write_config

CYCLES = scale(100, 1000)
#: The most a list may lag behind the node: a Healthy list for a node absent longer than this is wrong.
LAG = 1.0
#: After a checkpoint's uevent, nothing may contradict the node's state for this long.
QUIET = 0.15


class Node:
    """The mknod'ed node, with the times it was present (time.monotonic(), the fake kubelet's clock)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "dev" / "kvm"
        self.present_since: float | None = time.monotonic()
        self.intervals: list[tuple[float, float]] = []

    def remove(self) -> None:
        self.path.unlink()
        assert self.present_since is not None
        self.intervals.append((self.present_since, time.monotonic()))
        self.present_since = None

    def create(self) -> None:
        make_kvm_node(self.root)
        self.present_since = time.monotonic()

    @property
    def present(self) -> bool:
        return self.present_since is not None

    def present_within(self, start: float, end: float) -> bool:
        """Whether the node existed at some moment of [start, end]."""
        if self.present_since is not None and self.present_since <= end:
            return True
        return any(a <= end and b >= start for a, b in self.intervals)


async def latest_health(kubelet: FakeKubelet, healthy: bool, timeout: float = 5.0) -> None:
    """Wait until kubelet's latest list says ``healthy`` and no list has come for QUIET seconds.

    Lists from probes made before the node reached its final state may still be on their way, so a
    list in the quiet window restarts the wait; a daemon that settles wrong, or keeps flipping, times out.
    """
    want = 4096 if healthy else 0
    async with asyncio.timeout(timeout):
        while True:
            endpoint = kubelet.endpoints.get(RESOURCE)
            latest = endpoint.latest if endpoint is not None else None
            if latest is not None and sum(d.health == "Healthy" for d in latest.devices) == want:
                try:
                    await kubelet.next_event("list", timeout=QUIET)
                except TimeoutError:
                    return
                continue
            await kubelet.next_event("list")


def check_lists(kubelet: FakeKubelet, node: Node) -> int:
    """Every list has all IDs; no Healthy list for a node absent over the LAG before it. Returns the count."""
    lists = [e for e in kubelet.history if e.kind == "list"]
    ids = expected_ids()
    for ev in lists:
        assert ev.total == 4096 and ev.ids == ids
        assert ev.healthy in (0, 4096), ev.healthy
        if ev.healthy:
            assert node.present_within(ev.t - LAG, ev.t), f"Healthy list at {ev.t:.3f} for a node absent since"
    return len(lists)


async def test_device_flapping(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """CYCLES remove/re-create cycles (settled, bursts, lost events): right at every checkpoint."""
    rng = random.Random(tmp_path.name)
    kubelet = await started_kubelet(plugin_dir)
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    node = Node(dev_root)
    kinds = {"settled": 0, "burst": 0, "lost": 0}
    try:
        async with daemon(cfg) as proc:
            await settled(kubelet)
            before = ProcFigures.of(proc.pid)
            done = 0
            while done < CYCLES:
                kind = rng.choice(["settled", "burst", "burst", "lost"])
                n = 1 if kind == "settled" else min(rng.randint(2, 12), CYCLES - done)
                kinds[kind] += n
                if kind == "settled":
                    node.remove()
                    kvm_uevent()
                    await latest_health(kubelet, healthy=False)
                    node.create()
                    kvm_uevent()
                    await latest_health(kubelet, healthy=True)
                else:
                    for _ in range(n):
                        node.remove()
                        if kind == "burst":
                            kvm_uevent()
                        node.create()
                        if kind == "burst" and rng.random() < 0.5:
                            kvm_uevent()
                    # the checkpoint: leave the node absent or present, one uevent, kubelet must follow
                    if rng.random() < 0.5:
                        node.remove()
                    kvm_uevent()
                    await latest_health(kubelet, healthy=node.present)
                    if not node.present:
                        node.create()
                        kvm_uevent()
                        await latest_health(kubelet, healthy=True)
                done += n
            count = check_lists(kubelet, node)
            print(f"device flapping: {CYCLES} cycles {kinds}; kubelet got {count} lists")
            assert_one_current_registration(kubelet)
            assert len([e for e in kubelet.history if e.kind == "register"]) == 1
            assert sockets_in(plugin_dir) == {"kubelet.sock", SOCKET}
            assert_no_leak("device-flapping", proc.pid, before, ProcFigures.of(proc.pid), CYCLES)
            assert await proc.stop() == 0
            daemon_log_clean(proc.log())
    finally:
        await kubelet.stop()
        if not node.path.exists():
            os.mknod(node.path, 0o600 | 0o020000, os.makedev(10, 232))


async def test_absent_at_checkpoint_never_healthy(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """The node removed during a burst of change uevents for it: kubelet ends Unhealthy and stays so
    while the node stays away, through more uevents (each a re-probe)."""
    kubelet = await started_kubelet(plugin_dir)
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    node = Node(dev_root)
    try:
        async with daemon(cfg):
            await settled(kubelet)
            for _ in range(scale(6, 100)):
                for _ in range(5):
                    kvm_uevent()
                node.remove()
                for _ in range(5):
                    kvm_uevent()
                await latest_health(kubelet, healthy=False)
                for _ in range(5):  # more hints while absent: re-probes that must all say absent
                    kvm_uevent()
                try:
                    extra = await kubelet.next_event("list", timeout=QUIET)
                except TimeoutError:
                    pass
                else:
                    raise AssertionError(f"kubelet got a list with {extra.healthy} healthy while the node is gone")
                node.create()
                kvm_uevent()
                await latest_health(kubelet, healthy=True)
            check_lists(kubelet, node)
    finally:
        await kubelet.stop()
