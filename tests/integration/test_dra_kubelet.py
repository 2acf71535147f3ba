"""DRA mode toward kubelet: registration, prepare and unprepare, health stream, stop (real gRPC on unix sockets)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from pathlib import Path

import pytest

from ate_devplugd._pb.drahealth.v1alpha1 import api_pb2 as health_pb2
from ate_devplugd.base.unixserver import SocketInUseError
from ate_devplugd.base.unixsock import FileIdentity, staging_path
from ate_devplugd.config import ConfigError
from ate_devplugd.config.dra import MAX_SOCKET_PATH, DraConfig, from_mapping
from ate_devplugd.config.pools import DraResource
from ate_devplugd.dra.driver import DraDriver, KubeletLink
from tests.fakes.dra_kubelet import FakeDraKubelet
from tests.integration.dra_rig import KVM, NODE, rig, short_dir

DRIVER = "kvm.ate.dev"
POOL = f"{NODE}/ate.dev/kvm"


def result(device: str, request: str = "kvm", driver: str = DRIVER, pool: str = POOL, **extra: str) -> dict[str, str]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


class TestRegistration:
    async def test_registers_with_v1(self) -> None:
        """Kubelet finds the registration socket, GetInfo answers within 1 s, and v1 is chosen."""
        async with rig() as r:
            event = await r.kubelet.next_event("registered", "register-failed", "register-refused")
            assert (event.kind, event.name, event.detail) == ("registered", DRIVER, "v1.DRAPlugin")
            plugin = r.kubelet.plugins[DRIVER]
            assert plugin.endpoint == r.config.plugin_socket and os.path.isabs(plugin.endpoint)
            status = await r.status(lambda s: s.kubelet is KubeletLink.REGISTERED)
            assert str(status).startswith("dra: registered with kubelet")
            assert r.log.events("dra-registered")

    async def test_kubelet_132_uses_v1beta1(self) -> None:
        """A kubelet that knows only v1beta1.DRAPlugin registers with it and prepares through it."""
        async with rig(start_kubelet=False) as r:
            r.kubelet.known_versions = ("v1beta1.DRAPlugin",)
            await r.kubelet.start()  # after the driver: found by the initial walk
            event = await r.kubelet.next_event("registered", "register-failed", "register-refused")
            assert event.detail == "v1beta1.DRAPlugin"
            await r.published()
            uid = r.api.add_claim("default", "c1", [result("kvm-0")])
            response = await r.kubelet.prepare(DRIVER, ("default", uid, "c1"))
            assert [d.device_name for d in response.claims[uid].devices] == ["kvm-0"]

    async def test_dot_names_and_plain_files_ignored(self) -> None:
        """The staging socket (a dot-name) and a plain file in plugins_registry are not registered."""
        async with rig(start_driver=False) as r:
            (r.kubelet.registry / "notes.txt").write_text("x")
            assert (await r.kubelet.next_event("ignored")).detail == "not a socket"
            await r.driver.start()
            seen = [await r.kubelet.next_event("ignored", "registered") for _ in range(2)]
            assert [(e.kind, e.name.startswith(".")) for e in seen] == [("ignored", True), ("registered", False)]

    async def test_refused_registration_is_logged(self) -> None:
        """A kubelet that knows no offered version refuses; the driver logs it and shows it."""
        async with rig(start_kubelet=False) as r:
            r.kubelet.known_versions = ("v2.DRAPlugin",)
            await r.kubelet.start()
            assert (await r.kubelet.next_event("register-refused")).name == DRIVER
            status = await r.status(lambda s: s.kubelet is KubeletLink.REFUSED)
            assert "none of the versions" in status.detail
            assert r.log.events("dra-register-failed")[0].levelno == logging.ERROR

    async def test_stop_removes_sockets(self) -> None:
        """After stop both sockets are gone and kubelet deregisters the plugin."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            await r.driver.stop()
            assert not Path(r.config.plugin_socket).exists()
            assert not Path(r.config.registration_socket).exists()
            assert (await r.kubelet.next_event("deregistered")).name == DRIVER
            assert r.driver.status().kubelet is KubeletLink.STOPPED

    async def test_stale_sockets_replaced(self) -> None:
        """Sockets left by an earlier run are replaced at start."""
        async with rig(start_driver=False) as r:
            for path in (r.config.plugin_socket, r.config.registration_socket):
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text("stale")
            await r.driver.start()
            assert (await r.kubelet.next_event("registered")).name == DRIVER

    async def test_live_socket_of_another_process_kept(self) -> None:
        """A socket another process serves on is neither removed nor replaced: start fails, naming it."""
        async with rig(start_driver=False, start_kubelet=False) as r:
            path = Path(r.config.registration_socket)
            path.parent.mkdir(parents=True)
            with socket.socket(socket.AF_UNIX) as other:
                other.bind(str(path))
                other.listen()
                identity = FileIdentity.of(str(path))
                with pytest.raises(SocketInUseError, match=re.escape(str(path))):
                    await r.driver.start()
                assert FileIdentity.of(str(path)) == identity
            assert not Path(r.config.plugin_socket).exists()

    async def test_stop_leaves_a_socket_that_is_not_ours(self) -> None:
        """A socket put in place of ours while the driver runs is left alone when it stops."""
        async with rig() as r:
            path = Path(r.config.registration_socket)
            path.unlink()
            with socket.socket(socket.AF_UNIX) as other:
                other.bind(str(path))
                await r.driver.stop()
                assert path.is_socket()

    async def test_longest_socket_paths_served(self) -> None:
        """A kubelet_dir the config allows with not a byte to spare (the registration socket's staging
        name has 107 bytes) is served, and kubelet registers the driver."""
        async with short_dir() as base:
            kubelet_dir = f"{base}/{'k' * (67 - len(str(base)))}"
            config, errors = from_mapping({"node_name": NODE, "kubelet_dir": kubelet_dir, "kubeconfig": f"{base}/kc"})
            assert errors == [] and len(staging_path(config.registration_socket)) == MAX_SOCKET_PATH
            driver = DraDriver(config, [KVM], backoff=(60.0, 60.0))
            kubelet = FakeDraKubelet(Path(kubelet_dir))
            await kubelet.start()
            try:
                await driver.start()
                assert (await kubelet.next_event("registered")).name == DRIVER
            finally:
                await driver.stop()
                await kubelet.stop()


