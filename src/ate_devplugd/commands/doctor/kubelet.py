"""``ate-devplugd doctor``: kubelet (its socket answering, its version against what the config asks, and
in DRA mode its feature gates as its command line and config file set them) and the cgroup version the
runtime grants devices under."""

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
from ate_devplugd.commands import gates
from ate_devplugd.commands.findings import Finding, Level, fail, ok, warn
from ate_devplugd.config import Config
from ate_devplugd.config.dra import Layout
from ate_devplugd.cri import ask as runtime_ask
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


def kubelet_needs(cfg: Config, version: tuple[int, int, int]) -> tuple[Level, str]:
    """Whether a kubelet this old serves what the config asks (KEP-4009 for device plugins' CDI names; DRA
    mode from 1.34, where its feature gates decide: ``gates_finding``)."""
    if cfg.mode == "dra":  # 1.34 and later: its gates say (``gates_finding``)
        return (Level.FAIL, "DRA mode needs 1.34 or later") if version < (1, 34, 0) else (Level.OK, "DRA mode")
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


def gates_finding(cfg: Config, text: str, version: tuple[int, int, int], proc_root: str) -> Finding:
    """DRA mode on kubelet 1.34 or later: its feature gates as its command line and config file set them
    (``commands.gates``, what ``switch-mode`` reads before a move), not guessed from the version."""
    names = gates.needed(cfg.dra is not None and cfg.dra.sharing is Layout.SHARED)
    process = runtime_ask.read_kubelet(proc_root)
    found = (
        [gates.default(name, version) for name in names]
        if process is None
        else gates.kubelet_gates(process, names, version)
    )
    said = "; ".join(str(gate) for gate in found)
    seen = "" if process is not None else f" (no kubelet process in {proc_root}: its version's defaults)"
    off = [gate for gate in found if gate.on is False]
    if off:
        return fail("kubelet version", f"{text}: DRA mode needs in kubelet: {said}{seen}", gates.turn_on(off, process))
    if any(gate.on is None for gate in found):
        return warn(
            "kubelet version", f"{text}: cannot tell kubelet's gates for DRA mode: {said}", "run doctor as root"
        )
    control = "kube-apiserver's shows in the deviceclass lines; kube-scheduler's cannot be seen from a node"
    return ok("kubelet version", f"{text}: DRA mode: {said}{seen}; {control}")


async def findings(
    cfg: Config, find: Callable[[], str | None], mountinfo: str, proc_root: str = "/proc"
) -> list[Finding]:
    """kubelet's socket, its version against what the config asks (its gates, for DRA mode), and the
    cgroup version."""
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
    elif cfg.mode == "dra" and parsed >= gates.FIRST:
        out.append(gates_finding(cfg, found[1], parsed, proc_root))
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
