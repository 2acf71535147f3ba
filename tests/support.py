"""The one test harness, used by tests/, tests/fault/ and bench/.

- ``FakeKubelet`` (tests/fakes/kubelet.py) and ``started_kubelet``: kubelet's device manager;
- ``DaemonProcess`` / ``daemon()``: ``python -m ate_devplugd run`` as a subprocess;
- ``DaemonInProcess`` / ``daemon_in_process()``: the daemon on the test's own loop, with ``FakeKernel``
  standing in for the kernel's device nodes and ``FakeMonitor`` for udev (no root, no /dev/kvm);
- ``NotifyReceiver``: a real sd_notify socket (read continuously, or left unread to stall);
- ``EventRecorder``: the daemon's log events, in process;
- char nodes: ``make_kvm_node`` (a real mknod, root) and ``kvm_uevent`` (a real kernel uevent);
- ``allocated_kvm()``: the daemon on the host's own /dev/kvm with CDI on, and one real Allocate, for the
  tests that hand its answer to a real container runtime (podman, containerd through CRI).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from ate_devplugd._pb import api_pb2, api_pb2_grpc
from ate_devplugd.base.inotify import DirEvent, DirWatcher
from ate_devplugd.base.logs import FIELD_EVENT
from ate_devplugd.base.unixsock import unix_target
from ate_devplugd.commands import instance
from ate_devplugd.commands.instance import Running
from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.daemon import Daemon
from ate_devplugd.deviceplugin import endpoint
from ate_devplugd.node.devices import Presence, Resource
from ate_devplugd.node.kernel import KernelView, NodeStat, UdevKernelView
from ate_devplugd.signals.notify import Notifier
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.fakes.kubelet import FakeKubelet

SRC = Path(__file__).resolve().parents[1] / "src"
KVM_SYSFS = Path("/sys/class/misc/kvm")
KVM_UEVENT = KVM_SYSFS / "uevent"
FAKES = Path(__file__).resolve().parent / "fakes"
RESOURCE = "ate.dev/kvm"
SOCKET = "ate.dev-kvm.sock"
KVM_DEVNUM = (10, 232)
UDEVD = Path("/lib/systemd/systemd-udevd")
UDEV_CONTROL = Path("/run/udev/control")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "NOTIFY_SOCKET",
            "WATCHDOG_USEC",
            "WATCHDOG_PID",
            "JOURNAL_STREAM",
            "INVOCATION_ID",
            "RUNTIME_DIRECTORY",
        )
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``ate-devplugd ARGS`` as a subprocess, awaited on the loop (which may serve what it asks):
    its exit status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ate_devplugd",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or subprocess_env(),
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def write_config(
    path: Path,
    plugin_dir: Path,
    dev_root: Path,
    devices: str | None = None,
    *,
    metrics_file: Path | str = "",
    cdi_dir: Path | None = None,
) -> Path:
    """A config file for a test daemon: nothing written outside the test's directories (metrics off
    unless given a file; CDI specs next to the config) and no runtime asked but one there."""
    cdi = cdi_dir or path.parent / "cdi"
    text = f'plugin_dir = "{plugin_dir}"\ndev_root = "{dev_root}"\ncdi_dir = "{cdi}"\nmetrics_file = "{metrics_file}"\n'
    text += f'runtime_socket = "{path.parent / "runtime.sock"}"\n'
    text += devices if devices is not None else '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
    path.write_text(text)
    return path


def kvm_config(
    plugin_dir: Path, dev_root: Path, count: int = 4096, *, metrics_file: Path | str = "", **device: Any
) -> Config:
    """The default kvm resource (``count`` units) on these directories (metrics off unless given a
    file; CDI specs and the runtime's socket in ``plugin_dir``'s parent)."""
    return Config(
        plugin_dir=str(plugin_dir),
        dev_root=str(dev_root),
        cdi_dir=str(plugin_dir.parent / "cdi"),
        metrics_file=str(metrics_file),
        runtime_socket=str(plugin_dir.parent / "runtime.sock"),
        devices=(DeviceConfig(RESOURCE, "/dev/kvm", count=count, **device),),
    )


PRESENT = Presence(True, True, "character device 10:232")
GONE = Presence(False, False, "/dev/kvm does not exist")


def kvm_resource(count: int = 8, permissions: str = "rw") -> Resource:
    """The kvm resource, present and healthy."""
    resource = Resource(DeviceConfig(RESOURCE, "/dev/kvm", count=count, permissions=permissions))
    resource.update(PRESENT)
    return resource


@contextlib.asynccontextmanager
async def served(
    directory: Path, resource: Resource, *, withheld: bool = False
) -> AsyncIterator[tuple[endpoint.PluginServer, api_pb2_grpc.DevicePluginStub]]:
    """``resource`` served on a real socket in ``directory``, and a stub connected to it."""
    server = endpoint.PluginServer(resource, str(directory / resource.config.socket_name), withheld=withheld)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(unix_target(server.socket_path)) as channel:
            yield server, api_pb2_grpc.DevicePluginStub(channel)
    finally:
        await server.stop()


def alloc(*id_lists: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in id_lists]
    )


# -- char nodes ------------------------------------------------------------------------------------


def kvm_available() -> bool:
    """The kernel has a kvm misc device (``ATE_TEST_NO_KVM=1`` pretends it has none)."""
    return os.environ.get("ATE_TEST_NO_KVM", "") in ("", "0") and (KVM_SYSFS / "dev").exists()


def kvm_dev_root(parent: Path) -> Path:
    """parent/root standing in for ``/``, with ``dev/kvm`` a real kvm node; skips without root or kvm."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    if not kvm_available():
        pytest.skip("the kernel has no kvm misc device")
    root = parent / "root"
    (root / "dev").mkdir(parents=True)
    make_kvm_node(root)
    return root


