"""Advertised means usable, end to end: the daemon between the fake kubelet (or, in DRA mode, the fake
API server) and a fake CRI runtime, with real gRPC on real unix sockets. A device that needs CDI is
withheld when the runtime will not give it to a container (CDI off, a conflicting spec) and offered
again when it will, each within a bound.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from ate_devplugd.commands.probe import deviceplugin as nodeprobe
from ate_devplugd.cri.usable import EVENT_OFFERED, EVENT_WITHHELD, HOLD
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.fakes.kubelet import FakeKubelet
from tests.integration.dra_rig import dra_node
from tests.support import FakeKernel, daemon_in_process, kvm_config, started_kubelet, wait_for_content

RESOURCE = "ate.dev/kvm"
#: From the runtime's change to what kubelet (or the API server) sees: the hold, and some room.
BOUND = HOLD + 1.0


def other_spec() -> str:
    node = {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}
    return json.dumps(
        {
            "cdiVersion": "0.6.0",
            "kind": RESOURCE,
            "devices": [{"name": "kvm", "containerEdits": {"deviceNodes": [node]}}],
        }
    )


async def restarted(old: FakeRuntime, enable_cdi: bool, dirs: list[str]) -> FakeRuntime:
    """The runtime started again with another config: its socket created anew (the daemon follows it)."""
    await old.stop()
    with contextlib.suppress(FileNotFoundError):
        old.socket.unlink()
    return await FakeRuntime(old.socket, "containerd", "1.7.24", containerd_info(enable_cdi, dirs)).start()


async def allocatable(kubelet: FakeKubelet, want: int, timeout: float) -> float:
    """Seconds until kubelet's latest list offers ``want`` Healthy units."""
    began = time.monotonic()
    while kubelet.allocatable(RESOURCE) != want:
        await kubelet.next_event("list", resource=RESOURCE, timeout=timeout)
    return time.monotonic() - began


