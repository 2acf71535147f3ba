"""A fake container runtime: CRI's RuntimeService answering Version and Status on a real unix socket.

It answers as containerd's and CRI-O's CRI servers do (docs/cdi-runtimes.md names the lines):
- ``Version`` gives the runtime's name and version, ``version`` "0.1.0" and ``runtime_api_version`` "v1";
- ``Status`` gives RuntimeReady and NetworkReady, and ``info`` only when ``verbose`` is set (containerd
  ``pkg/cri/server/status.go``: ``if r.Verbose``; CRI-O ``server/runtime_status.go``); ``info["config"]``
  is the runtime's config as JSON, here a recorded answer (``tests/data/cri/*.json``) or one built with
  the keys the runtime's code marshals;
- every other RPC is UNIMPLEMENTED (the generated servicer's default), as nothing here needs them.

``hang = True`` makes every call wait until the client gives up, as a stuck runtime would.

Run as a script (the package test) it serves containerd's answer for ``--version`` and ``--enable-cdi``
on ``--socket`` until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc

try:
    from ate_devplugd._pb.cri.v1 import api_pb2, api_pb2_grpc
except ImportError:  # run from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from ate_devplugd._pb.cri.v1 import api_pb2, api_pb2_grpc

DATA = Path(__file__).resolve().parents[1] / "data" / "cri"


def recorded(name: str) -> tuple[str, str, dict[str, str]]:
    """A recorded answer: (runtime name, runtime version, Status info) from ``tests/data/cri/<name>.json``."""
    data = json.loads((DATA / f"{name}.json").read_text())
    return data["runtime_name"], data["runtime_version"], data["info"]


def containerd_info(enable_cdi: bool | None, spec_dirs: list[str] | None = None, **extra: Any) -> dict[str, str]:
    """Status info as containerd marshals its CRI config: ``enableCDI`` and ``cdiSpecDirs`` at the top level
    of ``config`` (left out when ``enable_cdi`` is None and no dirs are given: containerd 1.6)."""
    config: dict[str, Any] = {"containerdRootDir": "/var/lib/containerd", **extra}
    if enable_cdi is not None or spec_dirs is not None:
        config["enableCDI"] = enable_cdi
        config["cdiSpecDirs"] = spec_dirs if spec_dirs is not None else ["/etc/cdi", "/var/run/cdi"]
    return {"config": json.dumps(config), "golang": '"go1.22"', "lastCNILoadStatus": "OK"}


class FakeRuntime(api_pb2_grpc.RuntimeServiceServicer):
    """One runtime on ``socket``; ``answer`` may be changed between calls (a runtime restarted with a new config)."""

    def __init__(self, socket: Path, name: str, version: str, info: dict[str, str]) -> None:
        self.socket = socket
        self.answer = (name, version, info)
        self.hang = False
        #: Calls answered as a starting containerd answers before its CRI service has initialized (its
        #: socket is served already): an error ("server is not initialized yet", code UNKNOWN).
        self.not_ready = 0
        self.calls: list[str] = []
        self._called = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._released = asyncio.Event()

    async def start(self) -> FakeRuntime:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_RuntimeServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        await self._server.start()
        return self

    async def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def wait_for_calls(self, name: str, count: int, timeout: float = 10.0) -> None:
        """Until ``name`` has been called ``count`` times."""
        async with asyncio.timeout(timeout):
            while self.calls.count(name) < count:
                self._called.clear()
                await self._called.wait()

    def _record(self, name: str) -> None:
        self.calls.append(name)
        self._called.set()

    async def _maybe_hang(self) -> None:
        if self.hang:
            await self._released.wait()

    async def Version(self, request: Any, context: Any) -> Any:
        self._record("Version")
        await self._maybe_hang()
        if self.not_ready > 0:
            self.not_ready -= 1
            await context.abort(grpc.StatusCode.UNKNOWN, "server is not initialized yet")
        name, version, _ = self.answer
        return api_pb2.VersionResponse(
            version="0.1.0", runtime_name=name, runtime_version=version, runtime_api_version="v1"
        )

    async def Status(self, request: Any, context: Any) -> Any:
        self._record("Status")
        await self._maybe_hang()
        conditions = [
            api_pb2.RuntimeCondition(type="RuntimeReady", status=True),
            api_pb2.RuntimeCondition(type="NetworkReady", status=True),
        ]
        response = api_pb2.StatusResponse(status=api_pb2.RuntimeStatus(conditions=conditions))
        if request.verbose:
            response.info.update(self.answer[2])
        return response


async def _serve(socket: Path, version: str, enable_cdi: bool | None) -> int:
    socket.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        socket.unlink()
    runtime = await FakeRuntime(socket, "containerd", version, containerd_info(enable_cdi)).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"serving on {socket}", flush=True)
    await stop.wait()
    await runtime.stop()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="A fake containerd CRI runtime (Version and Status) for tests.")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--version", default="1.7.24~ds1")
    parser.add_argument("--enable-cdi", choices=("true", "false", "absent"), default="false")
    args = parser.parse_args()
    enable = {"true": True, "false": False, "absent": None}[args.enable_cdi]
    return asyncio.run(_serve(args.socket, args.version, enable))


if __name__ == "__main__":
    sys.exit(main())
