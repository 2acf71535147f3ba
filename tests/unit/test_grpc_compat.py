"""grpcio's private API, held in grpc_compat: the runtime kept for the daemon's life, teardown races quiet."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from ate_devplugd.base import grpc_compat
from ate_devplugd.deviceplugin import endpoint
from tests.support import EventRecorder, kvm_resource, subprocess_env

#: Run in a fresh interpreter: in the test process, another test's channel may still hold the runtime.
RUNTIME_CHECK = """
import asyncio, sys, threading
import grpc
from grpc._cython import cygrpc
from ate_devplugd.base import grpc_compat

def others():
    return {t.ident for t in threading.enumerate() if t is not threading.main_thread()}

def after_exit():
    # A runtime shut down stops its threads, which may take a moment: wait for them to end (join).
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(timeout=10)
    return others()

async def channel_comes_and_goes():
    async with grpc.aio.insecure_channel("unix:" + sys.argv[2]):
        pass

async def main():
    if sys.argv[1] == "without-hook":
        del cygrpc.init_grpc_aio
    await channel_comes_and_goes()
    assert not after_exit(), "the runtime outlived its last channel"
    async with grpc_compat.grpc_runtime():
        held = others()
        assert held, "grpc.aio's poller thread did not start"
        for _ in range(3):
            await channel_comes_and_goes()
            assert others() == held, "the runtime was shut down and started anew"
    assert not after_exit(), "the runtime was not released"

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
        async with grpc_compat.grpc_runtime():
            caplog.clear()  # grpc's own debug lines about its runtime
            batch_error = grpc_compat.EXECUTE_BATCH_ERROR
            assert isinstance(batch_error, type)
            loop.call_exception_handler(
                {"message": "Task exception was never retrieved", "exception": batch_error("send status")}
            )
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            caplog.clear()
            loop.call_exception_handler({"message": "Task exception was never retrieved", "exception": OSError(5)})
            assert [r.levelno for r in caplog.records] == [logging.ERROR]
        assert loop.get_exception_handler() is None


class TestGrpcTeardownLog:
    """grpcio's own logger reporting a send cut off by a departing peer: one debug line, no traceback."""

    def test_batch_report_becomes_one_debug_line(self, caplog: pytest.LogCaptureFixture) -> None:
        async def run() -> None:
            async with grpc_compat.grpc_runtime():
                cygrpc_log = logging.getLogger(grpc_compat.CYGRPC_LOGGER)
                try:
                    raise RuntimeError("stand-in for ExecuteBatchError")  # noqa: TRY301 - to log with exc_info
                except RuntimeError:
                    # as grpcio's aio server reports it (aio/server.pyx.pxi, _handle_exceptions)
                    cygrpc_log.exception(
                        "ExecuteBatchError raised in core by servicer method [/v1beta1.DevicePlugin/ListAndWatch]"
                    )
                cygrpc_log.error("something else")

        caplog.set_level(logging.DEBUG)
        asyncio.run(run())
        ours = [r for r in caplog.records if r.name == "ate_devplugd.base.grpc_compat" or r.levelno >= logging.WARNING]
        assert [(r.name, r.levelno, r.exc_info is None) for r in ours] == [
            ("ate_devplugd.base.grpc_compat", logging.DEBUG, True),
            ("grpc._cython.cygrpc", logging.ERROR, True),
        ]
        assert "/v1beta1.DevicePlugin/ListAndWatch" in ours[0].getMessage()


#: kubelet's side of the race: a ListAndWatch client that never reads (so the server's 83 KB message
#: waits on HTTP/2 flow control) and is then killed while that message is in flight.
STALLED_CLIENT = """
import sys, time, grpc
from ate_devplugd._pb import api_pb2, api_pb2_grpc
options = [("grpc.http2.lookahead_bytes", 0), ("grpc.http2.bdp_probe", 0)]
channel = grpc.insecure_channel("unix://" + sys.argv[1], options=options)
stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
time.sleep(3600)
"""


class TestTeardownRaceForReal:
    """The race itself, as kubelet makes it when it dies with a message in flight."""

    async def test_kubelet_killed_mid_message_leaves_no_traceback(self, tmp_path: Path) -> None:
        """Killed with a ListAndWatch message in flight: grpcio's ExecuteBatchError (reported on its logger
        by grpcio 1.85, as an unretrieved task exception by 1.51) is one debug line, nothing louder."""
        recorder = EventRecorder()
        root = logging.getLogger()
        level = root.level
        root.addHandler(recorder)
        root.setLevel(logging.DEBUG)
        resource = kvm_resource(count=4096)
        opened = asyncio.Event()
        try:
            async with grpc_compat.grpc_runtime():
                server = endpoint.PluginServer(resource, str(tmp_path / "p.sock"), lambda n: n and opened.set())
                await server.start()
                try:
                    for _ in range(3):
                        opened.clear()
                        client = await asyncio.create_subprocess_exec(
                            sys.executable, "-c", STALLED_CLIENT, server.socket_path, env=subprocess_env()
                        )
                        async with asyncio.timeout(30):
                            await opened.wait()
                        client.kill()
                        await client.wait()
                        async with asyncio.timeout(30):
                            while not [r for r in recorder.records if grpc_compat.TEARDOWN_RACE in r.getMessage()]:
                                await recorder.queue.get()
                        loud = [r for r in recorder.records if r.levelno >= logging.WARNING]
                        assert not loud, [r.getMessage() for r in loud]
                        recorder.records.clear()
                finally:
                    await server.stop()
        finally:
            root.removeHandler(recorder)
            root.setLevel(level)
