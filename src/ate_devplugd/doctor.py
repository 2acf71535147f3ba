"""``ate-devplugd doctor``: will a sandbox pod that asks for our resources get a working device here?

One node, one verdict: each check is one ``Finding`` (OK, WARN or FAIL, what was found, and the remedy),
in the order a device reaches a container: the config, the devices (present with the kernel's
major:minor, KVM able to create a VM, the host's owner and mode), the daemon (running, its sockets
answering, registered with kubelet), kubelet (its socket, its version, the cgroup version), the
container runtime (whether it applies our CDI names and reads our spec directory) and, in DRA mode,
the API side (``dra/doctor.py``). A fleet tool runs it over ssh and reads ``--json``; the exit status
is 1 when anything fails.

Nothing here changes the node: the KVM check creates a VM and closes it at once, the daemon's sockets
get the calls ``probe`` makes, the runtime gets the questions the daemon asks.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import grp
import json
import os
import posixpath
import pwd
import re
import shutil
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ate_devplugd import config as configmod
from ate_devplugd import devices, remedies, runtime_cdi
from ate_devplugd.config import Config, ConfigError, DeviceConfig
from ate_devplugd.kernel import KernelView
from ate_devplugd.kubelet_watch import KUBELET_SOCKET
from ate_devplugd.lock import InstanceLock
from ate_devplugd.runtime_cdi import CdiVerdict, RuntimeReport
from ate_devplugd.unixsock import socket_answers

if TYPE_CHECKING:
    from ate_devplugd.podresources import Allocatable

#: Where ``kubelet --version`` is looked for when it is not on PATH.
KUBELET_PATHS = ("/usr/bin/kubelet", "/usr/local/bin/kubelet", "/opt/bin/kubelet")
#: How long a call to a socket, kubelet or the API server may take.
TIMEOUT = 5.0
MOUNTINFO = "/proc/self/mountinfo"


class Level(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``check`` names what was looked at (``device ate.dev/kvm``)."""

    check: str
    level: Level
    message: str
    remedy: str = ""


@dataclass
class Node:
    """Where the doctor looks: the real node by default; tests point it elsewhere."""

    kernel: KernelView
    #: Finds the kubelet binary (None where the node has none); default: ``find_kubelet``.
    find_kubelet: Callable[[], str | None] | None = None
    mountinfo: str = MOUNTINFO
    #: The daemon's metrics file is read for what only the daemon knows (registration).
    read_metrics: Callable[[str], str] = field(default=lambda path: Path(path).read_text(encoding="utf-8"))


def ok(check: str, message: str) -> Finding:
    return Finding(check, Level.OK, message)


def warn(check: str, message: str, remedy: str = "") -> Finding:
    return Finding(check, Level.WARN, message, remedy)


def fail(check: str, message: str, remedy: str = "") -> Finding:
    return Finding(check, Level.FAIL, message, remedy)


# -- the run ---------------------------------------------------------------------------------------


async def examine(config_path: str | os.PathLike[str] | None, node: Node) -> list[Finding]:
    """Every check, in order; a config that does not load is the only finding that stops the rest."""
    try:
        cfg = configmod.load(config_path)
    except ConfigError as exc:
        where = str(config_path or configmod.DEFAULT_CONFIG_PATH)
        return [
            fail("config", line if where in line else f"{where}: {line}", "fix the file (ate-devplugd check-config)")
            for line in exc.errors
        ]
    source = str(config_path) if config_path else _default_source()
    findings = [ok("config", f"{source}: {len(cfg.devices)} device(s), {cfg.mode} mode")]
    report = await runtime_cdi.ask(cfg.runtime_socket, cfg.cdi_dir, TIMEOUT)
    for dev in cfg.devices:
        findings += device_findings(cfg, dev, node.kernel, report)
    findings += await daemon_findings(cfg, node)
    findings += await kubelet_findings(cfg, node)
    findings += runtime_findings(cfg, report)
    if cfg.mode == "dra" and cfg.dra is not None:
        from ate_devplugd.dra import doctor as dra_doctor  # noqa: PLC0415 - aiohttp only in DRA mode

        findings += await dra_doctor.findings(cfg, cfg.dra, TIMEOUT)
    return findings


def _default_source() -> str:
    path = configmod.DEFAULT_CONFIG_PATH
    return path if os.path.exists(path) else "built-in defaults"


def failed(findings: Sequence[Finding]) -> bool:
    return any(f.level is Level.FAIL for f in findings)


# -- devices ---------------------------------------------------------------------------------------


def is_kvm(dev: DeviceConfig) -> bool:
    return dev.probe == "kvm" or posixpath.basename(dev.path) == "kvm"


