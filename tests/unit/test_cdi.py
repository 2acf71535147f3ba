"""CDI specs as the daemon writes them: content, file, when they are written again, and what happens
when they cannot be."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ate_devplugd.config import device as device_config
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.node import cdi, cdispec
from ate_devplugd.node.devices import Presence, Resource
from tests.support import recording_events

KVM = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True)


def present(config: DeviceConfig, devnum: tuple[int, int] = (10, 232)) -> Resource:
    resource = Resource(config)
    resource.update(Presence(True, True, "character device", devnum=devnum))
    return resource


class TestSpec:
    def test_every_field_written(self) -> None:
        """cdiVersion 0.3.0, the kind, one device named after the node, type, numbers, rw, fileMode as a
        number; uid and gid only when configured."""
        assert cdispec.spec(KVM, 10, 232) == {
            "cdiVersion": "0.3.0",
            "kind": "ate.dev/kvm",
            "devices": [
                {
                    "name": "kvm",
                    "containerEdits": {
                        "deviceNodes": [
                            {
                                "path": "/dev/kvm",
                                "type": "c",
                                "major": 10,
                                "minor": 232,
                                "permissions": "rw",
                                "fileMode": 438,
                            }
                        ]
                    },
                }
            ],
        }
        owned = DeviceConfig(
            "ate.dev/kvm", "/dev/kvm", cdi=True, container_mode=0o660, container_uid=0, container_gid=107
        )
        node = cdispec.spec(owned, 10, 232)["devices"][0]["containerEdits"]["deviceNodes"][0]
        assert (node["fileMode"], node["uid"], node["gid"]) == (0o660, 0, 107)

    def test_names(self, tmp_path: Path) -> None:
        """The qualified name Allocate sends, and the spec's file name (vendor-class.json)."""
        tun = DeviceConfig("ate.dev/tun", "/dev/net/tun", cdi=True)
        assert device_config.qualified_name(KVM) == "ate.dev/kvm=kvm"
        assert device_config.qualified_name(tun) == "ate.dev/tun=tun"
        assert cdispec.spec_path(str(tmp_path), tun) == str(tmp_path / "ate.dev-tun.json")


