"""`probe` and `doctor` describe the daemon that runs (its config, its last reload), and say how the
file on disk differs from it; with no daemon running they read the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from ate_devplugd import config as configmod
from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Finding, Level
from tests.support import (
    RESOURCE,
    FakeKernel,
    daemon_in_process,
    kvm_config,
    run_cli,
    started_kubelet,
    subprocess_env,
    write_config,
)

KVM = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {count}\n'


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


async def probe(config: Path, run_dir: Path) -> tuple[int, str, str]:
    env = subprocess_env(RUNTIME_DIRECTORY=str(run_dir))
    return await run_cli("probe", "--config", str(config), "--timeout", "3", env=env)


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The daemon's runtime directory, where the commands of this test look for it."""
    path = tmp_path / "run"
    path.mkdir()
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(path))
    return path


async def test_after_a_refused_mode_change(
    tmp_path: Path, run_dir: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """`mode = "dra"` refused by a reload: probe queries the device-plugin daemon that serves (exit 0),
    says the file differs and names the refused reload; doctor describes that daemon (running, its socket
    answering) and WARNs of the file and the reload."""
    config = kvm_config(plugin_dir, fake_root, count=8)
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, 'mode = "dra"\n' + KVM.format(count=8))
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(
            config,
            kernel,
            reload_config=lambda: configmod.load(path),
            running_config=run_dir / "running-config.toml",
            reload_result=run_dir / "reload-result.json",
        ) as running:
            await kubelet.next_event("list")
            assert not await running.daemon.reload()
            status, out, err = await probe(path, run_dir)
            assert status == 0, (out, err)
            (row,) = [line for line in out.splitlines() if line.startswith(RESOURCE)]
            assert "8/8" in row.split(), out
            assert "the file on disk differs from what runs: mode = 'dra' (restart to apply); [dra] added" in err
            assert (
                "its last reload was not applied: reload 1 refused: mode = 'dra' (running: 'device-plugin')" in err
            ), err
            found = by_check(await examine(path, Node(kernel=kernel, find_kubelet=lambda: None)))
            assert found["config"].level is Level.OK and "device-plugin mode" in found["config"].message
            assert found["config file"].level is Level.WARN
            assert "mode = 'dra' (restart to apply)" in found["config file"].message
            assert found["config file"].remedy == "systemctl restart ate-devplugd"
            assert found["reload"].level is Level.WARN and "reload 1 refused" in found["reload"].message
            assert found["daemon"].level is Level.OK, found["daemon"]
            assert found[f"socket {RESOURCE}"].level is Level.OK, found[f"socket {RESOURCE}"]
    finally:
        await kubelet.stop()


async def test_after_a_normal_reload(
    tmp_path: Path, run_dir: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """An applied reload: what runs is the file; nothing differs, nothing is refused."""
    config = kvm_config(plugin_dir, fake_root, count=8)
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, KVM.format(count=4))
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(
            config,
            kernel,
            reload_config=lambda: configmod.load(path),
            running_config=run_dir / "running-config.toml",
            reload_result=run_dir / "reload-result.json",
        ) as running:
            await kubelet.next_event("list")
            assert await running.daemon.reload()
            status, out, err = await probe(path, run_dir)
            assert status == 0 and err == "", (out, err)
            (row,) = [line for line in out.splitlines() if line.startswith(RESOURCE)]
            assert "4/4" in row.split(), out
            found = by_check(await examine(path, Node(kernel=kernel, find_kubelet=lambda: None)))
            assert found["config"].level is Level.OK and "running daemon's" in found["config"].message
            assert "config file" not in found and "reload" not in found
            # The file changed again, not reloaded: a reload applies it.
            path.write_text(path.read_text().replace("count = 4", "count = 2"))
            _, _, err = await probe(path, run_dir)
            assert "device ate.dev/kvm changed (reload to apply)" in err, err
    finally:
        await kubelet.stop()


async def test_no_daemon_reads_the_file(tmp_path: Path, run_dir: Path, plugin_dir: Path, fake_root: Path) -> None:
    """No daemon holds the lock (a copy left behind is not one): the file, as check-config reads it."""
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, 'mode = "dra"\n' + KVM.format(count=8))
    (run_dir / "running-config.toml").write_text(configmod.render(kvm_config(plugin_dir, fake_root)))
    found = by_check(await examine(path, Node(kernel=FakeKernel(), find_kubelet=lambda: None)))
    assert found["config"].message == f"{path}: 1 device(s), dra mode"
    assert found["daemon"].level is Level.FAIL and "config file" not in found
    status, out, err = await probe(path, run_dir)
    assert status == 1 and "differs" not in err, (out, err)
