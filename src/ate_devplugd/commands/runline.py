"""`run`'s command line as the unit gives it (``ate-devplugd run [--option VALUE]...``), read without
argparse, whose import and parser are about 2.5 ms of every start.

``read`` takes only what it can read exactly as argparse would: ``run`` first, then the options below by
their full names, each with a value (``--config PATH`` or ``--config=PATH``). Anything else (``--help``, an
abbreviation, an unknown option, a value argparse would refuse or read otherwise) is None, and
``commands.args`` parses the line, with its usage errors and help. Its ``run`` parser has these options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import argparse

#: Where the log goes: ``auto`` is journald when started by systemd, else stderr.
LOG_TARGETS = ("auto", "journal", "console")
#: `run`'s options -> the values each allows (None: any).
OPTIONS: dict[str, tuple[str, ...] | None] = {
    "--config": None,
    "--plugin-dir": None,
    "--dev-root": None,
    "--log-level": None,
    "--log-target": LOG_TARGETS,
}


class RunLine(NamedTuple):
    """What `run` was given (None: not given, the file's value or the default holds)."""

    config: str | None = None
    plugin_dir: str | None = None
    dev_root: str | None = None
    log_level: str | None = None
    log_target: str = "auto"

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunLine:
        """The same, from `run`'s line as ``commands.args`` parsed it."""
        return cls(**{name: getattr(args, name) for name in cls._fields})

    def overrides(self) -> dict[str, str | None]:
        """What the options set over the file."""
        return {"plugin_dir": self.plugin_dir, "dev_root": self.dev_root, "log_level": self.log_level}


def read(args: list[str]) -> RunLine | None:
    """``args`` as `run`'s options, or None for argparse to parse."""
    if not args or args[0] != "run":
        return None
    values: dict[str, str] = {}
    index = 1
    while index < len(args):
        option, eq, value = args[index].partition("=")
        if option not in OPTIONS:
            return None
        if not eq:
            index += 1
            if index == len(args) or args[index].startswith("-"):
                return None  # no value, or one argparse may take for an option
            value = args[index]
        allowed = OPTIONS[option]
        if allowed is not None and value not in allowed:
            return None
        values[option[2:].replace("-", "_")] = value
        index += 1
    return RunLine(**values)
