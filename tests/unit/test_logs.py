"""The journal record format, the console format, and events with their fields bound once."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ate_devplugd.base import logs


class TestJournalHandler:
    def test_fields_and_priority(self) -> None:
        """Event records carry PRIORITY, SYSLOG_IDENTIFIER and the ATE_* fields."""
        sent: list[tuple[str, dict[str, Any]]] = []
        logger = logging.getLogger("test.journal")
        logger.propagate = False
        handler = logs.JournalHandler(send=lambda msg, **kw: sent.append((msg, kw)))
        logger.addHandler(handler)
        try:
            logs.EventLog(logger, resource="ate.dev/kvm", device="/dev/kvm").warning(
                "device-removed", "gone: %s", "/dev/kvm"
            )
            logger.error("plain")
        finally:
            logger.removeHandler(handler)
        (msg, fields), (plain, plain_fields) = sent
        assert msg == "gone: /dev/kvm"
        assert fields["PRIORITY"] == "4"
        assert fields["SYSLOG_IDENTIFIER"] == "ate-devplugd"
        assert (fields["ATE_EVENT"], fields["ATE_RESOURCE"], fields["ATE_DEVICE"]) == (
            "device-removed",
            "ate.dev/kvm",
            "/dev/kvm",
        )
        assert plain == "plain" and plain_fields["PRIORITY"] == "3" and "ATE_EVENT" not in plain_fields

    def test_a_failing_sender_does_not_raise(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A broken journal costs the record, never the daemon."""

        def boom(*_: Any, **__: Any) -> None:
            raise OSError("journal gone")

        handler = logs.JournalHandler(send=boom)
        errors: list[logging.LogRecord] = []
        monkeypatch.setattr(handler, "handleError", errors.append)
        handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None))
        assert len(errors) == 1

    def test_console_format(self) -> None:
        """Console lines show the level, the message and the event fields."""
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "registered %s", ("a",), None)
        record.ATE_EVENT = "registered"
        record.ATE_RESOURCE = "ate.dev/kvm"
        line = logs.ConsoleFormatter().format(record)
        assert line == "info: registered a  [event=registered resource=ate.dev/kvm]"
