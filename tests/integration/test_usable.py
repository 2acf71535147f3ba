"""Advertised means usable, end to end: the daemon between the fake kubelet (or, in DRA mode, the fake
API server) and a fake CRI runtime, with real gRPC on real unix sockets. A device that needs CDI is
withheld the moment the runtime (or the spec on disk) would not give it to a container, and offered
again once that has held; every ListAndWatch answer is recorded, the first included.

The moments (docs/usable.md): the start (the first answer already carries the verdict, a runtime that
never answered withholds, a hung one holds the start for FIRST_VERDICT at most), the runtime away (its
verdict kept), our spec that cannot be written back, and cdi_dir replaced (withheld until the runtime
restarts).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from ate_devplugd.commands.probe import deviceplugin as nodeprobe
from ate_devplugd.cri.check import FIRST_VERDICT
from ate_devplugd.cri.usable import EVENT_OFFERED, EVENT_WITHHELD, HOLD
from ate_devplugd.node.cdi import EVENT_REPLACED
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
    await stopped(old)
    return await started(old.socket, enable_cdi, dirs)


async def stopped(runtime: FakeRuntime) -> None:
    await runtime.stop()
    with contextlib.suppress(FileNotFoundError):
        runtime.socket.unlink()


async def started(socket: Path, enable_cdi: bool, dirs: list[str]) -> FakeRuntime:
    return await FakeRuntime(socket, "containerd", "1.7.24", containerd_info(enable_cdi, dirs)).start()


async def allocatable(kubelet: FakeKubelet, want: int, timeout: float) -> float:
    """Seconds until kubelet's latest list offers ``want`` Healthy units."""
    began = time.monotonic()
    while kubelet.allocatable(RESOURCE) != want:
        await kubelet.next_event("list", resource=RESOURCE, timeout=timeout)
    return time.monotonic() - began


def answers(kubelet: FakeKubelet) -> list[int]:
    """The Healthy units of every ListAndWatch answer kubelet got, in order, the first included."""
    return [ev.healthy for ev in kubelet.history if ev.kind == "list" and ev.resource == RESOURCE]


async def quiet(kubelet: FakeKubelet, seconds: float) -> None:
    """Kubelet's own events for ``seconds`` (longer than a hold: any offer would have come)."""
    with contextlib.suppress(TimeoutError):
        while True:
            await kubelet.next_event("list", resource=RESOURCE, timeout=seconds)


