"""One Register per kubelet, in any order kubelet's start-up wipe takes and wherever its new socket is bound.

kubelet answers a second Register for a resource by disconnecting the newer client once the older stream
ends (A7b), so a plugin must register exactly once per kubelet. kubelet's wipe removes the directory's
sockets in the filesystem's order, not by name: the stale ``kubelet.sock`` may go before or after ours,
with other plugins' sockets in between, and the new kubelet.sock may be bound between the daemon's look at
the directory and its connect. These tests make each of those happen, on purpose and at random, with the
CPU idle and overcommitted; the count is exact either way. The last test is the one exception: kubelet,
still running, has dropped the resource, and the daemon registers once more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ate_devplugd.deviceplugin import endpoint
from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import (
    LOADED_WAIT,
    assert_one_current_registration,
    daemon_log_clean,
    load,
    scale,
    settled,
)
from tests.support import (
    RESOURCE,
    SOCKET,
    FakeKernel,
    daemon,
    daemon_in_process,
    kvm_config,
    wait_for_content,
    write_config,
)

#: Other plugins' sockets, as on any real node (each re-created before each restart).
OTHERS = ("a.example-gpu.sock", "nvidia-gpu.sock", "zz-sriov.sock")


def others_between(names: list[str]) -> list[str]:
    """One other plugin's socket, the stale kubelet.sock, the rest of the others, ours last."""
    others = sorted(n for n in names if n not in ("kubelet.sock", SOCKET))
    rest = [n for n in names if n in ("kubelet.sock", SOCKET)]
    head, tail = others[:1], others[1:]
    return head + [n for n in rest if n == "kubelet.sock"] + tail + [n for n in rest if n == SOCKET]


ORDERS: dict[str, Callable[[list[str]], list[str]] | str] = {
    "kubelet.sock first": lambda names: sorted(names, key=lambda n: n != "kubelet.sock"),
    "ours first": lambda names: sorted(names, key=lambda n: n != SOCKET),
    "others between": others_between,
    "random": "random",
}


def other_plugins(directory: Path) -> None:
    """The other plugins' sockets, dead (a wipe removes them; their plugins are not modelled)."""
    for name in OTHERS:
        path = directory / name
        if not path.exists():
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(path))
            sock.close()


def registrations(kubelet: FakeKubelet) -> int:
    return len([e for e in kubelet.history if e.kind == "register"])


async def registered_after_restart(kubelet: FakeKubelet, timeout: float = LOADED_WAIT) -> float:
    """Wait for the Register and first list that follow a restart; seconds from the restart."""
    start = time.monotonic()
    await kubelet.next_event("register", timeout=timeout)
    await kubelet.next_event("list", timeout=timeout)
    return time.monotonic() - start


