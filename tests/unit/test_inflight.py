"""A stop answers the calls in flight before the streams end: kubelet closes the connection at a stream's end,
and a call it still waited for on it would fail (``Canceled``), a pod lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from ate_devplugd._pb import api_pb2
from ate_devplugd.base.inflight import InFlight
from tests.support import kvm_resource, served


async def test_idle_waits_for_every_call_and_is_bounded() -> None:
    calls = InFlight()
    assert await calls.idle(0.0)
    with calls.call(), calls.call():
        assert not await calls.idle(0.05)
    assert await calls.idle(0.0)


async def test_the_stream_ends_only_once_the_call_in_flight_is_answered(tmp_path: Path) -> None:
    """An Allocate in flight when the server stops (held here by its count): the ListAndWatch stream stays
    open until it is answered, then ends; no new call is taken meanwhile."""
    order: list[str] = []
    async with served(tmp_path, kvm_resource()) as (server, stub):
        stream = stub.ListAndWatch(api_pb2.Empty())
        await stream.read()

        async def watch() -> None:
            try:
                while await stream.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError:
                pass
            order.append("stream ended")

        watching = asyncio.get_running_loop().create_task(watch())
        in_flight = server.servicer.in_flight.call()
        in_flight.__enter__()
        stopping = asyncio.get_running_loop().create_task(server.stop(grace=5.0))
        done, _ = await asyncio.wait({watching}, timeout=0.3)  # the stream must stay open: nothing may end it
        assert not done, order
        order.append("answered")
        in_flight.__exit__(None, None, None)
        async with asyncio.timeout(10):
            await watching
            await stopping
    assert order == ["answered", "stream ended"]
