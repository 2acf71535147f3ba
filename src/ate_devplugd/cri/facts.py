"""What the node's container runtime does with our CDI names, decided from its answers over CRI.

kubelet hands a device plugin's CDI names to the runtime in ``ContainerConfig.cdi_devices``; what the
runtime then does is its own business, and a runtime that ignores them says so nowhere. So the daemon
asks the runtime what kubelet asks it (``cri.ask.ask``: ``Version``; ``Status`` with ``verbose``, whose
``info["config"]`` is the runtime's own config as JSON) and ``decide`` draws the verdict here, with no I/O
but a path lookup, from what each runtime's code does with that config (docs/cdi-runtimes.md has each
fact with its file, line and tag):

- containerd before 1.7 has no CDI at all (v1.6.20: nothing in ``pkg/cri`` reads CDI; its CRI API has
  no ``cdi_devices`` field, so the names are dropped as an unknown field): not applied.
- containerd 1.7.0 and 1.7.1 inject CDI devices only from annotations (``pkg/cri/opts/spec_linux.go``
  ``WithCDI(annotations)``); the CRI field is read from 1.7.2 on (``WithCDI(annotations, CDIDevices)``):
  not applied before 1.7.2.
- containerd 1.7 and 2.x apply them only ``if c.config.EnableCDI`` (``container_create_linux.go``);
  the JSON key is ``enableCDI`` at the top level of ``info["config"]`` (``PluginConfig`` / ``RuntimeConfig``
  is embedded in ``Config``), false by default in 1.7, true in 2.0-2.2, and a pointer from 2.3 on
  (``null`` when unset: on). The spec directories are ``cdiSpecDirs``.
- CRI-O has no switch: it injects the CRI field's names from 1.28 on
  (``internal/factory/container/device.go``, later ``device_linux.go``) and reports its
  ``RuntimeConfig`` (with ``CDISpecDirs``, no JSON tag) under ``info["config"]["crio"]`` from 1.33 on.
- Both read specs through the CDI library, which walks each spec directory from an ``Lstat`` of it: a
  directory given as a symlink is not read (``filepath.Walk`` in ``pkg/cdi/spec-dirs.go``); one under a
  symlinked parent (``/var/run/cdi``) is.

A name the runtime cannot resolve fails the container's creation (``unresolvable CDI devices``), so a
spec directory the runtime does not read is worse than CDI off. Anything else (no socket, no answer, a
runtime or a config this module does not know) is ``UNKNOWN``: the daemon never guesses.
"""

from __future__ import annotations

