"""CDI in a real container (podman 4.3.1): a spec grants /dev/kvm to a non-root process, and what podman refuses.

``TestDaemonWrittenSpec`` runs the daemon and gives podman the spec it wrote and the names its Allocate
sent; ``TestGuestBoots`` gives podman the whole Allocate answer (DeviceSpec and CDI name) and boots a
guest in the container as a non-root user. The other specs here are written by hand, as the daemon
writes them: one device ``kvm`` of kind ``ate.dev/kvm``, one character node with its major:minor read
from the host, ``rw``, and the container-side mode and owner. Each run sees only its own spec directory (tests.podman).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.podman import KvmCheck, NodeStat, Podman, PodmanRunError, kvm_spec, write_spec
from tests.support import KvmAllocation, allocated_kvm

DEVICE = "ate.dev/kvm=kvm"
#: A uid/gid that neither the host nor the image knows: only the node's "other" bits can let it in.
SANDBOX = (4242, 4242)
#: The VMM's user in the guest-boot tests: started as this uid:gid, as a pod's runAsUser/runAsGroup.
VMM_USER = (1000, 1000)
KVM_API_VERSION = 12


@pytest.fixture
def host_kvm() -> Iterator[NodeStat]:
    """The host's /dev/kvm before the test; checked unchanged after it."""
    before = NodeStat.of("/dev/kvm")
    yield before
    assert NodeStat.of("/dev/kvm") == before, "a container run changed the host's /dev/kvm"


def assert_rule(check: KvmCheck, node: NodeStat, access: str) -> None:
    """The container's cgroup allows exactly ``access`` on the node (where the rules are readable)."""
    if check.cgroup_devices is not None:
        assert f"c {node.major}:{node.minor} {access}" in check.cgroup_devices, check.cgroup_devices


