"""What the daemon puts back by itself, in process against the fake kubelet (modelled on kubelet's device
manager, A7b): our CDI spec removed or broken on disk, and kubelet, still running, dropping the resource
any number of times."""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import pytest

from ate_devplugd.deviceplugin import drops
from ate_devplugd.node.cdi import EVENT_RESTORED
from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import settled
from tests.support import RESOURCE, FakeKernel, daemon_in_process, kvm_config, wait_for_content


async def test_spec_removed_is_written_back_and_allocatable_never_drops(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """Our spec removed, then its whole directory: each written back at once (one warning each, counted);
    kubelet is told nothing new, and its allocatable stays 4096 throughout."""
    kubelet = FakeKubelet(plugin_dir, seed=11)
    await kubelet.start()
    metrics = tmp_path / "metrics.prom"
    config = kvm_config(plugin_dir, fake_root, metrics_file=metrics, cdi=True)
    spec = Path(config.cdi_dir) / "ate.dev-kvm.json"
    loop = asyncio.get_running_loop()
    try:
        async with daemon_in_process(config, kernel) as running:
            await kubelet.next_event("list")
            written = spec.read_bytes()
            await settled(kubelet)
            removed_at = loop.time()
            spec.unlink()
            record = await running.events.wait_for(EVENT_RESTORED, timeout=5)
            took = loop.time() - removed_at
            print(f"our spec removed: written back {took * 1e3:.0f} ms later")
            assert record.levelno == logging.WARNING and "was removed" in record.getMessage()
            assert spec.read_bytes() == written
            for path in Path(config.cdi_dir).iterdir():
                path.unlink()
            Path(config.cdi_dir).rmdir()
            record = await running.events.wait_for(EVENT_RESTORED, timeout=5)
            assert "made again" in record.getMessage() and spec.read_bytes() == written
            await wait_for_content(metrics, f'ate_devplugd_cdi_spec_rewrites_total{{resource="{RESOURCE}"}} 2\n')
            seen = kubelet.drain()
            assert all(ev.healthy == 4096 for ev in seen if ev.kind == "list"), seen
            assert not [ev for ev in seen if ev.kind in ("register", "stream-ended", "disconnected")], seen
            assert kubelet.allocatable(RESOURCE) == 4096
    finally:
        await kubelet.stop()


async def dropped(kubelet: FakeKubelet) -> float:
    """kubelet, still running, drops the resource (its client's stream ends: A7b's disconnect); the loop
    time it did."""
    await kubelet.cut(kubelet.endpoints[RESOURCE])
    await kubelet.next_event("disconnected", resource=RESOURCE)
    assert kubelet.allocatable(RESOURCE) == 0
    return asyncio.get_running_loop().time()


async def test_three_drops_in_one_kubelet_life_each_healed(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three kubelet-side drops in one kubelet life: each healed by one Register (allocatable back to 4096
    each time), each warned of with its number and counted; `registered` is 0 while kubelet offers none."""
    monkeypatch.setattr(drops, "STREAM_GRACE", 0.3)
    kubelet = FakeKubelet(plugin_dir, seed=12)
    await kubelet.start()
    metrics = tmp_path / "metrics.prom"
    registered = f'ate_devplugd_registered{{resource="{RESOURCE}"}} '
    loop = asyncio.get_running_loop()
    try:
        async with daemon_in_process(kvm_config(plugin_dir, fake_root, metrics_file=metrics), kernel) as running:
            await kubelet.next_event("list")
            await wait_for_content(metrics, registered + "1\n")
            for n in (1, 2, 3):
                cut_at = await dropped(kubelet)
                if n == 1:
                    await wait_for_content(metrics, registered + "0\n")
                record = await running.events.wait_for("reregister", timeout=30)
                assert record.levelno == logging.WARNING and f"drop {n} with this kubelet" in record.getMessage()
                await kubelet.next_event("register")
                lst = await kubelet.next_event("list")
                print(f"drop {n}: allocatable back {(loop.time() - cut_at) * 1e3:.0f} ms after it")
                assert lst.healthy == 4096 and kubelet.allocatable(RESOURCE) == 4096
            seen = await settled(kubelet)
            assert not [ev for ev in seen if ev.kind == "register"], seen
            assert len([e for e in kubelet.history if e.kind == "register"]) == 4
            assert len(running.events.named("reregister")) == 3
            assert not [e for e in kubelet.history if e.kind == "double-register"]
            await wait_for_content(metrics, f'ate_devplugd_reregistrations_total{{resource="{RESOURCE}"}} 3\n')
            await wait_for_content(metrics, registered + "1\n")
            assert running.daemon.status_line() == "ate.dev/kvm: 4096/4096 healthy, registered"
    finally:
        await kubelet.stop()


async def test_a_kubelet_that_keeps_dropping_is_retried_with_growing_delays(
    plugin_dir: Path, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubelet drops the resource as soon as each stream opens: registered once more each time, the wait
    before each doubling (grace, 2x, 4x, 8x): healed without end, never hammered."""
    monkeypatch.setattr(drops, "STREAM_GRACE", 0.15)
    kubelet = FakeKubelet(plugin_dir, seed=13)
    await kubelet.start()
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    try:
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await kubelet.next_event("list")
            for _ in range(5):
                cut_at = await dropped(kubelet)
                await kubelet.next_event("register", timeout=30)
                waits.append(loop.time() - cut_at)
                await kubelet.next_event("list")
            print("waits before each Register: " + ", ".join(f"{w * 1e3:.0f} ms" for w in waits))
            for n, wait in enumerate(waits):
                assert wait >= 0.15 * 2**n * 0.95, waits
            assert all(later > 1.5 * earlier for earlier, later in itertools.pairwise(waits)), waits
            assert len(running.events.named("reregister")) == 5
    finally:
        await kubelet.stop()
