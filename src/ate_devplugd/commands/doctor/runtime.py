"""``ate-devplugd doctor``: the container runtime, and what it does with our CDI names.

Findings from the runtime's answer (``cri.ask.ask``, asked once per run by ``doctor.examine`` on the
socket ``cri.ask.discover`` chose): which runtime answers on which CRI socket, and why that one;
where any resource uses CDI, the verdict on its CDI names with what a node that gets them wrong must
change (``cdi_remedy``); then the spec files of the directories the runtime reads: one finding per file
that defines one of our names, or spec of ours the CDI library refuses (``cri.conflicts``), a spec of
ours that is not on disk (with why it cannot be written: ``unwritable``), or one OK line. Last, what
only the running daemon knows: each device it withholds, by its metrics file, with the remedy for the
reason (``withheld_findings``; ``spec-dir-replaced`` is seen by the daemon alone).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence

from ate_devplugd.commands.findings import Finding, fail, ok, warn
from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.cri import conflicts as cdi_conflicts
from ate_devplugd.cri import facts as runtime_facts
from ate_devplugd.cri import remedies
from ate_devplugd.cri.ask import read_commands
from ate_devplugd.cri.endpoint import Endpoint
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport
from ate_devplugd.cri.rules import SpecProblem, Trouble
from ate_devplugd.cri.usable import Need, need, replacement_unfit
from ate_devplugd.node.cdispec import spec_path
from ate_devplugd.node.devices import Withheld

#: The remedy for each reason the daemon withholds a device, where no line before gives it.
WITHHELD_REMEDIES = {
    Withheld.CDI_NOT_APPLIED: "see the runtime cdi line",
    Withheld.DIR_NOT_READ: "see the runtime cdi line",
    Withheld.CDI_UNKNOWN: (
        "see the runtime line: start the runtime, or set runtime_socket where its CRI socket is elsewhere; "
        'for a runtime the daemon does not know, whose VMM runs as root, set cdi = true (not "required")'
    ),
    Withheld.SPEC_CONFLICT: "see the cdi specs lines",
    Withheld.SPEC_REPLACED: "see the cdi specs lines",
    Withheld.SPEC_INVALID: "see the cdi specs lines",
    Withheld.SPEC_MISSING: "see the cdi specs lines",
    Withheld.SPEC_DIR_REPLACED: (
        "restart the container runtime (systemctl restart containerd, then kubelet): its CDI cache follows the "
        "cdi_dir that was renamed away; the daemon offers the device again once the runtime has restarted"
    ),
    Withheld.MODE_SWITCH: "finish the switch (see the switch line)",
}


def findings(
    cfg: Config, report: RuntimeReport, endpoint: Endpoint, withheld: Mapping[str, str] | None = None
) -> list[Finding]:
    """The runtime's name and version, which socket was asked and why, and what it does with CDI names
    where any resource uses them; ``withheld``: the running daemon's reasons, by resource."""
    why = endpoint.why if endpoint.named else f"the first usual socket that exists: {endpoint.why}"
    if not report.name:
        remedy = "is the runtime running? set runtime_socket where its CRI socket is elsewhere"
        runtime = warn("runtime", f"no answer ({report.reason}; {why})", remedy)
    else:
        runtime = ok("runtime", f"{report.runtime} at {report.socket} ({why})")
    if not cfg.checks_runtime:
        return [runtime, ok("runtime cdi", "no resource uses CDI")]
    out = [runtime, verdict_finding(cfg, report), *spec_findings(cfg, report)]
    return out + withheld_findings(cfg, withheld or {})


def verdict_finding(cfg: Config, report: RuntimeReport) -> Finding:
    message = f"{report.describe()}: {runtime_facts.consequence(report.verdict, cfg.mode)}"
    if report.verdict is CdiVerdict.APPLIED:
        return ok("runtime cdi", report.describe())
    if report.verdict is CdiVerdict.UNKNOWN:
        return warn("runtime cdi", message, "ate-devplugd doctor again once the runtime answers")
    return fail("runtime cdi", message, cdi_remedy(cfg, report))


def spec_findings(cfg: Config, report: RuntimeReport) -> list[Finding]:
    """The spec files of ``cdi_dir`` and the directories the runtime reads (``cdi_dir`` alone where it
    does not say: ``cri.conflicts.dirs_to_read``): a FAIL per file that makes one of our names fail or
    resolve to another device (a WARN where the replacing node serves the VMM as ours does), a WARN per
    file that defines one but loses to ours, a FAIL (WARN where a root VMM still gets the DeviceSpec's
    node) per spec of ours that is not on disk; else one OK line."""
    dirs = cdi_conflicts.dirs_to_read(report.spec_dirs, cfg.cdi_dir)
    found = cdi_conflicts.find(dirs, cfg.cdi_dir, cfg.devices)
    missing = {qualified_name(dev): missing_finding(cfg, dev) for dev in cfg.devices if not_written(cfg, dev, found)}
    if not found and not missing:
        names = ", ".join(cdi_conflicts.ours(dirs, cfg.cdi_dir, cfg.devices))
        return [ok("cdi specs", f"no other spec in {', '.join(dirs)} defines {names}")]
    # a spec of ours refused that cannot be written back is said as one that is not there
    said = [p for p in found if not (p.trouble is Trouble.REFUSED and p.name in missing)]
    return [problem_finding(cfg, p) for p in said] + list(missing.values())


