"""DRA mode's servers on their unix sockets: their directories, and a socket of another process kept (real gRPC)."""

from __future__ import annotations

import os
import re
import socket
import stat
from pathlib import Path

import grpc
import pytest

from ate_devplugd._pb.pluginregistration.v1 import api_pb2 as reg_pb2
from ate_devplugd._pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from ate_devplugd.base.unixserver import SocketInUseError
from ate_devplugd.base.unixsock import FileIdentity, socket_answers, staging_path, unix_target
from ate_devplugd.dra.service import DraServer, RegistrationServicer

DRIVER = "kvm.ate.dev"


def registration(server: grpc.aio.Server) -> None:
    servicer = RegistrationServicer(DRIVER, "/k/plugins/kvm.ate.dev/dra.sock", lambda ok, error: None)
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)


async def test_directory_made_then_served(tmp_path: Path) -> None:
    """The registration socket's directory is made 0750 when kubelet has not made it yet; GetInfo answers."""
    path = tmp_path / "registry" / "kvm-reg.sock"
    server = DraServer(str(path), registration)
    await server.start()
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
        async with grpc.aio.insecure_channel(unix_target(str(path))) as channel:
            info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=5)
        assert info.name == DRIVER
    finally:
        await server.stop()
    assert not path.exists()


async def test_live_socket_bound_while_starting_is_not_replaced(tmp_path: Path) -> None:
    """Another process binding the socket path after the start looked at it and before our socket is put
    there keeps its socket: start fails naming the path, and the same file, still answering, is there
    after our stop (it used to be renamed over)."""
    path = tmp_path / "plugins_registry" / f"{DRIVER}-reg.sock"
    with socket.socket(socket.AF_UNIX) as other:

        def add_services_while_another_binds(server: grpc.aio.Server) -> None:
            registration(server)
            other.bind(str(path))  # between the start's check and its socket put in place
            other.listen()

        server = DraServer(str(path), add_services_while_another_binds)
        with pytest.raises(SocketInUseError, match=re.escape(str(path))):
            await server.start()
        theirs = FileIdentity.of(str(path))
        await server.stop()
        assert theirs is not None and FileIdentity.of(str(path)) == theirs
        assert socket_answers(str(path))
        assert not os.path.lexists(staging_path(str(path)))