def device_findings(cfg: Config, dev: DeviceConfig, kernel: KernelView, report: RuntimeReport) -> list[Finding]:
    """Present with the kernel's major:minor; for KVM, a VM can be created; the host's owner and mode."""
    check = f"device {dev.resource}"
    look = devices.presence(dev, cfg.dev_root, kernel)
    if not look.present:
        if os.path.isdir(devices.node_path(dev, cfg.dev_root)):
            remedy = "set path to the device node: a directory is none (ate-devplugd check-config says so)"
        elif is_kvm(dev):
            remedy = _load_kvm_remedy()
        else:
            remedy = f"load the module that provides {dev.path}"
        return [fail(check, look.reason, remedy)]
    out = [ok(check, f"{dev.path}: {look.reason}")]
    node = devices.node_path(dev, cfg.dev_root)
    if is_kvm(dev):
        out.append(kvm_finding(dev, node, kernel))
    out.append(access_finding(cfg, dev, node, report))
    return out


def _load_kvm_remedy() -> str:
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
            "turn on VT-x/AMD-V in the firmware, or use an instance type with nested virtualisation",
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


def access_finding(cfg: Config, dev: DeviceConfig, node: str, report: RuntimeReport) -> Finding:
    """What the host's owner and mode mean for a VMM that is not root, with and without CDI."""
    check = f"access {dev.resource}"
    try:
        st = os.stat(node)
    except OSError as exc:
        return warn(check, f"cannot stat {node}: {exc.strerror}")
    host = _owner(st)
    if dev.cdi and report.verdict is CdiVerdict.APPLIED:
        inside = f"{dev.container_mode:04o}" if dev.container_mode is not None else "the spec's mode"
        return ok(check, f"host {host}; containers get {inside} through CDI, so a VMM that is not root opens it")
    if stat.S_IMODE(st.st_mode) & 0o006 == 0o006:
        return ok(check, f"host {host}: any user in a container opens it")
    why = f"host {host}: a VMM that is not root (nor in the node's gid {st.st_gid}) gets EACCES"
    if not dev.cdi:
        return warn(check, f"{why}; no CDI for it", "set cdi = true for it (README: Non-root sandboxes)")
    return warn(check, f"{why}: the runtime does not apply its CDI spec (see runtime)", "fix the runtime line below")


# -- the daemon ------------------------------------------------------------------------------------


def daemon_pid(plugin_dir: str) -> int | None:
    """The pid of the ate-devplugd holding the plugin directory's instance lock, None when none runs."""
    holder = InstanceLock(plugin_dir).holder()
    return None if holder is None else holder[0]


async def daemon_findings(cfg: Config, node: Node) -> list[Finding]:
    """Running; its sockets answer as kubelet would ask them; kubelet holds its registration."""
    pid = daemon_pid(cfg.plugin_dir)
    if pid is None:
        return [
            fail("daemon", "ate-devplugd is not running", "systemctl start ate-devplugd; journalctl -u ate-devplugd")
        ]
    out = [ok("daemon", f"running (pid {pid})")]
    if cfg.mode == "dra":
        return out + [dra_registration_finding(cfg, dev.resource, node) for dev in cfg.devices]
    from ate_devplugd import nodeprobe, podresources  # noqa: PLC0415 - gRPC only when the daemon runs

    held: podresources.Allocatable | str
    try:
        held = await podresources.allocatable(podresources.socket_for(cfg.plugin_dir), TIMEOUT)
    except podresources.Unanswered as exc:
        held = str(exc)
    for dev in cfg.devices:
        check = f"socket {dev.resource}"
        if not os.path.exists(posixpath.join(cfg.plugin_dir, dev.socket_name)):
            out.append(fail(check, f"no {dev.socket_name} in {cfg.plugin_dir}", "systemctl status ate-devplugd"))
            continue
        row = await nodeprobe.probe_socket(cfg.plugin_dir, dev.socket_name, dev.resource, TIMEOUT)
        if row.error:
            out.append(fail(check, f"{dev.socket_name}: {row.error}", "systemctl restart ate-devplugd"))
        elif row.healthy < row.total or not row.total:
            out.append(warn(check, f"answers, {row.healthy}/{row.total} units healthy", "see the device line"))
        else:
            out.append(ok(check, f"answers: {row.healthy}/{row.total} healthy, Allocate grants {row.grants}"))
        out.append(registration_finding(cfg, dev.resource, node, held))
    return out


def metric_value(text: str, name: str, resource: str) -> float | None:
    """One sample of the daemon's metrics file (its own exposition: one sample per line)."""
    pattern = re.compile(rf'^{re.escape(name)}\{{resource="{re.escape(resource)}"\}} (\S+)$', re.MULTILINE)
    m = pattern.search(text)
    return float(m[1]) if m else None


