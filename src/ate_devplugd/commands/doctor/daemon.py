"""``ate-devplugd doctor``: the daemon, running, its sockets answering as kubelet asks them, registered.

The daemon is running when one serves the config (``commands.instance``: it holds the lock of the
directory the config serves in); with none, the line names the daemons that serve other directories. In
device-plugin mode each resource's socket gets the calls ``probe`` makes
(``commands.probe.deviceplugin.probe_socket``), and whether kubelet holds the resource is kubelet's own
word: its pod-resources API says which units it offers. Where that API does not answer, and in DRA mode
(where kubelet holds the driver's registration, not a resource's), the daemon's metrics file says what
the daemon knows: read through ``read_metrics``, so a test gives it.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from ate_devplugd.base.look import Look, look
from ate_devplugd.base.unixsock import socket_answers
from ate_devplugd.commands.findings import Finding, fail, ok, warn
from ate_devplugd.commands.instance import Found
from ate_devplugd.config import Config
from ate_devplugd.kubelet.watch import KUBELET_SOCKET

if TYPE_CHECKING:
    from ate_devplugd.kubelet.podresources import Allocatable

#: Reads the daemon's metrics file (its path given): ``doctor.Node.read_metrics``.
ReadMetrics = Callable[[str], str]


async def findings(cfg: Config, found: Found, read_metrics: ReadMetrics, timeout: float) -> list[Finding]:
    """Running; its sockets answer as kubelet would ask them; kubelet holds its registration."""
    if found.running is None:
        return [fail("daemon", found.nobody(), "systemctl start ate-devplugd; journalctl -u ate-devplugd")]
    out = [ok("daemon", f"running ({found.running.describe()})")]
    if cfg.mode == "dra":
        return out + [dra_registration_finding(cfg, dev.resource, read_metrics) for dev in cfg.devices]
    from ate_devplugd.commands.probe import deviceplugin as nodeprobe  # noqa: PLC0415 - gRPC only when the daemon runs
    from ate_devplugd.kubelet import podresources  # noqa: PLC0415

    held: podresources.Allocatable | str
    try:
        held = await podresources.allocatable(podresources.socket_for(cfg.plugin_dir), timeout)
    except podresources.Unanswered as exc:
        held = str(exc)
    for dev in cfg.devices:
        check = f"socket {dev.resource}"
        seen = look(posixpath.join(cfg.plugin_dir, dev.socket_name))
        if seen is Look.CANNOT_LOOK:
            message = f"{dev.socket_name} in {cfg.plugin_dir}: cannot look: permission denied; run as root"
            out.append(warn(check, message, "run doctor as root"))
            continue
        if seen is Look.ABSENT:
            out.append(fail(check, f"no {dev.socket_name} in {cfg.plugin_dir}", "systemctl status ate-devplugd"))
            continue
        row = await nodeprobe.probe_socket(cfg.plugin_dir, dev.socket_name, dev.resource, timeout)
        if row.error:
            out.append(fail(check, f"{dev.socket_name}: {row.error}", "systemctl restart ate-devplugd"))
        elif row.healthy < row.total or not row.total:
            out.append(warn(check, f"answers, {row.healthy}/{row.total} units healthy", "see the device line"))
        else:
            out.append(ok(check, f"answers: {row.healthy}/{row.total} healthy, Allocate grants {row.grants}"))
        out.append(registration_finding(cfg, dev.resource, read_metrics, held))
    return out


def metric_value(text: str, name: str, resource: str) -> float | None:
    """One sample of the daemon's metrics file (its own exposition: one sample per line)."""
    pattern = re.compile(rf'^{re.escape(name)}\{{resource="{re.escape(resource)}"\}} (\S+)$', re.MULTILINE)
    m = pattern.search(text)
    return float(m[1]) if m else None


def dra_registration_finding(cfg: Config, resource: str, read_metrics: ReadMetrics) -> Finding:
    """DRA mode: a kubelet that does not answer holds no registration, whatever the metrics file (written
    shortly after a change) says; else as ``registration_finding``."""
    if not socket_answers(posixpath.join(cfg.plugin_dir, KUBELET_SOCKET)):
        message = "not registered: kubelet does not answer (see kubelet)"
        return fail(f"registered {resource}", message, "systemctl status kubelet")
    return registration_finding(cfg, resource, read_metrics)


def registration_finding(
    cfg: Config, resource: str, read_metrics: ReadMetrics, held: Allocatable | str = ""
) -> Finding:
    """Whether kubelet holds the resource: in device-plugin mode kubelet's own pod-resources API says which
    units it offers (``held``; the text of why it could not be asked otherwise); without it, the daemon's
    metrics file says what the daemon knows."""
    check = f"registered {resource}"
    if not isinstance(held, str):
        return offered_finding(check, held.units.get(resource, 0))
    return metrics_finding(cfg, check, resource, read_metrics, f"; pod-resources API: {held}" if held else "")


def metrics_finding(cfg: Config, check: str, resource: str, read_metrics: ReadMetrics, asked: str) -> Finding:
    """What the daemon's metrics file says of the registration (``asked``: why kubelet was not asked)."""
    if not cfg.metrics_file:
        return warn(check, f"cannot tell: metrics_file is off{asked}", "systemctl status ate-devplugd shows it")
    try:
        text = read_metrics(cfg.metrics_file)
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
