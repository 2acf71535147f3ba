"""``ate-devplugd doctor``: will a sandbox pod that asks for our resources get a working device here?

One node, one verdict: each check is one ``Finding`` (OK, WARN or FAIL, what was found, and the remedy), in
the order a device reaches a container: the config, the devices (present with the kernel's major:minor, KVM
able to create a VM, the host's owner and mode), the daemon (running, its sockets answering, registered with
kubelet: ``commands/doctor/daemon.py``), kubelet (its socket, its version, the cgroup version:
``commands/doctor/kubelet.py``), the container runtime (whether it applies our CDI names and reads our spec
directory: ``commands/doctor/runtime.py``) and, in DRA mode, the API side (``commands/doctor/dra.py``). This
module runs them in that order and holds the checks of the host itself: the devices, kubelet and cgroups. A
fleet tool runs it over ssh and reads ``--json``; the lines, the JSON and the exit status (1 when anything
fails) are ``commands/findings.py``'s.

Nothing here changes the node: the KVM check creates a VM and closes it at once, the daemon's sockets get the
calls ``probe`` makes, the runtime gets the questions the daemon asks.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import grp
import os
import platform
import posixpath
import pwd
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ate_devplugd import config as configmod
from ate_devplugd.base.look import Look, look
from ate_devplugd.commands import findings as findings_mod
from ate_devplugd.commands import instance
from ate_devplugd.commands.doctor import daemon as doctor_daemon
from ate_devplugd.commands.doctor import kubelet as doctor_kubelet
from ate_devplugd.commands.doctor import runtime as doctor_runtime
from ate_devplugd.commands.doctor import switch as doctor_switch
from ate_devplugd.commands.findings import Finding, fail, ok, warn
from ate_devplugd.commands.switch_files import DROPIN_DIR
from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.cri import ask as runtime_ask
from ate_devplugd.cri import conflicts as cdi_conflicts
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport
from ate_devplugd.cri.rules import SpecProblem
from ate_devplugd.cri.usable import decide
from ate_devplugd.node import devices
from ate_devplugd.node.cdispec import spec_path
from ate_devplugd.node.kernel import KernelView

#: The setting under which a device whose VMM is not root is offered only where that VMM can open it.
SAFE = 'cdi = "required"'
#: How long a call to a socket, kubelet or the API server may take.
TIMEOUT = 5.0
MOUNTINFO = "/proc/self/mountinfo"


@dataclass
class Node:
    """Where the doctor looks: the real node by default; tests point it elsewhere."""

    kernel: KernelView
    #: Finds the kubelet binary (None where the node has none); default: ``find_kubelet``.
    find_kubelet: Callable[[], str | None] | None = None
    mountinfo: str = MOUNTINFO
    #: The daemon's metrics file is read for what only the daemon knows (registration).
    read_metrics: Callable[[str], str] = field(default=lambda path: Path(path).read_text(encoding="utf-8"))
    #: Where the running kubelet is looked for (its runtime endpoint, its feature gates).
    proc_root: str = "/proc"
    #: The unit's drop-in directory (``switch-mode``'s DRA drop-in is looked for there).
    dropin_dir: str = DROPIN_DIR


# -- the run ---------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    from ate_devplugd.node.kernel import UdevKernelView  # noqa: PLC0415 - pyudev only once the line is read

    found = asyncio.run(examine(args.config, Node(kernel=UdevKernelView())))
    print(findings_mod.render_json(found) if args.json else findings_mod.render(found))
    return findings_mod.exit_status(found)


async def examine(config_path: str | os.PathLike[str] | None, node: Node) -> list[Finding]:
    """Every check, in order, of the daemon that serves the file (its config; how the file differs) or,
    with none running for it, of the file; a config that does not load and no daemon started from it is
    the only finding that stops the rest."""
    found = await instance.find(config_path)
    cfg = found.config
    if cfg is None:
        where = str(config_path or configmod.DEFAULT_CONFIG_PATH)
        remedy = "fix the file (ate-devplugd check-config)"
        return [fail("config", line if where in line else f"{where}: {line}", remedy) for line in found.file_errors]
    findings = config_findings(found, config_path)
    endpoint = runtime_ask.discover(cfg.runtime_socket, node.proc_root)
    report = await runtime_ask.ask(endpoint.socket, cfg.cdi_dir, TIMEOUT)
    dirs = cdi_conflicts.dirs_to_read(report.spec_dirs, cfg.cdi_dir)
    problems = cdi_conflicts.find(dirs, cfg.cdi_dir, cfg.devices)  # the same as the cdi specs lines
    for dev in cfg.devices:
        findings += device_findings(cfg, dev, node.kernel, report, problems)
    findings += await doctor_daemon.findings(cfg, found, node.read_metrics, TIMEOUT)
    findings += await doctor_kubelet.findings(
        cfg, node.find_kubelet or doctor_kubelet.find_kubelet, node.mountinfo, node.proc_root
    )
    findings += doctor_runtime.findings(cfg, report, endpoint, withheld(found))
    findings += await doctor_switch.findings(found, TIMEOUT, node.dropin_dir)
    if cfg.mode == "dra" and cfg.dra is not None:
        from ate_devplugd.commands.doctor import dra as dra_doctor  # noqa: PLC0415 - aiohttp only in DRA mode

        findings += await dra_doctor.findings(cfg, cfg.dra, TIMEOUT)
    return findings


def withheld(found: instance.Found) -> dict[str, str]:
    """What the daemon withholds, by resource, as its own record says (none without a daemon)."""
    if found.running is None:
        return {}
    return {served.resource: served.withheld for served in found.running.record.serving if served.withheld}


def config_findings(found: instance.Found, config_path: str | os.PathLike[str] | None) -> list[Finding]:
    """The config described: the running daemon's, with a WARN when the file on disk differs and when its
    last reload was not applied; else the file's."""
    running, cfg = found.running, found.config
    assert cfg is not None
    if running is None:
        source = str(config_path) if config_path else _default_source()
        return [ok("config", f"{source}: {len(cfg.devices)} device(s), {cfg.mode} mode")]
    source = running.record.source or "built-in defaults"
    out = [ok("config", f"the running daemon's, {source}: {len(cfg.devices)} device(s), {cfg.mode} mode")]
    if found.file_error:
        out.append(warn("config file", found.file_line(), "fix the file (ate-devplugd check-config)"))
    elif found.differences:
        out.append(warn("config file", found.file_line(), _apply_remedy(found)))
    if running.refused:
        out.append(warn("reload", f"the last reload was not applied: {running.refused}", "journalctl -u ate-devplugd"))
    return out