def dra_registration_finding(cfg: Config, resource: str, node: Node) -> Finding:
    """DRA mode: a kubelet that does not answer holds no registration, whatever the metrics file (written
    shortly after a change) says; else as ``registration_finding``."""
    if not socket_answers(posixpath.join(cfg.plugin_dir, KUBELET_SOCKET)):
        message = "not registered: kubelet does not answer (see kubelet)"
        return fail(f"registered {resource}", message, "systemctl status kubelet")
    return registration_finding(cfg, resource, node)


def registration_finding(cfg: Config, resource: str, node: Node, held: Allocatable | str = "") -> Finding:
    """Whether kubelet holds the resource: in device-plugin mode kubelet's own pod-resources API says which
    units it offers (``held``; the text of why it could not be asked otherwise); without it, the daemon's
    metrics file says what the daemon knows."""
    check = f"registered {resource}"
    if not isinstance(held, str):
        return offered_finding(check, held.units.get(resource, 0))
    return metrics_finding(cfg, check, resource, node, f"; pod-resources API: {held}" if held else "")


def metrics_finding(cfg: Config, check: str, resource: str, node: Node, asked: str) -> Finding:
    """What the daemon's metrics file says of the registration (``asked``: why kubelet was not asked)."""
    if not cfg.metrics_file:
        return warn(check, f"cannot tell: metrics_file is off{asked}", "systemctl status ate-devplugd shows it")
    try:
        text = node.read_metrics(cfg.metrics_file)
    except OSError as exc:
        return warn(
            check, f"cannot tell: {cfg.metrics_file}: {exc.strerror}{asked}", "systemctl status ate-devplugd shows it"
        )
    registered = metric_value(text, "ate_devplugd_registered", resource)
    if registered is None:
        return warn(check, f"cannot tell: {cfg.metrics_file} has no registration for it")
    if registered != 1:
        return fail(check, "kubelet holds no registration of it", "systemctl status ate-devplugd; is kubelet running?")
    if cfg.mode != "dra" and metric_value(text, "ate_devplugd_listandwatch_streams", resource) == 0:
        return fail(check, "registered, but kubelet closed its ListAndWatch stream", "systemctl restart kubelet")
    return ok(check, "kubelet holds its registration")


def offered_finding(check: str, units: int) -> Finding:
    """What kubelet's pod-resources API says it offers of the resource."""
    if units:
        return ok(check, f"kubelet offers {units} units of it (its pod-resources API)")
    return fail(
        check,
        "kubelet offers no unit of it (its pod-resources API)",
        "systemctl status ate-devplugd (its STATUS says why); journalctl -u ate-devplugd",
    )


# -- kubelet, cgroups ------------------------------------------------------------------------------


def find_kubelet(paths: Sequence[str] = KUBELET_PATHS) -> str | None:
    """kubelet on PATH, else in the usual places."""
    return shutil.which("kubelet") or next((p for p in paths if os.access(p, os.X_OK)), None)


