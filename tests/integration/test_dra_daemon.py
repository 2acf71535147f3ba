"""The whole daemon in ``mode = "dra"``: the DRA driver fed by the device registry, its CDI specs, its
STATUS, its stop; against the fake DRA kubelet and the fake API server (tests/fakes), and podman as the
real reader of the CDI spec a prepared claim names."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from ate_devplugd import config as configmod
from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.kubelet.lock import InstanceLock
from ate_devplugd.node.kernel import UdevKernelView
from tests.fakes.dra_kubelet import WIPING_DELAY
from tests.integration.dra_rig import DRIVER, NODE, DraNode, dra_node, short_dir, write_kubeconfig
from tests.podman import Podman
from tests.support import (
    FakeKernel,
    FakeMonitor,
    NotifyReceiver,
    daemon_in_process,
    kvm_config,
    run_cli,
    wait_for_content,
)

SANDBOX = (4242, 4242)


class TestDraMode:
    async def test_registers_publishes_prepares_and_stops(self, fake_root: Path, kernel: FakeKernel) -> None:
        """kubelet registers the driver; one slice of 128 devices is published; a prepared claim names the
        CDI device whose spec the daemon wrote; a vanished device withdraws the slice's devices; the stop
        leaves no socket."""
        monitor = FakeMonitor()
        try:
            async with dra_node(kernel, fake_root, monitor) as node:
                assert (await node.kubelet.next_event("registered")).name == DRIVER
                status = await node.status("registered with kubelet, slice published")
                # the runtime's CDI verdict follows as its own part once the runtime (absent here) was asked
                dra_part, withheld_part = status.split(" | cdi: ")[0].split(" | ")
                assert dra_part == (
                    "dra: registered with kubelet, slice published (128 devices), layout units (sharing set in config)"
                )
                # the device-plugin path DRA mode keeps registered with every unit Unhealthy (no kubelet.sock here)
                assert withheld_part.startswith("ate.dev/kvm: device-plugin path withheld (DRA mode)")
                (published,) = node.api.node_slices()
                assert published["spec"]["driver"] == DRIVER and len(published["spec"]["devices"]) == 128
                claim = node.claim("vm-1")
                response = await node.kubelet.prepare(DRIVER, claim)
                (device,) = response.claims[claim[1]].devices
                assert list(device.cdi_device_ids) == ["ate.dev/kvm=kvm"]
                assert (Path(node.config.cdi_dir) / "ate.dev-kvm.json").exists()
                assert node.running.events.named("dra-prepare")

                kernel.remove_node(fake_root / "dev" / "kvm")
                monitor.emit("remove")
                await node.status("slice published (no device offered)")
                assert node.api.node_slices()[0]["spec"]["devices"] == []

                assert await node.running.stop() == 0
                assert not Path(node.config.dra.plugin_socket).exists()  # type: ignore[union-attr]
                assert not Path(node.config.dra.registration_socket).exists()  # type: ignore[union-attr]
        finally:
            monitor.close()

    async def test_reload_to_another_node_name_prepares_its_cdi_device(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A reload that gives a resource another device node (so another CDI device name) rewrites its
        spec; a claim prepared after it names the device that spec defines, not the old one."""
        kernel.add_node(fake_root / "dev" / "kvm2", (10, 233))
        kernel.names[(10, 233)] = "/dev/kvm2"
        new: list[Config] = []
        async with dra_node(kernel, fake_root, reload_config=lambda: new[0]) as node:
            await node.kubelet.next_event("registered")
            await node.status("slice published")
            moved = dataclasses.replace(node.config.devices[0], path="/dev/kvm2")
            new.append(dataclasses.replace(node.config, devices=(moved,)))
            node.running.daemon.request_reload()
            await node.running.events.wait_for("reload")
            spec = json.loads((Path(node.config.cdi_dir) / "ate.dev-kvm.json").read_text())
            assert [d["name"] for d in spec["devices"]] == ["kvm2"]
            claim = node.claim("vm-1")
            response = await node.kubelet.prepare(DRIVER, claim)
            assert list(response.claims[claim[1]].devices[0].cdi_device_ids) == ["ate.dev/kvm=kvm2"]

    async def test_reload_that_adds_a_resource_is_refused_whole(self, fake_root: Path, kernel: FakeKernel) -> None:
        """DRA mode publishes the resources it started with: a reload that adds one and moves another to
        another node is refused as a whole, in one line, so the moved resource's spec stays as it was;
        STATUS ends with the refusal."""
        kernel.add_node(fake_root / "dev" / "kvm2", (10, 233))
        kernel.names[(10, 233)] = "/dev/kvm2"
        new: list[Config] = []
        async with dra_node(kernel, fake_root, reload_config=lambda: new[0]) as node:
            await node.kubelet.next_event("registered")
            await node.status("slice published")
            moved = dataclasses.replace(node.config.devices[0], path="/dev/kvm2")
            added = DeviceConfig("ate.dev/vhost-net", "/dev/vhost-net", cdi=True)
            new.append(dataclasses.replace(node.config, devices=(moved, added)))
            node.running.daemon.request_reload()
            record = await node.running.events.wait_for("reload-failed")
            line = "DRA mode's set of resources changes only on restart (adding ate.dev/vhost-net), so nothing"
            line += " of this reload was applied"
            assert record.getMessage() == line
            assert node.running.daemon.status_line().split(" | reload refused ")[1].endswith(line)
            spec = json.loads((Path(node.config.cdi_dir) / "ate.dev-kvm.json").read_text())
            assert [d["name"] for d in spec["devices"]] == ["kvm"]
            assert not node.running.events.named("reload")

    async def test_kubelet_restart_republishes(self, fake_root: Path, kernel: FakeKernel) -> None:
        """kubelet's start deletes the node's slices: the daemon publishes again within a second."""
        async with dra_node(kernel, fake_root) as node:
            await node.status("slice published")
            deleted = node.api.kubelet_restarted()
            assert deleted
            kind, obj = await node.api.next_change("ADDED", timeout=1.0)
            assert kind == "ADDED" and obj["spec"]["nodeName"] == NODE

    async def test_refused_credentials_in_status_then_replaced_without_a_restart(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """The API server stops accepting the daemon's token: STATUS says so with what to do, and one
        warning; the kubeconfig written again with a new token is used at once, with no restart."""
        async with dra_node(kernel, fake_root) as node:
            await node.status("slice published")
            node.api.token = "n3w-t0ken"
            node.api.end_watches()  # the connection renews its watch, and is refused
            status = await node.status("the API server refuses the credentials")
            assert "401 Unauthorized" in status and "write a new one" in status, status
            (refused,) = node.running.events.named("dra-credentials-refused")
            assert refused.levelno == logging.WARNING
            assert node.config.dra is not None
            write_kubeconfig(Path(node.config.dra.kubeconfig), node.api.url, token="n3w-t0ken")
            await node.status("slice published")
            assert node.running.events.named("dra-credentials-changed")

    async def test_status_when_kubelet_registers_between_its_deletion_and_the_republish(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A kubelet restart in this order: its start deletes the slice, it registers the driver again,
        and only then does the republish land. STATUS says so at each step and ends with all 128
        devices; it never claims the device is absent."""
        async with dra_node(kernel, fake_root) as node:
            await node.kubelet.next_event("registered")
            await node.status("dra: registered with kubelet, slice published (128 devices)")
            node.api.hold_creates()
            assert node.api.kubelet_restarted()
            await node.api.next_request("POST /apis/resource.k8s.io/v1/resourceslices")  # held
            await node.status("dra: registered with kubelet, slices deleted, publishing again")
            await node.kubelet.restart()
            await node.kubelet.next_event("registered")  # after the daemon answered the notice
            node.api.release_creates()
            await node.api.next_change("ADDED")
            await node.status("dra: registered with kubelet, slice published (128 devices)")
            shown = [f["STATUS"] for f in node.notify.history if "STATUS" in f]
            assert not [s for s in shown if "no device offered" in s], shown

    async def test_live_socket_at_the_registration_path_stops_the_start(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Another process serving on the registration socket: one error naming it, exit 73, no traceback,
        and neither that socket nor any of ours left behind by us."""
        async with short_dir() as base:
            dra = DraConfig(node_name=NODE, kubeconfig=str(base / "kubeconfig"), kubelet_dir=str(base / "kubelet"))
            plugin_dir = base / "device-plugins"
            plugin_dir.mkdir()
            config = dataclasses.replace(kvm_config(plugin_dir, fake_root, cdi=True), mode="dra", dra=dra)
            registration = Path(dra.registration_socket)
            registration.parent.mkdir(parents=True)
            with socket.socket(socket.AF_UNIX) as other:
                other.bind(str(registration))
                other.listen()
                async with daemon_in_process(config, kernel) as running:
                    async with asyncio.timeout(10):
                        assert await running.task == 73
                (error,) = [r for r in running.events.records if r.levelno >= logging.ERROR]
                assert str(registration) in error.getMessage() and not error.exc_info
                assert registration.is_socket()
                assert not Path(dra.plugin_socket).exists()

    async def test_holds_its_own_directory_not_kubelets_device_plugin_one(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """DRA mode neither makes kubelet's device-plugin directory nor names its instance lock after it:
        the lock is the driver's plugin directory's, so a second daemon for that driver is refused (naming
        that directory) while kubelet's device-plugin directory stays free for a device-plugin daemon."""
        async with short_dir() as base:
            dra = DraConfig(node_name=NODE, kubeconfig=str(base / "kubeconfig"), kubelet_dir=str(base / "kubelet"))
            device_plugins = base / "kubelet" / "device-plugins"
            config = dataclasses.replace(kvm_config(device_plugins, fake_root, cdi=True), mode="dra", dra=dra)
            async with daemon_in_process(config, kernel) as running:
                await running.events.wait_for("ready")
                assert Path(dra.plugin_socket).is_socket()
                assert not device_plugins.exists()
                ours = base / "kubelet" / "plugins" / DRIVER
                assert InstanceLock(str(ours)).holder() == (os.getpid(), os.geteuid())
                assert InstanceLock(str(device_plugins)).holder() is None
                async with daemon_in_process(config, kernel) as second:
                    async with asyncio.timeout(10):
                        assert await second.task == os.EX_CANTCREAT
                refusal = f"another ate-devplugd is already running for {ours}; not starting"
                assert refusal in [r.getMessage() for r in second.events.records]
                assert await running.stop() == 0
            assert not device_plugins.exists()


async def probe(config: Config, directory: Path, *, served: bool = True) -> tuple[int, list[str]]:
    """``ate-devplugd probe`` run with ``config`` written to a file: its exit status and lines. A daemon
    serving it is probed with nothing said on stderr; with none (``served`` False) stderr says so, naming
    the driver's directory it would serve in."""
    path = directory / "probe.toml"
    path.write_text(configmod.render(config))
    status, out, err = await run_cli("probe", "--config", str(path), "--timeout", "3")
    assert config.dra is not None
    nobody = f"ate-devplugd: no ate-devplugd serves {os.path.dirname(config.dra.plugin_socket)}"
    assert (not err) if served else err.startswith(nobody), err
    return status, out.splitlines()


class TestProbe:
    async def test_what_the_node_serves(self, fake_root: Path, kernel: FakeKernel) -> None:
        """probe in DRA mode: GetInfo of the registration socket, the plugin socket answering with the
        devices' health (both layouts' devices, where the layout follows the cluster), the node's slice of
        the driver, and the layout the API server's answer decides (here: shared)."""
        async with dra_node(kernel, fake_root, sharing=None) as node:
            await node.kubelet.next_event("registered")
            await node.status("slice published (1 device), layout shared")
            status, lines = await probe(node.config, node.dir)
            (published,) = node.api.node_slices()
        dra = node.config.dra
        assert dra is not None
        assert status == 0, lines
        assert lines[0].split() == ["CHECK", "WHERE", "RESULT"]
        registration, plugin, slices, layout = (line.split(None, 2) for line in lines[1:5])
        assert registration == [
            "registration",
            dra.registration_socket,
            f"GetInfo: DRAPlugin {DRIVER}, v1.DRAPlugin v1beta1.DRAPlugin, endpoint {dra.plugin_socket}",
        ]
        assert plugin == ["plugin", dra.plugin_socket, "DRAPlugin v1 answers; health: 129/129 devices healthy"]
        assert slices == ["slices", node.api.url, f"1 ResourceSlice of {DRIVER} on node {NODE}"]
        assert layout == [
            "layout",
            node.api.url,
            "shared (decided: the API server keeps allowMultipleAllocations)",
        ]
        assert lines[5] == ""
        assert lines[6].split() == ["SLICE", "POOL", "GENERATION", "DEVICES", "LAYOUT"]
        assert lines[7].split() == [published["metadata"]["name"], f"{NODE}/ate.dev/kvm", "1", "1", "shared"]

    async def test_units_said_as_set(self, fake_root: Path, kernel: FakeKernel) -> None:
        """With ``sharing = "units"`` probe says so, and asks the API server nothing about it."""
        async with dra_node(kernel, fake_root) as node:
            await node.status("slice published (128 devices), layout units (sharing set in config)")
            status, lines = await probe(node.config, node.dir)
            dry_runs = node.api.dry_runs
        assert status == 0, lines
        assert lines[4].split(None, 2)[2] == "units (sharing set in config)" and dry_runs == 0
        assert lines[7].split()[3:] == ["128", "units"]

    async def test_nothing_served(self, fake_root: Path) -> None:
        """No daemon and no API server: each check says what failed, and probe exits 1."""
        async with short_dir() as base:
            dra = DraConfig(node_name=NODE, kubeconfig=str(base / "kubeconfig"), kubelet_dir=str(base / "kubelet"))
            config = dataclasses.replace(kvm_config(base, fake_root, cdi=True), mode="dra", dra=dra)
            status, lines = await probe(config, base, served=False)
        assert status == 1, lines
        assert [line.split()[0] for line in lines[1:]] == ["registration", "plugin", "slices"]
        assert all(" ERROR " in line for line in lines[1:]), lines
        assert "kubeconfig: no such file" in lines[3] and "Errno" not in lines[3], lines


WRITES = ("POST ", "PUT ", "PATCH ", "DELETE ")


class TestDraRestart:
    """A daemon restart (an upgrade in place, ``systemctl restart``) against kubelet's grace for drivers
    that deregister (30 s, then kubelet deletes the driver's slices on the node)."""

    @staticmethod
    async def restart(
        node: DraNode, kernel: FakeKernel, *, after: str | None = None
    ) -> tuple[float, list[dict[str, object]]]:
        """Stop the daemon (and wait for kubelet's event ``after``, if given), start a new daemon and wait until it is
        registered and its slices are published; returns the seconds from the stop to the new registration
        and the slices of the node from before the restart."""
        before = node.api.node_slices()
        while not node.api.changes.empty():
            node.api.changes.get_nowait()
        loop = asyncio.get_running_loop()
        stopped_at = loop.time()
        assert await node.running.stop() == 0
        assert (await node.kubelet.next_event("deregistered")).name == DRIVER
        assert (await node.kubelet.next_event("wipe-pending")).name == DRIVER
        if after is not None:
            await node.kubelet.next_event(after, timeout=10)
        notify = NotifyReceiver(node.dir / "notify-again")
        try:
            async with daemon_in_process(node.config, kernel, notify=notify.path):
                await node.kubelet.next_event("registered", timeout=10)
                back = loop.time() - stopped_at
                await notify.wait_for(lambda f: "registered with kubelet, slice published" in f.get("STATUS", ""))
        finally:
            await notify.close()
        return back, before

    async def test_restart_inside_kubelets_grace_keeps_the_slice(self, fake_root: Path, kernel: FakeKernel) -> None:
        """Stopped and started again within kubelet's 30 s: kubelet cancels its wipe, and the published slice
        stays the same object (name, uid, resourceVersion): nothing deleted, created or updated."""
        async with dra_node(kernel, fake_root) as node:
            await node.kubelet.next_event("registered")
            await node.status("slice published")
            requests = len(node.api.requests)
            back, before = await self.restart(node, kernel)
            assert (await node.kubelet.next_event("wipe-cancelled")).name == DRIVER
            print(f"daemon restart: registered again {back * 1000:.0f} ms after the stop (grace {WIPING_DELAY:g} s)")
            assert back < WIPING_DELAY
            assert node.api.node_slices() == before and len(before) == 1
            assert node.api.changes.empty()
            assert [r for r in node.api.requests[requests:] if r.startswith(WRITES)] == []

    async def test_restart_past_kubelets_grace_loses_the_slice(self, fake_root: Path, kernel: FakeKernel) -> None:
        """The same restart once the grace is over (shortened here): kubelet deletes the slice and the new
        daemon creates another, which the test above would see."""
        async with dra_node(kernel, fake_root, wiping_delay=0.2) as node:
            await node.kubelet.next_event("registered")
            await node.status("slice published")
            _, before = await self.restart(node, kernel, after="wiped")
            kinds = [node.api.changes.get_nowait()[0] for _ in range(node.api.changes.qsize())]
            assert kinds == ["DELETED", "ADDED"]
            (after,) = node.api.node_slices()
            assert after["metadata"]["uid"] != before[0]["metadata"]["uid"]


class TestDraWithARealRuntime:
    async def test_prepared_claim_opens_kvm_in_podman(self, podman: Podman) -> None:
        """The CDI id a prepared claim returns, given to podman with the daemon's spec directory: a process
        that dropped to a stranger's uid opens the host's /dev/kvm (KVM API 12)."""
        async with dra_node(UdevKernelView(), Path("/")) as node:
            await node.kubelet.next_event("registered")
            await node.status("slice published")
            claim = node.claim("vm-1")
            response = await node.kubelet.prepare(DRIVER, claim)
            ids = list(response.claims[claim[1]].devices[0].cdi_device_ids)
            check = await podman.run(cdi_devices=ids, run_as=SANDBOX, spec_dir=Path(node.config.cdi_dir))
        assert check.opened and check.api_version == 12, check.raw


REGISTERED = 'ate_devplugd_registered{resource="ate.dev/kvm"} '


async def doctor(node: DraNode) -> dict[str, dict[str, Any]]:
    """``ate-devplugd doctor --json`` on the node: its checks by name."""
    path = node.dir / "doctor.toml"
    path.write_text(configmod.render(node.config))
    _status, out, err = await run_cli("doctor", "--json", "--config", str(path))
    assert out, err
    return {check["check"]: check for check in json.loads(out)["checks"]}


async def health_held(node: DraNode) -> None:
    """Until kubelet has the first message of the driver's health stream (the stream is open)."""
    async with asyncio.timeout(5):
        await node.kubelet.plugins[DRIVER].health.get()


class TestKubeletFollowed:
    """kubelet registers a DRA driver once and says nothing when it stops: STATUS, the registered gauge and
    doctor must still say when it is gone, and registered again once the next kubelet registers the driver."""

    async def test_stop_and_start(self, fake_root: Path, kernel: FakeKernel) -> None:
        """kubelet 1.36 as the driver sees it (its process listening on kubelet.sock, its health stream
        held) stopped and started twice: "kubelet gone, not registered" and 0 while it is stopped, doctor
        FAILs the registration beside kubelet; registered and 1 once it registered the driver again."""
        prom = fake_root / "m.prom"
        gone: list[float] = []
        back: list[float] = []
        files: list[float] = []
        async with dra_node(kernel, fake_root, metrics_file=prom, kubelet_process=True, hold_health=True) as node:
            await node.kubelet.next_event("registered")
            await node.status("dra: registered with kubelet")
            await health_held(node)
            await wait_for_content(prom, REGISTERED + "1")
            checks = await doctor(node)
            assert (checks["kubelet"]["level"], checks["registered ate.dev/kvm"]["level"]) == ("OK", "OK"), checks
            for _ in range(2):
                node.notify.forget()
                began = time.monotonic()
                await node.kubelet.stop()
                at, _ = await node.notify.wait_stamped(
                    lambda f: f.get("STATUS", "").startswith("dra: kubelet gone, not registered, slice published")
                )
                await wait_for_content(prom, REGISTERED + "0")
                files.append(time.monotonic() - began)
                gone.append(at - began)
                checks = await doctor(node)
                assert checks["kubelet"]["level"] == "FAIL", checks
                assert checks["registered ate.dev/kvm"]["level"] == "FAIL", checks
                node.notify.forget()
                began = time.monotonic()
                await node.kubelet.start()
                at, _ = await node.notify.wait_stamped(
                    lambda f: f.get("STATUS", "").startswith("dra: registered with kubelet")
                )
                await wait_for_content(prom, REGISTERED + "1")
                back.append(at - began)
                await node.kubelet.next_event("registered")  # kubelet took the answer to its notice
                await health_held(node)
                checks = await doctor(node)
                assert checks["registered ate.dev/kvm"]["level"] == "OK", checks
            assert len(node.running.events.named("dra-kubelet-gone")) == 2
        ms = ", ".join(f"{1000 * g:.1f}" for g in gone)
        in_file = ", ".join(f"{1000 * f:.1f}" for f in files)
        print(
            f"STATUS kubelet gone {ms} ms after its stop (metrics file: {in_file} ms); "
            f"registered again {back[0]:.2f}, {back[1]:.2f} s after start"
        )
        assert max(gone) < 2.0 and max(files) < 3.0, (gone, files)

    async def test_process_alone(self, fake_root: Path, kernel: FakeKernel) -> None:
        """A kubelet that holds no health stream (before 1.36): its process ending is enough."""
        async with dra_node(kernel, fake_root, kubelet_process=True) as node:
            await node.kubelet.next_event("registered")
            await node.status("dra: registered with kubelet")
            began = time.monotonic()
            await node.kubelet.stop()
            at, _ = await node.notify.wait_stamped(lambda f: "dra: kubelet gone" in f.get("STATUS", ""))
            print(f"STATUS kubelet gone {1000 * (at - began):.1f} ms after its process ended")

    async def test_health_stream_alone(self, fake_root: Path, kernel: FakeKernel) -> None:
        """No kubelet process to follow: kubelet ending its health stream, with no kubelet.sock answering,
        is enough."""
        async with dra_node(kernel, fake_root, hold_health=True) as node:
            await node.kubelet.next_event("registered")
            await node.status("dra: registered with kubelet")
            await health_held(node)
            began = time.monotonic()
            await node.kubelet.stop()
            at, _ = await node.notify.wait_stamped(lambda f: "dra: kubelet gone" in f.get("STATUS", ""))
            print(f"STATUS kubelet gone {1000 * (at - began):.1f} ms after its health stream ended")

    async def test_restart_is_not_gone(self, fake_root: Path, kernel: FakeKernel) -> None:
        """kubelet restarted: at most a moment of "gone" or "waiting", then registered with the new one."""
        async with dra_node(kernel, fake_root, kubelet_process=True, hold_health=True) as node:
            await node.kubelet.next_event("registered")
            await node.status("dra: registered with kubelet")
            await node.kubelet.restart()
            await node.kubelet.next_event("registered")  # after the daemon answered its notice
            await health_held(node)
            # the new kubelet's kubelet.sock events, whenever they are read, leave it registered
            assert node.running.daemon.status_line().startswith("dra: registered with kubelet")


class TestDevicePluginModeWithDraTable:
    async def test_unprepare_only_driver_refuses_prepare_and_unprepares(
        self, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Device-plugin mode with a [dra] table keeps DRA's plugin registered for unprepare only: no slice,
        a prepare refused with the reason, an unprepare answered (DRA pods left here can be deleted)."""
        async with short_dir() as base:
            from tests.fakes.dra_kubelet import FakeDraKubelet

            dra = DraConfig(node_name=NODE, kubeconfig=str(base / "none"), kubelet_dir=str(base / "kubelet"))
            plugin_dir = base / "device-plugins"
            plugin_dir.mkdir()
            config = dataclasses.replace(kvm_config(plugin_dir, fake_root, cdi=True), dra=dra)
            kubelet = FakeDraKubelet(base / "kubelet")
            async with daemon_in_process(config, kernel) as running:
                await kubelet.start()
                try:
                    assert (await kubelet.next_event("registered")).name == DRIVER
                    claim = ("default", "uid-1", "vm-1")
                    response = await kubelet.prepare(DRIVER, claim)
                    assert "unprepare only (device-plugin mode" in response.claims["uid-1"].error
                    response = await kubelet.unprepare(DRIVER, claim)
                    assert response.claims["uid-1"].error == ""
                    assert "dra: unprepare only" in running.daemon.status_line()
                finally:
                    await kubelet.stop()

    @pytest.mark.parametrize("checkpoint", ["names-driver", "other-driver", "none"])
    async def test_without_kubelets_plugin_directories_it_runs_on(
        self, fake_root: Path, kernel: FakeKernel, checkpoint: str
    ) -> None:
        """Where kubelet's plugin directories cannot be made (the unit without dra-mode.conf), the
        unprepare-only driver is left out and device-plugin mode serves as before: one warning while
        kubelet's checkpoint records a claim of ours (pods left that cannot be deleted), one info line when
        it records none (a node moved back with no DRA pod left, at each start)."""
        async with short_dir() as base:
            kubelet_dir = base / "kubelet"
            kubelet_dir.mkdir()
            (kubelet_dir / "plugins").write_text("")  # where the driver's directory would be made
            state = {"names-driver": DRIVER, "other-driver": "gpu.example.com", "none": ""}[checkpoint]
            if state:
                body = json.dumps({"ClaimInfoStateList": [{"DriverState": {state: {}}}]})
                (kubelet_dir / "dra_manager_state").write_text(json.dumps({"Data": body, "Checksum": 1}))
            dra = DraConfig(node_name=NODE, kubeconfig=str(base / "none"), kubelet_dir=str(kubelet_dir))
            plugin_dir = base / "device-plugins"
            plugin_dir.mkdir()
            config = dataclasses.replace(kvm_config(plugin_dir, fake_root, cdi=True), dra=dra)
            async with daemon_in_process(config, kernel) as running:
                record = await running.events.wait_for("dra-unprepare-unavailable")
                await running.events.wait_for("ready")
                assert "dra:" not in running.daemon.status_line()
                owed = checkpoint == "names-driver"
                assert record.levelno == (logging.WARNING if owed else logging.INFO), record.getMessage()
                assert ("records a claim of" if owed else "none is owed") in record.getMessage()
