"""`probe` and `doctor` describe the daemon that serves the config they are given (its config, its last
reload, by its record on the instance lock), and say how the file on disk differs from it, by value; with
no daemon for that config they read the file and name the daemons that serve other directories."""

from __future__ import annotations

import os
from pathlib import Path

from ate_devplugd import config as configmod
from ate_devplugd.commands import instance
from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Finding, Level
from tests.integration.dra_rig import dra_node
from tests.support import (
    RESOURCE,
    FakeKernel,
    daemon_in_process,
    kvm_config,
    run_cli,
    started_kubelet,
    write_config,
)

KVM = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = {count}\n'


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


async def probe(config: Path) -> tuple[int, str, str]:
    return await run_cli("probe", "--config", str(config), "--timeout", "3")


def no_kubelet(kernel: FakeKernel) -> Node:
    return Node(kernel=kernel, find_kubelet=lambda: None)


async def test_after_a_refused_mode_change(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """`mode = "dra"` refused by a reload: probe queries the device-plugin daemon that serves (exit 0),
    says the file differs and names the refused reload; doctor describes that daemon (running, its socket
    answering) and WARNs of the file (a new mode is switch-mode's, never a restart) and the reload."""
    config = kvm_config(plugin_dir, fake_root, count=8)
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, 'mode = "dra"\n' + KVM.format(count=8))
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(
            config, kernel, reload_config=lambda: configmod.load(path), source=path
        ) as running:
            await kubelet.next_event("list")
            assert not await running.daemon.reload()
            status, out, err = await probe(path)
            assert status == 0, (out, err)
            (row,) = [line for line in out.splitlines() if line.startswith(RESOURCE)]
            assert "8/8" in row.split(), out
            assert f"probing the running daemon (pid {os.getpid()}, device-plugin mode in {plugin_dir}" in err, err
            assert "the file on disk differs from what runs: mode = 'dra' (switch-mode to apply); [dra] added" in err
            assert (
                "its last reload was not applied: reload 1 refused: mode = 'dra' (running: 'device-plugin')" in err
            ), err
            found = by_check(await examine(path, no_kubelet(kernel)))
            assert found["config"].level is Level.OK and "device-plugin mode" in found["config"].message
            assert found["config file"].level is Level.WARN
            assert "mode = 'dra' (switch-mode to apply)" in found["config file"].message
            assert found["config file"].remedy == "ate-devplugd switch-mode dra"
            assert found["reload"].level is Level.WARN and "reload 1 refused" in found["reload"].message
            assert found["daemon"].level is Level.OK, found["daemon"]
            assert found[f"socket {RESOURCE}"].level is Level.OK, found[f"socket {RESOURCE}"]
            switch = found["switch-mode"]
            assert (
                switch.level is Level.WARN and "the file says mode dra, the daemon runs device-plugin" in switch.message
            )
    finally:
        await kubelet.stop()


async def test_after_a_normal_reload(tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
    """An applied reload: what runs is the file; nothing differs, nothing is refused."""
    config = kvm_config(plugin_dir, fake_root, count=8)
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, KVM.format(count=4))
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(config, kernel, reload_config=lambda: configmod.load(path)) as running:
            await kubelet.next_event("list")
            assert await running.daemon.reload()
            status, out, err = await probe(path)
            assert status == 0 and err == "", (out, err)
            (row,) = [line for line in out.splitlines() if line.startswith(RESOURCE)]
            assert "4/4" in row.split(), out
            found = by_check(await examine(path, no_kubelet(kernel)))
            assert found["config"].level is Level.OK and "running daemon's" in found["config"].message
            assert "config file" not in found and "reload" not in found
            # The file changed again, not reloaded: a reload applies it.
            path.write_text(path.read_text().replace("count = 4", "count = 2"))
            _, _, err = await probe(path)
            assert "device ate.dev/kvm changed (reload to apply)" in err, err
    finally:
        await kubelet.stop()


async def test_an_untouched_file_never_differs(
    tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
) -> None:
    """A file with `cdi = true` that leaves `container_mode` to its default, run as the daemon loaded it:
    probe and doctor find nothing that differs (compared by value, a default left unset is no difference)."""
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, KVM.format(count=8) + "cdi = true\n")
    config = configmod.load(path)
    kubelet = await started_kubelet(plugin_dir)
    try:
        async with daemon_in_process(config, kernel, reload_config=lambda: configmod.load(path), source=path):
            await kubelet.next_event("list")
            status, out, err = await probe(path)
            assert status == 0 and "differs" not in err, (out, err)
            found = by_check(await examine(path, no_kubelet(kernel)))
            assert "config file" not in found, found["config file"]
            assert found["switch-mode"].level is Level.OK
    finally:
        await kubelet.stop()


