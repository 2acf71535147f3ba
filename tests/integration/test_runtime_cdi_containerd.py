"""The CDI verdict against real containerd: what the daemon and ``doctor`` say, and what then happens.

For each runtime setup (containerd 1.7.24 with ``enable_cdi`` true, false, and a ``cdi_spec_dirs`` that
leaves out the daemon's directory; containerd 2.1.9 the same, with CDI on by default, with its own
version 3 config and with a version 2 file; containerd 1.6.20 as it is) the daemon runs on the host's /dev/kvm with
``cdi = true`` and ``runtime_socket`` at that containerd: its STATUS, its journal event and its metric
give the verdict, and ``doctor`` gives it too. Then a pod is run as kubelet runs it with the daemon's
Allocate answer (tests.runtimes.containerd: CRI CreateContainer with the Devices and CDI names, a VMM as
uid 1000), and the verdict must predict what the container got: a guest that boots (applied), EACCES
(not applied), or no container at all (spec directory not read). A second spec in the daemon's directory
that defines the same name (on 1.7 and 2.1) leaves the verdict "applied" but fails the container; the
daemon's ``cdi-conflict`` warning and ``doctor``'s ``cdi specs`` FAIL must say so.

They need root, /dev/kvm and containerd; they skip without them, and fail instead where
``ATE_REQUIRE_CONTAINERD=1`` (``make check``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Level
from ate_devplugd.commands.findings import render as render_doctor
from ate_devplugd.config import Config, render
from ate_devplugd.cri.check import EVENT_NOT_APPLIED, EVENT_RUNTIME
from ate_devplugd.cri.conflicts import EVENT_CONFLICT
from ate_devplugd.cri.facts import CdiVerdict
from ate_devplugd.node.cdi import EVENT_RESTORED
from ate_devplugd.node.kernel import UdevKernelView
from tests.fakes.kubelet import FakeKubelet
from tests.podman import NodeStat
from tests.runtimes.containerd import CheckerRun, Containerd, ContainerdBuild, Images, require, run_allocated, running
from tests.support import (
    RESOURCE,
    KvmAllocation,
    NotifyReceiver,
    daemon_in_process,
    kvm_config,
    started_kubelet,
    wait_for_content,
)

#: What each verdict promises about a container started with the daemon's answer.
PROMISES: dict[CdiVerdict, Callable[[CheckerRun], bool]] = {
    CdiVerdict.APPLIED: lambda run: bool(run.check and run.check.guest and run.check.guest.booted),
    CdiVerdict.NOT_APPLIED: lambda run: bool(run.check and run.check.open_error == "EACCES"),
    CdiVerdict.DIR_NOT_READ: lambda run: run.failed_call == "CreateContainer" and "unresolvable CDI" in run.error,
}


@dataclasses.dataclass
class Said:
    """What the daemon and doctor said about one runtime, and what the pod then got."""

    status: str
    events: list[logging.LogRecord]
    metrics: list[str]
    doctor: dict[str, Any]
    doctor_text: str
    run: CheckerRun
    #: The daemon's cdi-conflict events, and its STATUS once the pod ran.
    conflicts: list[logging.LogRecord] = dataclasses.field(default_factory=list)
    last_status: str = ""


def daemon_config(tmp_path: Path, socket: Path) -> tuple[Config, Path]:
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    prom = tmp_path / "metrics" / "ate-devplugd.prom"
    prom.parent.mkdir()
    config = dataclasses.replace(
        kvm_config(plugin_dir, Path("/"), cdi=True, metrics_file=prom), dev_root="/", runtime_socket=str(socket)
    )
    path = tmp_path / "config.toml"
    path.write_text(render(config))
    return config, path


def kubelet_binary(tmp_path: Path) -> Path:
    """The node's kubelet binary is not part of these tests: a stand-in answers ``--version`` as kubelet 1.31."""
    script = tmp_path / "kubelet"
    script.write_text("#!/bin/sh\necho 'Kubernetes v1.31.2'\n")
    script.chmod(0o755)
    return script


