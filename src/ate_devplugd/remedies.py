"""What to change so that the node's runtime applies our CDI names: the remedy ``doctor`` prints.

The keys are the same everywhere (``enable_cdi``, ``cdi_spec_dirs``); the table that holds them is not:

- containerd 1.7, and 2.x given a version 2 file (2.x migrates it when it starts):
  ``[plugins."io.containerd.grpc.v1.cri"]``;
- containerd 2.x with its own version 3 file: ``[plugins.'io.containerd.cri.v1.runtime']``. Given the old
  table there, 2.x logs ``Ignoring unknown key`` and nothing changes;
- CRI-O: ``[crio.runtime] cdi_spec_dirs`` (it has no switch; before 1.28 only an upgrade helps).

containerd's CRI Status does not tell the layouts apart (its ``info["config"]`` is the same JSON for a
version 2 and a version 3 file), so the version is read from the file itself: the top-level
``version = N`` of ``/etc/containerd/config.toml`` (:func:`read_config_file`, the one read here; a file
without the key is version 1, which containerd reads as the old layout too). Where the file cannot be
read, the remedy for 2.x names both tables. Everything else here is pure.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

from ate_devplugd.runtime_cdi import CdiVerdict, RuntimeReport, parse_version

#: containerd's config file when it is started without ``--config``.
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
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


def containerd_table(version: tuple[int, int, int], config: ConfigFile | None) -> tuple[str, str]:
    """The table holding enable_cdi and cdi_spec_dirs for this containerd and config file, and how to
    name it in a remedy (both layouts, where 2.x's file could not be read)."""
    if version < (2, 0, 0):
        return CONTAINERD_V2_TABLE, CONTAINERD_V2_TABLE
    declared = config.version if config else None
    if declared is None:
        both = f"{CONTAINERD_V3_TABLE} (a version 3 file; {CONTAINERD_V2_TABLE} in a version 2 file)"
        return CONTAINERD_V3_TABLE, both
    table = CONTAINERD_V3_TABLE if declared >= 3 else CONTAINERD_V2_TABLE
    return table, table


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
    table, named = containerd_table(version, config)
    if report.verdict is CdiVerdict.DIR_NOT_READ:
        dirs = _toml_list([*(report.spec_dirs or ()), cdi_dir])
        text = f"add {cdi_dir} to {named} cdi_spec_dirs of {file} and restart the runtime, {_OR_CDI_DIR}"
        return Remedy(text, table, (("cdi_spec_dirs", dirs),), file)
    if version < (1, 7, 2):
        return Remedy("upgrade containerd to 1.7.2 or later (with enable_cdi = true) or 2.x")
    text = f"set enable_cdi = true in {named} of {file}, restart containerd, then kubelet"
    return Remedy(text, table, (("enable_cdi", "true"),), file)


def _toml_list(items: list[str]) -> str:
    """A TOML array of basic strings (our paths hold no quote or backslash that needs more)."""
    return "[" + ", ".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items) + "]"
