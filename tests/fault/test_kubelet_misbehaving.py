"""A kubelet that misbehaves: the daemon backs off without spinning, and registers once kubelet is sane.

Each test starts with a sane kubelet (baseline figures taken once registered), turns it into a bad one
for an episode, measures the daemon's CPU time and its Register attempts over the episode, then brings
a sane kubelet back (a new kubelet.sock, as a real restart does) and requires a registration within
``SANE_WITHIN`` seconds, exactly one live registration after, and no leak.

The daemon runs with ATE_DEVPLUGD_REGISTER_TIMEOUT=0.3, so a hung Register fails in 0.3 s, not 15 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.kubelet import Event, FakeKubelet
from tests.fault.harness import (
    RESOURCE,
    SOCKET,
    ProcFigures,
    assert_no_leak,
    assert_one_current_registration,
    cpu_seconds,
    daemon_log_clean,
    scale,
    settled,
    sockets_in,
)
from tests.support import DaemonProcess, NotifyReceiver, daemon, subprocess_env, write_config

REGISTER_TIMEOUT = 0.3
#: How long each bad kubelet misbehaves; the CPU bound below is for this span.
EPISODE = scale(15, 200) / 10
#: The daemon may use at most this share of one CPU while kubelet misbehaves (a spin uses ~100 %).
#: Generous: gRPC core's own threads are billed to the daemon, and on a loaded 2-core machine the
#: same idle work costs several times more CPU; a spin still misses it by far. The figure is printed.
CPU_SHARE = 0.35
#: With retries at 5 ms doubling, an episode of E seconds allows about log2(E / 5 ms) + 1 attempts;
#: a hung Register adds REGISTER_TIMEOUT to each. Twice that is the bound.
MAX_ATTEMPTS = 2 * (int(EPISODE / 0.005).bit_length() + 1)
#: From a sane kubelet.sock to kubelet's "register" event.
SANE_WITHIN = 2.0


class MoodyKubelet(FakeKubelet):
    """The fake kubelet, plus two bad moods: Register that never answers; never opening ListAndWatch."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.mood = "sane"

    async def handle_register(self, request: Any, context: Any) -> Any:
        self._record(Event("register-call", request.resource_name))
        if self.mood == "hang":
            await asyncio.Event().wait()  # until the daemon's deadline or our restart cancels the call
        return await super().handle_register(request, context)

    async def _list_and_watch(self, endpoint: Any) -> None:
        if self.mood == "no-list-and-watch":
            self._record(Event("no-list-and-watch", endpoint.resource))
            await asyncio.Event().wait()  # until the endpoint is dropped
        await super()._list_and_watch(endpoint)


def attempts(proc: DaemonProcess) -> int:
    """Register attempts that failed, from the daemon's (debug) log: one line each."""
    return proc.log().count("[event=register-failed")


@contextlib.asynccontextmanager
async def bad_socket(path: Path, kind: str) -> AsyncIterator[asyncio.Queue[int]]:
    """kubelet.sock that refuses connections (bound, not listening) or accepts and drops each one."""
    accepted: asyncio.Queue[int] = asyncio.Queue()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    if kind == "refuse":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        try:
            yield accepted
        finally:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return

    def dropped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.put_nowait(1)
        writer.close()

    server = await asyncio.start_unix_server(dropped, str(path))
    try:
        yield accepted
    finally:
        server.close()
        await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


async def episode_figures(proc: DaemonProcess) -> tuple[float, int]:
    """Let the fault last EPISODE seconds; the daemon's CPU seconds and failed attempts over it."""
    cpu0, tries0 = cpu_seconds(proc.pid), attempts(proc)
    await asyncio.sleep(EPISODE)  # the length of the episode (load), not a wait for any state
    return cpu_seconds(proc.pid) - cpu0, attempts(proc) - tries0


def check_episode(name: str, cpu: float, tries: int, min_tries: int = 1) -> None:
    print(f"kubelet {name}: {tries} failed Register attempts and {cpu:.3f} s CPU over {EPISODE:g} s")
    assert cpu <= CPU_SHARE * EPISODE, f"{name}: the daemon used {cpu:.2f} s CPU in {EPISODE} s"
    assert min_tries <= tries <= MAX_ATTEMPTS, f"{name}: {tries} attempts in {EPISODE} s"


async def sane_again(kubelet: FakeKubelet, proc: DaemonProcess | None = None) -> float:
    """Bring a sane kubelet up (wipe + new kubelet.sock); seconds until the daemon has registered."""
    loop = asyncio.get_running_loop()
    if isinstance(kubelet, MoodyKubelet):
        kubelet.mood = "sane"
    kubelet.reject_register = None
    start = loop.time()
    if kubelet.socket_path.exists() and kubelet._server is not None:
        await kubelet.restart()
    else:
        await kubelet.start()
    try:
        await kubelet.next_event("register", timeout=SANE_WITHIN)
    except TimeoutError:
        raise AssertionError(
            f"no registration {SANE_WITHIN} s after kubelet became sane:\n" + (proc.log()[-3000:] if proc else "")
        ) from None
    return loop.time() - start


