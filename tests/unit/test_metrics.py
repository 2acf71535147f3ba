"""The metrics, their text format and their textfile writer, in-process: values, label sets, the text as
prometheus_client writes it, atomic and coalesced writes, no timer while idle, and faults of the metrics
directory (missing, unwritable, read-only, full).

Writes are counted with real inotify (IN_MOVED_TO of the file's name), not by wrapping the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import stat
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ate_devplugd import __version__, config
from ate_devplugd.base import atomicfile
from ate_devplugd.config.dra import Layout
from ate_devplugd.cri.facts import CdiVerdict
from ate_devplugd.dra.metrics import ClaimProblem, DraMetrics
from ate_devplugd.node.devices import Withheld
from ate_devplugd.signals.metrics import ALLOCATE_ERROR_CODES, GRPC_CODES, Metrics
from ate_devplugd.signals.promtext import Family, MetricType, exposition
from ate_devplugd.signals.textfile import PROMPT_INTERVAL, TextfileWriter
from tests.prometheus_tools import watching
from tests.support import subprocess_env

KVM = "ate.dev/kvm"
VHOST = "ate.dev/vhost-net"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a text exposition, keyed by sample name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics.render().decode())[(name, tuple(sorted(labels.items())))]


def make_writer(path: Path, interval: float = 1.0) -> tuple[Metrics, TextfileWriter]:
    metrics = Metrics()
    writer = TextfileWriter(str(path), metrics.render, interval=interval)
    metrics.on_change = writer.changed
    metrics.add_resource(KVM)
    return metrics, writer


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mount)")


async def run(*argv: str, check: bool = True) -> int:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rc = await proc.wait()
    assert rc == 0 or not check, argv
    return rc


@contextlib.asynccontextmanager
async def mounted(*argv: str) -> AsyncIterator[None]:
    """Run ``mount ARGV``; the last argument is the mount point, unmounted (lazily) on exit."""
    needs_root()
    await run("mount", *argv)
    try:
        yield
    finally:
        await run("umount", "-l", argv[-1])


class TestMetrics:
    def test_series_of_a_new_resource(self) -> None:
        """A resource added has every per-resource series at 0; build info and process counters are there."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        got = samples(metrics.render().decode())
        r = (("resource", KVM),)
        expected: Samples = {
            ("ate_devplugd_build_info", (("version", __version__),)): 1.0,
            **{
                (f"ate_devplugd_{name}", r): 0.0
                for name in (
                    "device_present",
                    "device_healthy",
                    "advertised_units",
                    "healthy_units",
                    "device_usable",
                    "registered",
                    "listandwatch_streams",
                    "registrations_total",
                    "register_failures_total",
                    "reregistrations_total",
                    "cdi_spec_rewrites_total",
                    "allocations_total",
                    "health_transitions_total",
                )
            },
            **{("ate_devplugd_allocate_errors_total", (("code", c), *r)): 0.0 for c in ALLOCATE_ERROR_CODES},
            **{("ate_devplugd_device_withheld", (("reason", w.value), *r)): 0.0 for w in Withheld},
            ("ate_devplugd_kubelet_restarts_total", ()): 0.0,
            ("ate_devplugd_reloads_total", ()): 0.0,
            ("ate_devplugd_reload_failures_total", ()): 0.0,
        }
        assert got == expected

    def test_types_and_help(self) -> None:
        """Counters are counters named *_total, the rest gauges; every family has help text."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        text = metrics.render().decode()
        types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
        assert all(kind == "counter" for name, kind in types.items() if name.endswith("_total"))
        assert all(kind == "gauge" for name, kind in types.items() if not name.endswith("_total"))
        assert sum(kind == "counter" for kind in types.values()) == 10
        helps = [line for line in text.splitlines() if line.startswith("# HELP")]
        assert len(helps) == len(types) and all(len(h.split(" ", 3)[3]) > 10 for h in helps)

    def test_values_follow_the_calls(self) -> None:
        """State setters and counters show in the rendered text, per resource."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        metrics.add_resource(VHOST)
        metrics.set_device(KVM, present=True, healthy=True, advertised_units=4096)
        metrics.set_device(VHOST, present=True, healthy=True, advertised_units=16)
        metrics.set_device(VHOST, present=True, healthy=False, advertised_units=16)  # a health transition
        metrics.set_registered(KVM, True)
        metrics.set_streams(KVM, 1)
        for _ in range(3):
            metrics.registration(KVM)
        metrics.register_failure(KVM)
        for _ in range(5):
            metrics.allocation(KVM)
        metrics.allocate_error(KVM, "INVALID_ARGUMENT")
        metrics.allocate_error(KVM, "FAILED_PRECONDITION")
        metrics.allocate_error(KVM, "FAILED_PRECONDITION")
        metrics.kubelet_restart()
        metrics.reload()
        metrics.reload_failed()
        metrics.reload_failed()
        got = samples(metrics.render().decode())

        def at(name: str, resource: str | None = None, **labels: str) -> float:
            if resource is not None:
                labels["resource"] = resource
            return got[(f"ate_devplugd_{name}", tuple(sorted(labels.items())))]

        assert (at("device_present", KVM), at("device_healthy", KVM)) == (1, 1)
        assert (at("advertised_units", KVM), at("healthy_units", KVM)) == (4096, 4096)
        assert (at("device_present", VHOST), at("device_healthy", VHOST)) == (1, 0)
        assert (at("advertised_units", VHOST), at("healthy_units", VHOST)) == (16, 0)
        assert (at("registered", KVM), at("listandwatch_streams", KVM)) == (1, 1)
        assert (at("registered", VHOST), at("listandwatch_streams", VHOST)) == (0, 0)
        assert (at("registrations_total", KVM), at("register_failures_total", KVM)) == (3, 1)
        assert at("allocations_total", KVM) == 5
        assert at("allocate_errors_total", KVM, code="INVALID_ARGUMENT") == 1
        assert at("allocate_errors_total", KVM, code="FAILED_PRECONDITION") == 2
        assert at("allocate_errors_total", VHOST, code="FAILED_PRECONDITION") == 0
        assert (at("health_transitions_total", VHOST), at("health_transitions_total", KVM)) == (1, 0)
        assert (at("kubelet_restarts_total"), at("reloads_total"), at("reload_failures_total")) == (1, 1, 2)

    def test_absent_device_is_not_healthy(self) -> None:
        """A device that is not present never counts as healthy, whatever the caller passed."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        metrics.set_device(KVM, present=False, healthy=True, advertised_units=4096)
        assert value(metrics, "ate_devplugd_device_healthy", resource=KVM) == 0
        assert value(metrics, "ate_devplugd_healthy_units", resource=KVM) == 0
        assert value(metrics, "ate_devplugd_advertised_units", resource=KVM) == 4096

    def test_on_change_only_when_a_value_changed(self) -> None:
        """Setting a gauge to the value it has is no change; every counter increment is one."""
        calls: list[None] = []
        metrics = Metrics(on_change=lambda prompt: calls.append(None))
        metrics.add_resource(KVM)
        metrics.add_resource(KVM)
        assert len(calls) == 1
        for _ in range(3):
            metrics.set_device(KVM, present=True, healthy=True, advertised_units=4096)
            metrics.set_registered(KVM, True)
            metrics.set_streams(KVM, 1)
        assert len(calls) == 4
        metrics.allocation(KVM)
        metrics.allocation(KVM)
        metrics.kubelet_restart()
        assert len(calls) == 7

    def test_removed_resource_stays_gone(self) -> None:
        """After remove_resource its series are gone, and late calls for it neither return them nor notify."""
        calls: list[None] = []
        metrics = Metrics(on_change=lambda prompt: calls.append(None))
        metrics.add_resource(KVM)
        metrics.add_resource(VHOST)
        metrics.remove_resource(VHOST)
        assert metrics.resources == (KVM,)
        before = len(calls)
        metrics.set_streams(VHOST, 0)
        metrics.set_registered(VHOST, False)
        metrics.set_device(VHOST, present=True, healthy=True, advertised_units=1)
        metrics.allocation(VHOST)
        metrics.allocate_error(VHOST, "INVALID_ARGUMENT")
        metrics.remove_resource(VHOST)
        assert len(calls) == before
        assert not [key for key in samples(metrics.render().decode()) if ("resource", VHOST) in key[1]]

    def test_code_label_is_bounded(self) -> None:
        """Only canonical gRPC code names become label values; anything else counts as UNKNOWN."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        for n in range(1000):
            metrics.allocate_error(KVM, f"code-{n}")
        metrics.allocate_error(KVM, "RESOURCE_EXHAUSTED")
        codes = {
            dict(labels)["code"]: v
            for (name, labels), v in samples(metrics.render().decode()).items()
            if name == "ate_devplugd_allocate_errors_total"
        }
        assert set(codes) <= GRPC_CODES
        assert codes == {"INVALID_ARGUMENT": 0, "FAILED_PRECONDITION": 0, "UNKNOWN": 1000, "RESOURCE_EXHAUSTED": 1}

    def test_only_our_families_without_prometheus_client(self) -> None:
        """Only ate_devplugd_ families, no _created series; rendering imports no prometheus_client."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        metrics.allocation(KVM)
        text = metrics.render().decode()
        assert "_created" not in text
        assert {family.name.split("_")[0] for family in text_string_to_metric_families(text)} == {"ate"}
        code = (
            "import sys; from ate_devplugd.signals.metrics import Metrics; m = Metrics(); m.add_resource('a.b/c'); "
            "m.render(); sys.exit('prometheus_client' in sys.modules)"
        )
        assert subprocess.run([sys.executable, "-c", code], env=subprocess_env(), check=False).returncode == 0


class TestExposition:
    """The text format as prometheus_client writes it: the same families rendered by its
    ``generate_latest`` and by ours read back the same through its parser (names, types, help, labels,
    values), including what needs escaping and values past 2**53."""

    @staticmethod
    def read(text: bytes) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """Every family as prometheus_client's parser reads it (values as floats, as its writer has them)."""
        return [
            (f.name, f.type, f.documentation, [(s.name, s.labels, float(s.value)) for s in f.samples])
            for f in text_string_to_metric_families(text.decode())
        ]

    @staticmethod
    def by_prometheus_client(families: list[Family]) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        theirs: list[Any] = []
        for f in families:
            if f.type is MetricType.HISTOGRAM:
                buckets = [(labels[0][1], v) for suffix, labels, v in f.samples if suffix == "_bucket"]
                (total,) = [v for suffix, _, v in f.samples if suffix == "_sum"]
                theirs.append(HistogramMetricFamily(f.name, f.help, buckets=buckets, sum_value=total))
                continue
            kind = CounterMetricFamily if f.type is MetricType.COUNTER else GaugeMetricFamily
            family = kind(f.name, f.help, labels=list(f.labels))
            for _, labels, v in f.samples:
                family.add_metric([value for _, value in labels], v)
            theirs.append(family)

        class Collector:
            def collect(self) -> list[Any]:
                return theirs

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector())  # type: ignore[arg-type]
        return bytes(generate_latest(registry))

    def test_the_daemons_families(self) -> None:
        metrics = Metrics()
        metrics.add_resource(KVM)
        metrics.add_resource(VHOST)
        metrics.set_device(KVM, present=True, healthy=True, advertised_units=4096)
        metrics.allocate_error(KVM, "INVALID_ARGUMENT")
        metrics.kubelet_restart()
        families = list(metrics.families())
        assert self.read(exposition(families)) == self.read(self.by_prometheus_client(families))

    def test_escaping_and_large_values(self) -> None:
        odd = 'a\\b "quoted"\nnext line'
        gauge = Family.gauge("ate_devplugd_test_gauge", "help with \\ and\na second line", "what")
        gauge.add_metric([odd], 0.5)
        gauge.add_metric(["inf"], float("inf"))
        counter = Family.counter("ate_devplugd_test", "a counter", "what", "code")
        counter.add_metric([odd, "OK"], 2**60 + 1)
        families = [gauge, counter, Family.counter("ate_devplugd_test_plain", "no labels")]
        families[-1].add_metric([], 7)
        ours = exposition(families)
        assert self.read(ours) == self.read(self.by_prometheus_client(families))
        assert f"{2**60 + 1}".encode() in ours  # a count is written exactly, not rounded to a float
        assert self.read(ours)[0][3][0][1] == {"what": odd}

    def test_dra_modes_families(self) -> None:
        """DRA mode's series (counters with labels, the prepare-latency histogram) and the runtime's CDI
        gauge read back as prometheus_client writes them."""
        metrics = Metrics()
        metrics.add_resource(KVM)
        metrics.set_runtime_cdi(CdiVerdict.NOT_APPLIED, "containerd 1.7.24")
        dra = DraMetrics("kvm.ate.dev", Layout.UNITS, (KVM,), shared=metrics)
        metrics.add_source(dra)
        for seconds in (0.001, 0.03, 0.03, 2.0, 60.0):
            dra.prepare_call(seconds)
        dra.claim_failed(ClaimProblem.NOT_FOUND)
        families = list(metrics.families())
        assert any(f.type is MetricType.HISTOGRAM for f in families)
        ours = exposition(families)
        assert self.read(ours) == self.read(self.by_prometheus_client(families))
        assert b'ate_devplugd_dra_prepare_duration_seconds_bucket{le="0.05"} 3\n' in ours
        assert b'ate_devplugd_dra_prepare_duration_seconds_bucket{le="+Inf"} 5\n' in ours

    def test_histogram_ends_with_inf(self) -> None:
        with pytest.raises(ValueError, match="last bucket must be"):
            Family.histogram("ate_devplugd_x", "x", [(1.0, 2)], 1.5)

    def test_label_values_must_match_the_names(self) -> None:
        with pytest.raises(ValueError, match="2 label values expected"):
            Family.counter("ate_devplugd_x", "x", "a", "b").add_metric(["only one"], 1)


