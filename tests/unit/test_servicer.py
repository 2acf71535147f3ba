"""The DevicePlugin service over real gRPC on a real unix socket: lists, streams, Allocate, request limits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.base.unixsock import unix_target
from ate_devplugd.config.device import max_request_bytes
from ate_devplugd.deviceplugin import endpoint
from ate_devplugd.node.devices import Presence, Withheld, Withholding
from tests.support import GONE, PRESENT, alloc, kvm_resource, served


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

    async def test_withheld_path_is_unhealthy_whatever_the_device(self, tmp_path: Path) -> None:
        """DRA mode's withheld path: every unit Unhealthy with the device present (allocatable 0), no
        PreStartContainer asked (kubelet 1.36's check passes), Allocate refused."""
        res = kvm_resource(count=4)
        async with served(tmp_path, res, withheld=True) as (_, stub):
            opts = await stub.GetDevicePluginOptions(api_pb2.Empty())
            assert not opts.pre_start_required
            call = stub.ListAndWatch(api_pb2.Empty())
            assert [d.health for d in (await call.read()).devices] == ["Unhealthy"] * 4
            call.cancel()
            assert res.usable
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Allocate(alloc(["kvm-0"]))
            assert exc.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "device-plugin path withheld (DRA mode)" in str(exc.value.details())

    async def test_each_list_sent_to_kubelet_is_told(self, tmp_path: Path) -> None:
        """``on_sent`` hears the Healthy units of each list as it goes out on kubelet's streams (what kubelet's
        word is then judged against), not on our own tools' streams; the withheld path sends none Healthy."""
        res = kvm_resource(count=4)
        for withheld, healthy in ((False, 4), (True, 0)):
            sent: list[int] = []
            server = endpoint.PluginServer(
                res, str(tmp_path / res.config.socket_name), withheld=withheld, on_sent=sent.append
            )
            await server.start()
            try:
                async with grpc.aio.insecure_channel(unix_target(server.socket_path)) as channel:
                    stub = api_pb2_grpc.DevicePluginStub(channel)
                    tool = stub.ListAndWatch(api_pb2.Empty(), metadata=(("x-ate-devplugd-tool", "probe"),))
                    await tool.read()
                    call = stub.ListAndWatch(api_pb2.Empty())
                    await call.read()
                    if not withheld:  # the withheld path's list never changes
                        res.update(GONE)
                        await call.read()
                        res.update(PRESENT)
                        await call.read()
                    call.cancel()
                    tool.cancel()
            finally:
                await server.stop()
            assert sent == ([healthy, 0, healthy] if not withheld else [0]), (withheld, sent)

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
        server = endpoint.PluginServer(res, str(tmp_path / "p.sock"))
        await server.start()
        async with grpc.aio.insecure_channel(unix_target(server.socket_path)) as channel:
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

    async def test_allocate_without_cdi_is_unchanged_on_the_wire(self, tmp_path: Path) -> None:
        """With CDI off (the default) the response is byte for byte the DeviceSpec-only one."""
        async with (
            served(tmp_path, kvm_resource()) as (server, _),
            grpc.aio.insecure_channel(unix_target(server.socket_path)) as channel,
        ):
            allocate = channel.unary_unary(
                "/v1beta1.DevicePlugin/Allocate", request_serializer=api_pb2.AllocateRequest.SerializeToString
            )
            raw = await allocate(alloc(["kvm-0"]))
        expected = api_pb2.AllocateResponse(
            container_responses=[
                api_pb2.ContainerAllocateResponse(
                    devices=[api_pb2.DeviceSpec(container_path="/dev/kvm", host_path="/dev/kvm", permissions="rw")]
                )
            ]
        )
        assert raw == expected.SerializeToString()
        assert raw == b"\n\x1a\x1a\x18\n\x08/dev/kvm\x12\x08/dev/kvm\x1a\x02rw"  # as before CDI existed

    async def test_allocate_with_cdi_names_the_device_beside_the_spec(self, tmp_path: Path) -> None:
        """With the spec in place Allocate sends the DeviceSpec and the CDI name together."""
        resource = kvm_resource()
        resource.cdi_device = "ate.dev/kvm=kvm"
        async with served(tmp_path, resource) as (_, stub):
            (cresp,) = (await stub.Allocate(alloc(["kvm-0"]))).container_responses
        assert [d.host_path for d in cresp.devices] == ["/dev/kvm"]
        assert [c.name for c in cresp.cdi_devices] == ["ate.dev/kvm=kvm"]

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

    async def test_a_withheld_device_is_unhealthy_to_kubelet_and_not_granted(self, tmp_path: Path) -> None:
        """Present and healthy but withheld: every unit Unhealthy on the open stream, Allocate refused with
        the reason; offered again, every unit Healthy; the IDs never change."""
        res = kvm_resource(count=3)
        async with served(tmp_path, res) as (_, stub):
            call = stub.ListAndWatch(api_pb2.Empty())
            first = await call.read()
            res.withhold(Withholding(Withheld.CDI_NOT_APPLIED, "containerd 1.7.24 has enable_cdi = false"))
            second = await call.read()
            assert [d.health for d in second.devices] == ["Unhealthy"] * 3
            assert [d.ID for d in second.devices] == [d.ID for d in first.devices]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(alloc(["kvm-0"]))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "withheld: cdi-not-applied" in (info.value.details() or "")
            res.withhold(None)
            third = await call.read()
            assert [d.health for d in third.devices] == ["Healthy"] * 3
            await stub.Allocate(alloc(["kvm-0"]))
            call.cancel()

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
