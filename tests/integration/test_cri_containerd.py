"""kubelet's path into the runtime: the daemon's Allocate answer handed to containerd through CRI.

Kubelet does not run containers itself: for a container that asks for ``ate.dev/kvm`` it takes the
plugin's Allocate answer and sends the runtime a CRI ``CreateContainer`` whose ``devices`` are the
DeviceSpecs and whose ``CDI_devices`` are the CDI names (``kuberuntime_container.go``: makeDevices,
makeCDIDevices). These tests do the same against real containerd (tests.runtimes.containerd): the
daemon runs on the host's /dev/kvm with ``cdi = true`` and answers a real gRPC Allocate from the fake
kubelet; a pod on the node's network runs the checker as uid 1000, which boots a guest when
``/dev/kvm`` opens. Each test prints the CRI calls' times and the OCI spec's device entries.

- containerd 1.7 (Debian 13's 1.7.24) with ``enable_cdi = true`` applies the spec: the guest boots;
- the same containerd with ``enable_cdi = false`` drops the CDI name without a word: EACCES;
- containerd 1.6 (Debian 12's 1.6.20) has no CDI at all: its CRI API has no field 17, so the name is
  an unknown field, dropped as silently: EACCES;
- containerd 2.1 (forky/sid's 2.1.9), with its own version 3 config and with a version 2 file (which it
  migrates): CDI is on without a word in the file and the guest boots; ``enable_cdi = false``: EACCES; a
  ``cdi_spec_dirs`` without the daemon's directory: CreateContainer fails, ``unresolvable CDI devices``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.podman import NodeStat
from tests.runtimes.containerd import (
    VMM_USER,
    CheckerRun,
    ContainerdBuild,
    Images,
    oci_node,
    oci_rules,
    run_allocated,
    running,
)
from tests.support import allocated_kvm

DEVICE = "ate.dev/kvm=kvm"
#: What containerd 1.7 logs (info) when it applies a container's CDI names (pkg/cri/opts WithCDI).
CDI_LOG = "CDI devices from CRI Config.CDIDevices: [ate.dev/kvm=kvm]"


@pytest.fixture
def host_kvm() -> NodeStat:
    """The host's /dev/kvm, which must keep strangers out for the negatives to mean anything."""
    node = NodeStat.of("/dev/kvm")
    assert node.mode & 0o007 == 0, f"the host's /dev/kvm is {node.mode:#o}: open to every user"
    return node


async def allocate_and_run(
    containerd: ContainerdBuild, images: Images, tmp_path: Path, **cri_config: object
) -> tuple[CheckerRun, str, dict[str, object]]:
    """A containerd of its own (its CDI spec directory is where the daemon writes), the daemon's Allocate,
    and one pod as kubelet runs it with that answer. Returns the run, containerd's log and its CRI config."""
    cdi_dir = tmp_path / "cdi"  # the daemon's cdi_dir in allocated_kvm
    async with running(containerd, tmp_path / "containerd", images=[images.pause, images.checker], **cri_config) as rt:
        config = await rt.client.config()
        async with allocated_kvm(tmp_path) as allocation:
            assert allocation.cdi_dir == cdi_dir
            assert allocation.cdi_names == [DEVICE]
            run = await run_allocated(rt, allocation)
    print(run.summary())
    return run, rt.log(), config


def assert_vmm_user(run: CheckerRun) -> None:
    """The checker ran as the pod's user, with no group but its own."""
    assert run.check is not None, run
    assert (run.check.uid, run.check.gid) == VMM_USER, run.check.raw
    assert set(run.check.groups) <= {VMM_USER[1]}, run.check.raw


def assert_guest_boots(run: CheckerRun, log: str, host_kvm: NodeStat, *, logs_cdi: bool = True) -> None:
    """CDI applied: the spec's node (0666) replaced the DeviceSpec's, and uid 1000 booted the guest;
    ``logs_cdi``: containerd's info log names the device (1.7 does; 2.x logs it at debug level only)."""
    assert run.failed_call is None, run
    assert_vmm_user(run)
    assert run.check is not None and run.check.guest is not None, run.check
    assert run.check.guest.booted, run.check.guest
    (node,) = oci_node(run, "/dev/kvm")
    assert (node["type"], node["major"], node["minor"], node["fileMode"]) == (
        "c",
        host_kvm.major,
        host_kvm.minor,
        0o666,
    ), node
    # Both grants add the cgroup rule: the DeviceSpec's and the CDI spec's.
    assert oci_rules(run, host_kvm.major, host_kvm.minor) == ["rw", "rw"], run.oci_device_rules
    assert (CDI_LOG in log) is logs_cdi


