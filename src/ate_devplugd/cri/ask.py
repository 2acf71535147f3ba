"""Asking the node's container runtime over CRI, once: which runtime, and what it answers.

``discover`` finds the socket kubelet's runtime listens on (``cri.endpoint`` holds the order: ours,
else kubelet's flag or config file as its ``/proc`` entry shows them, else the usual sockets). ``ask``
puts kubelet's own questions to it (``Version``; ``Status`` with ``verbose``) and hands the answers to
``cri.facts.decide``, which holds what each runtime does with CDI names; no socket, no answer in
time, or an error is ``UNKNOWN``. ``doctor`` asks once; the daemon's ``cri.check.RuntimeCheck`` asks
whenever the node gives it a reason.
"""

from __future__ import annotations

import asyncio
import os
import posixpath

from ate_devplugd.base.look import Look, look
from ate_devplugd.cri.endpoint import DEFAULT_RUNTIME_SOCKETS, KUBELET_COMM, Endpoint, Kubelet, choose, config_file
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport, decide

#: The CRI version kubelet sends in VersionRequest.
KUBELET_CRI_VERSION = "0.1.0"
#: How long one question to the runtime may take before its answer counts as unknown.
ASK_TIMEOUT = 10.0


# -- which runtime ---------------------------------------------------------------------------------


def read_kubelet(proc_root: str = "/proc") -> Kubelet | None:
    """The running kubelet (the first process named ``kubelet``): its command line, and its config file
    where ``--config`` names one that can be read; None where none runs."""
    try:
        pids = sorted(int(name) for name in os.listdir(proc_root) if name.isdigit())
    except OSError:
        return None
    for pid in pids:
        base = posixpath.join(proc_root, str(pid))
        try:
            with open(posixpath.join(base, "comm"), encoding="utf-8", errors="replace") as f:
                if f.read().strip() != KUBELET_COMM:
                    continue
            with open(posixpath.join(base, "cmdline"), "rb") as f:
                argv = tuple(os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1])
        except OSError:
            continue  # gone meanwhile, or not ours to read
        path = config_file(argv, posixpath.join(base, "cwd"))
        try:
            with open(path, encoding="utf-8") as f:
                text: str | None = f.read()
        except (OSError, UnicodeDecodeError):
            text = None
        return Kubelet(pid, argv, path, text)
    return None


def read_commands(comm: str, proc_root: str = "/proc") -> list[tuple[tuple[str, ...], str]]:
    """The command lines of the processes named ``comm``, each with its working directory (``cwd``
    resolved; "/" where it cannot be read), in pid order."""
    try:
        pids = sorted(int(name) for name in os.listdir(proc_root) if name.isdigit())
    except OSError:
        return []
    out = []
    for pid in pids:
        base = posixpath.join(proc_root, str(pid))
        try:
            with open(posixpath.join(base, "comm"), encoding="utf-8", errors="replace") as f:
                if f.read().strip() != comm:
                    continue
            with open(posixpath.join(base, "cmdline"), "rb") as f:
                argv = tuple(os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1])
        except OSError:
            continue
        try:
            cwd = os.readlink(posixpath.join(base, "cwd"))
        except OSError:
            cwd = "/"
        out.append((argv, cwd))
    return out


def discover(configured: str, proc_root: str = "/proc") -> Endpoint:
    """The socket to ask and why (``cri.endpoint`` holds the order)."""
    return choose(configured, None if configured else read_kubelet(proc_root))


# -- asking ----------------------------------------------------------------------------------------


def find_socket(configured: str, candidates: tuple[str, ...] = DEFAULT_RUNTIME_SOCKETS) -> str | None:
    """The runtime socket to ask: the named one (``discover``), else the first usual one that exists."""
    if configured:
        return configured
    return next((path for path in candidates if look(path) is not Look.ABSENT), None)


def absent_report(configured_socket: str) -> RuntimeReport | None:
    """The verdict when there is no runtime socket to ask (UNKNOWN, saying where none was); None when
    there is one."""
    socket = find_socket(configured_socket)
    if socket is None:
        where = ", ".join(DEFAULT_RUNTIME_SOCKETS)
        return RuntimeReport(CdiVerdict.UNKNOWN, f"no runtime socket at {where}")
    if look(socket) is Look.ABSENT:
        return RuntimeReport(CdiVerdict.UNKNOWN, f"no runtime socket at {socket}", socket=socket)
    return None


async def ask(configured_socket: str, cdi_dir: str, timeout: float = ASK_TIMEOUT) -> RuntimeReport:
    """Ask the runtime (Version, then Status with verbose) and decide; never raises for its answers."""
    import grpc  # noqa: PLC0415 - the doctor imports this module before it needs gRPC

    from ate_devplugd._pb.cri.v1 import api_pb2, api_pb2_grpc  # noqa: PLC0415
    from ate_devplugd.base.unixsock import unix_target  # noqa: PLC0415

    absent = absent_report(configured_socket)
    if absent is not None:
        return absent
    socket = find_socket(configured_socket)
    assert socket is not None
    async with grpc.aio.insecure_channel(unix_target(socket)) as channel:
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        try:
            async with asyncio.timeout(timeout):
                version = await stub.Version(api_pb2.VersionRequest(version=KUBELET_CRI_VERSION))
                status = await stub.Status(api_pb2.StatusRequest(verbose=True))
        except grpc.aio.AioRpcError as exc:
            why = f"{socket}: {exc.code().name}: {exc.details()}"
            return RuntimeReport(CdiVerdict.UNKNOWN, why, socket=socket, unanswered=True)
        except TimeoutError:
            why = f"{socket} did not answer within {timeout:g}s"
            return RuntimeReport(CdiVerdict.UNKNOWN, why, socket=socket, unanswered=True)
    return decide(version.runtime_name, version.runtime_version, dict(status.info), cdi_dir, socket=socket)


# -- the daemon's check ----------------------------------------------------------------------------
