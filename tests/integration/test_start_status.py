"""The exit status of a start that fails says its cause (sysexits), not always "another ate-devplugd":
73 another process on our socket, 77 a permission refused (with the path), 71 any other system error."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from ate_devplugd.base.unixserver import SocketInUseError
from ate_devplugd.daemon.apply import start_failure
from ate_devplugd.kubelet.watch import KubeletWatch
from tests.support import FakeKernel, daemon_in_process, kvm_config


def test_each_cause_has_its_status() -> None:
    status, line = start_failure(SocketInUseError("/run/x.sock: another process answers there"))
    assert status == os.EX_CANTCREAT and "another ate-devplugd" in line
    status, line = start_failure(OSError(errno.EADDRINUSE, "Address already in use"))
    assert status == os.EX_CANTCREAT
    status, line = start_failure(PermissionError(errno.EACCES, "Permission denied", "/var/lib/kubelet/x"))
    assert status == os.EX_NOPERM and "/var/lib/kubelet/x: permission denied" in line
    assert "another" not in line
    status, line = start_failure(PermissionError(errno.EPERM, "Operation not permitted", "/dev/x"))
    assert status == os.EX_NOPERM and line.startswith("cannot start: /dev/x: Operation not permitted"), line
    status, line = start_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert status == os.EX_OSERR and line == "cannot start: No space left on device"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), os.EX_OSERR),
        (PermissionError(errno.EPERM, "Operation not permitted", "/x"), os.EX_NOPERM),
    ],
)
async def test_a_start_step_that_fails(
    error: OSError, status: int, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubelet's directory cannot be watched (inotify's limit, a refused permission): the start ends
    with its cause's status and one line saying it."""

    def refused(_self: KubeletWatch) -> None:
        raise error

    monkeypatch.setattr(KubeletWatch, "start", refused)
    plugin_dir = fake_root.parent / "device-plugins"
    async with daemon_in_process(kvm_config(plugin_dir, fake_root), kernel) as running:
        async with asyncio.timeout(10):
            assert await running.task == status
        (record,) = [r for r in running.events.records if r.getMessage().endswith("; not starting")]
        assert "another ate-devplugd" not in record.getMessage()
        assert not running.events.named("ready")