def _apply_remedy(found: instance.Found) -> str:
    """What applies the file's changes: a new mode is ``switch-mode``'s (a restart would lose the pods
    arriving meanwhile), a restart-only change a restart, any other a reload."""
    assert found.file is not None and found.running is not None
    if found.file.mode != found.running.config.mode:
        return f"ate-devplugd switch-mode {found.file.mode}"
    return "systemctl restart ate-devplugd" if found.restart else "systemctl reload ate-devplugd"


def _default_source() -> str:
    path = configmod.DEFAULT_CONFIG_PATH
    return path if look(path) is not Look.ABSENT else "built-in defaults"


# -- devices ---------------------------------------------------------------------------------------


def is_kvm(dev: DeviceConfig) -> bool:
    return dev.probe == "kvm" or posixpath.basename(dev.path) == "kvm"


def device_findings(
    cfg: Config, dev: DeviceConfig, kernel: KernelView, report: RuntimeReport, problems: Sequence[SpecProblem] = ()
) -> list[Finding]:
    """Present with the kernel's major:minor; for KVM, a VM can be created; the host's owner and mode."""
    check = f"device {dev.resource}"
    found = devices.presence(dev, cfg.dev_root, kernel)
    if not found.present:
        if look(devices.node_path(dev, cfg.dev_root), directory=True) is Look.PRESENT:
            remedy = "set path to the device node: a directory is none (ate-devplugd check-config says so)"
        elif is_kvm(dev):
            remedy = _load_kvm_remedy()
        else:
            remedy = f"load the module that provides {dev.path}"
        return [fail(check, found.reason, remedy)]
    out = [ok(check, f"{dev.path}: {found.reason}")]
    node = devices.node_path(dev, cfg.dev_root)
    if is_kvm(dev):
        out.append(kvm_finding(dev, node, kernel))
    out.append(access_finding(cfg, dev, node, report, problems))
    return out


def arm64(machine: str | None = None) -> bool:
    """Whether this is an arm64 node (``machine``: a test's ``uname -m``), whose kernel has KVM built in."""
    return (machine or platform.machine()) in ("aarch64", "arm64")


def _load_kvm_remedy(machine: str | None = None) -> str:
    if arm64(machine):  # Debian's arm64 kernel: CONFIG_KVM=y, no module to load
        return "boot the kernel at EL2 (bare metal, or a VM with nested virtualisation on): its KVM is built in"
    return "load kvm_intel or kvm_amd (modprobe) with virtualisation on in the firmware"


