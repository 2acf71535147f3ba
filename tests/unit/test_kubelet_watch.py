"""KubeletWatch on a real directory with real inotify: which kubelet.sock is there, the subscribers, and
why a socket went."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from ate_devplugd.base.inotify import DirEvent
from ate_devplugd.kubelet.watch import HELD, KubeletWatch, SocketLoss


def dead_socket(path: Path) -> None:
    """A socket file nobody listens on (what a killed kubelet leaves)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()


def live_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.listen()
    return sock


class Heard:
    """A subscriber's calls, counted; ``wait(n)`` waits for the n-th (inotify is read on the loop)."""

    def __init__(self) -> None:
        self.calls = 0
        self._called = asyncio.Event()

    def __call__(self) -> None:
        self.calls += 1
        self._called.set()

    async def wait(self, count: int) -> None:
        async with asyncio.timeout(5):
            while self.calls < count:
                self._called.clear()
                await self._called.wait()


class TestKubelet:
    async def test_identity_follows_the_file(self, plugin_dir: Path) -> None:
        """kubelet() is the kubelet.sock file there now: None, one file, then another at the same path."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        try:
            assert watch.kubelet() is None
            dead_socket(plugin_dir / "kubelet.sock")
            first = watch.kubelet()
            assert first is not None and watch.kubelet() == first
            (plugin_dir / "kubelet.sock").unlink()
            assert watch.kubelet() is None
            dead_socket(plugin_dir / "kubelet.sock")
            second = watch.kubelet()
            assert second is not None and second != first
        finally:
            watch.close()

    async def test_a_new_file_never_takes_a_held_inode(self, plugin_dir: Path) -> None:
        """kubelet.sock removed and made again at once, many times (a filesystem such as ext4 hands the
        freed inode number to the next file, and two files of one clock tick share a ctime): each new one
        is a new identity, since the watch holds the inode of the one it saw; the held files stay bounded."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        fds_before = len(os.listdir("/proc/self/fd"))
        try:
            seen = watch.kubelet()
            for _ in range(200):
                dead_socket(plugin_dir / "kubelet.sock")
                now = watch.kubelet()
                assert now is not None and now != seen and (seen is None or now.ino != seen.ino)
                seen = now
                (plugin_dir / "kubelet.sock").unlink()
            assert len(os.listdir("/proc/self/fd")) <= fds_before + HELD
        finally:
            watch.close()
        assert len(os.listdir("/proc/self/fd")) <= fds_before

    async def test_subscribers_hear_their_socket_and_kubelet(self, plugin_dir: Path) -> None:
        """A subscriber is called for its own socket name and for kubelet.sock, not for others' files."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        heard_a, heard_b = Heard(), Heard()
        undo = watch.subscribe("a.sock", heard_a)
        watch.subscribe("b.sock", heard_b)
        try:
            (plugin_dir / "a.sock").write_text("")
            await heard_a.wait(1)
            (plugin_dir / "kubelet_internal_checkpoint").write_text("{}")
            dead_socket(plugin_dir / "kubelet.sock")
            await heard_b.wait(1)
            await heard_a.wait(2)
            assert (heard_a.calls, heard_b.calls) == (2, 1), "the checkpoint file woke no one"
            undo()
            (plugin_dir / "a.sock").unlink()
            (plugin_dir / "kubelet.sock").unlink()
            await heard_b.wait(2)
            assert heard_a.calls == 2
        finally:
            watch.close()


class TestChanges:
    async def test_what_may_change_what_kubelet_offers(self, plugin_dir: Path) -> None:
        """``on_changes`` hears another plugin's socket come and go, kubelet's checkpoint written and a new
        kubelet.sock; not our own socket, dot-named staging or temp files, nor kubelet.sock going."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        watch.subscribe("ours.sock", lambda: None)
        seen: list[tuple[str, str]] = []
        heard = Heard()

        def changed(events: list[DirEvent]) -> None:
            seen.extend((ev.kind, ev.name) for ev in events)
            heard()

        undo = watch.on_changes(changed)
        try:
            dead_socket(plugin_dir / ".ours.sock")  # our staging name, then linked into place
            os.link(plugin_dir / ".ours.sock", plugin_dir / "ours.sock")
            (plugin_dir / ".ours.sock").unlink()
            (plugin_dir / ".kubelet_internal_checkpoint.tmp").write_text("{}")  # kubelet's temp, renamed
            os.replace(plugin_dir / ".kubelet_internal_checkpoint.tmp", plugin_dir / "kubelet_internal_checkpoint")
            await heard.wait(1)
            dead_socket(plugin_dir / "gpu.sock")
            (plugin_dir / "gpu.sock").unlink()
            dead_socket(plugin_dir / "kubelet.sock")
            (plugin_dir / "kubelet.sock").unlink()
            (plugin_dir / "ours.sock").unlink()
            await heard.wait(2)
            while ("created", "kubelet.sock") not in seen:
                await heard.wait(heard.calls + 1)
            assert seen == [
                ("created", "kubelet_internal_checkpoint"),
                ("created", "gpu.sock"),
                ("removed", "gpu.sock"),
                ("created", "kubelet.sock"),
            ], seen
            undo()
            dead_socket(plugin_dir / "other.sock")
            dead_socket(plugin_dir / "kubelet.sock")  # also wakes subscribers: a sure sign the batch was read
            calls = heard.calls
            woken = Heard()
            watch.subscribe("x.sock", woken)
            (plugin_dir / "kubelet.sock").unlink()
            await woken.wait(1)
            assert heard.calls == calls
        finally:
            watch.close()


class TestSocketLoss:
    async def test_kubelet_gone_is_a_restart(self, plugin_dir: Path) -> None:
        """kubelet.sock absent, or present but answering no one (its kubelet was killed): a kubelet restart."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        try:
            assert watch.socket_loss(watch.kubelet()) is SocketLoss.KUBELET_RESTART
            dead_socket(plugin_dir / "kubelet.sock")
            assert watch.socket_loss(watch.kubelet()) is SocketLoss.KUBELET_RESTART
        finally:
            watch.close()

    async def test_kubelet_alive_is_someone_else(self, plugin_dir: Path) -> None:
        """The kubelet registered with still answers: the socket was removed by someone else."""
        listener = live_socket(plugin_dir / "kubelet.sock")
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        try:
            assert watch.socket_loss(watch.kubelet()) is SocketLoss.FOREIGN
        finally:
            watch.close()
            listener.close()

    async def test_new_kubelet_is_a_restart(self, plugin_dir: Path) -> None:
        """A kubelet.sock other than the known one: a restart, even though it answers."""
        dead_socket(plugin_dir / "kubelet.sock")
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        known = watch.kubelet()
        (plugin_dir / "kubelet.sock").unlink()
        listener = live_socket(plugin_dir / "kubelet.sock")
        try:
            assert watch.socket_loss(known) is SocketLoss.KUBELET_RESTART
        finally:
            watch.close()
            listener.close()
