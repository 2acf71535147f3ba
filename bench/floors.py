"""The floors: the least a Python process on this runtime can do for each figure, run as subprocesses.

    floors.py import-ready NOTIFY_SOCKET   import grpc, protobuf, pyudev, systemd; send READY=1; exit
    floors.py idle-import                  import grpc; print "up"; wait for stdin to close (RSS floor)
    floors.py idle-libraries SOCKET [dra]  every library the daemon loads (with dra: DRA mode's too),
                                           and one grpc.aio server serving SOCKET; wait for stdin to
                                           close (RSS floor)
    floors.py import-groups dp|dra         import what the daemon loads, group by group, printing
                                           "GROUP RSS_KIB" after each (dp ends with prometheus_client,
                                           which the daemon does not load, for reference)
    floors.py uevent-wake SOURCE           a bare pyudev monitor (misc subsystem, KVM's VM announcements
                                           dropped as the daemon has them); print the monotonic time of
                                           each wake-up
    floors.py echo SOCKET                  a minimal grpc.aio unary echo server on a unix socket
    floors.py register DIR                 a minimal plugin: serve DIR/floor.sock, watch DIR with inotify,
                                           and Register once each time kubelet.sock is created
    floors.py serve-register DIR           the floor of a start: import the libraries the daemon loads,
                                           serve DIR/floor.sock (a DevicePlugin with one device), Register
                                           once with kubelet.sock (there already); stop when stdin closes

Each prints "up" on stdout when it is ready to be measured.
"""

from __future__ import annotations

import sys
import time


def _up() -> None:
    sys.stdout.write("up\n")
    sys.stdout.flush()


def import_ready(notify_socket: str) -> int:
    import socket

    import google.protobuf
    import grpc
    import pyudev
    import systemd

    del google.protobuf, grpc, pyudev, systemd
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.sendto(b"READY=1", notify_socket)
    return 0


def idle_import() -> int:
    import grpc

    del grpc
    _up()
    sys.stdin.read()
    return 0


def idle_libraries(socket_path: str, mode: str = "dp") -> int:
    import asyncio

    import grpc
    import pyudev
    from systemd import daemon

    from ate_devplugd._pb import api_pb2_grpc

    del daemon, api_pb2_grpc
    pyudev.Context()
    if mode == "dra":
        import aiohttp
        import yaml

        del aiohttp, yaml

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_insecure_port("unix://" + socket_path)
        await server.start()
        _up()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(None)

    asyncio.run(serve())
    return 0


def _rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def import_groups(mode: str) -> int:
    """RSS after each group of imports, in the order the daemon loads them (the journal as under systemd)."""

    def step(group: str) -> None:
        sys.stdout.write(f"{group}\t{_rss_kib()}\n")

    step("interpreter")
    import grpc
    import grpc.aio

    from ate_devplugd._pb import api_pb2, api_pb2_grpc

    step("grpc, protobuf, generated code")
    import asyncio

    import pyudev
    from systemd import journal

    pyudev.Context()
    step("asyncio, pyudev, systemd.journal")
    from ate_devplugd import cli, daemon

    step("the daemon's modules")
    if mode == "dra":
        from ate_devplugd.dra import mode as dra_mode

        del dra_mode
        step("DRA mode: aiohttp, PyYAML, dra/")
    else:
        import prometheus_client

        del prometheus_client
        step("prometheus_client")
    del grpc, api_pb2, api_pb2_grpc, asyncio, journal, cli, daemon
    sys.stdout.flush()
    return 0


def uevent_wake(source: str) -> int:
    import select

    import pyudev

    from ate_devplugd.node import kvm_events

    monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=source)
    monitor.filter_by("misc")
    monitor.start()
    kvm_events.drop_in_kernel(monitor.fileno())  # wakes when the daemon would: not for a VM's start or end
    poller = select.poll()
    poller.register(monitor.fileno(), select.POLLIN)
    _up()
    while True:
        poller.poll()
        t = time.monotonic()
        while monitor.poll(timeout=0) is not None:
            pass
        sys.stdout.write(f"{t!r}\n")
        sys.stdout.flush()


