"""``switch-mode`` on a node with pods running and arriving (the rig: ``switch_rig``): device-plugin -> DRA ->
device-plugin, then the kept drop-in removed by a later run; with the daemon stopped before a move, crashing
during one, kubelet registering the DRA driver only after its Node update, a cluster that does not map the
name; and a move that is interrupted (a signal, a lost API server), then finished, with ``doctor`` between.

Every pod's path and wait is printed; the moves by ``switch-mode`` lose none (0 failed, 0 stuck, 0
undeletable, 0 delayed by a failed prepare), README's plain recipe does. The seed is printed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from ate_devplugd import config as configmod
from ate_devplugd.commands import switch_files
from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Finding, Level
from ate_devplugd.commands.switch_files import CORDON_ANNOTATION, TARGET_ANNOTATION
from ate_devplugd.config.dra import DraConfig
from tests.fault.harness import load
from tests.integration.dra_rig import NODE, write_kubeconfig
from tests.integration.switch_rig import (
    ENDPOINT_GRACE,
    RESOURCE,
    RESTART_SEC,
    WIPING_DELAY,
    Outcome,
    Rig,
    manifests_docs,
    node,
    report,
    s,
    seed,
)
from tests.support import FakeKernel, subprocess_env

NOTHING_LOST = {"failed": 0, "stuck": 0, "undeletable": 0, "delayed": 0}


def none_lost(outcome: Outcome, value: int) -> None:
    assert outcome.lost() == NOTHING_LOST, f"seed {value}: {outcome.lost()}"


async def there_and_back(rig: Rig) -> None:
    """DP -> DRA, DRA pods left at the move back, a later run once they are gone, and one more."""
    await asyncio.sleep(s(50))  # pods arrive in device-plugin mode
    assert await rig.move("dra") == 0
    await asyncio.sleep(s(ENDPOINT_GRACE + 50))  # past kubelet's endpoint grace, pods still arriving
    assert await rig.move("device-plugin") == 0
    assert switch_files.dropin_linked(rig.files), "kept while DRA pods are left"
    assert any("drop-in kept while" in line for line in rig.output)
    await rig.no_dra_pod_left()
    await asyncio.sleep(s(WIPING_DELAY))


async def findings(rig: Rig, kernel: FakeKernel) -> list[Finding]:
    where = Node(kernel=kernel, find_kubelet=lambda: None, proc_root=str(rig.proc), dropin_dir=rig.files.dropin_dir)
    return await examine(rig.config, where)


def switch_findings(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.check == "switch-mode"]


@pytest.mark.parametrize("cpu", ["idle", "overcommit"])
async def test_switch_mode_loses_no_pod_both_ways(kernel: FakeKernel, fake_root: Path, cpu: str) -> None:
    """There and back; the drop-in kept for the DRA pods left, doctor WARNs once none is, and the next run
    removes it (a restart, under its own cordon); then a run that has nothing to do."""
    value = seed()
    with load(cpu) as machine:
        async with node(value, kernel, fake_root) as rig:
            await there_and_back(rig)
            kept = switch_findings(await findings(rig, kernel))
            assert [f.level for f in kept] == [Level.WARN], kept
            assert (
                "no DRA pod is left" in kept[0].message and kept[0].remedy == "ate-devplugd switch-mode device-plugin"
            )
            assert await rig.move("device-plugin") == 0
            assert not switch_files.dropin_linked(rig.files)
            assert ("daemon-reload",) in rig.systemd.calls
            assert await rig.move("device-plugin") == 0  # nothing to do: no cordon, no restart
            assert "nothing to do" in rig.output[-1]
            assert [f.level for f in switch_findings(await findings(rig, kernel))] == [Level.OK]
            outcome = await rig.finish()
    report(f"switch-mode, seed {value}, {machine}", outcome)
    paths = {p.path for p in outcome.pods if p.phase == "Running"}
    assert paths == {"device-plugin", "dra"}, paths
    none_lost(outcome, value)
    assert len(outcome.unavailable) == 3, outcome.unavailable


async def test_readme_recipe_loses_pods(kernel: FakeKernel, fake_root: Path) -> None:
    value = seed()
    async with node(value, kernel, fake_root) as rig:
        await asyncio.sleep(s(50))
        await rig.readme_move("dra")
        await asyncio.sleep(s(ENDPOINT_GRACE + 50))
        await rig.readme_move("device-plugin")
        await asyncio.sleep(s(WIPING_DELAY + 70))
        outcome = await rig.finish()
    report(f"README recipe, seed {value}", outcome)
    assert outcome.of("failed"), "a pod bound in the Node's lag fails admission (DP -> DRA)"
    assert outcome.of("stuck"), "a pod sent down the DRA path after the driver went waits for ever (DRA -> DP)"


async def stop_daemon(rig: Rig) -> None:
    """``systemctl stop`` inside the Node's lag, once every pod bound has started, pods held back from then
    on: what fails while the daemon is down before any command runs is not the move's."""
    rig.arriving = False
    await rig.until(
        lambda: not rig.scheduler.pending and not any(p.path and p.phase == "Pending" for p in rig.pods), 10
    )
    async with rig.reporter.just_reported():
        await rig.systemd.stop(burst=False)