def not_written(cfg: Config, dev: DeviceConfig, problems: Sequence[SpecProblem]) -> bool:
    """Our spec for ``dev`` is not on disk, or is there refused where it cannot be written back."""
    if not dev.cdi:
        return False
    if not os.path.isfile(spec_path(cfg.cdi_dir, dev)):
        return True
    refused = any(p.trouble is Trouble.REFUSED and p.name == qualified_name(dev) for p in problems)
    return refused and bool(unwritable(cfg.cdi_dir)[0])


def spec_failure(cfg: Config, dev: DeviceConfig, problems: Sequence[SpecProblem]) -> str:
    """Why our spec for ``dev`` cannot be written, where it is not on disk as ours ("" where it is, and
    where nothing seen from here tells why: the daemon then puts it back)."""
    return unwritable(cfg.cdi_dir)[0] if not_written(cfg, dev, problems) else ""


def problem_finding(cfg: Config, problem: SpecProblem) -> Finding:
    if problem.trouble is Trouble.REPLACES:
        dev = next((d for d in cfg.devices if problem.name == qualified_name(d)), None)
        unfit = "?" if dev is None else replacement_unfit(dev, problem.nodes, host_devnum(cfg, dev))
        if not unfit:
            fits = f"{problem.describe()}; its node serves the VMM as ours does, so the device is offered"
            return warn("cdi specs", fits, problem.remedy())
        return fail("cdi specs", f"{problem.describe()} ({unfit})", problem.remedy())
    return (fail if problem.breaks else warn)("cdi specs", problem.describe(), problem.remedy())


def host_devnum(cfg: Config, dev: DeviceConfig) -> tuple[int, int] | None:
    try:
        st = os.stat(posixpath.join(cfg.dev_root, dev.path.lstrip("/")))
    except OSError:
        return None
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def missing_finding(cfg: Config, dev: DeviceConfig) -> Finding:
    """Our spec not on disk: the daemon writes it back at once where it can, so it cannot (or no daemon
    runs); why, where that can be seen from here, and the remedy."""
    path = spec_path(cfg.cdi_dir, dev)
    why, remedy = unwritable(cfg.cdi_dir)
    held = need(dev, cfg.mode) is Need.REQUIRED
    there = "not on disk" if not os.path.isfile(path) else "not ours (refused), and cannot be written back"
    what = f"{path} is {there}{f': {why}' if why else ''}; "
    what += (
        f"{dev.resource} is withheld (spec-missing)"
        if held
        else "Allocate names no CDI device: containers get the host's node, a VMM that is not root gets EACCES"
    )
    return (fail if held else warn)("cdi specs", what, remedy)


def unwritable(cdi_dir: str) -> tuple[str, str]:
    """Why nothing can be written in ``cdi_dir`` (a file there, a read-only or full filesystem), and the
    remedy; ("", the journal) where none of those."""
    if os.path.lexists(cdi_dir) and not os.path.isdir(cdi_dir):
        return f"{cdi_dir} is not a directory", f"remove {cdi_dir} (a file): the daemon then writes its spec at once"
    where = cdi_dir
    while not os.path.isdir(where) and where != "/":
        where = posixpath.dirname(where)
    try:
        st = os.statvfs(where)
    except OSError:
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        remedy = f"mount {where} read-write, or set cdi_dir to a writable directory the runtime reads"
        return f"{where} is on a read-only filesystem", remedy
    if st is not None and (st.f_bfree == 0 or (st.f_files and st.f_ffree == 0)):
        return f"the filesystem of {where} is full", "free space on it: the daemon writes the spec within 2 s"
    return "", "systemctl status ate-devplugd; journalctl -u ate-devplugd ATE_EVENT=cdi-failed says why"


def withheld_findings(cfg: Config, withheld: Mapping[str, str]) -> list[Finding]:
    """A FAIL per device the running daemon withholds, with the remedy for its reason."""
    out = []
    for dev in cfg.devices:
        reason = withheld.get(dev.resource)
        if reason is None:
            continue
        remedy = WITHHELD_REMEDIES.get(Withheld(reason), "") if reason in _REASONS else ""
        out.append(fail(f"withheld {dev.resource}", f"the daemon withholds it ({reason})", remedy))
    return out


_REASONS = {r.value for r in Withheld}


def cdi_remedy(cfg: Config, report: RuntimeReport) -> str:
    config = None
    if report.name == "containerd":  # the file the running containerd was given (k3s, RKE2: --config)
        config = remedies.read_config_file(remedies.containerd_config(read_commands("containerd"), report.socket))
    return remedies.cdi_remedy(report, cfg.cdi_dir, config).text
