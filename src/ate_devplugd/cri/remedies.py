"""What to change so that the node's runtime applies our CDI names: the remedy ``doctor`` prints.

The keys are the same everywhere (``enable_cdi``, ``cdi_spec_dirs``); the table that holds them is not:

- containerd 1.7, and 2.x given a version 2 file (2.x migrates it when it starts):
  ``[plugins."io.containerd.grpc.v1.cri"]``;
- containerd 2.x with its own version 3 file: ``[plugins.'io.containerd.cri.v1.runtime']``. Given the old
  table there, 2.x logs ``Ignoring unknown key`` and nothing changes;
- a file without ``version`` is version 1: containerd 1.x reads the keys in ``[plugins.cri]`` there (the
  full name is ignored); 2.x reads no CRI key of such a file, so it must first be given ``version = 3``;
- CRI-O: ``[crio.runtime] cdi_spec_dirs`` (it has no switch; before 1.28 only an upgrade helps).

containerd's CRI Status does not tell the layouts apart (its ``info["config"]`` is the same JSON for a
version 2 and a version 3 file), so the version is read from the file itself: the top-level
``version = N`` of the file the running containerd was given (``--config``/``-c`` on its command line, as
k3s and RKE2 pass it; ``/etc/containerd/config.toml`` without one: :func:`containerd_config`, from the
command line ``cri.ask.read_commands`` reads; :func:`read_config_file`, the one file read here). Where
the file cannot be read, the remedy for 2.x names the tables of both versions, for 1.x the version 2
one. Everything else here is pure.
"""

from __future__ import annotations

import posixpath
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass

from ate_devplugd.cri.facts import CDI_DEFAULT_SPEC_DIRS, CdiVerdict, RuntimeReport, parse_version, reads_dir

#: containerd's config file when it is started without ``--config``.
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
#: containerd's socket when it is started without ``--address``.
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
#: The CRI table of containerd 1.x in a file without ``version`` (version 1).
CONTAINERD_V1_TABLE = "[plugins.cri]"
#: The CRI table of containerd 1.x's layout (version 2), which 2.x migrates from.
CONTAINERD_V2_TABLE = '[plugins."io.containerd.grpc.v1.cri"]'
#: The table of 2.x's own layout (version 3) that holds enable_cdi and cdi_spec_dirs.
CONTAINERD_V3_TABLE = "[plugins.'io.containerd.cri.v1.runtime']"
CRIO_TABLE = "[crio.runtime]"


@dataclass(frozen=True)
class ConfigFile:
    """A runtime's config file, and the layout version it declares (None: it could not be read)."""

    path: str
    version: int | None = None


@dataclass(frozen=True)
class Remedy:
    """One remedy: the text ``doctor`` prints, and the config change it asks for (none where the remedy
    is an upgrade), so that it can be applied as written."""

    text: str
    #: The TOML table to set ``settings`` in ("" when the remedy is no config change).
    table: str = ""
    #: (key, TOML value) pairs to set in ``table``.
    settings: tuple[tuple[str, str], ...] = ()
    #: The file to edit, where it can be known.
    file: str = ""
    #: The ``version`` the file must declare before ``settings`` take (None: the one it has).
    version: int | None = None


def _option(argv: Sequence[str], long: str, short: str) -> str | None:
    """The last value of ``--long``/``-short`` in ``argv`` (``--long=v``, ``--long v``, ``-short v``,
    ``-short=v``: urfave/cli's forms), None without one."""
    value = None
    args = list(argv[1:])
    for i, arg in enumerate(args):
        for name in (long, short):
            if arg.startswith(name + "="):
                value = arg[len(name) + 1 :]
            elif arg == name and i + 1 < len(args):
                value = args[i + 1]
    return value


def containerd_config(commands: Sequence[tuple[tuple[str, ...], str]], socket: str) -> str:
    """The config file of the containerd serving ``socket``: ``commands`` are the running containerd
    processes (argv, working directory); the one whose ``--address``/``-a`` (its default without one) is
    ``socket`` gives its ``--config``/``-c`` (relative to its working directory); else the default file.
    (A ``grpc.address`` set in the file itself is not followed: such a containerd is not recognised.)"""
    for argv, cwd in commands:
        if posixpath.normpath(_option(argv, "--address", "-a") or CONTAINERD_SOCKET) != posixpath.normpath(socket):
            continue
        path = _option(argv, "--config", "-c")
        return posixpath.normpath(posixpath.join(cwd, path)) if path else CONTAINERD_CONFIG
    return CONTAINERD_CONFIG