class TestCdiGrant:
    async def test_non_root_opens_kvm_through_cdi(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        """A 0666 root:root node from the spec lets a process that dropped to a stranger's uid open /dev/kvm."""
        write_spec(tmp_path, kvm_spec(file_mode=0o666, uid=0, gid=0))
        check = await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert (check.uid, check.gid, check.groups) == (*SANDBOX, ())
        assert check.opened, check.raw
        assert check.api_version == KVM_API_VERSION
        assert check.node == NodeStat(0o666, 0, 0, host_kvm.major, host_kvm.minor)
        assert_rule(check, host_kvm, "rw")

    async def test_device_spec_alone_is_refused(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        """Without CDI the node keeps the host's mode and owner, so the same process gets EACCES."""
        check = await podman.run(devices=["/dev/kvm"], run_as=SANDBOX, spec_dir=tmp_path)
        assert check.node == host_kvm
        assert check.open_error == "EACCES", check.raw
        absent = await podman.run(run_as=SANDBOX, spec_dir=tmp_path)
        assert absent.node is None
        assert absent.stat_errno == errno.ENOENT

    async def test_spec_keeping_host_mode_is_refused(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        """A spec that carries the host's mode and owner injects the node, but the process gets EACCES."""
        write_spec(tmp_path, kvm_spec(file_mode=host_kvm.mode, uid=host_kvm.uid, gid=host_kvm.gid))
        check = await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert check.node == host_kvm
        assert check.open_error == "EACCES", check.raw
        assert_rule(check, host_kvm, "rw")

    async def test_cdi_node_replaces_the_device_spec_one(
        self, podman: Podman, tmp_path: Path, host_kvm: NodeStat
    ) -> None:
        """Given both (kubelet sends a DeviceSpec beside the CDI name), the container gets the spec's node."""
        write_spec(tmp_path, kvm_spec(file_mode=0o666, uid=0, gid=0))
        for order in (["/dev/kvm", DEVICE], [DEVICE, "/dev/kvm"]):
            check = await podman.run(devices=order, run_as=SANDBOX, spec_dir=tmp_path)
            assert check.node == NodeStat(0o666, 0, 0, host_kvm.major, host_kvm.minor), order
            assert check.opened, (order, check.raw)

    async def test_ownerless_node_goes_to_the_user(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        """A node without uid/gid is chowned to podman's --user, and gets mode 0666 without fileMode."""
        # podman 4.3.1's CDI library (0.5.2) leaves a missing fileMode to runc (0666); from CDI 1.1.0 the
        # library copies the host's mode instead, so a spec must always state fileMode.
        write_spec(tmp_path, kvm_spec(file_mode=None, uid=None, gid=None))
        check = await podman.run(cdi_devices=[DEVICE], user="4242:4242", spec_dir=tmp_path)
        assert check.node == NodeStat(0o666, *SANDBOX, host_kvm.major, host_kvm.minor)
        assert check.opened, check.raw
        as_root = await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert as_root.node == NodeStat(0o666, 0, 0, host_kvm.major, host_kvm.minor)


def only_podman_4(podman: Podman) -> None:
    """These are the limits of podman 4 (4.3.1 in Debian 12), which decide the daemon's cdiVersion;
    podman 5 (Debian 13) reads newer specs."""
    if podman.version[:1] != (4,):
        pytest.skip(f"podman {'.'.join(map(str, podman.version))}: the limits tested are podman 4's")


class TestCdiLimits:
    @pytest.mark.parametrize("version", ["0.3.0", "0.4.0", "0.5.0"])
    async def test_versions_accepted(self, podman: Podman, tmp_path: Path, version: str) -> None:
        """podman 4.3.1 loads a spec of cdiVersion 0.3.0 to 0.5.0 carrying fileMode, uid and gid."""
        write_spec(tmp_path, kvm_spec(version=version))
        check = await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert check.opened, check.raw

    @pytest.mark.parametrize("version", ["0.6.0", "0.7.0", "1.0.0", "v0.3.0"])
    async def test_versions_refused(self, podman: Podman, tmp_path: Path, version: str) -> None:
        """A newer cdiVersion makes podman 4.3.1 drop the spec, so the device is unresolvable."""
        only_podman_4(podman)
        write_spec(tmp_path, kvm_spec(version=version))
        with pytest.raises(PodmanRunError) as refused:
            await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert refused.value.returncode == 126
        assert refused.value.error == f"setting up CDI devices: unresolvable CDI devices {DEVICE}"
        assert f'invalid version "{version}"' in (refused.value.cdi_reason or ""), refused.value.stderr

    @pytest.mark.parametrize("version", ["0.5.0", "0.7.0"])
    async def test_additional_gids_refused(self, podman: Podman, tmp_path: Path, version: str) -> None:
        """additionalGids (CDI 0.7.0) is an unknown field to podman 4.3.1, whatever cdiVersion says."""
        only_podman_4(podman)
        write_spec(tmp_path, kvm_spec(version=version, edits_extra={"additionalGids": [4242]}))
        with pytest.raises(PodmanRunError) as refused:
            await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert 'unknown field "additionalGids"' in (refused.value.cdi_reason or ""), refused.value.stderr

    async def test_file_mode_must_be_a_number(self, podman: Podman, tmp_path: Path) -> None:
        """fileMode written as a string ("0666") makes the spec unparsable."""
        write_spec(tmp_path, kvm_spec(node_extra={"fileMode": "0666"}))
        with pytest.raises(PodmanRunError) as refused:
            await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert "cannot unmarshal string" in (refused.value.cdi_reason or ""), refused.value.stderr

    async def test_missing_spec_fails_the_container(self, podman: Podman, tmp_path: Path) -> None:
        """With no spec for the name, the container is not created at all (nothing is logged about it)."""
        with pytest.raises(PodmanRunError) as refused:
            await podman.run(cdi_devices=[DEVICE], run_as=SANDBOX, spec_dir=tmp_path)
        assert refused.value.returncode == 126
        assert refused.value.error == f"setting up CDI devices: unresolvable CDI devices {DEVICE}"
        assert refused.value.cdi_reason is None


class TestDaemonWrittenSpec:
    """The spec the daemon writes, read by the real consumer: what Allocate names, podman applies."""

    @staticmethod
    async def allocated_run(
        podman: Podman, tmp_path: Path, **device: Any
    ) -> tuple[KvmCheck, list[str], dict[str, Any]]:
        """The daemon (real kernel view, the host's /dev/kvm) with cdi = true; one Allocate; the run podman
        makes of its response's CDI names, as a process that dropped to a stranger's uid."""
        async with allocated_kvm(tmp_path, **device) as allocation:
            names, spec = allocation.cdi_names, allocation.spec()
        check = await podman.run(cdi_devices=names, run_as=SANDBOX, spec_dir=allocation.cdi_dir)
        return check, names, spec

    async def test_non_root_opens_kvm(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        """cdi = true: a process that is not root opens /dev/kvm (0666 in the container), gets API 12 and
        boots the guest."""
        check, names, spec = await self.allocated_run(podman, tmp_path)
        assert names == [DEVICE] and spec["cdiVersion"] == "0.3.0"
        assert check.opened and check.api_version == KVM_API_VERSION, check.raw
        assert check.guest is not None and check.guest.booted, check.raw
        assert check.node is not None and (check.node.mode, check.node.major, check.node.minor) == (
            0o666,
            host_kvm.major,
            host_kvm.minor,
        )
        assert_rule(check, host_kvm, "rw")

    async def test_host_mode_in_the_spec_is_refused(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        """A table that keeps the host's owner and mode: the node is there, the same process gets EACCES."""
        check, _, _ = await self.allocated_run(
            podman, tmp_path, container_mode=host_kvm.mode, container_uid=host_kvm.uid, container_gid=host_kvm.gid
        )
        assert check.node == host_kvm
        assert check.open_error == "EACCES", check.raw


def podman_devices(allocation: KvmAllocation) -> list[str]:
    """The Allocate answer's DeviceSpecs as podman's ``--device HOST:CONTAINER:PERMISSIONS``."""
    return [f"{d.host_path}:{d.container_path}:{d.permissions}" for d in allocation.device_specs]


class TestGuestBoots:
    """A VMM started as a non-root user (``--user 1000:1000``, no supplementary groups) runs a guest through
    exactly what the daemon's Allocate returned, the way kubelet hands it to a runtime: the DeviceSpec and
    the CDI name, with the daemon's own spec. Take the CDI name away and the same VMM gets EACCES; take
    both away and there is no node."""

    @staticmethod
    def assert_vmm_user(check: KvmCheck) -> None:
        """Started as VMM_USER with no group but its own (podman lists the primary gid as the one
        supplementary group; the kernel then checks nothing else)."""
        assert (check.uid, check.gid) == VMM_USER, check.raw
        assert set(check.groups) <= {VMM_USER[1]}, check.raw

    @staticmethod
    def host_node_closed(host_kvm: NodeStat) -> None:
        """The negatives mean something only where the host's node keeps strangers out (0660 root:kvm)."""
        assert host_kvm.mode & 0o007 == 0, f"the host's /dev/kvm is {host_kvm.mode:#o}: open to every user"

    async def test_vmm_boots_the_guest(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        async with allocated_kvm(tmp_path) as allocation:
            check = await podman.run(
                cdi_devices=allocation.cdi_names,
                devices=podman_devices(allocation),
                user=f"{VMM_USER[0]}:{VMM_USER[1]}",
                spec_dir=allocation.cdi_dir,
            )
        assert allocation.cdi_names == [DEVICE]
        self.assert_vmm_user(check)
        assert check.node is not None and (check.node.mode, check.node.major, check.node.minor) == (
            0o666,
            host_kvm.major,
            host_kvm.minor,
        ), check.raw
        assert check.guest is not None, check.raw
        assert check.guest.booted, check.guest
        print(f"podman {'.'.join(map(str, podman.version))}: the guest wrote {check.guest.output!r} and halted")

    async def test_device_spec_alone_gets_eacces(self, podman: Podman, tmp_path: Path, host_kvm: NodeStat) -> None:
        self.host_node_closed(host_kvm)
        async with allocated_kvm(tmp_path) as allocation:
            check = await podman.run(
                devices=podman_devices(allocation), user=f"{VMM_USER[0]}:{VMM_USER[1]}", spec_dir=allocation.cdi_dir
            )
        self.assert_vmm_user(check)
        assert check.node == host_kvm
        assert check.open_error == "EACCES", check.raw
        assert check.guest is None

    async def test_no_names_no_node(self, podman: Podman, tmp_path: Path) -> None:
        async with allocated_kvm(tmp_path) as allocation:
            check = await podman.run(user=f"{VMM_USER[0]}:{VMM_USER[1]}", spec_dir=allocation.cdi_dir)
        assert check.node is None and check.stat_errno == errno.ENOENT, check.raw
        assert check.open_error == "ENOENT" and check.guest is None
