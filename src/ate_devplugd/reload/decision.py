"""Whether a reload may apply a re-read config: the checks that refuse it whole, before anything changes.

A reload is refused, and the running config kept, for the first of these it meets: the file does not
load (each of its errors: ``config.load`` is the one validation, the one ``check-config`` runs); it
changes a restart-only key (``config.RESTART_ONLY``), or in DRA mode the set of resources; an added
resource's socket is served by another process. The refusal carries every line of its kind for the
journal, the first for STATUS, and the line the ``reload`` command shows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from ate_devplugd import config as configmod
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.kubelet.lock import busy_sockets


class Reason(enum.Enum):
    CONFIG_ERROR = "config error"
    RESTART_ONLY = "restart-only change"
    SOCKET_BUSY = "socket busy"


class ReloadRefused(Exception):
    """Nothing of the new config is applied; ``lines`` (at least one) say why."""

    def __init__(self, reason: Reason, lines: list[str] | tuple[str, ...]) -> None:
        super().__init__(lines[0])
        self.reason = reason
        self.lines = tuple(lines)

    @property
    def first(self) -> str:
        return self.lines[0]

    def journal_lines(self) -> list[str]:
        """One journal line (at error priority) per line of the refusal."""
        if self.reason is Reason.CONFIG_ERROR:
            return [f"config error, keeping the running config: {line}" for line in self.lines]
        if self.reason is Reason.SOCKET_BUSY:
            return [f"{line}; keeping the running config" for line in self.lines]
        return list(self.lines)

    def message(self) -> str:
        """The line the ``reload`` command prints after ``ate-devplugd: `` (a config error as
        ``check-config`` prints it)."""
        if self.reason is Reason.CONFIG_ERROR:
            return f"config error: {self.first}"
        return f"reload refused: {self.first}"


def accept(running: Config, load: Callable[[], Config]) -> Config:
    """The config ``load`` reads, if a reload may apply it over ``running``; else ``ReloadRefused``."""
    try:
        new = load()
    except ConfigError as exc:
        raise ReloadRefused(Reason.CONFIG_ERROR, exc.errors) from None
    restart = configmod.restart_only_change(running, new) or _dra_resources_change(running, new)
    if restart is not None:
        raise ReloadRefused(Reason.RESTART_ONLY, [restart])
    added = set(configmod.diff(running, new).added)
    busy = sockets_in_use(new, tuple(dev for dev in new.devices if dev.resource in added))
    if busy:
        raise ReloadRefused(Reason.SOCKET_BUSY, busy)
    return new


def sockets_in_use(config: Config, devices: tuple[DeviceConfig, ...]) -> list[str]:
    """Why each of these devices' sockets cannot be served: another process answers there (device-plugin
    mode's sockets only; DRA mode's own find out when they are served)."""
    return busy_sockets(config.plugin_dir, devices) if config.mode != "dra" else []


def _dra_resources_change(running: Config, new: Config) -> str | None:
    """DRA mode publishes its set of resources as it was at start."""
    if running.mode != "dra":
        return None
    change = configmod.diff(running, new)
    names = [f"adding {name}" for name in change.added] + [f"removing {name}" for name in change.removed]
    if not names:
        return None
    return (
        f"DRA mode's set of resources changes only on restart ({', '.join(names)}), "
        "so nothing of this reload was applied"
    )