async def kubelet_version(binary: str | None) -> tuple[str, str] | None:
    """(binary, ``v1.31.2``) from ``kubelet --version``, or None where there is no kubelet binary."""
    if binary is None:
        return None
    proc = await asyncio.create_subprocess_exec(
        binary, "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        async with asyncio.timeout(TIMEOUT):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return binary, ""
    m = re.search(r"v\d+\.\d+\.\d+\S*", out.decode(errors="replace"))
    return binary, m[0] if m else ""


def kubelet_needs(cfg: Config, version: tuple[int, int, int]) -> tuple[Level, str]:  # noqa: PLR0911 - one per rule
    """Whether a kubelet this old serves what the config asks (KEP-4009 for device plugins' CDI names;
    DRAExtendedResource and DRAConsumableCapacity for DRA mode)."""
    if cfg.mode == "dra":
        sharing = cfg.dra.sharing if cfg.dra is not None else "units"
        gates = "DRAExtendedResource" + (" and DRAConsumableCapacity" if sharing == "shared" else "")
        if version < (1, 34, 0):
            return Level.FAIL, "DRA mode needs 1.34 or later"
        if version < (1, 36, 0):
            return (
                Level.WARN,
                f"DRA mode on 1.34-1.35 needs the {gates} feature gate(s) on (apiserver, scheduler, kubelet)",
            )
        return Level.OK, "new enough for DRA mode"
    if not any(dev.cdi for dev in cfg.devices):
        return Level.OK, "serves the device-plugin API v1beta1"
    if version < (1, 28, 0):
        return Level.FAIL, "passes device plugins' CDI names to the runtime only from 1.28"
    if version < (1, 29, 0):
        return Level.WARN, "1.28 passes CDI names only with the DevicePluginCDIDevices feature gate on"
    return Level.OK, "passes CDI names to the runtime"


def cgroup_version(mountinfo: str) -> str:
    """``v2``, ``hybrid`` (v1 controllers beside a v2 tree) or ``v1``, from /sys/fs/cgroup's mounts."""
    kinds: dict[str, str] = {}
    try:
        lines = Path(mountinfo).read_text(encoding="utf-8").splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, fstype = left.split(), right.split()[:1]
        if len(fields) > 4 and fstype:
            kinds[fields[4]] = fstype[0]
    if kinds.get("/sys/fs/cgroup") == "cgroup2":
        return "v2"
    if kinds.get("/sys/fs/cgroup/unified") == "cgroup2":
        return "hybrid"
    return "v1" if any(v == "cgroup" for v in kinds.values()) else "unknown"


async def kubelet_findings(cfg: Config, node: Node) -> list[Finding]:
    out = []
    sock = posixpath.join(cfg.plugin_dir, KUBELET_SOCKET)
    if not os.path.exists(sock):
        out.append(fail("kubelet", f"no {sock}: kubelet is not running", "systemctl start kubelet"))
    elif not socket_answers(sock):
        out.append(
            fail("kubelet", f"{sock} does not answer (kubelet stopped or restarting)", "systemctl status kubelet")
        )
    else:
        out.append(ok("kubelet", f"{sock} answers"))
    found = await kubelet_version((node.find_kubelet or find_kubelet)())
    parsed = runtime_cdi.parse_version(found[1]) if found else None
    if found is None:
        out.append(warn("kubelet version", "no kubelet binary on this node: version not checked"))
    elif parsed is None:
        out.append(warn("kubelet version", f"{found[0]} --version gave no version"))
    else:
        level, why = kubelet_needs(cfg, parsed)
        remedy = "upgrade kubelet" if level is not Level.OK else ""
        out.append(Finding("kubelet version", level, f"{found[1]}: {why}", remedy))
    cgroups = cgroup_version(node.mountinfo)
    explain = {
        "v2": "the runtime grants the device with an eBPF device program",
        "hybrid": "v1 device controller beside a v2 tree",
        "v1": "the runtime grants the device through the devices controller",
    }.get(cgroups, "not found")
    out.append(ok("cgroup", f"{cgroups}: {explain}") if cgroups != "unknown" else warn("cgroup", "version unknown"))
    return out


# -- the runtime -----------------------------------------------------------------------------------


def runtime_findings(cfg: Config, report: RuntimeReport) -> list[Finding]:
    """The runtime's name and version, and what it does with CDI names where any resource uses them."""
    if not report.name:
        remedy = "is the runtime running? set runtime_socket where its CRI socket is elsewhere"
        runtime = warn("runtime", f"no answer ({report.reason})", remedy)
    else:
        runtime = ok("runtime", f"{report.runtime} at {report.socket}")
    if not runtime_cdi.wanted(any(dev.cdi for dev in cfg.devices), cfg.mode):
        return [runtime, ok("runtime cdi", "no resource uses CDI")]
    message = f"{report.describe()}: {runtime_cdi.consequence(report.verdict, cfg.mode)}"
    if report.verdict is CdiVerdict.APPLIED:
        return [runtime, ok("runtime cdi", report.describe())]
    if report.verdict is CdiVerdict.UNKNOWN:
        return [runtime, warn("runtime cdi", message, "ate-devplugd doctor again once the runtime answers")]
    return [runtime, fail("runtime cdi", message, cdi_remedy(cfg, report))]


def cdi_remedy(cfg: Config, report: RuntimeReport) -> str:
    config = remedies.read_config_file() if report.name == "containerd" else None
    return remedies.cdi_remedy(report, cfg.cdi_dir, config).text


# -- output ----------------------------------------------------------------------------------------


def render(findings: Sequence[Finding]) -> str:
    """One line each: level, check, what was found, and the remedy after a dash."""
    width = max((len(f.check) for f in findings), default=0)
    lines = []
    for f in findings:
        line = f"{f.level.value:<4}  {f.check:<{width}}  {f.message}"
        if f.remedy and f.level is not Level.OK:
            line += f" -- {f.remedy}"
        lines.append(line)
    return "\n".join(lines)


def render_json(findings: Sequence[Finding]) -> str:
    checks = [{"check": f.check, "level": f.level.value, "message": f.message, "remedy": f.remedy} for f in findings]
    summary = {level.value: sum(1 for f in findings if f.level is level) for level in Level}
    return json.dumps({"ok": not failed(findings), "summary": summary, "checks": checks}, indent=2)
