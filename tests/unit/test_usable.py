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
from ate_devplugd.cri.rules import SpecProblem, Trouble
from ate_devplugd.cri.usable import Need, Usability, decide, need, verdict
from ate_devplugd.node.cdi import spec_path
from ate_devplugd.node.devices import Presence, Resource, Withheld, Withholding
from tests.support import recording_events

NAME = "ate.dev/kvm=kvm"
PLAIN = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True)
REQUIRED = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, cdi_required=True)
OWNED = DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_uid=1000)
NO_CDI = DeviceConfig("ate.dev/kvm", "/dev/kvm")


def report(verdict: CdiVerdict, reason: str = "x") -> RuntimeReport:
    return RuntimeReport(verdict, reason, socket="/run/containerd/containerd.sock", name="containerd", version="1.7.24")


APPLIED = report(CdiVerdict.APPLIED, "reads /etc/cdi")
OFF = report(CdiVerdict.NOT_APPLIED, "enable_cdi = false")
DIR = report(CdiVerdict.DIR_NOT_READ, "cdi_spec_dirs = [/x] leaves out /etc/cdi")
UNKNOWN = RuntimeReport(CdiVerdict.UNKNOWN, "no runtime socket")


def problem(trouble: Trouble, name: str = NAME) -> SpecProblem:
    return SpecProblem(
        "/etc/cdi/other.json", trouble, name, "/etc/cdi/ate.dev-kvm.json", "bad" * (trouble is Trouble.REFUSED)
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
    def test_unknown_or_no_runtime_never_withholds(self, dev: DeviceConfig, mode: str) -> None:
        breaking = [problem(Trouble.CONFLICT), problem(Trouble.REFUSED)]
        for rep in (None, UNKNOWN):
            assert decide(dev, mode, rep, breaking, written=False, on_disk=False) is None

    def test_cdi_not_applied(self) -> None:
        for rep in (OFF, DIR):
            got = decide(REQUIRED, "device-plugin", rep)
            assert reason(got) is Withheld.CDI_NOT_APPLIED
            assert got is not None and "containerd 1.7.24" in got.detail
            assert reason(decide(OWNED, "device-plugin", rep)) is Withheld.CDI_NOT_APPLIED
            assert reason(decide(PLAIN, "dra", rep)) is Withheld.CDI_NOT_APPLIED
        # cdi = true with no container owner or mode: a root VMM still gets the node from the DeviceSpec
        assert decide(PLAIN, "device-plugin", OFF) is None
        # but a runtime that applies CDI names and cannot find our spec fails the container
        assert reason(decide(PLAIN, "device-plugin", DIR)) is Withheld.CDI_NOT_APPLIED
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
        # a conflict beside our missing spec: the conflict is what the runtime does
        got = decide(dev, "device-plugin", APPLIED, [problem(Trouble.REPLACES), problem(Trouble.CONFLICT)])
        assert reason(got) is Withheld.SPEC_CONFLICT

    def test_spec_not_written(self) -> None:
        """Allocate names no CDI device: the DeviceSpec is all a container gets."""
        assert reason(decide(REQUIRED, "device-plugin", APPLIED, written=False)) is Withheld.SPEC_MISSING
        assert decide(PLAIN, "device-plugin", APPLIED, [problem(Trouble.CONFLICT)], written=False) is None

    def test_no_cdi_is_never_withheld(self) -> None:
        assert decide(NO_CDI, "device-plugin", APPLIED, [problem(Trouble.CONFLICT)], on_disk=False) is None

    def test_metric_verdict(self) -> None:
        assert verdict(None, []) is None
        assert verdict(OFF, [problem(Trouble.CONFLICT)]) == "not_applied"
        assert verdict(APPLIED, []) == "applied"
        assert verdict(APPLIED, [problem(Trouble.SHADOWED)]) == "applied"
        assert verdict(APPLIED, [problem(Trouble.REPLACES)]) == "spec_replaced"
        assert verdict(APPLIED, [problem(Trouble.REFUSED)]) == "spec_invalid"
        assert verdict(APPLIED, [problem(Trouble.REPLACES), problem(Trouble.CONFLICT)]) == "spec_conflict"
        assert verdict(APPLIED, [], missing=True) == "spec_missing"
        assert set(usable.VERDICTS) >= {"applied", "unknown", "spec_conflict", "spec_missing"}


# -- Usability: the decisions applied, coalesced ------------------------------------------------------------


class Rig:
    """One resource seen with its spec on disk, a Usability with a short hold, and what it reported."""

    def __init__(self, tmp_path: Path, dev: DeviceConfig = REQUIRED, hold: float = 0.05) -> None:
        self.config = Config(devices=(dev,), cdi_dir=str(tmp_path))
        self.resource = Resource(dev)
        self.resource.update(Presence(True, True, "ok", devnum=(10, 232)))
        self.resource.cdi_device = NAME
        Path(spec_path(str(tmp_path), dev)).write_text("{}")
        self.devices: Any = SimpleNamespace(registry=SimpleNamespace(resources={dev.resource: self.resource}))
        self.changes: list[tuple[Withholding | None, str | None, float]] = []
        self.verdicts: list[str | None] = []
        self.changed = asyncio.Event()
        self.usable = Usability(self._changed, lambda v, _runtime: self.verdicts.append(v), hold=hold)

    def _changed(self, resource: Resource, event: str | None) -> None:
        self.changes.append((resource.withheld, event, asyncio.get_running_loop().time()))
        self.changed.set()

    def update(self, rep: RuntimeReport | None, problems: list[SpecProblem] | None = None) -> None:
        self.usable.update(self.devices, self.config, rep, problems or [])

    async def next_change(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            await self.changed.wait()
        self.changed.clear()


class TestUsability:
    async def test_withheld_after_the_hold_and_offered_again(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        wakes = rig.resource.change_event()
        with recording_events() as events:
            start = asyncio.get_running_loop().time()
            rig.update(OFF)
            assert rig.resource.usable  # not at once
            await rig.next_change()
            assert rig.changes[-1][2] - start >= 0.05
            assert reason(rig.resource.withheld) is Withheld.CDI_NOT_APPLIED and not rig.resource.usable
            assert wakes.is_set()  # the streams hear it
            assert rig.changes[-1][1] == usable.EVENT_WITHHELD
            (warned,) = events.named(usable.EVENT_WITHHELD)
            assert warned.levelname == "WARNING" and "cdi-not-applied" in warned.getMessage()
            rig.update(APPLIED)
            await rig.next_change()
            assert rig.resource.withheld is None and rig.resource.usable
            assert rig.changes[-1][1] == usable.EVENT_OFFERED
            assert [r.levelname for r in events.named(usable.EVENT_OFFERED)] == ["INFO"]
        assert rig.verdicts == ["not_applied", "applied"]
        rig.usable.close()

    async def test_a_flapping_runtime_does_not_flap_the_node(self, tmp_path: Path) -> None:
        """The verdict flips every third of the hold for a while: nothing is applied until it holds."""
        rig = Rig(tmp_path, hold=0.15)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        flips = [OFF, APPLIED, UNKNOWN, OFF, APPLIED, OFF, None, OFF, APPLIED, OFF]
        last: list[float] = []

        def flip(index: int) -> None:
            rig.update(flips[index])
            if index + 1 < len(flips):
                loop.call_later(0.05, flip, index + 1)
            else:
                last.append(loop.time())
                done.set()

        flip(0)
        async with asyncio.timeout(5):
            await done.wait()
        assert rig.changes == []
        await rig.next_change()
        assert len(rig.changes) == 1 and rig.changes[0][2] - last[0] >= 0.15
        assert reason(rig.resource.withheld) is Withheld.CDI_NOT_APPLIED
        rig.usable.close()

    async def test_a_change_back_before_the_hold_cancels_it(self, tmp_path: Path) -> None:
        """Withheld, then the runtime restarts (unknown for a moment) and says the same again: no offer."""
        rig = Rig(tmp_path, hold=0.05)
        rig.update(OFF)
        await rig.next_change()
        rig.update(UNKNOWN)
        rig.update(OFF)
        rig.update(DIR)  # another detail of the same reason is another withholding, held in turn
        await rig.next_change()
        assert [reason(c[0]) for c in rig.changes] == [Withheld.CDI_NOT_APPLIED] * 2
        assert rig.resource.withheld is not None and "leaves out" in rig.resource.withheld.detail
        rig.usable.close()

    async def test_spec_missing_on_disk_and_a_plain_cdi_device(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path, dev=PLAIN)
        rig.update(OFF)
        rig.update(APPLIED, [problem(Trouble.CONFLICT)])
        await rig.next_change()
        assert reason(rig.resource.withheld) is Withheld.SPEC_CONFLICT
        Path(spec_path(str(tmp_path), PLAIN)).unlink()
        rig.update(APPLIED)
        await rig.next_change()
        assert reason(rig.resource.withheld) is Withheld.SPEC_MISSING
        assert rig.verdicts[-1] == "spec_missing"
        rig.update(OFF)  # a root VMM gets the node from the DeviceSpec
        await rig.next_change()
        assert rig.resource.withheld is None
        rig.usable.close()

    async def test_a_resource_gone_from_the_config_drops_its_pending_change(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        rig.update(OFF)
        rig.devices.registry.resources = {}
        rig.update(OFF)
        fired = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, fired.set)
        await fired.wait()  # a timer of its own, not a sleep: four holds have passed
        assert rig.changes == [] and rig.resource.withheld is None
        rig.usable.close()
