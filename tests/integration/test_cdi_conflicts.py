"""Other CDI specs that define our names, and specs of ours the CDI library refuses: found in real spec
directories (files in a temp directory), by ``doctor`` and by the daemon (at start, and on the inotify
event of a file created, written or removed), with a fake runtime saying which directories it reads.
No root needed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Level
from ate_devplugd.config import Config, render
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.cri.check import EVENT_ENDPOINT
from ate_devplugd.cri.conflicts import EVENT_CONFLICT, EVENT_INVALID, dirs_to_read, find, scan
from ate_devplugd.cri.rules import Trouble
from ate_devplugd.node.cdi import EVENT_RESTORED
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.support import FakeKernel, NotifyReceiver, daemon_in_process, kvm_config

KVM = "ate.dev/kvm=kvm"
DEVICES = (DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True),)


def other_spec(kind: str = "ate.dev/kvm", name: str = "kvm") -> str:
    node = {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}
    return json.dumps(
        {"cdiVersion": "0.6.0", "kind": kind, "devices": [{"name": name, "containerEdits": {"deviceNodes": [node]}}]}
    )


def our_spec(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "cdi" / "ate.dev-kvm.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({**json.loads(other_spec()), **changes}))
    return path


class TestScan:
    def test_the_librarys_files_only(self, tmp_path: Path) -> None:
        """``*.json`` and ``*.yaml`` in each directory, by name; no subdirectory, no other name, and no
        directory that is itself a symlink; the priority is the directory's index."""
        first, second, linked = tmp_path / "a", tmp_path / "b", tmp_path / "link"
        first.mkdir()
        second.mkdir()
        (first / "z.json").write_text(other_spec("x.io/a"))
        (first / "b.yaml").write_text(
            "cdiVersion: 0.3.0\nkind: y.io/b\ndevices: [{name: d, containerEdits: {env: [A=1]}}]\n"
        )
        (first / "notes.txt").write_text(other_spec())
        (first / "sub.json").mkdir()
        (second / "c.json").write_text("{")
        linked.symlink_to(first)
        specs = scan([str(first), str(second), str(linked), str(tmp_path / "missing")])
        assert [(Path(s.path).name, s.priority, s.names) for s in specs] == [
            ("b.yaml", 0, ("y.io/b=d",)),
            ("z.json", 0, ("x.io/a=kvm",)),
            ("c.json", 1, ()),
        ]
        assert specs[2].error.startswith("not JSON")

    def test_conflict_in_our_directory(self, tmp_path: Path) -> None:
        ours = our_spec(tmp_path)
        (ours.parent / "other.json").write_text(other_spec())
        (problem,) = find([str(ours.parent)], str(ours.parent), DEVICES)
        assert (problem.path, problem.trouble, problem.name, problem.ours) == (
            str(ours.parent / "other.json"),
            Trouble.CONFLICT,
            KVM,
            str(ours),
        )

    def test_a_later_directory(self, tmp_path: Path) -> None:
        ours = our_spec(tmp_path)
        later = tmp_path / "later"
        later.mkdir()
        (later / "other.json").write_text(other_spec())
        (problem,) = find([str(ours.parent), str(later)], str(ours.parent), DEVICES)
        assert (problem.path, problem.trouble) == (str(later / "other.json"), Trouble.REPLACES)
        (problem,) = find([str(later), str(ours.parent)], str(ours.parent), DEVICES)
        assert problem.trouble is Trouble.SHADOWED

    def test_ours_refused(self, tmp_path: Path) -> None:
        ours = our_spec(tmp_path, cdiVersion="0.2.0")
        (problem,) = find([str(ours.parent)], str(ours.parent), DEVICES)
        assert (problem.path, problem.trouble) == (str(ours), Trouble.REFUSED)

    def test_same_file_under_two_names(self, tmp_path: Path) -> None:
        """Our directory read twice, once through a symlinked parent: the same file, no conflict."""
        ours = our_spec(tmp_path)
        (tmp_path / "run").symlink_to(tmp_path)
        assert find([str(ours.parent), str(tmp_path / "run" / "cdi")], str(ours.parent), DEVICES) == []


def config_for(tmp_path: Path, plugin_dir: Path, fake_root: Path) -> Config:
    return dataclasses.replace(
        kvm_config(plugin_dir, fake_root, cdi=True, container_mode=0o666), runtime_socket=str(tmp_path / "runtime.sock")
    )


async def runtime_reading(tmp_path: Path, *dirs: Path) -> FakeRuntime:
    info = containerd_info(True, [str(d) for d in dirs])
    return await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24", info).start()


