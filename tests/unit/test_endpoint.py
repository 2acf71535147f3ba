"""A plugin endpoint: its socket file, its server's start and stop, and Register, over real gRPC."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import grpc
import pytest

from ate_devplugd.base import unixserver
from ate_devplugd.base.unixserver import SocketGoneError
from ate_devplugd.deviceplugin import endpoint
from tests.fakes.kubelet import FakeKubelet
from tests.support import kvm_resource


class TestSocketPath:
    async def test_socket_identity(self, tmp_path: Path) -> None:
        """socket_is_ours turns false when the file is removed or replaced."""
        server = endpoint.PluginServer(kvm_resource(), str(tmp_path / "p.sock"))
        await server.start()
        try:
            assert server.socket_is_ours()
            os.unlink(server.socket_path)
            assert not server.socket_is_ours()
            Path(server.socket_path).write_text("")
            assert not server.socket_is_ours()
        finally:
            await server.stop()
        assert Path(server.socket_path).exists(), "someone else's file is left alone"


class TestRegister:
    async def test_register_is_answered_while_kubelet_calls_back(self, tmp_path: Path) -> None:
        """Register awaited on the serving loop completes although kubelet dials back first."""
        kubelet = FakeKubelet(tmp_path)
        await kubelet.start()
        res = kvm_resource()
        server = endpoint.PluginServer(res, str(tmp_path / "ate.dev-kvm.sock"))
        await server.start()
        try:
            await endpoint.register(str(kubelet.socket_path), "ate.dev-kvm.sock", "ate.dev/kvm", 5)
            reg = await kubelet.next_event("register")
            assert (reg.resource, reg.endpoint) == ("ate.dev/kvm", "ate.dev-kvm.sock")
            lst = await kubelet.next_event("list")
            assert (lst.healthy, lst.total) == (8, 8)
        finally:
            await server.stop()
            await kubelet.stop()

    async def test_register_rejected(self, tmp_path: Path) -> None:
        """kubelet's refusal reaches the caller as an RPC error."""
        kubelet = FakeKubelet(tmp_path)
        await kubelet.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await endpoint.register(str(kubelet.socket_path), "x.sock", "kvm", 5)
            assert "invalid" in (info.value.details() or "")
        finally:
            await kubelet.stop()

    async def test_register_without_kubelet_fails_fast(self, tmp_path: Path) -> None:
        """A kubelet.sock nobody listens on fails at once (UNAVAILABLE), not at the deadline."""
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(tmp_path / "kubelet.sock"))
        sock.close()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await endpoint.register(str(tmp_path / "kubelet.sock"), "x.sock", "a.io/b", 10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert loop.time() - start < 5


class TestSocketWipedWhileStarting:
    @staticmethod
    async def assert_gone_at_once(tmp_path: Path) -> None:
        """start() raises SocketGoneError well before the self-check's timeout."""
        server = endpoint.PluginServer(kvm_resource(), str(tmp_path / "p.sock"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(SocketGoneError):
            await server.start()
        await server.stop()
        assert loop.time() - start < endpoint.SELF_DIAL_TIMEOUT

    async def test_wipe_during_start_is_reported_at_once(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """kubelet wiping our socket between bind and the self-check: SocketGoneError at once, not a
        reconnect wait that ends in a serve failure."""
        real_publish = unixserver._publish

        def publish_then_wipe(staging: str, path: str) -> None:
            real_publish(staging, path)
            os.unlink(path)  # what kubelet's start does to every socket in the directory

        monkeypatch.setattr(unixserver, "_publish", publish_then_wipe)
        await self.assert_gone_at_once(tmp_path)

    async def test_wipe_before_self_check_is_reported_at_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The same when the socket goes just before the self-check's RPC (it fails fast, no wait)."""
        real_dial = endpoint.PluginServer._dial_self

        async def wipe_then_dial(self: endpoint.PluginServer) -> None:
            os.unlink(self.socket_path)
            await real_dial(self)

        monkeypatch.setattr(endpoint.PluginServer, "_dial_self", wipe_then_dial)
        await self.assert_gone_at_once(tmp_path)
