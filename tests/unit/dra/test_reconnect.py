"""After a failed connection to the API server: the wait and what is said, in process."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ate_devplugd.base.logs import FIELD_EVENT
from ate_devplugd.dra import reconnect
from ate_devplugd.dra.apiclient import ApiError, ApiUnavailable
from ate_devplugd.dra.kubeconfig import KubeconfigError
from ate_devplugd.dra.reconnect import Reconnects


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int]]:
    """The events said, with their levels; then forgotten."""
    out = [(getattr(r, FIELD_EVENT, ""), r.levelno) for r in caplog.records]
    caplog.clear()
    return out


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="ate_devplugd.dra.reconnect")
    return caplog


def answered(monkeypatch: pytest.MonkeyPatch, now: float) -> None:
    """The clock the module reads says ``now`` (the process's own is left alone)."""
    monkeypatch.setattr(reconnect, "time", SimpleNamespace(monotonic=lambda: now))


class TestReconnects:
    @pytest.mark.parametrize("exc", [ApiUnavailable("connection refused"), ApiError(503, "ServiceUnavailable", "")])
    def test_away_is_retried_within_a_second(
        self, exc: ApiError | ApiUnavailable, caplog: pytest.LogCaptureFixture
    ) -> None:
        """No answer, or a 5xx while it starts: the next connection within a second, whatever the back-off."""
        trouble = Reconnects("/kc")
        retry = trouble.api_failed(exc, 30.0, token=True)
        assert 0.5 <= retry.delay <= reconnect.RECONNECT_SECONDS and not retry.credentials_refused
        assert said(caplog) == [("dra-api-error", logging.WARNING)]
        trouble.api_failed(exc, 30.0, token=True)
        assert said(caplog) == [("dra-api-error", logging.DEBUG)]  # the same problem again: quiet

    @pytest.mark.parametrize("status", [401, 403])
    def test_refusal_in_the_moment_after_the_return(
        self, status: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A refusal within SETTLE_SECONDS of the first answer is the start's moment: retried soon, no alarm;
        after it, a 403 says once that it is real, with the long back-off, and a 401 that the credentials
        are refused, with what to do."""
        trouble = Reconnects("/kc")
        answered(monkeypatch, 100.0)
        retry = trouble.api_failed(ApiError(status, "Refused", ""), 30.0, token=True)
        assert retry.delay <= reconnect.RECONNECT_SECONDS and not retry.credentials_refused
        assert said(caplog) == [("dra-api-error", logging.WARNING)]
        answered(monkeypatch, 100.0 + reconnect.SETTLE_SECONDS)
        retry = trouble.api_failed(ApiError(status, "Refused", ""), 30.0, token=True)
        assert retry.delay == 30.0
        if status == 403:
            assert not retry.credentials_refused and said(caplog) == [("dra-api-refused", logging.WARNING)]
        else:
            assert retry.credentials_refused and reconnect.TOKEN_REMEDY in retry.detail
            assert said(caplog) == [("dra-credentials-refused", logging.WARNING)]
            retry = trouble.api_failed(ApiError(401, "Refused", ""), 30.0, token=True)
            assert retry.credentials_refused and said(caplog) == [("", logging.DEBUG)]

    @pytest.mark.parametrize(
        ("token", "remedy"), [(True, reconnect.TOKEN_REMEDY), (False, reconnect.CERTIFICATE_REMEDY)]
    )
    def test_refused_credentials_once_until_they_change(
        self, token: bool, remedy: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A 401 well after the server answered names the remedy for the credentials' kind, once; new
        credentials refused are said again."""
        trouble = Reconnects("/kc")
        answered(monkeypatch, 0.0)
        trouble.api_failed(ApiError(500, "Starting", ""), 1.0, token=token)  # away...
        trouble.api_failed(ApiError(422, "Invalid", ""), 1.0, token=token)  # ...answers at 0
        answered(monkeypatch, reconnect.SETTLE_SECONDS + 1)
        caplog.clear()
        for _ in range(2):
            retry = trouble.api_failed(ApiError(401, "Unauthorized", ""), 4.0, token=token)
            assert retry.detail == f"401 Unauthorized; {remedy}" and retry.delay == 4.0
        assert said(caplog) == [("dra-credentials-refused", logging.WARNING), ("", logging.DEBUG)]
        trouble.new_problem(credentials=True)
        trouble.api_failed(ApiError(401, "Unauthorized", ""), 4.0, token=token)
        assert said(caplog) == [("dra-credentials-refused", logging.WARNING)]

    def test_other_answers_take_the_back_off(self, caplog: pytest.LogCaptureFixture) -> None:
        """A 422 (or a 409) is no outage and no start's moment: the back-off as it is."""
        retry = Reconnects("/kc").api_failed(ApiError(409, "Conflict", "modified"), 8.0, token=True)
        assert (retry.delay, retry.detail, retry.credentials_refused) == (8.0, "409 Conflict: modified", False)
        assert said(caplog) == [("dra-api-error", logging.WARNING)]

    def test_kubeconfig_error_once(self, caplog: pytest.LogCaptureFixture) -> None:
        trouble = Reconnects("/kc")
        for _ in range(2):
            assert trouble.kubeconfig_failed(KubeconfigError("/kc: not valid YAML")) == "/kc: not valid YAML"
        assert said(caplog) == [("dra-kubeconfig", logging.ERROR), ("", logging.DEBUG)]

    def test_back_said_once_after_failures(self, caplog: pytest.LogCaptureFixture) -> None:
        """The first connection that works after failures is said at info; one after a working one is not."""
        trouble = Reconnects("/kc")
        trouble.worked()
        assert said(caplog) == []
        trouble.failed()
        trouble.worked()
        trouble.worked()
        assert said(caplog) == [("dra-api-back", logging.INFO)]

    def test_jitter(self) -> None:
        assert reconnect.reconnect_delay(30.0, lambda a, b: a) == 0.5
        assert reconnect.reconnect_delay(0.2, lambda a, b: b) == 0.2