class TestDaemon:
    async def test_a_spec_that_appears_is_warned_once(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A conflicting spec written into our directory: one warning naming it, STATUS says it (also when
        the file is written again); removed: STATUS clears; written again: warned again."""
        config = config_for(tmp_path, plugin_dir, fake_root)
        cdi = Path(config.cdi_dir)
        other = cdi / "other.json"
        runtime = await runtime_reading(tmp_path, cdi)
        notify = NotifyReceiver(tmp_path / "notify")
        part = f"| cdi spec conflict: {other} also defines {KVM}"
        try:
            async with daemon_in_process(config, kernel, notify=notify.path) as running:
                await notify.wait_for(lambda f: "applies CDI" in f.get("STATUS", ""))
                other.write_text(other_spec())
                event = await running.events.wait_for(EVENT_CONFLICT)
                assert event.levelname == "WARNING"
                assert str(other) in event.getMessage()
                assert "unresolvable CDI devices" in event.getMessage()
                await notify.wait_for(lambda f: f.get("STATUS", "").endswith(part))
                other.write_text(other_spec())
                await running.daemon.reload()
                assert len(running.events.named(EVENT_CONFLICT)) == 1
                other.unlink()
                await notify.wait_for(lambda f: "cdi spec" not in f.get("STATUS", "x"))
                other.write_text(other_spec())
                await notify.wait_for(lambda f: f.get("STATUS", "").endswith(part))
                assert len(running.events.named(EVENT_CONFLICT)) == 2
        finally:
            await runtime.stop()
            await notify.close()

    async def test_found_at_start_in_a_later_directory(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Already there when the daemon starts, in a directory the runtime reads after ours."""
        config = config_for(tmp_path, plugin_dir, fake_root)
        later = tmp_path / "later"
        later.mkdir()
        (later / "vendor.yaml").write_text(
            "cdiVersion: 0.5.0\nkind: ate.dev/kvm\ndevices: [{name: kvm, containerEdits: {env: [A=1]}}]\n"
        )
        runtime = await runtime_reading(tmp_path, Path(config.cdi_dir), later)
        notify = NotifyReceiver(tmp_path / "notify")
        try:
            async with daemon_in_process(config, kernel, notify=notify.path) as running:
                event = await running.events.wait_for(EVENT_CONFLICT)
                assert "containers get its device" in event.getMessage()
                await notify.wait_for(lambda f: f"cdi spec replaces: {later / 'vendor.yaml'}" in f.get("STATUS", ""))
                assert not running.events.named(EVENT_INVALID)
        finally:
            await runtime.stop()
            await notify.close()

    async def test_no_runtime_answering_cdi_dir_is_read(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """No runtime answering: the spec check reads our (non-default) cdi_dir, and a conflicting spec there
        is warned of; the daemon says which runtime socket it asks and why."""
        config = config_for(tmp_path, plugin_dir, fake_root)  # runtime.sock: nothing listens there
        cdi = Path(config.cdi_dir)
        async with daemon_in_process(config, kernel) as running:
            asking = await running.events.wait_for(EVENT_ENDPOINT)
            assert asking.getMessage() == f"cdi: asking {tmp_path}/runtime.sock (runtime_socket in our config)"
            await running.events.wait_for("cdi-runtime")  # the verdict: unknown
            (cdi / "other.json").write_text(other_spec())
            event = await running.events.wait_for(EVENT_CONFLICT)
            assert f"{cdi}/other.json also defines ate.dev/kvm=kvm" in event.getMessage()
            assert len(running.events.named(EVENT_ENDPOINT)) == 1

    async def test_our_spec_refused_is_written_back(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """Our spec changed by hand into one the library refuses: written back at once (one
        cdi-spec-restored warning), and STATUS ends with no spec problem."""
        config = config_for(tmp_path, plugin_dir, fake_root)
        runtime = await runtime_reading(tmp_path, Path(config.cdi_dir))
        notify = NotifyReceiver(tmp_path / "notify")
        ours = Path(config.cdi_dir) / "ate.dev-kvm.json"
        try:
            async with daemon_in_process(config, kernel, notify=notify.path) as running:
                await notify.wait_for(lambda f: "applies CDI" in f.get("STATUS", ""))
                written = ours.read_text()
                ours.write_text(written.replace('"0.3.0"', '"0.2.0"'))
                event = await running.events.wait_for(EVENT_RESTORED)
                assert f"{ours} of ate.dev/kvm was changed" in event.getMessage()
                assert ours.read_text() == written
                status = running.daemon.status_line()  # the spec check may have seen the broken one
                while "cdi spec refused" in status:
                    status = (await notify.wait_for(lambda f: "STATUS" in f))["STATUS"]
                assert "applies CDI" in status and "cdi spec" not in status, status
                assert not running.events.named(EVENT_CONFLICT)
                assert len(running.events.named(EVENT_RESTORED)) == 1
        finally:
            await runtime.stop()
            await notify.close()


class TestDoctor:
    async def test_fails_with_the_remedy(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        config = config_for(tmp_path, plugin_dir, fake_root)
        path = tmp_path / "config.toml"
        path.write_text(render(config))
        ours = our_spec(tmp_path)
        assert str(ours.parent) == config.cdi_dir
        (ours.parent / "other.json").write_text(other_spec())
        runtime = await runtime_reading(tmp_path, ours.parent)
        try:
            findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
        finally:
            await runtime.stop()
        (found,) = [f for f in findings if f.check == "cdi specs"]
        assert found.level is Level.FAIL
        assert found.message.startswith(f"{ours.parent / 'other.json'} also defines {KVM}")
        assert found.remedy.startswith(f"remove {ours.parent / 'other.json'}, or rename it")


def test_the_directories_read() -> None:
    """The runtime's directories where it said them (cdi_dir first where none of them is it); cdi_dir alone
    where it did not say."""
    assert dirs_to_read(None, "/srv/cdi") == ("/srv/cdi",)
    assert dirs_to_read(("/etc/cdi", "/var/run/cdi"), "/var/run/cdi") == ("/etc/cdi", "/var/run/cdi")
    assert dirs_to_read(("/etc/cdi", "/var/run/cdi"), "/run/cdi") == ("/etc/cdi", "/var/run/cdi")  # a symlink
    assert dirs_to_read(("/etc/cdi",), "/srv/cdi") == ("/srv/cdi", "/etc/cdi")