def config_version(text: str) -> int | None:
    """The layout version a containerd config file declares: its top-level ``version``, 1 without one
    (containerd's rule); None when the text is not TOML or the version not a number."""
    try:
        version = tomllib.loads(text).get("version", 1)
    except tomllib.TOMLDecodeError:
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def read_config_file(path: str = CONTAINERD_CONFIG) -> ConfigFile:
    """``path`` and the version it declares (None when it is absent or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            return ConfigFile(path, config_version(f.read()))
    except (OSError, UnicodeDecodeError):
        return ConfigFile(path)


def containerd_layout(version: tuple[int, int, int], config: ConfigFile | None) -> tuple[str, str, int | None]:
    """The table holding enable_cdi and cdi_spec_dirs for this containerd and config file, how a remedy
    names it (the tables of both versions, where 2.x's file could not be read), and the ``version`` the
    file must be given first (None: none)."""
    declared = config.version if config else None
    if version < (2, 0, 0):
        table = CONTAINERD_V1_TABLE if declared == 1 else CONTAINERD_V2_TABLE
        return table, table, None
    if declared is None:
        both = f"{CONTAINERD_V3_TABLE} (a version 3 file; {CONTAINERD_V2_TABLE} in a version 2 file)"
        return CONTAINERD_V3_TABLE, both, None
    if declared < 2:
        return CONTAINERD_V3_TABLE, CONTAINERD_V3_TABLE, 3
    table = CONTAINERD_V3_TABLE if declared >= 3 else CONTAINERD_V2_TABLE
    return table, table, None


def cdi_remedy(report: RuntimeReport, cdi_dir: str, config: ConfigFile | None = None) -> Remedy:
    """The remedy for a runtime that will not apply our CDI names (NOT_APPLIED or DIR_NOT_READ);
    ``config`` is the runtime's config file where it was read (:func:`read_config_file`)."""
    version = parse_version(report.version) or (0, 0, 0)
    if report.name == "containerd":
        return _containerd(report, version, cdi_dir, config)
    if report.verdict is CdiVerdict.DIR_NOT_READ:
        dirs = _toml_list([*(report.spec_dirs or ()), cdi_dir])
        text = f"add {cdi_dir} to {CRIO_TABLE} cdi_spec_dirs and restart the runtime, {_OR_CDI_DIR}"
        return Remedy(text, CRIO_TABLE, (("cdi_spec_dirs", dirs),))
    return Remedy(f"upgrade {report.name} (CRI-O 1.28 or later applies CDI names)")


_OR_CDI_DIR = "or set cdi_dir to a directory it reads"


def _containerd(
    report: RuntimeReport, version: tuple[int, int, int], cdi_dir: str, config: ConfigFile | None
) -> Remedy:
    file = config.path if config else CONTAINERD_CONFIG
    table, named, file_version = containerd_layout(version, config)
    first = ""
    if file_version is not None:
        first = f"give {file} version = {file_version} at its top (2.x reads no CRI key of a file without one), then "
    if report.verdict is CdiVerdict.DIR_NOT_READ:
        dirs = _toml_list([*(report.spec_dirs or ()), cdi_dir])
        text = f"{first}add {cdi_dir} to {named} cdi_spec_dirs of {file} and restart the runtime, {_OR_CDI_DIR}"
        return Remedy(text, table, (("cdi_spec_dirs", dirs),), file, file_version)
    if version < (1, 7, 2):
        text = "upgrade containerd to 1.7.2 or later (with enable_cdi = true) or 2.x"
        if not any(reads_dir(d, cdi_dir) for d in CDI_DEFAULT_SPEC_DIRS):
            dirs = " and ".join(CDI_DEFAULT_SPEC_DIRS)
            text += f", and add {cdi_dir} to its cdi_spec_dirs (by default it reads only {dirs})"
        return Remedy(text)
    text = f"{first}set enable_cdi = true in {named} of {file}, restart containerd, then kubelet"
    return Remedy(text, table, (("enable_cdi", "true"),), file, file_version)


def _toml_list(items: list[str]) -> str:
    """A TOML array of basic strings (our paths hold no quote or backslash that needs more)."""
    return "[" + ", ".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items) + "]"
