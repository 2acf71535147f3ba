"""The metrics file as its real readers see it: Debian's prometheus-node-exporter (textfile collector
only, on 127.0.0.1) scraped over HTTP, and promtool on the written file and on the shipped alert rules.

Skipped where the tools are not installed, failed instead with ATE_REQUIRE_PROMETHEUS_TOOLS=1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ate_devplugd import __version__
from ate_devplugd.cri.facts import CdiVerdict
from ate_devplugd.signals.metrics import Metrics
from ate_devplugd.signals.textfile import TextfileWriter
from tests.integration.dra_rig import DRIVER, dra_node
from tests.prometheus_tools import NodeExporter, node_exporter, promtool, sample, watching
from tests.support import (
    FakeKernel,
    FakeMonitor,
    daemon,
    daemon_in_process,
    kvm_config,
    kvm_uevent,
    make_kvm_node,
    started_kubelet,
    wait_for_content,
    write_config,
)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "ate-devplugd.rules.yml"
RULES_TEST = Path(__file__).resolve().parent / "ate-devplugd.rules.test.yml"
KVM = "ate.dev/kvm"
VHOST = "ate.dev/vhost-net"
FILE = "ate-devplugd.prom"


def busy_metrics() -> Metrics:
    """Two resources in the states and with the counts a running daemon would have."""
    metrics = Metrics()
    for name in (KVM, VHOST):
        metrics.add_resource(name)
    metrics.set_device(KVM, present=False, healthy=False, advertised_units=4096)
    metrics.set_device(KVM, present=True, healthy=True, advertised_units=4096)  # a health transition
    metrics.set_device(VHOST, present=False, healthy=False, advertised_units=0)
    metrics.set_registered(KVM, True)
    metrics.set_streams(KVM, 1)
    metrics.registration(KVM)
    metrics.registration(KVM)
    metrics.register_failure(KVM)
    for _ in range(7):
        metrics.allocation(KVM)
    metrics.allocate_error(KVM, "FAILED_PRECONDITION")
    metrics.kubelet_restart()
    metrics.reload()
    metrics.set_runtime_cdi(CdiVerdict.NOT_APPLIED, "containerd 1.7.24")
    return metrics


async def written(metrics: Metrics, directory: Path) -> TextfileWriter:
    """``metrics`` written to DIRECTORY/ate-devplugd.prom by the writer (waited for by inotify)."""
    writer = TextfileWriter(str(directory / FILE), metrics.render)
    metrics.on_change = writer.changed
    with watching(directory, FILE) as events:
        writer.start()
        await events.renamed()
    return writer


class TestNodeExporter:
    async def test_scraped_values(self, tmp_path: Path) -> None:
        """node_exporter serves the file's values with their types, reads it without error, and follows a change."""
        metrics = busy_metrics()
        writer = await written(metrics, tmp_path)
        async with node_exporter(tmp_path) as exporter:
            families = await exporter.families()
            assert sample(families, "node_textfile_scrape_error") == 0
            assert sample(families, "node_scrape_collector_success", collector="textfile") == 1
            assert sample(families, "node_textfile_mtime_seconds", file=str(tmp_path / FILE)) > 0
            assert sample(families, "ate_devplugd_build_info", version=__version__) == 1
            assert sample(families, "ate_devplugd_device_healthy", resource=KVM) == 1
            assert sample(families, "ate_devplugd_healthy_units", resource=KVM) == 4096
            assert sample(families, "ate_devplugd_device_present", resource=VHOST) == 0
            assert sample(families, "ate_devplugd_registered", resource=KVM) == 1
            assert sample(families, "ate_devplugd_listandwatch_streams", resource=KVM) == 1
            assert sample(families, "ate_devplugd_registrations_total", resource=KVM) == 2
            assert sample(families, "ate_devplugd_allocations_total", resource=KVM) == 7
            assert sample(families, "ate_devplugd_allocate_errors_total", resource=KVM, code="FAILED_PRECONDITION") == 1
            assert sample(families, "ate_devplugd_kubelet_restarts_total") == 1
            cdi = {"runtime": "containerd 1.7.24"}
            assert sample(families, "ate_devplugd_runtime_cdi", verdict="not_applied", **cdi) == 1
            assert sample(families, "ate_devplugd_runtime_cdi", verdict="applied", **cdi) == 0
            ours = {name: f for name, f in families.items() if name.startswith("ate_devplugd_")}
            assert {f.type for f in ours.values()} == {"gauge", "counter"}
            assert ours["ate_devplugd_allocations"].type == "counter"
            assert ours["ate_devplugd_registered"].type == "gauge"
            # what node_exporter serves of ours is exactly what was written
            written_samples = {
                (s.name, tuple(sorted(s.labels.items())), s.value)
                for f in text_string_to_metric_families(metrics.render().decode())
                for s in f.samples
            }
            served = {(s.name, tuple(sorted(s.labels.items())), s.value) for f in ours.values() for s in f.samples}
            assert served == written_samples

            with watching(tmp_path, FILE) as events:
                metrics.set_device(KVM, present=False, healthy=False, advertised_units=4096)
                metrics.set_registered(KVM, False)
                await events.renamed()
            families = await exporter.families()
            assert sample(families, "ate_devplugd_device_healthy", resource=KVM) == 0
            assert sample(families, "ate_devplugd_healthy_units", resource=KVM) == 0
            assert sample(families, "ate_devplugd_registered", resource=KVM) == 0
        writer.close()

    async def test_scrapes_during_rewrites_never_see_a_partial_file(self, tmp_path: Path) -> None:
        """Scrapes while the file is rewritten as fast as the writer goes: every one reads a whole file."""
        metrics = busy_metrics()
        writer = await written(metrics, tmp_path)
        writer.interval = 0.0
        stop = asyncio.Event()

        async def rewrite() -> None:
            while not stop.is_set():
                metrics.allocation(KVM)
                writer.flush()
                await asyncio.sleep(0)

        async with node_exporter(tmp_path) as exporter:
            task = asyncio.get_running_loop().create_task(rewrite())
            try:
                seen = []
                for _ in range(50):
                    families = await exporter.families()
                    assert sample(families, "node_textfile_scrape_error") == 0
                    seen.append(sample(families, "ate_devplugd_allocations_total", resource=KVM))
            finally:
                stop.set()
                await task
        assert seen == sorted(seen) and seen[-1] > seen[0], seen
        print(f"{writer.writes} rewrites under 50 scrapes")
        writer.close()

    async def test_no_file_no_series(self, tmp_path: Path) -> None:
        """Metrics off (the file removed on close): node_exporter serves none of ours and reports no error."""
        writer = await written(busy_metrics(), tmp_path)
        writer.close()
        async with node_exporter(tmp_path) as exporter:
            families = await exporter.families()
        assert sample(families, "node_textfile_scrape_error") == 0
        assert not [name for name in families if name.startswith("ate_devplugd_")]


