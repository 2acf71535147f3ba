"""``ate-devplugd doctor``: the container runtime, and what it does with our CDI names.

Findings from the runtime's answer (``cri.ask.ask``, asked once per run by ``doctor.examine`` on the
socket ``cri.ask.discover`` chose): which runtime answers on which CRI socket, and why that one;
where any resource uses CDI, the verdict on its CDI names with what a node that gets them wrong must
change (``cdi_remedy``); then the spec files of the directories the runtime reads: one finding per file
that defines one of our names, or spec of ours the CDI library refuses (``cri.conflicts``), or one OK
line.
"""

from __future__ import annotations

from ate_devplugd.commands.findings import Finding, fail, ok, warn
from ate_devplugd.config import Config
from ate_devplugd.cri import conflicts as cdi_conflicts
from ate_devplugd.cri import facts as runtime_facts
from ate_devplugd.cri import remedies
from ate_devplugd.cri.ask import read_commands
from ate_devplugd.cri.endpoint import Endpoint
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport


def findings(cfg: Config, report: RuntimeReport, endpoint: Endpoint) -> list[Finding]:
    """The runtime's name and version, which socket was asked and why, and what it does with CDI names
    where any resource uses them."""
    why = endpoint.why if endpoint.named else f"the first usual socket that exists: {endpoint.why}"
    if not report.name:
        remedy = "is the runtime running? set runtime_socket where its CRI socket is elsewhere"
        runtime = warn("runtime", f"no answer ({report.reason}; {why})", remedy)
    else:
        runtime = ok("runtime", f"{report.runtime} at {report.socket} ({why})")
    if not cfg.checks_runtime:
        return [runtime, ok("runtime cdi", "no resource uses CDI")]
    return [runtime, verdict_finding(cfg, report), *spec_findings(cfg, report)]


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
    resolve to another device, a WARN per file that defines one but loses to ours, else one OK line."""
    dirs = cdi_conflicts.dirs_to_read(report.spec_dirs, cfg.cdi_dir)
    found = cdi_conflicts.find(dirs, cfg.cdi_dir, cfg.devices)
    if not found:
        names = ", ".join(cdi_conflicts.ours(dirs, cfg.cdi_dir, cfg.devices))
        return [ok("cdi specs", f"no other spec in {', '.join(dirs)} defines {names}")]
    return [(fail if p.breaks else warn)("cdi specs", p.describe(), p.remedy()) for p in found]


def cdi_remedy(cfg: Config, report: RuntimeReport) -> str:
    config = None
    if report.name == "containerd":  # the file the running containerd was given (k3s, RKE2: --config)
        config = remedies.read_config_file(remedies.containerd_config(read_commands("containerd"), report.socket))
    return remedies.cdi_remedy(report, cfg.cdi_dir, config).text
