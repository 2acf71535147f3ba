"""KubeletWatch on a real directory with real inotify: the kubelet generation, its subscribers, and why a
socket went."""

from __future__ import annotations

import socket
from pathlib import Path

from ate_devplugd.kubelet_watch import KubeletWatch, SocketLoss


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


class TestGeneration:
    async def test_a_created_kubelet_sock_is_counted_once(self, plugin_dir: Path) -> None:
        """Each kubelet.sock created is one generation, counted by the drain in look() (stat, then drain)."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        try:
            assert watch.look().generation == 0 and not watch.look().present
            dead_socket(plugin_dir / "kubelet.sock")
            state = watch.look()
            assert state.present and state.generation == 1
            assert watch.look().generation == 1, "a second look sees no newer kubelet"
            (plugin_dir / "kubelet_internal_checkpoint").write_text("{}")
            (plugin_dir / "kubelet.sock").unlink()
            assert watch.look() == type(state)(present=False, generation=1)
        finally:
            watch.close()

    async def test_subscribers_hear_their_socket_and_kubelet(self, plugin_dir: Path) -> None:
        """A subscriber is called for its own socket name and for kubelet.sock, not for others' files."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        heard: list[str] = []
        undo = watch.subscribe("a.sock", lambda: heard.append("a"))
        watch.subscribe("b.sock", lambda: heard.append("b"))
        try:
            (plugin_dir / "a.sock").write_text("")
            watch.look()
            assert heard == ["a"]
            (plugin_dir / "kubelet_internal_checkpoint").write_text("{}")
            watch.look()
            assert heard == ["a"]
            dead_socket(plugin_dir / "kubelet.sock")
            watch.look()
            assert sorted(heard) == ["a", "a", "b"]
            undo()
            (plugin_dir / "a.sock").unlink()
            watch.look()
            assert sorted(heard) == ["a", "a", "b"]
        finally:
            watch.close()


class TestSocketLoss:
    async def test_kubelet_gone_is_a_restart(self, plugin_dir: Path) -> None:
        """kubelet.sock absent, or present but answering no one (its kubelet was killed): a kubelet restart."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        try:
            assert watch.socket_loss(watch.look().generation) is SocketLoss.KUBELET_RESTART
            dead_socket(plugin_dir / "kubelet.sock")
            assert watch.socket_loss(watch.look().generation) is SocketLoss.KUBELET_RESTART
        finally:
            watch.close()

    async def test_kubelet_alive_is_someone_else(self, plugin_dir: Path) -> None:
        """The kubelet registered with still answers: the socket was removed by someone else."""
        listener = live_socket(plugin_dir / "kubelet.sock")
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        try:
            assert watch.socket_loss(watch.look().generation) is SocketLoss.FOREIGN
        finally:
            watch.close()
            listener.close()

    async def test_new_kubelet_is_a_restart(self, plugin_dir: Path) -> None:
        """A kubelet.sock created since the known generation: a restart, even though it answers."""
        watch = KubeletWatch(str(plugin_dir))
        watch.start()
        known = watch.look().generation
        listener = live_socket(plugin_dir / "kubelet.sock")
        try:
            assert watch.socket_loss(known) is SocketLoss.KUBELET_RESTART
        finally:
            watch.close()
            listener.close()
