"""KubeletPresence on a real directory: real inotify, a real process listening on kubelet.sock, its pidfd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ate_devplugd.config.dra import DraConfig
from ate_devplugd.config.pools import DraResource
from ate_devplugd.dra.driver import DraDriver, KubeletLink
from ate_devplugd.dra.presence import KubeletPresence, Presence, listener_pid
from ate_devplugd.kubelet.watch import KubeletWatch
from tests.fakes.dra_kubelet import LISTENER


@contextlib.asynccontextmanager
async def kubelet(path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A process listening on ``path``, as kubelet on kubelet.sock; terminated (socket left behind) at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LISTENER, str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            assert await proc.stdout.readline() == b"listening\n"
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


class Hints:
    def __init__(self) -> None:
        self.count = 0
        self._event = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self._event.set()

    async def wait(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            await self._event.wait()
        self._event.clear()


class TestListenerPid:
    async def test_pid_of_the_listening_process(self, tmp_path: Path) -> None:
        async with kubelet(tmp_path / "kubelet.sock") as proc:
            assert listener_pid(str(tmp_path / "kubelet.sock")) == proc.pid

    def test_none_without_a_listener(self, tmp_path: Path) -> None:
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(tmp_path / "kubelet.sock"))
        dead.close()
        assert listener_pid(str(tmp_path / "kubelet.sock")) is None
        assert listener_pid(str(tmp_path / "absent.sock")) is None


class TestPresence:
    async def test_process_exit_is_a_hint_and_then_gone(self, plugin_dir: Path) -> None:
        """The registering kubelet's process ends (its kubelet.sock left behind): one hint, then GONE."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        hints = Hints()
        presence = KubeletPresence(watch, hints)
        presence.start()
        try:
            async with kubelet(plugin_dir / "kubelet.sock") as proc:
                presence.registered()
                assert presence.kubelet_pid == proc.pid
                assert presence.holds() is Presence.HOLDS
                proc.terminate()
                await proc.wait()
                await hints.wait()
                assert presence.holds() is Presence.GONE
                assert presence.kubelet_pid is None
                assert (plugin_dir / "kubelet.sock").exists()
        finally:
            presence.close()
            watch.close()

    async def test_new_kubelet_sock_is_restarted(self, plugin_dir: Path) -> None:
        """A kubelet.sock created after the registration (a new kubelet) is RESTARTED, once it answers."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        hints = Hints()
        presence = KubeletPresence(watch, hints)
        presence.start()
        try:
            async with kubelet(plugin_dir / "kubelet.sock") as old:
                presence.registered()
            await hints.wait()  # the old one's process ended
            os.unlink(plugin_dir / "kubelet.sock")  # the new kubelet's start removes it, then listens anew
            async with kubelet(plugin_dir / "kubelet.sock") as new:
                assert new.pid != old.pid
                await hints.wait()
                assert presence.holds() is Presence.RESTARTED
                presence.registered()
                assert presence.holds() is Presence.HOLDS
                assert presence.kubelet_pid == new.pid
        finally:
            presence.close()
            watch.close()


class Follower:
    """A KubeletFollower whose answer the test sets."""

    def __init__(self) -> None:
        self.seen = Presence.HOLDS
        self.registrations = 0

    def start(self) -> None:
        pass

    def registered(self) -> None:
        self.registrations += 1

    def holds(self) -> Presence:
        return self.seen

    def close(self) -> None:
        pass


class TestDriverState:
    """DraDriver's kubelet state from the follower's answers (no sockets: the state machine alone)."""

    def driver(self, follower: Follower) -> DraDriver:
        config = DraConfig(node_name="node-1", kubelet_dir="/nonexistent/kubelet")
        return DraDriver(config, [DraResource("ate.dev/kvm", "ate.dev/kvm=kvm")], kubelet=follower)

    def test_hints_before_any_registration_change_nothing(self) -> None:
        follower = Follower()
        driver = self.driver(follower)
        driver.kubelet = KubeletLink.WAITING
        follower.seen = Presence.GONE
        driver.kubelet_changed()
        assert driver.kubelet is KubeletLink.WAITING

    @pytest.mark.parametrize(
        ("seen", "state"),
        [
            (Presence.HOLDS, KubeletLink.REGISTERED),
            (Presence.GONE, KubeletLink.GONE),
            (Presence.RESTARTED, KubeletLink.WAITING),
        ],
    )
    def test_after_registration(self, seen: Presence, state: KubeletLink) -> None:
        follower = Follower()
        driver = self.driver(follower)
        driver.kubelet = KubeletLink.WAITING
        driver._registration_status(True, "")  # what kubelet's NotifyRegistrationStatus calls
        assert (driver.kubelet, follower.registrations) == (KubeletLink.REGISTERED, 1)
        follower.seen = seen
        driver.kubelet_changed()
        assert driver.kubelet is state
        driver._registration_status(True, "")  # the next kubelet registers the driver
        assert driver.kubelet is KubeletLink.REGISTERED
