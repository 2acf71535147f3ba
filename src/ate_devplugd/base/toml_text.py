"""Values written as TOML, as a user writes them: for error messages and for the rendered config.

An error names the bad value as it stands in the file (``true``, ``0o1777``, ``[{driver = 'x'}]``), never
as Python prints it (``True``, ``1023``, ``[{'driver': 'x'}]``); a rendered config reads back to the same
values.
"""

from __future__ import annotations

import datetime
import math
import re

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


def toml_value(value: object, *, octal: bool = False) -> str:  # noqa: PLR0911 - one return per TOML type
    """``value`` as it is written in TOML, for error messages: ``true``, ``0o1777`` (with ``octal``),
    ``'ate.dev/kvm'``, ``[{driver = 'x'}]``; None (a key not given) is ``unset``.

    A string is a literal string (single quotes, as the messages have always shown them) unless it holds
    a quote or a character that is not printable: then a basic string with escapes, so that an error is
    always one printable line.
    """
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"0o{value:o}" if octal and value >= 0 else str(value)
    if isinstance(value, float):
        return _toml_float(value)
    if isinstance(value, str):
        return f"'{value}'" if value.isprintable() and "'" not in value else toml_str(value)
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(str(k))} = {toml_value(v, octal=octal)}" for k, v in value.items())
        return "{" + items + "}" if items else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v, octal=octal) for v in value) + "]"
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    return toml_str(str(value))


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_str(key)


def toml_setting(value: object) -> str:
    """``value`` as a rendered config writes it: a string as a basic string (``toml_str``), anything else as
    ``toml_value`` writes it."""
    return toml_str(value) if isinstance(value, str) else toml_value(value)


def toml_str(value: str) -> str:
    """A TOML basic string (double quotes), escaped so that it is one printable line that reads back to
    ``value``: what a rendered config writes."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\U{ord(c):08x}" for c in escaped) + '"'
