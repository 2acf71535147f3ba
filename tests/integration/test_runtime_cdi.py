"""The daemon asks the runtime whether it applies CDI: STATUS, one journal event, the metric.

A fake runtime (``tests/fakes/cri.py``) answers on a real unix socket with recorded or rule-built
answers; the daemon runs on the test's loop with the fake kernel and kubelet. No root needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from pathlib import Path

from ate_devplugd.config import Config
from ate_devplugd.cri.check import EVENT_NOT_APPLIED, EVENT_RUNTIME, FIRST_VERDICT, RuntimeCheck
from ate_devplugd.cri.endpoint import Source
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport
from tests.fakes.cri import FakeRuntime, containerd_info, recorded
from tests.support import (
    FakeKernel,
    NotifyReceiver,
    daemon_in_process,
    kvm_config,
    started_kubelet,
    wait_for_content,
)

KVM_READY = "ate.dev/kvm: 4096/4096 healthy, waiting for kubelet"


def cdi_config(plugin_dir: Path, fake_root: Path, tmp_path: Path, **top: str) -> Config:
    config = kvm_config(plugin_dir, fake_root, cdi=True, container_mode=0o666)
    return dataclasses.replace(config, runtime_socket=str(tmp_path / "runtime.sock"), **top)


def metric_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("ate_devplugd_runtime_cdi")]


class TestVerdictShown:
    async def test_enable_cdi_false(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """containerd 1.7 with CDI off (its recorded answer): STATUS, one warning event, asked again on reload."""
        runtime = await FakeRuntime(tmp_path / "runtime.sock", *recorded("containerd-1.7.24-cdi-off")).start()
        notify = NotifyReceiver(tmp_path / "notify")
        prom = tmp_path / "m.prom"
        config = dataclasses.replace(cdi_config(plugin_dir, fake_root, tmp_path), metrics_file=str(prom))
        try:
            async with daemon_in_process(config, kernel, notify=notify.path) as running:
                want = f"{KVM_READY} | cdi: containerd 1.7.24~ds1 ignores CDI (enable_cdi = false)"
                await notify.wait_for(lambda f: f.get("STATUS") == want)
                event = await running.events.wait_for(EVENT_NOT_APPLIED)
                assert event.levelname == "WARNING"
                assert "non-root VMM gets EACCES" in event.getMessage()
                await running.daemon.reload()
                await runtime.wait_for_calls("Status", 2)  # asked again on reload
                await running.stop()
            assert len(running.events.named(EVENT_NOT_APPLIED)) == 1  # the same verdict is not logged again
        finally:
            await runtime.stop()
            await notify.close()

    async def test_metric(self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """One series per verdict (the runtime's, then what stops our names from resolving), 1 for the
        current one, with the runtime named."""
        cdi = str(plugin_dir.parent / "cdi")
        answer = containerd_info(True, ["/etc/cdi", cdi])
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "v1.7.24", answer).start()
        prom = tmp_path / "m.prom"
        config = dataclasses.replace(cdi_config(plugin_dir, fake_root, tmp_path), metrics_file=str(prom))
        try:
            async with daemon_in_process(config, kernel):
                await wait_for_content(
                    prom, 'ate_devplugd_runtime_cdi{runtime="containerd 1.7.24",verdict="applied"} 1'
                )
                assert metric_lines(prom) == [
                    f'ate_devplugd_runtime_cdi{{runtime="containerd 1.7.24",verdict="{verdict}"}} {value}'
                    for verdict, value in (
                        ("applied", "1"),
                        ("not_applied", "0"),
                        ("dir_not_read", "0"),
                        ("unknown", "0"),
                        ("spec_dir_replaced", "0"),
                        ("spec_conflict", "0"),
                        ("spec_invalid", "0"),
                        ("spec_replaced", "0"),
                        ("spec_missing", "0"),
                    )
                ]
        finally:
            await runtime.stop()

    async def test_kubelet_start_asks_again(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A runtime reconfigured together with a kubelet restart: the new verdict follows the new kubelet.sock."""
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24", containerd_info(False)).start()
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            async with daemon_in_process(cdi_config(plugin_dir, fake_root, tmp_path), kernel, notify=notify.path):
                await notify.wait_for(lambda f: "ignores CDI" in f.get("STATUS", ""))
                runtime.answer = ("containerd", "1.7.24", containerd_info(True, [str(plugin_dir.parent / "cdi")]))
                kubelet = await started_kubelet(plugin_dir)
                try:
                    await notify.wait_for(
                        lambda f: f.get("STATUS", "").endswith(
                            f"| cdi: containerd 1.7.24 applies CDI (reads {plugin_dir.parent / 'cdi'})"
                        )
                    )
                finally:
                    await kubelet.stop()
        finally:
            await runtime.stop()
            await notify.close()


class TestNeverInTheWay:
    async def test_absent_runtime_is_unknown_once(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """No socket: unknown, logged once at info however often the daemon asks."""
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            async with daemon_in_process(
                cdi_config(plugin_dir, fake_root, tmp_path), kernel, notify=notify.path
            ) as running:
                event = await running.events.wait_for(EVENT_RUNTIME)
                assert event.levelname == "INFO"
                assert "no runtime socket at" in event.getMessage()
                await running.daemon.reload()
                await running.daemon.reload()
                await notify.wait_for(lambda f: "cdi: unknown whether CDI is applied" in f.get("STATUS", ""))
                await running.stop()
            assert len(running.events.named(EVENT_RUNTIME)) == 1
            assert not running.events.named(EVENT_NOT_APPLIED)
        finally:
            await notify.close()

    async def test_hung_runtime_delays_nothing(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A runtime that never answers holds the start for FIRST_VERDICT at most: READY, registration and
        Allocate go on, and STATUS says that no runtime has answered since the start."""
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24", containerd_info(True)).start()
        runtime.hang = True
        notify = NotifyReceiver(tmp_path / "notify")
        kubelet = await started_kubelet(plugin_dir)
        try:
            began = time.monotonic()
            async with daemon_in_process(cdi_config(plugin_dir, fake_root, tmp_path), kernel, notify=notify.path):
                await notify.wait_for(lambda f: "READY" in f)
                await kubelet.next_event("register")
                took = time.monotonic() - began
                assert FIRST_VERDICT <= took < FIRST_VERDICT + 2.0, took
                response = await kubelet.allocate("ate.dev/kvm", ["kvm-1"])
                assert [d.name for d in response.container_responses[0].cdi_devices] == ["ate.dev/kvm=kvm"]
                assert runtime.calls == ["Version"]
                status = await notify.wait_for(lambda f: f.get("STATUS", "").endswith("within 1.5 s)"))
                assert (
                    "| cdi: unknown whether CDI is applied (no runtime has answered since the start: it did"
                    in (status["STATUS"])
                )
        finally:
            await kubelet.stop()
            await runtime.stop()
            await notify.close()

    async def test_no_cdi_no_question(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Without a CDI resource (device-plugin mode) the runtime is not asked and nothing is shown."""
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24", containerd_info(False)).start()
        notify = NotifyReceiver(tmp_path / "notify")
        config = dataclasses.replace(kvm_config(plugin_dir, fake_root), runtime_socket=str(runtime.socket))
        try:
            async with daemon_in_process(config, kernel, notify=notify.path) as running:
                ready = await notify.wait_for(lambda f: "READY" in f)
                assert ready["STATUS"] == KVM_READY
                await running.daemon.reload()
                assert runtime.calls == []
        finally:
            await runtime.stop()
            await notify.close()


async def restarted(runtime: FakeRuntime, enable_cdi: bool, spec_dirs: list[str]) -> FakeRuntime:
    """The runtime stopped and started again as containerd is (``systemctl restart``): it removes its socket
    as it stops, and removes a stale one, then binds anew, as it starts; the new one has ``enable_cdi``."""
    await stopped(runtime)
    return await started(runtime.socket, enable_cdi, spec_dirs)


async def stopped(runtime: FakeRuntime) -> None:
    await runtime.stop()
    with contextlib.suppress(FileNotFoundError):
        runtime.socket.unlink()


async def started(socket: Path, enable_cdi: bool, spec_dirs: list[str]) -> FakeRuntime:
    with contextlib.suppress(FileNotFoundError):
        socket.unlink()
    return await FakeRuntime(socket, "containerd", "1.7.24", containerd_info(enable_cdi, spec_dirs)).start()


def verdict_line(verdict: str, runtime: str = "containerd 1.7.24") -> str:
    return f'ate_devplugd_runtime_cdi{{runtime="{runtime}",verdict="{verdict}"}} 1'


class TestFollowsTheRuntime:
    """The verdict follows the runtime's socket (inotify on its directory): kept, marked away, as soon as it
    goes, asked again when it is created, with nothing else (no reload, no kubelet) happening."""

    async def test_restarts_with_enable_cdi_toggled(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Each restart with enable_cdi toggled: STATUS says the verdict is kept once the socket is gone (the
        metric keeps it), then the new verdict once it is back; one question per start. The latencies are
        printed."""
        cdi = [str(plugin_dir.parent / "cdi")]
        socket = tmp_path / "runtime.sock"
        runtime = await started(socket, False, cdi)
        notify = NotifyReceiver(tmp_path / "notify")
        prom = tmp_path / "m.prom"
        config = dataclasses.replace(cdi_config(plugin_dir, fake_root, tmp_path), metrics_file=str(prom))
        gone: list[float] = []
        back: list[float] = []
        files: list[float] = []
        try:
            async with daemon_in_process(config, kernel, notify=notify.path) as running:
                await notify.wait_for(lambda f: "cdi: containerd 1.7.24 ignores CDI" in f.get("STATUS", ""))
                await wait_for_content(prom, verdict_line("not_applied"))
                for enable in (True, False, True, False):
                    asked = runtime.calls.count("Version")
                    notify.forget()
                    began = time.monotonic()
                    kept = "applies CDI" if not enable else "ignores CDI"
                    await stopped(runtime)
                    at, _ = await notify.wait_stamped(
                        lambda f, kept=kept: (
                            f"{kept} (" in f.get("STATUS", "")
                            and "; kept while the runtime is away (its socket " in f.get("STATUS", "")
                        )
                    )
                    assert verdict_line("applied" if not enable else "not_applied") in prom.read_text()
                    gone.append(at - began)
                    notify.forget()
                    began = time.monotonic()
                    runtime = await started(socket, enable, cdi)
                    said = "cdi: containerd 1.7.24 " + ("applies CDI" if enable else "ignores CDI")
                    at, _ = await notify.wait_stamped(lambda f, said=said: said in f.get("STATUS", ""))
                    await wait_for_content(prom, verdict_line("applied" if enable else "not_applied"))
                    files.append(time.monotonic() - began)
                    back.append(at - began)
                    assert runtime.calls.count("Version") == 1, (asked, runtime.calls)
                # one journal line per verdict change, the gone runtime's at info
                assert len(running.events.named(EVENT_NOT_APPLIED)) == 3
        finally:
            await runtime.stop()
            await notify.close()
        print(f"STATUS away after the socket went: {fmt(gone)}; new verdict after it came back: {fmt(back)}")
        print(f"metrics file seen following: {fmt(files)}")
        assert max(gone) < 2.0 and max(back) < 2.0 and max(files) < 3.0, (gone, back, files)

    async def test_restart_in_one_burst_is_one_question(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Socket removed and created again at once (and a ttrpc socket beside it, as containerd has): one
        question to the new runtime, and its verdict shown."""
        cdi = [str(plugin_dir.parent / "cdi")]
        socket = tmp_path / "runtime.sock"
        runtime = await started(socket, False, cdi)
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            async with daemon_in_process(cdi_config(plugin_dir, fake_root, tmp_path), kernel, notify=notify.path):
                await notify.wait_for(lambda f: "ignores CDI" in f.get("STATUS", ""))
                old = runtime
                runtime = FakeRuntime(socket, "containerd", "1.7.24", containerd_info(True, cdi))
                began = time.monotonic()
                socket.unlink()  # the old server still holds its listening socket: no window without one
                await runtime.start()
                (tmp_path / "runtime.sock.ttrpc").touch()
                at, _ = await notify.wait_stamped(lambda f: "applies CDI" in f.get("STATUS", ""))
                print(f"new verdict {1000 * (at - began):.1f} ms after the socket was re-created")
                assert runtime.calls == ["Version", "Status"]
                await old.stop()
        finally:
            await runtime.stop()
            await notify.close()

    async def test_runtime_not_initialized_yet(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A runtime that serves its socket before it can answer (containerd's CRI service initializes
        after the socket is there; no event marks that moment): unknown at first, then, with nothing else
        happening, its verdict once it answers. How many errors it gives first is varied (seeded)."""
        cdi = [str(plugin_dir.parent / "cdi")]
        socket = tmp_path / "runtime.sock"
        runtime = await started(socket, False, cdi)
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            async with daemon_in_process(cdi_config(plugin_dir, fake_root, tmp_path), kernel, notify=notify.path):
                await notify.wait_for(lambda f: "ignores CDI" in f.get("STATUS", ""))
                for errors in random.Random(7).sample(range(1, 6), 3):
                    await stopped(runtime)
                    await notify.wait_for(lambda f: "no runtime socket at" in f.get("STATUS", ""))
                    runtime = FakeRuntime(socket, "containerd", "1.7.24", containerd_info(True, cdi))
                    runtime.not_ready = errors
                    began = time.monotonic()
                    await runtime.start()
                    await notify.wait_for(lambda f: "server is not initialized yet" in f.get("STATUS", ""))
                    at, _ = await notify.wait_stamped(lambda f: "applies CDI" in f.get("STATUS", ""), timeout=60)
                    print(f"{errors} error(s), then the verdict {1000 * (at - began):.0f} ms after the socket")
                    assert runtime.calls.count("Version") == errors + 1, runtime.calls
                    await stopped(runtime)
                    runtime = await started(socket, False, cdi)
                    await notify.wait_for(lambda f: "ignores CDI" in f.get("STATUS", ""))
        finally:
            await runtime.stop()
            await notify.close()

    async def test_socket_directory_created_later(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """runtime_socket in a directory that does not exist yet (containerd installed after the daemon
        started): unknown, then the verdict once the directory and the socket appear."""
        socket = tmp_path / "run" / "containerd" / "containerd.sock"
        config = dataclasses.replace(cdi_config(plugin_dir, fake_root, tmp_path), runtime_socket=str(socket))
        notify = NotifyReceiver(tmp_path / "notify")
        runtime: FakeRuntime | None = None
        try:
            async with daemon_in_process(config, kernel, notify=notify.path):
                await notify.wait_for(
                    lambda f: (
                        "cdi: unknown whether CDI is applied (no runtime has answered since the start: no runtime "
                        f"socket at {socket})" in f.get("STATUS", "")
                    )
                )
                socket.parent.mkdir(parents=True)
                runtime = await started(socket, False, [str(plugin_dir.parent / "cdi")])
                await notify.wait_for(lambda f: "cdi: containerd 1.7.24 ignores CDI" in f.get("STATUS", ""))
        finally:
            if runtime is not None:
                await runtime.stop()
            await notify.close()


def fmt(seconds: list[float]) -> str:
    return ", ".join(f"{1000 * s:.1f}" for s in seconds) + " ms"


class TestKubeletsRuntime:
    async def test_follows_the_socket_kubelet_names(self, tmp_path: Path) -> None:
        """No runtime_socket: the socket of kubelet's --container-runtime-endpoint (found in a fake /proc),
        not a usual one, is asked and followed through a restart."""
        cdi = [str(tmp_path / "cdi")]
        socket = tmp_path / "k3s" / "containerd.sock"
        socket.parent.mkdir()
        proc = tmp_path / "proc"
        (proc / "77").mkdir(parents=True)
        (proc / "77" / "comm").write_text("kubelet\n")
        (proc / "77" / "cmdline").write_bytes(b"kubelet\0--container-runtime-endpoint=unix://%s\0" % bytes(socket))
        (proc / "77" / "cwd").symlink_to(tmp_path)
        runtime = await started(socket, False, cdi)
        reports: list[RuntimeReport | None] = []
        changed = asyncio.Event()

        def on_report(report: RuntimeReport | None) -> None:
            reports.append(report)
            changed.set()

        async def verdict(want: CdiVerdict) -> RuntimeReport:
            async with asyncio.timeout(10):
                while not (reports and reports[-1] is not None and reports[-1].verdict is want):
                    changed.clear()
                    await changed.wait()
            report = reports[-1]
            assert report is not None
            return report

        check = RuntimeCheck(on_report, proc_root=str(proc))
        try:
            check.start(socket="", cdi_dir=cdi[0], mode="device-plugin", enabled=True)
            assert check.endpoint is not None and check.endpoint.source is Source.KUBELET_FLAG
            assert check.watched == (str(socket),)
            report = await verdict(CdiVerdict.NOT_APPLIED)
            assert report.socket == str(socket)
            runtime = await restarted(runtime, True, cdi)
            await verdict(CdiVerdict.APPLIED)
        finally:
            await check.close()
            await runtime.stop()