class TestPrepare:
    async def test_prepare_returns_cdi_device(self) -> None:
        """An allocated claim gets one device per result of this driver, with the resource's CDI device."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            await r.published()
            results = [result("kvm-3"), result("kvm-0", request="b"), result("x", driver="other.example.com")]
            uid = r.api.add_claim("ns1", "claim", results)
            response = await r.kubelet.prepare(DRIVER, ("ns1", uid, "claim"))
            entry = response.claims[uid]
            assert entry.error == ""
            assert [
                (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in entry.devices
            ] == [
                (["kvm"], POOL, "kvm-3", ["ate.dev/kvm=kvm"]),
                (["b"], POOL, "kvm-0", ["ate.dev/kvm=kvm"]),
            ]
            assert not entry.devices[0].HasField("share_id")
            assert r.log.events("dra-prepare")
            again = await r.kubelet.prepare(DRIVER, ("ns1", uid, "claim"))
            assert again == response

    async def test_per_claim_errors(self) -> None:
        """A missing, unallocated or re-created claim fails alone; the good one is prepared."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            await r.published()
            good = r.api.add_claim("ns", "good", [result("kvm-1")])
            unallocated = r.api.add_claim("ns", "pending", None)
            r.api.add_claim("ns", "recreated", [result("kvm-2")])
            response = await r.kubelet.prepare(
                DRIVER,
                ("ns", good, "good"),
                ("ns", unallocated, "pending"),
                ("ns", "old-uid", "recreated"),
                ("ns", "u4", "missing"),
            )
            assert response.claims[good].error == "" and len(response.claims[good].devices) == 1
            assert response.claims[unallocated].error == "claim ns/pending: not allocated"
            assert "not 'old-uid'" in response.claims["old-uid"].error
            assert response.claims["u4"].error == "claim ns/missing: not found"
            assert not response.claims["u4"].devices

    async def test_unknown_device_fails_claim(self) -> None:
        """A result naming a device or pool this node does not serve fails that claim."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            await r.published()
            a = r.api.add_claim("ns", "a", [result("kvm-999")])
            b = r.api.add_claim("ns", "b", [result("kvm-0", pool="node-2/ate.dev/kvm")])
            response = await r.kubelet.prepare(DRIVER, ("ns", a, "a"), ("ns", b, "b"))
            assert "device 'kvm-999' is not in pool" in response.claims[a].error
            assert "is not served on this node" in response.claims[b].error

    async def test_absent_device_fails_claim(self) -> None:
        """While the device node is absent, prepare fails the claim (kubelet retries)."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            await r.published()
            uid = r.api.add_claim("ns", "c", [result("kvm-0")])
            r.driver.set_health("ate.dev/kvm", False)
            response = await r.kubelet.prepare(DRIVER, ("ns", uid, "c"))
            assert "is absent on this node" in response.claims[uid].error
            r.driver.set_health("ate.dev/kvm", True)
            response = await r.kubelet.prepare(DRIVER, ("ns", uid, "c"))
            assert response.claims[uid].error == ""

    async def test_unprepare_answers_every_claim(self) -> None:
        """Unprepare succeeds for every claim, known or not, every time; each is logged at info, as a
        prepare is, so the journal shows both ends of a claim."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            claims = [("ns", "u1", "a"), ("ns", "u2", "b")]
            for _ in range(2):
                response = await r.kubelet.unprepare(DRIVER, *claims)
                assert {uid: e.error for uid, e in response.claims.items()} == {"u1": "", "u2": ""}
            said = r.log.events("dra-unprepare")
            assert [(e.levelno, e.getMessage()) for e in said[:2]] == [
                (logging.INFO, "dra: unprepared claim ns/a (uid u1)"),
                (logging.INFO, "dra: unprepared claim ns/b (uid u2)"),
            ]
            assert len(said) == 4


class TestHealthStream:
    async def test_stream_follows_health(self) -> None:
        """NodeWatchResources sends every device at once, then again when the device vanishes and returns."""
        async with rig(resources=(DraResource("ate.dev/kvm", "ate.dev/kvm=kvm", units=2),)) as r:
            await r.kubelet.next_event("registered")
            updates = r.kubelet.watch_health(DRIVER)
            first = await asyncio_get(updates)
            assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
                (POOL, "kvm-0", health_pb2.HEALTHY),
                (POOL, "kvm-1", health_pb2.HEALTHY),
            ]
            assert first.devices[0].health_check_timeout_seconds > 365 * 24 * 3600
            r.driver.set_health("ate.dev/kvm", False)
            second = await asyncio_get(updates)
            assert {d.health for d in second.devices} == {health_pb2.UNHEALTHY}
            assert "absent" in second.devices[0].message
            r.driver.set_health("ate.dev/kvm", True)
            assert {d.health for d in (await asyncio_get(updates)).devices} == {health_pb2.HEALTHY}

    async def test_stop_ends_stream(self) -> None:
        """Stopping the driver ends the health stream."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            updates = r.kubelet.watch_health(DRIVER)
            await asyncio_get(updates)
            await r.driver.stop()
            ended = await r.kubelet.next_event("health-ended")
            assert ended.name == DRIVER, ended

    async def test_restarted_driver_streams_again(self) -> None:
        """A driver started again after a stop serves a health stream that stays open and follows changes."""
        async with rig() as r:
            await r.kubelet.next_event("registered")
            await r.driver.stop()
            await r.kubelet.next_event("deregistered")
            await r.driver.start()
            await r.kubelet.next_event("registered")
            updates = r.kubelet.watch_health(DRIVER)
            await asyncio_get(updates)
            r.driver.set_health("ate.dev/kvm", False)
            assert {d.health for d in (await asyncio_get(updates)).devices} == {health_pb2.UNHEALTHY}

    def test_unknown_resource_rejected(self) -> None:
        """set_health of a resource the driver does not publish is a KeyError."""
        driver = DraDriver(DraConfig(node_name=NODE), [KVM])
        with pytest.raises(KeyError):
            driver.set_health("ate.dev/other", False)

    def test_unpublishable_resource_is_a_config_error(self) -> None:
        """A resource DRA cannot publish (a name too long for a device attribute) is refused at once."""
        long_name = DraResource("ate.dev/" + "k" * 60, "ate.dev/kvm=kvm")
        with pytest.raises(ConfigError, match="longer than 64 characters"):
            DraDriver(DraConfig(node_name=NODE), [long_name])


async def asyncio_get(
    queue: asyncio.Queue[health_pb2.NodeWatchResourcesResponse],
) -> health_pb2.NodeWatchResourcesResponse:
    async with asyncio.timeout(5):
        return await queue.get()
