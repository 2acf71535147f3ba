"""One validation: the same broken file gives the same errors, in one round, to start, reload,
``check-config`` and ``doctor`` (``config.load`` runs every check: the file's fields and each device
path on this host)."""

from __future__ import annotations

import os
from pathlib import Path

from ate_devplugd import config as configmod
from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Level
from tests.support import FakeKernel, daemon_in_process, kvm_config, run_cli, started_kubelet, write_config

#: A field error and a path that is a directory on this host: two rounds before, one now.
BROKEN = (
    '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 0\n'
    '[[device]]\nresource = "ate.dev/shm"\npath = "/dev/shm"\n'
)
ERRORS = [
    "device[0] (ate.dev/kvm): count: 0 must be an integer from 1 to 65536",
    "device[1] (ate.dev/shm): path: '/dev/shm' is a directory; path names a device node, e.g. '/dev/kvm'",
]


def broken_file(tmp_path: Path, plugin_dir: Path, fake_root: Path) -> Path:
    (fake_root / "dev" / "shm").mkdir(exist_ok=True)
    return write_config(tmp_path / "c.toml", plugin_dir, fake_root, BROKEN)


def config_errors(stderr: str) -> list[str]:
    prefix = "ate-devplugd: config error: "
    return [line.removeprefix(prefix) for line in stderr.splitlines() if line.startswith(prefix)]


async def test_check_config_and_run_say_every_error_and_exit_78(
    tmp_path: Path, plugin_dir: Path, fake_root: Path
) -> None:
    path = broken_file(tmp_path, plugin_dir, fake_root)
    for command in ("check-config", "run"):
        status, out, err = await run_cli(command, "--config", str(path))
        assert status == os.EX_CONFIG and out == "", (command, err)
        assert config_errors(err) == ERRORS, (command, err)


async def test_run_checks_its_options_in_the_same_round(tmp_path: Path, plugin_dir: Path, fake_root: Path) -> None:
    path = broken_file(tmp_path, plugin_dir, fake_root)
    status, _, err = await run_cli("run", "--config", str(path), "--log-level", "loud")
    assert status == os.EX_CONFIG
    assert config_errors(err) == ["--log-level: must be one of debug, info, warning, error, not 'loud'", *ERRORS], err


async def test_doctor_fails_each_error(tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
    path = broken_file(tmp_path, plugin_dir, fake_root)
    findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
    assert [(f.check, f.level) for f in findings] == [("config", Level.FAIL)] * 2
    assert [f.message for f in findings] == [f"{path}: {line}" for line in ERRORS]


async def test_a_reload_refuses_each_error_once(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    path = broken_file(tmp_path, plugin_dir, fake_root)
    config = kvm_config(plugin_dir, fake_root, count=8)
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(config, kernel, reload_config=lambda: configmod.load(path)) as running:
            await kubelet.next_event("list")
            assert not await running.daemon.reload()
            lines = [r.getMessage() for r in running.events.named("reload-failed")]
            assert lines == [f"config error, keeping the running config: {line}" for line in ERRORS]
            assert running.daemon.config == config
    finally:
        await kubelet.stop()