@pytest.mark.parametrize("cpu", ["idle", "overcommit"])
async def test_daemon_stopped_before_the_move(kernel: FakeKernel, fake_root: Path, cpu: str) -> None:
    """The daemon stopped before each move (to DRA, back, and the later run that removes the kept drop-in):
    the command starts it and waits for kubelet to hold it before it cordons, then trusts only the new
    daemon's record and a Node read after it (the stale "above 0" of a stopped daemon never uncordons).
    Pods arrive again once the command has cordoned the node."""
    value = seed()
    with load(cpu) as machine:
        async with node(value, kernel, fake_root) as rig:
            await asyncio.sleep(s(50))
            for target, then in (("dra", ENDPOINT_GRACE + 50), ("device-plugin", 0), ("device-plugin", 50)):
                if target == "device-plugin" and then:  # the later run, once the DRA pods are gone
                    assert switch_files.dropin_linked(rig.files)
                    await rig.no_dra_pod_left()
                await stop_daemon(rig)
                since = len(rig.output)
                resumed = asyncio.get_running_loop().create_task(resume_after_check(rig, since))
                assert await rig.move(target) == 0
                await resumed
                assert "ate-devplugd.service started (no daemon served the config)" in await rig.line(": 1/6 ", since)
                await asyncio.sleep(s(then))
            assert not switch_files.dropin_linked(rig.files)
            outcome = await rig.finish()
    report(f"daemon stopped before each move, seed {value}, {machine}", outcome)
    none_lost(outcome, value)


async def resume_after_check(rig: Rig, since: int) -> None:
    """Pods arrive again once the command has cordoned the node (its first step, the check, is done: kubelet
    holds the daemon again). One bound between the check and the cordon would meet a daemon that kubelet's
    device manager may not have listed yet, on a node that was broken before the command came."""
    await rig.line(": 2/6 ", since)
    rig.arriving = True


@pytest.mark.parametrize("when", ["settle", "half-way", "drop-in"])
async def test_daemon_crashing_during_the_move(kernel: FakeKernel, fake_root: Path, when: str) -> None:
    """The daemon crashes during a move and systemd starts it again after RestartSec (2-5 s, drawn):
    - settle: at the cordon of the move to DRA (pods held back a moment around it: one bound as the
      daemon crashes is lost to the crash, not to the move);
    - half-way: going back from a node half-way to DRA (the file and the drop-in changed, the daemon still
      in device-plugin mode, the Node's "above 0" the one from before the restart), the new daemon at
      kubelet's first Register of it, before kubelet holds it;
    - drop-in: the same crash in the later run that removes the kept drop-in (a restart in device-plugin
      mode).
    The command waits for a daemon started after its restart that kubelet holds, and reads the Node only
    after it."""
    value = seed()
    async with node(value, kernel, fake_root) as rig:
        restart_sec = s(rig.rng.uniform(*RESTART_SEC))
        loop = asyncio.get_running_loop()

        def at_register() -> None:  # the first Register after the command's restart
            if not rig.systemd.crashes and rig.systemd.calls and rig.systemd.calls[-1][0] == "restart":
                rig.systemd.crash(restart_sec)

        await asyncio.sleep(s(50))
        if when == "settle":
            rig.arriving = False
            await asyncio.sleep(s(1))  # the last pod bound is admitted

            def at_cordon(resource: str) -> None:
                if resource == "nodes" and rig.cordoned() and not rig.systemd.crashes:
                    rig.systemd.crash(restart_sec)

            rig.api.listeners.append(at_cordon)
            since = len(rig.output)
            resumed = loop.create_task(resume_after_check(rig, since))
            assert await rig.move("dra") == 0
            await resumed
        elif when == "half-way":
            switch_files.write_mode(rig.files, "dra")  # a move's step 4 cut short before its restart
            switch_files.link_dropin(rig.files)
            rig.dp.on_register = at_register
            assert await rig.move("device-plugin") == 0
        else:
            await there_and_back(rig)
            rig.dp.on_register = at_register
            assert await rig.move("device-plugin") == 0
        assert not switch_files.dropin_linked(rig.files) or when == "settle"
        assert rig.systemd.crashes == 1
        await asyncio.sleep(s(50))
        outcome = await rig.finish()
    report(f"daemon crashing during the move ({when}), seed {value}", outcome)
    none_lost(outcome, value)


