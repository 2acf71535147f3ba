"""Command line: ``ate-devplugd [run] | check-config | probe | doctor | dra-manifests``."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys

from ate_devplugd import __version__
from ate_devplugd import config as configmod
from ate_devplugd.config import DEFAULT_CONFIG_PATH, DEFAULT_PLUGIN_DIR, ConfigError

#: `probe` found a socket that does not answer (os.EX_* has no name for it).
EX_FAILURE = 1
#: How long, at exit, the loop is kept for tasks gRPC still has on it.
LEFTOVER_TASKS_TIMEOUT = 0.5

DESCRIPTION = """\
Advertise host device nodes (by default /dev/kvm) to kubelet as extended resources, so a pod that
requests e.g. `ate.dev/kvm: 1` gets that one device node and the matching cgroup allow rule, without
running privileged. Runs as a systemd service (Type=notify); see ate-devplugd(8) and
ate-devplugd.toml(5).
"""

#: Each command and its one line, in `--help` and atop the command's own help.
COMMANDS = {
    "run": "the daemon, in the foreground (the default when no command is given)",
    "check-config": "validate the config and print the effective config; exit 78 on errors",
    "probe": "query every plugin socket as kubelet would: what the node offers (DRA: and its slices)",
    "doctor": "check the node end to end: OK/WARN/FAIL per check with the remedy; exit 1 on a FAIL",
    "dra-manifests": "print the DeviceClasses (and RBAC) an administrator applies once for DRA mode",
}
#: `probe --timeout` when not given, in seconds.
PROBE_TIMEOUT = 5.0

USAGE = "ate-devplugd [-h] [--version] [COMMAND] [OPTIONS]"

EPILOG = (
    "commands (`ate-devplugd COMMAND --help` gives each one's options):\n"
    + "".join(f"  {name:<15}{line}\n" for name, line in COMMANDS.items())
    + f"""
examples:
  ate-devplugd check-config --config /etc/ate-devplugd/config.toml
  ate-devplugd run --log-target console --log-level debug
  ate-devplugd probe
  ate-devplugd doctor --json
  ate-devplugd dra-manifests --config /etc/ate-devplugd/config.toml | kubectl apply -f -

exit status: 0 ok; 78 bad config (EX_CONFIG); 73 another instance serves the same sockets;
             77 not root: cannot create or write the plugin directory (EX_NOPERM);
             1 probe found a socket that does not answer, or doctor found a FAIL; 2 bad usage.
default config: {DEFAULT_CONFIG_PATH} (built-in defaults when it does not exist)
"""
)


def _seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, e.g. {PROBE_TIMEOUT:g}, not {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ate-devplugd",
        usage=USAGE,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ate-devplugd {__version__}")
    # listed once, in the epilog: argparse's own list of subcommands cannot keep them to one line each
    sub = parser.add_subparsers(dest="command", prog="ate-devplugd", help=argparse.SUPPRESS)

    def command(name: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, description=COMMANDS[name])
        p.add_argument(
            "--config",
            metavar="PATH",
            help=f"config file (default {DEFAULT_CONFIG_PATH}, if it exists)",
        )
        return p

    run = command("run")
    run.add_argument("--plugin-dir", metavar="DIR", help=f"kubelet's device-plugin directory ({DEFAULT_PLUGIN_DIR})")
    run.add_argument("--dev-root", metavar="DIR", help="look device paths up under DIR (default /)")
    run.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    run.add_argument(
        "--log-target",
        choices=("auto", "journal", "console"),
        default="auto",
        help="auto: journald when started by systemd, else stderr",
    )

    command("check-config")

    probe = command("probe")
    probe.add_argument("--plugin-dir", metavar="DIR", help="directory to probe (default: from the config)")
    probe.add_argument(
        "--timeout",
        type=_seconds,
        default=PROBE_TIMEOUT,
        metavar="SECONDS",
        help=f"per-call timeout in seconds (default {PROBE_TIMEOUT:g})",
    )

    doctor = command("doctor")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")

    manifests = command("dra-manifests")
    which = manifests.add_mutually_exclusive_group()
    which.add_argument(
        "--kubelet-credentials",
        action="store_true",
        help="the daemon uses kubelet's own kubeconfig: print the DeviceClasses only, no RBAC or policy",
    )
    which.add_argument(
        "--stage",
        choices=("policy", "grant"),
        help="print one stage: 'policy' (DeviceClasses, service account, admission policy), then, once the "
        "policy is in force, 'grant' (the RBAC it confines)",
    )
    return parser


def _command_first(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with the command first, wherever it was given (``--config X check-config``), or ``run``
    before them when none is; an argument where a command belongs that is none is a usage error.

    The command is the first argument that is neither an option nor an option's value, so the options
    that take a value are looked up in the commands' parsers (an unambiguous abbreviation counts).
    """
    if "--version" in args:
        return args
    takes_value: set[str] = set()
    is_flag: set[str] = set()
    # argparse lists a parser's options only in its private _actions
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                for option in command._actions:
                    (is_flag if option.nargs == 0 else takes_value).update(option.option_strings)
    is_flag.update(("-h", "--help"))
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            index += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        if "=" not in arg and arg not in is_flag:
            values = {o for o in takes_value if o.startswith(arg)} if arg.startswith("--") else {arg} & takes_value
            flags = {o for o in is_flag if o.startswith(arg)} if arg.startswith("--") else set()
            if values and not flags:
                index += 1  # its value
        index += 1
    if index >= len(args):
        return args if any(a in ("-h", "--help") for a in args) else ["run", *args]
    name = args[index]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; the commands are {', '.join(COMMANDS)} (see --help)")
    return [name, *args[:index], *args[index + 1 :]]


