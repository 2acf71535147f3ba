"""The whole daemon as a subprocess against the fake kubelet, on a temp directory.

``dev_root`` is a temp directory holding a real ``mknod``'ed kvm node; re-probes are triggered by real
kernel uevents (``change`` written to /sys/class/misc/kvm/uevent).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.fault.harness import LOADED_WAIT, load, settled
from tests.support import (
    DaemonProcess,
    KernelUevents,
    NotifyReceiver,
    assert_vms_made_no_hint,
    daemon,
    kvm_uevent,
    make_kvm_node,
    run_cli,
    started_kubelet,
    subprocess_env,
    vm_storm,
    vm_storm_then_removal,
    wait_for_path,
    write_config,
)


class TestStartAndRegister:
    async def test_first_capacity(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """Registered with v1beta1, a base-name endpoint and 4096 Healthy units; Allocate grants rw."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                reg = await kubelet.next_event("register", "register-rejected")
                assert reg.kind == "register", proc.log()
                assert (reg.resource, reg.endpoint) == ("ate.dev/kvm", "ate.dev-kvm.sock")
                lst = await kubelet.next_event("list")
                assert (lst.healthy, lst.total) == (4096, 4096)
                assert lst.ids == [f"kvm-{i}" for i in range(4096)]
                resp = await kubelet.allocate("ate.dev/kvm", ["kvm-17"])
                (cresp,) = resp.container_responses
                assert [(d.host_path, d.container_path, d.permissions) for d in cresp.devices] == [
                    ("/dev/kvm", "/dev/kvm", "rw")
                ]
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await kubelet.allocate("ate.dev/kvm", ["kvm-4096"])
                assert "kvm-4096" in (info.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError):
                    await kubelet.allocate("ate.dev/kvm")
                assert await proc.stop() == 0
            assert not (plugin_dir / "ate.dev-kvm.sock").exists()
            assert not [e for e in kubelet.history if e.kind == "double-register"]
        finally:
            await kubelet.stop()

    async def test_ids_stable_across_daemon_restart(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """A restarted daemon advertises exactly the same IDs."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg):
                first = await kubelet.next_event("list")
            async with daemon(cfg):
                await kubelet.next_event("register")
                second = await kubelet.next_event("list")
            assert first.ids == second.ids and second.healthy == 4096
        finally:
            await kubelet.stop()

    async def test_kubelet_absent_at_start(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """With no kubelet the daemon serves and waits; it registers once kubelet.sock appears."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        async with daemon(cfg) as proc:
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
            kubelet = await started_kubelet(plugin_dir)
            try:
                reg = await kubelet.next_event("register")
                assert reg.resource == "ate.dev/kvm", proc.log()
                await kubelet.next_event("list")
                assert len([e for e in kubelet.history if e.kind == "register"]) == 1
            finally:
                await kubelet.stop()

    async def test_kubelet_wipes_while_we_start_serving(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """kubelet starting (and wiping the directory) the moment our socket appears is a restart to
        follow at once, not a failure to serve."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        async with daemon(cfg) as proc:
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
            kubelet = await started_kubelet(plugin_dir)
            try:
                await kubelet.next_event("register")
                await kubelet.next_event("list")
            finally:
                await kubelet.stop()
            assert "cannot serve" not in proc.log() and "serve-failed" not in proc.log(), proc.log()

    async def test_plugin_dir_created(self, tmp_path: Path, dev_root: Path) -> None:
        """A missing plugin directory is created 0750 and served."""
        plugin_dir = tmp_path / "var" / "device-plugins"
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        async with daemon(cfg) as proc:
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
            assert (plugin_dir.stat().st_mode & 0o777) == 0o750, proc.log()


class TestKubeletRestart:
    @pytest.mark.budget(300)
    @pytest.mark.parametrize("machine", ["idle", "overcommit"])
    async def test_restart_reregisters(self, tmp_path: Path, plugin_dir: Path, dev_root: Path, machine: str) -> None:
        """kubelet restart (sockets wiped in a random order, new kubelet.sock) is followed by exactly one new
        registration, each logged as a kubelet restart, never as a foreign removal; the CPU idle or
        overcommitted."""
        kubelet = await started_kubelet(plugin_dir, seed=f"{tmp_path.name}/{machine}")
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            with load(machine):
                async with daemon(cfg) as proc:
                    await kubelet.next_event("list", timeout=LOADED_WAIT)
                    for _ in range(5):
                        await kubelet.restart()
                        reg = await kubelet.next_event("register", timeout=LOADED_WAIT)
                        assert reg.resource == "ate.dev/kvm", proc.log()
                        lst = await kubelet.next_event("list", timeout=LOADED_WAIT)
                        assert lst.healthy == 4096
                    await settled(kubelet)  # a second Register, had one followed, would come in here
                    regs = [e for e in kubelet.history if e.kind == "register"]
                    assert len(regs) == 6, proc.log()
                    assert not [e for e in kubelet.history if e.kind == "double-register"]
                    # kubelet killed and started: its old socket stays until its wipe, before or after ours
                    log = proc.log()
                    assert "event=socket-removed" not in log and log.count("event=kubelet-restart") >= 5, log
        finally:
            await kubelet.stop()

    async def test_socket_deleted_by_hand(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """Our socket removed by someone: served anew and registered again."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                os.unlink(plugin_dir / "ate.dev-kvm.sock")
                reg = await kubelet.next_event("register")
                assert reg.resource == "ate.dev/kvm", proc.log()
                await kubelet.next_event("list")
                assert (plugin_dir / "ate.dev-kvm.sock").exists()
        finally:
            await kubelet.stop()

    async def test_plugin_dir_removed_and_back(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """The whole directory removed and re-created (kubelet reinstalled): recovered when it returns."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                await kubelet.stop()
                # moved away atomically (the daemon may be re-serving into it meanwhile), then removed
                plugin_dir.rename(tmp_path / "gone")
                shutil.rmtree(tmp_path / "gone")
                plugin_dir.mkdir()
                await kubelet.start()
                reg = await kubelet.next_event("register")
                assert reg.resource == "ate.dev/kvm", proc.log()
        finally:
            await kubelet.stop()


class TestStop:
    async def test_sigterm(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """SIGTERM: exit 0 within 2 s with the socket removed; no empty device list is sent."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                await proc.signal(signal.SIGTERM)
                assert await proc.wait(timeout=2) == 0, proc.log()
            assert not (plugin_dir / "ate.dev-kvm.sock").exists()
            assert all(e.total == 4096 for e in kubelet.history if e.kind == "list")
        finally:
            await kubelet.stop()

    async def test_sigint(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """SIGINT (Ctrl-C in `make run`) stops the daemon like SIGTERM."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        async with daemon(cfg) as proc:
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
            await proc.signal(signal.SIGINT)
            assert await proc.wait(timeout=2) == 0, proc.log()

    async def test_second_instance_refused(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """A second daemon on the same directory exits non-zero, saying why; the first stays registered."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as first:
                await kubelet.next_event("list")
                second = await DaemonProcess(cfg).start()
                assert await second.wait() == 73
                assert "already running" in second.log()
                assert first.proc is not None and first.proc.returncode is None
                assert len([e for e in kubelet.history if e.kind == "register"]) == 1
                await kubelet.allocate("ate.dev/kvm", ["kvm-0"])
        finally:
            await kubelet.stop()

    async def test_live_socket_of_another_process_refused(
        self, tmp_path: Path, plugin_dir: Path, dev_root: Path
    ) -> None:
        """Someone else answering on our socket path (another netns, say): refuse to start, touch nothing."""
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(str(plugin_dir / "ate.dev-kvm.sock"))
        holder.listen()
        try:
            cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
            proc = await DaemonProcess(cfg).start()
            assert await proc.wait() == 73
            assert "another process is serving" in proc.log()
            assert (plugin_dir / "ate.dev-kvm.sock").exists()
        finally:
            holder.close()


class TestHotplug:
    async def test_device_appearing_later_is_registered(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """A device absent at start is not advertised; once it appears (and a uevent fires) it is."""
        os.unlink(dev_root / "dev" / "kvm")
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            env = subprocess_env(NOTIFY_SOCKET=str(notify.path))
            async with daemon(cfg, env=env) as proc:
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert "ate.dev/kvm: absent" in ready["STATUS"], proc.log()
                assert not [e for e in kubelet.history if e.kind == "register"]
                make_kvm_node(dev_root)
                kvm_uevent()
                reg = await kubelet.next_event("register")
                assert reg.resource == "ate.dev/kvm", proc.log()
                assert (await kubelet.next_event("list")).healthy == 4096
        finally:
            await notify.close()
            await kubelet.stop()

    async def test_vanish_and_return(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """The node removed: all units Unhealthy (same IDs); restored: Healthy again."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                first = await kubelet.next_event("list")
                os.unlink(dev_root / "dev" / "kvm")
                kvm_uevent()
                gone = await kubelet.next_event("list")
                assert (gone.healthy, gone.total, gone.ids) == (0, 4096, first.ids), proc.log()
                make_kvm_node(dev_root)
                kvm_uevent()
                back = await kubelet.next_event("list")
                assert back.healthy == 4096
        finally:
            await kubelet.stop()


class TestVmAnnouncements:
    """Real VMs (KVM_CREATE_VM on the host's kvm) make the kernel announce each start and end; the
    daemon is never woken for them, and a device change among them is seen at once."""

    async def test_never_reach_the_daemon(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """500 VMs started and stopped: the daemon (debug log) looks again only for the uevents that are
        not KVM's announcements, and none of these got past the kernel's filter to be left out later."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                log, other_kvm = await vm_storm_then_removal(kubelet, proc, dev_root, 500, kvm_uevent)
        finally:
            await kubelet.stop()
        assert_vms_made_no_hint(log, other_kvm)

    async def test_removal_during_a_storm_is_seen_at_once(
        self, tmp_path: Path, plugin_dir: Path, dev_root: Path
    ) -> None:
        """With VMs starting and stopping back to back, the node removed (and a uevent): kubelet hears
        Unhealthy as fast as without the storm; back, Healthy."""
        kubelet = await started_kubelet(plugin_dir)
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        seen = KernelUevents()
        node = dev_root / "dev" / "kvm"
        loop = asyncio.get_running_loop()
        try:
            async with daemon(cfg, "--log-level", "info") as proc:
                await kubelet.next_event("list")
                async with vm_storm(node):
                    await seen.wait_announcements(200)
                    delays = []
                    for _ in range(5):
                        os.unlink(node)
                        t0 = loop.time()
                        kvm_uevent()
                        assert (await kubelet.next_event("list", timeout=10)).healthy == 0, proc.log()
                        delays.append(loop.time() - t0)
                        make_kvm_node(dev_root)
                        kvm_uevent()
                        assert (await kubelet.next_event("list", timeout=10)).healthy == 4096
                    storm_announcements = seen.announcements
        finally:
            seen.close()
            await kubelet.stop()
        delays.sort()
        print(
            f"removal -> kubelet sees Unhealthy during a VM storm ({storm_announcements} announcements): "
            f"median {delays[2] * 1000:.1f} ms, max {delays[-1] * 1000:.1f} ms"
        )
        assert delays[-1] < 5.0


class TestBadConfig:
    @pytest.mark.parametrize(
        ("text", "fragment"),
        [
            ("colour = 1\n", "unknown key 'colour'"),
            ('[[device]]\nresource = "kvm"\npath = "/dev/kvm"\n', "resource: 'kvm'"),
            ('[[device]]\nresource = "a.io/k"\npath = "kvm"\n', "path: 'kvm'"),
            ('[[device]]\nresource = "a.io/k"\npath = "/etc/k"\n', "path: '/etc/k'"),
            ('[[device]]\nresource = "a.io/k"\npath = "/dev/k"\ncount = 0\n', "count: 0"),
            ('[[device]]\nresource = "a.io/k"\npath = "/dev/k"\ncount = 99999\n', "count: 99999"),
            ('[[device]]\nresource = "a.io/k"\npath = "/dev/k"\npermissions = "x"\n', "permissions: 'x'"),
            (
                '[[device]]\nresource = "a.io/k"\npath = "/dev/k"\n[[device]]\nresource = "a.io/k"\npath = "/dev/j"\n',
                "resource 'a.io/k' is already used",
            ),
        ],
    )
    def test_exit_78_naming_the_field(self, tmp_path: Path, plugin_dir: Path, text: str, fragment: str) -> None:
        """check-config and run both exit 78 with the field named, and run touches nothing."""
        cfg = tmp_path / "bad.toml"
        cfg.write_text(f'plugin_dir = "{plugin_dir}"\n' + text)
        for command in ("check-config", "run"):
            out = subprocess.run(
                [sys.executable, "-m", "ate_devplugd", command, "--config", str(cfg)],
                capture_output=True,
                text=True,
                env=subprocess_env(),
                timeout=30,
                check=False,
            )
            assert out.returncode == 78, out
            assert fragment in out.stderr, out.stderr
        assert list(plugin_dir.iterdir()) == []

    def test_check_config_prints_effective_config(self, tmp_path: Path) -> None:
        """check-config prints the effective config and exits 0."""
        cfg = tmp_path / "ok.toml"
        cfg.write_text('[[device]]\nresource = "ate.dev/vhost-net"\npath = "/dev/vhost-net"\npreopen = true\n')
        out = subprocess.run(
            [sys.executable, "-m", "ate_devplugd", "check-config", "--config", str(cfg)],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=30,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert 'resource = "ate.dev/vhost-net"' in out.stdout and "preopen = true" in out.stdout


class TestProbeCommand:
    async def test_probe_table(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """`ate-devplugd probe` shows each socket's units and the DeviceSpec it grants."""
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        async with daemon(cfg):
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
            status, out, err = await run_cli("probe", "--config", str(cfg))
        assert status == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["RESOURCE", "SOCKET", "HEALTHY/TOTAL", "CDI", "GRANTS"]
        assert lines[1].split() == [
            "ate.dev/kvm",
            "ate.dev-kvm.sock",
            "4096/4096",
            "-",
            "/dev/kvm",
            "->",
            "/dev/kvm",
            "(rw)",
        ]

    async def test_probe_shows_the_cdi_device(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """With cdi = true the table names the CDI device Allocate returns beside the DeviceSpec."""
        devices = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncdi = true\n'
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root, devices)
        async with daemon(cfg):
            await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
            status, out, err = await run_cli("probe", "--config", str(cfg))
        assert status == 0, err
        header, row = out.splitlines()
        assert row.split()[:4] == ["ate.dev/kvm", "ate.dev-kvm.sock", "4096/4096", "ate.dev/kvm=kvm"], out
        assert header.index("CDI") == row.index("ate.dev/kvm=kvm")

    def test_probe_dead_socket_fails(self, plugin_dir: Path) -> None:
        """A socket that does not answer makes probe exit non-zero."""
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(plugin_dir / "dead.sock"))
        dead.close()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "ate_devplugd",
                "probe",
                "--plugin-dir",
                str(plugin_dir),
                "--timeout",
                "2",
            ],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=30,
            check=False,
        )
        assert out.returncode == 1 and "ERROR" in out.stdout, out