async def test_an_untouched_dra_file_never_differs(tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
    """DRA mode, whose devices all get a CDI spec (and its mode) without the file saying so, and whose Node
    name the host gave: the file that leaves all of that unset does not differ from what runs."""
    async with dra_node(kernel, fake_root) as node:
        await node.status("slice published")
        cfg, dra = node.config, node.config.dra
        assert dra is not None
        path = tmp_path / "dra.toml"
        path.write_text(
            f'mode = "dra"\nplugin_dir = "{cfg.plugin_dir}"\ndev_root = "{cfg.dev_root}"\ncdi_dir = "{cfg.cdi_dir}"\n'
            f'metrics_file = ""\nruntime_socket = "{cfg.runtime_socket}"\n\n'
            f'[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\n\n'
            f'[dra]\nnode_name = "{dra.node_name}"\nkubeconfig = "{dra.kubeconfig}"\n'
            f'kubelet_dir = "{dra.kubelet_dir}"\nsharing = "{dra.sharing}"\n'
        )
        found = await instance.find(path)
        assert found.running is not None and found.running.record.mode == "dra"
        assert found.differences == () and found.file_line() == "", found.differences


async def test_two_daemons_each_command_describes_its_own(tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
    """Two daemons on two plugin directories (a `make run` beside the installed one): probe and doctor given
    either config describe the daemon serving it, by its pid and directory; given a config no daemon
    serves, they say so and name both."""
    dirs = [tmp_path / "a" / "device-plugins", tmp_path / "b" / "device-plugins"]
    for d in dirs:
        d.mkdir(parents=True)
    paths = [
        write_config(d.parent / "c.toml", d, fake_root, KVM.format(count=n)) for d, n in zip(dirs, (4, 8), strict=True)
    ]
    kubelets = [await started_kubelet(d) for d in dirs]
    try:
        async with (
            daemon_in_process(configmod.load(paths[0]), kernel, source=paths[0]),
            daemon_in_process(configmod.load(paths[1]), kernel, source=paths[1]),
        ):
            for kubelet in kubelets:
                await kubelet.next_event("list")
            for d, path, units in zip(dirs, paths, ("4/4", "8/8"), strict=True):
                path.write_text(path.read_text() + "# touched, not changed\n")
                status, out, err = await probe(path)
                assert status == 0 and err == "", (out, err)
                (row,) = [line for line in out.splitlines() if line.startswith(RESOURCE)]
                assert units in row.split(), out
                found = by_check(await examine(path, no_kubelet(kernel)))
                assert found["daemon"].level is Level.OK
                assert f"device-plugin mode in {d}, " in found["daemon"].message, found["daemon"]
                assert f"from {path}" in found["daemon"].message, found["daemon"]
            lone = tmp_path / "c" / "device-plugins"
            lone.mkdir(parents=True)
            nobody = write_config(lone.parent / "c.toml", lone, fake_root)
            found = by_check(await examine(nobody, no_kubelet(kernel)))
            assert found["daemon"].level is Level.FAIL
            message = found["daemon"].message
            assert message.startswith(f"no ate-devplugd serves {lone}; running: "), message
            assert all(f"mode in {d}, " in message for d in dirs), message
            status, _, err = await probe(nobody)
            assert status == 1 and f"no ate-devplugd serves {lone}" in err, err
    finally:
        for kubelet in kubelets:
            await kubelet.stop()


async def test_no_daemon_reads_the_file(tmp_path: Path, plugin_dir: Path, fake_root: Path) -> None:
    """No daemon serves the file's directory: the file, as check-config reads it."""
    path = write_config(tmp_path / "c.toml", plugin_dir, fake_root, 'mode = "dra"\n' + KVM.format(count=8))
    found = by_check(await examine(path, no_kubelet(FakeKernel())))
    assert found["config"].message == f"{path}: 1 device(s), dra mode"
    assert found["daemon"].level is Level.FAIL and "config file" not in found
    status, out, err = await probe(path)
    assert status == 1 and "differs" not in err, (out, err)
