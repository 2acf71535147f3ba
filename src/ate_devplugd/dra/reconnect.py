"""After a failed connection to the API server: how soon the next one, and what to say of the failure.

The slice publisher (``slices.SlicePublisher``) asks ``Reconnects`` at each failure. When the API server
could not be reached (or answered 5xx while it starts), the wait stays at about a second, jittered, so
the node is back about a second after the API server is and a fleet does not come back in step. An
answer that refuses (401, 403, 422) takes the publisher's back-off, up to 30 s, except in the first
SETTLE_SECONDS after the API server answers again (after an outage, or at the daemon's start): a server
that has just started may refuse for a moment, before it has loaded its authenticators (401) or its
authorization rules (403), so those two are retried on the reconnect schedule there, and said once as
a warning if they outlast it. A 401 outside that moment means the credentials are refused (an expired
token, or one bound to a Node that was deleted or created again): one ``dra-credentials-refused``
warning says so, with what to do, until a connection works again or the credentials change. Each
problem is said once at warning (a broken kubeconfig once at error), its repeats at debug; the first
connection that works after failures is said once, at info.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ate_devplugd.base.logs import EventLog
from ate_devplugd.dra.apiclient import ApiError, ApiUnavailable
from ate_devplugd.dra.kubeconfig import KubeconfigError

log = logging.getLogger(__name__)

#: After a connection failed for want of the API server, the next one starts at most this long later:
#: half to all of it, at random (see ``reconnect_delay``).
RECONNECT_SECONDS = 1.0
#: For this long after the API server answers again, a 401 or 403 is retried on the reconnect schedule:
#: a server that has just started answers before its authenticators and authorization rules are loaded.
SETTLE_SECONDS = 30.0
#: What to do about credentials the API server refuses (401), by their kind.
TOKEN_REMEDY = (
    "the token expired, or the Node it is bound to was deleted or created again: write a new one "
    "(docs/dra.md: Credentials for DRA mode)"
)
CERTIFICATE_REMEDY = "the client certificate expired or is not trusted: check kubelet's certificate rotation"


def reconnect_delay(delay: float, uniform: Callable[[float, float], float] = random.uniform) -> float:
    """The back-off ``delay`` while the API server is away: at most RECONNECT_SECONDS, and jittered."""
    return uniform(0.5, 1.0) * min(delay, RECONNECT_SECONDS)


def unreachable(exc: ApiError | ApiUnavailable) -> bool:
    """Whether the API server was away (no answer, or a 5xx while it starts), not refusing us."""
    return isinstance(exc, ApiUnavailable) or exc.status >= 500


@dataclass(frozen=True)
class Retry:
    """What a failed connection leads to: the wait before the next, and what STATUS says of it."""

    delay: float
    detail: str
    #: The API server refuses the credentials (401, not in the moment after its start).
    credentials_refused: bool = False


class Reconnects:
    """The failures of one publisher's connections to the API server, from its start."""

    def __init__(self, kubeconfig: str) -> None:
        self._kubeconfig = kubeconfig
        #: The problem last said: said again only at debug.
        self._reported = ""
        #: The refusal of these credentials was said (once, until they change or a connection works).
        self._refused_said = False
        #: When the connections began to fail (monotonic), until one works again.
        self._failing_since: float | None = None
        #: The API server has not answered since the start or since it was last away.
        self._away = True
        #: When it answered again (monotonic), while a 401 or 403 is still taken for its start's moment.
        self._answered_at: float | None = None

    def new_problem(self, *, credentials: bool = False) -> None:
        """The next failure is news, said again: after a connection that worked, or (``credentials``) after
        the credentials' files changed, when a refusal of them is news too."""
        self._reported = ""
        if credentials:
            self._refused_said = False

    def failed(self) -> None:
        """A connection failed (said by one of the methods below)."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()

    def worked(self) -> None:
        """A connection published the slices: the API server answers, and is back if it was not."""
        self._away, self._answered_at, self._refused_said = False, None, False
        if self._failing_since is not None:
            EventLog(log).info(
                "dra-api-back",
                "dra: the API server session is back after %.1f s of failed attempts; slices published",
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None

    def kubeconfig_failed(self, exc: KubeconfigError) -> str:
        """The kubeconfig cannot be used: one clear error per distinct problem, then quiet retries."""
        message = str(exc)
        if message != self._reported:
            EventLog(log).error("dra-kubeconfig", "dra: cannot use the kubeconfig (retrying): %s", message)
        else:
            log.debug("dra: kubeconfig still unusable: %s", message)
        self._reported = message
        return message

    def api_failed(self, exc: ApiError | ApiUnavailable, delay: float, *, token: bool) -> Retry:
        """Say why the connection failed; ``delay`` is the back-off's next, ``token`` the credentials' kind."""
        message = str(exc)
        level = logging.DEBUG if message == self._reported else logging.WARNING
        self._reported = message
        if isinstance(exc, ApiUnavailable) or unreachable(exc):
            self._away, self._answered_at = True, None
            delay = reconnect_delay(delay)
            EventLog(log).log(level, "dra-api-error", "dra: API server: %s (retrying in %.2f s)", message, delay)
            return Retry(delay, message)
        now = time.monotonic()
        if self._away:  # it answers again: a refusal now may be its start's moment
            self._away, self._answered_at = False, now
        refused = exc.status in (401, 403)
        if refused and self._answered_at is not None:
            since = now - self._answered_at
            if since < SETTLE_SECONDS:
                delay = reconnect_delay(delay)
                EventLog(log).log(
                    level,
                    "dra-api-error",
                    "dra: API server: %s, %.1f s after it answered again (it may not have loaded its "
                    "authentication or authorization yet; retrying in %.2f s)",
                    message,
                    since,
                    delay,
                )
                return Retry(delay, message)
            self._answered_at = None
            if exc.status == 403:
                EventLog(log).warning(
                    "dra-api-refused",
                    "dra: the API server still refuses %.0f s after it answered again, so this is no "
                    "restart's moment: %s (backing off; retrying in %.2f s)",
                    since,
                    message,
                    delay,
                )
                return Retry(delay, message)
        if exc.status == 401:
            remedy = TOKEN_REMEDY if token else CERTIFICATE_REMEDY
            if not self._refused_said:
                EventLog(log).warning(
                    "dra-credentials-refused",
                    "dra: the API server refuses the credentials of %s (%s): %s (retrying in %.2f s)",
                    self._kubeconfig,
                    message,
                    remedy,
                    delay,
                )
                self._refused_said = True
            else:
                log.debug("dra: credentials still refused: %s (retrying in %.2f s)", message, delay)
            return Retry(delay, f"{message}; {remedy}", credentials_refused=True)
        EventLog(log).log(level, "dra-api-error", "dra: API server: %s (retrying in %.2f s)", message, delay)
        return Retry(delay, message)
