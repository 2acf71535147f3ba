"""The DevicePlugin service, its server and Register, over real gRPC on real unix sockets."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from ate_devplugd import plugin
from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.config import DeviceConfig, max_request_bytes
from ate_devplugd.devices import Presence, Resource
from tests.fakes.kubelet import FakeKubelet
from tests.support import subprocess_env

PRESENT = Presence(True, True, "character device 10:232")
GONE = Presence(False, False, "/dev/kvm does not exist")


def kvm_resource(count: int = 8, permissions: str = "rw") -> Resource:
    res = Resource(DeviceConfig("ate.dev/kvm", "/dev/kvm", count=count, permissions=permissions))
    res.update(PRESENT)
    return res


@asynccontextmanager
async def served(
    tmp_path: Path, resource: Resource
) -> AsyncIterator[tuple[plugin.PluginServer, api_pb2_grpc.DevicePluginStub]]:
    server = plugin.PluginServer(resource, str(tmp_path / resource.config.socket_name))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(plugin.unix_target(server.socket_path)) as channel:
            yield server, api_pb2_grpc.DevicePluginStub(channel)
    finally:
        await server.stop()


def alloc(*id_lists: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in id_lists]
    )


class TestDevicePluginService:
    async def test_options_advertise_nothing_optional(self, tmp_path: Path) -> None:
        """GetDevicePluginOptions returns a real message with both options off."""
        async with served(tmp_path, kvm_resource()) as (_, stub):
            opts = await stub.GetDevicePluginOptions(api_pb2.Empty())
        assert (opts.pre_start_required, opts.get_preferred_allocation_available) == (False, False)

    async def test_list_and_watch_sends_all_then_changes(self, tmp_path: Path) -> None:
        """The full list at once, then again on each health change; IDs never change."""
        res = kvm_resource(count=4)
        async with served(tmp_path, res) as (_, stub):
            call = stub.ListAndWatch(api_pb2.Empty())
            first = await call.read()
            assert [(d.ID, d.health) for d in first.devices] == [(f"kvm-{i}", "Healthy") for i in range(4)]
            res.update(GONE)
            second = await call.read()
            assert [d.health for d in second.devices] == ["Unhealthy"] * 4
            assert [d.ID for d in second.devices] == [d.ID for d in first.devices]
            res.update(PRESENT)
            third = await call.read()
            assert [d.health for d in third.devices] == ["Healthy"] * 4
            call.cancel()

    async def test_list_and_watch_ignores_non_changes(self, tmp_path: Path) -> None:
        """A re-probe with the same health sends nothing."""
        res = kvm_resource(count=2)
        async with served(tmp_path, res) as (_, stub):
            call = stub.ListAndWatch(api_pb2.Empty())
            await call.read()
            res.update(Presence(True, True, "same health, other words"))
            res.update(GONE)
            msg = await call.read()
            assert msg.devices[0].health == "Unhealthy"
            call.cancel()

    async def test_cancelled_stream_is_released(self, tmp_path: Path) -> None:
        """When kubelet cancels ListAndWatch the handler ends (no stream left behind)."""
        res = kvm_resource()
        async with served(tmp_path, res) as (server, stub):
            call = stub.ListAndWatch(api_pb2.Empty())
            await call.read()
            assert server.servicer.streams == 1
            call.cancel()
            async with asyncio.timeout(5):
                while server.servicer.streams:
                    res.update(GONE if res.healthy else PRESENT)
                    await asyncio.sleep(0)

    async def test_stop_ends_streams(self, tmp_path: Path) -> None:
        """Stopping the server ends every ListAndWatch stream and removes the socket."""
        res = kvm_resource()
        server = plugin.PluginServer(res, str(tmp_path / "p.sock"))
        await server.start()
        async with grpc.aio.insecure_channel(plugin.unix_target(server.socket_path)) as channel:
            call = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
            await call.read()
            await server.stop()
            try:
                ended = await call.read()
            except grpc.aio.AioRpcError:
                ended = grpc.aio.EOF
            assert ended is grpc.aio.EOF
        assert not (tmp_path / "p.sock").exists()
        await server.stop()  # twice is fine

    async def test_allocate_grants_the_node(self, tmp_path: Path) -> None:
        """One response per container, each the configured node with the configured permissions."""
        async with served(tmp_path, kvm_resource(permissions="rw")) as (_, stub):
            resp = await stub.Allocate(alloc(["kvm-0"], ["kvm-1", "kvm-7"]))
        assert len(resp.container_responses) == 2
        for cresp in resp.container_responses:
            assert [(d.container_path, d.host_path, d.permissions) for d in cresp.devices] == [
                ("/dev/kvm", "/dev/kvm", "rw")
            ]
            assert not cresp.mounts and not cresp.envs and not cresp.cdi_devices

    @pytest.mark.parametrize(
        ("ids", "code", "fragment"),
        [
            ([["kvm-8"]], grpc.StatusCode.INVALID_ARGUMENT, "'kvm-8'"),
            ([["kvm-01"]], grpc.StatusCode.INVALID_ARGUMENT, "'kvm-01'"),
            ([["tun-0"]], grpc.StatusCode.INVALID_ARGUMENT, "'tun-0'"),
            ([["kvm-" + "9" * 5000]], grpc.StatusCode.INVALID_ARGUMENT, "unknown device ID"),
            ([], grpc.StatusCode.INVALID_ARGUMENT, "no container requests"),
            ([[]], grpc.StatusCode.INVALID_ARGUMENT, "names no device"),
        ],
    )
    async def test_allocate_rejects_bad_requests(
        self, tmp_path: Path, ids: list[list[str]], code: grpc.StatusCode, fragment: str
    ) -> None:
        """Unknown IDs and empty requests get a clear status that names the problem."""
        async with served(tmp_path, kvm_resource()) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(alloc(*ids))
            assert info.value.code() == code
            assert fragment in (info.value.details() or "")
            # and the server still answers
            await stub.Allocate(alloc(["kvm-0"]))

    async def test_allocate_refuses_unhealthy(self, tmp_path: Path) -> None:
        """A unit of a vanished device is not granted; the status says why."""
        res = kvm_resource()
        async with served(tmp_path, res) as (_, stub):
            res.update(GONE)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(alloc(["kvm-0"]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "kvm-0" in (info.value.details() or "") and "does not exist" in (info.value.details() or "")

    async def test_preferred_allocation_and_prestart(self, tmp_path: Path) -> None:
        """Not advertised, but valid answers: required IDs first, then available ones, up to size."""
        async with served(tmp_path, kvm_resource()) as (_, stub):
            req = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["kvm-1", "kvm-2", "kvm-3"],
                        must_include_deviceIDs=["kvm-2"],
                        allocation_size=2,
                    )
                ]
            )
            resp = await stub.GetPreferredAllocation(req)
            assert list(resp.container_responses[0].deviceIDs) == ["kvm-2", "kvm-1"]
            pre = await stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["kvm-0"]))
            assert pre == api_pb2.PreStartContainerResponse()


class TestRequestLimit:
    """The server takes the largest request kubelet can send, and refuses far larger ones up front."""

    async def test_kubelets_largest_request_is_answered(self, tmp_path: Path) -> None:
        res = kvm_resource(count=65536)
        ids = [f"kvm-{i}" for i in range(65536)]
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=ids, must_include_deviceIDs=ids, allocation_size=65536
                )
            ]
        )
        assert request.ByteSize() < max_request_bytes(res.config)
        async with served(tmp_path, res) as (_, stub):
            response = await stub.GetPreferredAllocation(request)
            assert list(response.container_responses[0].deviceIDs) == ids
            allocated = await stub.Allocate(alloc(ids))
        assert len(allocated.container_responses) == 1

    async def test_oversized_request_is_resource_exhausted(self, tmp_path: Path) -> None:
        res = kvm_resource()
        async with served(tmp_path, res) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(alloc(["kvm-" + "9" * max_request_bytes(res.config)]))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await stub.Allocate(alloc(["kvm-1"]))).container_responses


class TestSocketPath:
    def test_stale_socket_is_removed(self, tmp_path: Path) -> None:
        """A socket nobody listens on is left over from a dead process: removed."""
        path = tmp_path / "s.sock"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
        plugin.check_socket_free(str(path))
        assert not path.exists()

    def test_regular_file_is_removed(self, tmp_path: Path) -> None:
        """A plain file in our socket's place is not ours to keep."""
        path = tmp_path / "s.sock"
        path.write_text("x")
        plugin.check_socket_free(str(path))
        assert not path.exists()

    def test_live_socket_is_refused(self, tmp_path: Path) -> None:
        """A socket that answers belongs to a running process: never stolen."""
        path = tmp_path / "s.sock"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.listen()
        try:
            with pytest.raises(plugin.SocketInUseError, match="another process"):
                plugin.check_socket_free(str(path))
            assert path.exists()
        finally:
            sock.close()

    async def test_socket_identity(self, tmp_path: Path) -> None:
        """socket_is_ours turns false when the file is removed or replaced."""
        server = plugin.PluginServer(kvm_resource(), str(tmp_path / "p.sock"))
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
        server = plugin.PluginServer(res, str(tmp_path / "ate.dev-kvm.sock"))
        await server.start()
        try:
            await plugin.register(str(kubelet.socket_path), "ate.dev-kvm.sock", "ate.dev/kvm", 5)
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
                await plugin.register(str(kubelet.socket_path), "x.sock", "kvm", 5)
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
            await plugin.register(str(tmp_path / "kubelet.sock"), "x.sock", "a.io/b", 10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert loop.time() - start < 5


class TestSocketWipedWhileStarting:
    @staticmethod
    async def assert_gone_at_once(tmp_path: Path) -> None:
        """start() raises SocketGoneError well before the self-check's timeout."""
        server = plugin.PluginServer(kvm_resource(), str(tmp_path / "p.sock"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(plugin.SocketGoneError):
            await server.start()
        await server.stop()
        assert loop.time() - start < plugin.SELF_DIAL_TIMEOUT

    async def test_wipe_during_start_is_reported_at_once(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """kubelet wiping our socket between bind and the self-check: SocketGoneError at once, not a
        reconnect wait that ends in a serve failure."""
        real_publish = plugin._publish

        def publish_then_wipe(staging: str, path: str) -> None:
            real_publish(staging, path)
            os.unlink(path)  # what kubelet's start does to every socket in the directory

        monkeypatch.setattr(plugin, "_publish", publish_then_wipe)
        await self.assert_gone_at_once(tmp_path)

    async def test_wipe_before_self_check_is_reported_at_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The same when the socket goes just before the self-check's RPC (it fails fast, no wait)."""
        real_dial = plugin.PluginServer._dial_self

        async def wipe_then_dial(self: plugin.PluginServer) -> None:
            os.unlink(self.socket_path)
            await real_dial(self)

        monkeypatch.setattr(plugin.PluginServer, "_dial_self", wipe_then_dial)
        await self.assert_gone_at_once(tmp_path)


#: Run in a fresh interpreter: in the test process, another test's channel may still hold the runtime.
RUNTIME_CHECK = """
import asyncio, sys, threading
import grpc
from ate_devplugd import plugin

def others():
    return {t.ident for t in threading.enumerate() if t is not threading.main_thread()}

async def channel_comes_and_goes():
    async with grpc.aio.insecure_channel("unix:" + sys.argv[2]):
        pass

async def main():
    if sys.argv[1] == "without-hook":
        del plugin._CYGRPC.init_grpc_aio
    await channel_comes_and_goes()
    assert not others(), "the runtime outlived its last channel"
    async with plugin.grpc_runtime():
        held = others()
        assert held, "grpc.aio's poller thread did not start"
        for _ in range(3):
            await channel_comes_and_goes()
            assert others() == held, "the runtime was shut down and started anew"
    assert not others(), "the runtime was not released"

asyncio.run(main())
"""


class TestGrpcRuntimeHeld:
    """grpc.aio's runtime stays up while the daemon runs, however often channels come and go."""

    @pytest.mark.parametrize("how", ["by-reference", "without-hook"])
    def test_runtime_outlives_channels(self, tmp_path: Path, how: str) -> None:
        result = subprocess.run(
            [sys.executable, "-c", RUNTIME_CHECK, how, str(tmp_path / "none.sock")],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr


class TestGrpcTeardownReports:
    """grpcio failing to end a stream whose peer went first is one debug line; anything else is untouched."""

    async def test_final_status_to_a_gone_peer_is_not_an_error(self, caplog: pytest.LogCaptureFixture) -> None:
        loop = asyncio.get_running_loop()
        caplog.set_level(logging.DEBUG)
        async with plugin.grpc_runtime():
            caplog.clear()  # grpc's own debug lines about its runtime
            batch_error = plugin._CYGRPC.ExecuteBatchError
            loop.call_exception_handler(
                {"message": "Task exception was never retrieved", "exception": batch_error("send status")}
            )
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            caplog.clear()
            loop.call_exception_handler({"message": "Task exception was never retrieved", "exception": OSError(5)})
            assert [r.levelno for r in caplog.records] == [logging.ERROR]
        assert loop.get_exception_handler() is None
