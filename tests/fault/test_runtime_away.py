"""The container runtime away for seconds, again and again, with CDI off and ``cdi = "required"``.

The daemon runs as a process on a scratch ``dev_root`` with a real kvm node, beside the fake kubelet and
a fake containerd whose CDI is off (tests/fakes/cri.py). The runtime is stopped (its socket removed, as
containerd does) for seconds, then started again with the same config; some restarts are back to back.
While it is away no container is created and, once it is back, a uid-1000 VMM would get ``EACCES``: so
not one ListAndWatch answer, the first included, may offer a Healthy unit, with the CPU idle or
overcommitted. STATUS says the verdict is kept while the runtime is away.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest

from tests.fakes.cri import FakeRuntime, containerd_info
from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import LOADED_WAIT, daemon_log_clean, load, scale
from tests.support import RESOURCE, NotifyReceiver, daemon, started_kubelet, subprocess_env, write_config

#: Stops of the runtime, each for AWAY seconds (0 for some: a restart back to back).
STOPS = scale(4, 40)
AWAY = (0.0, 3.0)
DEVICE = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncdi = "required"\n'


def healthy_answers(kubelet: FakeKubelet) -> list[int]:
    return [ev.healthy for ev in kubelet.history if ev.kind == "list" and ev.resource == RESOURCE]


async def status(notify: NotifyReceiver, text: str) -> str:
    return (await notify.wait_for(lambda f: text in f.get("STATUS", ""), timeout=LOADED_WAIT))["STATUS"]


async def listened(kubelet: FakeKubelet, seconds: float) -> None:
    """What kubelet is sent for ``seconds`` (each answer recorded in its history)."""
    if seconds <= 0:
        return
    with contextlib.suppress(TimeoutError):
        while True:
            await kubelet.next_event("list", resource=RESOURCE, timeout=seconds)


@pytest.mark.budget(600)
@pytest.mark.parametrize("machine", ["idle", "overcommit"])
async def test_runtime_away_offers_nothing(tmp_path: Path, plugin_dir: Path, dev_root: Path, machine: str) -> None:
    rng = random.Random(f"{tmp_path.name}/{machine}")
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root, DEVICE)
    socket = tmp_path / "runtime.sock"
    cdi = [str(tmp_path / "cdi")]
    runtime = await FakeRuntime(socket, "containerd", "1.7.24", containerd_info(False, cdi)).start()
    kubelet = await started_kubelet(plugin_dir)
    notify = NotifyReceiver(tmp_path / "notify")
    away: list[float] = []
    try:
        with load(machine) as how:
            async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
                await status(notify, "withheld: cdi-not-applied, registered")
                for _ in range(STOPS):
                    seconds = 0.0 if rng.random() < 0.25 else rng.uniform(*AWAY)
                    notify.forget()
                    await runtime.stop()
                    with contextlib.suppress(FileNotFoundError):
                        socket.unlink()
                    await listened(kubelet, seconds)
                    notify.forget()
                    runtime = await FakeRuntime(socket, "containerd", "1.7.24", containerd_info(False, cdi)).start()
                    await runtime.wait_for_calls("Status", 1, timeout=LOADED_WAIT)  # asked again
                    away.append(seconds)
                await listened(kubelet, 1.0)  # past the hold: an offer would have come
                seen = healthy_answers(kubelet)
                assert seen and set(seen) == {0}, (how, seen)
                said = [f.get("STATUS", "") for f in notify.history]
                assert any("; kept while the runtime is away (its socket " in line for line in said), said
                assert await proc.stop() == 0, proc.log()
                daemon_log_clean(proc.log())
                assert proc.log().count("is withheld (cdi-not-applied)") == 1
                assert "is offered again" not in proc.log()
        print(f"runtime away {len(away)} times ({sum(away):.1f} s in all), {how}: {len(seen)} answers, none Healthy")
    finally:
        await kubelet.stop()
        await runtime.stop()
        await notify.close()
