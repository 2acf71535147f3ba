"""The daemon as systemd sees it: sd_notify datagrams, the watchdog, reload on SIGHUP, idle wake-ups."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.fakes.kubelet import FakeKubelet
from tests.support import NotifyReceiver, daemon, subprocess_env, wait_for_content, wait_for_path, write_config

VHOST = '[[device]]\nresource = "ate.dev/tun"\npath = "/dev/net/tun"\ncount = {count}\n'
KVM = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {count}\n'
UNIT = Path(__file__).resolve().parents[2] / "packaging" / "ate-devplugd.service"


def null_node(root: Path) -> None:
    """A real /dev/null node (1:3) under root: a third device the kernel names."""
    os.mknod(root / "dev" / "null", 0o600 | 0o020000, os.makedev(1, 3))


def tun_node(root: Path) -> None:
    """A real /dev/net/tun node (10:200) under root, for a second resource."""
    if not Path("/sys/class/misc/tun/dev").exists():
        pytest.skip("the kernel has no tun misc device")
    major, minor = (int(x) for x in Path("/sys/class/misc/tun/dev").read_text().split(":"))
    (root / "dev" / "net").mkdir(exist_ok=True)
    os.mknod(root / "dev" / "net" / "tun", 0o600 | 0o020000, os.makedev(major, minor))


class TestNotify:
    async def test_ready_before_kubelet_then_status(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """READY=1 comes before any kubelet exists; STATUS then follows registration; STOPPING on SIGTERM."""
        notify = NotifyReceiver(tmp_path / "notify")
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert ready["STATUS"] == "ate.dev/kvm: 4096/4096 healthy, waiting for kubelet", proc.log()
                kubelet = FakeKubelet(plugin_dir)
                await kubelet.start()
                try:
                    status = await notify.wait_for(lambda f: f.get("STATUS", "").endswith("registered"))
                    assert status["STATUS"] == "ate.dev/kvm: 4096/4096 healthy, registered"
                    await proc.signal(signal.SIGTERM)
                    stopping = await notify.wait_for(lambda f: "STOPPING" in f)
                    assert stopping["STOPPING"] == "1"
                    assert await proc.wait() == 0
                finally:
                    await kubelet.stop()
        finally:
            await notify.close()

    async def test_status_when_kubelet_stops_watching(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """If kubelet closes ListAndWatch while alive, STATUS stops claiming a working registration."""
        notify = NotifyReceiver(tmp_path / "notify")
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))):
                await kubelet.next_event("list")
                task = kubelet.endpoints["ate.dev/kvm"].stream_task
                assert task is not None
                task.cancel()
                status = await notify.wait_for(lambda f: "closed its ListAndWatch" in f.get("STATUS", ""))
                assert status["STATUS"].startswith("ate.dev/kvm: 4096/4096 healthy, registered, but kubelet")
                await kubelet.restart()
                await notify.wait_for(lambda f: f.get("STATUS", "").endswith("healthy, registered"))
        finally:
            await notify.close()
            await kubelet.stop()

    async def test_status_tells_unhealthy_and_absent(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """STATUS names an absent device and an unhealthy one, with the reason."""
        notify = NotifyReceiver(tmp_path / "notify")
        devices = KVM.format(count=4) + '[[device]]\nresource = "ate.dev/vhost-vsock"\npath = "/dev/vhost-vsock"\n'
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root, devices)
        try:
            async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))):
                ready = await notify.wait_for(lambda f: "READY" in f)
                kvm, vsock = ready["STATUS"].split(" | ")
                assert kvm == "ate.dev/kvm: 4/4 healthy, waiting for kubelet"
                assert vsock.startswith("ate.dev/vhost-vsock: absent (") and "does not exist" in vsock
                (dev_root / "dev" / "kvm").unlink()
                Path("/sys/class/misc/kvm/uevent").write_text("change")
                status = await notify.wait_for(lambda f: "ate.dev/kvm: 0/4" in f.get("STATUS", ""))
                assert "does not exist" in status["STATUS"]
        finally:
            await notify.close()

    async def test_watchdog_pings(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """WATCHDOG=1 at half of WATCHDOG_USEC, from the event loop."""
        notify = NotifyReceiver(tmp_path / "notify")
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        env = subprocess_env(NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="200000")
        try:
            async with daemon(cfg, env=env):
                await notify.wait_for(lambda f: "READY" in f)
                loop = asyncio.get_running_loop()
                times = []
                for _ in range(11):
                    await notify.wait_for(lambda f: "WATCHDOG" in f)
                    times.append(loop.time())
                # ten intervals of 0.1 s (half the 0.2 s deadline): about 1 s in all; a busy loop
                # would take almost nothing, and the span does not hang on one late reading
                span = times[-1] - times[0]
                assert 0.7 < span < 1.5, span
        finally:
            await notify.close()

    async def test_watchdog_for_another_pid_is_ignored(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """WATCHDOG_PID naming another process: no pings."""
        notify = NotifyReceiver(tmp_path / "notify")
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        env = subprocess_env(NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="100000", WATCHDOG_PID="1")
        try:
            async with daemon(cfg, env=env) as proc:
                await notify.wait_for(lambda f: "READY" in f)
                await proc.signal(signal.SIGTERM)
                rest = await notify.wait_for(lambda f: "STOPPING" in f)
                assert rest
                assert not [m for m in notify.history if "WATCHDOG" in m]
        finally:
            await notify.close()


class TestReload:
    async def test_add_remove_change_keep(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """One SIGHUP: the added resource registers, the changed one sends its new list on its open stream
        (no new registration), the removed one goes, the kept one is not touched."""
        tun_node(dev_root)
        null_node(dev_root)
        extra = '[[device]]\nresource = "ate.dev/null"\npath = "/dev/null"\ncount = 2\nsubsystem = "mem"\n'
        before = KVM.format(count=8) + VHOST.format(count=8)
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        notify = NotifyReceiver(tmp_path / "notify")
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root, before)
        try:
            async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
                await notify.wait_for(lambda f: f.get("STATUS", "").count("registered") == 2, timeout=15)
                first = {(await kubelet.next_event("list")).resource for _ in range(2)}
                assert first == {"ate.dev/kvm", "ate.dev/tun"}
                kvm_stream = kubelet.endpoints["ate.dev/kvm"].stream_task
                tun_stream = kubelet.endpoints["ate.dev/tun"].stream_task
                kubelet.drain()
                # keep kvm, change tun (count), add null ... then remove it again below
                write_config(cfg, plugin_dir, dev_root, KVM.format(count=8) + VHOST.format(count=4) + extra)
                await proc.signal(signal.SIGHUP)
                try:
                    reloading = await notify.wait_for(lambda f: "RELOADING" in f)
                except TimeoutError:
                    raise AssertionError(proc.log()) from None
                assert reloading["MONOTONIC_USEC"].isdigit()
                await notify.wait_for(lambda f: "READY" in f)
                regs = {}
                async with asyncio.timeout(10):
                    while len(regs) < 2:
                        ev = await kubelet.next_event("list")
                        regs[ev.resource] = ev
                assert set(regs) == {"ate.dev/tun", "ate.dev/null"}, proc.log()
                assert regs["ate.dev/tun"].total == 4 and regs["ate.dev/null"].total == 2
                assert kubelet.endpoints["ate.dev/kvm"].stream_task is kvm_stream and not kvm_stream.done()
                assert kubelet.endpoints["ate.dev/tun"].stream_task is tun_stream and not tun_stream.done()
                assert (plugin_dir / "ate.dev-null.sock").exists()

                write_config(cfg, plugin_dir, dev_root, KVM.format(count=8) + VHOST.format(count=4))
                await proc.signal(signal.SIGHUP)
                await notify.wait_for(lambda f: "READY" in f)
                ended = await kubelet.next_event("stream-ended")
                assert ended.resource == "ate.dev/null"
                assert not (plugin_dir / "ate.dev-null.sock").exists()
                assert not kvm_stream.done()
                registered = [e.resource for e in kubelet.history if e.kind == "register"]
                assert registered.count("ate.dev/kvm") == registered.count("ate.dev/tun") == 1, registered
                assert not [e for e in kubelet.history if e.kind == "stream-ended" and e.resource != "ate.dev/null"]
        finally:
            await notify.close()
            await kubelet.stop()

    async def test_bad_config_keeps_the_old(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """A broken config on SIGHUP is logged field by field; nothing changes but STATUS, which ends with
        the first error."""
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        notify = NotifyReceiver(tmp_path / "notify")
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
                await kubelet.next_event("list")
                cfg.write_text(cfg.read_text() + "count = 0\nbogus = 1\n")
                await proc.signal(signal.SIGHUP)
                await notify.wait_for(lambda f: "RELOADING" in f)
                ready = await notify.wait_for(lambda f: "READY" in f)
                kept, refused = ready["STATUS"].split(" | reload refused ")
                assert kept == "ate.dev/kvm: 4096/4096 healthy, registered"
                assert re.fullmatch(r"\d\d:\d\d:\d\d: device\[0\] \(ate.dev/kvm\): unknown key 'bogus'", refused), ready
                log = proc.log()
                assert "count: 0" in log and "unknown key 'bogus'" in log and "keeping the running config" in log
                assert len([e for e in kubelet.history if e.kind == "register"]) == 1
                await kubelet.allocate("ate.dev/kvm", ["kvm-4095"])
        finally:
            await notify.close()
            await kubelet.stop()


class TestIdle:
    async def test_no_wakeups_when_idle(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """Registered (kubelet's word taken) and idle, the event loop has no timer: over a 3-second strace of
        the main thread it makes no system call, and any epoll_wait it does make (a uevent from elsewhere on
        the machine can wake it) waits without a timeout. Metrics are on: once the file shows the
        registration, nothing more is written and no write is pending."""
        if shutil.which("strace") is None:
            pytest.skip("strace is not installed")
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        metrics = tmp_path / "metrics" / "ate-devplugd.prom"
        metrics.parent.mkdir()
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root, metrics_file=metrics)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                await wait_for_path(plugin_dir / "ate.dev-kvm.sock")
                await wait_for_content(metrics, 'ate_devplugd_listandwatch_streams{resource="ate.dev/kvm"} 1\n')
                await kubelet.next_event("pod-resources")  # the daemon has asked kubelet what it offers
                mtime = metrics.stat().st_mtime_ns
                out = await asyncio.to_thread(
                    subprocess.run,
                    ["timeout", "-s", "INT", "3", "strace", "-e", "trace=epoll_wait", "-p", str(proc.pid)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if "Operation not permitted" in out.stderr:
                    pytest.skip("ptrace is not permitted here")
                # Lines look like "epoll_wait(3, [...], 3, -1) = 1": the last argument is the timeout.
                timeouts = re.findall(r"^epoll_wait\(\d+, .*, (-?\d+)\)", out.stderr, re.MULTILINE)
                assert all(t == "-1" for t in timeouts), out.stderr
                assert metrics.stat().st_mtime_ns == mtime, "an idle daemon rewrote its metrics file"
        finally:
            await kubelet.stop()


SRC = Path(__file__).resolve().parents[2] / "src" / "ate_devplugd"
THREAD_APIS = ("threading", "to_thread", "run_in_executor", "MonitorObserver", "concurrent.futures", "_thread")


class TestThreads:
    def test_source_starts_no_thread(self) -> None:
        """Our code never starts a thread: no threading API is used anywhere in the package."""
        for path in SRC.rglob("*.py"):
            if "_pb" in path.parts:
                continue
            text = path.read_text()
            assert not [api for api in THREAD_APIS if api in text], path

    async def test_thread_count_is_steady(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """The only threads are gRPC's own, and their number does not grow with restarts and calls."""
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        try:
            async with daemon(cfg) as proc:
                await kubelet.next_event("list")
                tasks = Path(f"/proc/{proc.pid}/task")
                before = sorted((t / "comm").read_text().strip() for t in tasks.iterdir())
                for _ in range(5):
                    await kubelet.restart()
                    await kubelet.next_event("list")
                    for _ in range(10):
                        await kubelet.allocate("ate.dev/kvm", ["kvm-1"])
                after = sorted((t / "comm").read_text().strip() for t in tasks.iterdir())
                # gRPC's event-engine pool starts a worker when work is queued while none is idle, and
                # retires it once idle: with Debian 13's grpcio it holds one worker more at times (never
                # two, over 100 restarts), with Debian 12's it has not. Any other new thread is growth.
                pool = "event_engine"
                assert [n for n in after if n != pool] == [n for n in before if n != pool], (before, after)
                assert after.count(pool) <= before.count(pool) + 1, (before, after)
        finally:
            await kubelet.stop()


class TestUnitFile:
    def test_reload_waits_for_the_daemons_verdict(self) -> None:
        """ExecReload runs `ate-devplugd reload` with the daemon's pid: it signals the daemon and waits for
        its verdict, so every refusal fails the reload job (its line logged as the daemon's). The daemon
        keeps nothing on disk for the commands (its record lives on its lock): no runtime directory."""
        directives: dict[str, list[str]] = {}
        for line in UNIT.read_text().splitlines():
            if re.match(r"[A-Za-z]+=", line):
                key, value = line.split("=", 1)
                directives.setdefault(key, []).append(value)
        assert directives["ExecReload"] == ["/usr/bin/ate-devplugd reload --pid $MAINPID"]
        assert directives["SyslogIdentifier"] == ["ate-devplugd"]
        assert "RuntimeDirectory" not in directives