class TestDevicePluginMode:
    async def test_required_device_and_cdi_off(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """cdi = "required", a runtime with CDI off: the first answer kubelet gets has no Healthy unit (the
        verdict is heard before serving), STATUS, the event, the metrics and probe say why; the runtime
        fixed: 4096 after the hold. Capacity (the units listed) stays."""
        prom = tmp_path / "m.prom"
        config = kvm_config(plugin_dir, fake_root, cdi=True, cdi_required=True, metrics_file=prom)
        cdi = [config.cdi_dir]
        runtime = await started(Path(config.runtime_socket), False, cdi)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                first = await kubelet.next_event("list", resource=RESOURCE)
                assert (first.healthy, first.total) == (0, 4096)
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
                took = time.monotonic() - begin
                print(f"offered again {1000 * took:.0f} ms after the runtime's restart")
                assert took >= HOLD
                await running.events.wait_for(EVENT_OFFERED)
                assert "withheld: " not in running.daemon.status_line()
                await wait_for_content(prom, 'ate_devplugd_device_usable{resource="ate.dev/kvm"} 1')
                assert len(running.events.named(EVENT_WITHHELD)) == 1
                seen = answers(kubelet)
                assert seen[0] == 0 and seen[-1] == 4096 and set(seen) == {0, 4096}
                assert seen.index(4096) == len(seen) - seen[::-1].index(0), seen  # never offered in between
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_plain_cdi_is_not_withheld_for_cdi_off(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """cdi = true with no container owner: a root VMM gets the node from the DeviceSpec, so a runtime
        with CDI off withholds nothing (checked past the hold, on kubelet's own events)."""
        config = kvm_config(plugin_dir, fake_root, cdi=True)
        runtime = await started(Path(config.runtime_socket), False, [config.cdi_dir])
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await running.events.wait_for("cdi-not-applied")
                await quiet(kubelet, BOUND)
                assert set(answers(kubelet)) == {4096}
                assert not running.events.named(EVENT_WITHHELD)
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_conflicting_spec_dropped_in_and_removed(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A second spec defining ate.dev/kvm=kvm in the runtime's (our) spec directory: the runtime drops
        the name, so the device is withheld at once (plain cdi = true); removed: offered after the hold."""
        config = kvm_config(plugin_dir, fake_root, cdi=True)
        runtime = await started(Path(config.runtime_socket), True, [config.cdi_dir])
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await allocatable(kubelet, 4096, 10)
                other = Path(config.cdi_dir) / "other.json"
                began = time.monotonic()
                other.write_text(other_spec())
                await allocatable(kubelet, 0, BOUND)
                took = time.monotonic() - began
                print(f"withheld {1000 * took:.0f} ms after the conflicting spec")
                assert took < HOLD  # at once: the scan's coalescing only
                assert "withheld: spec-conflict" in running.daemon.status_line()
                assert "spec-conflict" in (await running.events.wait_for(EVENT_WITHHELD)).getMessage()
                began = time.monotonic()
                other.unlink()
                await allocatable(kubelet, 4096, BOUND)
                print(f"offered again {1000 * (time.monotonic() - began):.0f} ms after it was removed")
        finally:
            await kubelet.stop()
            await runtime.stop()


class TestTheMoments:
    async def test_runtime_away_keeps_its_verdict(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """CDI off, cdi = "required": the runtime's socket gone for three holds, then back with the same
        config: not one Healthy answer; STATUS says the verdict is kept while it is away."""
        prom = tmp_path / "m.prom"
        config = kvm_config(plugin_dir, fake_root, cdi=True, cdi_required=True, metrics_file=prom)
        runtime = await started(Path(config.runtime_socket), False, [config.cdi_dir])
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await running.events.wait_for(EVENT_WITHHELD)
                await stopped(runtime)
                await running.events.wait_for("cdi-runtime-away")
                assert "ignores CDI (enable_cdi = false); kept while the runtime is away (its socket " in (
                    running.daemon.status_line()
                )
                await quiet(kubelet, 3 * HOLD)
                assert 'verdict="not_applied"} 1' in prom.read_text()
                runtime = await started(Path(config.runtime_socket), False, [config.cdi_dir])
                await running.events.wait_for("cdi-not-applied")
                await quiet(kubelet, BOUND)
                assert set(answers(kubelet)) == {0}, answers(kubelet)
                assert len(running.events.named(EVENT_WITHHELD)) == 1 and not running.events.named(EVENT_OFFERED)
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_no_runtime_heard_since_the_start(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """No runtime at the start: unknown, and it says so; a device whose VMM needs its CDI name applied
        is withheld from the first answer (cdi-unknown) and offered once a runtime that applies CDI answers."""
        config = kvm_config(plugin_dir, fake_root, cdi=True, cdi_required=True)
        kubelet = await started_kubelet(plugin_dir)
        runtime: FakeRuntime | None = None
        try:
            async with daemon_in_process(config, kernel) as running:
                first = await kubelet.next_event("list", resource=RESOURCE)
                assert first.healthy == 0
                status = running.daemon.status_line()
                assert "withheld: cdi-unknown" in status
                assert "| cdi: unknown whether CDI is applied (no runtime has answered since the start: no runtime" in (
                    status
                )
                runtime = await started(Path(config.runtime_socket), True, [config.cdi_dir])
                await allocatable(kubelet, 4096, BOUND + 1)
        finally:
            await kubelet.stop()
            if runtime is not None:
                await runtime.stop()

    async def test_a_hung_runtime_holds_the_start_for_the_bound_only(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A runtime that never answers: registered FIRST_VERDICT after the start at most, withheld as
        unknown; its answer, once it gives one, decides."""
        config = kvm_config(plugin_dir, fake_root, cdi=True, cdi_required=True)
        runtime = await started(Path(config.runtime_socket), True, [config.cdi_dir])
        runtime.hang = True
        kubelet = await started_kubelet(plugin_dir)
        try:
            began = time.monotonic()
            async with daemon_in_process(config, kernel) as running:
                await kubelet.next_event("register")
                took = time.monotonic() - began
                print(f"registered {1000 * took:.0f} ms after the start, the runtime hung")
                assert FIRST_VERDICT <= took < FIRST_VERDICT + 2.0
                assert answers(kubelet) in ([], [0]) and "withheld: cdi-unknown" in running.daemon.status_line()
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_a_spec_that_cannot_be_written_back(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Our spec's directory replaced by a file: the write-back fails, the device is withheld at once
        (spec-missing, with the cause) and the metric says spec_missing; the file removed: the spec is
        written (a back-off: no event tells) and the device offered, with no reload."""
        prom = tmp_path / "m.prom"
        config = kvm_config(plugin_dir, fake_root, cdi=True, cdi_required=True, metrics_file=prom)
        cdi_dir = Path(config.cdi_dir)
        runtime = await started(Path(config.runtime_socket), True, [config.cdi_dir])
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await allocatable(kubelet, 4096, 10)
                began = time.monotonic()
                shutil.rmtree(cdi_dir)
                cdi_dir.write_text("")
                await allocatable(kubelet, 0, BOUND)
                print(f"withheld {1000 * (time.monotonic() - began):.0f} ms after the directory became a file")
                event = await running.events.wait_for(EVENT_WITHHELD)
                assert "(spec-missing)" in event.getMessage() and f"{cdi_dir} is not a directory" in event.getMessage()
                assert "withheld: spec-missing" in running.daemon.status_line()
                await wait_for_content(prom, 'verdict="spec_missing"} 1')
                began = time.monotonic()
                cdi_dir.unlink()
                await allocatable(kubelet, 4096, 2.0 + BOUND)
                print(f"offered again {1000 * (time.monotonic() - began):.0f} ms after the file went")
                assert (cdi_dir / "ate.dev-kvm.json").exists()
        finally:
            await kubelet.stop()
            await runtime.stop()

    async def test_a_replaced_directory_until_the_runtime_restarts(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """cdi_dir renamed away: our spec is written into a new one at once, but the runtime that was there
        follows the old one: withheld (spec-dir-replaced) until it restarts, then offered."""
        config = kvm_config(plugin_dir, fake_root, cdi=True)
        cdi_dir = Path(config.cdi_dir)
        runtime = await started(Path(config.runtime_socket), True, [config.cdi_dir])
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await allocatable(kubelet, 4096, 10)
                cdi_dir.rename(tmp_path / "cdi.old")
                await allocatable(kubelet, 0, BOUND)
                await running.events.wait_for(EVENT_REPLACED)
                assert (cdi_dir / "ate.dev-kvm.json").exists()
                assert "withheld: spec-dir-replaced" in running.daemon.status_line()
                await quiet(kubelet, BOUND)
                assert kubelet.allocatable(RESOURCE) == 0
                runtime = await restarted(runtime, True, [config.cdi_dir])
                await allocatable(kubelet, 4096, BOUND + 1)
        finally:
            await kubelet.stop()
            await runtime.stop()


class TestDraMode:
    async def test_cdi_off_and_a_conflicting_spec_take_the_device_out_of_the_slice(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """DRA mode (CDI is its only path): no runtime heard, a runtime with CDI off, then a conflicting
        spec: the device is out of the node's slice, and in it only while the runtime can give it."""
        async with dra_node(kernel, fake_root, runtime=False) as node:
            await node.status("withheld: cdi-unknown")
            await node.status("slice published (no device offered)")
            socket = Path(node.config.runtime_socket)
            cdi = [node.config.cdi_dir]
            runtime = await started(socket, False, cdi)
            try:
                await node.status("withheld: cdi-not-applied")
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
                text = node.running.events.named("dra-device-unhealthy")[0].getMessage()
                assert "vanished" not in text and "withheld: cdi-unknown" in text
            finally:
                await runtime.stop()
