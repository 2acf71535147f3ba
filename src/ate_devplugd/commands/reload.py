"""``ate-devplugd reload``: make the running daemon reload its config, and say how that went.

The unit's ``ExecReload=`` runs it with the daemon's pid (``$MAINPID``), so that a reload the daemon
refuses fails ``systemctl reload``, whatever the reason: a config error, a restart-only change, a socket
another process serves. It reads the daemon's reload record in its runtime directory
(``reload.result``), sends SIGHUP, and waits (on inotify events, with a timeout) for the daemon's verdict
on this reload: nothing printed and True when it was applied; the first error on stderr and False when it
was refused or failed, or when no verdict comes. When stderr is the journal (``ExecReload=``), where the
daemon wrote each error already, the line says only that the reload was refused, not the error again.

A daemon that keeps no record (run by hand: no runtime directory) is signalled all the same, and the
command says what it can tell without it: the config file's own errors, as ``check-config`` finds them.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import signal
import sys
from collections.abc import Mapping

from ate_devplugd import config as configmod
from ate_devplugd.base.logs import stderr_is_journal
from ate_devplugd.config import ConfigError
from ate_devplugd.reload import result as reload_result
from ate_devplugd.reload.result import Outcome


def request(config_path: str | None, pid: int | None, timeout: float, environ: Mapping[str, str] = os.environ) -> bool:
    """Reload the daemon ``pid`` (None: the one ``$MAINPID`` or its record names); True when it applied
    the config (or, keeping no record, when the file has no error)."""
    path = reload_result.path_in(posixpath.dirname(configmod.running_config_path(environ)))
    pid = pid if pid is not None else _daemon_pid(environ, path)
    if pid is None:
        return _fail(
            "no running daemon to reload: $MAINPID is not set and there is no record of one in "
            f"{posixpath.dirname(path)}; give --pid, or use systemctl reload ate-devplugd"
        )
    record = reload_result.read(path)
    # The reload this signal starts is numbered above the record's (one running now is the record).
    after = record.generation if record is not None and record.pid == pid else None
    try:
        pidfd = _pidfd(pid)
    except ProcessLookupError:
        return _fail(f"no daemon to reload: no process {pid} is running")
    try:
        problem = _signal(pid, pidfd)
        if problem is not None:
            return _fail(problem)
        if after is None:
            return _without_record(config_path, pid, path)
        return _verdict(path, pid, after, timeout, pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    """A pidfd for the process (its end is then an event, and its pid cannot be taken by another one
    while the command holds it); None where pidfds are not to be had. ``ProcessLookupError``: no such
    process."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError:
        return None


def _signal(pid: int, pidfd: int | None) -> str | None:
    """SIGHUP to the process; why it could not be sent, or None."""
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGHUP)
        except PermissionError:
            pass  # a system-call filter may refuse this call itself; kill(2) below says if the signal may go
        except ProcessLookupError:
            return f"no daemon to reload: no process {pid} is running"
        else:
            return None
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return f"no daemon to reload: no process {pid} is running"
    except PermissionError:
        return f"cannot signal process {pid}: permission denied (run as root)"
    return None


def _verdict(path: str, pid: int, after: int, timeout: float, pidfd: int | None) -> bool:
    """Wait for the daemon's record of this reload and tell it."""
    try:
        result = asyncio.run(reload_result.wait(path, pid, after, timeout, pidfd))
    except ProcessLookupError:
        return _fail(f"the daemon (pid {pid}) ended before it said how the reload went")
    if result is None:
        return _fail(f"the daemon (pid {pid}) did not say how the reload went within {timeout:g} s")
    if result.outcome is not Outcome.APPLIED:
        if stderr_is_journal():  # ExecReload=: the daemon's own lines, each error once, are there already
            return _fail(f"reload {result.generation} {result.outcome.value}: the daemon's errors above say why")
        return _fail(result.error or f"the reload was {result.outcome.value}")
    return True


def _daemon_pid(environ: Mapping[str, str], path: str) -> int | None:
    """``$MAINPID`` (systemd sets it for ``ExecReload=``), else the pid of a running daemon's record."""
    value = environ.get("MAINPID", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    record = reload_result.read(path)
    return record.pid if record is not None and _running(record.pid) else None


def _without_record(config_path: str | None, pid: int, path: str) -> bool:
    """The daemon keeps no record: what the file says is all there is to tell."""
    try:
        configmod.load(config_path)
        errors: list[str] = []
    except ConfigError as exc:
        errors = exc.errors
    if errors:
        return _fail(f"config error: {errors[0]}")
    print(
        f"ate-devplugd: signalled the daemon (pid {pid}) to reload; it keeps no record at {path} (not run by "
        "systemd), so only its log and STATUS say whether it applied the config, which has no error",
        file=sys.stderr,
    )
    return True


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fail(line: str) -> bool:
    print(f"ate-devplugd: {line}", file=sys.stderr)
    return False