class TestTextfileWriter:
    async def test_written_by_rename_readable_by_others(self, tmp_path: Path) -> None:
        """The file appears by a rename, mode 0644 even under umask 077, equal to the rendered metrics."""
        path = tmp_path / "ate-devplugd.prom"
        old_umask = os.umask(0o077)
        try:
            with watching(tmp_path, path.name) as events:
                metrics, writer = make_writer(path)
                writer.start()
                await events.renamed()
        finally:
            os.umask(old_umask)
        assert path.read_bytes() == metrics.render()
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
        assert not writer.pending and writer.writes == 1

    async def test_first_change_after_quiet_is_written_at_once(self, tmp_path: Path) -> None:
        """A change after a quiet interval is written within FIRST_DELAY (after what the loop was about to
        send); one right after it waits for the interval."""
        path = tmp_path / "m.prom"
        with watching(tmp_path, path.name) as events:
            metrics, writer = make_writer(path, interval=0.3)
            metrics.set_registered(KVM, True)
            metrics.allocation(KVM)  # the same moment's changes: one write
            writer.start()
            assert writer.pending and writer.writes == 0
            await events.renamed()
            assert writer.writes == 1 and not writer.pending
            assert value(metrics, "ate_devplugd_registered", resource=KVM) == 1
            loop = asyncio.get_running_loop()
            changed_at = loop.time()
            metrics.allocation(KVM)
            await asyncio.sleep(0)
            assert writer.writes == 1 and writer.pending
            await events.renamed()
            waited = loop.time() - changed_at
            assert 0.2 <= waited <= 2.0, waited
            assert path.read_bytes() == metrics.render()
            assert events.renames == 2

    async def test_burst_of_1000_changes_is_coalesced(self, tmp_path: Path) -> None:
        """1,000 changes, one per loop turn, are written a bounded number of times, ending with the last state."""
        path = tmp_path / "m.prom"
        with watching(tmp_path, path.name) as events:
            metrics, writer = make_writer(path)
            writer.start()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for n in range(1000):
                metrics.allocation(KVM)
                metrics.set_streams(KVM, n % 2)
                await asyncio.sleep(0)
            burst = loop.time() - t0
            async with asyncio.timeout(5):
                while writer.pending:
                    await events.renamed()
            assert value(metrics, "ate_devplugd_allocations_total", resource=KVM) == 1000
            assert path.read_bytes() == metrics.render()
            print(f"1,000-change burst over {burst * 1000:.1f} ms: {events.renames} write(s)")
            # the first change after FIRST_DELAY; the streams (state) at most once per PROMPT_INTERVAL after
            assert 1 <= events.renames == writer.writes <= 2 + burst / PROMPT_INTERVAL

    async def test_a_change_of_state_is_written_within_the_prompt_interval(self, tmp_path: Path) -> None:
        """Right after a write, a count waits for the interval, a change of state only PROMPT_INTERVAL."""
        path = tmp_path / "m.prom"
        with watching(tmp_path, path.name) as events:
            metrics, writer = make_writer(path, interval=5.0)
            writer.start()
            await events.renamed()
            loop = asyncio.get_running_loop()
            metrics.allocation(KVM)  # a count: would wait the 5 s interval
            changed_at = loop.time()
            metrics.set_streams(KVM, 1)  # a state: carries the count with it
            await events.renamed()
            waited = loop.time() - changed_at
            print(f"a change of state written {waited * 1000:.0f} ms after it (prompt interval {PROMPT_INTERVAL} s)")
            assert waited < 2.0, waited
            assert value(metrics, "ate_devplugd_listandwatch_streams", resource=KVM) == 1
            assert path.read_bytes() == metrics.render()

    async def test_spread_burst_is_written_about_once_per_interval(self, tmp_path: Path) -> None:
        """Changes arriving for 1.5 s without a pause are written at most once per interval, plus the edges."""
        path = tmp_path / "m.prom"
        with watching(tmp_path, path.name) as events:
            metrics, writer = make_writer(path, interval=0.25)
            writer.start()
            await events.renamed()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            n = 0
            while loop.time() - t0 < 1.5:
                metrics.allocation(KVM)
                n += 1
                await asyncio.sleep(0.001)  # pacing of the load, not a wait for a state
            burst = loop.time() - t0
            async with asyncio.timeout(5):
                while writer.pending:
                    await events.renamed()
            print(f"{n} changes over {burst:.2f} s at interval {writer.interval} s: {events.renames - 1} writes")
            assert events.renames - 1 <= 2 + burst / writer.interval
            assert path.read_bytes() == metrics.render()

    async def test_idle_writer_arms_nothing(self, tmp_path: Path) -> None:
        """With nothing changed no write is pending and nothing is written, even when values are set again."""
        path = tmp_path / "m.prom"
        with watching(tmp_path, path.name) as events:
            metrics, writer = make_writer(path, interval=0.2)
            metrics.set_device(KVM, present=True, healthy=True, advertised_units=4096)
            writer.start()
            await events.renamed()
            assert not writer.pending
            metrics.set_device(KVM, present=True, healthy=True, advertised_units=4096)
            metrics.set_registered(KVM, False)
            assert not writer.pending
            await asyncio.sleep(3 * writer.interval)  # deliberate idle window: prove nothing happens
            assert events.queue.empty() and writer.writes == 1 and not writer.pending

    async def test_missing_directory_is_logged_once_at_info(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A missing directory: one info line, metrics off (nothing armed); enable() after it exists writes."""
        caplog.set_level(logging.DEBUG, logger="ate_devplugd")
        directory = tmp_path / "node-exporter"
        path = directory / "m.prom"
        metrics, writer = make_writer(path)
        writer.start()
        writer.flush()  # the first write, now
        assert not writer.enabled and writer.writes == 0
        for _ in range(10):
            metrics.allocation(KVM)
        assert not writer.pending
        records = [r for r in caplog.records if r.name.startswith("ate_devplugd")]
        assert [(r.levelno, getattr(r, "ATE_EVENT", "")) for r in records] == [(logging.INFO, "metrics-off")]
        assert str(directory) in records[0].getMessage()
        directory.mkdir()
        with watching(directory, path.name) as events:
            writer.enable(str(path))
            await events.renamed()
        assert writer.enabled and path.read_bytes() == metrics.render()

    async def test_directory_where_no_file_can_be_created(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """No file can be created in the directory (0555 for a user, immutable for root): one warning, off."""
        caplog.set_level(logging.DEBUG, logger="ate_devplugd")
        path = tmp_path / "m.prom"
        if os.geteuid() == 0:
            if shutil.which("chattr") is None:
                pytest.skip("chattr is not installed")
            if await run("chattr", "+i", str(tmp_path), check=False):
                pytest.skip("no immutable flag on this file system")
            undo = ["chattr", "-i", str(tmp_path)]
        else:
            tmp_path.chmod(0o555)
            undo = ["chmod", "0755", str(tmp_path)]
        try:
            metrics, writer = make_writer(path)
            writer.start()
            writer.flush()  # the first write, now
            metrics.allocation(KVM)
            assert not writer.enabled and not writer.pending
        finally:
            await run(*undo)
        records = [r for r in caplog.records if r.name.startswith("ate_devplugd")]
        assert [r.levelno for r in records] == [logging.WARNING]
        assert os.strerror(errno.EPERM if os.geteuid() == 0 else errno.EACCES) in records[0].getMessage()
        assert list(tmp_path.iterdir()) == []
        with watching(tmp_path, path.name) as events:
            writer.enable(str(path))
            await events.renamed()
        assert path.read_bytes() == metrics.render()

    async def test_read_only_directory(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """A directory turned read-only (a read-only bind mount) while writing: one warning, off; on again after."""
        caplog.set_level(logging.DEBUG, logger="ate_devplugd")
        directory = tmp_path / "textfile"
        directory.mkdir()
        path = directory / "m.prom"
        with watching(directory, path.name) as events:
            metrics, writer = make_writer(path, interval=0.05)
            writer.start()
            await events.renamed()
        async with mounted("--bind", str(directory), str(directory)):
            await run("mount", "-o", "remount,ro,bind", str(directory))
            metrics.allocation(KVM)
            writer.flush()
            metrics.allocation(KVM)
            assert not writer.enabled and not writer.pending
        records = [r for r in caplog.records if r.name.startswith("ate_devplugd")]
        assert [r.levelno for r in records] == [logging.WARNING]
        assert os.strerror(errno.EROFS) in records[0].getMessage()
        with watching(directory, path.name) as events:
            writer.enable(str(path))
            await events.renamed()
        assert value(metrics, "ate_devplugd_allocations_total", resource=KVM) == 2
        assert path.read_bytes() == metrics.render()

    async def test_full_file_system(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """No space left (a full tmpfs): one warning, no temp file left behind, the old file intact."""
        caplog.set_level(logging.DEBUG, logger="ate_devplugd")
        directory = tmp_path / "textfile"
        directory.mkdir()
        async with mounted("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)):
            path = directory / "m.prom"
            metrics, writer = make_writer(path)
            with watching(directory, path.name) as events:
                writer.start()
                await events.renamed()
            old = path.read_bytes()
            filler = directory / "filler"
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                with pytest.raises(OSError) as full:
                    while True:
                        os.write(fd, b"\0" * 4096)
                assert full.value.errno == errno.ENOSPC
            finally:
                os.close(fd)
            metrics.allocation(KVM)
            writer.flush()
            assert not writer.enabled
            records = [r for r in caplog.records if r.name.startswith("ate_devplugd")]
            assert [r.levelno for r in records] == [logging.WARNING]
            assert os.strerror(errno.ENOSPC) in records[0].getMessage()
            assert sorted(p.name for p in directory.iterdir()) == ["filler", "m.prom"]
            assert path.read_bytes() == old
            filler.unlink()
            with watching(directory, path.name) as events:
                writer.enable(str(path))
                await events.renamed()
            assert path.read_bytes() == metrics.render()
            writer.close()

    async def test_fifo_and_stale_temp_file_are_replaced(self, tmp_path: Path) -> None:
        """A FIFO at the path is replaced, never opened; a temp file left by a dead writer (even a symlink) is
        replaced, its target untouched."""
        path = tmp_path / "m.prom"
        os.mkfifo(path)
        victim = tmp_path / "victim"
        victim.write_text("keep")
        metrics, writer = make_writer(path)
        os.symlink(victim, atomicfile.temp_path(writer.path))
        with watching(tmp_path, path.name) as events:
            writer.start()
            await events.renamed()
        assert stat.S_ISREG(path.lstat().st_mode) and path.read_bytes() == metrics.render()
        assert victim.read_text() == "keep"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.prom", "victim"]

    async def test_enable_with_another_path_and_off(self, tmp_path: Path) -> None:
        """enable(other) moves the file; enable("") turns metrics off and removes it; so does close()."""
        first, second = tmp_path / "a.prom", tmp_path / "b.prom"
        with watching(tmp_path, first.name) as events:
            metrics, writer = make_writer(first)
            writer.start()
            await events.renamed()
        with watching(tmp_path, second.name) as events:
            writer.enable(str(second))
            await events.renamed()
        assert not first.exists() and second.read_bytes() == metrics.render()
        writer.enable("")
        metrics.allocation(KVM)
        assert not writer.enabled and not writer.pending and not second.exists()
        writer.enable(str(second))
        writer.flush()
        writer.close()
        metrics.allocation(KVM)
        assert not second.exists() and not writer.pending
        assert list(tmp_path.iterdir()) == []

    async def test_close_can_keep_the_file(self, tmp_path: Path) -> None:
        """close(remove=False) cancels a pending write and leaves the last file in place."""
        path = tmp_path / "m.prom"
        metrics, writer = make_writer(path)
        writer.flush()
        written = path.read_bytes()
        metrics.allocation(KVM)
        assert writer.pending
        writer.close(remove=False)
        assert not writer.pending and path.read_bytes() == written

    def test_flush_without_a_loop(self, tmp_path: Path) -> None:
        """flush() needs no running event loop (a last write after the loop has ended)."""
        path = tmp_path / "m.prom"
        metrics = Metrics()
        metrics.add_resource(KVM)
        writer = TextfileWriter(str(path), metrics.render)
        writer.flush()
        assert path.read_bytes() == metrics.render() and writer.writes == 1

    async def test_cost_of_one_write(self, tmp_path: Path) -> None:
        """One write (render, temp file, rename) of four resources costs a few milliseconds at most."""
        path = tmp_path / "m.prom"
        metrics, writer = make_writer(path, interval=0)
        for name in ("ate.dev/vhost-net", "ate.dev/vhost-vsock", "ate.dev/tun"):
            metrics.add_resource(name)
        times = []
        for _ in range(300):
            metrics.allocation(KVM)
            t0 = time.perf_counter()
            writer.flush()
            times.append(time.perf_counter() - t0)
        times.sort()
        median, p99 = statistics.median(times) * 1000, times[int(len(times) * 0.99)] * 1000
        render = min(timeit_render(metrics) for _ in range(3)) * 1000
        print(
            f"write: median {median:.3f} ms, p99 {p99:.3f} ms (render alone {render:.3f} ms), {len(metrics.render())} B"
        )
        assert writer.writes == 300
        assert median < 5.0, f"median write {median:.2f} ms"


def timeit_render(metrics: Metrics, n: int = 100) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        metrics.render()
    return (time.perf_counter() - t0) / n


class TestPathError:
    @pytest.mark.parametrize(
        ("path", "ok"),
        [
            ("", True),
            ("/var/lib/prometheus/node-exporter/ate-devplugd.prom", True),
            ("/srv/metrics/x.prom", True),
            ("ate-devplugd.prom", False),
            ("/var/lib/prometheus/node-exporter/ate-devplugd.txt", False),
            ("/var/lib/prometheus/node-exporter/", False),
            ("/var/lib/prometheus/node-exporter/.prom", False),
        ],
    )
    def test_metrics_file_values(self, path: str, ok: bool) -> None:
        """An absolute *.prom path or "" (off) is accepted; anything node_exporter would not read is not."""
        if ok:
            assert config.parse(f"metrics_file = {path!r}").metrics_file == path
        else:
            with pytest.raises(config.ConfigError, match="metrics_file"):
                config.parse(f"metrics_file = {path!r}")
