"""Command line: ``ate-devplugd [run] | check-config | probe | doctor | dra-manifests | reload |
switch-mode``: the unit's `run` line as ``commands.runline`` reads it, any other as ``commands.args``
parses it; then the daemon (``run``), or the command's own module (``COMMANDS``)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from ate_devplugd import __version__
from ate_devplugd import config as configmod
from ate_devplugd.commands import runline
from ate_devplugd.config import ConfigError

if TYPE_CHECKING:
    import argparse

    from ate_devplugd.daemon.handover import Successor

#: The commands other than `run`: the module that runs each (imported only when it is chosen, so that no
#: command pays for another's imports, and `run` for none) and its entry point, given the parsed line.
COMMANDS = {
    "check-config": "ate_devplugd.commands.check",
    "probe": "ate_devplugd.commands.probe",
    "doctor": "ate_devplugd.commands.doctor",
    "dra-manifests": "ate_devplugd.commands.manifests",
    "reload": "ate_devplugd.commands.reload",
    "switch-mode": "ate_devplugd.commands.switch",
}
#: How long, at exit, the loop is kept for tasks gRPC still has on it.
LEFTOVER_TASKS_TIMEOUT = 0.5


def main(argv: list[str] | None = None) -> int:
    early = _EarlySignals()
    given = list(sys.argv[1:] if argv is None else argv)
    line = runline.read(given)  # the unit's `run` line: no argparse
    if line is None:
        from ate_devplugd.commands import args as cli_args  # noqa: PLC0415 - argparse for any other line

        parser = cli_args.parser_for(given)
        args = parser.parse_args(cli_args.command_first(parser, given))
        if args.command != "run":
            early.restore()
            return _command(args)
        line = runline.RunLine.of(args)
    from ate_devplugd.daemon.handover import Successor  # noqa: PLC0415 - the run path only

    successor = Successor.from_env()  # started by a running daemon to take its node over
    try:
        cfg = configmod.load(line.config, overrides=line.overrides())
    except ConfigError as exc:
        for error in exc.errors:
            print(f"ate-devplugd: config error: {error}", file=sys.stderr)
        if successor is not None:
            successor.refuse(f"config error: {exc.errors[0]}")
        return os.EX_CONFIG
    status = _run(cfg, line, early, successor, sys.orig_argv if argv is None else None)
    if argv is None:  # the process itself (the console script, python -m), not a caller in Python
        _exit_now(status)
    return status


def _command(args: argparse.Namespace) -> int:
    """Any command but `run`: its module's ``main``, as ``commands.args`` parsed the line."""
    module: Any = importlib.import_module(COMMANDS[args.command])
    return int(module.main(args))


def _exit_now(status: int) -> None:
    """End the process once the daemon has stopped, without the interpreter's teardown.

    Every socket, the lock and the notify socket are already closed; what is left is freeing each module
    and object one by one (30-50 ms), and an upgrade's new daemon starts only once this one has exited:
    kubelet has no units of ours meanwhile. Logs and stdio are flushed first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


class _EarlySignals:
    """Signals before the daemon's own handlers exist (imports and config take a few hundred ms).

    They are only remembered: raising from a handler in the middle of importing grpc's extension
    module crashes the interpreter at exit. SIGTERM or SIGINT then ends start-up with status 0 before
    anything is created, or stops the daemon at once; SIGHUP becomes a reload once the daemon runs
    (the file may have changed after it was read), SIGUSR2 a handover.
    """

    def __init__(self) -> None:
        self.stop = False
        self.reload = False
        self.handover = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._hup)
        signal.signal(signal.SIGUSR2, self._usr2)

    @staticmethod
    def restore() -> None:
        """Back to the defaults (for the commands that are not the daemon)."""
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _stop(self, signum: int, frame: object) -> None:
        self.stop = True

    def _hup(self, signum: int, frame: object) -> None:
        self.reload = True

    def _usr2(self, signum: int, frame: object) -> None:
        self.handover = True


def _run(
    cfg: configmod.Config,
    line: runline.RunLine,
    early: _EarlySignals,
    successor: Successor | None,
    argv: list[str] | None,
) -> int:
    """The daemon; ``argv`` is the process's own command line (a handover starts its successor so), None
    where it is not a process of its own (a caller in Python)."""
    from ate_devplugd.base import malloc  # noqa: PLC0415 - before gRPC and its threads

    malloc.one_arena()
    import asyncio  # noqa: PLC0415 - not imported before the signal handlers are in place

    from ate_devplugd.base.logs import setup_logging  # noqa: PLC0415
    from ate_devplugd.daemon import Daemon  # noqa: PLC0415 - heavy imports only for the daemon
    from ate_devplugd.reload import record  # noqa: PLC0415

    setup_logging(line.log_target, cfg.log_level)
    log = logging.getLogger(__name__)

    def reload_config() -> configmod.Config:
        return configmod.load(line.config, overrides=line.overrides())

    log.info("ate-devplugd %s starting: %d device(s), plugin_dir %s", __version__, len(cfg.devices), cfg.plugin_dir)
    for warning in configmod.review(cfg).warnings:  # what check-config warns of, said once (nothing to act on now)
        log.info("config warning: %s", warning)
    if early.stop:
        return os.EX_OK
    overrides = {key: value for key, value in line.overrides().items() if value is not None}
    source = record.source_of(line.config)
    daemon = Daemon(
        cfg, source=source, overrides=overrides, reload_config=reload_config, argv=argv, successor=successor
    )

    async def run() -> int:
        task = asyncio.ensure_future(daemon.run())
        await asyncio.sleep(0)  # the daemon's first step installs its signal handlers
        if early.stop:
            daemon.request_stop()
        elif early.reload:
            daemon.request_reload()
        elif early.handover:
            daemon.request_handover()
        status = await task
        # gRPC ends the calls its stopped servers had in tasks of its own, a loop turn or two later; ended
        # by asyncio.run instead, each would be reported as a crash. They take well under a millisecond.
        leftover = asyncio.all_tasks() - {asyncio.current_task()}
        if leftover:
            await asyncio.wait(leftover, timeout=LEFTOVER_TASKS_TIMEOUT)
        return status

    return asyncio.run(run())
