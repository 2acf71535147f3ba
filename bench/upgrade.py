"""What an upgrade costs a node, in pods: the daemon restarted as systemd restarts it (SIGTERM, its exit,
the new process started), handed over (``ate-devplugd reload --handover``, what the package's postinst
runs), and handed over under the guard (``handover_guard = true``: switch-mode's cordon around it), each with
pods arriving at 10/s and 50/s, on a quiet machine and with the CPU overcommitted as a node starting
sandboxes is. Pods of a restart or a plain handover go straight to kubelet's admission (the fake kubelet
refuses a pod while no unit of its resource is healthy, as kubelet 1.36 does); a guarded handover's are
created in the fake API server and bound by the fake scheduler, which honours the cordon
(``tests.managed.Cluster``).

Each upgrade runs under the fake service manager (``tests/fakes/servicemanager.py``): the one that follows
MAINPID= to a successor, as systemd does. Figures per kind: the window (kubelet's old stream ended -> the
new device list healthy), the cordon (guarded: the seconds the node took no new pod), and the pods that
failed per upgrade, beside the pods that arrived.
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
from tests.managed import Arrivals, Cluster, service
from tests.support import RESOURCE, run_cli

KINDS = ("restart", "handover", "guarded")

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


async def one(kind: str, rate: float, plugin_dir: Path, dev_root: Path, seed: int) -> dict[str, float]:
    """One upgrade of ``kind`` (of KINDS) with pods arriving at ``rate``: its window, cordon and pods."""
    base = plugin_dir.parent
    kubelet = FakeKubelet(plugin_dir, jitter=0.0)
    await kubelet.start()
    cluster = Cluster(kubelet, base, rate, seed) if kind == "guarded" else None
    pods = Arrivals(kubelet, rate) if cluster is None else None
    stack = contextlib.AsyncExitStack()
    try:
        if cluster is not None:
            await cluster.start()
        config = _config(base, plugin_dir, dev_root, cluster)
        svc = await stack.enter_async_context(service(config, base))
        await svc.ready()
        await kubelet.next_event("list", resource=RESOURCE, timeout=60)
        if pods is not None:
            pods.start()
        else:
            assert cluster is not None
            cluster.arrive()
        await asyncio.sleep(MARGIN)  # pods arriving before the upgrade: load, not a wait for an event
        kubelet.drain()
        began = time.monotonic()
        if kind in ("handover", "guarded"):  # the config says whether it is guarded
            status, _, err = await run_cli("reload", "--handover", "--config", str(config))
            if status != 0:
                raise RuntimeError(f"the {kind} handover failed: {err}")
        else:  # as systemd restarts a unit: SIGTERM, its exit, a new process
            await stack.aclose()
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(service(config, base))
        window = await _window(kubelet, began)
        await asyncio.sleep(MARGIN)  # pods arriving after it: load, not a wait for an event
        if pods is not None:
            failed, arrived, cordon = len(await pods.stop()), len(pods.outcomes), 0.0
        else:
            assert cluster is not None
            failed = len(await cluster.stop_arriving(timeout=120))
            arrived, cordon = len(cluster.pods), sum(cluster.cordons)
        return {"window_ms": window * 1000, "cordon_ms": cordon * 1000, "arrived": arrived, "failed": failed}
    finally:
        await stack.aclose()
        if cluster is not None:
            await cluster.stop()
        await kubelet.stop()


def _config(base: Path, plugin_dir: Path, dev_root: Path, cluster: Cluster | None) -> Path:
    """The daemon's config: plain, or with the guard on and the cluster's credentials."""
    guard = "handover_guard = true\n" if cluster is not None else ""
    config = base / ("guarded.toml" if cluster is not None else "upgrade.toml")
    config.write_text(
        f'plugin_dir = "{plugin_dir}"\ndev_root = "{dev_root}"\nmetrics_file = ""\ncdi_dir = "{base / "cdi"}"\n'
        f'runtime_socket = "{base / "runtime.sock"}"\n{guard}\n[[device]]\nresource = "{RESOURCE}"\n'
        f'path = "/dev/kvm"\ncount = {COUNT}\n\n{cluster.dra_table(plugin_dir.parent) if cluster is not None else ""}'
    )
    return config


async def losses(base: Path, dev_root: Path, reps: int) -> dict[str, Any]:
    """Per kind, rate and machine: the window (median) and the pods that failed per upgrade (mean, max)."""
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for machine in ("quiet", "overcommitted"):
        with cpu_overcommit() if machine == "overcommitted" else contextlib.nullcontext():
            for kind in KINDS:
                for rate in RATES:
                    runs = [await one(kind, rate, plugin_dir, dev_root, seed) for seed in range(reps)]
                    out[f"{kind} {rate:g}/s {machine}"] = {
                        "window_ms": round(statistics.median(r["window_ms"] for r in runs), 1),
                        "cordon_ms": round(statistics.median(r["cordon_ms"] for r in runs), 1),
                        "lost_mean": round(statistics.fmean(r["failed"] for r in runs), 2),
                        "lost_max": max(r["failed"] for r in runs),
                        "arrived_mean": round(statistics.fmean(r["arrived"] for r in runs), 1),
                        "n": reps,
                    }
    return out
