"""A reload is a plan, then a commit: a step that fails, whichever it is, leaves the running daemon as it
was (its log level, its config and the config its record announces, the udev filter, the sessions kubelet
sees and the metrics' resources), and the next good reload applies the whole config."""

from __future__ import annotations

import dataclasses
import errno
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ate_devplugd.config import Config, ConfigError
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.reload import decision
from tests.support import (
    RESOURCE,
    FakeKernel,
    FakeMonitor,
    daemon_in_process,
    kvm_config,
    record_of,
    started_kubelet,
)

VHOST = DeviceConfig("ate.dev/vhost-net", "/dev/vhost-net", count=2, subsystem="vhost")


class RefusingMonitor(FakeMonitor):
    """A monitor whose kernel refuses a filter on ``refused`` (the old filter stays as it was)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: str | None = None

    def filter_by(self, subsystem: str) -> None:
        if subsystem == self.refused:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        super().filter_by(subsystem)


def resources(exposition: bytes) -> set[str]:
    """The resources the metrics hold series of."""
    return set(re.findall(r'resource="([^"]*)"', exposition.decode()))


@pytest.fixture
def root_level() -> Iterator[None]:
    before = logging.getLogger().level
    yield
    logging.getLogger().setLevel(before)


def refuse_filter(monitor: RefusingMonitor, _monkeypatch: pytest.MonkeyPatch) -> None:
    monitor.refused = "vhost"


def busy_check_raises(_monitor: RefusingMonitor, monkeypatch: pytest.MonkeyPatch) -> None:
    def raising(*_args: object) -> list[str]:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(decision, "busy_sockets", raising)


def read_fails(_monitor: RefusingMonitor, _monkeypatch: pytest.MonkeyPatch) -> None:
    FAILING.append(OSError(errno.EIO, "Input/output error"))


def read_refused(_monitor: RefusingMonitor, _monkeypatch: pytest.MonkeyPatch) -> None:
    FAILING.append(ConfigError(["log_level: must be one of debug, info, warning, error, not 'loud'"]))


FAILING: list[Exception] = []
STEPS: dict[str, Callable[[RefusingMonitor, pytest.MonkeyPatch], None]] = {
    "reading the config": read_fails,
    "validating the config": read_refused,
    "checking the added sockets": busy_check_raises,
    "the udev filter": refuse_filter,
}


@pytest.mark.usefixtures("root_level")
@pytest.mark.parametrize("step", list(STEPS))
async def test_a_failing_step_changes_nothing(
    step: str,
    plugin_dir: Path,
    fake_root: Path,
    kernel: FakeKernel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel.add_node(fake_root / "dev" / "vhost-net", (10, 238))
    kernel.names[(10, 238)] = "/dev/vhost-net"
    base = dataclasses.replace(kvm_config(plugin_dir, fake_root, count=8), log_level="info")
    wanted = dataclasses.replace(base, log_level="debug", devices=(*base.devices, VHOST))
    FAILING.clear()

    def reload() -> Config:
        if FAILING:
            raise FAILING.pop()
        return wanted

    monitor = RefusingMonitor()
    kubelet = await started_kubelet(plugin_dir)

    async def announced() -> Config:
        found = await record_of(base)
        assert found is not None
        return found.config

    try:
        async with daemon_in_process(base, kernel, monitor=monitor, reload_config=reload) as running:
            await kubelet.next_event("list")
            daemon = running.daemon
            before = (
                logging.getLogger().level,
                daemon.config,
                await announced(),
                set(monitor.filters),
                daemon.status_line(),
                resources(daemon.metrics.render()),
                sorted(kubelet.endpoints),
            )
            STEPS[step](monitor, monkeypatch)
            assert not await daemon.reload()
            after = (
                logging.getLogger().level,
                daemon.config,
                await announced(),
                set(monitor.filters),
                daemon.status_line().split(" | reload ")[0],
                resources(daemon.metrics.render()),
                sorted(kubelet.endpoints),
            )
            assert after == before, step
            assert not (plugin_dir / VHOST.socket_name).exists()
            assert logging.getLogger().level == logging.INFO
            # The same config, once nothing fails, is applied whole.
            monitor.refused = None
            monkeypatch.undo()
            assert await daemon.reload()
            assert daemon.config == wanted and await announced() == wanted
            assert monitor.filters == {"misc", "vhost"} and logging.getLogger().level == logging.DEBUG
            await kubelet.next_event("list", resource=VHOST.resource)
            assert RESOURCE in daemon.status_line() and VHOST.resource in daemon.status_line()
    finally:
        await kubelet.stop()