async def test_kubelet_registers_the_driver_after_the_node_update(kernel: FakeKernel, fake_root: Path) -> None:
    """kubelet's plugin reconciler registers the new driver's socket only after kubelet has written the
    Node's allocatable 0 (then 0 to a second more, drawn): the cordon stays until the daemon's record
    says the driver is registered, so no pod meets `DRA driver ... is not registered`."""
    value = seed()

    def after_node_update(rig: Rig) -> Callable[[], Awaitable[None]]:
        async def lag() -> None:
            if rig.api.nodes[NODE]["status"]["allocatable"][RESOURCE] != "0":
                await rig.reporter.next_write()  # kubelet's Node update: allocatable 0 (the withheld path)
            await asyncio.sleep(s(rig.rng.uniform(0, 1.0)))  # then the reconciler's pass

        return lag

    async with node(value, kernel, fake_root, register_lag=after_node_update) as rig:
        await asyncio.sleep(s(50))
        assert await rig.move("dra") == 0
        await asyncio.sleep(s(100))
        outcome = await rig.finish()
    report(f"DRA driver registered after the Node update, seed {value}", outcome)
    assert any(p.path == "dra" and p.started for p in outcome.pods)
    none_lost(outcome, value)


@pytest.mark.parametrize("gate", ["apiserver", "kubelet"])
async def test_a_cluster_that_does_not_map_the_name(kernel: FakeKernel, fake_root: Path, gate: str) -> None:
    """DRAExtendedResource off: in the API server (the DeviceClass stored without extendedResourceName;
    the scheduler, off too, takes no DRA path), or in kubelet 1.35 (its default: alpha, off). The move to
    DRA is refused before the cordon, naming the gate; the node stays in device-plugin mode, untouched."""
    value = seed()
    kubelet = ("v1.35.3", "", "") if gate == "kubelet" else None
    async with node(value, kernel, fake_root, kubelet=kubelet) as rig:
        if gate == "apiserver":
            rig.api.extended_resource = rig.scheduler.extended_resource = False
            rig.api.objects.clear()  # the administrator's apply, on this API server
            rig.api.create(*manifests_docs(DraConfig(node_name=NODE)))
        else:
            rig.pods_side.extended_resource = False
        before = rig.config.read_text()
        await asyncio.sleep(s(50))
        assert await rig.move("dra") == 1
        said = "\n".join(rig.output)
        assert "DRAExtendedResource" in said, said
        assert ("DeviceClass kvm.ate.dev is stored without extendedResourceName" in said) == (gate == "apiserver")
        assert ("kubelet would fail every pod sent down the DRA path" in said) == (gate == "kubelet")
        assert "nothing was changed" in said
        assert rig.config.read_text() == before and not rig.windows and not rig.cordoned()
        assert not switch_files.dropin_linked(rig.files)
        await asyncio.sleep(s(50))
        outcome = await rig.finish()
    report(f"DRAExtendedResource off in {gate}, seed {value}", outcome)
    none_lost(outcome, value)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "api-lost"])