import enum
import json
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Where both runtimes read specs unless configured otherwise (the CDI library's default).
CDI_DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


class CdiVerdict(enum.Enum):
    """What the runtime will do with our CDI names."""

    #: It injects them, and reads the directory our specs are in.
    APPLIED = "applied"
    #: It drops them: the container gets the DeviceSpec's node with the host's owner and mode.
    NOT_APPLIED = "not_applied"
    #: It injects CDI names but does not read our directory: creating the container fails.
    DIR_NOT_READ = "dir_not_read"
    #: No runtime answered, or it is one whose handling of CDI this module does not know.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class RuntimeReport:
    """What the runtime said, and the verdict drawn from it."""

    verdict: CdiVerdict
    #: Why, in the runtime's own terms (``enable_cdi = false``).
    reason: str
    socket: str = ""
    #: The runtime's name and version as its Version answer gives them (empty when it did not answer).
    name: str = ""
    version: str = ""
    #: The spec directories the runtime reads, where it says.
    spec_dirs: tuple[str, ...] | None = None
    #: Its socket is there but it gave no answer (an error or none in time): asked again, it may answer.
    unanswered: bool = False
    #: The daemon's loop time after which the runtime that answered started (its socket was last seen
    #: absent then); None when it may be older than anything the daemon saw (``cri.check``).
    since: float | None = None
    #: Why the runtime does not answer now, where this verdict is the one it gave before ("" while it
    #: answers): a verdict is kept until the runtime answers again.
    away: str = ""

    @property
    def answered(self) -> bool:
        """Whether a runtime answered (its Version named it), whatever the verdict."""
        return bool(self.name)

    @property
    def runtime(self) -> str:
        """``containerd 2.1.9``: no ``v``, nor the ``+unknown`` of a build without a git revision (Debian's 2.x)."""
        return f"{self.name} {self.version.lstrip('v').removesuffix('+unknown')}".strip()

    def describe(self) -> str:
        """One line for STATUS and the journal: ``containerd 1.7.24 ignores CDI (enable_cdi = false)``."""
        what = {
            CdiVerdict.APPLIED: "applies CDI",
            CdiVerdict.NOT_APPLIED: "ignores CDI",
            CdiVerdict.DIR_NOT_READ: "does not read our spec directory",
            CdiVerdict.UNKNOWN: "",
        }[self.verdict]
        if self.verdict is CdiVerdict.UNKNOWN:
            return f"unknown whether CDI is applied ({self.reason})"
        return f"{self.runtime} {what} ({self.reason})"

    def status(self) -> str:
        """STATUS's part: the verdict, and that it is kept while the runtime is away."""
        return self.describe() + (f"; kept while the runtime is away ({self.away})" if self.away else "")


# -- deciding --------------------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``v1.7.24``, ``1.7.24~ds1``, ``2.0.0+unknown`` -> (1, 7, 24); None when it is not a version."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def reads_dir(runtime_dir: str, cdi_dir: str) -> bool:
    """Whether a runtime whose spec directory is ``runtime_dir`` reads the specs we write in ``cdi_dir``.

    The CDI library does not follow a spec directory that is itself a symlink (it walks from an Lstat),
    while symlinks above it are resolved by the kernel (``/var/run`` -> ``/run``)."""
    if not runtime_dir.startswith("/"):
        return False
    theirs = posixpath.normpath(runtime_dir)
    if os.path.islink(theirs):
        return False

    def resolved(path: str) -> str:
        path = posixpath.normpath(path)
        return posixpath.join(os.path.realpath(posixpath.dirname(path)), posixpath.basename(path))

    return theirs == posixpath.normpath(cdi_dir) or resolved(theirs) == os.path.realpath(cdi_dir)


def decide(name: str, version: str, info: Mapping[str, str], cdi_dir: str, *, socket: str = "") -> RuntimeReport:
    """The verdict for a runtime from its Version and verbose Status answers (no I/O but a path lookup)."""
    report = _reporter(socket, name, version)
    parsed = parse_version(version)
    if parsed is None:
        return report(CdiVerdict.UNKNOWN, f"{name} reports version {version!r}, which is not a version")
    config = _info_config(info)
    if name == "containerd":
        return _containerd(report, parsed, config, cdi_dir)
    if name == "cri-o":
        return _crio(report, parsed, config, cdi_dir)
    return report(CdiVerdict.UNKNOWN, f"how {name or 'this runtime'} treats CDI names is not known")


def _reporter(socket: str, name: str, version: str) -> Callable[..., RuntimeReport]:
    def report(verdict: CdiVerdict, reason: str, spec_dirs: tuple[str, ...] | None = None) -> RuntimeReport:
        return RuntimeReport(verdict, reason, socket=socket, name=name, version=version, spec_dirs=spec_dirs)

    return report


def _info_config(info: Mapping[str, str]) -> dict[str, Any] | None:
    try:
        config = json.loads(info.get("config", ""))
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def _spec_dirs(value: object) -> tuple[str, ...] | None:
    if isinstance(value, list) and all(isinstance(d, str) for d in value):
        return tuple(value)
    return None


def _dir_verdict(report: Callable[..., RuntimeReport], dirs: tuple[str, ...], cdi_dir: str, key: str) -> RuntimeReport:
    shown = ", ".join(dirs) or "none"
    if any(reads_dir(d, cdi_dir) for d in dirs):
        return report(CdiVerdict.APPLIED, f"reads {cdi_dir}", dirs)
    return report(CdiVerdict.DIR_NOT_READ, f"{key} = [{shown}] leaves out {cdi_dir}", dirs)


def _containerd(  # noqa: PLR0911 - one return per rule of containerd's code
    report: Callable[..., RuntimeReport], version: tuple[int, int, int], config: dict[str, Any] | None, cdi_dir: str
) -> RuntimeReport:
    if version < (1, 7, 0):
        return report(CdiVerdict.NOT_APPLIED, "no CDI before containerd 1.7")
    if version < (1, 7, 2):
        return report(CdiVerdict.NOT_APPLIED, "before 1.7.2 it takes CDI names from annotations only")
    if config is None:
        return report(CdiVerdict.UNKNOWN, "its Status gives no config")
    if "enableCDI" not in config:
        return report(CdiVerdict.UNKNOWN, "its config has no enableCDI")
    enabled = config["enableCDI"]
    if enabled is False:
        return report(CdiVerdict.NOT_APPLIED, "enable_cdi = false")
    if enabled not in (True, None):  # None: unset, on by default (2.3 and later)
        return report(CdiVerdict.UNKNOWN, f"enableCDI is {enabled!r}")
    dirs = _spec_dirs(config.get("cdiSpecDirs"))
    if dirs is None:
        return report(CdiVerdict.UNKNOWN, "its config has no cdiSpecDirs list")
    return _dir_verdict(report, dirs, cdi_dir, "cdi_spec_dirs")


def _crio(
    report: Callable[..., RuntimeReport], version: tuple[int, int, int], config: dict[str, Any] | None, cdi_dir: str
) -> RuntimeReport:
    if version < (1, 28, 0):
        return report(CdiVerdict.NOT_APPLIED, "before 1.28 it takes CDI names from annotations only")
    crio = (config or {}).get("crio")
    dirs = _spec_dirs(crio.get("CDISpecDirs")) if isinstance(crio, dict) else None
    if dirs is not None:
        return _dir_verdict(report, dirs, cdi_dir, "cdi_spec_dirs")
    # Before 1.33 CRI-O does not report its spec directories: only its defaults can be counted on.
    if any(reads_dir(d, cdi_dir) for d in CDI_DEFAULT_SPEC_DIRS):
        why = f"reads {cdi_dir} unless cdi_spec_dirs was changed (not reported before 1.33)"
        return report(CdiVerdict.APPLIED, why)
    return report(CdiVerdict.UNKNOWN, f"it does not report whether it reads {cdi_dir} (before 1.33)")


def consequence(verdict: CdiVerdict, mode: str = "device-plugin") -> str:
    """What a verdict means for a sandbox pod (in DRA mode CDI is the only path to the device)."""
    if verdict is CdiVerdict.NOT_APPLIED and mode == "dra":
        return "containers get no device at all (DRA hands devices over through CDI only)"
    return {
        CdiVerdict.APPLIED: "containers get the node with the spec's owner and mode",
        CdiVerdict.NOT_APPLIED: "containers get the host's node (owner and mode), so a non-root VMM gets EACCES",
        CdiVerdict.DIR_NOT_READ: "creating a container that asks for the resource fails (unresolvable CDI devices)",
        CdiVerdict.UNKNOWN: "cannot tell what containers get",
    }[verdict]
