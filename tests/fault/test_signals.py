"""SIGTERM and SIGHUP at random moments of start-up, registration and reload.

Every run ends either in a clean exit (status 0, our socket and its staging name gone, nothing logged
as an error) or, for SIGHUP, in a consistent running state: one live registration with the IDs the
current file asks for, then a clean exit on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from pathlib import Path

from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import (
    SOCKET,
    assert_one_current_registration,
    daemon_log_clean,
    scale,
    settled,
    sockets_in,
)
from tests.support import DaemonProcess, started_kubelet, subprocess_env, write_config

TRIALS = scale(12, 150)
#: Start-up (interpreter, imports, probe, serve) takes roughly 0.3-0.6 s here; registration follows.
LATEST_SIGNAL = 0.9


def leftovers(plugin_dir: Path) -> set[str]:
    """Our files left in the directory: the socket and its staging name."""
    return {p.name for p in plugin_dir.iterdir() if p.name in (SOCKET, "." + SOCKET)}


async def start_daemon(tmp_path: Path, plugin_dir: Path, dev_root: Path, count: int = 4096) -> DaemonProcess:
    cfg = write_config(
        tmp_path / "c.toml",
        plugin_dir,
        dev_root,
        devices=f'[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {count}\n',
    )
    return await DaemonProcess(cfg, env=subprocess_env(ATE_DEVPLUGD_REGISTER_TIMEOUT="2")).start()


def set_count(proc: DaemonProcess, plugin_dir: Path, dev_root: Path, count: int) -> None:
    write_config(
        proc.config,
        plugin_dir,
        dev_root,
        devices=f'[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {count}\n',
    )


def before_the_program(proc: DaemonProcess, code: int, sig: int) -> bool:
    """Killed by ``sig`` before the daemon's first log line: the handlers go in before that line and
    before anything is created, so a default-action death is only acceptable with an empty log. (A
    bound on the delay instead would fail on a loaded machine, where the interpreter alone can take
    longer than any bound worth stating.)"""
    return code == -sig and proc.log() == ""


async def assert_clean_exit(proc: DaemonProcess, plugin_dir: Path) -> bool:
    """Exit 0 (or killed before the program ran: returns True), nothing left, a clean log."""
    code = await proc.wait(timeout=10)
    assert code == 0 or before_the_program(proc, code, signal.SIGTERM), (code, proc.log()[-3000:])
    assert not leftovers(plugin_dir), (leftovers(plugin_dir), proc.log()[-3000:])
    daemon_log_clean(proc.log())
    return code != 0


async def test_sigterm_at_random_points(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """SIGTERM at a random moment from exec to well after registration (some while Register is in flight):
    exit 0, nothing of ours left, never two registrations."""
    rng = random.Random(tmp_path.name)
    early: list[float] = []
    kubelet = await started_kubelet(plugin_dir)
    try:
        for trial in range(TRIALS):
            kubelet.register_delay = rng.choice([0.0, 0.0, 0.05, 0.3])
            proc = await start_daemon(tmp_path, plugin_dir, dev_root)
            delay = rng.uniform(0.0, LATEST_SIGNAL)
            try:
                await asyncio.sleep(delay)  # the random moment (load), not a wait for a state
                await proc.signal(signal.SIGTERM)
                if await assert_clean_exit(proc, plugin_dir):
                    early.append(delay)
            finally:
                if proc.proc is not None and proc.proc.returncode is None:
                    proc.proc.kill()
                    await proc.proc.wait()
            assert not [e for e in kubelet.history if e.kind == "double-register"], trial
        registrations = len([e for e in kubelet.history if e.kind == "register"])
        latest = f", the latest {max(early) * 1000:.0f} ms after exec" if early else ""
        print(
            f"SIGTERM at random points: {TRIALS} trials, {registrations} reached registration, "
            f"{len(early)} before the program ran{latest}"
        )
    finally:
        await kubelet.stop()


async def test_sighup_at_random_points(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """SIGHUP (once or twice) at a random moment of start-up or registration: the daemon keeps running and
    ends registered once with the current config; SIGTERM then exits cleanly."""
    rng = random.Random(tmp_path.name)
    early = 0
    trials = scale(6, 100)
    for _ in range(trials):
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        kubelet.register_delay = rng.choice([0.0, 0.05, 0.3])
        proc = await start_daemon(tmp_path, plugin_dir, dev_root)
        try:
            first = rng.uniform(0.0, LATEST_SIGNAL)
            for delay in [first, rng.uniform(0.0, LATEST_SIGNAL)][: rng.randint(1, 2)]:
                await asyncio.sleep(delay)  # random moments (load)
                with contextlib.suppress(ProcessLookupError):  # gone already: judged below
                    await proc.signal(signal.SIGHUP)
            kubelet.register_delay = 0.0
            assert proc.proc is not None
            exited = asyncio.ensure_future(proc.proc.wait())
            settling = asyncio.ensure_future(settled(kubelet))
            await asyncio.wait((exited, settling), timeout=20, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                settling.cancel()
                code = exited.result()
                assert before_the_program(proc, code, signal.SIGHUP), (code, first, proc.log()[-3000:])
                early += 1
                continue
            exited.cancel()
            assert settling.done(), proc.log()[-3000:]
            settling.result()
            assert proc.proc is not None and proc.proc.returncode is None, proc.log()[-3000:]
            assert_one_current_registration(kubelet)
            await proc.signal(signal.SIGTERM)
            await assert_clean_exit(proc, plugin_dir)
        finally:
            if proc.proc is not None and proc.proc.returncode is None:
                proc.proc.kill()
                await proc.proc.wait()
            await kubelet.stop()
    print(f"SIGHUP at random points: {trials} trials, {early} before the interpreter had started the daemon")
    assert early < trials


async def test_signals_during_reload(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """A reload that re-serves the resource (its count changes), hit by SIGHUP or SIGTERM at a random
    moment: either a clean exit, or one live registration advertising the count now in the file."""
    rng = random.Random(tmp_path.name)
    kubelet = await started_kubelet(plugin_dir)
    proc = await start_daemon(tmp_path, plugin_dir, dev_root, count=4096)
    try:
        await settled(kubelet)
        count = 4096
        for trial in range(scale(7, 100)):
            count = rng.choice([c for c in (64, 4096, 1000, 7) if c != count])
            set_count(proc, plugin_dir, dev_root, count)
            await proc.signal(signal.SIGHUP)
            await asyncio.sleep(rng.uniform(0.0, 0.1))  # a random moment of the reload (load)
            if trial == scale(7, 100) - 1 or rng.random() < 0.15:
                await proc.signal(signal.SIGTERM)
                await assert_clean_exit(proc, plugin_dir)
                kubelet.drain()
                proc = await start_daemon(tmp_path, plugin_dir, dev_root, count=count)
            elif rng.random() < 0.5:
                count = rng.choice([c for c in (64, 4096, 1000, 7) if c != count])
                set_count(proc, plugin_dir, dev_root, count)
                await proc.signal(signal.SIGHUP)
            await settled(kubelet, timeout=20)
            assert_one_current_registration(kubelet, healthy=count, total=count)
        await proc.signal(signal.SIGTERM)
        await assert_clean_exit(proc, plugin_dir)
        assert sockets_in(plugin_dir) == {"kubelet.sock"}
    finally:
        if proc.proc is not None and proc.proc.returncode is None:
            proc.proc.kill()
            await proc.proc.wait()
        await kubelet.stop()