def _config_error(exc: ConfigError) -> int:
    for line in exc.errors:
        print(f"ate-devplugd: config error: {line}", file=sys.stderr)
    return os.EX_CONFIG


def main(argv: list[str] | None = None) -> int:
    early = _EarlySignals()
    parser = _parser()
    args = parser.parse_args(_command_first(parser, list(sys.argv[1:] if argv is None else argv)))
    if args.command != "run":
        early.restore()

    if args.command == "doctor":
        return _doctor(args.config, as_json=args.json)
    try:
        cfg = configmod.load(args.config)
        if args.command == "run":
            cfg = cfg.with_overrides(**_run_overrides(args))
        elif args.command == "probe" and args.plugin_dir:
            cfg = cfg.with_overrides(plugin_dir=args.plugin_dir)
    except ConfigError as exc:
        running = _running_config(exc, args.config, args.plugin_dir) if args.command == "probe" else None
        if running is None:
            return _config_error(exc)
        cfg = running

    if args.command == "check-config":
        return _check_config(cfg)
    if args.command == "probe":
        return _probe(cfg, args.timeout)
    if args.command == "dra-manifests":
        return _dra_manifests(cfg, with_access=not args.kubelet_credentials, stage=args.stage)
    return _run(cfg, args, early)


def _check_config(cfg: configmod.Config) -> int:
    """The effective config on stdout; on stderr what else the config means on this host."""
    review = configmod.review(cfg)
    for line in review.notes:
        print(f"ate-devplugd: note: {line}", file=sys.stderr)
    for line in review.warnings:
        print(f"ate-devplugd: config warning: {line}", file=sys.stderr)
    if review.errors:
        return _config_error(ConfigError(list(review.errors)))
    sys.stdout.write(configmod.render(cfg))
    return os.EX_OK


def _run_overrides(args: argparse.Namespace) -> dict[str, str | None]:
    """What `run`'s options set over the file (None: not given)."""
    return {"plugin_dir": args.plugin_dir, "dev_root": args.dev_root, "log_level": args.log_level}


def _running_config(broken: ConfigError, config: str | None, plugin_dir: str | None) -> configmod.Config | None:
    """For `probe` when the config file does not parse: the config the running daemon wrote, if any,
    saying so on stderr (None: there is none either)."""
    path = configmod.running_config_path()
    try:
        cfg = configmod.load(path)
        if plugin_dir:
            cfg = cfg.with_overrides(plugin_dir=plugin_dir)
    except ConfigError:
        return None
    print(
        f"ate-devplugd: probing with the running daemon's config from {path}; "
        f"{config or DEFAULT_CONFIG_PATH} does not parse: {broken.errors[0]}",
        file=sys.stderr,
    )
    return cfg


def _dra_manifests(cfg: configmod.Config, *, with_access: bool, stage: str | None = None) -> int:
    from ate_devplugd.dra import config as dra_config  # noqa: PLC0415 - PyYAML only for this command
    from ate_devplugd.dra import manifests  # noqa: PLC0415

    dra = cfg.dra or dra_config.from_mapping(None)[0]
    text = manifests.render(dra, [dev.resource for dev in cfg.devices], with_access=with_access, stage=stage)
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
        from ate_devplugd.dra import probe  # noqa: PLC0415 - aiohttp and PyYAML only in DRA mode

        report = asyncio.run(probe.probe(cfg.dra, timeout))
        print(probe.render(report))
        return os.EX_OK if report.ok else EX_FAILURE

    from ate_devplugd import nodeprobe  # noqa: PLC0415 - keeps `check-config` free of grpc

    ours = {dev.socket_name: dev.resource for dev in cfg.devices}
    try:
        rows = asyncio.run(nodeprobe.probe_all(cfg.plugin_dir, ours, timeout))
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

    from ate_devplugd import doctor  # noqa: PLC0415 - gRPC and the kernel view only for this command
    from ate_devplugd.kernel import UdevKernelView  # noqa: PLC0415

    findings = asyncio.run(doctor.examine(config_path, doctor.Node(kernel=UdevKernelView())))
    print(doctor.render_json(findings) if as_json else doctor.render(findings))
    return EX_FAILURE if doctor.failed(findings) else os.EX_OK


def _run(cfg: configmod.Config, args: argparse.Namespace, early: _EarlySignals) -> int:
    from ate_devplugd import malloc  # noqa: PLC0415 - before gRPC and its threads

    malloc.one_arena()
    import asyncio  # noqa: PLC0415 - not imported before the signal handlers are in place

    from ate_devplugd import reload_result  # noqa: PLC0415
    from ate_devplugd.daemon import Daemon  # noqa: PLC0415 - heavy imports only for the daemon
    from ate_devplugd.logs import setup_logging  # noqa: PLC0415

    setup_logging(args.log_target, cfg.log_level)
    log = logging.getLogger("ate_devplugd")

    def reload_config() -> configmod.Config:
        return configmod.load(args.config).with_overrides(**_run_overrides(args))

    log.info("ate-devplugd %s starting: %d device(s), plugin_dir %s", __version__, len(cfg.devices), cfg.plugin_dir)
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
