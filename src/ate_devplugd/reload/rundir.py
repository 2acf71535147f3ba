"""What the running daemon keeps in its runtime directory for the commands that ask about it.

Under the unit (``RuntimeDirectory=``, /run/ate-devplugd) the daemon keeps there the config it runs
(``running-config.toml``, rewritten at start and after each good reload: ``probe`` reads it when the file
on disk does not parse) and the outcome of its latest reload (``reload.result``: what ``ate-devplugd
reload`` waits for). Each file is replaced in one step; neither outlives the daemon. Started by hand,
the daemon is given no paths and keeps nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ate_devplugd import config as configmod
from ate_devplugd.base import atomicfile
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import Config
from ate_devplugd.reload import result as reload_result
from ate_devplugd.reload.result import Outcome, Result

log = logging.getLogger(__name__)


class RuntimeFiles:
    """The running config and the reload outcome, each at its path (None: not kept)."""

    def __init__(self, running_config: str | None = None, reload_result_path: str | None = None) -> None:
        self.running_config = running_config
        self.reload_result = reload_result_path
        self._events = EventLog(log)
        self._written = False

    def keep_config(self, config: Config) -> None:
        """Write the config being run (as TOML) where `probe` finds it."""
        if self.running_config is None:
            return
        try:
            atomicfile.replace_file(self.running_config, configmod.render(config).encode(), 0o644)
        except OSError as exc:
            self._events.warning(
                "running-config-failed",
                "cannot write %s (%s); probe reads only the config file",
                self.running_config,
                exc.strerror,
            )
        self._written = True

    def record(self, generation: int, outcome: Outcome, error: str = "") -> None:
        """Record the outcome of reload number ``generation`` (0: the start) for `ate-devplugd reload`."""
        if self.reload_result is None:
            return
        try:
            reload_result.write(self.reload_result, Result(os.getpid(), generation, outcome, error))
        except OSError as exc:
            self._events.warning(
                "reload-result-failed",
                "cannot write %s (%s); `ate-devplugd reload` cannot tell how a reload went",
                self.reload_result,
                exc.strerror,
            )
        self._written = True

    def forget(self) -> None:
        """At the stop: nothing outlives the daemon (systemd removes its runtime directory too); a daemon
        that never wrote (another one's files, when it did not start) removes nothing."""
        if not self._written:
            return
        for path in (self.running_config, self.reload_result):
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