def kvm_finding(dev: DeviceConfig, node: str, kernel: KernelView) -> Finding:
    """A node that answers KVM_GET_API_VERSION but cannot create a VM runs no guest."""
    check = f"kvm {dev.resource}"
    try:
        version = kernel.kvm_api_version(node)
        if version != devices.KVM_API_VERSION:
            return fail(check, f"KVM_GET_API_VERSION returned {version}, not {devices.KVM_API_VERSION}")
        kernel.kvm_create_vm(node)
    except PermissionError as exc:
        return warn(check, f"cannot open {node} as uid {os.geteuid()} ({exc.strerror})", "run doctor as root")
    except OSError as exc:
        return fail(
            check,
            f"{node} answers KVM_GET_API_VERSION but KVM_CREATE_VM fails ({errno.errorcode.get(exc.errno or 0, '?')}: "
            f"{exc.strerror}): virtualisation is off in the firmware, or this machine (a cloud instance without "
            "nested virtualisation) cannot run guests",
            "boot the kernel at EL2 (bare metal, or an instance type with nested virtualisation)"
            if arm64()
            else "turn on VT-x/AMD-V in the firmware, or use an instance type with nested virtualisation",
        )
    return ok(check, f"KVM API {devices.KVM_API_VERSION}; KVM_CREATE_VM works")


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{stat.S_IMODE(st.st_mode):04o} {user}:{group}"


def access_finding(  # noqa: PLR0911 - one return per verdict
    cfg: Config, dev: DeviceConfig, node: str, report: RuntimeReport, problems: Sequence[SpecProblem] = ()
) -> Finding:
    """What a container asking for the resource will get, for the runtime's verdict and the spec files
    (``problems``, those of the ``cdi specs`` lines): the spec's owner and mode (applied, our name
    resolving to our spec), the host's (not applied, or no CDI for it), no container at all (our spec
    directory not read, or our name not resolving), or nothing that can be told (unknown); and whether
    the daemon withholds the device for it (``cri.usable``)."""
    check = f"access {dev.resource}"
    try:
        st = os.stat(node)
    except OSError as exc:
        return warn(check, f"cannot stat {node}: {exc.strerror}")
    host = _owner(st)
    open_to_all = stat.S_IMODE(st.st_mode) & 0o006 == 0o006
    eacces = f"a VMM that is not root (nor in the node's gid {st.st_gid}) gets EACCES"
    if not dev.cdi:
        if open_to_all:
            return ok(check, f"host {host}: any user in a container opens it")
        return warn(check, f"host {host}: {eacces}; no CDI for it", f"set {SAFE} for it (README: Non-root sandboxes)")
    verdict = report.verdict
    failure = doctor_runtime.spec_failure(cfg, dev, problems)
    devnum = (os.major(st.st_rdev), os.minor(st.st_rdev))
    on_disk = os.path.isfile(spec_path(cfg.cdi_dir, dev))
    withheld = decide(
        dev, cfg.mode, report, problems, written=not failure, on_disk=on_disk, failure=failure, devnum=devnum
    )
    held = f"; the daemon withholds it ({withheld.reason.value})" if withheld is not None else ""
    if verdict is CdiVerdict.APPLIED and withheld is not None:
        why = f"host {host}; containers asking for it do not get {_spec_access(dev)} through CDI"
        return fail(check, f"{why}: {withheld.detail}{held}", "fix the cdi specs line below")
    if verdict is CdiVerdict.APPLIED:
        return ok(
            check, f"host {host}; containers get {_spec_access(dev)} through CDI, so a VMM that is not root opens it"
        )
    if verdict is CdiVerdict.DIR_NOT_READ:
        why = f"host {host}; no container that asks for it is created: the runtime does not read {cfg.cdi_dir}"
        return warn(check, f"{why} (unresolvable CDI devices){held}", "fix the runtime line below")
    if verdict is CdiVerdict.UNKNOWN:
        why = "runtime not found" if not report.name else "see runtime"
        return warn(check, f"host {host}; cannot tell what containers get ({why}){held}", "see the runtime line below")
    if cfg.mode == "dra":
        return warn(
            check,
            f"host {host}; containers get no device: DRA hands it over through CDI only{held}",
            "fix the runtime line below",
        )
    if open_to_all and withheld is None:
        return ok(check, f"host {host}: the runtime ignores the CDI spec, but any user in a container opens it")
    if open_to_all:  # the table asks for CDI (cdi = "required", or a container owner or mode of its own)
        why = f"host {host}: the runtime ignores the CDI spec the table asks for (any user opens the host's node)"
        return warn(check, f"{why}{held}", "fix the runtime line below")
    remedy = "fix the runtime line below" + (
        "" if withheld else f", and set {SAFE} so that it is not offered meanwhile"
    )
    return warn(check, f"host {host}: {eacces}: the runtime does not apply its CDI spec (see runtime){held}", remedy)


def _spec_access(dev: DeviceConfig) -> str:
    """The node's mode and owner in a container, as the CDI spec makes them: ``0666 (owned by 1000:1000)``;
    without uid and gid in the spec a runtime gives the node to the container's user (node/cdi.py)."""
    if dev.container_uid is None and dev.container_gid is None:
        return f"{dev.node_mode:04o} (owned by the container's user)"
    uid = "-" if dev.container_uid is None else str(dev.container_uid)
    gid = "-" if dev.container_gid is None else str(dev.container_gid)
    return f"{dev.node_mode:04o} (owned by {uid}:{gid})"