async def observe(
    containerd: ContainerdBuild,
    images: Images,
    tmp_path: Path,
    verdict: CdiVerdict,
    *,
    metric: str = "",
    **cri_config: object,
) -> Said:
    """A containerd of its own; the daemon asking it; doctor; then one pod with the daemon's Allocate answer.
    ``metric``: the verdict label expected (the runtime's verdict unless a spec stops our name resolving).
    Where no container would be created, kubelet must see the device withheld (allocatable 0)."""
    async with running(containerd, tmp_path / "containerd", images=[images.pause, images.checker], **cri_config) as rt:
        config, path = daemon_config(tmp_path, rt.socket)
        notify = NotifyReceiver(tmp_path / "notify")
        kubelet: FakeKubelet = await started_kubelet(Path(config.plugin_dir))
        try:
            async with daemon_in_process(config, UdevKernelView(), notify=notify.path) as running_daemon:
                first = await kubelet.next_event("list")
                # The daemon's Allocate answer; where it withholds the device from its first answer (cri.usable:
                # the verdict is heard before it serves), what it would have granted.
                if first.healthy:
                    (response,) = (await kubelet.allocate(RESOURCE, ["kvm-0"])).container_responses
                else:
                    response = KvmAllocation.granted(Path(config.cdi_dir)).response
                status = await notify.wait_for(lambda f: "| cdi: " in f.get("STATUS", ""), timeout=30)
                line = f'ate_devplugd_runtime_cdi{{runtime="{rt_name(status)}",verdict="{metric or verdict.value}"}} 1'
                await wait_for_content(Path(config.metrics_file), line)
                prom = Path(config.metrics_file)
                # what doctor reads of the daemon: registered, and kubelet's stream open
                await wait_for_content(prom, f'ate_devplugd_registered{{resource="{RESOURCE}"}} 1')
                await wait_for_content(prom, f'ate_devplugd_listandwatch_streams{{resource="{RESOURCE}"}} 1')
                metrics = [m for m in prom.read_text().splitlines() if m.startswith("ate_devplugd_runtime_cdi")]
                binary = kubelet_binary(tmp_path)
                findings = await examine(path, Node(kernel=UdevKernelView(), find_kubelet=lambda: str(binary)))
                allocation = KvmAllocation(response, Path(config.cdi_dir))
                run = await run_allocated(rt, allocation)
                if run.failed_call == "CreateContainer":  # what the node advertises matches what a pod gets
                    assert first.healthy == 0 and kubelet.allocatable(RESOURCE) == 0
                events = running_daemon.events.named(EVENT_RUNTIME) + running_daemon.events.named(EVENT_NOT_APPLIED)
                conflicts = running_daemon.events.named(EVENT_CONFLICT)
                last_status = running_daemon.daemon.status_line()
        finally:
            await kubelet.stop()
            await notify.close()
    text = render_doctor(findings)
    print(status["STATUS"], *metrics, text, run.summary(), sep="\n")
    return Said(status["STATUS"], events, metrics, {f.check: f for f in findings}, text, run, conflicts, last_status)


def rt_name(status: dict[str, str]) -> str:
    """The runtime as STATUS names it (``containerd 1.7.24~ds1``)."""
    part = status["STATUS"].split("| cdi: ", 1)[1]
    return " ".join(part.split()[:2])


def assert_said(said: Said, verdict: CdiVerdict, status_end: str, level: Level) -> None:
    assert said.status.endswith(status_end), said.status
    (event,) = said.events
    if verdict is CdiVerdict.APPLIED:
        assert (event.levelname, getattr(event, "ATE_EVENT", "")) == ("INFO", EVENT_RUNTIME)
    else:
        assert (event.levelname, getattr(event, "ATE_EVENT", "")) == ("WARNING", EVENT_NOT_APPLIED)
    assert sum(m.endswith(" 1") for m in said.metrics) == 1
    assert f'verdict="{verdict.value}"}} 1' in "\n".join(said.metrics)
    cdi = said.doctor["runtime cdi"]
    assert cdi.level is level, said.doctor_text
    assert PROMISES[verdict](said.run), said.run.summary()
    # cdi = true: withheld where no container is created; a root VMM opens the host's node without CDI
    assert ("withheld: dir-not-read" in said.last_status) is (verdict is CdiVerdict.DIR_NOT_READ), said.last_status
    for other, promise in PROMISES.items():
        if other is not verdict:
            assert not promise(said.run), (other, said.run.summary())


