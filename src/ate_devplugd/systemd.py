"""systemd integration: sd_notify state, the watchdog interval, and logging to journald or stderr.

Outside systemd every call here is a harmless no-op (``NOTIFY_SOCKET`` unset), so the daemon runs the
same in a terminal, a test or a unit.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

SYSLOG_IDENTIFIER = "ate-devplugd"

#: Structured fields on every event record; operators filter the journal by them.
FIELD_RESOURCE = "ATE_RESOURCE"
FIELD_DEVICE = "ATE_DEVICE"
FIELD_EVENT = "ATE_EVENT"
_FIELDS = (FIELD_EVENT, FIELD_RESOURCE, FIELD_DEVICE)


def _default_sender(state: str) -> bool:
    from systemd import daemon  # noqa: PLC0415 - loaded only when a message is sent

    return bool(daemon.notify(state))


class Notifier:
    """Sends sd_notify messages; the sender is injectable for tests."""

    def __init__(self, sender: Callable[[str], bool] | None = None) -> None:
        self._sender = sender
        self.enabled = sender is not None or bool(os.environ.get("NOTIFY_SOCKET"))
        self._status = ""

    def send(self, *lines: str) -> None:
        if not self.enabled:
            return
        sender = self._sender or _default_sender
        try:
            sender("\n".join(lines))
        except OSError as exc:
            logging.getLogger(__name__).warning("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self._status = status
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        """Send STATUS= only when it changed."""
        if status != self._status:
            self._status = status
            self.send(f"STATUS={status}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


def watchdog_interval(environ: dict[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or None if not asked for this process."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 2 / 1_000_000


def under_systemd(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"))


class JournalHandler(logging.Handler):
    """Writes records to journald with a PRIORITY and the ATE_* fields given in ``extra=``."""

    _PRIORITY = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))

    def __init__(self, send: Callable[..., Any] | None = None) -> None:
        super().__init__()
        if send is None:
            from systemd import journal  # noqa: PLC0415 - only when logging to the journal

            send = journal.send
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {key: str(getattr(record, key)) for key in _FIELDS if getattr(record, key, None)}
            priority = next((p for level, p in self._PRIORITY if record.levelno >= level), 7)
            if record.exc_info:
                fields["EXCEPTION_TEXT"] = logging.Formatter().formatException(record.exc_info)
            self._send(
                record.getMessage(),
                PRIORITY=str(priority),
                SYSLOG_IDENTIFIER=SYSLOG_IDENTIFIER,
                LOGGER=record.name,
                CODE_FILE=record.pathname,
                CODE_LINE=record.lineno,
                CODE_FUNC=record.funcName,
                **fields,
            )
        except Exception:  # noqa: BLE001 - the logging contract: a failed record must not crash the caller
            self.handleError(record)


class ConsoleFormatter(logging.Formatter):
    """``LEVEL message [event=… resource=…]`` on stderr; journald adds its own timestamps."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        tags = [f"{key[4:].lower()}={getattr(record, key)}" for key in _FIELDS if getattr(record, key, None)]
        if tags:
            text += "  [" + " ".join(tags) + "]"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(target: str, level: str) -> str:
    """Route the root logger to journald or stderr; returns the target chosen."""
    if target == "auto":
        target = "journal" if under_systemd() else "console"
    handler: logging.Handler
    if target == "journal":
        handler = JournalHandler()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(ConsoleFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # grpc's own logger is chatty at debug; keep it to warnings.
    logging.getLogger("grpc").setLevel(logging.WARNING)
    return target


def event(
    logger: logging.Logger,
    level: int,
    name: str,
    msg: str,
    *args: object,
    resource: str | None = None,
    device: str | None = None,
    exc_info: bool = False,
) -> None:
    """Log one event with its structured fields (ATE_EVENT, ATE_RESOURCE, ATE_DEVICE)."""
    extra = {FIELD_EVENT: name}
    if resource:
        extra[FIELD_RESOURCE] = resource
    if device:
        extra[FIELD_DEVICE] = device
    logger.log(level, msg, *args, extra=extra, exc_info=exc_info)