def make_kvm_node(root: Path) -> Path:
    """A real character node at root/dev/kvm with the kernel's kvm numbers (needs root)."""
    major, minor = (int(x) for x in (KVM_SYSFS / "dev").read_text().split(":"))
    node = root / "dev" / "kvm"
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
    return node


def kvm_uevent() -> None:
    """Emit a real kernel uevent for the kvm misc device (a hint for the daemon to look again)."""
    KVM_UEVENT.write_text("change")


#: Creates VMs on the kvm node argv[1], argv[2] of them (0: until killed), one after another: each a
#: KVM_CREATE_VM and the close of the VM fd, so the kernel announces its start and its end. Prints "up"
#: once the node is open and, at the end, how many it made and in how many seconds.
VM_LOOP = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CLOEXEC)
wanted = int(sys.argv[2])
print("up", flush=True)
made, t0 = 0, time.monotonic()
while wanted == 0 or made < wanted:
    os.close(fcntl.ioctl(fd, 0xAE01, 0))  # KVM_CREATE_VM
    made += 1
print(made, time.monotonic() - t0, flush=True)
"""


@contextlib.asynccontextmanager
async def vm_storm(node: Path | str = "/dev/kvm", count: int = 0) -> AsyncIterator[asyncio.subprocess.Process]:
    """VMs started and stopped back to back in a child process (``VM_LOOP``); killed at the end if still going."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", VM_LOOP, str(node), str(count), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            if await proc.stdout.readline() != b"up\n":
                raise RuntimeError(f"the VM loop did not start (exit {await proc.wait()})")
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def vm_storm_then_removal(
    kubelet: FakeKubelet, proc: DaemonProcess, dev_root: Path, count: int, tell: Callable[[], object]
) -> tuple[str, int]:
    """``count`` VMs started and stopped on ``dev_root``'s kvm node while ``proc`` runs, until the kernel
    has announced them all; then the node removed and ``tell()`` (a uevent that says so, run in a
    thread): kubelet's next list must be Unhealthy. Returns the daemon's log by then, and how many
    uevents on kvm that are not KVM's announcements (ours included) the kernel sent meanwhile."""
    seen = KernelUevents()
    try:
        async with vm_storm(dev_root / "dev" / "kvm", count) as storm:
            assert storm.stdout is not None
            made = int((await storm.stdout.readline()).split()[0])
        await seen.wait_announcements(2 * made)
        (dev_root / "dev" / "kvm").unlink()
        await asyncio.to_thread(tell)
        assert (await kubelet.next_event("list")).healthy == 0, proc.log()
        return proc.log(), len(seen.other_kvm)
    finally:
        seen.close()