class TestContainerd17:
    async def test_enable_cdi_true(
        self, containerd_17: ContainerdBuild, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """Applied: STATUS and doctor say so, doctor prints only OK lines, and uid 1000 boots a guest."""
        cdi = [tmp_path / "cdi"]  # the daemon's cdi_dir
        verdict = CdiVerdict.APPLIED
        said = await observe(containerd_17, cri_images, tmp_path, verdict, enable_cdi=True, cdi_spec_dirs=cdi)
        assert_said(said, CdiVerdict.APPLIED, f"applies CDI (reads {tmp_path / 'cdi'})", Level.OK)
        assert all(line.startswith("OK ") for line in said.doctor_text.splitlines()), said.doctor_text

    async def test_enable_cdi_false(
        self, containerd_17: ContainerdBuild, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """Not applied (enable_cdi = false): a warning event, doctor FAILs the runtime, the VMM gets EACCES."""
        said = await observe(containerd_17, cri_images, tmp_path, CdiVerdict.NOT_APPLIED, enable_cdi=False)
        assert_said(said, CdiVerdict.NOT_APPLIED, "ignores CDI (enable_cdi = false)", Level.FAIL)
        assert said.doctor["access ate.dev/kvm"].level is Level.WARN

    async def test_spec_dirs_leave_ours_out(
        self, containerd_17: ContainerdBuild, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """CDI on, but cdi_spec_dirs without the daemon's directory: CreateContainer fails, as predicted."""
        other = tmp_path / "elsewhere"
        said = await observe(
            containerd_17, cri_images, tmp_path, CdiVerdict.DIR_NOT_READ, enable_cdi=True, cdi_spec_dirs=[other]
        )
        assert_said(said, CdiVerdict.DIR_NOT_READ, f"leaves out {tmp_path / 'cdi'})", Level.FAIL)


@pytest.mark.parametrize("config_version", [3, 2])
class TestContainerd21:
    """containerd 2.1 with its own version 3 config, and with a version 2 file (which it migrates)."""

    async def test_cdi_on_by_default(
        self,
        containerd_21: ContainerdBuild,
        cri_images: Images,
        tmp_path: Path,
        closed_kvm: NodeStat,
        config_version: int,
    ) -> None:
        """No enable_cdi in the file: applied, only OK lines from doctor, and uid 1000 boots a guest.
        STATUS names the version as 2.1.9, without the ``+unknown`` the runtime answers."""
        cdi = [tmp_path / "cdi"]
        verdict = CdiVerdict.APPLIED
        said = await observe(
            containerd_21, cri_images, tmp_path, verdict, cdi_spec_dirs=cdi, config_version=config_version
        )
        assert_said(said, verdict, f"applies CDI (reads {tmp_path / 'cdi'})", Level.OK)
        assert all(line.startswith("OK ") for line in said.doctor_text.splitlines()), said.doctor_text
        assert f"| cdi: containerd {containerd_21.version.removesuffix('+unknown')} applies" in said.status
        assert "+unknown" not in said.status + said.doctor_text

    async def test_enable_cdi_false(
        self,
        containerd_21: ContainerdBuild,
        cri_images: Images,
        tmp_path: Path,
        closed_kvm: NodeStat,
        config_version: int,
    ) -> None:
        """Not applied: a warning event, doctor FAILs the runtime, the VMM gets EACCES."""
        verdict = CdiVerdict.NOT_APPLIED
        said = await observe(
            containerd_21, cri_images, tmp_path, verdict, enable_cdi=False, config_version=config_version
        )
        assert_said(said, verdict, "ignores CDI (enable_cdi = false)", Level.FAIL)

    async def test_spec_dirs_leave_ours_out(
        self,
        containerd_21: ContainerdBuild,
        cri_images: Images,
        tmp_path: Path,
        closed_kvm: NodeStat,
        config_version: int,
    ) -> None:
        """CDI on, cdi_spec_dirs without the daemon's directory: CreateContainer fails, as predicted."""
        other = tmp_path / "elsewhere"
        verdict = CdiVerdict.DIR_NOT_READ
        said = await observe(
            containerd_21, cri_images, tmp_path, verdict, cdi_spec_dirs=[other], config_version=config_version
        )
        assert_said(said, verdict, f"leaves out {tmp_path / 'cdi'})", Level.FAIL)


#: A vendor's spec that defines our name too (a valid one: the library loads it).
CONFLICTING_SPEC = {
    "cdiVersion": "0.6.0",
    "kind": "ate.dev/kvm",
    "devices": [{"name": "kvm", "containerEdits": {"deviceNodes": [{"path": "/dev/kvm"}]}}],
}


class TestConflictingSpec:
    @pytest.mark.parametrize("series", ["1.7", "2.1"])
    async def test_same_directory(self, series: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat) -> None:
        """A second spec in our directory that defines ate.dev/kvm=kvm: the verdict is still "applied", but
        containerd drops the name (conflicting device) and creates no container; the daemon warns naming
        the file and says it in STATUS, and doctor FAILs it with the remedy."""
        build = require(series)
        cdi = tmp_path / "cdi"  # the daemon's cdi_dir
        cdi.mkdir()
        other = cdi / "other.json"
        other.write_text(json.dumps(CONFLICTING_SPEC))
        verdict = CdiVerdict.APPLIED
        said = await observe(
            build, cri_images, tmp_path, verdict, metric="spec_conflict", enable_cdi=True, cdi_spec_dirs=[cdi]
        )
        # the first STATUS already says it: the spec directories are read before the daemon serves
        assert f"applies CDI (reads {cdi}) | cdi spec conflict: {other}" in said.status, said.status
        assert "withheld: spec-conflict" in said.status, said.status
        assert said.run.failed_call == "CreateContainer", said.run.summary()
        assert "unresolvable CDI devices ate.dev/kvm=kvm" in said.run.error, said.run.error
        (event,) = said.conflicts
        assert event.levelname == "WARNING"
        assert f"{other} also defines ate.dev/kvm=kvm" in event.getMessage()
        assert said.last_status.endswith(f"| cdi spec conflict: {other} also defines ate.dev/kvm=kvm")
        assert "withheld: spec-conflict" in said.last_status, said.last_status  # no new pod is sent here
        found = said.doctor["cdi specs"]
        assert found.level is Level.FAIL, said.doctor_text
        assert found.remedy.startswith(f"remove {other}"), said.doctor_text


class TestContainerd16:
    async def test_as_it_is(
        self, containerd_16: ContainerdBuild, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """containerd 1.6 has no CDI: not applied, and the VMM gets EACCES."""
        said = await observe(containerd_16, cri_images, tmp_path, CdiVerdict.NOT_APPLIED)
        assert_said(said, CdiVerdict.NOT_APPLIED, "ignores CDI (no CDI before containerd 1.7)", Level.FAIL)


async def follow_restarts(build: ContainerdBuild, tmp_path: Path, starts: list[tuple[bool | None, str]]) -> None:
    """containerd started with each ``enable_cdi`` in turn (``systemctl restart`` with the config changed
    between), nothing else happening: STATUS must say the verdict is kept while it is away once it
    stopped, then end with each start's verdict. The latencies are printed."""
    cdi = tmp_path / "cdi"  # the daemon's cdi_dir
    workdir = tmp_path / "containerd"
    enable, expected = starts[0]
    rt = await Containerd.start(build, workdir, enable_cdi=enable, cdi_spec_dirs=[cdi])
    config, _ = daemon_config(tmp_path, rt.socket)
    notify = NotifyReceiver(tmp_path / "notify")
    gone: list[float] = []
    back: list[float] = []
    try:
        async with daemon_in_process(config, UdevKernelView(), notify=notify.path):
            await notify.wait_for(lambda f: f.get("STATUS", "").endswith(expected), timeout=30)
            for enable, expected in starts[1:]:
                notify.forget()
                began = time.monotonic()
                await rt.stop()
                at, _ = await notify.wait_stamped(
                    lambda f: "; kept while the runtime is away (its socket " in f.get("STATUS", ""), timeout=30
                )
                gone.append(at - began)
                notify.forget()
                began = time.monotonic()
                rt = await Containerd.start(build, workdir, enable_cdi=enable, cdi_spec_dirs=[cdi])
                at, status = await notify.wait_stamped(
                    lambda f, end=expected: f.get("STATUS", "").endswith(end), timeout=30
                )
                back.append(at - began)
                print(status["STATUS"])
    finally:
        await rt.stop()
        await notify.close()
    ms = lambda values: ", ".join(f"{1000 * v:.0f}" for v in values)  # noqa: E731
    print(f"containerd {build.version}: STATUS away {ms(gone)} ms after SIGTERM; verdict {ms(back)} ms after start")


class TestFollowsRestarts:
    async def test_containerd_17_enable_cdi_toggled(self, containerd_17: ContainerdBuild, tmp_path: Path) -> None:
        """containerd 1.7 restarted with enable_cdi off, on, off: STATUS follows each start."""
        cdi = tmp_path / "cdi"
        off, on = "ignores CDI (enable_cdi = false)", f"applies CDI (reads {cdi})"
        await follow_restarts(containerd_17, tmp_path, [(False, off), (True, on), (False, off), (True, on)])

    async def test_containerd_16_restarted(self, containerd_16: ContainerdBuild, tmp_path: Path) -> None:
        """containerd 1.6 restarted: unknown while it is down, its verdict again once it is back."""
        verdict = "ignores CDI (no CDI before containerd 1.7)"
        await follow_restarts(containerd_16, tmp_path, [(None, verdict)] * 3)


class TestOurSpecRemoved:
    @pytest.mark.parametrize("series", ["1.7", "2.1"])
    async def test_written_back_and_a_pod_still_gets_the_device(
        self, series: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """Our spec removed while containerd applies CDI: written back at once (one cdi-spec-restored
        warning, counted); kubelet's allocatable never drops; a pod then run with the daemon's Allocate
        answer gets a working /dev/kvm as uid 1000 (a guest boots), not "unresolvable CDI devices"."""
        build = require(series)
        cdi = tmp_path / "cdi"
        cdi.mkdir()
        run_with = {"images": [cri_images.pause, cri_images.checker], "enable_cdi": True, "cdi_spec_dirs": [cdi]}
        async with running(build, tmp_path / "containerd", **run_with) as rt:
            config, _ = daemon_config(tmp_path, rt.socket)
            kubelet: FakeKubelet = await started_kubelet(Path(config.plugin_dir))
            try:
                async with daemon_in_process(config, UdevKernelView()) as running_daemon:
                    await kubelet.next_event("list")
                    spec = cdi / "ate.dev-kvm.json"
                    written = spec.read_bytes()
                    spec.unlink()
                    record = await running_daemon.events.wait_for(EVENT_RESTORED, timeout=10)
                    assert "was removed" in record.getMessage() and spec.read_bytes() == written
                    prom = Path(config.metrics_file)
                    await wait_for_content(prom, f'ate_devplugd_cdi_spec_rewrites_total{{resource="{RESOURCE}"}} 1')
                    (response,) = (await kubelet.allocate(RESOURCE, ["kvm-0"])).container_responses
                    run = await run_allocated(rt, KvmAllocation(response, Path(config.cdi_dir)))
                    print(run.summary())
                    assert PROMISES[CdiVerdict.APPLIED](run), run.summary()
                    seen = kubelet.drain()
                    assert all(ev.healthy == 4096 for ev in seen if ev.kind == "list"), seen
                    assert kubelet.allocatable(RESOURCE) == 4096
            finally:
                await kubelet.stop()
