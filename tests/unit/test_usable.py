"""Advertised means usable (cri/usable.py): which device is withheld when, and the coalescing of changes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig, tables
from ate_devplugd.cri import usable
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport
from ate_devplugd.cri.rules import DeviceNode, SpecProblem, Trouble
from ate_devplugd.cri.usable import Need, Usability, decide, need, replacement_unfit, verdict
from ate_devplugd.node.cdi import DirMove
from ate_devplugd.node.cdispec import SpecState, spec_path
from ate_devplugd.node.devices import Presence, Resource, Withheld, Withholding
from tests.support import recording_events

NAME = "ate.dev/kvm=kvm"
PLAIN = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True)
REQUIRED = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, cdi_required=True)
OWNED = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_uid=1000)
NO_CDI = DeviceConfig("ate.dev/kvm", "/dev/kvm")


def report(verdict: CdiVerdict, reason: str = "x", since: float | None = None) -> RuntimeReport:
    return RuntimeReport(
        verdict, reason, socket="/run/containerd/containerd.sock", name="containerd", version="1.7.24", since=since
    )


APPLIED = report(CdiVerdict.APPLIED, "reads /etc/cdi")
OFF = report(CdiVerdict.NOT_APPLIED, "enable_cdi = false")
DIR = report(CdiVerdict.DIR_NOT_READ, "cdi_spec_dirs = [/x] leaves out /etc/cdi")
UNKNOWN = RuntimeReport(CdiVerdict.UNKNOWN, "no runtime has answered since the start: no runtime socket")
#: A runtime that answered, but whose handling of CDI is not known.
OTHER = RuntimeReport(CdiVerdict.UNKNOWN, "how docker treats CDI names is not known", name="docker", version="28")
KVM_NODE = DeviceNode("/dev/kvm", type="c", major=10, minor=232, file_mode=0o600, permissions="rw")


def problem(trouble: Trouble, name: str = NAME, nodes: tuple[DeviceNode, ...] = ()) -> SpecProblem:
    return SpecProblem(
        "/etc/cdi/other.json",
        trouble,
        name,
        "/etc/cdi/ate.dev-kvm.json",
        "bad" * (trouble is Trouble.REFUSED),
        nodes=nodes,
    )


def reason(w: Withholding | None) -> Withheld | None:
    return None if w is None else w.reason


class TestNeed:
    def test_the_cdi_choice(self) -> None:
        assert need(NO_CDI, "device-plugin") is Need.NONE
        assert need(PLAIN, "device-plugin") is Need.SPEC
        assert need(REQUIRED, "device-plugin") is Need.REQUIRED
        assert need(OWNED, "device-plugin") is Need.REQUIRED
        assert need(DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_gid=36), "x") is Need.REQUIRED
        # every table has a container mode (check-config writes the default out): it says nothing of the VMM
        assert need(DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_mode=0o660), "x") is Need.SPEC
        assert need(PLAIN, "dra") is Need.REQUIRED

    def test_cdi_required_in_toml(self) -> None:
        errors: list[str] = []
        (dev,) = tables([{"resource": "ate.dev/kvm", "path": "/dev/kvm", "cdi": "required"}], errors)
        assert not errors and dev.cdi and dev.cdi_required
        (dra,) = tables([{"resource": "ate.dev/kvm", "path": "/dev/kvm", "cdi": "required"}], errors, cdi_required=True)
        assert not errors and dra.cdi_required
        tables([{"resource": "ate.dev/kvm", "path": "/dev/kvm", "cdi": "yes"}], errors)
        assert errors == ["device[0] (ate.dev/kvm): cdi: must be true, false or 'required', not 'yes'"]
        errors.clear()
        tables([{"resource": "ate.dev/kvm", "path": "/dev/kvm", "cdi_required": True}], errors)
        assert errors == ["device[0] (ate.dev/kvm): unknown key 'cdi_required'"]


class TestDecide:
    @pytest.mark.parametrize("dev", [NO_CDI, PLAIN, REQUIRED, OWNED])
    @pytest.mark.parametrize("mode", ["device-plugin", "dra"])
    def test_not_checked_never_withholds(self, dev: DeviceConfig, mode: str) -> None:
        """No report: the check is off (no device uses CDI), so nothing is decided on it."""
        breaking = [problem(Trouble.CONFLICT), problem(Trouble.REFUSED)]
        assert decide(dev, mode, None, breaking, written=False, on_disk=False) is None

    @pytest.mark.parametrize("rep", [UNKNOWN, OTHER])
    def test_unknown_withholds_what_needs_cdi_applied(self, rep: RuntimeReport) -> None:
        """Advertised means usable: nothing says a runtime applies the name, so a device whose VMM needs it
        is not offered; one a root VMM opens through the DeviceSpec is."""
        for dev, mode in ((REQUIRED, "device-plugin"), (OWNED, "device-plugin"), (PLAIN, "dra")):
            got = decide(dev, mode, rep)
            assert reason(got) is Withheld.CDI_UNKNOWN
            assert got is not None and rep.reason in got.detail
        assert decide(PLAIN, "device-plugin", rep, [problem(Trouble.CONFLICT)]) is None
        assert decide(NO_CDI, "device-plugin", rep) is None

    def test_cdi_not_applied_and_dir_not_read(self) -> None:
        got = decide(REQUIRED, "device-plugin", OFF)
        assert reason(got) is Withheld.CDI_NOT_APPLIED
        assert got is not None and "containerd 1.7.24 ignores CDI" in got.detail
        assert reason(decide(OWNED, "device-plugin", OFF)) is Withheld.CDI_NOT_APPLIED
        assert reason(decide(PLAIN, "dra", OFF)) is Withheld.CDI_NOT_APPLIED
        # cdi = true with no container owner: a root VMM still gets the node from the DeviceSpec
        assert decide(PLAIN, "device-plugin", OFF) is None
        # a runtime that applies CDI names and does not read our directory fails the container: its own reason
        for dev in (PLAIN, REQUIRED):
            got = decide(dev, "device-plugin", DIR)
            assert reason(got) is Withheld.DIR_NOT_READ
            assert got is not None and "does not read our spec directory" in got.detail
            assert "applies CDI" not in got.detail
        assert decide(NO_CDI, "device-plugin", DIR) is None

    @pytest.mark.parametrize("dev", [PLAIN, REQUIRED])
    def test_spec_problems_withhold_where_the_runtime_applies_cdi(self, dev: DeviceConfig) -> None:
        for trouble, why in (
            (Trouble.CONFLICT, Withheld.SPEC_CONFLICT),
            (Trouble.REPLACES, Withheld.SPEC_REPLACED),
            (Trouble.REFUSED, Withheld.SPEC_INVALID),
        ):
            got = decide(dev, "device-plugin", APPLIED, [problem(trouble)])
            assert reason(got) is why
            assert got is not None and "/etc/cdi/other.json" in got.detail
        assert decide(dev, "device-plugin", APPLIED, [problem(Trouble.SHADOWED)]) is None
        assert decide(dev, "device-plugin", APPLIED, [problem(Trouble.CONFLICT, "ate.dev/other=x")]) is None
        assert reason(decide(dev, "device-plugin", APPLIED, on_disk=False)) is Withheld.SPEC_MISSING
        assert decide(dev, "device-plugin", APPLIED) is None
        # a conflict beside a replacing spec: the conflict is what the runtime does
        got = decide(dev, "device-plugin", APPLIED, [problem(Trouble.REPLACES), problem(Trouble.CONFLICT)])
        assert reason(got) is Withheld.SPEC_CONFLICT

    @pytest.mark.parametrize("dev", [PLAIN, REQUIRED])
    def test_a_replacing_node_the_vmm_opens_is_not_withheld(self, dev: DeviceConfig) -> None:
        """A later directory's spec for our name whose node has no owner and mode 0600: the runtime gives it
        to the container's user, whose VMM opens it (containerd 1.7.24, 2.1.9)."""
        fit = problem(Trouble.REPLACES, nodes=(KVM_NODE,))
        assert decide(dev, "device-plugin", APPLIED, [fit], devnum=(10, 232)) is None
        root_only = problem(Trouble.REPLACES, nodes=(KVM_NODE._replace(uid=0, gid=0),))
        got = decide(dev, "device-plugin", APPLIED, [root_only], devnum=(10, 232))
        assert reason(got) is Withheld.SPEC_REPLACED
        assert got is not None and "mode 0600 owned by 0:0, which the VMM cannot open" in got.detail

    def test_replacement_unfit(self) -> None:
        devnum = (10, 232)
        owned = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_uid=1000, container_gid=1000)
        cases: list[tuple[DeviceConfig, DeviceNode, str]] = [
            (PLAIN, KVM_NODE, ""),
            (PLAIN, KVM_NODE._replace(major=None, minor=None), ""),  # the host's node at our path
            (PLAIN, KVM_NODE._replace(file_mode=0o660, uid=0), ""),  # the container's group
            (PLAIN, KVM_NODE._replace(file_mode=0o606, uid=0, gid=0), ""),  # others may
            (owned, KVM_NODE._replace(uid=1000, gid=0), ""),  # the VMM the table declares
            (PLAIN, KVM_NODE._replace(uid=1000), "owned by 1000:-"),  # a uid the table does not declare
            (PLAIN, KVM_NODE._replace(file_mode=0o400), "cannot open"),
            (PLAIN, KVM_NODE._replace(file_mode=None), "no fileMode"),
            (PLAIN, KVM_NODE._replace(minor=233), "another device"),
            (PLAIN, KVM_NODE._replace(major=None, minor=None, host_path="/dev/null"), "the host's /dev/null"),
            (PLAIN, KVM_NODE._replace(type="b"), "not a character device"),
            (PLAIN, KVM_NODE._replace(permissions="r"), "lacks the rw"),
            (PLAIN, KVM_NODE._replace(path="/dev/kvm0"), "no node at /dev/kvm"),
        ]
        for dev, node, why in cases:
            got = replacement_unfit(dev, (node,), devnum)
            assert why in got if why else got == "", (node, got)
        assert replacement_unfit(PLAIN, (KVM_NODE._replace(permissions=""),), devnum) == ""  # rwm by default
        assert "another device" in replacement_unfit(PLAIN, (KVM_NODE,), None)

    def test_spec_not_written(self) -> None:
        """Allocate names no CDI device: the DeviceSpec is all a container gets; the cause is said."""
        got = decide(REQUIRED, "device-plugin", APPLIED, written=False, failure="cannot write x: No space left")
        assert reason(got) is Withheld.SPEC_MISSING
        assert got is not None and got.detail.endswith("cannot write x: No space left")
        assert decide(PLAIN, "device-plugin", APPLIED, [problem(Trouble.CONFLICT)], written=False) is None

    def test_a_replaced_directory(self) -> None:
        replaced = "/run/cdi was replaced (renamed away): restart the runtime"
        for dev in (PLAIN, REQUIRED):
            got = decide(dev, "device-plugin", APPLIED, [problem(Trouble.REPLACES)], dir_replaced=replaced)
            assert got == Withholding(Withheld.SPEC_DIR_REPLACED, replaced)
        assert decide(PLAIN, "device-plugin", OFF, dir_replaced=replaced) is None  # the DeviceSpec's node

    def test_no_cdi_is_never_withheld(self) -> None:
        assert decide(NO_CDI, "device-plugin", APPLIED, [problem(Trouble.CONFLICT)], on_disk=False) is None

    def test_metric_verdict(self) -> None:
        assert verdict(None) is None
        assert verdict(OFF, [Withheld.SPEC_CONFLICT]) == "not_applied"
        assert verdict(APPLIED) == "applied"
        assert verdict(APPLIED, [Withheld.SPEC_REPLACED]) == "spec_replaced"
        assert verdict(APPLIED, [Withheld.SPEC_INVALID]) == "spec_invalid"
        assert verdict(APPLIED, [Withheld.SPEC_REPLACED, Withheld.SPEC_CONFLICT]) == "spec_conflict"
        assert verdict(APPLIED, [Withheld.SPEC_MISSING]) == "spec_missing"
        assert verdict(APPLIED, [], missing=True) == "spec_missing"
        assert verdict(APPLIED, [Withheld.SPEC_DIR_REPLACED, Withheld.SPEC_MISSING]) == "spec_dir_replaced"
        assert verdict(UNKNOWN, [Withheld.CDI_UNKNOWN]) == "unknown"
        assert set(usable.VERDICTS) >= {"applied", "unknown", "spec_conflict", "spec_missing", "spec_dir_replaced"}


