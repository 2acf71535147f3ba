"""``ate-devplugd reload``: make the running daemon reload its config, and say how that went.

The unit's ``ExecReload=`` runs it with the daemon's pid (``$MAINPID``), so that a reload the daemon
refuses fails ``systemctl reload``, whatever the reason: a config error, a restart-only change, a socket
another process serves. It finds the daemon (by that pid, else as the daemon that serves the config it is
given: ``commands.instance``), watches its record on the instance lock, sends SIGHUP, and waits for the
daemon's verdict on this reload in the record: nothing printed and True when it was applied; the first
error on stderr and False when it was refused or failed, when the daemon ends first, or when no verdict
comes in time. When stderr is the journal (``ExecReload=``), where the daemon wrote each error already,
the line says only that the reload was refused, not the error again. A refusal of a new ``mode`` also
names ``switch-mode``, which applies it (a plain restart loses the pods arriving meanwhile).

A daemon of another version than this program (the package was upgraded under it), or ``--handover``:
the daemon hands its node over to a new process of the program on disk instead (``commands.handover``), and
the command says how that went, in one line either way. With ``--guard``, or ``handover_guard = true`` in
the config file, the handover runs inside switch-mode's cordon (``commands.guard``), each step said.

A process given by ``--pid`` that announces no record (not an ate-devplugd of this version) is signalled all
the same, and the command says what it can tell without one: the config file's own errors, as
``check-config`` finds them; asked to hand over, such a process cannot: exit 69, restart it instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Mapping

from ate_devplugd import __version__
from ate_devplugd import config as configmod
from ate_devplugd.base import announce
from ate_devplugd.base.logs import stderr_is_journal
from ate_devplugd.commands import guard, instance
from ate_devplugd.commands.findings import EXIT_FAILED
from ate_devplugd.commands.handover import hand_over_said, send_signal
from ate_devplugd.commands.switch_files import Host, HostFiles
from ate_devplugd.commands.switch_move import Timing
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.reload import record
from ate_devplugd.reload.result import Outcome, Result

#: A handover's successor imports and loads its config first: seconds on a loaded node.
HANDOVER_TIMEOUT = 90.0
#: A refusal that names a new mode (``config.restart_only_change``'s words).
_NEW_MODE = re.compile(r"\bmode = '(dra|device-plugin)' \(running: ")


class _Ended(Exception):
    """The daemon closed its record before the verdict: it ended."""


def request(
    config_path: str | None,
    pid: int | None,
    timeout: float,
    environ: Mapping[str, str] = os.environ,
    *,
    handover: bool = False,
    guarded: bool | None = None,
) -> int:
    """Reload the daemon ``pid`` (None: ``$MAINPID``'s, else the one serving ``config_path``), or have it hand
    over (``handover``, or a daemon of another version than this program: an upgrade), under the guard
    when ``guarded`` (None: as the config file's ``handover_guard`` says); the exit status: 0 when it
    applied the config or handed over (or, announcing no record, when the file has no error), 1 when not,
    69 (EX_UNAVAILABLE) when a handover was asked of a process that cannot make one; a guarded handover's
    as switch-mode's (130/143: interrupted, the cordon kept)."""
    pid = pid if pid is not None else _main_pid(environ)
    if pid is not None:
        running = next((r for r in asyncio.run(instance.every()) if r.pid == pid), None)
        if running is None and handover:
            print(f"ate-devplugd: process {pid} announces no record: it cannot hand over (restart it)", file=sys.stderr)
            return os.EX_UNAVAILABLE
        if running is None:
            return _status(_without_record(config_path, pid))
    else:
        found = asyncio.run(instance.find(config_path))
        if found.running is None:
            return _status(_fail(f"no running daemon to reload: {found.nobody()}; give --pid, or use systemctl reload"))
        running = found.running
    if handover or running.record.version != __version__:
        return _handover(running, config_path or running.record.source or None, timeout, guarded)
    return _status(_verdict(running, timeout))


def _handover(running: instance.Running, path: str | None, timeout: float, guarded: bool | None) -> int:
    """``running`` handed over, guarded or not: the exit status."""
    guard_config, why = _guard_config(path, guarded)
    if why:
        return _status(_fail(why))
    if guard_config is not None:
        return _guarded(guard_config, path, timeout)
    return _status(_handed_over(running, timeout))


def _guard_config(path: str | None, guarded: bool | None) -> tuple[Config | None, str]:
    """The config the guard runs with (None: no guard), or why a guard asked for cannot run."""
    try:
        cfg = configmod.load(path)
    except ConfigError as exc:  # unguarded, the new process refuses the file itself and the daemon serves on
        return None, f"cannot guard the handover: config error: {exc.errors[0]}" if guarded else ""
    if not (cfg.handover_guard if guarded is None else guarded):
        return None, ""
    if cfg.dra is None:
        return None, (
            "cannot guard the handover: it needs the [dra] table (node_name, kubeconfig) for the credentials "
            "it cordons the Node with, as switch-mode does"
        )
    return cfg, ""


def _guarded(cfg: Config, path: str | None, timeout: float) -> int:
    def say(line: str) -> None:
        print(f"ate-devplugd: {line}", file=sys.stderr, flush=True)

    host = Host(HostFiles(path or configmod.DEFAULT_CONFIG_PATH), say=say)
    return asyncio.run(guard.guarded(cfg, host, Timing(), max(timeout, HANDOVER_TIMEOUT)))  # switch-mode's waits


def _status(ok: bool) -> int:
    return os.EX_OK if ok else EXIT_FAILED


def _handed_over(running: instance.Running, timeout: float) -> bool:
    """Have ``running`` hand over, and tell how it went (a line either way)."""
    said = asyncio.run(hand_over_said(running, max(timeout, HANDOVER_TIMEOUT)))
    if not said.done:
        return _fail(said.line)
    print(f"ate-devplugd: {said.line}", file=sys.stderr)
    return True


def _verdict(running: instance.Running, timeout: float) -> bool:
    """Reload ``running`` and tell its verdict."""
    try:
        result = asyncio.run(_reload(running.name, timeout))
    except ProcessLookupError:
        return _fail(f"no daemon to reload: no process {running.pid} is running")
    except PermissionError:
        return _fail(f"cannot signal process {running.pid}: permission denied (run as root)")
    except (_Ended, OSError):
        return _fail(f"the daemon (pid {running.pid}) ended before it said how the reload went")
    if result is None:
        return _fail(f"the daemon (pid {running.pid}) did not say how the reload went within {timeout:g} s")
    if result.outcome is not Outcome.APPLIED:
        if stderr_is_journal():  # ExecReload=: the daemon's own lines, each error once, are there already
            _fail(f"reload {result.generation} {result.outcome.value}: the daemon's errors above say why")
        else:
            _fail(result.error or f"the reload was {result.outcome.value}")
        moved = _NEW_MODE.search(result.error)
        if moved is not None:  # the remedy for a mode difference is switch-mode's, never a restart
            _fail(
                f"a new mode is applied by `ate-devplugd switch-mode {moved[1]}` (it cordons the node for the "
                "restart, so no arriving pod is lost), not by a reload or a plain restart"
            )
        return False
    return True


async def _reload(name: bytes, timeout: float) -> Result | None:
    """Watch the record on lock ``name``, signal its daemon, and return its verdict on that reload (None:
    none within ``timeout``)."""
    try:
        async with asyncio.timeout(timeout), contextlib.aclosing(announce.follow(name, timeout)) as records:
            after: int | None = None
            async for peer, line in records:
                now = record.decode(line)
                if now is None:
                    continue
                if after is None:  # the record as of our watch: the reload the signal starts comes after it
                    after = now.reload.generation
                    send_signal(peer.pid, signal.SIGHUP)
                elif now.reload.ended_after(after):
                    return now.reload
    except TimeoutError:
        return None
    raise _Ended


def _main_pid(environ: Mapping[str, str]) -> int | None:
    """``$MAINPID``: systemd sets it for ``ExecReload=``."""
    value = environ.get("MAINPID", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _without_record(config_path: str | None, pid: int) -> bool:
    """The process announces no record: what the file says is all there is to tell."""
    try:
        send_signal(pid, signal.SIGHUP)
    except ProcessLookupError:
        return _fail(f"no daemon to reload: no process {pid} is running")
    except PermissionError:
        return _fail(f"cannot signal process {pid}: permission denied (run as root)")
    try:
        configmod.load(config_path)
        errors: list[str] = []
    except ConfigError as exc:
        errors = exc.errors
    if errors:
        return _fail(f"config error: {errors[0]}")
    print(
        f"ate-devplugd: signalled process {pid} to reload; it announces no record of an ate-devplugd, so only "
        "its log says whether it applied the config, which has no error",
        file=sys.stderr,
    )
    return True


def _fail(line: str) -> bool:
    print(f"ate-devplugd: {line}", file=sys.stderr)
    return False


def main(args: argparse.Namespace) -> int:
    """``reload`` (before the config is read: the daemon reads it, and says what it found)."""
    return request(args.config, args.pid, args.timeout, handover=args.handover, guarded=args.guard)
