"""What the commands that check a node report, and how: findings, their lines and JSON, tables.

``doctor`` (both modes' checks: ``commands/doctor/__init__.py`` and ``commands/doctor/dra.py``) reports one
``Finding`` per check: OK, WARN or FAIL, what was found, and the remedy. They are printed one line each
(``render``) or as JSON for a fleet tool (``render_json``); the exit status is 1 when any of them failed
(``exit_status``). ``probe`` (``commands/probe/deviceplugin.py``, ``commands/probe/dra.py``) prints tables
(``format_table``).

Nothing here knows what is checked: no config, device or kubelet.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

#: The exit status of a run with a FAIL among its findings (and of a probe or a reload that failed).
EXIT_FAILED = 1


class Level(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``check`` names what was looked at (``device ate.dev/kvm``)."""

    check: str
    level: Level
    message: str
    remedy: str = ""


def config_error(lines: Sequence[str]) -> int:
    """A config that does not load: each error on stderr, and the exit status (78, EX_CONFIG)."""
    for line in lines:
        print(f"ate-devplugd: config error: {line}", file=sys.stderr)
    return os.EX_CONFIG


def ok(check: str, message: str) -> Finding:
    return Finding(check, Level.OK, message)


def warn(check: str, message: str, remedy: str = "") -> Finding:
    return Finding(check, Level.WARN, message, remedy)


def fail(check: str, message: str, remedy: str = "") -> Finding:
    return Finding(check, Level.FAIL, message, remedy)


def failed(findings: Sequence[Finding]) -> bool:
    return any(f.level is Level.FAIL for f in findings)


def exit_status(findings: Sequence[Finding]) -> int:
    """1 when anything failed (a WARN does not), else 0."""
    return EXIT_FAILED if failed(findings) else os.EX_OK


def render(findings: Sequence[Finding]) -> str:
    """One line each: level, check, what was found, and the remedy after a dash."""
    width = max((len(f.check) for f in findings), default=0)
    lines = []
    for f in findings:
        line = f"{f.level.value:<4}  {f.check:<{width}}  {f.message}"
        if f.remedy and f.level is not Level.OK:
            line += f" -- {f.remedy}"
        lines.append(line)
    return "\n".join(lines)


def render_json(findings: Sequence[Finding]) -> str:
    checks = [{"check": f.check, "level": f.level.value, "message": f.message, "remedy": f.remedy} for f in findings]
    summary = {level.value: sum(1 for f in findings if f.level is level) for level in Level}
    return json.dumps({"ok": not failed(findings), "summary": summary, "checks": checks}, indent=2)


def format_table(table: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the last one as it is."""
    last = len(table[0]) - 1
    widths = [max(len(r[i]) for r in table) for i in range(last)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) if i < last else cell for i, cell in enumerate(r)).rstrip() for r in table
    )
