"""The handover guard (``reload --handover`` with ``handover_guard = true``, or ``--guard``): switch-mode's
cordon, settle and kubelet's-word steps around a handover, the mode kept. The daemon runs under the fake
service manager; pods are created in the fake API server and bound by the fake scheduler, which honours
the cordon, and admitted by kubelet's pod side (``tests.managed.Cluster``).

What must hold: no pod fails, on an idle machine and with the CPU overcommitted (the pods created under
the cordon wait and run after it); the cordon is lifted and our annotations are gone; the successor
serves. A handover the daemon refuses (its successor cannot start) lifts the cordon, leaves the daemon
serving, and fails the command with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest

from ate_devplugd.commands.switch_files import CORDON_ANNOTATION, TARGET_ANNOTATION
from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import cpu_overcommit
from tests.integration.dra_rig import NODE, short_dir
from tests.managed import Cluster, service
from tests.support import RESOURCE, run_cli, started_kubelet

COUNT = 64
RATE = 20.0


def guarded_config(base: Path, dev_root: Path, cluster: Cluster, kubelet_dir: Path, *, guard: bool = True) -> Path:
    config = base / "c.toml"
    config.write_text(
        f'plugin_dir = "{kubelet_dir / "device-plugins"}"\ndev_root = "{dev_root}"\ncdi_dir = "{base / "cdi"}"\n'
        f'metrics_file = ""\nruntime_socket = "{base / "runtime.sock"}"\nhandover_guard = {str(guard).lower()}\n\n'
        f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\ncount = {COUNT}\n\n' + cluster.dra_table(kubelet_dir)
    )
    return config


def annotations(cluster: Cluster) -> dict[str, str]:
    return cluster.api.nodes[NODE]["metadata"].get("annotations") or {}


class Rig(NamedTuple):
    base: Path
    kubelet: FakeKubelet
    cluster: Cluster
    config: Path


@contextlib.asynccontextmanager
async def rig(dev_root: Path, seed: int, *, guard: bool = True) -> AsyncIterator[Rig]:
    """The fake kubelet, the fake control plane with pods arriving at RATE when asked, and the config."""
    async with short_dir() as base:
        kubelet_dir = base / "kubelet"
        (kubelet_dir / "device-plugins").mkdir(parents=True)
        kubelet = await started_kubelet(kubelet_dir / "device-plugins")
        cluster = Cluster(kubelet, base, RATE, seed=seed)
        await cluster.start()
        try:
            yield Rig(base, kubelet, cluster, guarded_config(base, dev_root, cluster, kubelet_dir, guard=guard))
        finally:
            await cluster.stop()
            await kubelet.stop()


@pytest.mark.parametrize("cpu", ["idle", "overcommit"])
async def test_a_guarded_handover_loses_no_pod(dev_root: Path, cpu: str) -> None:
    async with rig(dev_root, 41) as (base, kubelet, cluster, config):
        with cpu_overcommit() if cpu == "overcommit" else contextlib.nullcontext():
            async with service(config, base) as svc:
                await svc.ready()
                await kubelet.next_event("list", resource=RESOURCE, timeout=60)
                old = svc.main
                cluster.arrive()
                status, _, err = await run_cli("reload", "--handover", "--config", str(config))
                failed = await cluster.stop_arriving(timeout=60)
                assert status == 0, err
                print(err)
                assert "handover: 2/6 cordoned node node-1" in err, err
                assert f"handover: 4/6 handed over from pid {old} " in err, err
                assert "handover: 6/6 uncordoned node node-1: done, device-plugin mode" in err, err
                assert svc.main != old
                assert (await svc.next("exit", timeout=30, pid=old))["status"] == 0
        assert failed == [], [(p.name, p.reason) for p in failed]
        assert not cluster.cordoned()
        assert CORDON_ANNOTATION not in annotations(cluster) and TARGET_ANNOTATION not in annotations(cluster)
        assert len(cluster.cordons) == 1
        waited = [p for p in cluster.pods if p.wait is not None and p.wait > 0.5]
        print(
            f"guarded handover ({cpu}): {len(cluster.pods)} pods at {RATE:g}/s, 0 failed; cordoned "
            f"{cluster.cordons[0]:.2f} s; {len(waited)} pods waited more than 0.5 s for it"
        )


async def test_a_refused_guarded_handover_lifts_the_cordon(dev_root: Path) -> None:
    """The file broken once the Node is cordoned (after the command read it): the successor exits 78, the
    daemon serves on, the command lifts its cordon and fails, saying why and that nothing was changed."""
    async with rig(dev_root, 7, guard=False) as (base, kubelet, cluster, config):
        cordoned = asyncio.Event()
        cluster.api.listeners.append(lambda resource: cordoned.set() if cluster.cordoned() else None)
        async with service(config, base) as svc:
            await svc.ready()
            await kubelet.next_event("list", resource=RESOURCE, timeout=60)
            old = svc.main
            command = asyncio.get_running_loop().create_task(
                run_cli("reload", "--handover", "--guard", "--config", str(config))
            )
            async with asyncio.timeout(60):
                await cordoned.wait()
            config.write_text(config.read_text().replace(f"count = {COUNT}", "count = 0"))
            status, _, err = await command
            assert status == 1, err
            print(err)
            assert "exited 78 before it was ready: config error: device[0] (ate.dev/kvm): count: 0" in err, err
            assert "the guarded handover (device-plugin mode) did not start" in err, err
            assert "serves on (the cordon lifted)" in err, err
            assert "nothing was changed: the node is not cordoned by switch-mode" in err, err
            assert svc.main == old and svc.proc.returncode is None
            assert await kubelet.admit(RESOURCE) == ""
        assert not cluster.cordoned()
        assert CORDON_ANNOTATION not in annotations(cluster) and TARGET_ANNOTATION not in annotations(cluster)


async def test_the_guard_needs_credentials(tmp_path: Path, dev_root: Path) -> None:
    """``handover_guard = true`` without the ``[dra]`` table is a config error naming the field."""
    config = tmp_path / "c.toml"
    config.write_text(f'dev_root = "{dev_root}"\nhandover_guard = true\n')
    status, _, err = await run_cli("check-config", "--config", str(config))
    assert status == 78, err
    assert "handover_guard: true needs the [dra] table (node_name, kubeconfig)" in err, err