def assert_dropped(run: CheckerRun, log: str, host_kvm: NodeStat) -> None:
    """CDI off: the container got the host's node and EACCES, and nothing in containerd's log says the CDI
    name was ignored."""
    assert run.failed_call is None, run
    assert_vmm_user(run)
    assert run.check is not None
    assert run.check.node == host_kvm, run.check.raw
    assert run.check.open_error == "EACCES", run.check.raw
    assert run.check.guest is None
    (node,) = oci_node(run, "/dev/kvm")
    assert (node["fileMode"], node["uid"], node["gid"]) == (host_kvm.mode, host_kvm.uid, host_kvm.gid), node
    assert oci_rules(run, host_kvm.major, host_kvm.minor) == ["rw"], run.oci_device_rules
    assert DEVICE not in log


class TestContainerd17:
    async def test_cdi_on_the_guest_boots(
        self, containerd_17: ContainerdBuild, cri_images: Images, tmp_path: Path, host_kvm: NodeStat
    ) -> None:
        """enable_cdi = true: the spec's node (0666) replaces the DeviceSpec's, and uid 1000 boots the guest."""
        run, log, config = await allocate_and_run(
            containerd_17, cri_images, tmp_path, enable_cdi=True, cdi_spec_dirs=[tmp_path / "cdi"]
        )
        assert (config["enableCDI"], config["cdiSpecDirs"]) == (True, [str(tmp_path / "cdi")])
        assert_guest_boots(run, log, host_kvm)

    async def test_cdi_off_the_name_is_dropped(
        self, containerd_17: ContainerdBuild, cri_images: Images, tmp_path: Path, host_kvm: NodeStat
    ) -> None:
        """enable_cdi = false (the default): the same container gets the host's node and EACCES."""
        run, log, config = await allocate_and_run(containerd_17, cri_images, tmp_path, enable_cdi=False)
        assert config["enableCDI"] is False
        assert_dropped(run, log, host_kvm)


@pytest.mark.parametrize("config_version", [3, 2])
class TestContainerd21:
    """containerd 2.1 with its own version 3 config, and with a version 2 file."""

    async def test_cdi_on_by_default_the_guest_boots(
        self,
        containerd_21: ContainerdBuild,
        cri_images: Images,
        tmp_path: Path,
        host_kvm: NodeStat,
        config_version: int,
    ) -> None:
        """No enable_cdi in the file: 2.x applies CDI by default, and uid 1000 boots the guest."""
        cdi = [tmp_path / "cdi"]
        run, log, config = await allocate_and_run(
            containerd_21, cri_images, tmp_path, cdi_spec_dirs=cdi, config_version=config_version
        )
        assert "enable_cdi" not in (tmp_path / "containerd" / "config.toml").read_text()
        assert (config["enableCDI"], config["cdiSpecDirs"]) == (True, [str(tmp_path / "cdi")])
        assert_guest_boots(run, log, host_kvm, logs_cdi=False)

    async def test_cdi_off_the_name_is_dropped(
        self,
        containerd_21: ContainerdBuild,
        cri_images: Images,
        tmp_path: Path,
        host_kvm: NodeStat,
        config_version: int,
    ) -> None:
        """enable_cdi = false: EACCES, as on 1.7."""
        run, log, config = await allocate_and_run(
            containerd_21, cri_images, tmp_path, enable_cdi=False, config_version=config_version
        )
        assert config["enableCDI"] is False
        assert_dropped(run, log, host_kvm)

    async def test_spec_dir_not_read_unresolvable(
        self,
        containerd_21: ContainerdBuild,
        cri_images: Images,
        tmp_path: Path,
        host_kvm: NodeStat,
        config_version: int,
    ) -> None:
        """CDI on, but cdi_spec_dirs leaves the daemon's directory out: no container at all."""
        other = tmp_path / "elsewhere"
        run, _, config = await allocate_and_run(
            containerd_21, cri_images, tmp_path, cdi_spec_dirs=[other], config_version=config_version
        )
        assert config["cdiSpecDirs"] == [str(other)]
        assert run.failed_call == "CreateContainer", run.summary()
        assert "unresolvable CDI devices" in run.error, run.error


class TestContainerd16:
    async def test_no_cdi_the_name_is_dropped(
        self, containerd_16: ContainerdBuild, cri_images: Images, tmp_path: Path, host_kvm: NodeStat
    ) -> None:
        """containerd 1.6 knows no CDI: CreateContainer succeeds, the name is dropped without a word, and the
        container has the DeviceSpec's node alone: EACCES."""
        run, log, config = await allocate_and_run(containerd_16, cri_images, tmp_path)
        assert "enableCDI" not in config and "cdiSpecDirs" not in config, sorted(config)
        assert run.failed_call is None, run
        assert_vmm_user(run)
        assert run.check is not None
        assert run.check.node == host_kvm, run.check.raw
        assert run.check.open_error == "EACCES", run.check.raw
        (node,) = oci_node(run, "/dev/kvm")
        assert (node["fileMode"], node["uid"], node["gid"]) == (host_kvm.mode, host_kvm.uid, host_kvm.gid), node
        assert oci_rules(run, host_kvm.major, host_kvm.minor) == ["rw"], run.oci_device_rules
        assert DEVICE not in log
        assert os.path.exists(tmp_path / "cdi" / "ate.dev-kvm.json")  # the spec was there to be read
