"""sd_notify over a real datagram socket, the watchdog interval, and the journal record format."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from ate_devplugd import systemd


class TestNotifier:
    def test_messages_reach_a_real_socket(self, tmp_path: Path, clean_env: None) -> None:
        """READY, STATUS (only on change), RELOADING with MONOTONIC_USEC, STOPPING, WATCHDOG."""
        path = tmp_path / "notify"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        sock.settimeout(5)
        os.environ["NOTIFY_SOCKET"] = str(path)
        notifier = systemd.Notifier()
        notifier.ready("a: 1/1 healthy")
        notifier.status("a: 1/1 healthy")  # unchanged: not sent
        notifier.status("a: 0/1 healthy")
        notifier.reloading()
        notifier.watchdog()
        notifier.stopping()
        got = [sock.recv(4096).decode() for _ in range(5)]
        sock.close()
        assert got[0] == "READY=1\nSTATUS=a: 1/1 healthy"
        assert got[1] == "STATUS=a: 0/1 healthy"
        assert got[2].startswith("RELOADING=1\nMONOTONIC_USEC=") and got[2].split("=")[-1].isdigit()
        assert got[3] == "WATCHDOG=1"
        assert got[4].startswith("STOPPING=1")

    def test_no_socket_is_a_no_op(self, clean_env: None) -> None:
        """Without NOTIFY_SOCKET nothing is sent and nothing fails."""
        os.environ.pop("NOTIFY_SOCKET", None)
        notifier = systemd.Notifier()
        assert not notifier.enabled
        notifier.ready("x")


class TestWatchdog:
    @pytest.mark.parametrize(
        ("env", "expected"),
        [
            ({}, None),
            ({"WATCHDOG_USEC": "3000000"}, 1.5),
            ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "42"}, 1.5),
            ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "43"}, None),
            ({"WATCHDOG_USEC": "0"}, None),
            ({"WATCHDOG_USEC": "junk"}, None),
        ],
    )
    def test_interval(self, env: dict[str, str], expected: float | None) -> None:
        """Half of WATCHDOG_USEC, only when meant for this process."""
        assert systemd.watchdog_interval(env, pid=42) == expected


class TestJournalHandler:
    def test_fields_and_priority(self) -> None:
        """Event records carry PRIORITY, SYSLOG_IDENTIFIER and the ATE_* fields."""
        sent: list[tuple[str, dict[str, Any]]] = []
        logger = logging.getLogger("test.journal")
        logger.propagate = False
        handler = systemd.JournalHandler(send=lambda msg, **kw: sent.append((msg, kw)))
        logger.addHandler(handler)
        try:
            systemd.event(
                logger,
                logging.WARNING,
                "device-removed",
                "gone: %s",
                "/dev/kvm",
                resource="ate.dev/kvm",
                device="/dev/kvm",
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

        handler = systemd.JournalHandler(send=boom)
        errors: list[logging.LogRecord] = []
        monkeypatch.setattr(handler, "handleError", errors.append)
        handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None))
        assert len(errors) == 1

    def test_console_format(self) -> None:
        """Console lines show the level, the message and the event fields."""
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "registered %s", ("a",), None)
        record.ATE_EVENT = "registered"
        record.ATE_RESOURCE = "ate.dev/kvm"
        line = systemd.ConsoleFormatter().format(record)
        assert line == "info: registered a  [event=registered resource=ate.dev/kvm]"
