"""The whole daemon on the test's own loop: registration, kubelet restarts, reload, hotplug, sd_notify.

The kernel's device nodes are a table (``FakeKernel``) and udev is a pipe (``FakeMonitor``); everything
else is real: gRPC on unix sockets, the fake kubelet, inotify, sd_notify datagrams. No root, no
/dev/kvm: these run for any contributor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from ate_devplugd import config as configmod
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.deviceplugin import endpoint, plugins
from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import LOADED_WAIT, full_tmpfs, read_only_bind
from tests.support import (
    RESOURCE,
    SOCKET,
    EventRecorder,
    FakeKernel,
    FakeMonitor,
    NotifyReceiver,
    daemon_in_process,
    kvm_config,
    record_of,
    run_cli,
    started_kubelet,
    wait_for_path,
    write_config,
)

KVM_COUNT_0 = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 0\n'


def registrations(kubelet: FakeKubelet) -> int:
    return len([e for e in kubelet.history if e.kind == "register"])


def no_double_registration(kubelet: FakeKubelet) -> None:
    assert not [e for e in kubelet.history if e.kind == "double-register"]


class TestRegistration:
    async def test_serves_registers_and_grants(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """v1beta1, a base-name endpoint, 4096 Healthy units, Allocate grants the node; stop removes the socket."""
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
                reg = await kubelet.next_event("register", "register-rejected")
                assert (reg.kind, reg.resource, reg.endpoint) == ("register", RESOURCE, SOCKET)
                lst = await kubelet.next_event("list")
                assert (lst.healthy, lst.total) == (4096, 4096)
                assert lst.ids == [f"kvm-{i}" for i in range(4096)]
                (cresp,) = (await kubelet.allocate(RESOURCE, ["kvm-9"])).container_responses
                assert [(d.host_path, d.container_path, d.permissions) for d in cresp.devices] == [
                    ("/dev/kvm", "/dev/kvm", "rw")
                ]
                assert running.daemon.status_line() == "ate.dev/kvm: 4096/4096 healthy, registered"
                assert await running.stop() == 0
            assert not (plugin_dir / SOCKET).exists()
            no_double_registration(kubelet)
        finally:
            await kubelet.stop()

    async def test_kubelet_absent_at_start(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """With no kubelet the daemon serves and waits; once kubelet.sock appears it registers, once."""
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await running.events.wait_for("ready")
            assert running.daemon.status_line().endswith("waiting for kubelet")
            kubelet = await started_kubelet(plugin_dir)
            try:
                await kubelet.next_event("list")
                assert registrations(kubelet) == 1
                record = await running.events.wait_for("registered")
                assert record.levelno == logging.INFO
            finally:
                await kubelet.stop()

    async def test_stale_kubelet_socket_at_start(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """A dead kubelet.sock left by a killed kubelet: the daemon waits; the kubelet's first start is
        followed as a restart (info, not a warning) and registers once."""
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(plugin_dir / "kubelet.sock"))
        dead.close()
        async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
            await wait_for_path(plugin_dir / SOCKET)
            kubelet = await started_kubelet(plugin_dir)
            try:
                await kubelet.next_event("list")
                assert registrations(kubelet) == 1
                assert not running.events.named("socket-removed"), running.events.text()
            finally:
                await kubelet.stop()


class TestKubeletRestart:
    async def test_restarts_the_kubelet_way(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """kubelet killed and started again (its old socket left behind, then every socket removed in a random
        order, then kubelet.sock created): one new registration each time, every one logged as
        kubelet-restart at info, never as a foreign removal."""
        kubelet = await started_kubelet(plugin_dir, seed=6)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
                await kubelet.next_event("list")
                for n in range(1, 21):
                    await kubelet.restart()
                    await kubelet.next_event("list")
                    assert registrations(kubelet) == n + 1
                no_double_registration(kubelet)
                assert not [r for r in running.events.records if r.levelno >= logging.WARNING], running.events.text()
                restarts = running.events.named("kubelet-restart")
                assert restarts and {r.levelno for r in restarts} == {logging.INFO}
        finally:
            await kubelet.stop()

    async def test_short_lived_kubelets_do_not_warn(
        self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Twelve kubelets in a row, each gone while the daemon's Register to it is in flight: the failed
        attempts are counted per kubelet, so none is a warning (the tenth toward one kubelet is); the
        kubelet that stays gets exactly one registration."""
        lives = 12
        kubelet = await started_kubelet(plugin_dir)
        arrived = asyncio.Event()
        kubelet.on_register = arrived.set
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
                await kubelet.next_event("list")
                kubelet.register_delay = 60.0  # each Register is held until its kubelet goes
                for _ in range(lives):
                    arrived.clear()
                    await kubelet.restart()
                    async with asyncio.timeout(LOADED_WAIT):
                        await arrived.wait()
                kubelet.register_delay = 0.0
                await kubelet.restart()
                await kubelet.next_event("list")
                last = max(i for i, e in enumerate(kubelet.history) if e.kind == "restart")
                assert [e.kind for e in kubelet.history[last:]].count("register") == 1
                # One attempt cancelled per kubelet, each counted afresh: the count never runs on across
                # kubelets: twelve lives fail at least twelve attempts, and a count that ran on would reach
                # the tenth (a warning) among them. How many count toward one kubelet is the interleaving's:
                # its kubelet.sock, bound a while before it listens, refuses a retry or two (seen: three
                # toward one kubelet on a loaded machine), or a retry looked at one kubelet.sock and
                # connected to the next kubelet's.
                attempts = [
                    int(r.getMessage().split("(attempt ")[1].split(")")[0])
                    for r in running.events.named("register-failed")
                ]
                assert len(attempts) >= lives and max(attempts) < 10, running.events.text()
                assert not [r for r in running.events.records if r.levelno >= logging.WARNING], running.events.text()
                no_double_registration(kubelet)
        finally:
            await kubelet.stop()

    async def test_socket_removed_before_the_old_kubelet_sock(
        self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """The moment kubelet's wipe has removed our socket but not yet its old kubelet.sock (no new one
        yet either) is already told apart from a foreign removal: the old kubelet.sock no longer answers."""
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
                await kubelet.next_event("list")
                await kubelet.stop(graceful=False)
                assert (plugin_dir / "kubelet.sock").exists()
                (plugin_dir / SOCKET).unlink()  # the wipe, first step
                record = await running.events.wait_for("kubelet-restart")
                assert record.levelno == logging.INFO
                await wait_for_path(plugin_dir / SOCKET)  # served anew, waiting for the new kubelet
                await kubelet.start()  # the rest of the wipe, then the new kubelet.sock
                await kubelet.next_event("register")
                assert not running.events.named("socket-removed"), running.events.text()
        finally:
            await kubelet.stop()

    async def test_foreign_removal_is_a_warning(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """Our socket removed while the kubelet we registered with still runs: a warning, served and
        registered anew."""
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
                await kubelet.next_event("list")
                (plugin_dir / SOCKET).unlink()
                record = await running.events.wait_for("socket-removed")
                assert record.levelno == logging.WARNING
                await kubelet.next_event("register")
                assert not running.events.named("kubelet-restart")
        finally:
            await kubelet.stop()


class TestReload:
    async def test_changed_device_keeps_its_stream(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """A reload that changes count and permissions sends the new list on the open ListAndWatch stream
        and answers Allocate from the new config: no Register, no stream ended, never a list at 0."""
        config = kvm_config(plugin_dir, fake_root, count=8)
        current = [config]
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel, reload_config=lambda: current[0]) as running:
                await kubelet.next_event("list")
                stream = kubelet.endpoints[RESOURCE].stream_task
                current[0] = kvm_config(plugin_dir, fake_root, count=4, permissions="rwm")
                running.daemon.request_reload()
                lst = await kubelet.next_event("list")
                assert (lst.healthy, lst.total, lst.ids) == (4, 4, [f"kvm-{i}" for i in range(4)])
                await running.events.wait_for("reload")
                (cresp,) = (await kubelet.allocate(RESOURCE, ["kvm-3"])).container_responses
                assert cresp.devices[0].permissions == "rwm"
                with pytest.raises(grpc.aio.AioRpcError):
                    await kubelet.allocate(RESOURCE, ["kvm-4"])
                assert kubelet.endpoints[RESOURCE].stream_task is stream and stream is not None and not stream.done()
                assert registrations(kubelet) == 1
                assert [e.kind for e in kubelet.history if e.kind in ("stream-ended", "register")] == ["register"]
                assert all(e.total for e in kubelet.history if e.kind == "list")
        finally:
            await kubelet.stop()

    async def test_added_and_removed(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """An added resource is served and registered (STATUS in the new config's order); a removed one's
        socket goes; the kept one is untouched."""
        kernel.add_node(fake_root / "dev" / "vhost-net", (10, 238))
        kernel.names[(10, 238)] = "/dev/vhost-net"
        vhost = DeviceConfig("ate.dev/vhost-net", "/dev/vhost-net", count=2)
        base = kvm_config(plugin_dir, fake_root, count=8)
        current = [base]
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(base, kernel, reload_config=lambda: current[0]) as running:
                await kubelet.next_event("list")
                stream = kubelet.endpoints[RESOURCE].stream_task
                current[0] = dataclasses.replace(base, devices=(vhost, *base.devices))
                running.daemon.request_reload()
                lst = await kubelet.next_event("list", resource="ate.dev/vhost-net")
                assert lst.total == 2
                await running.events.wait_for("reload")
                parts = running.daemon.status_line().split(" | ")
                assert [part.split(": ")[0] for part in parts] == ["ate.dev/vhost-net", RESOURCE]
                current[0] = base
                running.daemon.request_reload()
                await kubelet.next_event("stream-ended", resource="ate.dev/vhost-net")
                await running.events.wait_for("reload")
                assert not (plugin_dir / "ate.dev-vhost-net.sock").exists()
                assert kubelet.endpoints[RESOURCE].stream_task is stream and stream is not None and not stream.done()
                assert running.daemon.status_line() == "ate.dev/kvm: 8/8 healthy, registered"
        finally:
            await kubelet.stop()

    async def test_bad_config_keeps_the_running_one(
        self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A config error on reload is logged per field; the running config stays, registration untouched."""

        def broken() -> Config:
            raise ConfigError(["device[0] (ate.dev/kvm): count: 0 must be an integer from 1 to 65536"])

        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel, reload_config=broken) as running:
                await kubelet.next_event("list")
                running.daemon.request_reload()
                record = await running.events.wait_for("reload-failed")
                assert "count: 0" in record.getMessage() and record.levelno == logging.ERROR
                await kubelet.allocate(RESOURCE, ["kvm-4095"])
                assert registrations(kubelet) == 1
        finally:
            await kubelet.stop()

    async def test_refused_reload_stays_in_status_until_a_good_one(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """After a refused reload STATUS (sent with READY=1) ends with `reload refused HH:MM:SS: <first
        error>`, and stops saying so at the next good reload. The config the daemon's record announces
        changes only with the good one, and the record goes with the daemon."""
        config = kvm_config(plugin_dir, fake_root, count=8)
        current: list[Config | ConfigError] = [config]

        def reload() -> Config:
            if isinstance(current[0], ConfigError):
                raise current[0]
            return current[0]

        notify = NotifyReceiver(tmp_path / "notify")

        async def announced() -> Config | None:
            found = await record_of(config)
            return found.config if found is not None else None

        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel, reload_config=reload, notify=notify.path) as running:
                await notify.wait_for(lambda f: f.get("STATUS") == "ate.dev/kvm: 8/8 healthy, registered")
                assert await announced() == config
                first = "device[0] (ate.dev/kvm): count: 0 must be an integer from 1 to 65536"
                current[0] = ConfigError([first, "unknown key 'bogus'"])
                running.daemon.request_reload()
                ready = await notify.wait_for(lambda f: "READY" in f)
                kept, refused = ready["STATUS"].split(" | reload refused ")
                assert kept == "ate.dev/kvm: 8/8 healthy, registered"
                assert re.fullmatch(r"\d\d:\d\d:\d\d: " + re.escape(first), refused), ready
                assert await announced() == config
                current[0] = kvm_config(plugin_dir, fake_root, count=4)
                running.daemon.request_reload()
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert ready["STATUS"] == "ate.dev/kvm: 4/4 healthy, registered", ready
                assert await announced() == current[0]
            assert await announced() is None
        finally:
            await kubelet.stop()
            await notify.close()

    async def test_mode_change_is_refused_whole(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Device-plugin mode running, a file with `mode = "dra"` and another count: one line names the
        restart-only keys and nothing is applied. CDI stays off (DRA mode reads every device as a CDI one),
        the count stays, kubelet sees nothing new, and STATUS says the reload was refused."""
        config = kvm_config(plugin_dir, fake_root, count=8)
        path = write_config(
            tmp_path / "c.toml",
            plugin_dir,
            fake_root,
            'mode = "dra"\n[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 4\n',
        )
        notify = NotifyReceiver(tmp_path / "notify")
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(
                config, kernel, reload_config=lambda: configmod.load(path), notify=notify.path
            ) as running:
                await kubelet.next_event("list")
                await notify.wait_for(lambda f: "READY" in f)
                running.daemon.request_reload()
                record = await running.events.wait_for("reload-failed")
                line = "mode = 'dra' (running: 'device-plugin'), [dra] added: change only on restart"
                assert record.getMessage().startswith(line) and record.levelno == logging.ERROR
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert ready["STATUS"].split(" | reload refused ")[1].split(": ", 1)[1].startswith(line), ready
                assert running.daemon.config == config
                (cresp,) = (await kubelet.allocate(RESOURCE, ["kvm-7"])).container_responses
                assert not cresp.cdi_devices
                assert not (tmp_path / "cdi" / "ate.dev-kvm.json").exists()
                assert [e.kind for e in kubelet.history if e.kind in ("register", "list")] == ["register", "list"]
                assert not running.events.named("reload")
                assert len(running.events.named("reload-failed")) == 1
        finally:
            await kubelet.stop()
            await notify.close()

    async def test_what_check_config_refuses_is_refused(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A device path that is a directory on this host: check-config refuses it (and so fails the unit's
        reload), and so does the reload itself, instead of applying a file `systemctl reload` reports
        as failed."""
        config = kvm_config(plugin_dir, fake_root, count=8)
        (fake_root / "dev" / "shm").mkdir()
        path = write_config(
            tmp_path / "c.toml", plugin_dir, fake_root, '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/shm"\n'
        )
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel, reload_config=lambda: configmod.load(path)) as running:
                await kubelet.next_event("list")
                running.daemon.request_reload()
                record = await running.events.wait_for("reload-failed")
                assert record.getMessage() == (
                    "config error, keeping the running config: device[0] (ate.dev/kvm): path: '/dev/shm' is a "
                    "directory; path names a device node, e.g. '/dev/kvm'"
                )
                assert running.daemon.config == config
                assert " | reload refused " in running.daemon.status_line()
                await kubelet.allocate(RESOURCE, ["kvm-7"])
        finally:
            await kubelet.stop()

    async def test_probe_uses_the_running_config_when_the_file_is_broken(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """`probe` on a config file that does not parse queries the daemon started from that file, with the
        config it runs (its record's), and says so, naming the file and its first error; with no daemon
        started from it, it is a config error (78), as before."""
        broken = write_config(tmp_path / "c.toml", plugin_dir, fake_root, KVM_COUNT_0)
        status, _, err = await run_cli("probe", "--config", str(broken))
        assert status == 78 and "count" in err, err
        config = kvm_config(plugin_dir, fake_root, count=8)
        async with daemon_in_process(config, kernel, source=broken) as running:
            await running.events.wait_for("ready")
            status, out, err = await run_cli("probe", "--config", str(broken), "--timeout", "3")
            assert status == 0, (out, err)
            assert err.startswith(f"ate-devplugd: probing the running daemon (pid {os.getpid()}, "), err
            assert f"; {broken} does not load: device[0] (ate.dev/kvm): count:" in err, err
            (row,) = [line for line in out.splitlines() if line.startswith(RESOURCE)]
            assert "8/8" in row.split(), out


class TestHotplug:
    async def test_vanish_and_return(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """The node gone (and a uevent): every unit Unhealthy, same IDs; back: Healthy again."""
        monitor = FakeMonitor()
        kubelet = await started_kubelet(plugin_dir)
        node = fake_root / "dev" / "kvm"
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root, count=16), kernel, monitor=monitor):
                first = await kubelet.next_event("list")
                kernel.remove_node(node)
                monitor.emit("remove")
                gone = await kubelet.next_event("list")
                assert (gone.healthy, gone.total, gone.ids) == (0, 16, first.ids)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await kubelet.allocate(RESOURCE, ["kvm-0"])
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                kernel.add_node(node)
                monitor.emit("add")
                assert (await kubelet.next_event("list")).healthy == 16
        finally:
            await kubelet.stop()
            monitor.close()

    async def test_device_appearing_later(self, plugin_dir: Path, fake_root: Path) -> None:
        """A device absent at start is not served; once it appears (and a uevent says so) it registers."""
        kernel = FakeKernel()
        monitor = FakeMonitor()
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel, monitor=monitor) as running:
                await running.events.wait_for("ready")
                assert running.daemon.status_line().startswith("ate.dev/kvm: absent (")
                assert not (plugin_dir / SOCKET).exists() and registrations(kubelet) == 0
                kernel.add_node(fake_root / "dev" / "kvm")
                monitor.emit("add")
                assert (await kubelet.next_event("list")).healthy == 4096
        finally:
            await kubelet.stop()
            monitor.close()


class TestVmAnnouncements:
    """KVM's change uevents for a VM's start and end change no device: no look, no probe, nothing logged
    above debug; a removal among them is seen as soon as it is read."""

    async def test_vm_lifecycles_cost_no_look(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        monitor = FakeMonitor()
        kubelet = await started_kubelet(plugin_dir)
        node = fake_root / "dev" / "kvm"
        try:
            config = kvm_config(plugin_dir, fake_root, count=16, probe="kvm")
            async with daemon_in_process(config, kernel, monitor=monitor) as running:
                assert (await kubelet.next_event("list")).healthy == 16
                calls, logged = kernel.calls.copy(), len(running.events.records)
                for pid in range(1000, 1500):  # 500 VMs started and stopped: 1,000 uevents
                    monitor.emit_vm("create", pid, created=pid, count=1)
                    monitor.emit_vm("destroy", pid, created=pid, count=0)
                kernel.remove_node(node)
                monitor.emit("remove")
                assert (await kubelet.next_event("list")).healthy == 0
                # One look (the removal); the node was gone, so no probe either.
                assert kernel.calls - calls == {"stat_node": 1}
                after = running.events.records[logged:]
                assert [r.ATE_EVENT for r in after if r.levelno > logging.DEBUG] == ["device-removed"]  # type: ignore[attr-defined]
                assert not [r for r in after if r.getMessage().startswith("uevent change misc/kvm")]
        finally:
            await kubelet.stop()
            monitor.close()

    async def test_change_without_vm_properties_is_a_hint(
        self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A change on misc/kvm that is not KVM's announcement (EVENT alone, no CREATED/COUNT/PID) makes
        the daemon look again: here it finds the probe failing."""
        monitor = FakeMonitor()
        kubelet = await started_kubelet(plugin_dir)
        try:
            config = kvm_config(plugin_dir, fake_root, count=16, probe="kvm")
            async with daemon_in_process(config, kernel, monitor=monitor):
                assert (await kubelet.next_event("list")).healthy == 16
                kernel.kvm_version = 11
                monitor.emit_vm("create")
                monitor.emit("change", EVENT="create")
                assert (await kubelet.next_event("list")).healthy == 0
        finally:
            await kubelet.stop()
            monitor.close()


class TestNotify:
    async def test_stalled_reader_stops_nothing(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """systemd not reading its notify socket (queue full): registration, restarts and Allocate go on;
        once it reads again, the latest STATUS arrives."""
        notify = NotifyReceiver(tmp_path / "notify", read=False)
        kubelet = await started_kubelet(plugin_dir)
        monitor = FakeMonitor()
        node = fake_root / "dev" / "kvm"
        try:
            config = kvm_config(plugin_dir, fake_root, count=4)
            async with daemon_in_process(config, kernel, monitor=monitor, notify=notify.path):
                await kubelet.next_event("list")
                for _ in range(8):  # each a STATUS change or two: far more than the queue's ten datagrams
                    kernel.remove_node(node)
                    monitor.emit("remove")
                    assert (await kubelet.next_event("list")).healthy == 0
                    kernel.add_node(node)
                    monitor.emit("add")
                    assert (await kubelet.next_event("list")).healthy == 4
                    await kubelet.restart()
                    await kubelet.next_event("register")
                await kubelet.allocate(RESOURCE, ["kvm-0"])
                notify.start_reading()
                await notify.wait_for(lambda f: f.get("STATUS") == "ate.dev/kvm: 4/4 healthy, registered")
        finally:
            await kubelet.stop()
            await notify.close()
            monitor.close()

    async def test_ready_timeout_is_said(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A first attempt that outlasts the READY timeout (its server slow to start): READY=1 goes out
        all the same, with an event and a part of STATUS that says so until the attempt ends."""
        monkeypatch.setattr(plugins, "READY_TIMEOUT", 0.2)
        release = asyncio.Event()
        start = endpoint.PluginServer.start

        async def slow_start(server: endpoint.PluginServer) -> None:
            await release.wait()
            await start(server)

        monkeypatch.setattr(endpoint.PluginServer, "start", slow_start)
        notify = NotifyReceiver(tmp_path / "notify")
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel, notify=notify.path) as running:
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert ready["STATUS"].endswith(" | ready after 0.2 s without the first attempt of ate.dev/kvm"), ready
                (record,) = [r for r in running.events.named("ready") if r.levelno == logging.WARNING]
                assert record.getMessage() == (
                    "ready after 0.2 s without the first attempt of ate.dev/kvm (see its state in STATUS)"
                )
                release.set()
                await notify.wait_for(lambda f: f.get("STATUS") == "ate.dev/kvm: 4096/4096 healthy, registered")
        finally:
            await kubelet.stop()
            await notify.close()

    async def test_ready_then_status_then_stopping(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """READY=1 before any kubelet; STATUS follows registration; STOPPING at the stop."""
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel, notify=notify.path) as running:
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert ready["STATUS"] == "ate.dev/kvm: 4096/4096 healthy, waiting for kubelet"
                kubelet = await started_kubelet(plugin_dir)
                try:
                    await notify.wait_for(lambda f: f.get("STATUS") == "ate.dev/kvm: 4096/4096 healthy, registered")
                    assert await running.stop() == 0
                    await notify.wait_for(lambda f: f.get("STOPPING") == "1")
                finally:
                    await kubelet.stop()
        finally:
            await notify.close()


class TestInstance:
    async def test_second_daemon_on_the_directory(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """A second daemon for the same directory exits 73 and leaves the first one's registration alone."""
        kubelet = await started_kubelet(plugin_dir)
        try:
            config = kvm_config(plugin_dir, fake_root)
            async with daemon_in_process(config, kernel):
                await kubelet.next_event("list")
                async with daemon_in_process(config, kernel) as second:
                    assert await second.stop() == os.EX_CANTCREAT
                assert registrations(kubelet) == 1
                await kubelet.allocate(RESOURCE, ["kvm-0"])
        finally:
            await kubelet.stop()


def cdi_spec(path: Path) -> dict[str, Any]:
    node: dict[str, Any] = json.loads(path.read_text())["devices"][0]["containerEdits"]["deviceNodes"][0]
    return node


class TestCdi:
    async def test_spec_in_place_before_register(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """With cdi = true the spec exists when kubelet gets Register, and Allocate names its device."""
        spec = plugin_dir.parent / "cdi" / "ate.dev-kvm.json"
        kubelet = await started_kubelet(plugin_dir)
        seen_at_register: list[bool] = []
        kubelet.on_register = lambda: seen_at_register.append(spec.exists())
        try:
            async with daemon_in_process(kvm_config(plugin_dir, fake_root, cdi=True), kernel):
                await kubelet.next_event("list")
                assert seen_at_register == [True]
                assert cdi_spec(spec) == {
                    "path": "/dev/kvm",
                    "type": "c",
                    "major": 10,
                    "minor": 232,
                    "permissions": "rw",
                    "fileMode": 0o666,
                }
                (cresp,) = (await kubelet.allocate(RESOURCE, ["kvm-0"])).container_responses
                assert [c.name for c in cresp.cdi_devices] == ["ate.dev/kvm=kvm"]
                assert [d.host_path for d in cresp.devices] == ["/dev/kvm"]
        finally:
            await kubelet.stop()

    async def test_spec_follows_reload_and_numbers(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """A reload that changes the container mode, and a node that comes back with other numbers, rewrite
        the spec; the registration stays; a reload that drops the resource removes its spec."""
        spec = plugin_dir.parent / "cdi" / "ate.dev-kvm.json"
        current = [kvm_config(plugin_dir, fake_root, cdi=True)]
        monitor = FakeMonitor()
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(
                current[0], kernel, monitor=monitor, reload_config=lambda: current[0]
            ) as running:
                await kubelet.next_event("list")
                current[0] = kvm_config(plugin_dir, fake_root, cdi=True, container_mode=0o660, container_gid=107)
                running.daemon.request_reload()
                await running.events.wait_for("reload")
                assert (cdi_spec(spec)["fileMode"], cdi_spec(spec)["gid"]) == (0o660, 107)
                node = fake_root / "dev" / "kvm"
                kernel.add_node(node, (10, 99))
                kernel.names[(10, 99)] = "/dev/kvm"
                monitor.emit()
                await running.events.wait_for("cdi-spec")
                assert cdi_spec(spec)["minor"] == 99
                assert registrations(kubelet) == 1
                current[0] = dataclasses.replace(current[0], devices=(DeviceConfig("ate.dev/other", "/dev/kvm"),))
                running.daemon.request_reload()
                await running.events.wait_for("reload")
                assert not spec.exists()
        finally:
            await kubelet.stop()
            monitor.close()

    async def test_unwritable_spec_directory(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A spec directory that cannot be made: one warning, and the resource registers and is granted
        as without CDI (DeviceSpec only)."""
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("")
        config = dataclasses.replace(kvm_config(plugin_dir, fake_root, cdi=True), cdi_dir=str(blocker / "cdi"))
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await kubelet.next_event("list")
                (cresp,) = (await kubelet.allocate(RESOURCE, ["kvm-0"])).container_responses
                assert not cresp.cdi_devices and [d.host_path for d in cresp.devices] == ["/dev/kvm"]
                (warning,) = running.events.named("cdi-failed")
                assert warning.levelno == logging.WARNING
        finally:
            await kubelet.stop()

    async def test_read_only_spec_directory(self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """The spec directory read-only (a read-only bind mount): registration and Allocate unaffected."""
        if os.geteuid() != 0:
            pytest.skip("a read-only bind mount needs root")
        cdi_dir = plugin_dir.parent / "cdi"
        cdi_dir.mkdir()
        kubelet = await started_kubelet(plugin_dir)
        try:
            with read_only_bind(cdi_dir):
                async with daemon_in_process(kvm_config(plugin_dir, fake_root, cdi=True), kernel) as running:
                    await kubelet.next_event("list")
                    (cresp,) = (await kubelet.allocate(RESOURCE, ["kvm-0"])).container_responses
                    assert not cresp.cdi_devices
                    assert "Read-only" in running.events.named("cdi-failed")[0].getMessage()
        finally:
            await kubelet.stop()


async def wait_for_record(events: EventRecorder, start: str, timeout: float = 10.0) -> None:
    """The next record whose message starts with ``start`` (a line that is no event)."""
    async with asyncio.timeout(timeout):
        while not (await events.queue.get()).getMessage().startswith(start):
            pass


class TestMetricsFile:
    async def test_metrics_off_is_said_once_per_cause(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """No textfile directory: "metrics off" once; reloads that meet the same cause do not say it again,
        one with another path (another cause) does."""
        config = kvm_config(plugin_dir, fake_root, metrics_file=tmp_path / "none" / "ate-devplugd.prom")
        config = dataclasses.replace(config, log_level="debug")  # the line that is not said again is debug
        current = [config]
        async with daemon_in_process(config, kernel, reload_config=lambda: current[0]) as running:
            await running.events.wait_for("metrics-off")
            for _ in range(3):
                assert await running.daemon.reload()
                await wait_for_record(running.events, "metrics still off")
            assert len(running.events.named("metrics-off")) == 1
            current[0] = dataclasses.replace(config, metrics_file=str(tmp_path / "other" / "ate-devplugd.prom"))
            assert await running.daemon.reload()
            record = await running.events.wait_for("metrics-off")
            assert "other" in record.getMessage()

    @pytest.mark.parametrize("fault", ["read-only", "full"])
    async def test_unwritable_metrics_directory(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel, fault: str
    ) -> None:
        """A metrics directory read-only (a read-only bind mount) or full (a 4 KiB tmpfs, filled): one
        warning, metrics off, registration and Allocate unaffected."""
        if os.geteuid() != 0:
            pytest.skip("mounts need root")
        textfiles = tmp_path / "textfile"
        textfiles.mkdir()
        with contextlib.ExitStack() as stack:
            stack.enter_context(read_only_bind(textfiles) if fault == "read-only" else full_tmpfs(textfiles))
            kubelet = await started_kubelet(plugin_dir)
            try:
                config = kvm_config(plugin_dir, fake_root, metrics_file=textfiles / "ate-devplugd.prom")
                async with daemon_in_process(config, kernel) as running:
                    await kubelet.next_event("list")
                    record = await running.events.wait_for("metrics-off")
                    assert record.levelno == logging.WARNING
                    for n in range(5):
                        await kubelet.allocate(RESOURCE, [f"kvm-{n}"])
                    await kubelet.restart()
                    await kubelet.next_event("register")
                    assert len(running.events.named("metrics-off")) == 1
            finally:
                await kubelet.stop()
