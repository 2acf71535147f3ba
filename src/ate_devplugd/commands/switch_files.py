"""The host's side of ``switch-mode``: the config's top-level ``mode`` and the unit's DRA drop-in (and the
names of its annotations on the Node, the cordon's and the move's target, which ``doctor`` reads too).

The config file is changed in its ``mode`` line only (added, marked, before the first table when it has
none; that line removed again on the way back), so every other byte stays as the operator wrote it; the
new text is validated as ``check-config`` validates it before it replaces the file in one step. The
drop-in is a symlink to the packaged ``dra-mode.conf``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import re
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ate_devplugd import config as configmod
from ate_devplugd.base.atomicfile import replace_file
from ate_devplugd.config import Config

#: On the Node while the cordon is ``switch-mode``'s: only a cordon with it is lifted by it (``doctor`` reads it).
CORDON_ANNOTATION = "ate.dev/cordoned-by"
CORDON_VALUE = "switch-mode"
#: On the Node from a move's start to its end: the mode it moves to, so that a move interrupted before the
#: config changed still reads as the move it is (``doctor``: which way finishes it, which goes back).
TARGET_ANNOTATION = "ate.dev/switch-mode-target"
DROPIN_DIR = "/etc/systemd/system/ate-devplugd.service.d"
DROPIN_SOURCE = "/usr/share/ate-devplugd/dra-mode.conf"
DROPIN_NAME = "dra-mode.conf"
UNIT = "ate-devplugd.service"

#: A top-level ``mode = ...`` line (before any table header), with whatever comment follows it.
_MODE_LINE = re.compile(r'^[ \t]*mode[ \t]*=[ \t]*("[^"\n]*"|\'[^\'\n]*\')(?P<rest>[ \t]*(#[^\n]*)?)$', re.MULTILINE)
_TABLE = re.compile(r"^[ \t]*\[", re.MULTILINE)
#: The comment on a mode line ``switch-mode`` added (the file had none): it goes again on the way back.
ADDED = "  # added by ate-devplugd switch-mode"


@dataclass(frozen=True)
class HostFiles:
    """Where the config and the unit's drop-in are (a test gives its own)."""

    config: str = configmod.DEFAULT_CONFIG_PATH
    dropin_dir: str = DROPIN_DIR
    dropin_source: str = DROPIN_SOURCE

    @property
    def dropin(self) -> str:
        return posixpath.join(self.dropin_dir, DROPIN_NAME)


class SwitchFailed(Exception):
    """A step did not complete; the message says which and why."""


class NothingChanged(SwitchFailed):
    """A step refused before it changed anything: the daemon serves on as it did (a guarded handover the
    daemon refused), so the run lifts its own cordon before it says so."""


async def run_systemctl(command: str, *args: str) -> None:
    """``systemctl ARGS`` (``command`` names the binary); SwitchFailed when it fails."""
    proc = await asyncio.create_subprocess_exec(command, *args)
    if await proc.wait() != 0:
        raise SwitchFailed(f"{command} {' '.join(args)} exited {proc.returncode}")


@dataclass
class Host:
    """What the command changes on the host, and how; a test gives its own."""

    files: HostFiles = field(default_factory=HostFiles)
    systemctl: Callable[..., Awaitable[None]] = field(default=lambda *a: run_systemctl("systemctl", *a))
    say: Callable[[str], None] = print
    #: Where kubelet's process is looked for (its feature gates: ``commands.gates``).
    proc_root: str = "/proc"


def with_mode(text: str, mode: str) -> str:
    """``text`` with its top-level ``mode`` set to ``mode``, every other byte kept. A file without a mode
    line gets one, marked (``ADDED``), above the first table and the comment lines that are its own; the
    way back to device-plugin mode (the default) removes that marked line, so a move there and back leaves
    the file as it was."""
    first_table = _TABLE.search(text)
    top = text[: first_table.start()] if first_table else text
    found = _MODE_LINE.search(top)
    if found is not None:
        if mode == "device-plugin" and found["rest"] == ADDED:
            end = found.end() + (2 if text.startswith("\n\n", found.end()) else 1)
            return text[: found.start()] + text[end:]
        return text[: found.start()] + f'mode = "{mode}"' + found["rest"] + text[found.end() :]
    if mode == "device-plugin":
        return text  # the default already
    line = f'mode = "{mode}"{ADDED}'
    if first_table is None:
        return text + ("" if not text or text.endswith("\n") else "\n") + line + "\n"
    at = first_table.start()
    while (above := text.rfind("\n", 0, at - 1) + 1) < at and text[above:at].lstrip().startswith("#"):
        at = above  # the table's own comment lines stay with it
    return text[:at] + line + "\n\n" + text[at:]


def write_mode(files: HostFiles, mode: str) -> tuple[bool, Config]:
    """Set the config file's ``mode``: whether the file changed, and the config it now holds. Raises
    ConfigError (nothing written) when the result would not pass ``check-config``."""
    try:
        with open(files.config, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        text = ""
    new = with_mode(text, mode)
    cfg = configmod.parse(new, source=files.config)  # every check, as check-config runs them
    if new == text:
        return False, cfg
    try:
        mode_bits = stat.S_IMODE(os.stat(files.config).st_mode)
    except FileNotFoundError:
        mode_bits = 0o644
    replace_file(files.config, new.encode(), mode_bits)
    return True, cfg


def dropin_linked(files: HostFiles) -> bool:
    return os.path.lexists(files.dropin)


def link_dropin(files: HostFiles) -> bool:
    """The drop-in linked (whether that changed anything); a file of the operator's there is kept."""
    if os.path.lexists(files.dropin):
        return False
    os.makedirs(files.dropin_dir, mode=0o755, exist_ok=True)
    os.symlink(files.dropin_source, files.dropin)
    return True


def remove_dropin(files: HostFiles) -> bool:
    """The drop-in removed (whether it was there), and its directory if that leaves it empty."""
    if not os.path.lexists(files.dropin):
        return False
    os.unlink(files.dropin)
    with contextlib.suppress(OSError):  # not empty: other drop-ins of the operator's
        os.rmdir(files.dropin_dir)
    return True