class TestPromtool:
    async def test_check_metrics_accepts_the_file(self, tmp_path: Path) -> None:
        """promtool check metrics (its lint included) finds nothing to say about the written file."""
        metrics = busy_metrics()
        writer = await written(metrics, tmp_path)
        rc, out = await promtool("check", "metrics", stdin=(tmp_path / FILE).read_bytes())
        assert (rc, out.strip()) == (0, ""), out
        writer.close()

    async def test_check_rules_accepts_the_shipped_rules(self) -> None:
        """promtool check rules accepts the eleven shipped alerts."""
        rc, out = await promtool("check", "rules", str(RULES))
        assert rc == 0, out
        assert "SUCCESS: 11 rules found" in out, out

    def test_the_package_installs_the_rules_where_the_docs_say(self) -> None:
        """The .deb installs the rules file (debian/*.install) where docs/monitoring.md and ate-devplugd(8) say."""
        install = (ROOT / "packaging" / "debian" / "ate-devplugd.install").read_text().splitlines()
        (target,) = [line.split()[1] for line in install if line.split()[0] == str(RULES.relative_to(ROOT))]
        installed = "/" + target.rstrip("/") + "/" + RULES.name
        assert installed == "/usr/share/ate-devplugd/ate-devplugd.rules.yml"
        assert f"The package installs `{installed}`" in (ROOT / "docs" / "monitoring.md").read_text()
        man = (ROOT / "packaging" / "man" / "ate-devplugd.8").read_text().replace("\\-", "-")
        assert f".I {installed}\n" in man

    async def test_alerts_fire_when_they_should(self) -> None:
        """promtool test rules: each alert fires for its case after its delay, and not for the healthy ones,
        with nodes in device-plugin mode and in DRA mode."""
        rc, out = await promtool("test", "rules", str(RULES_TEST))
        assert rc == 0, out


