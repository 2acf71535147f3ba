"""Advertised means usable, against real containerd 1.7 and 2.1: what the fake kubelet is offered follows
whether a pod could get the device (cri/usable.py).

- ``cdi = "required"`` with containerd started with ``enable_cdi = false``: allocatable 0 within a bound
  of the verdict; containerd restarted with it on: 4096 again within a bound.
- ``cdi = true`` with a second spec defining ``ate.dev/kvm=kvm`` dropped into the spec directory
  containerd reads (ours): withheld; removed: offered again. (That such a spec fails the container is
  proven in ``test_runtime_cdi_containerd.py`` ``TestConflictingSpec``.)

They need root and containerd; they skip without them (``make runtimes`` provides both series).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from ate_devplugd.config import Config
from ate_devplugd.cri.usable import EVENT_OFFERED, EVENT_WITHHELD, HOLD
from ate_devplugd.node.kernel import UdevKernelView
from tests.fakes.kubelet import FakeKubelet
from tests.runtimes.containerd import Containerd, require
from tests.support import RESOURCE, daemon_in_process, kvm_config, started_kubelet

#: From what the daemon hears to what kubelet is offered: the hold, and room for a shared machine.
BOUND = HOLD + 1.0
#: A containerd start (its CRI service answering) takes a few seconds here.
START = 30.0
CONFLICTING_SPEC = {
    "cdiVersion": "0.6.0",
    "kind": RESOURCE,
    "devices": [{"name": "kvm", "containerEdits": {"deviceNodes": [{"path": "/dev/kvm"}]}}],
}


def daemon_config(tmp_path: Path, socket: Path, **device: object) -> Config:
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    config = kvm_config(plugin_dir, Path("/"), **device)
    return dataclasses.replace(config, dev_root="/", runtime_socket=str(socket))


async def offered(kubelet: FakeKubelet, want: int, timeout: float) -> float:
    """Seconds until kubelet's latest ListAndWatch offers ``want`` Healthy units."""
    began = time.monotonic()
    while kubelet.allocatable(RESOURCE) != want:
        await kubelet.next_event("list", resource=RESOURCE, timeout=timeout)
    return time.monotonic() - began


@pytest.mark.parametrize("series", ["1.7", "2.1"])
class TestRealContainerd:
    async def test_required_device_enable_cdi_false_then_fixed(self, series: str, tmp_path: Path) -> None:
        build = require(series)
        cdi = tmp_path / "cdi"
        workdir = tmp_path / "containerd"
        rt = await Containerd.start(build, workdir, enable_cdi=False, cdi_spec_dirs=[cdi])
        config = daemon_config(tmp_path, rt.socket, cdi=True, cdi_required=True)
        kubelet = await started_kubelet(Path(config.plugin_dir))
        try:
            async with daemon_in_process(config, UdevKernelView()) as running:
                await offered(kubelet, 4096, 10)  # at first: the runtime is asked once the daemon is ready
                verdict = await running.events.wait_for("cdi-not-applied", timeout=START)
                await offered(kubelet, 0, BOUND)
                took = time.time() - verdict.created
                assert HOLD * 0.9 <= took <= BOUND
                assert len(kubelet.endpoints[RESOURCE].latest.devices) == 4096  # capacity stays
                assert "cdi-not-applied" in (await running.events.wait_for(EVENT_WITHHELD)).getMessage()
                await rt.stop()
                rt = await Containerd.start(build, workdir, enable_cdi=True, cdi_spec_dirs=[cdi])
                verdict = await running.events.wait_for("cdi-runtime", timeout=START)
                await offered(kubelet, 4096, BOUND)
                back = time.time() - verdict.created
                await running.events.wait_for(EVENT_OFFERED)
                print(f"containerd {build.version}: withheld {1000 * took:.0f} ms after enable_cdi = false was "
                      f"heard, offered {1000 * back:.0f} ms after enable_cdi = true was")  # fmt: skip
        finally:
            await kubelet.stop()
            await rt.stop()

    async def test_conflicting_spec_dropped_in_and_removed(self, series: str, tmp_path: Path) -> None:
        build = require(series)
        cdi = tmp_path / "cdi"
        rt = await Containerd.start(build, tmp_path / "containerd", enable_cdi=True, cdi_spec_dirs=[cdi])
        config = daemon_config(tmp_path, rt.socket, cdi=True)
        kubelet = await started_kubelet(Path(config.plugin_dir))
        try:
            async with daemon_in_process(config, UdevKernelView()) as running:
                await running.events.wait_for("cdi-runtime", timeout=START)
                await offered(kubelet, 4096, BOUND)
                other = cdi / "other.json"
                began = time.monotonic()
                other.write_text(json.dumps(CONFLICTING_SPEC))
                await offered(kubelet, 0, BOUND)
                took = time.monotonic() - began
                assert "withheld: spec-conflict" in running.daemon.status_line()
                began = time.monotonic()
                other.unlink()
                await offered(kubelet, 4096, BOUND)
                back = time.monotonic() - began
                print(f"containerd {build.version}: withheld {1000 * took:.0f} ms after the conflicting spec, "
                      f"offered {1000 * back:.0f} ms after it went")  # fmt: skip
        finally:
            await kubelet.stop()
            await rt.stop()
