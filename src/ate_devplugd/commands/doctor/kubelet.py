"""``ate-devplugd doctor``: kubelet (its socket answering, its version against what the config asks) and
the cgroup version the runtime grants devices under."""

from __future__ import annotations

import asyncio
import os
import posixpath
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from ate_devplugd.base.look import Look, look
from ate_devplugd.base.unixsock import socket_answers
from ate_devplugd.commands.findings import Finding, Level, fail, ok, warn
from ate_devplugd.config import Config
from ate_devplugd.cri import facts as runtime_facts
from ate_devplugd.kubelet.watch import KUBELET_SOCKET

#: Where ``kubelet --version`` is looked for when it is not on PATH.
KUBELET_PATHS = ("/usr/bin/kubelet", "/usr/local/bin/kubelet", "/opt/bin/kubelet")
#: How long ``kubelet --version`` may take.
TIMEOUT = 5.0
#: What doctor says of a path it may not look at (it is not root).
CANNOT_LOOK = "cannot look: permission denied; run as root"


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


async def findings(cfg: Config, find: Callable[[], str | None], mountinfo: str) -> list[Finding]:
    """kubelet's socket, its version against what the config asks, and the cgroup version."""
    out = []
    sock = posixpath.join(cfg.plugin_dir, KUBELET_SOCKET)
    seen = look(sock)
    if seen is Look.CANNOT_LOOK:
        out.append(warn("kubelet", f"{sock}: {CANNOT_LOOK}", "run doctor as root"))
    elif seen is Look.ABSENT:
        out.append(fail("kubelet", f"no {sock}: kubelet is not running", "systemctl start kubelet"))
    elif not socket_answers(sock):
        out.append(
            fail("kubelet", f"{sock} does not answer (kubelet stopped or restarting)", "systemctl status kubelet")
        )
    else:
        out.append(ok("kubelet", f"{sock} answers"))
    found = await kubelet_version(find())
    parsed = runtime_facts.parse_version(found[1]) if found else None
    if found is None:
        out.append(warn("kubelet version", "no kubelet binary on this node: version not checked"))
    elif parsed is None:
        out.append(warn("kubelet version", f"{found[0]} --version gave no version"))
    else:
        level, why = kubelet_needs(cfg, parsed)
        remedy = "upgrade kubelet" if level is not Level.OK else ""
        out.append(Finding("kubelet version", level, f"{found[1]}: {why}", remedy))
    cgroups = cgroup_version(mountinfo)
    explain = {
        "v2": "the runtime grants the device with an eBPF device program",
        "hybrid": "v1 device controller beside a v2 tree",
        "v1": "the runtime grants the device through the devices controller",
    }.get(cgroups, "not found")
    out.append(ok("cgroup", f"{cgroups}: {explain}") if cgroups != "unknown" else warn("cgroup", "version unknown"))
    return out
