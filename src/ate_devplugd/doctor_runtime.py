"""``ate-devplugd doctor``: the container runtime, and what it does with our CDI names.

Two findings from the runtime's answer (``runtime_cdi.ask``, asked once per run by ``doctor.examine``):
which runtime answers on the CRI socket, and, where any resource uses CDI, the verdict on its CDI names
with what a node that gets them wrong must change (``cdi_remedy``).
"""

from __future__ import annotations

from ate_devplugd import remedies, runtime_cdi, runtime_facts
from ate_devplugd.config import Config
from ate_devplugd.findings import Finding, fail, ok, warn
from ate_devplugd.runtime_facts import CdiVerdict, RuntimeReport


def findings(cfg: Config, report: RuntimeReport) -> list[Finding]:
    """The runtime's name and version, and what it does with CDI names where any resource uses them."""
    if not report.name:
        remedy = "is the runtime running? set runtime_socket where its CRI socket is elsewhere"
        runtime = warn("runtime", f"no answer ({report.reason})", remedy)
    else:
        runtime = ok("runtime", f"{report.runtime} at {report.socket}")
    if not runtime_cdi.wanted(any(dev.cdi for dev in cfg.devices), cfg.mode):
        return [runtime, ok("runtime cdi", "no resource uses CDI")]
    message = f"{report.describe()}: {runtime_facts.consequence(report.verdict, cfg.mode)}"
    if report.verdict is CdiVerdict.APPLIED:
        return [runtime, ok("runtime cdi", report.describe())]
    if report.verdict is CdiVerdict.UNKNOWN:
        return [runtime, warn("runtime cdi", message, "ate-devplugd doctor again once the runtime answers")]
    return [runtime, fail("runtime cdi", message, cdi_remedy(cfg, report))]


def cdi_remedy(cfg: Config, report: RuntimeReport) -> str:
    config = remedies.read_config_file() if report.name == "containerd" else None
    return remedies.cdi_remedy(report, cfg.cdi_dir, config).text
