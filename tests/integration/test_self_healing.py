"""What the daemon puts back by itself, in process against the fake kubelet (modelled on kubelet's device
manager, A7b): our CDI spec removed or broken on disk, and kubelet, still running, dropping the resource
any number of times."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

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