class TestDaemonThroughNodeExporter:
    """The daemon's own file, as node_exporter serves it, following what kubelet and the device do."""

    @staticmethod
    async def scraped(exporter: NodeExporter, path: Path, line: str) -> dict[str, Metric]:
        """Once the file shows ``line`` (a write is renamed into place), what node_exporter serves."""
        await wait_for_content(path, line)
        families = await exporter.families()
        assert sample(families, "node_textfile_scrape_error") == 0
        return families

    async def test_values_move_as_they_should(self, tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
        """registered 1 after Register; healthy 0 then 1 across a real removal and return (real uevents);
        allocations +5 after five Allocates; kubelet restarts +1 after a kubelet restart."""
        textfiles = tmp_path / "textfile"
        textfiles.mkdir()
        metrics = textfiles / FILE
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root, metrics_file=metrics)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with node_exporter(textfiles) as exporter, daemon(cfg) as proc:
                await kubelet.next_event("list")
                families = await self.scraped(exporter, metrics, f'ate_devplugd_registered{{resource="{KVM}"}} 1\n')
                assert sample(families, "ate_devplugd_registered", resource=KVM) == 1, proc.log()
                assert sample(families, "ate_devplugd_healthy_units", resource=KVM) == 4096
                restarts = sample(families, "ate_devplugd_kubelet_restarts_total")

                (dev_root / "dev" / "kvm").unlink()
                kvm_uevent()
                families = await self.scraped(exporter, metrics, f'ate_devplugd_device_healthy{{resource="{KVM}"}} 0\n')
                assert sample(families, "ate_devplugd_healthy_units", resource=KVM) == 0
                make_kvm_node(dev_root)
                kvm_uevent()
                families = await self.scraped(exporter, metrics, f'ate_devplugd_device_healthy{{resource="{KVM}"}} 1\n')
                assert sample(families, "ate_devplugd_health_transitions_total", resource=KVM) == 2

                allocated = sample(families, "ate_devplugd_allocations_total", resource=KVM)
                for n in range(5):
                    await kubelet.allocate(KVM, [f"kvm-{n}"])
                after = f'ate_devplugd_allocations_total{{resource="{KVM}"}} {int(allocated) + 5}\n'
                families = await self.scraped(exporter, metrics, after)
                assert sample(families, "ate_devplugd_allocations_total", resource=KVM) == allocated + 5

                await kubelet.restart()
                await kubelet.next_event("register")
                families = await self.scraped(
                    exporter, metrics, f"ate_devplugd_kubelet_restarts_total {int(restarts) + 1}\n"
                )
                assert sample(families, "ate_devplugd_kubelet_restarts_total") == restarts + 1
                assert sample(families, "ate_devplugd_registrations_total", resource=KVM) == 2
        finally:
            await kubelet.stop()

    async def test_allocate_burst_writes_a_bounded_number_of_times(
        self, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """1,000 Allocates as fast as kubelet can send them: the file is written about once a second, and
        its last write holds the final count."""
        textfiles = plugin_dir.parent / "textfile"
        textfiles.mkdir()
        config = kvm_config(plugin_dir, fake_root, metrics_file=textfiles / FILE)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel):
                await kubelet.next_event("list")
                await wait_for_content(textfiles / FILE, f'ate_devplugd_registered{{resource="{KVM}"}} 1\n')
                with watching(textfiles, FILE) as events:
                    loop = asyncio.get_running_loop()
                    started = loop.time()
                    for n in range(1000):
                        await kubelet.allocate(KVM, [f"kvm-{n}"])
                    took = loop.time() - started
                    await wait_for_content(
                        textfiles / FILE, f'ate_devplugd_allocations_total{{resource="{KVM}"}} 1000\n'
                    )
                    print(f"1000 Allocates in {took:.2f} s: {events.renames} writes of the metrics file")
                    assert 1 <= events.renames <= took / 1.0 + 2, (events.renames, took)
        finally:
            await kubelet.stop()


