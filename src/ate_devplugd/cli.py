"""Command line: ``ate-devplugd [run] | check-config | probe | doctor | dra-manifests | reload |
switch-mode``: the unit's `run` line as ``commands.runline`` reads it, any other as ``commands.args``
parses it; then the command it names."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from ate_devplugd import __version__
from ate_devplugd import config as configmod
from ate_devplugd.commands import runline
from ate_devplugd.config import DEFAULT_CONFIG_PATH, ConfigError

if TYPE_CHECKING:
    import argparse

    from ate_devplugd.commands import running

#: `probe` found a socket that does not answer, `doctor` a FAIL, `reload` a refusal (os.EX_* has no name).
EX_FAILURE = 1
#: How long, at exit, the loop is kept for tasks gRPC still has on it.
LEFTOVER_TASKS_TIMEOUT = 0.5


def _config_error(exc: ConfigError) -> int:
    for line in exc.errors:
        print(f"ate-devplugd: config error: {line}", file=sys.stderr)
    return os.EX_CONFIG


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
    try:
        cfg = configmod.load(line.config, overrides=line.overrides())
    except ConfigError as exc:
        return _config_error(exc)
    status = _run(cfg, line, early)
    if argv is None:  # the process itself (the console script, python -m), not a caller in Python
        _exit_now(status)
    return status


def _command(args: argparse.Namespace) -> int:  # noqa: PLR0911 - one return per command
    """Any command but `run`, as ``commands.args`` parsed it."""
    if args.command == "doctor":
        return _doctor(args.config, as_json=args.json)
    if args.command == "reload":  # before the config is read: the daemon reads it, and says what it found
        from ate_devplugd.commands import reload as reload_request  # noqa: PLC0415 - inotify only for this command

        return os.EX_OK if reload_request.request(args.config, args.pid, args.timeout) else EX_FAILURE
    if args.command == "probe":
        from ate_devplugd.commands import running as running_daemon  # noqa: PLC0415 - the lock's socket only here

        daemon = running_daemon.find(args.config)
        if daemon is not None:  # the daemon that runs, whatever the file says now
            return _probe(_describe_running(daemon, args.config, args.plugin_dir), args.timeout)
    try:
        cfg = configmod.load(args.config)
        if args.command == "probe" and args.plugin_dir:
            cfg = cfg.with_overrides(plugin_dir=args.plugin_dir)
    except ConfigError as exc:
        return _config_error(exc)

    if args.command == "check-config":
        return _check_config(cfg)
    if args.command == "switch-mode":
        return _switch_mode(cfg, args)
    if args.command == "probe":
        return _probe(cfg, args.timeout)
    return _dra_manifests(
        cfg, with_access=not args.kubelet_credentials, stage=args.stage, refuse_multi=args.refuse_multi
    )


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


def _check_config(cfg: configmod.Config) -> int:
    """The effective config on stdout; on stderr what else the config means on this host."""
    review = configmod.review(cfg)
    for line in review.notes:
        print(f"ate-devplugd: note: {line}", file=sys.stderr)
    for line in review.warnings:
        print(f"ate-devplugd: config warning: {line}", file=sys.stderr)
    sys.stdout.write(configmod.render(cfg))
    return os.EX_OK


def _describe_running(daemon: running.RunningDaemon, config: str | None, plugin_dir: str | None) -> configmod.Config:
    """For `probe`: the running daemon's config, saying on stderr how the file differs and how its last
    reload went."""
    if daemon.file_error:
        print(
            f"ate-devplugd: probing with the running daemon's config from {daemon.source}; "
            f"{config or DEFAULT_CONFIG_PATH} does not parse: {daemon.file_error}",
            file=sys.stderr,
        )
    elif daemon.differences:
        print(f"ate-devplugd: probing the running daemon (pid {daemon.pid}); {daemon.file_line()}", file=sys.stderr)
    if daemon.refused:
        print(f"ate-devplugd: its last reload was not applied: {daemon.refused}", file=sys.stderr)
    return daemon.config.with_overrides(plugin_dir=plugin_dir) if plugin_dir else daemon.config


def _switch_mode(cfg: configmod.Config, args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415 - not imported before the signal handlers are in place

    from ate_devplugd.base import logs  # noqa: PLC0415
    from ate_devplugd.commands import switch  # noqa: PLC0415 - aiohttp only for this command
    from ate_devplugd.commands.switch_files import HostFiles  # noqa: PLC0415

    if os.path.exists("/run/systemd/journal/socket"):  # each step's event in the journal, besides stdout
        with contextlib.suppress(ImportError):
            logger = logging.getLogger(switch.__name__)
            logger.addHandler(logs.JournalHandler())
            logger.setLevel(logging.INFO)
            logger.propagate = False
    files = HostFiles(args.config or DEFAULT_CONFIG_PATH, args.dropin_dir, args.dropin_source)

    async def systemctl(*words: str) -> None:
        await switch.run_systemctl(args.systemctl, *words)

    host = switch.Host(files, configmod.running_config_path(), systemctl)
    if args.kubeconfig and cfg.dra is not None:
        cfg = dataclasses.replace(cfg, dra=dataclasses.replace(cfg.dra, kubeconfig=args.kubeconfig))
    try:
        return asyncio.run(switch.switch_mode(args.mode, cfg, host, switch.Timing(args.timeout, args.settle)))
    except ConfigError as exc:
        return _config_error(exc)


def _dra_manifests(
    cfg: configmod.Config, *, with_access: bool, stage: str | None = None, refuse_multi: bool = False
) -> int:
    from ate_devplugd.commands import manifests  # noqa: PLC0415
    from ate_devplugd.config import dra as dra_config  # noqa: PLC0415 - PyYAML only for this command

    dra = cfg.dra or dra_config.from_mapping(None)[0]
    resources = [dev.resource for dev in cfg.devices]
    text = manifests.render(dra, resources, with_access=with_access, stage=stage, refuse_multi=refuse_multi)
    sys.stdout.write(text)
    return os.EX_OK


class _EarlySignals:
    """Signals before the daemon's own handlers exist (imports and config take a few hundred ms).

    They are only remembered: raising from a handler in the middle of importing grpc's extension
    module crashes the interpreter at exit. SIGTERM or SIGINT then ends start-up with status 0 before
    anything is created, or stops the daemon at once; SIGHUP becomes a reload once the daemon runs
    (the file may have changed after it was read).
    """

    def __init__(self) -> None:
        self.stop = False
        self.reload = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._hup)

    @staticmethod
    def restore() -> None:
        """Back to the defaults (for the commands that are not the daemon)."""
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _stop(self, signum: int, frame: object) -> None:
        self.stop = True

    def _hup(self, signum: int, frame: object) -> None:
        self.reload = True


def _probe(cfg: configmod.Config, timeout: float) -> int:
    import asyncio  # noqa: PLC0415 - not imported before the signal handlers are in place

    if cfg.mode == "dra" and cfg.dra is not None:
        from ate_devplugd.commands.probe import dra as probe  # noqa: PLC0415 - aiohttp and PyYAML only in DRA mode

        report = asyncio.run(probe.probe(cfg.dra, timeout))
        print(probe.render(report))
        return os.EX_OK if report.ok else EX_FAILURE

    from ate_devplugd.commands.probe import deviceplugin as nodeprobe  # noqa: PLC0415 - keeps `check-config` free of grpc

    ours = {dev.socket_name: dev.resource for dev in cfg.devices}
    try:
        rows = asyncio.run(nodeprobe.probe_all(cfg.plugin_dir, ours, timeout, cfg.metrics_file))
    except OSError as exc:
        print(f"ate-devplugd: cannot read {cfg.plugin_dir}: {exc.strerror}", file=sys.stderr)
        return EX_FAILURE
    if not rows:
        print(f"no plugin sockets in {cfg.plugin_dir}")
        return EX_FAILURE
    print(nodeprobe.render(rows))
    return EX_FAILURE if any(row.error for row in rows) else os.EX_OK


def _doctor(config_path: str | None, *, as_json: bool) -> int:
    import asyncio  # noqa: PLC0415 - not imported before the signal handlers are in place

    from ate_devplugd.commands import doctor, findings  # noqa: PLC0415 - gRPC and the kernel view only for this command
    from ate_devplugd.node.kernel import UdevKernelView  # noqa: PLC0415

    found = asyncio.run(doctor.examine(config_path, doctor.Node(kernel=UdevKernelView())))
    print(findings.render_json(found) if as_json else findings.render(found))
    return findings.exit_status(found)


def _run(cfg: configmod.Config, line: runline.RunLine, early: _EarlySignals) -> int:
    from ate_devplugd.base import malloc  # noqa: PLC0415 - before gRPC and its threads

    malloc.one_arena()
    import asyncio  # noqa: PLC0415 - not imported before the signal handlers are in place

    from ate_devplugd.base.logs import setup_logging  # noqa: PLC0415
    from ate_devplugd.daemon import Daemon  # noqa: PLC0415 - heavy imports only for the daemon
    from ate_devplugd.reload import result as reload_result  # noqa: PLC0415

    setup_logging(line.log_target, cfg.log_level)
    log = logging.getLogger(__name__)

    def reload_config() -> configmod.Config:
        return configmod.load(line.config, overrides=line.overrides())

    log.info("ate-devplugd %s starting: %d device(s), plugin_dir %s", __version__, len(cfg.devices), cfg.plugin_dir)
    for warning in configmod.review(cfg).warnings:  # what check-config warns of, said once (nothing to act on now)
        log.info("config warning: %s", warning)
    if early.stop:
        return os.EX_OK
    # Under the unit (RuntimeDirectory=) the config it runs is kept for `probe`, each reload's outcome for `reload`.
    running = configmod.running_config_path() if os.environ.get("RUNTIME_DIRECTORY") else None
    result = reload_result.path_in(os.path.dirname(running)) if running is not None else None
    daemon = Daemon(cfg, reload_config=reload_config, running_config=running, reload_result=result)

    async def run() -> int:
        task = asyncio.ensure_future(daemon.run())
        await asyncio.sleep(0)  # the daemon's first step installs its signal handlers
        if early.stop:
            daemon.request_stop()
        elif early.reload:
            daemon.request_reload()
        status = await task
        # gRPC ends the calls its stopped servers had in tasks of its own, a loop turn or two later; ended
        # by asyncio.run instead, each would be reported as a crash. They take well under a millisecond.
        leftover = asyncio.all_tasks() - {asyncio.current_task()}
        if leftover:
            await asyncio.wait(leftover, timeout=LEFTOVER_TASKS_TIMEOUT)
        return status

    return asyncio.run(run())
