"""Advertised means usable at every moment, against real containerd 1.7 and 2.1: every ListAndWatch
answer the fake kubelet gets, the first included, beside what a uid-1000 VMM in a container created
through CRI gets at that moment (tests.runtimes.containerd: RunPodSandbox, CreateContainer with the
daemon's DeviceSpec and CDI name, StartContainer; the checker opens /dev/kvm and boots a guest).

Each test is a sequence of moments, each begun by a change the test makes (the first: the daemon's
start). A moment holds the answers kubelet got from its change to the next one and what a container got
once the daemon had heard of the change. The rule at every moment (``Moments.check``): an answer that
offers a Healthy unit is only ever beside a container that boots its guest, and a container that does
not (EACCES, no container at all) is only ever beside answers that offer none. The moments:

- the start against a runtime that ignores CDI, ``cdi = "required"``: the first answer withholds;
- the runtime away for seconds (stopped, then started with the same config): no answer offers;
- our spec that cannot be written back (the filesystem of ``cdi_dir`` full, or a file at ``cdi_dir``):
  withheld, with the cause; ``doctor`` FAILs it and the metrics say ``spec_missing``; offered again the
  moment it is written, with no reload;
- ``cdi_dir`` replaced (``mv`` away, or two renames): containerd's CDI cache follows the old directory
  (the library's fsnotify watch on it: docs/cdi-runtimes.md), so withheld until it restarts; ``doctor``
  says to restart it;
- a later directory's spec for our name: offered where its node (no owner, mode 0600) is the VMM's,
  withheld where it is root's.

They need root and containerd; they skip without them (``make runtimes`` provides both series).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Finding, Level
from ate_devplugd.config import Config, render
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.cri.facts import CdiVerdict
from ate_devplugd.cri.usable import EVENT_OFFERED, EVENT_WITHHELD, HOLD
from ate_devplugd.node.kernel import UdevKernelView
from tests.fakes.kubelet import FakeKubelet
from tests.integration.test_runtime_cdi_containerd import PROMISES, kubelet_binary
from tests.podman import NodeStat
from tests.runtimes.containerd import CheckerRun, Containerd, ContainerdBuild, Images, require, run_allocated
from tests.support import RESOURCE, DaemonInProcess, KvmAllocation, daemon_in_process, started_kubelet, wait_for_content

#: From what the daemon hears to what kubelet is offered: the hold, and room for a shared machine.
BOUND = HOLD + 2.0
#: How long the runtime is away.
AWAY = 3.0
SERIES = pytest.mark.parametrize("series", ["1.7", "2.1"])


def works(run: CheckerRun | None) -> bool:
    return run is not None and PROMISES[CdiVerdict.APPLIED](run)


def outcome(run: CheckerRun | None) -> str:
    if run is None:
        return "no container: the runtime is away"
    if run.check is None:
        return f"{run.failed_call} failed: {run.error}"
    if works(run):
        return "the guest boots"
    return f"open {run.check.open_error}"


@dataclasses.dataclass
class Moment:
    what: str
    #: The Healthy units of each answer kubelet got from this moment's change to the next, and of the
    #: answer it held (its allocatable) while the container was created.
    answers: list[int]
    run: CheckerRun | None
    held: list[int] = dataclasses.field(default_factory=list)


class Moments:
    """One containerd, the daemon on the host's /dev/kvm beside a fake kubelet, and the moments seen."""

    def __init__(self, build: ContainerdBuild, images: Images, tmp_path: Path) -> None:
        self.build, self.images, self.tmp = build, images, tmp_path
        self.workdir = tmp_path / "containerd"
        self.cdi = tmp_path / "cdi"
        self.rt: Containerd | None = None
        self.kubelet: FakeKubelet | None = None
        self.running: DaemonInProcess | None = None
        self.config: Config | None = None
        self.config_path = tmp_path / "config.toml"
        self.moments: list[Moment] = []
        self._what = "the daemon's start"
        self._mark = 0
        self._changed_at = time.monotonic()

    async def start_runtime(self, **cri: Any) -> Containerd:
        images = [self.images.pause, self.images.checker] if self.rt is None else []
        self.rt = await Containerd.start(self.build, self.workdir, images=images, **cri)
        return self.rt

    async def stop_runtime(self) -> None:
        assert self.rt is not None
        await self.rt.stop()

    @contextlib.asynccontextmanager
    async def daemon(self, **device: Any) -> AsyncIterator[DaemonInProcess]:
        assert self.rt is not None
        plugin_dir = self.tmp / "device-plugins"
        plugin_dir.mkdir()
        prom = self.tmp / "metrics" / "ate-devplugd.prom"
        prom.parent.mkdir()
        self.config = Config(
            plugin_dir=str(plugin_dir),
            dev_root="/",
            cdi_dir=str(self.cdi),
            metrics_file=str(prom),
            runtime_socket=str(self.rt.socket),
            devices=(DeviceConfig(RESOURCE, "/dev/kvm", cdi=True, **device),),
        )
        self.config_path.write_text(render(self.config))
        self.kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(self.config, UdevKernelView()) as running:
                self.running = running
                yield running
        finally:
            await self.kubelet.stop()

    def change(self, what: str) -> None:
        """A change the test makes now: the answers from here on are the next moment's."""
        assert self.kubelet is not None
        self._close(None)
        self._what, self._mark = what, len(self.kubelet.history)
        self._changed_at = time.monotonic()

    async def container(self) -> CheckerRun | None:
        """What a uid-1000 VMM gets now, in a container created through CRI with the daemon's grant; the
        moment so far recorded with it."""
        assert self.rt is not None and self.config is not None and self.kubelet is not None
        before = self.kubelet.allocatable(RESOURCE)
        run = await run_allocated(self.rt, KvmAllocation.granted(Path(self.config.cdi_dir)))
        print(f"  {self._what}: {outcome(run)}; {run.summary()}")
        self._close(run)
        self.moments[-1].held = [before, self.kubelet.allocatable(RESOURCE)]
        return run

    def away(self) -> None:
        """While the runtime is away, no container is created at all."""
        self._close(None, ran=True)

    def _close(self, run: CheckerRun | None, *, ran: bool = False) -> None:
        assert self.kubelet is not None
        answers = [
            ev.healthy for ev in self.kubelet.history[self._mark :] if ev.kind == "list" and ev.resource == RESOURCE
        ]
        if run is not None or ran:
            self.moments.append(Moment(self._what, answers, run))
        elif answers and (not self.moments or self.moments[-1].what != self._what):
            self.moments.append(Moment(self._what, answers, self.moments[-1].run if self.moments else None))
        elif answers:
            self.moments[-1].answers += answers
        self._mark = len(self.kubelet.history)

    async def offered(self, want: int, timeout: float = BOUND) -> float:
        """Seconds until kubelet's latest answer offers ``want`` Healthy units."""
        assert self.kubelet is not None
        began = time.monotonic()
        while self.kubelet.allocatable(RESOURCE) != want:
            await self.kubelet.next_event("list", resource=RESOURCE, timeout=timeout)
        print(f"  {self._what}: kubelet offers {want} {1000 * (time.monotonic() - self._changed_at):.0f} ms after it")
        return time.monotonic() - began

    async def listen(self, seconds: float) -> None:
        """Every answer kubelet gets for ``seconds`` (recorded in its history)."""
        assert self.kubelet is not None
        with contextlib.suppress(TimeoutError):
            while True:
                await self.kubelet.next_event("list", resource=RESOURCE, timeout=seconds)

    async def doctor(self) -> dict[str, Finding]:
        findings = await examine(
            self.config_path, Node(kernel=UdevKernelView(), find_kubelet=lambda: str(kubelet_binary(self.tmp)))
        )
        return {f.check: f for f in findings}

    def check(self) -> None:
        """Every answer beside what a container got at its moment: printed, then the rule."""
        for m in self.moments:
            print(
                f"{self.build.version}: {m.what}: answers {m.answers or '-'} (kubelet held {m.held or '-'}); "
                f"a uid-1000 VMM: {outcome(m.run)}"
            )
        for m in self.moments:
            offered = m.answers + m.held
            if any(offered):
                assert works(m.run), f"{m.what}: offered {offered}, but {outcome(m.run)}"
            if not works(m.run):
                assert not any(offered), f"{m.what}: {outcome(m.run)}, but offered {offered}"

    async def close(self) -> None:
        if self.rt is not None:
            await self.rt.stop()


