"""The unix-socket server of both modes: what is at its path before, while and after it serves (real gRPC)."""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from ate_devplugd.base import unixserver
from ate_devplugd.base.unixserver import SocketGoneError, SocketInUseError, UnixServer, check_socket_free
from ate_devplugd.base.unixsock import FileIdentity, socket_answers, staging_path, unix_target


def echo_service(server: grpc.aio.Server) -> None:
    """One method, ``/t.T/Echo``, that answers its request's bytes."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))


async def echo(path: str) -> bytes:
    async with grpc.aio.insecure_channel(unix_target(path)) as channel:
        answer: bytes = await channel.unary_unary("/t.T/Echo")(b"hello", timeout=5)
        return answer


def then(first: Callable[[grpc.aio.Server], None], step: Callable[[], object]) -> Callable[[grpc.aio.Server], None]:
    """``first``, then ``step``: something that happens after the server checked its path and before
    it puts its socket there (services are added in between)."""

    def add(server: grpc.aio.Server) -> None:
        first(server)
        step()

    return add


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Another process's unix socket, bound where a test says and listening once it is."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        yield sock
    finally:
        sock.close()


def listen_at(sock: socket.socket, path: Path) -> None:
    sock.bind(str(path))
    sock.listen()


class TestCheckSocketFree:
    def test_stale_socket_is_removed(self, tmp_path: Path) -> None:
        """A socket nobody listens on is left over from a dead process: removed."""
        path = tmp_path / "s.sock"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
        check_socket_free(str(path))
        assert not path.exists()

    def test_regular_file_is_removed(self, tmp_path: Path) -> None:
        """A plain file in our socket's place is not ours to keep."""
        path = tmp_path / "s.sock"
        path.write_text("x")
        check_socket_free(str(path))
        assert not path.exists()

    def test_live_socket_is_refused(self, tmp_path: Path, listener: socket.socket) -> None:
        """A socket that answers belongs to a running process: never stolen."""
        path = tmp_path / "s.sock"
        listen_at(listener, path)
        with pytest.raises(SocketInUseError, match="another process"):
            check_socket_free(str(path))
        assert path.exists()

    def test_listener_with_a_full_queue_is_refused_at_once(self, tmp_path: Path, listener: socket.socket) -> None:
        """A listener that accepts nothing (its queue full) is in use too: said at once, not after a wait
        on the loop for a connection it would never take."""
        path = tmp_path / "s.sock"
        listener.bind(str(path))
        listener.listen(0)
        queued = []
        while True:  # fill its queue: the next connect says EAGAIN
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            queued.append(peer)
            try:
                peer.connect(str(path))
            except BlockingIOError:
                break
        try:
            with pytest.raises(SocketInUseError, match="another process"):
                check_socket_free(str(path))
        finally:
            for peer in queued:
                peer.close()

    def test_directory_is_refused(self, tmp_path: Path) -> None:
        (tmp_path / "s.sock").mkdir()
        with pytest.raises(SocketInUseError, match="is a directory"):
            check_socket_free(str(tmp_path / "s.sock"))


class TestUnixServer:
    async def test_serves_at_the_path_then_removes_it(self, tmp_path: Path) -> None:
        """Served 0600 at the path, nothing left at the staging name; stop removes the socket."""
        path = tmp_path / "e.sock"
        server = UnixServer(str(path), echo_service)
        await server.start()
        try:
            assert await echo(str(path)) == b"hello"
            assert stat.S_IMODE(path.lstat().st_mode) == 0o600
            assert not os.path.lexists(staging_path(str(path)))
            assert server.is_ours()
        finally:
            await server.stop()
        assert not path.exists() and not server.is_ours()
        await server.stop()  # twice is fine

    async def test_live_socket_at_start_is_kept(self, tmp_path: Path, listener: socket.socket) -> None:
        path = tmp_path / "e.sock"
        listen_at(listener, path)
        identity = FileIdentity.of(str(path))
        server = UnixServer(str(path), echo_service)
        with pytest.raises(SocketInUseError, match="another process"):
            await server.start()
        await server.stop()
        assert FileIdentity.of(str(path)) == identity and socket_answers(str(path))

    async def test_live_socket_bound_while_starting_is_kept(self, tmp_path: Path, listener: socket.socket) -> None:
        """Another process binding the path after the start's check and before our socket is put there keeps
        its socket: the link fails, start says so, and its file is the one at the path afterwards."""
        path = tmp_path / "e.sock"
        server = UnixServer(str(path), then(echo_service, lambda: listen_at(listener, path)))
        with pytest.raises(SocketInUseError, match="another process"):
            await server.start()
        identity = FileIdentity.of(str(path))
        await server.stop()
        assert FileIdentity.of(str(path)) == identity and socket_answers(str(path))
        assert not os.path.lexists(staging_path(str(path)))

    async def test_stale_file_made_while_starting_is_replaced(self, tmp_path: Path) -> None:
        path = tmp_path / "e.sock"
        server = UnixServer(str(path), then(echo_service, lambda: path.write_text("stale")))
        await server.start()
        try:
            assert await echo(str(path)) == b"hello"
        finally:
            await server.stop()

    async def test_a_leftover_staging_name_is_no_obstacle(self, tmp_path: Path) -> None:
        """A plain file at the staging name (a crash left it; gRPC removes only a socket there) is ours."""
        path = tmp_path / "e.sock"
        Path(staging_path(str(path))).write_text("")
        server = UnixServer(str(path), echo_service)
        await server.start()
        try:
            assert await echo(str(path)) == b"hello"
        finally:
            await server.stop()

    async def test_removed_while_starting(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Our socket removed just after it was put in place (kubelet wiping its directory): SocketGoneError,
        an OSError, so whoever cannot serve says so."""
        real_publish = unixserver._publish

        def publish_then_wipe(staging: str, path: str) -> None:
            real_publish(staging, path)
            os.unlink(path)

        monkeypatch.setattr(unixserver, "_publish", publish_then_wipe)
        server = UnixServer(str(tmp_path / "e.sock"), echo_service)
        with pytest.raises(SocketGoneError) as info:
            await server.start()
        await server.stop()
        assert isinstance(info.value, OSError) and str(info.value).endswith("was removed while it was being served")

    async def test_stop_leaves_a_file_that_is_not_ours(self, tmp_path: Path) -> None:
        path = tmp_path / "e.sock"
        server = UnixServer(str(path), echo_service)
        await server.start()
        path.unlink()
        path.write_text("someone else's")
        assert not server.is_ours()
        await server.stop()
        assert path.read_text() == "someone else's"

    async def test_longest_path_is_served(self) -> None:
        """A path whose staging name has sun_path's 107 bytes is served (a unix:// target takes only 105)."""
        base = tempfile.mkdtemp(prefix="us-", dir="/tmp")
        try:
            path = os.path.join(base, "s" * (106 - len(base) - 1))
            assert len(staging_path(path)) == 107
            server = UnixServer(path, echo_service)
            await server.start()
            try:
                assert await echo(path) == b"hello"
            finally:
                await server.stop()
        finally:
            os.rmdir(base)

    async def test_too_long_path_names_itself(self, tmp_path: Path) -> None:
        path = str(tmp_path / ("s" * 120))
        server = UnixServer(path, echo_service)
        with pytest.raises(OSError, match=re.escape(f"cannot listen on {path}: File name too long")) as info:
            await server.start()
        await server.stop()
        assert info.value.errno == errno.ENAMETOOLONG
