"""DRA mode's layout where ``sharing`` is not set: decided from what the API server keeps, once per start.

Against the fake API server, which keeps ``allowMultipleAllocations`` (Kubernetes 1.36, DRAConsumableCapacity
on) or, with ``consumable_capacity = False``, drops it as 1.34-1.35 do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.dra.driver import DraDriver, DraStatus
from ate_devplugd.dra.layout import LayoutChoice, Why
from ate_devplugd.dra.slices import SliceState
from tests.integration.dra_rig import DRIVER, KVM, POOL, Rig, rig

DRY_RUN = "POST /apis/resource.k8s.io/v1/resourceslices?dryRun=All"
SHARED = {"name": "kvm", "attributes": {"resource": {"string": "ate.dev/kvm"}}, "allowMultipleAllocations": True}


def published_with(layout: Layout) -> Any:
    return lambda s: s.slices is SliceState.PUBLISHED and s.layout is not None and s.layout.layout is layout


@contextlib.asynccontextmanager
async def restarted(
    r: Rig, config: DraConfig | None = None
) -> AsyncIterator[tuple[DraDriver, asyncio.Queue[DraStatus]]]:
    """The driver stopped and another one started (a daemon restart inside kubelet's grace); kubelet's
    registration of the first is awaited first, so that its next one is the new driver's."""
    await r.kubelet.next_event("registered")
    await r.driver.stop()
    statuses: asyncio.Queue[DraStatus] = asyncio.Queue()
    again = DraDriver(config or r.config, [KVM], backoff=(0.01, 0.2), on_status=statuses.put_nowait)
    await again.start()
    try:
        yield again, statuses
    finally:
        await again.stop()


async def until(statuses: asyncio.Queue[DraStatus], pred: Any) -> DraStatus:
    async with asyncio.timeout(5):
        while not pred(status := await statuses.get()):
            pass
    return status


class TestFollowsTheCluster:
    async def test_shared_where_the_api_server_keeps_it(self) -> None:
        """An API server that keeps allowMultipleAllocations: one shared device, said in STATUS, the journal
        and the info metric; one dry-run create decided it; prepare echoes the share ID."""
        async with rig(sharing=None) as r:
            status = await r.status(published_with(Layout.SHARED))
            assert status.layout == LayoutChoice(Layout.SHARED, Why.KEPT)
            assert str(status).endswith(
                "slice published (1 device), layout shared (decided: the API server keeps allowMultipleAllocations)"
            )
            (slice_,) = r.api.node_slices()
            assert slice_["spec"]["devices"] == [SHARED]
            assert r.api.dry_runs == 1 and sum(q.startswith(DRY_RUN) for q in r.api.requests) == 1
            (said,) = r.log.events("dra-layout")
            assert said.levelno == logging.INFO
            assert said.getMessage() == "dra: layout shared (decided: the API server keeps allowMultipleAllocations)"
            assert r.driver.metrics.sharing is Layout.SHARED
            assert not r.log.events("dra-sharing-dropped")
            await r.kubelet.next_event("registered")
            result = {"request": "r", "driver": DRIVER, "pool": POOL, "device": "kvm", "shareID": "s-1"}
            uid = r.api.add_claim("ns", "c", [result])
            response = await r.kubelet.prepare(DRIVER, ("ns", uid, "c"))
            assert response.claims[uid].error == "" and response.claims[uid].devices[0].share_id == "s-1"

    async def test_units_where_the_api_server_drops_it(self) -> None:
        """An API server that drops allowMultipleAllocations (1.34-1.35): 128 exclusive devices, no error."""
        async with rig(sharing=None, api_options={"consumable_capacity": False}) as r:
            status = await r.status(published_with(Layout.UNITS))
            assert status.layout == LayoutChoice(Layout.UNITS, Why.DROPPED) and status.devices == 128
            assert "layout units (decided: the API server drops allowMultipleAllocations" in str(status)
            assert not status.sharing_dropped and not r.log.events("dra-sharing-dropped")
            (slice_,) = r.api.node_slices()
            assert [d["name"] for d in slice_["spec"]["devices"]] == [f"kvm-{i}" for i in range(128)]
            assert r.driver.metrics.sharing is Layout.UNITS

    async def test_the_setting_wins(self) -> None:
        """``sharing`` set: the API server is not asked, whatever it keeps."""
        async with rig(sharing=Layout.UNITS) as r:
            status = await r.status(published_with(Layout.UNITS))
            assert status.layout == LayoutChoice(Layout.UNITS, Why.CONFIG) and status.devices == 128
            assert r.api.dry_runs == 0 and not r.log.events("dra-layout")
        async with rig(sharing=Layout.SHARED, api_options={"consumable_capacity": False}) as r:
            status = await r.status(lambda s: s.sharing_dropped and s.slices is SliceState.PUBLISHED)
            assert status.layout == LayoutChoice(Layout.SHARED, Why.CONFIG) and r.api.dry_runs == 0

    async def test_undecided_while_the_api_server_is_away(self) -> None:
        """Before the API server answers, nothing is published and the layout is not said; then it is decided."""
        async with rig(sharing=None, start_driver=False) as r:
            await r.api.stop()
            await r.driver.start()
            status = await r.status(lambda s: s.slices is SliceState.API_ERROR)
            assert status.layout is None and r.driver.metrics.sharing is None
            await r.api.start(r.api.port)
            await r.status(published_with(Layout.SHARED))


class TestDecidedOncePerStart:
    async def test_not_again_while_running(self) -> None:
        """The layout holds while the daemon runs: a republish after kubelet's start asks nothing, even of
        an API server whose gate changed meanwhile."""
        async with rig(sharing=None) as r:
            await r.status(published_with(Layout.SHARED))
            r.api.consumable_capacity = False
            r.api.kubelet_restarted()
            await r.api.next_change("DELETED")
            _, obj = await r.api.next_change("ADDED")
            assert [d["name"] for d in obj["spec"]["devices"]] == ["kvm"]
            assert r.api.dry_runs == 1 and len(r.log.events("dra-layout")) == 1

    async def test_restart_onto_units_replaces_the_shared_slice(self) -> None:
        """A restart that decides units (the gate went off) updates the shared slice in place, with a higher
        generation; a claim allocated on the shared device before is still prepared."""
        async with rig(sharing=None) as r:
            await r.status(published_with(Layout.SHARED))
            (before,) = r.api.node_slices()
            r.api.consumable_capacity = False
            async with restarted(r) as (again, statuses):
                status = await until(statuses, published_with(Layout.UNITS))
                assert status.layout == LayoutChoice(Layout.UNITS, Why.DROPPED) and status.devices == 128
                (after,) = r.api.node_slices()
                assert after["metadata"]["name"] == before["metadata"]["name"]
                assert after["spec"]["pool"]["generation"] == before["spec"]["pool"]["generation"] + 1
                assert not r.log.events("dra-slice-adopted")
                await r.kubelet.next_event("registered")
                old = {"request": "r", "driver": DRIVER, "pool": POOL, "device": "kvm", "shareID": "s-1"}
                new = {"request": "r", "driver": DRIVER, "pool": POOL, "device": "kvm-7"}
                old_uid, new_uid = r.api.add_claim("ns", "old", [old]), r.api.add_claim("ns", "new", [new])
                response = await r.kubelet.prepare(DRIVER, ("ns", old_uid, "old"), ("ns", new_uid, "new"))
                assert response.claims[old_uid].error == "" and response.claims[old_uid].devices[0].share_id == "s-1"
                assert response.claims[new_uid].devices[0].device_name == "kvm-7"
                assert again.metrics.sharing is Layout.UNITS

    async def test_restart_onto_shared_replaces_the_units_slice(self) -> None:
        """A slice published in units (by a daemon with sharing = "units", or under a gate that was off) is
        replaced by the shared one when a restart decides shared; a claim on a unit is still prepared."""
        async with rig(sharing=Layout.UNITS) as r:
            await r.status(published_with(Layout.UNITS))
            (before,) = r.api.node_slices()
            unset = DraConfig(
                node_name=r.config.node_name, kubeconfig=r.config.kubeconfig, kubelet_dir=r.config.kubelet_dir
            )
            async with restarted(r, unset) as (_, statuses):
                status = await until(statuses, published_with(Layout.SHARED))
                assert status.devices == 1
                (after,) = r.api.node_slices()
                assert after["metadata"]["name"] == before["metadata"]["name"] and after["spec"]["devices"] == [SHARED]
                await r.kubelet.next_event("registered")
                uid = r.api.add_claim("ns", "c", [{"request": "r", "driver": DRIVER, "pool": POOL, "device": "kvm-5"}])
                response = await r.kubelet.prepare(DRIVER, ("ns", uid, "c"))
                assert response.claims[uid].error == "" and response.claims[uid].devices[0].device_name == "kvm-5"

    async def test_health_covers_both_layouts(self) -> None:
        """Where the layout follows the cluster, kubelet's health stream names the devices of both layouts
        (a claim of either may be prepared after a restart)."""
        async with rig(sharing=None) as r:
            await r.status(published_with(Layout.SHARED))
            await r.kubelet.next_event("registered")
            first = await asyncio.wait_for(r.kubelet.watch_health(DRIVER).get(), 5)
            names = {d.device.device_name for d in first.devices}
            assert names == {"kvm", *(f"kvm-{i}" for i in range(128))}