async def test_an_interrupted_move_then_finished(kernel: FakeKernel, fake_root: Path, how: str) -> None:
    """A move to DRA interrupted during its settle (a pod bound before the cordon still being admitted),
    while the config still says device-plugin: no traceback, where the node stands, the cordon kept with
    the move's target, exit 130/143 (1 for the API server that went away). doctor then says the node is
    half-way toward DRA, with `switch-mode dra` to finish and `switch-mode device-plugin` to go back; the
    move run again finishes. Pods arrive throughout: those that come while the node is half-way wait for
    the cordon to go, and then run."""
    value = seed()
    async with node(value, kernel, fake_root) as rig:
        await asyncio.sleep(s(50))
        rig.pods_side.hold_admission()  # a pod bound now waits in admission: the settle waits for it
        held = rig.new_pod()
        await rig.until(lambda: ("default", held.name) in rig.api.pods, 10)
        loop = asyncio.get_running_loop()
        since = len(rig.output)
        if how == "api-lost":

            async def lose() -> None:
                await rig.line("2/6 cordoned", since)
                await rig.api.stop()

            lost = loop.create_task(lose())
            status = await rig.move("dra", timeout=s(20))
            await lost
            await rig.api.start(rig.api.port)
        else:
            signum = getattr(signal, how)

            async def interrupt() -> None:
                await rig.line(" pod(s) not admitted yet", since)
                os.kill(os.getpid(), signum)

            interrupting = loop.create_task(interrupt())
            status = await rig.move("dra", signals=(signum,))
            await interrupting
        said = "\n".join(rig.output)
        assert "Traceback" not in said
        assert status == (1 if how == "api-lost" else 128 + getattr(signal, how)), said
        assert "switch-mode dra did not finish" in said, said
        stands = "the cordon stays" if how != "api-lost" else "as this run last knew, the node is cordoned by switch"
        assert stands in said, said
        assert "run `ate-devplugd switch-mode dra` again to finish" in said
        annotations = rig.api.nodes[NODE]["metadata"].get("annotations") or {}
        assert rig.cordoned() and annotations.get(CORDON_ANNOTATION) == "switch-mode"
        assert annotations.get(TARGET_ANNOTATION) == "dra"
        assert configmod.load(rig.config).mode == "device-plugin"
        half_way = switch_findings(await findings(rig, kernel))
        assert [f.level for f in half_way] == [Level.WARN], half_way
        assert "toward dra" in half_way[0].message, half_way
        assert half_way[0].remedy.startswith("finish with `ate-devplugd switch-mode dra`"), half_way
        assert "go back with `ate-devplugd switch-mode device-plugin`" in half_way[0].remedy
        rig.pods_side.release_admission()
        assert await rig.move("dra") == 0
        assert not rig.cordoned()
        assert TARGET_ANNOTATION not in (rig.api.nodes[NODE]["metadata"].get("annotations") or {})
        assert [f.level for f in switch_findings(await findings(rig, kernel))] == [Level.OK]
        await asyncio.sleep(s(20))
        outcome = await rig.finish()
    report(f"interrupted ({how}), then finished, seed {value}", outcome)
    none_lost(outcome, value)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "refused"])
async def test_the_command_line_ends_without_a_traceback(tmp_path: Path, how: str) -> None:
    """``ate-devplugd switch-mode`` as run from a shell, against an API server that takes the connection
    and never answers (a signal comes while it waits) or that refuses it: no traceback, where the node
    stands (nothing changed: the first read never answered), exit 128 + the signal, or 1."""
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        accepted.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    if how == "refused":
        server.close()
        await server.wait_closed()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
    config = tmp_path / "config.toml"
    config.write_text(f'metrics_file = ""\n[dra]\nnode_name = "{NODE}"\nkubeconfig = "{kubeconfig}"\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ate_devplugd", "switch-mode", "dra", "--config", str(config),
        "--systemctl", "/bin/false", "--dropin-dir", str(tmp_path / "dropins"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=subprocess_env(),
    )  # fmt: skip
    try:
        if how != "refused":
            async with asyncio.timeout(30):
                await accepted.wait()
            proc.send_signal(getattr(signal, how))
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    finally:
        for writer in held:
            writer.close()
        server.close()
    said = out.decode() + err.decode()
    assert "Traceback" not in said, said
    expected = 1 if how == "refused" else 128 + getattr(signal, how)
    assert proc.returncode == expected, said
    assert "switch-mode dra did not start" in said and "nothing was changed" in said, said
    if how != "refused":
        assert f"interrupted by {how} before its first step" in said, said
