"""The daemon that runs, as ``probe`` and ``doctor`` describe it: the config it runs, its last reload's
outcome, and how the file on disk differs from what runs.

Under the unit the daemon keeps its running config and its reload record in its runtime directory
(``reload.rundir``). A daemon runs it when a process holds that config's instance lock
(``kubelet.lock``), the one that wrote the record if there is one; the commands then describe that
daemon, whatever the file now says (a refused ``mode = "dra"`` leaves a device-plugin daemon serving).
With no such daemon (none runs, or one started by hand keeps no copy) there is nothing here: the
commands read the file, as ``check-config`` does.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from ate_devplugd import config as configmod
from ate_devplugd.base.toml_text import toml_value
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.kubelet.lock import InstanceLock
from ate_devplugd.reload import result as reload_result
from ate_devplugd.reload.result import Outcome, Result

#: The top-level keys compared between the file and what runs, in the file's order.
KEYS = ("plugin_dir", "dev_root", "log_level", "cdi_dir", "metrics_file", "runtime_socket", "mode")


@dataclass(frozen=True)
class RunningDaemon:
    pid: int
    #: The config it runs, and where the commands read it.
    config: Config
    source: str
    #: Its latest reload record (None: it keeps none).
    last: Result | None
    #: The file on disk against what runs: each difference, and whether a restart applies it (not a reload).
    differences: tuple[str, ...]
    restart: bool
    #: The file's first error when it does not load ("" when it does).
    file_error: str

    @property
    def refused(self) -> str:
        """The last reload, when it was refused or failed: ``reload 3 refused: <why>`` ("" otherwise)."""
        last = self.last
        if last is None or last.outcome not in (Outcome.REFUSED, Outcome.FAILED):
            return ""
        why = last.error.removeprefix(f"reload {last.outcome.value}: ")  # the reload command's line
        return f"reload {last.generation} {last.outcome.value}: {why}"

    def file_line(self) -> str:
        """How the file on disk differs from what runs ("" when it does not)."""
        if self.file_error:
            return f"the file on disk does not load ({self.file_error}); the daemon runs its previous config"
        if not self.differences:
            return ""
        return f"the file on disk differs from what runs: {'; '.join(self.differences)}"


def find(config_path: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ) -> RunningDaemon | None:
    """The running daemon, when one holds the lock of the config kept in its runtime directory."""
    source = configmod.running_config_path(environ)
    try:
        running = configmod.load(source)
    except ConfigError:
        return None
    holder = InstanceLock.of(running).holder()
    if holder is None:
        return None
    last = reload_result.read(reload_result.path_in(posixpath.dirname(source)))
    if last is not None and last.pid != holder[0]:
        return None  # another process's copy: not the daemon that holds the lock now
    try:
        on_disk = configmod.load(config_path)
    except ConfigError as exc:
        return RunningDaemon(holder[0], running, source, last, (), False, exc.errors[0])
    found, restart = differences(running, on_disk)
    return RunningDaemon(holder[0], running, source, last, found, restart, "")


def differences(running: Config, on_disk: Config) -> tuple[tuple[str, ...], bool]:
    """Each key or device the file sets otherwise than what runs, as TOML, with what applies it; and
    whether any of them takes a restart."""
    out = []
    restart = False
    for key in KEYS:
        now = getattr(on_disk, key)
        if now != getattr(running, key):
            takes_restart = key in configmod.RESTART_ONLY
            restart |= takes_restart
            out.append(f"{key} = {toml_value(now)} ({'restart' if takes_restart else 'reload'} to apply)")
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
