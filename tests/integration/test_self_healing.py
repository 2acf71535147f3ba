"""What the daemon puts back by itself, in process against the fake kubelet (modelled on kubelet's device
manager, A7b): our CDI spec removed or broken on disk; kubelet, still running, dropping the resource any
number of times; another client for the name taking it and going (kubelet 1.36 and 1.32)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from ate_devplugd.deviceplugin import drops
from ate_devplugd.node.cdi import EVENT_RESTORED
from tests.fakes.kubelet import FakeKubelet
from tests.fakes.plugin import OtherPlugin
from tests.fault.harness import LOADED_WAIT, expected_ids, load, settled
from tests.support import RESOURCE, SOCKET, FakeKernel, daemon_in_process, kvm_config, wait_for_content


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


# -- another client for the name (tests/fakes/kubelet.py's ``swap``): kubelet's own word -------------------

#: How late each of the three other clients goes (one kubelet life): as soon as its Register returned,
#: once kubelet took its device list, once the daemon had asked kubelet what it offers while it ran.
WHEN = ("at once", "after its list", "after the daemon looked")
#: A drop healed later than this (from the other client's going) has not been healed by the word.
BOUND = 10.0


async def until(kubelet: FakeKubelet, holds: Callable[[], bool], timeout: float = LOADED_WAIT) -> None:
    """Wait on kubelet's events until ``holds()``."""
    async with asyncio.timeout(timeout):
        while not holds():
            await kubelet.next_event(timeout=timeout)


def ours_offered(kubelet: FakeKubelet, healthy: int = 4096) -> bool:
    """kubelet's current client for the name is ours, watched, offering ``healthy`` units."""
    current = kubelet.endpoints.get(RESOURCE)
    return (
        current is not None and current.socket_path.endswith("/" + SOCKET) and kubelet.allocatable(RESOURCE) == healthy
    )


async def other_client(kubelet: FakeKubelet, n: int, when: str, ids: list[str]) -> float:
    """Another client registers the name and goes ``when``; the loop time the name was lost: it went (kubelet
    1.36), or it registered (1.32 ends our stream then)."""
    other = OtherPlugin(kubelet.dir, RESOURCE, ids, socket_name=f"stray-{n}.sock")
    registering = asyncio.get_running_loop().time()
    try:
        await other.start()
        if when == "after its list":
            await until(kubelet, lambda: any(e.kind == "list" and e.ids[:1] == ids[:1] for e in kubelet.history[-3:]))
        elif when == "after the daemon looked":
            await kubelet.next_event("pod-resources", timeout=LOADED_WAIT)
        gone = asyncio.get_running_loop().time()
    finally:
        await other.go()
    return gone if kubelet.swap == "1.36" else registering


@pytest.mark.figures
@pytest.mark.budget(180)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
@pytest.mark.parametrize(
    "case", [f"{swap}, {spacing}" for swap in ("1.36", "1.32") for spacing in ("back to back", "apart")]
)
async def test_another_client_for_the_name_three_times_in_one_kubelet_life(
    plugin_dir: Path, fake_root: Path, kernel: FakeKernel, case: str, machine: str
) -> None:
    """A stray instance registers the name (our IDs) and goes, three times in one kubelet life, each going
    later than the last. kubelet 1.36 swaps the client and leaves our stream open, so only its own word
    (pod-resources) shows the name offering nothing; 1.32 ends our stream. Each drop: `registered` 0, one
    warned and counted heal, our units offered again within the bound; one Register per heal, no more.
    Back to back, each drop comes as soon as the last heal is offered (the doubling wait shows); apart, once
    kubelet has been quiet for longer than that wait."""
    swap, spacing = case.split(", ")
    kubelet = FakeKubelet(plugin_dir, seed=f"other/{case}/{machine}", swap=swap)
    await kubelet.start()
    metrics = plugin_dir.parent / "metrics.prom"
    registered = f'ate_devplugd_registered{{resource="{RESOURCE}"}} '
    took: list[float] = []
    loop = asyncio.get_running_loop()
    try:
        with load(machine) as how:
            config = kvm_config(plugin_dir, fake_root, metrics_file=metrics)
            async with daemon_in_process(config, kernel) as running:
                await until(kubelet, lambda: ours_offered(kubelet))
                await wait_for_content(metrics, registered + "1\n", timeout=LOADED_WAIT)
                for n, when in enumerate(WHEN if swap == "1.36" else ("at once",) * 3, 1):
                    if spacing == "apart":
                        await settled(kubelet, quiet=drops.STREAM_GRACE * 2 ** (n - 1) + 0.5)
                    zero = loop.create_task(wait_for_content(metrics, registered + "0\n", timeout=LOADED_WAIT))
                    try:
                        gone = await other_client(kubelet, n, when, expected_ids())
                        record = await running.events.wait_for("reregister", timeout=LOADED_WAIT)
                        await until(kubelet, lambda: ours_offered(kubelet))
                        took.append(loop.time() - gone)
                        await zero
                    finally:
                        zero.cancel()
                    assert record.levelno == logging.WARNING and f"drop {n} with this kubelet" in record.getMessage()
                    if swap == "1.36":
                        assert "another client for the name took it" in record.getMessage(), record.getMessage()
                    await wait_for_content(metrics, registered + "1\n", timeout=LOADED_WAIT)
                await settled(kubelet)
                print(
                    f"kubelet {swap}, {how}, {spacing}: units offered again "
                    + ", ".join(f"{t * 1e3:.0f}" for t in took)
                    + " ms after the name was lost (1.36: the other client went; 1.32: it registered)"
                )
                assert max(took) < BOUND, took
                ours = [e for e in kubelet.history if e.kind == "register" and e.endpoint == SOCKET]
                assert len(ours) == 4, running.events.text()  # the first, and one per heal
                assert len(running.events.named("reregister")) == 3, running.events.text()
                await wait_for_content(metrics, f'ate_devplugd_reregistrations_total{{resource="{RESOURCE}"}} 3\n')
                assert running.daemon.status_line() == "ate.dev/kvm: 4096/4096 healthy, registered"
    finally:
        await kubelet.stop()


async def test_another_plugin_serving_the_name_is_undone_while_it_runs(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """Another plugin registers the name with IDs of its own (kubelet 1.36): kubelet offers none of ours
    while it runs, so the daemon takes the name back at once (warned, counted), without waiting for it to
    go; its later going costs nothing."""
    kubelet = FakeKubelet(plugin_dir, seed=14)
    await kubelet.start()
    loop = asyncio.get_running_loop()
    try:
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await until(kubelet, lambda: ours_offered(kubelet))
            await settled(kubelet, quiet=drops.STREAM_GRACE + 0.5)  # our Register is older than its wait
            other = OtherPlugin(plugin_dir, RESOURCE, [f"gpu-{i}" for i in range(3)])
            began = loop.time()
            try:
                await other.start()
                record = await running.events.wait_for("reregister", timeout=LOADED_WAIT)
                assert "it offers none of the 4096 units served Healthy" in record.getMessage(), record.getMessage()
                await until(kubelet, lambda: ours_offered(kubelet))
                print(f"another plugin's name taken back {(loop.time() - began) * 1e3:.0f} ms after its Register")
            finally:
                await other.go()
            await settled(kubelet)
            assert ours_offered(kubelet) and len(running.events.named("reregister")) == 1, running.events.text()
            assert running.daemon.status_line() == "ate.dev/kvm: 4096/4096 healthy, registered"
    finally:
        await kubelet.stop()