# -- Usability: the decisions applied, offers held ------------------------------------------------------------


class FakeDevices:
    """What ``Usability`` reads of the ``DeviceWatch``: the registry, each spec's state and failure, the move."""

    def __init__(self, resources: dict[str, Resource], cdi_dir: Path) -> None:
        self.registry = SimpleNamespace(resources=resources)
        self.cdi_dir = cdi_dir
        self.failures: dict[str, str] = {}
        self.spec_dir_moved: DirMove | None = None

    def spec_state(self, name: str) -> SpecState:
        resource = self.registry.resources[name]
        path = Path(spec_path(str(self.cdi_dir), resource.config))
        return SpecState.OURS if path.exists() else SpecState.REMOVED

    def spec_failure(self, name: str) -> str:
        return self.failures.get(name, "")


class Rig:
    """One resource seen with its spec on disk, a Usability with a short hold, and what it reported."""

    def __init__(self, tmp_path: Path, dev: DeviceConfig = REQUIRED, hold: float = 0.05) -> None:
        self.config = Config(devices=(dev,), cdi_dir=str(tmp_path))
        self.resource = Resource(dev)
        self.resource.update(Presence(True, True, "ok", devnum=(10, 232)))
        self.resource.cdi_device = NAME
        Path(spec_path(str(tmp_path), dev)).write_text("{}")
        self.devices = FakeDevices({dev.resource: self.resource}, tmp_path)
        self.changes: list[tuple[Withholding | None, str | None, float]] = []
        self.verdicts: list[str | None] = []
        self.changed = asyncio.Event()
        self.usable = Usability(self._changed, lambda v, _runtime: self.verdicts.append(v), hold=hold)

    def _changed(self, resource: Resource, event: str | None) -> None:
        self.changes.append((resource.withheld, event, asyncio.get_running_loop().time()))
        self.changed.set()

    def update(self, rep: RuntimeReport | None, problems: list[SpecProblem] | None = None) -> None:
        """One update; ``next_change`` then waits for a change it makes (at once, or once held)."""
        self.changed.clear()
        devices: Any = self.devices
        self.usable.update(devices, self.config, rep, problems or [])

    async def next_change(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            await self.changed.wait()
        self.changed.clear()


class TestUsability:
    async def test_withheld_at_once_and_offered_again_after_the_hold(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        wakes = rig.resource.change_event()
        with recording_events() as events:
            rig.update(OFF)
            # at once: before update returns, so the next ListAndWatch answer already carries it
            assert reason(rig.resource.withheld) is Withheld.CDI_NOT_APPLIED and not rig.resource.usable
            assert wakes.is_set()  # the streams hear it
            assert rig.changes[-1][1] == usable.EVENT_WITHHELD
            (warned,) = events.named(usable.EVENT_WITHHELD)
            assert warned.levelname == "WARNING" and "cdi-not-applied" in warned.getMessage()
            start = asyncio.get_running_loop().time()
            rig.update(APPLIED)
            assert rig.resource.withheld is not None  # not at once
            await rig.next_change()
            assert rig.changes[-1][2] - start >= 0.05
            assert rig.resource.withheld is None and rig.resource.usable
            assert rig.changes[-1][1] == usable.EVENT_OFFERED
            assert [r.levelname for r in events.named(usable.EVENT_OFFERED)] == ["INFO"]
        assert rig.verdicts[0] == "not_applied" and rig.verdicts[-1] == "applied"
        rig.usable.close()

    async def test_a_flapping_runtime_is_never_offered_in_between(self, tmp_path: Path) -> None:
        """The verdict flips every third of the hold for a while: withheld at the first OFF, and offered
        only once APPLIED has held for the hold."""
        rig = Rig(tmp_path, hold=0.15)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        flips = [OFF, APPLIED, UNKNOWN, OFF, APPLIED, OFF, OTHER, OFF, APPLIED, OFF, APPLIED]
        last: list[float] = []
        offered_during: list[bool] = []

        def flip(index: int) -> None:
            offered_during.append(rig.resource.usable)
            rig.update(flips[index])
            if index + 1 < len(flips):
                loop.call_later(0.05, flip, index + 1)
            else:
                last.append(loop.time())
                done.set()

        flip(0)
        async with asyncio.timeout(5):
            await done.wait()
        assert offered_during[0] and not any(offered_during[1:])
        assert rig.resource.withheld is not None
        withheld = [c for c in rig.changes if c[1] == usable.EVENT_WITHHELD]
        assert [reason(c[0]) for c in withheld] == [Withheld.CDI_NOT_APPLIED, Withheld.CDI_UNKNOWN] * 2 + [
            Withheld.CDI_NOT_APPLIED
        ]
        await rig.next_change()
        assert rig.changes[-1][1] == usable.EVENT_OFFERED and rig.changes[-1][2] - last[0] >= 0.15
        assert rig.resource.withheld is None
        rig.usable.close()

    async def test_a_change_back_before_the_hold_cancels_the_offer(self, tmp_path: Path) -> None:
        """Withheld; the runtime says APPLIED for a moment, then OFF again: no offer."""
        rig = Rig(tmp_path, hold=0.05)
        rig.update(OFF)
        rig.update(APPLIED)
        rig.update(OFF)
        fired = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, fired.set)
        await fired.wait()  # a timer of its own, not a sleep: four holds have passed
        assert [c[1] for c in rig.changes] == [usable.EVENT_WITHHELD]
        rig.update(DIR)  # another reason: withheld again, at once
        assert reason(rig.resource.withheld) is Withheld.DIR_NOT_READ
        rig.usable.close()

    async def test_spec_missing_on_disk_or_unwritable_and_a_plain_cdi_device(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path, dev=PLAIN)
        rig.update(APPLIED, [problem(Trouble.CONFLICT)])
        assert reason(rig.resource.withheld) is Withheld.SPEC_CONFLICT
        Path(spec_path(str(tmp_path), PLAIN)).unlink()
        rig.update(APPLIED)
        assert reason(rig.resource.withheld) is Withheld.SPEC_MISSING
        assert rig.verdicts[-1] == "spec_missing"
        rig.update(OFF)  # a root VMM gets the node from the DeviceSpec
        await rig.next_change()
        assert rig.resource.withheld is None
        # cannot be written: Allocate names no CDI device, a root VMM opens the DeviceSpec's node, and the
        # metric says spec_missing
        rig.resource.cdi_device = None
        rig.devices.failures[PLAIN.resource] = "cannot write x: No space left on device"
        rig.update(APPLIED)
        assert rig.resource.withheld is None and rig.verdicts[-1] == "spec_missing"
        rig.usable.close()

    async def test_an_unwritable_spec_withholds_a_required_device_with_its_cause(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        rig.update(APPLIED)
        assert rig.resource.withheld is None
        rig.resource.cdi_device = None
        rig.devices.failures[REQUIRED.resource] = "cannot write x: /run/cdi is not a directory"
        rig.update(APPLIED)
        got = rig.resource.withheld
        assert got is not None and got.reason is Withheld.SPEC_MISSING and got.detail.endswith("not a directory")
        assert rig.verdicts[-1] == "spec_missing"
        rig.devices.failures.clear()
        rig.resource.cdi_device = NAME
        rig.update(APPLIED)
        await rig.next_change()
        assert rig.resource.withheld is None and rig.verdicts[-1] == "applied"
        rig.usable.close()

    async def test_a_replaced_directory_until_the_runtime_restarts(self, tmp_path: Path) -> None:
        """cdi_dir renamed away after the runtime started: withheld; a runtime that started after the move
        (its since later) follows the new directory: offered."""
        rig = Rig(tmp_path, dev=PLAIN)
        now = asyncio.get_running_loop().time()
        before = report(CdiVerdict.APPLIED, "reads /run/cdi", since=None)
        rig.update(before)
        rig.devices.spec_dir_moved = DirMove(now, "/run/cdi was replaced (renamed away)", (1, 2))
        rig.update(before)
        got = rig.resource.withheld
        assert got is not None and got.reason is Withheld.SPEC_DIR_REPLACED
        assert "after containerd 1.7.24 started" in got.detail and "restarted" in got.detail
        assert rig.verdicts[-1] == "spec_dir_replaced"
        rig.update(report(CdiVerdict.APPLIED, "reads /run/cdi", since=now - 1))  # the same runtime, seen older
        assert rig.resource.withheld is not None
        rig.update(report(CdiVerdict.APPLIED, "reads /run/cdi", since=now + 0.5))  # restarted after the move
        await rig.next_change()
        assert rig.resource.withheld is None and rig.verdicts[-1] == "applied"
        rig.usable.close()

    async def test_a_resource_gone_from_the_config_drops_its_pending_offer(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        rig.update(OFF)
        rig.update(APPLIED)
        rig.devices.registry.resources = {}
        rig.update(APPLIED)
        fired = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, fired.set)
        await fired.wait()  # a timer of its own, not a sleep: four holds have passed
        assert [c[1] for c in rig.changes] == [usable.EVENT_WITHHELD]
        assert rig.resource.withheld is not None
        rig.usable.close()
