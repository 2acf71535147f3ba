"""The command line's grammar: the commands, their options and `--help`, and the command found wherever
it is written (``--config X check-config``); ``cli`` runs what it names."""

from __future__ import annotations

import argparse
import math

from ate_devplugd import __version__
from ate_devplugd.commands import runline
from ate_devplugd.config import DEFAULT_CONFIG_PATH, DEFAULT_PLUGIN_DIR

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
    "reload": "make the running daemon reload its config (or hand over to the program on disk) and wait for "
    "its verdict; exit 1 when refused",
    "switch-mode": "move this node to dra or device-plugin mode, pods running and arriving: none lost",
}
#: `switch-mode --timeout` when not given: how long each wait of the move may take, in seconds.
SWITCH_TIMEOUT = 300.0
#: `switch-mode --settle`: how long every pod bound here must stay admitted before the restart.
SWITCH_SETTLE = 2.0
#: `probe --timeout` when not given, in seconds.
PROBE_TIMEOUT = 5.0
#: `reload --timeout` when not given, in seconds: how long the daemon's verdict is waited for.
RELOAD_TIMEOUT = 30.0

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
  systemctl reload ate-devplugd      (runs: ate-devplugd reload --pid $MAINPID)
  ate-devplugd switch-mode dra       (and back: ate-devplugd switch-mode device-plugin)

exit status: 0 ok; 78 bad config (EX_CONFIG); 73 another instance serves the same sockets;
             77 not root: cannot create or write a directory it needs (EX_NOPERM);
             71 another system error at start (EX_OSERR), named;
             1 probe found a socket that does not answer, doctor found a FAIL, the daemon
               refused or failed a reload (or there is none to ask), or switch-mode did not finish
               (it says where the node stands); 130/143 switch-mode interrupted by SIGINT/SIGTERM
               (the cordon stays); 2 bad usage.
default config: {DEFAULT_CONFIG_PATH} (built-in defaults when it does not exist)
"""
)


def seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, e.g. {PROBE_TIMEOUT:g}, not {text}")
    return value


def parser_for(args: list[str]) -> argparse.ArgumentParser:
    """The parser for ``args``: where they start with a command (as the unit's ``ate-devplugd run`` does),
    one that knows that command alone, which is all that is needed (1.5 ms less at every start); else
    the whole one, to find the command wherever it is (``command_first``)."""
    return build_parser(args[0] if args and args[0] in COMMANDS else None)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command, or ``only`` that one."""
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

    def wanted(name: str) -> bool:
        return only is None or only == name

    if wanted("run"):
        run = command("run")
        run.add_argument(
            "--plugin-dir", metavar="DIR", help=f"kubelet's device-plugin directory ({DEFAULT_PLUGIN_DIR})"
        )
        run.add_argument("--dev-root", metavar="DIR", help="look device paths up under DIR (default /)")
        run.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
        run.add_argument(
            "--log-target",
            choices=runline.LOG_TARGETS,
            default="auto",
            help="auto: journald when started by systemd, else stderr",
        )

    if wanted("check-config"):
        command("check-config")

    if wanted("probe"):
        probe = command("probe")
        probe.add_argument("--plugin-dir", metavar="DIR", help="directory to probe (default: from the config)")
        probe.add_argument(
            "--timeout",
            type=seconds,
            default=PROBE_TIMEOUT,
            metavar="SECONDS",
            help=f"per-call timeout in seconds (default {PROBE_TIMEOUT:g})",
        )

    if wanted("doctor"):
        doctor = command("doctor")
        doctor.add_argument("--json", action="store_true", help="print the checks as JSON")

    if wanted("reload"):
        reload = command("reload")
        reload.add_argument(
            "--pid",
            type=int,
            metavar="PID",
            help="the daemon's process (default: $MAINPID, as systemd gives it to ExecReload=, else the one "
            "that serves the --config file)",
        )
        reload.add_argument(
            "--timeout",
            type=seconds,
            default=RELOAD_TIMEOUT,
            metavar="SECONDS",
            help=f"how long to wait for the daemon's verdict (default {RELOAD_TIMEOUT:g})",
        )
        reload.add_argument(
            "--handover",
            action="store_true",
            help="hand the node over to a new process of the program on disk, as an upgrade does (the default "
            "when the program on disk is another version than the daemon's), instead of re-reading the config",
        )
        reload.add_argument(
            "--guard",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="run a handover inside switch-mode's cordon, so that no arriving pod is lost; the node takes no "
            "new pods for its seconds, and it needs the [dra] table's credentials (default: the config's "
            "handover_guard)",
        )

    if wanted("switch-mode"):
        switch = command("switch-mode")
        switch.add_argument("mode", choices=("dra", "device-plugin"), help="the mode to move this node to")
        switch.add_argument(
            "--timeout",
            type=seconds,
            default=SWITCH_TIMEOUT,
            metavar="SECONDS",
            help=f"how long each wait may take before the command gives up, saying where the node stands "
            f"(default {SWITCH_TIMEOUT:g})",
        )
        switch.add_argument(
            "--settle",
            type=seconds,
            default=SWITCH_SETTLE,
            metavar="SECONDS",
            help=f"how long every pod bound here must stay admitted after the cordon (default {SWITCH_SETTLE:g})",
        )
        switch.add_argument(
            "--kubeconfig",
            metavar="PATH",
            help="the credentials to cordon the Node, list its pods and delete its slices with (default: the "
            "[dra] table's kubeconfig; the service account of dra-manifests may not patch Nodes or list pods)",
        )
        switch.add_argument("--systemctl", default="systemctl", metavar="CMD", help="the systemctl to run")
        switch.add_argument(
            "--dropin-dir",
            default="/etc/systemd/system/ate-devplugd.service.d",
            metavar="DIR",
            help="the unit's drop-in directory (default %(default)s)",
        )
        switch.add_argument(
            "--dropin-source",
            default="/usr/share/ate-devplugd/dra-mode.conf",
            metavar="PATH",
            help="the drop-in DRA mode needs, linked there (default %(default)s)",
        )

    if wanted("dra-manifests"):
        manifests = command("dra-manifests")
        which = manifests.add_mutually_exclusive_group()
        which.add_argument(
            "--kubelet-credentials",
            action="store_true",
            help="the daemon uses kubelet's own kubeconfig: print the DeviceClasses and a read-only role that lets "
            "nodes read them (for switch-mode and doctor), no other RBAC or policy",
        )
        which.add_argument(
            "--stage",
            choices=("policy", "grant"),
            help="print one stage: 'policy' (DeviceClasses, service account, admission policy), then, once the "
            "policy is in force, 'grant' (the RBAC it confines)",
        )
        manifests.add_argument(
            "--refuse-multi",
            action="store_true",
            help="also an admission policy that refuses pods asking for more than 1 of a resource per container "
            "(only where every node serving it has the shared layout)",
        )
    return parser


def command_first(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
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
