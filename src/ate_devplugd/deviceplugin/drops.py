"""When kubelet, still running, has dropped a registered resource: the grace, the doubling wait, the count.

kubelet's device manager drops a resource without stopping in two ways. It ends the resource's
ListAndWatch and disconnects its client (another client's stream for the name ended, or
``DeRegisterPlugin``): it then offers nothing of the resource (allocatable 0) and never calls the plugin
again. Or (kubelet 1.36) another client for the name takes its place with our stream left open, and when
that client goes kubelet offers nothing, with no signal on our stream; only kubelet's word shows it
(``offer``). A session heals either by serving anew and registering once more (``session``); ``Drops``
holds only the timing, with no I/O, so any order of streams and waits can be tested alone. The first wait
after kubelet stopped watching (or, for the second way, after the session's last change) is
``STREAM_GRACE`` (a kubelet that restarts is seen as a new kubelet long before, and one that registered us
opens its stream within milliseconds); each heal doubles the next wait, up to ``REREGISTER_CAP``, so a
kubelet that keeps dropping the resource (or a client that keeps taking the name) is not hammered; a
kubelet that watched (or held the registration) for ``STEADY``, and every new round (the next kubelet),
start again at ``STREAM_GRACE``.
"""

from __future__ import annotations

from ate_devplugd.base.backoff import Backoff

#: How long kubelet may go without a ListAndWatch stream on a registered resource, while it still runs,
#: before the session takes the resource for dropped and registers once more.
STREAM_GRACE = 1.0
#: The longest wait before registering once more, while drops keep coming.
REREGISTER_CAP = 30.0
#: How long kubelet must watch for the next drop to be waited for ``STREAM_GRACE`` again.
STEADY = 60.0


class Drops:
    """One round's watch on kubelet watching: streams open, and when not watching is a drop to heal."""

    def __init__(self) -> None:
        #: ListAndWatch streams open on the round's server (kubelet watches while > 0).
        self.streams = 0
        #: Heals made this round (one kubelet life).
        self.heals = 0
        #: When kubelet stopped watching (loop time).
        self.lost_at = 0.0
        self._watched_since: float | None = None
        self._due: float | None = None
        self._backoff = Backoff(STREAM_GRACE, REREGISTER_CAP)
        self._delay = self._backoff.next()

    @property
    def delay(self) -> float:
        """The wait before the next heal."""
        return self._delay

    def streams_changed(self, streams: int, now: float) -> None:
        """kubelet opened or ended a stream: watching again, or a drop timed from now."""
        self.streams = streams
        if streams:
            self._due = None
            self._watched_since = self._watched_since if self._watched_since is not None else now
            return
        if self._watched_since is not None and now - self._watched_since >= STEADY:
            self._backoff.reset()
            self._delay = self._backoff.next()
        self._watched_since = None
        self.expect(now)

    def expect(self, now: float) -> None:
        """Registered (again) or a stream ended: unless kubelet watches within the wait, a drop."""
        if not self.streams:
            self.lost_at, self._due = now, now + self._delay

    def left(self, now: float) -> float | None:
        """How long until not watching counts as a drop (None: nothing to time)."""
        if self._due is None or self.streams:
            return None
        return max(0.0, self._due - now)

    def due(self, now: float) -> bool:
        """Whether not watching counts as a drop now (it is then looked at once: ``healed`` or ``later``)."""
        if self.left(now) != 0.0:
            return False
        self._due = None
        return True

    def healed(self) -> None:
        """A heal is made (one more Register): counted, and the next wait doubles."""
        self.heals += 1
        self._delay = self._backoff.next()

    def steady(self) -> None:
        """kubelet held the registration for ``STEADY``: the next wait is ``STREAM_GRACE`` again."""
        self._backoff.reset()
        self._delay = self._backoff.next()

    def later(self, now: float) -> None:
        """kubelet did not answer: look again after a doubled wait (its restart may come first)."""
        self._delay = self._backoff.next()
        self._due = now + self._delay

    def stopped(self) -> None:
        """The round's server stopped: no stream, nothing to time."""
        self.streams, self._watched_since, self._due = 0, None, None
