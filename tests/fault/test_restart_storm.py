"""Kubelet restart storms: many restarts at random intervals down to 0 ms, some during a Register.

After the storm settles kubelet holds exactly one live registration, with the current IDs and all units
Healthy, and never saw a second registration while an older stream was open ("double-register", which
kubelet 1.32 answers by dropping the new one). The daemon holds no more fds, threads or memory than
before the storm, and only its own socket and kubelet's are left in the directory.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tests.fault.harness import (
    SOCKET,
    ProcFigures,
    around,
    assert_no_leak,
    assert_one_current_registration,
    daemon_log_clean,
    load,
    scale,
    settled,
    sockets_in,
)
from tests.support import daemon, started_kubelet, write_config

STORM = scale(100, 1000)


def storm_intervals(rng: random.Random, n: int) -> list[tuple[float, float]]:
    """(pause before the restart, register_delay of the new kubelet), both in seconds.

    A third of the pauses are 0 (back to back), the rest up to 40 ms; every fourth kubelet answers
    Register only after up to 30 ms, so that many restarts land while a Register is in flight.
    """
    out = []
    for i in range(n):
        pause = 0.0 if rng.random() < 0.33 else rng.uniform(0.0, 0.04)
        delay = rng.uniform(0.002, 0.03) if i % 4 == 0 else 0.0
        out.append((pause, delay))
    return out


@pytest.mark.budget(300)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
async def test_restart_storm(tmp_path: Path, plugin_dir: Path, dev_root: Path, machine: str) -> None:
    """N kubelet restarts (random wipe orders): one current registration after, nothing leaked; the CPU
    idle or overcommitted."""
    rng = random.Random(tmp_path.name)
    kubelet = await started_kubelet(plugin_dir, seed=f"{tmp_path.name}/{machine}")
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    try:
        with load(machine) as how:
            async with daemon(cfg) as proc:
                await settled(kubelet)
                assert_one_current_registration(kubelet)
                before = ProcFigures.of(proc.pid)
                for pause, delay in storm_intervals(rng, STORM):
                    if pause:
                        await asyncio.sleep(pause)  # load: the spacing of restarts, not a wait for anything
                    await kubelet.restart()
                    kubelet.register_delay = delay
                kubelet.register_delay = 0.0
                # the last kubelet may have been restarted while a delayed Register was still answering
                await settled(kubelet)
                assert_one_current_registration(kubelet)
                assert sockets_in(plugin_dir) == {"kubelet.sock", SOCKET}
                after = ProcFigures.of(proc.pid)
                assert_no_leak(f"restart-storm, {how}", proc.pid, before, after, STORM)
                registrations = [e for e in kubelet.history if e.kind == "register"]
                assert len(registrations) <= STORM + 1
                assert await proc.stop() == 0
                daemon_log_clean(proc.log())
                # every removal of our socket was a kubelet's start, each one killed and started the kubelet way
                log = proc.log()
                assert "event=socket-removed" not in log, around(log, "event=socket-removed")
                assert "warning: registering" not in log, around(log, "warning: registering")
            assert sockets_in(plugin_dir) == {"kubelet.sock"}
    finally:
        await kubelet.stop()


@pytest.mark.budget(300)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
async def test_restart_storm_rounds_settle_each_time(
    tmp_path: Path, plugin_dir: Path, dev_root: Path, machine: str
) -> None:
    """Bursts of restarts, settling after each burst: every settled state is exactly one registration."""
    rng = random.Random(tmp_path.name)
    kubelet = await started_kubelet(plugin_dir, seed=f"{tmp_path.name}/{machine}")
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    rounds = scale(8, 60)
    try:
        with load(machine) as how:
            async with daemon(cfg) as proc:
                await settled(kubelet)
                before = ProcFigures.of(proc.pid)
                for _ in range(rounds):
                    for pause, delay in storm_intervals(rng, rng.randint(1, 6)):
                        if pause:
                            await asyncio.sleep(pause)  # load, as above
                        await kubelet.restart()
                        kubelet.register_delay = delay
                    kubelet.register_delay = 0.0
                    await settled(kubelet, quiet=0.3)
                    assert_one_current_registration(kubelet)
                    assert sockets_in(plugin_dir) == {"kubelet.sock", SOCKET}
                assert_no_leak(f"restart-bursts, {how}", proc.pid, before, ProcFigures.of(proc.pid), rounds)
                daemon_log_clean(proc.log())
    finally:
        await kubelet.stop()