class TestDevicePluginMode:
    async def test_required_device_and_cdi_off(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """cdi = "required", a runtime with CDI off: allocatable 0 within the bound, STATUS and the event say
        why; the runtime fixed: 4096 again. Capacity (the units listed) stays."""
        prom = tmp_path / "m.prom"
        config = kvm_config(plugin_dir, fake_root, cdi=True, cdi_required=True, metrics_file=prom)
        cdi = [config.cdi_dir]
        runtime = await FakeRuntime(Path(config.runtime_socket), "containerd", "1.7.24", containerd_info(False)).start()
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await allocatable(kubelet, 4096, 10)  # offered at first: the runtime is asked after READY
                verdict = await running.events.wait_for("cdi-not-applied")
                await allocatable(kubelet, 0, BOUND)
                took = time.time() - verdict.created
                print(f"withheld {1000 * took:.0f} ms after the verdict")
                assert HOLD * 0.9 <= took <= BOUND
                assert len(kubelet.endpoints[RESOURCE].latest.devices) == 4096
                event = await running.events.wait_for(EVENT_WITHHELD)
                assert event.levelname == "WARNING" and "cdi-not-applied" in event.getMessage()
                assert "withheld: cdi-not-applied" in running.daemon.status_line()
                await wait_for_content(
                    prom, 'ate_devplugd_device_withheld{reason="cdi-not-applied",resource="ate.dev/kvm"} 1'
                )
                text = prom.read_text()
                assert 'ate_devplugd_device_usable{resource="ate.dev/kvm"} 0' in text
                assert 'ate_devplugd_device_healthy{resource="ate.dev/kvm"} 1' in text  # the device works
                assert 'ate_devplugd_healthy_units{resource="ate.dev/kvm"} 0' in text
                (row,) = await nodeprobe.probe_all(str(plugin_dir), {"ate.dev-kvm.sock": RESOURCE}, 3, str(prom))
                assert (row.healthy, row.total, row.grants) == (0, 4096, "(withheld: cdi-not-applied; no unit offered)")
                begin = time.monotonic()
                runtime = await restarted(runtime, True, cdi)
                await allocatable(kubelet, 4096, BOUND + 1)
                print(f"offered again {1000 * (time.monotonic() - begin):.0f} ms after the runtime's restart")
                await running.events.wait_for(EVENT_OFFERED)
                assert "withheld: " not in running.daemon.status_line()
                await wait_for_content(prom, 'ate_devplugd_device_usable{resource="ate.dev/kvm"} 1')
                assert len(running.events.named(EVENT_WITHHELD)) == 1
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_plain_cdi_is_not_withheld_for_cdi_off(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """cdi = true with no container owner or mode: a root VMM gets the node from the DeviceSpec, so a
        runtime with CDI off withholds nothing (checked past the hold, on kubelet's own events)."""
        config = kvm_config(plugin_dir, fake_root, cdi=True)
        runtime = await FakeRuntime(Path(config.runtime_socket), "containerd", "1.7.24", containerd_info(False)).start()
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await allocatable(kubelet, 4096, 10)
                await running.events.wait_for("cdi-not-applied")
                with contextlib.suppress(TimeoutError):
                    await kubelet.next_event("list", resource=RESOURCE, timeout=BOUND)
                assert kubelet.allocatable(RESOURCE) == 4096
                assert not running.events.named(EVENT_WITHHELD)
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_conflicting_spec_dropped_in_and_removed(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A second spec defining ate.dev/kvm=kvm in the runtime's (our) spec directory: the runtime drops
        the name, so the device is withheld (plain cdi = true); removed: offered again."""
        config = kvm_config(plugin_dir, fake_root, cdi=True)
        runtime = await FakeRuntime(
            Path(config.runtime_socket), "containerd", "1.7.24", containerd_info(True, [config.cdi_dir])
        ).start()
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await running.events.wait_for("cdi-runtime")
                await allocatable(kubelet, 4096, 10)
                other = Path(config.cdi_dir) / "other.json"
                began = time.monotonic()
                other.write_text(other_spec())
                await allocatable(kubelet, 0, BOUND)
                print(f"withheld {1000 * (time.monotonic() - began):.0f} ms after the conflicting spec")
                assert "withheld: spec-conflict" in running.daemon.status_line()
                assert "spec-conflict" in (await running.events.wait_for(EVENT_WITHHELD)).getMessage()
                began = time.monotonic()
                other.unlink()
                await allocatable(kubelet, 4096, BOUND)
                print(f"offered again {1000 * (time.monotonic() - began):.0f} ms after it was removed")
        finally:
            await kubelet.stop()
            await runtime.stop()


class TestDraMode:
    async def test_cdi_off_and_a_conflicting_spec_take_the_device_out_of_the_slice(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """DRA mode (CDI is its only path): a runtime with CDI off, then a conflicting spec: the device is
        out of the node's slice, and back each time the runtime can give it to a container."""
        async with dra_node(kernel, fake_root) as node:
            await node.status("slice published (128 devices)")
            socket = Path(node.config.runtime_socket)
            cdi = [node.config.cdi_dir]
            runtime = await FakeRuntime(socket, "containerd", "1.7.24", containerd_info(False, cdi)).start()
            try:
                await node.status("withheld: cdi-not-applied")
                await node.status("slice published (no device offered)")
                assert node.api.node_slices()[0]["spec"]["devices"] == []
                runtime = await restarted(runtime, True, cdi)
                await node.status("slice published (128 devices)")
                assert len(node.api.node_slices()[0]["spec"]["devices"]) == 128
                other = Path(node.config.cdi_dir) / "other.json"
                other.write_text(other_spec())
                await node.status("withheld: spec-conflict")
                await node.status("slice published (no device offered)")
                assert node.api.node_slices()[0]["spec"]["devices"] == []
                other.unlink()
                status = await node.status("slice published (128 devices)")
                assert "withheld: " not in status
                assert len(node.api.node_slices()[0]["spec"]["devices"]) == 128
                assert [r.levelname for r in node.running.events.named("dra-device-unhealthy")] == ["INFO"] * 2
                text = node.running.events.named("dra-device-unhealthy")[0].getMessage()
                assert "vanished" not in text and "withheld: cdi-not-applied" in text
            finally:
                await runtime.stop()