def figures(label: str, latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p50 = ordered[len(ordered) // 2]
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{label}: {len(ordered)} restarts, re-registered p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms"


async def restarts_each_registered_once(
    tmp_path: Path, kubelet: FakeKubelet, dev_root: Path, *, restarts: int, machine: str, label: str
) -> None:
    """The daemon with ``kubelet`` restarted ``restarts`` times (other plugins' sockets in the directory),
    each restart waited out: exactly one Register per kubelet, never a double one, nothing disconnected,
    every loss of our socket a kubelet restart. Prints the re-registration figures."""
    other_plugins(kubelet.dir)
    await kubelet.start()
    cfg = write_config(tmp_path / "c.toml", kubelet.dir, dev_root)
    try:
        with load(machine) as how:
            async with daemon(cfg) as proc:
                await settled(kubelet)
                latencies = []
                for _ in range(restarts):
                    other_plugins(kubelet.dir)
                    await kubelet.restart()
                    latencies.append(await registered_after_restart(kubelet))
                    harm = [e for e in kubelet.history if e.kind in ("double-register", "disconnected")]
                    assert not harm, (harm, proc.log()[-4000:])
                await settled(kubelet)
                print(figures(f"{label}, {how}", latencies))
                print(f"registrations: {registrations(kubelet)} for {restarts + 1} kubelets; double: 0")
                assert registrations(kubelet) == restarts + 1, proc.log()[-4000:]
                assert_one_current_registration(kubelet)
                log = proc.log()
                daemon_log_clean(log)
                assert "event=socket-removed" not in log and "event=reregister" not in log, log
    finally:
        await kubelet.stop()


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.budget(300)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
async def test_each_wipe_order(tmp_path: Path, plugin_dir: Path, dev_root: Path, order: str, machine: str) -> None:
    """Each wipe order, other plugins' sockets in the directory: exactly one Register per kubelet."""
    kubelet = FakeKubelet(plugin_dir, wipe_order=ORDERS[order], seed=f"{order}/{machine}")
    await restarts_each_registered_once(
        tmp_path, kubelet, dev_root, restarts=scale(12, 100), machine=machine, label=f"wipe order {order}"
    )


@pytest.mark.figures
@pytest.mark.budget(1500)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
async def test_random_restarts(tmp_path: Path, plugin_dir: Path, dev_root: Path, machine: str) -> None:
    """Restarts with a random wipe order and random pauses inside kubelet's start, other plugins' sockets
    in the directory: never a second Register for one kubelet (ATE_RESTARTS sets the count)."""
    restarts = int(os.environ.get("ATE_RESTARTS") or scale(100, 1000))
    kubelet = FakeKubelet(plugin_dir, seed=f"{tmp_path.name}/{machine}", jitter=0.004)
    await restarts_each_registered_once(
        tmp_path, kubelet, dev_root, restarts=restarts, machine=machine, label="random wipe orders"
    )


async def test_new_kubelet_bound_between_look_and_connect(
    plugin_dir: Path, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new kubelet removes the stale kubelet.sock and binds its own after the daemon looked and before
    it connects: the Register reaches the new kubelet, and that is the only Register it gets."""
    kubelet = FakeKubelet(plugin_dir, seed=1)
    await kubelet.start()
    real_register = endpoint.register
    armed: list[bool] = []

    async def register(kubelet_socket: str, *args: object) -> None:
        if armed:
            armed.clear()
            # the daemon has looked: the killed kubelet's socket is there. Its wipe took ours already;
            # now the new kubelet removes the stale socket and binds and listens on its own.
            kubelet.wipe_at_start = False
            await kubelet.start()
        await real_register(kubelet_socket, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(endpoint, "register", register)
    try:
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await kubelet.next_event("list")
            await kubelet.stop(graceful=False)
            before = registrations(kubelet)
            armed.append(True)
            os.unlink(plugin_dir / SOCKET)  # the new kubelet's wipe, our socket first
            await kubelet.next_event("register")
            await settled(kubelet)
            assert registrations(kubelet) == before + 1, running.events.text()
            assert not armed, "the Register went out after the new kubelet was bound"
            assert running.events.named("kubelet-replaced"), running.events.text()
            assert kubelet.allocatable(RESOURCE) == 4096
            assert running.daemon.status_line() == "ate.dev/kvm: 4096/4096 healthy, registered"
    finally:
        await kubelet.stop()


async def test_kubelet_restarted_right_after_register(
    plugin_dir: Path, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet that took the Register is killed and the next one has wiped the directory and bound its
    socket before the daemon looks again: the loss of our socket is a kubelet restart (not someone
    else's removal), and the new kubelet gets exactly one Register."""
    kubelet = FakeKubelet(plugin_dir, seed=5)
    await kubelet.start()
    real_register = endpoint.register
    armed: list[bool] = []

    async def register(kubelet_socket: str, *args: object) -> None:
        await real_register(kubelet_socket, *args)  # type: ignore[arg-type]
        if armed:
            armed.clear()
            await kubelet.restart()  # before the daemon's look after the call

    monkeypatch.setattr(endpoint, "register", register)
    try:
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await kubelet.next_event("list")
            armed.append(True)
            os.unlink(plugin_dir / SOCKET)  # someone else's removal: the daemon serves and registers anew
            await running.events.wait_for("socket-removed")
            await kubelet.next_event("restart")
            before = registrations(kubelet)
            await kubelet.next_event("list")
            await settled(kubelet)
            assert registrations(kubelet) == before + 1, running.events.text()
            assert len(running.events.named("socket-removed")) == 1, running.events.text()
            assert running.events.named("kubelet-restart"), running.events.text()
            assert kubelet.allocatable(RESOURCE) == 4096
    finally:
        await kubelet.stop()


async def test_kubelet_dropped_the_resource(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """A double Register forced on kubelet, then the older stream ended: kubelet disconnects the current
    client (allocatable 0, nothing more sent to us). The daemon sees its last stream end while the same
    kubelet still answers, waits out the grace, registers once more (one warning, counted): allocatable
    is back."""
    kubelet = FakeKubelet(plugin_dir, seed=2)
    await kubelet.start()
    loop = asyncio.get_running_loop()
    try:
        metrics = tmp_path / "metrics.prom"
        config = kvm_config(plugin_dir, fake_root, metrics_file=metrics)
        async with daemon_in_process(config, kernel) as running:
            await kubelet.next_event("list")
            older = kubelet.endpoints[RESOURCE]
            # what a plugin that registers twice does to kubelet
            await endpoint.register(str(kubelet.socket_path), SOCKET, RESOURCE, 10.0)
            await kubelet.next_event("double-register")
            await kubelet.next_event("list")
            await kubelet.cut(older)
            ended = await kubelet.next_event("disconnected")
            assert ended.error == "an older client's stream ended"
            assert kubelet.allocatable(RESOURCE) == 0
            cut_at = loop.time()
            record = await running.events.wait_for("reregister", timeout=30)
            assert record.levelno == logging.WARNING
            await kubelet.next_event("list")
            back = loop.time() - cut_at
            print(f"kubelet dropped the resource: allocatable back {back * 1e3:.0f} ms after the cut")
            assert kubelet.allocatable(RESOURCE) == 4096
            await settled(kubelet)
            assert len(running.events.named("reregister")) == 1
            await wait_for_content(metrics, 'ate_devplugd_reregistrations_total{resource="ate.dev/kvm"} 1\n')
            assert running.daemon.status_line() == "ate.dev/kvm: 4096/4096 healthy, registered"
    finally:
        await kubelet.stop()


async def test_stopped_kubelet_is_not_registered_again(plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
    """kubelet stopped (its stream ends and its socket answers no more): no Register after the grace; STATUS
    says kubelet closed the stream; the next kubelet gets one Register."""
    kubelet = FakeKubelet(plugin_dir, seed=3)
    await kubelet.start()
    try:
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await kubelet.next_event("list")
            await kubelet.stop(graceful=False)
            await running.events.wait_for("stream-ended")
            # longer than the grace: a wait on the kubelet's queue that must see nothing
            with pytest.raises(TimeoutError):
                await kubelet.next_event("register", timeout=2.5)
            assert not running.events.named("reregister")
            assert "closed its ListAndWatch" in running.daemon.status_line()
            before = registrations(kubelet)
            await kubelet.start()
            await kubelet.next_event("list")
            await settled(kubelet)
            assert registrations(kubelet) == before + 1
    finally:
        await kubelet.stop()


def test_orders_are_what_they_say() -> None:
    """The named orders put the stale kubelet.sock and our socket where their names say."""
    names = ["kubelet.sock", SOCKET, *OTHERS, "kubelet_internal_checkpoint"]
    random.Random(4).shuffle(names)
    assert ORDERS["kubelet.sock first"](names)[0] == "kubelet.sock"  # type: ignore[operator]
    assert ORDERS["ours first"](names)[0] == SOCKET  # type: ignore[operator]
    between = others_between(names)
    assert between.index("kubelet.sock") == 1 and between[-1] == SOCKET