@contextlib.asynccontextmanager
async def moments(series: str, images: Images, tmp_path: Path) -> AsyncIterator[Moments]:
    rig = Moments(require(series), images, tmp_path)
    try:
        yield rig
    finally:
        await rig.close()


@contextlib.contextmanager
def tmpfs(directory: Path, size: str = "16k") -> Iterator[Path]:
    """``directory`` a small tmpfs of its own (mounted before containerd starts, so that its private mount
    namespace holds the same filesystem), unmounted at the end."""
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def fill(directory: Path) -> Path:
    """Fill ``directory``'s filesystem (a file named ``filler``, not a spec), to ENOSPC."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * 1024)
    finally:
        os.close(fd)
    return filler


@SERIES
class TestMoments:
    async def test_the_start_against_a_runtime_that_ignores_cdi(
        self, series: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """enable_cdi = false, cdi = "required": the first answer already withholds every unit."""
        async with moments(series, cri_images, tmp_path) as rig:
            await rig.start_runtime(enable_cdi=False, cdi_spec_dirs=[rig.cdi])
            began = time.monotonic()
            async with rig.daemon(cdi_required=True) as running:
                assert rig.kubelet is not None
                first = await rig.kubelet.next_event("list", resource=RESOURCE)
                print(f"first answer {1000 * (first.t - began):.0f} ms after the start: {first.healthy} Healthy")
                assert (first.healthy, first.total) == (0, 4096)
                assert "withheld: cdi-not-applied" in running.daemon.status_line()
                await rig.container()
            rig.check()

    async def test_the_runtime_away_for_seconds(
        self, series: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """enable_cdi = false, cdi = "required": containerd stopped for seconds, then started with the same
        config: its verdict is kept meanwhile, and no answer offers a unit."""
        async with moments(series, cri_images, tmp_path) as rig:
            await rig.start_runtime(enable_cdi=False, cdi_spec_dirs=[rig.cdi])
            async with rig.daemon(cdi_required=True) as running:
                await rig.container()
                rig.change("containerd stopped")
                await rig.stop_runtime()
                await running.events.wait_for("cdi-runtime-away")
                assert "kept while the runtime is away" in running.daemon.status_line()
                await rig.listen(AWAY)
                rig.away()
                rig.change("containerd started again, enable_cdi = false")
                await rig.start_runtime(enable_cdi=False, cdi_spec_dirs=[rig.cdi])
                await running.events.wait_for("cdi-not-applied")
                await rig.listen(HOLD + 0.5)
                await rig.container()
                assert not running.events.named(EVENT_OFFERED)
            rig.check()

    @pytest.mark.parametrize("cause", ["full", "file"])
    async def test_a_spec_that_cannot_be_written_back(
        self, series: str, cause: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """cdi = "required", CDI on: our spec broken on disk with its filesystem full (or cdi_dir made a
        file): the write-back fails, so the device is withheld (spec-missing, with the cause), doctor FAILs
        it and the metrics say spec_missing; the space freed (the file removed): offered again, no reload."""
        with contextlib.ExitStack() as stack:
            async with moments(series, cri_images, tmp_path) as rig:
                if cause == "full":
                    stack.enter_context(tmpfs(rig.cdi))
                await rig.start_runtime(enable_cdi=True, cdi_spec_dirs=[rig.cdi])
                async with rig.daemon(cdi_required=True) as running:
                    assert rig.config is not None
                    await rig.offered(4096)
                    await rig.container()
                    spec = rig.cdi / "ate.dev-kvm.json"
                    if cause == "full":
                        rig.change("our spec broken, its filesystem full")
                        filler = fill(rig.cdi)
                        spec.write_text("{}")
                        why = "No space left on device"
                    else:
                        rig.change(f"{rig.cdi} made a file")
                        shutil.rmtree(rig.cdi)
                        rig.cdi.write_text("")
                        why = f"{rig.cdi} is not a directory"
                    event = await running.events.wait_for(EVENT_WITHHELD)
                    assert "(spec-missing)" in event.getMessage() and why in event.getMessage(), event.getMessage()
                    await rig.offered(0)
                    prom = Path(rig.config.metrics_file)
                    await wait_for_content(prom, 'verdict="spec_missing"} 1')
                    await wait_for_content(prom, 'ate_devplugd_device_withheld{reason="spec-missing",')
                    found = await rig.doctor()
                    assert found["withheld ate.dev/kvm"].level is Level.FAIL
                    specs = [f for c, f in found.items() if c == "cdi specs"]
                    print(*(f"  doctor: {f.level.value} {f.message} -- {f.remedy}" for f in found.values()), sep="\n")
                    assert specs and any(f.level is Level.FAIL for f in specs)
                    await rig.container()
                    rig.change("the space freed" if cause == "full" else "the file removed")
                    began = time.monotonic()
                    if cause == "full":
                        filler.unlink()
                    else:
                        rig.cdi.unlink()
                    took = await rig.offered(4096, timeout=BOUND + 2.0)
                    print(f"offered again {1000 * (time.monotonic() - began):.0f} ms after ({took:.2f} s)")
                    await rig.container()
                rig.check()

    @pytest.mark.parametrize("how", ["mv", "two renames"])
    async def test_a_replaced_spec_directory(
        self, series: str, how: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """cdi_dir renamed away (or swapped by two renames): our spec is in the new one at once, but the
        runtime's CDI cache follows the old directory: withheld (spec-dir-replaced), doctor says to restart
        the runtime; restarted, it reads the new one: offered."""
        async with moments(series, cri_images, tmp_path) as rig:
            rig.cdi.mkdir()
            await rig.start_runtime(enable_cdi=True, cdi_spec_dirs=[rig.cdi])
            async with rig.daemon() as running:
                await rig.offered(4096)
                await rig.container()
                rig.change(f"{rig.cdi} replaced ({how})")
                if how == "mv":
                    rig.cdi.rename(tmp_path / "cdi.old")
                else:
                    new = tmp_path / "cdi.new"
                    new.mkdir()
                    rig.cdi.rename(tmp_path / "cdi.old")
                    new.rename(rig.cdi)
                await running.events.wait_for("cdi-dir-replaced")
                await rig.offered(0)
                assert "withheld: spec-dir-replaced" in running.daemon.status_line()
                await rig.listen(2.0)  # the runtime's cache, a few seconds on
                await rig.container()
                found = await rig.doctor()
                withheld = found["withheld ate.dev/kvm"]
                assert withheld.level is Level.FAIL and "restart the container runtime" in withheld.remedy
                rig.change("containerd restarted")
                await rig.stop_runtime()
                await rig.start_runtime(enable_cdi=True, cdi_spec_dirs=[rig.cdi])
                await rig.offered(4096)
                await rig.container()
            rig.check()

    @pytest.mark.parametrize("owner", ["none", "root"])
    async def test_a_replacing_spec_judged_by_its_node(
        self, series: str, owner: str, cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
    ) -> None:
        """A later directory's spec for our name, its node mode 0600: with no owner the runtime gives it to
        the container's user, whose VMM opens it (offered); owned by root it cannot (withheld)."""
        async with moments(series, cri_images, tmp_path) as rig:
            later = tmp_path / "later"
            later.mkdir()
            rig.cdi.mkdir()
            await rig.start_runtime(enable_cdi=True, cdi_spec_dirs=[rig.cdi, later])
            async with rig.daemon(cdi_required=True) as running:
                await rig.offered(4096)
                await rig.container()
                node: dict[str, Any] = {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232, "fileMode": 0o600}
                if owner == "root":
                    node.update(uid=0, gid=0)
                devices = [{"name": "kvm", "containerEdits": {"deviceNodes": [node]}}]
                rig.change(f"a later directory's spec, mode 0600, owner {owner}")
                (later / "other.json").write_text(
                    json.dumps({"cdiVersion": "0.6.0", "kind": RESOURCE, "devices": devices})
                )
                if owner == "root":
                    await running.events.wait_for(EVENT_WITHHELD)
                    await rig.offered(0)
                else:
                    await running.events.wait_for("cdi-conflict")  # its warning: it replaces ours
                    await rig.listen(HOLD + 0.5)
                    assert rig.kubelet is not None and rig.kubelet.allocatable(RESOURCE) == 4096
                run = await rig.container()
                assert works(run) is (owner == "none"), outcome(run)
            rig.check()
