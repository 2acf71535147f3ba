"""Command line: ``ate-devplugd [run] | check-config | probe | doctor | dra-manifests``."""

from __future__ import annotations

import argparse
import logging
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

EPILOG = f"""\
commands:
  run            the daemon (the default when no command is given)
  check-config   validate the config, print the effective config; exit 78 on errors
  probe          query every plugin socket as kubelet would and print what the node offers
                 (DRA mode: GetInfo, the plugin socket, and the node's ResourceSlices)
  doctor         check the node end to end: OK/WARN/FAIL per check with the remedy; exit 1 on a FAIL
  dra-manifests  print the DeviceClasses (and RBAC) an administrator applies once for DRA mode

examples:
  ate-devplugd check-config --config /etc/ate-devplugd/config.toml
  ate-devplugd run --log-target console --log-level debug
  ate-devplugd probe
  ate-devplugd doctor --json
  ate-devplugd dra-manifests --config /etc/ate-devplugd/config.toml | kubectl apply -f -

exit status: 0 ok; 78 bad config (EX_CONFIG); 73 another instance serves the same sockets;
             1 probe found a socket that does not answer, or doctor found a FAIL.
default config: {DEFAULT_CONFIG_PATH} (built-in defaults when it does not exist)
"""

COMMANDS = ("run", "check-config", "probe", "doctor", "dra-manifests")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ate-devplugd",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ate-devplugd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            metavar="PATH",
            help=f"config file (default {DEFAULT_CONFIG_PATH}, if it exists)",
        )

    run = sub.add_parser("run", help="run the daemon (default)")
    add_config(run)
    run.add_argument("--plugin-dir", metavar="DIR", help=f"kubelet's device-plugin directory ({DEFAULT_PLUGIN_DIR})")
    run.add_argument("--dev-root", metavar="DIR", help="look device paths up under DIR (default /)")
    run.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    run.add_argument(
        "--log-target",
        choices=("auto", "journal", "console"),
        default="auto",
        help="auto: journald when started by systemd, else stderr",
    )

    check = sub.add_parser("check-config", help="validate the config and print the effective config")
    add_config(check)

    probe = sub.add_parser(
        "probe", help="query every plugin socket as kubelet would (DRA mode: the driver's sockets and slices)"
    )
    add_config(probe)
    probe.add_argument("--plugin-dir", metavar="DIR", help="directory to probe (default: from the config)")
    probe.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="per-call timeout")

    doctor = sub.add_parser("doctor", help="will a sandbox pod get a working device here? one line per check")
    add_config(doctor)
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")

    manifests = sub.add_parser("dra-manifests", help="print the cluster objects DRA mode needs, as YAML")
    add_config(manifests)
    manifests.add_argument(
        "--kubelet-credentials",
        action="store_true",
        help="the daemon uses kubelet's own kubeconfig: print the DeviceClasses only, no RBAC or policy",
    )
    return parser


def _config_error(exc: ConfigError) -> int:
    for line in exc.errors:
        print(f"ate-devplugd: config error: {line}", file=sys.stderr)
    return os.EX_CONFIG


def main(argv: list[str] | None = None) -> int:
    early = _EarlySignals()
    args_in = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args_in if not a.startswith("-")), None)
    wants_top = any(a in ("-h", "--help", "--version") for a in args_in) and first is None
    if first not in COMMANDS and not wants_top:
        args_in.insert(0, "run")
    args = _parser().parse_args(args_in)
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
        return _config_error(exc)

    if args.command == "check-config":
        sys.stdout.write(configmod.render(cfg))
        return os.EX_OK
    if args.command == "probe":
        return _probe(cfg, args.timeout)
    if args.command == "dra-manifests":
        return _dra_manifests(cfg, with_access=not args.kubelet_credentials)
    return _run(cfg, args, early)


def _run_overrides(args: argparse.Namespace) -> dict[str, str | None]:
    """What `run`'s options set over the file (None: not given)."""
    return {"plugin_dir": args.plugin_dir, "dev_root": args.dev_root, "log_level": args.log_level}


def _dra_manifests(cfg: configmod.Config, *, with_access: bool) -> int:
    from ate_devplugd.dra import config as dra_config  # noqa: PLC0415 - PyYAML only for this command
    from ate_devplugd.dra import manifests  # noqa: PLC0415

    dra = cfg.dra or dra_config.from_mapping(None)[0]
    text = manifests.render(dra, [dev.resource for dev in cfg.devices], with_access=with_access)
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

    from ate_devplugd.daemon import Daemon  # noqa: PLC0415 - heavy imports only for the daemon
    from ate_devplugd.logs import setup_logging  # noqa: PLC0415

    setup_logging(args.log_target, cfg.log_level)
    log = logging.getLogger("ate_devplugd")

    def reload_config() -> configmod.Config:
        return configmod.load(args.config).with_overrides(**_run_overrides(args))

    log.info("ate-devplugd %s starting: %d device(s), plugin_dir %s", __version__, len(cfg.devices), cfg.plugin_dir)
    if early.stop:
        return os.EX_OK
    daemon = Daemon(cfg, reload_config=reload_config)

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