class TestDraModeThroughNodeExporter:
    """DRA mode's file as node_exporter serves it: the shared series true for DRA, and DRA's own."""

    async def test_values_move_as_they_should(self, tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """registered 1 once kubelet took the driver; advertised and healthy units = the 128 devices of the
        published slice, 0 while the device is gone; allocations = claims prepared; prepare errors,
        unprepares, slice writes by reason and API errors counted; promtool's lint finds nothing."""
        textfiles = tmp_path / "textfile"
        textfiles.mkdir()
        path = textfiles / FILE
        monitor = FakeMonitor()
        try:
            async with (
                node_exporter(textfiles) as exporter,
                dra_node(kernel, fake_root, monitor, metrics_file=path) as node,
            ):
                await node.kubelet.next_event("registered")
                await node.status("registered with kubelet, slice published (128 devices)")
                # both in one write: the file may first show one of them (writes are coalesced)
                await wait_for_content(path, f'ate_devplugd_registered{{resource="{KVM}"}} 1')
                families = await TestDaemonThroughNodeExporter.scraped(
                    exporter, path, f'ate_devplugd_advertised_units{{resource="{KVM}"}} 128'
                )
                assert sample(families, "ate_devplugd_registered", resource=KVM) == 1
                assert sample(families, "ate_devplugd_registrations_total", resource=KVM) == 1
                assert sample(families, "ate_devplugd_healthy_units", resource=KVM) == 128
                assert sample(families, "ate_devplugd_dra_info", driver=DRIVER, sharing="units") == 1
                assert sample(families, "ate_devplugd_dra_slice_publishes_total", resource=KVM, reason="created") == 1

                claims = [node.claim(f"vm-{n}", f"kvm-{n}") for n in range(3)]
                for claim in claims:
                    await node.kubelet.prepare(DRIVER, claim)
                await node.kubelet.prepare(DRIVER, ("default", "u-gone", "gone"))
                await node.kubelet.unprepare(DRIVER, *claims)
                families = await TestDaemonThroughNodeExporter.scraped(
                    exporter, path, "ate_devplugd_dra_unprepares_total 3"
                )
                assert sample(families, "ate_devplugd_allocations_total", resource=KVM) == 3
                assert sample(families, "ate_devplugd_dra_prepares_total") == 3
                assert sample(families, "ate_devplugd_dra_prepare_errors_total", reason="not_found") == 1
                assert sample(families, "ate_devplugd_dra_prepare_duration_seconds_count") == 4
                assert sample(families, "ate_devplugd_dra_api_errors_total", reason="not_found") >= 1

                kernel.remove_node(fake_root / "dev" / "kvm")
                monitor.emit("remove")
                families = await TestDaemonThroughNodeExporter.scraped(
                    exporter, path, f'ate_devplugd_advertised_units{{resource="{KVM}"}} 0'
                )
                assert sample(families, "ate_devplugd_healthy_units", resource=KVM) == 0
                assert sample(families, "ate_devplugd_device_healthy", resource=KVM) == 0
                assert sample(families, "ate_devplugd_dra_slice_publishes_total", resource=KVM, reason="updated") == 1

                kernel.add_node(fake_root / "dev" / "kvm")
                monitor.emit("add")
                await node.status("slice published (128 devices)")
                node.api.kubelet_restarted()
                await node.api.next_change("ADDED")
                families = await TestDaemonThroughNodeExporter.scraped(
                    exporter,
                    path,
                    f'ate_devplugd_dra_slice_publishes_total{{reason="republished",resource="{KVM}"}} 1',
                )
                assert sample(families, "ate_devplugd_advertised_units", resource=KVM) == 128
                rc, out = await promtool("check", "metrics", stdin=path.read_bytes())
                assert (rc, out.strip()) == (0, ""), out
        finally:
            monitor.close()