class TestCdiSpecs:
    def test_written_before_use_then_named(self, tmp_path: Path) -> None:
        """A present CDI resource gets its spec (mode 0644, whatever the umask) and its CDI name."""
        specs = cdi.CdiSpecs(str(tmp_path / "cdi"))
        resource = present(KVM)
        old = os.umask(0o077)
        try:
            specs.sync(resource)
        finally:
            os.umask(old)
        path = tmp_path / "cdi" / "ate.dev-kvm.json"
        assert json.loads(path.read_text()) == cdispec.spec(KVM, 10, 232)
        assert path.stat().st_mode & 0o777 == 0o644
        assert resource.cdi_device == "ate.dev/kvm=kvm"
        assert [p.name for p in path.parent.iterdir()] == ["ate.dev-kvm.json"], "no temp file left"

    def test_not_written_without_cdi_or_before_the_device_is_seen(self, tmp_path: Path) -> None:
        """cdi = false writes nothing; nor does a CDI device never seen present (there are no numbers)."""
        specs = cdi.CdiSpecs(str(tmp_path))
        plain = present(DeviceConfig("ate.dev/kvm", "/dev/kvm"))
        specs.sync(plain)
        absent = Resource(KVM)
        absent.update(Presence(False, False, "does not exist"))
        specs.sync(absent)
        assert list(tmp_path.iterdir()) == []
        assert plain.cdi_device is None and absent.cdi_device is None

    def test_follows_numbers_and_config_only(self, tmp_path: Path) -> None:
        """Written again when the node's major:minor or the table changes; not when nothing did, nor when
        the device goes away (the spec stays for the containers that hold it)."""
        specs = cdi.CdiSpecs(str(tmp_path))
        resource = present(KVM)
        path = tmp_path / "ate.dev-kvm.json"
        specs.sync(resource)
        inode = path.stat().st_ino
        specs.sync(resource)
        resource.update(Presence(False, False, "gone"))
        specs.sync(resource)
        assert path.stat().st_ino == inode, "rewritten although nothing changed"
        resource.update(Presence(True, True, "back", devnum=(10, 200)))
        specs.sync(resource)
        assert json.loads(path.read_text())["devices"][0]["containerEdits"]["deviceNodes"][0]["minor"] == 200
        resource.replace_config(DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_mode=0o600))
        specs.sync(resource)
        assert json.loads(path.read_text())["devices"][0]["containerEdits"]["deviceNodes"][0]["fileMode"] == 0o600

    def test_a_current_spec_is_left_alone(self, tmp_path: Path) -> None:
        """A restarted daemon finds its spec as it would write it: the file is not replaced."""
        cdi.CdiSpecs(str(tmp_path)).sync(present(KVM))
        inode = (tmp_path / "ate.dev-kvm.json").stat().st_ino
        resource = present(KVM)
        cdi.CdiSpecs(str(tmp_path)).sync(resource)
        assert (tmp_path / "ate.dev-kvm.json").stat().st_ino == inode
        assert resource.cdi_device == "ate.dev/kvm=kvm"

    async def test_unwritable_kept_trying_then_written(self, tmp_path: Path) -> None:
        """A file where cdi_dir should be: one warning with the cause, no CDI name, NOT_WRITTEN and why;
        tried again on a back-off (no event tells of the file's removal), written once it can be, and the
        owner told each time, outside a look."""
        directory = tmp_path / "cdi"
        directory.write_text("")
        changed: list[str] = []
        specs = cdi.CdiSpecs(str(directory), on_change=lambda r: changed.append(r.name))
        specs.apply(str(directory), (KVM,))
        resource = present(KVM)
        try:
            with recording_events() as events:
                for _ in range(3):
                    specs.sync(resource)
                (warning,) = events.named("cdi-failed")
                assert warning.levelno == logging.WARNING and f"{directory} is not a directory" in warning.getMessage()
                assert "spec-missing" in warning.getMessage() and "never granted" in warning.getMessage()
                assert resource.cdi_device is None
                assert specs.state("ate.dev/kvm") is cdispec.SpecState.NOT_WRITTEN
                assert specs.failure("ate.dev/kvm") == (
                    f"cannot write the CDI spec {directory}/ate.dev-kvm.json: {directory} is not a directory"
                )
                directory.unlink()
                written = await events.wait_for("cdi-spec", timeout=5)
                assert "it could not be written before" in written.getMessage()
            assert resource.cdi_device == "ate.dev/kvm=kvm" and (directory / "ate.dev-kvm.json").exists()
            assert specs.state("ate.dev/kvm") is cdispec.SpecState.OURS and specs.failure("ate.dev/kvm") == ""
            assert changed == ["ate.dev/kvm"]
        finally:
            specs.close()

    async def test_a_heal_that_cannot_write_says_so(self, tmp_path: Path) -> None:
        """The spec removed, and cdi_dir cannot be made again (a file there): the heal fails with the cause,
        the owner hears it, and the spec is back once the file goes."""
        directory = tmp_path / "cdi"
        directory.mkdir()
        changed: list[str] = []
        specs = cdi.CdiSpecs(str(directory), on_change=lambda r: changed.append(r.name))
        specs.apply(str(directory), (KVM,))
        resource = present(KVM)
        try:
            with recording_events() as events:
                specs.sync(resource)
                shutil.rmtree(directory)
                directory.write_text("")
                failed = await events.wait_for("cdi-failed", timeout=5)
                assert "is not a directory" in failed.getMessage()
                assert changed and resource.cdi_device is None and "not a directory" in specs.failure("ate.dev/kvm")
                directory.unlink()
                await events.wait_for(cdi.EVENT_RESTORED, timeout=5)
            assert specs.state("ate.dev/kvm") is cdispec.SpecState.OURS and resource.cdi_device == "ate.dev/kvm=kvm"
        finally:
            specs.close()

    async def test_a_directory_renamed_away(self, tmp_path: Path) -> None:
        """cdi_dir renamed away (mv, or the first of two renames): ``moved`` says when and which directory
        went; the spec is written into a new cdi_dir at once; a reload to another directory forgets it."""
        directory = tmp_path / "cdi"
        directory.mkdir()
        changed: list[str] = []
        specs = cdi.CdiSpecs(str(directory), on_change=lambda r: changed.append(r.name))
        specs.apply(str(directory), (KVM,))
        resource = present(KVM)
        try:
            with recording_events() as events:
                specs.sync(resource)
                old = os.stat(directory)
                assert specs.moved is None
                directory.rename(tmp_path / "cdi.old")
                await events.wait_for(cdi.EVENT_REPLACED, timeout=5)
                moved = specs.moved
                assert moved is not None and moved.identity == (old.st_dev, old.st_ino)
                assert moved.detail == f"{directory} was replaced (renamed away)"
                assert "ate.dev/kvm" in changed
                assert (directory / "ate.dev-kvm.json").exists() and os.stat(directory).st_ino != old.st_ino
                shutil.rmtree(tmp_path / "cdi.old")  # gone for good: still replaced (the runtime must restart)
                assert specs.moved == moved
            specs.apply(str(tmp_path / "elsewhere"), (KVM,))
            assert specs.moved is None
        finally:
            specs.close()

    async def test_removed_when_the_resource_leaves_or_stops_using_cdi(self, tmp_path: Path) -> None:
        """A reload that drops the resource, or turns its CDI off, removes its spec; others stay."""
        tun = DeviceConfig("ate.dev/tun", "/dev/net/tun", cdi=True)
        specs = cdi.CdiSpecs(str(tmp_path))
        kvm_resource, tun_resource = present(KVM), present(tun, (10, 200))
        specs.sync(kvm_resource)
        specs.sync(tun_resource)
        specs.apply(str(tmp_path), (KVM,))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ate.dev-kvm.json"]
        plain = DeviceConfig("ate.dev/kvm", "/dev/kvm")
        specs.apply(str(tmp_path), (plain,))
        kvm_resource.replace_config(plain)
        specs.sync(kvm_resource)
        assert list(tmp_path.iterdir()) == [] and kvm_resource.cdi_device is None