@contextlib.asynccontextmanager
async def daemon_with_kubelet(
    tmp_path: Path, plugin_dir: Path, dev_root: Path
) -> AsyncIterator[tuple[DaemonProcess, MoodyKubelet, NotifyReceiver, ProcFigures]]:
    kubelet = MoodyKubelet(plugin_dir)
    await kubelet.start()
    notify = NotifyReceiver(tmp_path / "notify")
    env = subprocess_env(NOTIFY_SOCKET=str(notify.path), ATE_DEVPLUGD_REGISTER_TIMEOUT=str(REGISTER_TIMEOUT))
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    try:
        async with daemon(cfg, env=env) as proc:
            await settled(kubelet)
            yield proc, kubelet, notify, ProcFigures.of(proc.pid)
            assert await proc.stop() == 0
            daemon_log_clean(proc.log())
        assert SOCKET not in sockets_in(plugin_dir)
    finally:
        await notify.close()
        await kubelet.stop()


async def finish(
    name: str, *, proc: DaemonProcess, kubelet: FakeKubelet, plugin_dir: Path, before: ProcFigures, took: float
) -> None:
    print(f"kubelet {name}: registered {took * 1000:.0f} ms after a sane kubelet.sock appeared")
    await settled(kubelet)
    assert_one_current_registration(kubelet)
    assert sockets_in(plugin_dir) == {"kubelet.sock", SOCKET}
    assert_no_leak(f"kubelet-{name}", proc.pid, before, ProcFigures.of(proc.pid), 1)


async def test_register_hangs_past_deadline(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """Register never answers: each attempt ends at the deadline, then backs off; no spin."""
    async with daemon_with_kubelet(tmp_path, plugin_dir, dev_root) as (proc, kubelet, notify, before):
        kubelet.mood = "hang"
        await kubelet.restart()
        await kubelet.next_event("register-call")
        await notify.wait_for(lambda f: "register failed" in f.get("STATUS", ""))
        cpu, tries = await episode_figures(proc)
        check_episode("hang", cpu, tries, min_tries=2)
        await finish(
            "hang",
            proc=proc,
            kubelet=kubelet,
            plugin_dir=plugin_dir,
            before=before,
            took=await sane_again(kubelet, proc),
        )


async def test_register_fails(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """Register answers with an error every time: retried with doubling delays; no spin."""
    async with daemon_with_kubelet(tmp_path, plugin_dir, dev_root) as (proc, kubelet, notify, before):
        kubelet.reject_register = "the device manager is not ready"
        await kubelet.restart()
        await kubelet.next_event("register-rejected")
        await notify.wait_for(lambda f: "register failed" in f.get("STATUS", ""))
        cpu, tries = await episode_figures(proc)
        check_episode("rejects", cpu, tries, min_tries=3)
        await finish(
            "rejects",
            proc=proc,
            kubelet=kubelet,
            plugin_dir=plugin_dir,
            before=before,
            took=await sane_again(kubelet, proc),
        )


@pytest.mark.parametrize("kind", ["refuse", "drop"])
async def test_kubelet_sock_refuses_or_drops(tmp_path: Path, plugin_dir: Path, dev_root: Path, kind: str) -> None:
    """kubelet.sock exists but refuses connections, or accepts and drops them: back off; no spin."""
    async with daemon_with_kubelet(tmp_path, plugin_dir, dev_root) as (proc, kubelet, notify, before):
        await kubelet.stop()
        async with bad_socket(kubelet.socket_path, kind) as accepted:
            if kind == "drop":
                async with asyncio.timeout(5):
                    await accepted.get()
            await notify.wait_for(lambda f: "register failed" in f.get("STATUS", ""))
            cpu, tries = await episode_figures(proc)
            check_episode(kind, cpu, tries, min_tries=3)
            if kind == "drop":
                assert accepted.qsize() <= 4 * MAX_ATTEMPTS
        await finish(
            kind, proc=proc, kubelet=kubelet, plugin_dir=plugin_dir, before=before, took=await sane_again(kubelet, proc)
        )


async def test_kubelet_never_calls_list_and_watch(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """A kubelet that registers the plugin but never opens ListAndWatch: the daemon stays idle, registered
    once, and registers again at the next kubelet restart."""
    async with daemon_with_kubelet(tmp_path, plugin_dir, dev_root) as (proc, kubelet, notify, before):
        kubelet.mood = "no-list-and-watch"
        await kubelet.restart()
        await kubelet.next_event("no-list-and-watch")
        await notify.wait_for(lambda f: f.get("STATUS", "").endswith("registered"))
        cpu, tries = await episode_figures(proc)
        print(f"kubelet no-list-and-watch: {cpu:.3f} s CPU over {EPISODE:g} s")
        assert tries == 0 and cpu <= CPU_SHARE * EPISODE
        calls = [e for e in kubelet.history if e.kind == "register-call"]
        assert len(calls) == 2, calls  # the first kubelet's and this one's: no retry while registered
        await finish(
            "no-list-and-watch",
            proc=proc,
            kubelet=kubelet,
            plugin_dir=plugin_dir,
            before=before,
            took=await sane_again(kubelet, proc),
        )


async def test_no_kubelet_sock_idle(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """No kubelet at all: the daemon waits on inotify, using no CPU, and registers when one starts."""
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    notify = NotifyReceiver(tmp_path / "notify")
    try:
        async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
            await notify.wait_for(lambda f: "READY" in f)
            cpu, tries = await episode_figures(proc)
            print(f"no kubelet: {cpu:.3f} s CPU over {EPISODE:g} s")
            assert tries == 0 and cpu <= 0.02 * EPISODE
            kubelet = MoodyKubelet(plugin_dir)
            took = await sane_again(kubelet)
            try:
                assert took <= SANE_WITHIN
                await settled(kubelet)
                assert_one_current_registration(kubelet)
            finally:
                await kubelet.stop()
            assert os.path.exists(plugin_dir / SOCKET)
            assert RESOURCE in proc.log()
    finally:
        await notify.close()
