"""What an upgrade costs a node, in pods: the daemon restarted as systemd restarts it (SIGTERM, its exit,
the new process started), and handed over (``ate-devplugd reload --handover``, what the package's postinst
runs), each with pods arriving at 10/s and 50/s through kubelet's admission (the fake kubelet refuses a pod
while no unit of its resource is healthy, as kubelet 1.36 does), on a quiet machine and with the CPU
overcommitted as a node starting sandboxes is.

Each upgrade runs under the fake service manager (``tests/fakes/servicemanager.py``): the one that follows
MAINPID= to a successor, as systemd does. Figures per kind: the window (kubelet's old stream ended -> the
new device list healthy) and the pods that failed per upgrade, beside the pods that arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test harness

from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import cpu_overcommit
from tests.managed import Arrivals, service
from tests.support import RESOURCE, run_cli

RATES = (10.0, 50.0)
#: Pods keep arriving this long before each upgrade and after the device list is back.
MARGIN = 0.5
COUNT = 64


async def _window(kubelet: FakeKubelet, since: float) -> float:
    """kubelet's old stream's end (after ``since``) -> its next device list with every unit healthy."""
    ended = None
    async with asyncio.timeout(120):
        while True:
            ev = await kubelet.next_event("stream-ended", "list", resource=RESOURCE)
            if ev.kind == "stream-ended" and ev.t >= since:
                ended = ev.t
            elif ev.kind == "list" and ended is not None and ev.healthy == COUNT:
                return ev.t - ended


async def one(kind: str, rate: float, config: Path, base: Path) -> dict[str, float]:
    """One upgrade of ``kind`` (restart or handover) with pods arriving at ``rate``: its window and pods."""
    kubelet = FakeKubelet(config.parent / "device-plugins", jitter=0.0)
    await kubelet.start()
    stack = contextlib.AsyncExitStack()
    try:
        svc = await stack.enter_async_context(service(config, base))
        await svc.ready()
        await kubelet.next_event("list", resource=RESOURCE, timeout=60)
        pods = Arrivals(kubelet, rate)
        pods.start()
        await asyncio.sleep(MARGIN)  # pods arriving before the upgrade: load, not a wait for an event
        kubelet.drain()
        began = time.monotonic()
        if kind == "handover":
            status, _, err = await run_cli("reload", "--handover", "--config", str(config))
            if status != 0:
                raise RuntimeError(f"the handover failed: {err}")
        else:  # as systemd restarts a unit: SIGTERM, its exit, a new process
            await stack.aclose()
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(service(config, base))
        window = await _window(kubelet, began)
        await asyncio.sleep(MARGIN)  # pods arriving after it: load, not a wait for an event
        failed = await pods.stop()
        return {"window_ms": window * 1000, "arrived": len(pods.outcomes), "failed": len(failed)}
    finally:
        await stack.aclose()
        await kubelet.stop()


async def losses(base: Path, dev_root: Path, reps: int) -> dict[str, Any]:
    """Per kind, rate and machine: the window (median) and the pods that failed per upgrade (mean, max)."""
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    config = base / "upgrade.toml"
    config.write_text(
        f'plugin_dir = "{plugin_dir}"\ndev_root = "{dev_root}"\nmetrics_file = ""\ncdi_dir = "{base / "cdi"}"\n'
        f'runtime_socket = "{base / "runtime.sock"}"\n\n[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\n'
        f"count = {COUNT}\n"
    )
    out: dict[str, Any] = {}
    for machine in ("quiet", "overcommitted"):
        with cpu_overcommit() if machine == "overcommitted" else contextlib.nullcontext():
            for kind in ("restart", "handover"):
                for rate in RATES:
                    runs = [await one(kind, rate, config, base) for _ in range(reps)]
                    out[f"{kind} {rate:g}/s {machine}"] = {
                        "window_ms": round(statistics.median(r["window_ms"] for r in runs), 1),
                        "lost_mean": round(statistics.fmean(r["failed"] for r in runs), 2),
                        "lost_max": max(r["failed"] for r in runs),
                        "arrived_mean": round(statistics.fmean(r["arrived"] for r in runs), 1),
                        "n": reps,
                    }
    return out
