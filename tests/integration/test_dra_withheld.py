"""DRA mode's withheld device-plugin path (the endpoint DRA mode keeps registered with every unit Unhealthy,
so that kubelet 1.36 finds an endpoint for the name: docs/switching.md) against another client for the
name, kubelet 1.36 and 1.32 (tests/fakes/kubelet.py's ``swap``): the whole daemon in DRA mode in process between the
fake API server and the fake DRA kubelet, and the fake device manager on its device-plugin directory.

Without the heal, kubelet's endpoint for the name is the other client's, stopped, and 5 minutes later a new
DRA pod's container fails ``endpoint not found in cache`` (tests/fakes/scheduler.py's ``PodKubelet``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.fakes.kubelet import FakeKubelet
from tests.fakes.plugin import OtherPlugin
from tests.fault.harness import LOADED_WAIT, expected_ids, load, settled
from tests.integration.dra_rig import dra_node
from tests.integration.test_self_healing import BOUND, until
from tests.support import RESOURCE, SOCKET, EventRecorder, FakeKernel

WITHHELD = "ate.dev/kvm: device-plugin path withheld (DRA mode)"
#: How late each other client goes: as soon as its Register returned (kubelet may not have taken its
#: list: then only its socket's coming and going shows it), once kubelet took its list, after the heal.
WHEN = ("at once", "after its list", "after the heal")
HEALS = ("reregister", "withheld-reregister")


def parts(fields: dict[str, str]) -> list[str]:
    return fields.get("STATUS", "").split(" | ")


def withheld_current(kubelet: FakeKubelet) -> bool:
    """kubelet's current client for the name is our withheld path, watched, offering nothing."""
    current = kubelet.endpoints.get(RESOURCE)
    if current is None or not current.socket_path.endswith("/" + SOCKET) or current.latest is None:
        return False
    return current.streaming and kubelet.allocatable(RESOURCE) == 0


async def healed(events: EventRecorder) -> logging.LogRecord:
    """The next heal of the withheld path (verified, or the precaution)."""
    async with asyncio.timeout(LOADED_WAIT):
        while True:
            record = await events.queue.get()
            if getattr(record, "ATE_EVENT", None) in HEALS:
                return record


@pytest.mark.figures
@pytest.mark.budget(180)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
@pytest.mark.parametrize("swap", ["1.36", "1.32"])
async def test_withheld_path_taken_three_times_in_one_kubelet_life(
    fake_root: Path, kernel: FakeKernel, swap: str, machine: str
) -> None:
    """Another client registers the name three times in one kubelet life (a device-plugin-mode instance
    left running: our IDs, Healthy), going later each time. 1.36 leaves our stream open: kubelet's
    checkpoint (the client's Healthy units) or its socket's coming and going shows it; 1.32 ends our
    stream (and drops the other client at once, so how late it goes does not matter there). Each time
    STATUS says the path is not held, and one heal makes it kubelet's client again within the bound; one
    Register of ours per heal."""
    loop = asyncio.get_running_loop()
    took: list[float] = []
    async with dra_node(kernel, fake_root) as node:
        kubelet = FakeKubelet(node.dir / "device-plugins", seed=f"withheld/{swap}/{machine}", swap=swap)
        await kubelet.start()
        try:
            with load(machine) as how:
                await until(kubelet, lambda: withheld_current(kubelet))
                await node.notify.wait_for(lambda f: WITHHELD + ", registered" in parts(f), timeout=LOADED_WAIT)
                for n, when in enumerate(WHEN if swap == "1.36" else ("at once",) * 3, 1):
                    node.notify.forget()
                    lost = loop.create_task(
                        node.notify.wait_for(
                            lambda f: any(p.startswith(WITHHELD + ", registered, but") for p in parts(f)),
                            timeout=LOADED_WAIT,
                        )
                    )
                    other = OtherPlugin(kubelet.dir, RESOURCE, expected_ids(), socket_name=f"stray-{n}.sock")
                    began = loop.time()
                    try:
                        await other.start()
                        if when == "after its list":
                            await until(
                                kubelet, lambda: any(e.kind == "list" and e.healthy for e in kubelet.history[-3:])
                            )
                        if when != "after the heal":
                            await other.go()
                        record = await healed(node.running.events)
                        await until(kubelet, lambda: withheld_current(kubelet))
                        took.append(loop.time() - began)
                        await lost
                    finally:
                        lost.cancel()
                        await other.go()
                    if swap == "1.36" and when == "after its list":
                        assert record.levelno == logging.WARNING, record.getMessage()
                        assert "another client for ate.dev/kvm took it" in record.getMessage(), record.getMessage()
                await settled(kubelet)
                heals = [r for r in node.running.events.records if getattr(r, "ATE_EVENT", None) in HEALS]
                print(
                    f"kubelet {swap}, {how}: the withheld path kubelet's client again "
                    + ", ".join(f"{t * 1e3:.0f}" for t in took)
                    + " ms after the other client's Register ("
                    + ", ".join(getattr(r, "ATE_EVENT", "") for r in heals)
                    + ")"
                )
                assert max(took) < BOUND, took
                assert len(heals) == 3, node.running.events.text()
                ours = [e for e in kubelet.history if e.kind == "register" and e.endpoint == SOCKET]
                assert len(ours) == 4, node.running.events.text()  # the first, and one per heal
                assert withheld_current(kubelet)
                assert WITHHELD + ", registered" in node.running.daemon.status_line().split(" | ")
        finally:
            await kubelet.stop()


async def test_a_heal_confirmed_when_kubelet_took_the_list_before_its_reply(
    fake_root: Path, kernel: FakeKernel
) -> None:
    """kubelet's client runs beside its reply to Register: it may take the withheld path's list, and write its
    checkpoint, before the reply reaches the daemon. That write is the heal's evidence all the same: STATUS
    says registered again, not "asking kubelet what it offers" for good."""
    async with dra_node(kernel, fake_root) as node:
        kubelet = FakeKubelet(node.dir / "device-plugins", seed="withheld/reply")
        await kubelet.start()
        try:
            await until(kubelet, lambda: withheld_current(kubelet))
            await node.notify.wait_for(lambda f: WITHHELD + ", registered" in parts(f), timeout=LOADED_WAIT)
            node.notify.forget()
            kubelet.register_reply = "after its list"
            other = OtherPlugin(kubelet.dir, RESOURCE, expected_ids(), socket_name="stray-1.sock")
            try:
                await other.start()
                await until(kubelet, lambda: any(e.kind == "list" and e.healthy for e in kubelet.history[-3:]))
                await node.notify.wait_for(
                    lambda f: any(p.startswith(WITHHELD + ", registered, but") for p in parts(f)), timeout=LOADED_WAIT
                )
                await healed(node.running.events)
            finally:
                await other.go()
            await node.notify.wait_for(lambda f: WITHHELD + ", registered" in parts(f), timeout=BOUND)
            assert withheld_current(kubelet)
        finally:
            await kubelet.stop()
