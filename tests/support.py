"""Helpers for tests that run the daemon as a real subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from tests.fakes.kubelet import FakeKubelet

SRC = Path(__file__).resolve().parents[1] / "src"
KVM_UEVENT = Path("/sys/class/misc/kvm/uevent")
FAKES = Path(__file__).resolve().parent / "fakes"


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "INVOCATION_ID")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def write_config(path: Path, plugin_dir: Path, dev_root: Path, devices: str | None = None, top: str = "") -> Path:
    text = f'plugin_dir = "{plugin_dir}"\ndev_root = "{dev_root}"\n{top}\n'
    text += devices if devices is not None else '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
    path.write_text(text)
    return path


class DaemonProcess:
    """``python -m ate_devplugd run`` as a subprocess, its stderr kept in a file."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.args = args
        self.env = env or subprocess_env()
        self.log_path = config.with_suffix(f".{id(self)}.log")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> DaemonProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
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
                "debug",
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


class NotifySocket:
    """A real sd_notify receiver: an AF_UNIX datagram socket the daemon sends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, dict[str, str]]] = []

    def close(self) -> None:
        self.sock.close()

    async def next(self, timeout: float = 10.0) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            data = await loop.sock_recv(self.sock, 65536)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append((loop.time(), fields))
        return fields

    async def wait_for(self, pred: Callable[[dict[str, str]], bool], timeout: float = 10.0) -> dict[str, str]:
        async with asyncio.timeout(timeout):
            while True:
                fields = await self.next(timeout)
                if pred(fields):
                    return fields


async def wait_for_path(path: Path, timeout: float = 10.0) -> None:
    """Wait until ``path`` exists, on an inotify watch of its directory (no polling)."""
    from ate_devplugd.inotify import DirEvent, DirWatcher

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


def kvm_uevent() -> None:
    """Emit a real kernel uevent for the kvm misc device (a hint for the daemon to re-probe)."""
    KVM_UEVENT.write_text("change")


async def started_kubelet(plugin_dir: Path) -> FakeKubelet:
    """A fake kubelet serving ``plugin_dir`` (its sockets wiped first, as kubelet does)."""
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    return kubelet