def assert_vms_made_no_hint(log: str, other_kvm: int) -> None:
    """The daemon's debug log shows a hint for our uevent, and for any other test run's meanwhile, but
    none for KVM's announcements, and none was read only to be left out (the socket filter dropped them)."""
    hints = [line for line in log.splitlines() if " uevent change misc/kvm" in line]
    assert 1 <= len(hints) <= other_kvm, (len(hints), other_kvm)
    assert "left out" not in log, "announcements got past the socket filter"


class Udevd:
    """udevd for a test or the bench: the host's if one runs, else one started here and, at ``stop()``,
    ended, /run/udev removed and /dev/kvm's owner and mode put back (its rules may set them again).

    Starting udevd changes nothing by itself (no coldplug is triggered).
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._saved: os.stat_result | None = None

    @staticmethod
    def can_start() -> bool:
        return UDEV_CONTROL.exists() or (UDEVD.exists() and os.geteuid() == 0)

    def start(self) -> None:
        """Start one unless one runs (a plain child: it may outlive the loop of whoever starts it)."""
        if UDEV_CONTROL.exists():
            return
        kvm = Path("/dev/kvm")
        self._saved = kvm.stat() if kvm.exists() else None
        self.proc = subprocess.Popen([str(UDEVD)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self, timeout: float = 20.0) -> None:
        """Wait until udevd listens (its control socket is there)."""
        await wait_for_path(UDEV_CONTROL, timeout=timeout)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree("/run/udev", ignore_errors=True)
        kvm = Path("/dev/kvm")
        if self._saved is not None and kvm.exists():
            os.chown(kvm, self._saved.st_uid, self._saved.st_gid)
            os.chmod(kvm, self._saved.st_mode & 0o7777)


class KernelUevents:
    """The kernel's own uevents (netlink group 1, as the daemon reads them without udevd), read on the
    loop: KVM's VM announcements are counted, every other uevent on kvm is kept."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, 15)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self.sock.bind((0, 1))
        self.announcements = 0
        self.other_kvm: list[bytes] = []
        #: The receive buffer overflowed at least once (counts are then lower bounds).
        self.lost = False
        self._changed = asyncio.Event()
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._read)

    def _read(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                try:
                    message = self.sock.recv(65536)
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:
                        raise
                    self.lost = True
                    continue
                if not message.startswith(
                    (b"change@/devices/virtual/misc/kvm\0", b"remove@/devices/virtual/misc/kvm\0")
                ):
                    continue
                if b"\0CREATED=" in message and b"\0EVENT=" in message:
                    self.announcements += 1
                else:
                    self.other_kvm.append(message)
                self._changed.set()

    async def wait_announcements(self, count: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while self.announcements < count:
                self._changed.clear()
                await self._changed.wait()

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()


class FakeKernel:
    """A KernelView with a table of character nodes instead of the real ones, sysfs and ioctls.

    Paths not in the table are stat'ed for real (a regular file or a directory is "not a character
    device"), so tests need neither root nor /dev/kvm.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[int, int]] = {}
        self.names: dict[tuple[int, int], str] = {KVM_DEVNUM: "/dev/kvm"}
        self.static: dict[str, tuple[int, int]] = {}
        self.kvm_version = 12
        self.kvm_error: OSError | None = None
        self.open_error: OSError | None = None
        self.create_vm_error: OSError | None = None
        self.opened: list[str] = []
        #: Calls of each KernelView method: one ``stat_node`` per device per look.
        self.calls: collections.Counter[str] = collections.Counter()

    def add_node(self, path: Path | str, devnum: tuple[int, int] = KVM_DEVNUM) -> None:
        self.nodes[str(path)] = devnum

    def remove_node(self, path: Path | str) -> None:
        self.nodes.pop(str(path), None)

    def stat_node(self, path: str) -> NodeStat:
        self.calls["stat_node"] += 1
        if path in self.nodes:
            return NodeStat(True, *self.nodes[path])
        st = os.stat(path)
        if stat.S_ISCHR(st.st_mode):
            return NodeStat(True, os.major(st.st_rdev), os.minor(st.st_rdev))
        return NodeStat(is_char=False)

    def devnode(self, major: int, minor: int) -> str | None:
        return self.names.get((major, minor))

    def static_devnum(self, path: str) -> tuple[int, int] | None:
        return self.static.get(path)

    def kvm_api_version(self, path: str) -> int:
        self.calls["kvm_api_version"] += 1
        self._check(path, self.kvm_error)
        return self.kvm_version

    def open_node(self, path: str) -> None:
        self._check(path, self.open_error)
        self.opened.append(path)

    def kvm_create_vm(self, path: str) -> None:
        self._check(path, self.kvm_error or self.create_vm_error)

    def _check(self, path: str, error: OSError | None) -> None:
        if path not in self.nodes:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if error is not None:
            raise error


class FakeUEvent:
    """What the daemon reads of a pyudev Device (``properties``: the uevent's KEY=VALUE pairs)."""

    def __init__(
        self,
        action: str,
        subsystem: str,
        sys_name: str,
        device_node: str | None,
        properties: dict[str, str] | None = None,
    ) -> None:
        self.action, self.subsystem, self.sys_name, self.device_node = action, subsystem, sys_name, device_node
        self.properties = {"ACTION": action, "SUBSYSTEM": subsystem, **(properties or {})}


def vm_properties(event: str, pid: int = 4242, created: int = 1, count: int = 1) -> dict[str, str]:
    """The properties kvm_uevent_notify_change (virt/kvm/kvm_main.c) adds to its change uevent on misc/kvm."""
    return {
        "CREATED": str(created),
        "COUNT": str(count),
        "EVENT": event,
        "PID": str(pid),
        "STATS_PATH": f"/kvm/{pid}-{created}",
        "MAJOR": str(KVM_DEVNUM[0]),
        "MINOR": str(KVM_DEVNUM[1]),
        "DEVNAME": "kvm",
    }


class FakeMonitor:
    """A udev monitor backed by a real pipe (as pyudev's own tests do): the daemon's fd code runs unchanged."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._events: collections.deque[FakeUEvent | OSError] = collections.deque()
        self.filters: set[str] = set()
        self.started = False

    def emit(self, action: str = "change", subsystem: str = "misc", sys_name: str = "kvm", **properties: str) -> None:
        """Queue one event, as the kernel or udevd sends it."""
        self._queue(FakeUEvent(action, subsystem, sys_name, f"/dev/{sys_name}", properties))

    def emit_vm(self, event: str = "create", pid: int = 4242, created: int = 1, count: int = 1) -> None:
        """Queue KVM's announcement of a VM created or torn down (a change on misc/kvm)."""
        self.emit("change", "misc", "kvm", **vm_properties(event, pid, created, count))

    def fail(self, error: OSError) -> None:
        """Make the next receive fail with ``error`` (ENOBUFS: the kernel dropped events)."""
        self._queue(error)

    def _queue(self, item: FakeUEvent | OSError) -> None:
        self._events.append(item)
        os.write(self._write, b"x")

    def fileno(self) -> int:
        return self._read

    def filter_by(self, subsystem: str) -> None:
        self.filters.add(subsystem)

    def remove_filter(self) -> None:
        self.filters.clear()

    def start(self) -> None:
        self.started = True

    def poll(self, timeout: float | None = None) -> FakeUEvent | None:
        try:
            os.read(self._read, 1)
        except BlockingIOError:
            return None
        item = self._events.popleft()
        if isinstance(item, OSError):
            raise item
        return item

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


# -- the daemon's outputs ----------------------------------------------------------------------------


class NotifyReceiver:
    """A real sd_notify receiver: an AF_UNIX datagram socket the daemon sends to.

    ``start_reading()`` reads every datagram as it arrives (as systemd does) onto a queue, stamped
    with CLOCK_MONOTONIC; until then nothing is read, as with a stalled systemd.
    """

    def __init__(self, path: Path, *, read: bool = True) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.sock.bind(str(path))
        self.received: asyncio.Queue[tuple[float, dict[str, str]]] = asyncio.Queue()
        self.history: list[dict[str, str]] = []
        self._task: asyncio.Task[None] | None = None
        if read:
            self.start_reading()

    def start_reading(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            fields = dict(line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line)
            self.history.append(fields)
            self.received.put_nowait((time.monotonic(), fields))

    async def wait_for(self, pred: Callable[[dict[str, str]], bool], timeout: float = 10.0) -> dict[str, str]:
        return (await self.wait_stamped(pred, timeout))[1]

    async def wait_stamped(
        self, pred: Callable[[dict[str, str]], bool], timeout: float = 10.0
    ) -> tuple[float, dict[str, str]]:
        """The first datagram from now on for which ``pred`` holds, with the time it was read."""
        async with asyncio.timeout(timeout):
            while True:
                stamped = await self.received.get()
                if pred(stamped[1]):
                    return stamped

    def forget(self) -> None:
        """Drop what was received so far: the next wait sees only later datagrams."""
        while not self.received.empty():
            self.received.get_nowait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sock.close()


class EventRecorder(logging.Handler):
    """Log records, in process, kept and put on a queue; ``wait_for`` waits for a named event (ATE_EVENT)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.queue: asyncio.Queue[logging.LogRecord] = asyncio.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.queue.put_nowait(record)

    def named(self, name: str) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, FIELD_EVENT, None) == name]

    async def wait_for(self, name: str, timeout: float = 10.0) -> logging.LogRecord:
        async with asyncio.timeout(timeout):
            while True:
                record = await self.queue.get()
                if getattr(record, FIELD_EVENT, None) == name:
                    return record

    def text(self) -> str:
        return "\n".join(f"{r.levelname} {r.getMessage()} [{getattr(r, FIELD_EVENT, '')}]" for r in self.records)


@contextlib.contextmanager
def recording_events() -> Any:
    """Record the daemon's log records (every level) while the block runs."""
    recorder = EventRecorder()
    logger = logging.getLogger("ate_devplugd")
    level = logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    try:
        yield recorder
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)


# -- the daemon ----------------------------------------------------------------------------------------


class DaemonInProcess:
    """The daemon run on the test's loop: ``stop()`` returns its exit status."""

    def __init__(self, daemon: Daemon, task: asyncio.Task[int], events: EventRecorder) -> None:
        self.daemon = daemon
        self.task = task
        self.events = events

    async def stop(self, timeout: float = 10.0) -> int:
        self.daemon.request_stop()
        async with asyncio.timeout(timeout):
            return await self.task


@contextlib.asynccontextmanager
async def daemon_in_process(
    config: Config,
    kernel: KernelView,
    *,
    monitor: FakeMonitor | None = None,
    reload_config: Callable[[], Config] | None = None,
    notify: Path | None = None,
    source: Path | None = None,
) -> AsyncIterator[DaemonInProcess]:
    """``Daemon`` on this loop with ``kernel`` for the device nodes and ``monitor`` for udev (``source``:
    the config file its record names, as the command line gives it)."""
    factory = (lambda: (monitor, "udev")) if monitor is not None else None
    notifier = Notifier(str(notify) if notify is not None else None)
    with recording_events() as events:
        daemon = Daemon(
            config,
            reload_config=reload_config,
            kernel=kernel,
            monitor_factory=factory,
            notifier=notifier,
            source=str(source.resolve()) if source is not None else "",
        )
        task = asyncio.get_running_loop().create_task(daemon.run())
        try:
            yield DaemonInProcess(daemon, task, events)
        finally:
            if not task.done():
                daemon.request_stop()
                try:
                    async with asyncio.timeout(10):
                        await task
                except TimeoutError:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task


async def record_of(config: Config) -> Running | None:
    """The record of the daemon serving ``config``, as a command reads it."""
    return await instance.serving(config)


_DAEMON_LOGS = itertools.count(1)


class DaemonProcess:
    """``python -m ate_devplugd run`` as a subprocess, its stderr kept in a file."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None, log_level: str = "debug") -> None:
        self.config = config
        self.args = args
        self.env = env or subprocess_env()
        self.log_level = log_level
        # A number of its own: an id() is reused once the object is gone, and a later process would then
        # append to an earlier one's log (a trial killed before its first line read as one that ran).
        self.log_path = config.with_suffix(f".{next(_DAEMON_LOGS)}.log")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> DaemonProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "ate_devplugd",
                "run",
                "--config",
                str(self.config),
                "--log-target",
                "console",
                "--log-level",
                self.log_level,
                *self.args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self.env,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def wait(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            return await self.proc.wait()

    async def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def stop(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await self.wait(timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise


@contextlib.asynccontextmanager
async def daemon(config: Path, *args: str, env: dict[str, str] | None = None) -> AsyncIterator[DaemonProcess]:
    proc = await DaemonProcess(config, *args, env=env).start()
    try:
        yield proc
    finally:
        if proc.proc is not None and proc.proc.returncode is None:
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await proc.stop()


# -- waiting -------------------------------------------------------------------------------------------


async def wait_for_path(path: Path, timeout: float = 10.0) -> None:
    """Wait until ``path`` exists, on an inotify watch of its directory (no polling)."""
    appeared = asyncio.Event()

    def on_events(events: list[DirEvent]) -> None:
        if any(ev.name == path.name or ev.kind == "dir-back" for ev in events) and path.exists():
            appeared.set()

    watch = DirWatcher(str(path.parent), on_events)
    watch.start()
    try:
        if not path.exists():
            async with asyncio.timeout(timeout):
                await appeared.wait()
    finally:
        watch.close()


async def wait_for_content(path: Path, text: str, timeout: float = 10.0) -> None:
    """Wait until ``path`` holds ``text`` (files written by rename: one inotify event per new content)."""
    changed = asyncio.Event()

    def on_events(events: list[DirEvent]) -> None:
        if any(ev.name == path.name or ev.kind == "dir-back" for ev in events):
            changed.set()

    def holds() -> bool:
        try:
            return text in path.read_text()
        except FileNotFoundError:
            return False

    watch = DirWatcher(str(path.parent), on_events)
    watch.start()
    try:
        async with asyncio.timeout(timeout):
            while not holds():
                await changed.wait()
                changed.clear()
    finally:
        watch.close()


async def started_kubelet(plugin_dir: Path, **options: Any) -> FakeKubelet:
    """A fake kubelet serving ``plugin_dir`` (its sockets wiped first, as kubelet does)."""
    kubelet = FakeKubelet(plugin_dir, **options)
    await kubelet.start()
    return kubelet


# -- the daemon's answer, for a real container runtime ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class KvmAllocation:
    """What one Allocate of ``ate.dev/kvm`` answered, and the CDI spec directory it refers to."""

    response: api_pb2.ContainerAllocateResponse
    cdi_dir: Path

    @classmethod
    def granted(cls, cdi_dir: Path) -> KvmAllocation:
        """What the daemon's Allocate answers for one unit with ``cdi = true`` (the same whenever it grants
        one): for a pod granted the device at a moment the daemon withholds it, and so refuses Allocate."""
        response = api_pb2.ContainerAllocateResponse(
            devices=[api_pb2.DeviceSpec(container_path="/dev/kvm", host_path="/dev/kvm", permissions="rw")],
            cdi_devices=[api_pb2.CDIDevice(name=f"{RESOURCE}=kvm")],
        )
        return cls(response, cdi_dir)

    @property
    def cdi_names(self) -> list[str]:
        """The fully qualified CDI names (``ate.dev/kvm=kvm``), as kubelet passes them on."""
        return [c.name for c in self.response.cdi_devices]

    @property
    def device_specs(self) -> list[api_pb2.DeviceSpec]:
        return list(self.response.devices)

    def spec(self) -> dict[str, Any]:
        """The CDI spec the daemon wrote for the resource."""
        return dict(json.loads((self.cdi_dir / "ate.dev-kvm.json").read_text()))


@contextlib.asynccontextmanager
async def allocated_kvm(tmp_path: Path, **device: Any) -> AsyncIterator[KvmAllocation]:
    """The daemon on the host's /dev/kvm (the real kernel view) with ``cdi = true``, registered with a fake
    kubelet, and one real gRPC Allocate of one unit; the daemon keeps running while the block runs, as it
    does while kubelet creates the container. ``device`` adds ``[[device]]`` keys (``container_mode``, ...).
    The runtime the daemon asks says it applies CDI and reads ``cdi_dir`` (a fake containerd: the test
    hands the answer to a runtime of its own), so that a table whose VMM needs CDI is offered."""
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    config = dataclasses.replace(kvm_config(plugin_dir, Path("/"), cdi=True, **device), dev_root="/")
    answer = containerd_info(True, [config.cdi_dir])
    runtime = await FakeRuntime(Path(config.runtime_socket), "containerd", "2.1.9", answer).start()
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(config, UdevKernelView()):
            await kubelet.next_event("list")
            (response,) = (await kubelet.allocate(RESOURCE, ["kvm-0"])).container_responses
            yield KvmAllocation(response, Path(config.cdi_dir))
    finally:
        await kubelet.stop()
        await runtime.stop()
