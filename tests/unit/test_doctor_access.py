"""``doctor``'s access line: what a container asking for the resource will get, for each runtime verdict.

The host's node is a file in a temp directory with the mode under test; the verdicts are built as
``cri.facts.decide`` builds them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ate_devplugd.commands.doctor import access_finding
from ate_devplugd.commands.findings import Level
from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport
from ate_devplugd.cri.rules import SpecProblem, Trouble

CONTAINERD = {"socket": "/run/containerd/containerd.sock", "name": "containerd", "version": "1.7.24"}


def node(tmp_path: Path, mode: int) -> str:
    path = tmp_path / "kvm"
    path.write_text("")
    path.chmod(mode)
    return str(path)


def config(tmp_path: Path, mode: str = "device-plugin", *, spec: bool = True) -> Config:
    """A config whose cdi_dir holds our spec (as the daemon keeps it), unless ``spec`` is False."""
    (tmp_path / "cdi").mkdir(exist_ok=True)
    if spec:
        (tmp_path / "cdi" / "ate.dev-kvm.json").write_text("{}")
    return Config(plugin_dir=str(tmp_path / "dp"), cdi_dir=str(tmp_path / "cdi"), mode=mode)


def device(**keys: object) -> DeviceConfig:
    return dataclasses.replace(DeviceConfig("ate.dev/kvm", "/dev/kvm", cdi=True, container_mode=0o666), **keys)


def report(verdict: CdiVerdict, reason: str = "why", **keys: str) -> RuntimeReport:
    return RuntimeReport(verdict, reason, **({**CONTAINERD, **keys}))


class TestEachVerdict:
    def test_applied_the_specs_mode_and_owner(self, tmp_path: Path) -> None:
        """Applied: the spec's mode, and its owner (the container's user when the spec names none)."""
        found = access_finding(config(tmp_path), device(), node(tmp_path, 0o660), report(CdiVerdict.APPLIED))
        assert found.level is Level.OK
        assert "containers get 0666 (owned by the container's user) through CDI" in found.message
        owned = device(container_mode=0o600, container_uid=1000, container_gid=1000)
        found = access_finding(config(tmp_path), owned, node(tmp_path, 0o660), report(CdiVerdict.APPLIED))
        assert "containers get 0600 (owned by 1000:1000) through CDI" in found.message

    def test_not_applied_the_hosts_mode_and_owner(self, tmp_path: Path) -> None:
        """Not applied: the host's owner and mode, EACCES for a VMM that is not root when it is closed."""
        found = access_finding(config(tmp_path), device(), node(tmp_path, 0o660), report(CdiVerdict.NOT_APPLIED))
        assert found.level is Level.WARN
        assert found.message.startswith("host 0660 ")
        assert "gets EACCES: the runtime does not apply its CDI spec" in found.message
        assert "withholds" not in found.message  # cdi = true: a root VMM opens the host's node
        assert found.remedy.endswith('set cdi = "required" so that it is not offered meanwhile')
        found = access_finding(config(tmp_path), device(), node(tmp_path, 0o666), report(CdiVerdict.NOT_APPLIED))
        assert found.level is Level.OK
        assert "EACCES" not in found.message and "withholds" not in found.message
        assert "the runtime ignores the CDI spec, but any user in a container opens it" in found.message
        for dev in (device(cdi_required=True), device(container_uid=1000)):
            for mode in (0o660, 0o666):
                found = access_finding(config(tmp_path), dev, node(tmp_path, mode), report(CdiVerdict.NOT_APPLIED))
                assert found.level is Level.WARN
                assert found.message.endswith("the daemon withholds it (cdi-not-applied)")

    def test_spec_problems_agree_with_the_cdi_specs_lines(self, tmp_path: Path) -> None:
        """Applied, but another spec conflicts with ours: no "a VMM that is not root opens it" beside the
        spec FAIL; the access line FAILs too, and says the daemon withholds the device."""
        conflict = SpecProblem("/etc/cdi/other.json", Trouble.CONFLICT, "ate.dev/kvm=kvm", "/etc/cdi/ate.dev-kvm.json")
        for dev in (device(), device(cdi_required=True)):
            found = access_finding(config(tmp_path), dev, node(tmp_path, 0o660), report(CdiVerdict.APPLIED), [conflict])
            assert found.level is Level.FAIL
            assert "opens it" not in found.message
            assert "/etc/cdi/other.json also defines ate.dev/kvm=kvm" in found.message
            assert found.message.endswith("the daemon withholds it (spec-conflict)")
        shadowed = dataclasses.replace(conflict, trouble=Trouble.SHADOWED)
        found = access_finding(
            config(tmp_path), device(), node(tmp_path, 0o660), report(CdiVerdict.APPLIED), [shadowed]
        )
        assert found.level is Level.OK and "a VMM that is not root opens it" in found.message

    def test_not_applied_in_dra_mode_no_device(self, tmp_path: Path) -> None:
        found = access_finding(config(tmp_path, "dra"), device(), node(tmp_path, 0o666), report(CdiVerdict.NOT_APPLIED))
        assert found.level is Level.WARN
        assert "containers get no device" in found.message

    @pytest.mark.parametrize("mode", [0o660, 0o666])
    def test_dir_not_read_no_container(self, tmp_path: Path, mode: int) -> None:
        """Our directory not read: no container is created, whatever the host's mode (and no EACCES)."""
        found = access_finding(config(tmp_path), device(), node(tmp_path, mode), report(CdiVerdict.DIR_NOT_READ))
        assert found.level is Level.WARN
        assert f"no container that asks for it is created: the runtime does not read {tmp_path / 'cdi'}" in (
            found.message
        )
        assert "unresolvable CDI devices" in found.message
        assert "EACCES" not in found.message

    def test_unknown_cannot_tell(self, tmp_path: Path) -> None:
        """Unknown: cannot tell; "runtime not found" when no runtime answered; a device whose VMM needs its
        CDI name applied is withheld then (unknown is not usable)."""
        unknown = report(CdiVerdict.UNKNOWN, "how crun treats CDI names is not known", name="crun")
        found = access_finding(config(tmp_path), device(), node(tmp_path, 0o660), unknown)
        assert found.level is Level.WARN
        assert found.message.endswith("cannot tell what containers get (see runtime)")
        assert "EACCES" not in found.message
        absent = RuntimeReport(CdiVerdict.UNKNOWN, "no runtime socket at /run/containerd/containerd.sock")
        found = access_finding(config(tmp_path), device(), node(tmp_path, 0o660), absent)
        assert found.message.endswith("cannot tell what containers get (runtime not found)")
        found = access_finding(config(tmp_path), device(cdi_required=True), node(tmp_path, 0o660), absent)
        assert found.message.endswith("(runtime not found); the daemon withholds it (cdi-unknown)")

    def test_our_spec_not_on_disk(self, tmp_path: Path) -> None:
        """Applied, but our spec is not there: no container resolves the name; the daemon withholds it."""
        cfg = config(tmp_path, spec=False)
        found = access_finding(cfg, device(cdi_required=True), node(tmp_path, 0o660), report(CdiVerdict.APPLIED))
        assert found.level is Level.FAIL and found.message.endswith("the daemon withholds it (spec-missing)")

    def test_no_cdi_for_it(self, tmp_path: Path) -> None:
        """A resource without CDI: the host's owner and mode whatever the runtime does."""
        plain = device(cdi=False)
        found = access_finding(config(tmp_path), plain, node(tmp_path, 0o660), report(CdiVerdict.APPLIED))
        assert found.level is Level.WARN
        assert "gets EACCES; no CDI for it" in found.message
        assert found.remedy == 'set cdi = "required" for it (README: Non-root sandboxes)'
        assert os.stat(tmp_path / "kvm").st_mode & 0o777 == 0o660


def test_the_kvm_remedy_is_the_nodes_architectures() -> None:
    """A missing /dev/kvm: a module to load on amd64; on arm64, whose Debian kernel has KVM built in, a boot
    at EL2 (there is no module to load)."""
    from ate_devplugd.commands.doctor import _load_kvm_remedy, arm64

    assert "kvm_intel or kvm_amd" in _load_kvm_remedy("x86_64")
    assert arm64("aarch64") and not arm64("x86_64")
    remedy = _load_kvm_remedy("aarch64")
    assert "EL2" in remedy and "modprobe" not in remedy
