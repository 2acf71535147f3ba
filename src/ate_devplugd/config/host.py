"""What a config's device paths are on this host, checked as part of loading it (``config.from_mapping``).

A ``path`` that is a directory under ``dev_root`` can never be a device node: it is a config error, found
in the same round as the file's own errors, whoever loads the file (start, reload, ``check-config``,
``doctor``). Each table is looked at as it is written, so that a table with other errors is checked too.
"""

from __future__ import annotations

import posixpath

from ate_devplugd.base.look import Look, look
from ate_devplugd.base.toml_text import toml_str, toml_value


def path_errors(dev_root: str, tables: object) -> list[str]:
    """One error per ``[[device]]`` table whose ``path`` is a directory under ``dev_root``."""
    if not isinstance(tables, list):
        return []
    errors = []
    for index, table in enumerate(tables):
        if not isinstance(table, dict):
            continue
        path = table.get("path")
        if not (isinstance(path, str) and path.startswith("/") and "\0" not in path):
            continue
        if look(posixpath.join(dev_root, path.lstrip("/")), directory=True) is Look.PRESENT:
            errors.append(
                f"{_where(index, table)}: path: {toml_value(path)} is a directory; "
                "path names a device node, e.g. '/dev/kvm'"
            )
    return errors


def _where(index: int, table: dict[str, object]) -> str:
    """As ``config.device.tables`` names a table."""
    name = table.get("resource")
    if not isinstance(name, str):
        return f"device[{index}]"
    return f"device[{index}] ({name if name.isprintable() else toml_str(name)})"