class TestSelfHealing:
    """A spec of ours removed, changed or broken on disk is written back at once (inotify on cdi_dir, a
    burst coalesced), said once per heal and counted; a look (every reload) does the same."""

    @staticmethod
    async def healed(specs: cdi.CdiSpecs, events: Any, counted: list[str], harm: Callable[[], None]) -> str:
        before = len(counted)
        harm()
        record = await events.wait_for(cdi.EVENT_RESTORED, timeout=5)
        assert record.levelno == logging.WARNING
        assert len(counted) == before + 1 and counted[-1] == "ate.dev/kvm"
        assert specs.state("ate.dev/kvm") is cdispec.SpecState.OURS
        return str(record.getMessage())

    async def test_removed_changed_invalid_each_written_back(self, tmp_path: Path) -> None:
        directory = tmp_path / "cdi"
        path = directory / "ate.dev-kvm.json"
        counted: list[str] = []
        specs = cdi.CdiSpecs(str(directory), counted.append)
        specs.apply(str(directory), (KVM,))
        resource = present(KVM)
        try:
            with recording_events() as events:
                specs.sync(resource)
                written = path.read_bytes()
                assert specs.state("ate.dev/kvm") is cdispec.SpecState.OURS
                msg = await self.healed(specs, events, counted, path.unlink)
                assert "was removed" in msg and path.read_bytes() == written
                other = json.dumps({**cdispec.spec(KVM, 10, 232), "kind": "ate.dev/other"})
                msg = await self.healed(specs, events, counted, lambda: path.write_text(other))
                assert "was changed" in msg and path.read_bytes() == written
                msg = await self.healed(specs, events, counted, lambda: path.write_text("{not json"))
                assert "made invalid" in msg and path.read_bytes() == written

                def burst() -> None:  # one tool's burst: one heal
                    path.unlink()
                    path.write_text("x")
                    path.unlink()

                await self.healed(specs, events, counted, burst)
                assert len(events.named(cdi.EVENT_RESTORED)) == 4 and len(counted) == 4
                msg = await self.healed(specs, events, counted, lambda: shutil.rmtree(directory))
                assert "made again" in msg and path.read_bytes() == written
                assert resource.cdi_device == "ate.dev/kvm=kvm"
                assert not events.named("cdi-spec-removed") and not events.named("cdi-failed")
        finally:
            specs.close()

    async def test_a_look_writes_it_back_without_a_watch(self, tmp_path: Path) -> None:
        """Every look (every reload looks) puts the spec back, even with no config change; it is counted."""
        counted: list[str] = []
        specs = cdi.CdiSpecs(str(tmp_path), counted.append)  # never applied: no watch
        resource = present(KVM)
        specs.sync(resource)
        (tmp_path / "ate.dev-kvm.json").unlink()
        assert specs.state("ate.dev/kvm") is cdispec.SpecState.REMOVED
        with recording_events() as events:
            specs.sync(resource)
        assert specs.state("ate.dev/kvm") is cdispec.SpecState.OURS and counted == ["ate.dev/kvm"]
        assert [r.getMessage() for r in events.named(cdi.EVENT_RESTORED)] == [
            f"the CDI spec {tmp_path}/ate.dev-kvm.json of ate.dev/kvm was removed; wrote it back"
        ]
        assert specs.state("ate.dev/tun") is cdispec.SpecState.NOT_WRITTEN

    async def test_other_files_and_our_own_write_do_not_heal(self, tmp_path: Path) -> None:
        counted: list[str] = []
        specs = cdi.CdiSpecs(str(tmp_path), counted.append)
        specs.apply(str(tmp_path), (KVM,))
        resource = present(KVM)
        try:
            with recording_events() as events:
                specs.sync(resource)
                (tmp_path / "other.json").write_text("{}")
                (tmp_path / "ate.dev-kvm.json").unlink()
                await events.wait_for(cdi.EVENT_RESTORED, timeout=5)
                specs.sync(resource)  # a look at a current spec: nothing
                assert counted == ["ate.dev/kvm"] and len(events.named(cdi.EVENT_RESTORED)) == 1
        finally:
            specs.close()
