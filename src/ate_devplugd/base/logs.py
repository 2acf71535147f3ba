"""Logging: to journald with structured fields under systemd, else to stderr; events with their fields.

An *event* is a log record with an ``ATE_EVENT`` name (operators filter the journal by it) and, where it
concerns one resource, ``ATE_RESOURCE`` and ``ATE_DEVICE``. An ``EventLog`` binds those fields once.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

SYSLOG_IDENTIFIER = "ate-devplugd"

#: Structured fields on every event record; operators filter the journal by them.
FIELD_RESOURCE = "ATE_RESOURCE"
FIELD_DEVICE = "ATE_DEVICE"
FIELD_EVENT = "ATE_EVENT"
_FIELDS = (FIELD_EVENT, FIELD_RESOURCE, FIELD_DEVICE)


def under_systemd(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"))


def stderr_is_journal(environ: dict[str, str] | None = None) -> bool:
    """Whether stderr is the journal's stream systemd gave (``$JOURNAL_STREAM``: its device and inode)."""
    env = os.environ if environ is None else environ
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return env.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}"


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


class EventLog:
    """Logs events with the fields bound once: ``EventLog(log, resource=..., device=...).info("registered", ...)``."""

    def __init__(self, logger: logging.Logger, *, resource: str | None = None, device: str | None = None) -> None:
        self._logger = logger
        self._fields: dict[str, str] = {}
        if resource:
            self._fields[FIELD_RESOURCE] = resource
        if device:
            self._fields[FIELD_DEVICE] = device

    def log(self, level: int, name: str, msg: str, *args: object, exc_info: bool = False) -> None:
        self._logger.log(level, msg, *args, extra={FIELD_EVENT: name, **self._fields}, exc_info=exc_info)

    def debug(self, name: str, msg: str, *args: object) -> None:
        self.log(logging.DEBUG, name, msg, *args)

    def info(self, name: str, msg: str, *args: object) -> None:
        self.log(logging.INFO, name, msg, *args)

    def warning(self, name: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, name, msg, *args)

    def error(self, name: str, msg: str, *args: object, exc_info: bool = False) -> None:
        self.log(logging.ERROR, name, msg, *args, exc_info=exc_info)