def echo(socket_path: str) -> int:
    import asyncio

    import grpc

    def unary(request: bytes, context: object) -> bytes:
        return request

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_async(unary))}
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port("unix://" + socket_path)
        await server.start()
        _up()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(None)

    asyncio.run(serve())
    return 0


def _async(func):  # type: ignore[no-untyped-def]
    async def handler(request: bytes, context: object) -> bytes:
        return func(request, context)  # type: ignore[no-any-return]

    return handler


def _plugin_server(directory: str):  # type: ignore[no-untyped-def]
    """A grpc.aio server with a DevicePlugin of one device on DIR/floor.sock, and its RegisterRequest."""
    import asyncio

    import grpc

    from ate_devplugd._pb import api_pb2, api_pb2_grpc

    class Plugin(api_pb2_grpc.DevicePluginServicer):
        async def GetDevicePluginOptions(self, request: object, context: object) -> api_pb2.DevicePluginOptions:
            return api_pb2.DevicePluginOptions()

        async def ListAndWatch(self, request: object, context: object):  # type: ignore[no-untyped-def]
            yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID="floor-0", health="Healthy")])
            await asyncio.Event().wait()

    server = grpc.aio.server()
    api_pb2_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    server.add_insecure_port("unix://" + directory + "/floor.sock")
    request = api_pb2.RegisterRequest(version="v1beta1", endpoint="floor.sock", resource_name="bench.floor/register")
    return server, request


async def _register_once(kubelet_sock: str, request: object) -> None:
    """Register, retried at once while kubelet.sock refuses (it exists a moment before kubelet listens)."""
    import asyncio

    import grpc

    from ate_devplugd._pb import api_pb2_grpc

    for _ in range(1000):
        try:
            async with grpc.aio.insecure_channel("unix://" + kubelet_sock) as channel:
                await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=10)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.001)
        else:
            return


def register(directory: str) -> int:
    import asyncio
    import os

    from ate_devplugd.base.inotify import DirEvent, DirWatcher

    kubelet_sock = os.path.join(directory, "kubelet.sock")

    async def serve() -> None:
        server, request = _plugin_server(directory)
        await server.start()
        pending: set[asyncio.Task[None]] = set()

        def on_events(events: list[DirEvent]) -> None:
            if any(ev.kind == "created" and ev.name == "kubelet.sock" for ev in events):
                task = asyncio.get_running_loop().create_task(_register_once(kubelet_sock, request))
                pending.add(task)
                task.add_done_callback(pending.discard)

        watch = DirWatcher(directory, on_events)
        watch.start()
        _up()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        watch.close()
        await server.stop(None)

    asyncio.run(serve())
    return 0


def serve_register(directory: str) -> int:
    """What a start costs at least: the daemon's libraries, one server, one Register (and, on stop, the
    server stopped: the floor of an upgrade's old process going)."""
    import asyncio
    import os

    import google.protobuf
    import pyudev
    import systemd

    del google.protobuf, systemd
    pyudev.Context()

    async def serve() -> None:
        server, request = _plugin_server(directory)
        await server.start()
        await _register_once(os.path.join(directory, "kubelet.sock"), request)
        _up()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(None)

    asyncio.run(serve())
    return 0


def main(argv: list[str]) -> int:
    mode, *args = argv
    floors = {
        "import-ready": import_ready,
        "idle-import": idle_import,
        "idle-libraries": idle_libraries,
        "import-groups": import_groups,
        "uevent-wake": uevent_wake,
        "echo": echo,
        "register": register,
        "serve-register": serve_register,
    }
    if mode not in floors:
        raise SystemExit(f"unknown floor {mode!r}")
    return int(floors[mode](*args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
