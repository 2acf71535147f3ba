"""The daemon that serves a config, as the commands describe it: ``probe``, ``doctor``, ``reload`` and
``switch-mode`` each find it through the config they are given, and compare the file with it by value.

A daemon serves a config when it holds the instance lock of the directory that config serves in (its
mode's, or the other mode's: a file whose ``mode`` changed since the start still names the daemon's
directory); else, for a file that does not load or names other directories now, it is the daemon that was
started from that file (its record's ``source``). What the daemon runs is its own record's word
(``reload.record``): the config it runs, as values, and how its last reload went. The file is compared
with that config as values: a default the file leaves unset is no difference. With no daemon for the
config, the commands say so, naming the daemons they see serving other directories.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import NamedTuple

from ate_devplugd import config as configmod
from ate_devplugd.base import announce
from ate_devplugd.base.toml_text import toml_value
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.kubelet.lock import InstanceLock, held_names
from ate_devplugd.reload import record
from ate_devplugd.reload.record import Instance
from ate_devplugd.reload.result import Outcome


class Running(NamedTuple):
    """A daemon as its record says, with the lock name it holds and the config it runs."""

    name: bytes
    record: Instance
    config: Config

    @property
    def pid(self) -> int:
        return self.record.pid

    @property
    def directory(self) -> str:
        """The directory it serves in (its lock's): what tells two daemons apart."""
        return InstanceLock.of(self.config).directory

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.record.started))
        source = self.record.source or "the built-in defaults"
        return f"pid {self.pid}, {self.record.mode} mode in {self.directory}, started {started} from {source}"

    @property
    def refused(self) -> str:
        """Its last reload, when it was refused or failed: ``reload 3 refused: <why>`` ("" otherwise)."""
        last = self.record.reload
        if last.outcome not in (Outcome.REFUSED, Outcome.FAILED):
            return ""
        why = last.error.removeprefix(f"reload {last.outcome.value}: ")  # the reload command's line
        return f"reload {last.generation} {last.outcome.value}: {why}"


async def at(name: bytes) -> Running | None:
    """The daemon holding lock ``name``, by its record (the pid the kernel gives must be the record's)."""
    found = await announce.fetch(name)
    if found is None:
        return None
    peer, line = found
    instance = record.decode(line)
    if instance is None or instance.pid != peer.pid:
        return None
    try:
        config = configmod.from_mapping(instance.config)
    except ConfigError:
        return None
    return Running(name, instance, config)


async def every() -> list[Running]:
    """Every daemon running on this host, in the kernel's order of their locks."""
    found = [await at(name) for name in held_names()]
    return [running for running in found if running is not None]


async def serving(config: Config) -> Running | None:
    """The daemon that serves ``config``: the one holding a lock the config's directories name."""
    for lock in InstanceLock.candidates(config):
        running = await at(lock.name)
        if running is not None:
            return running
    return None


class Found(NamedTuple):
    """What a command given a config file finds: the file, the daemon that serves it, how they differ."""

    #: The file's config (None when it does not load: ``file_errors`` say why, every one of them).
    file: Config | None
    file_errors: tuple[str, ...]
    running: Running | None
    #: Each difference between the file and what runs, with what applies it; whether one takes a restart.
    differences: tuple[str, ...] = ()
    restart: bool = False
    #: The daemons that serve other configs (when none serves this one).
    others: tuple[Running, ...] = ()

    @property
    def file_error(self) -> str:
        """The file's first error ("" when it loads)."""
        return self.file_errors[0] if self.file_errors else ""

    @property
    def config(self) -> Config | None:
        """What the command describes: the config that runs, else the file's."""
        return self.running.config if self.running is not None else self.file

    def file_line(self) -> str:
        """How the file on disk differs from what runs ("" when it does not)."""
        if self.file_error:
            return f"the file on disk does not load ({self.file_error}); the daemon runs its previous config"
        if not self.differences:
            return ""
        return f"the file on disk differs from what runs: {'; '.join(self.differences)}"

    def nobody(self) -> str:
        """No daemon serves the file's config: said with the daemons serving other directories."""
        where = InstanceLock.of(self.file).directory if self.file is not None else "this config"
        others = [running.describe() for running in self.others]
        seen = f"; running: {', '.join(others)}" if others else ""
        return f"no ate-devplugd serves {where}{seen}"


async def find(config_path: str | os.PathLike[str] | None, plugin_dir: str | None = None) -> Found:
    """The file at ``config_path`` (None: the default), the daemon that serves it and how the two differ;
    ``plugin_dir`` is a command line's ``--plugin-dir`` over the file's."""
    try:
        file: Config | None = configmod.load(config_path)
        if plugin_dir and file is not None:
            file = file.with_overrides(plugin_dir=plugin_dir)
        errors: tuple[str, ...] = ()
    except ConfigError as exc:
        file, errors = None, tuple(exc.errors)
    running = await serving(file) if file is not None else None
    if running is None:  # a file that does not load, or names other directories now: the daemon started from it
        source = record.source_of(config_path)
        running = next((r for r in await every() if r.record.source == source), None)
    if running is None:
        return Found(file, errors, None, others=tuple(await every()))
    if file is None:
        return Found(file, errors, running)
    with contextlib.suppress(ConfigError):  # the file as the daemon reads it: under its command line's options
        file = file.with_overrides(**running.record.overrides)
    found, restart = differences(running.config, file)
    return Found(file, errors, running, found, restart)


def differences(running: Config, on_disk: Config) -> tuple[tuple[str, ...], bool]:
    """Each key or device the file sets otherwise than what runs, as TOML, with what applies it; and
    whether any of them takes a restart. ``mode`` is never a restart's: ``switch-mode`` moves it."""
    out = []
    restart = False
    for key in configmod.TOP_KEYS:
        now = getattr(on_disk, key)
        if now != getattr(running, key):
            how = "switch-mode" if key == "mode" else "restart" if key in configmod.RESTART_ONLY else "reload"
            restart |= how == "restart"
            out.append(f"{key} = {toml_value(now)} ({how} to apply)")
    if on_disk.dra != running.dra:
        restart = True
        what = "added" if running.dra is None else "removed" if on_disk.dra is None else "changed"
        out.append(f"[dra] {what} (restart to apply)")
    change = configmod.diff(running, on_disk)
    devices_restart = running.mode == "dra" and bool(change.added or change.removed)
    restart |= devices_restart
    how = "restart" if devices_restart else "reload"
    for verb, names in (("added", change.added), ("changed", change.changed), ("removed", change.removed)):
        out += [f"device {name} {verb} ({'reload' if verb == 'changed' else how} to apply)" for name in names]
    return tuple(out), restart
