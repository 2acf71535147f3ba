"""kubelet's word on what it offers, asked on hints: its pod-resources API's allocatable units, and (for DRA
mode's withheld path) what its device-manager checkpoint last recorded.

Not a poll: it is asked only when something may have changed what kubelet offers. A socket that is not ours
appearing in or leaving the plugin directory, kubelet's checkpoint rewritten (it took in some plugin's
device list), kubelet.sock created (``kubelet.watch``); a session's Register, its stream opened or ended, a
device list it sent (``deviceplugin.session``). kubelet is asked ``SETTLE`` after the last hint of a
burst (but no later than ``COALESCE_CAP`` after its first), one question for all of them: kubelet acts on a
plugin's device list, and on the end of another client's stream, in a goroutine of its own some
milliseconds after the event we see; one change shows here as several events (another client's socket,
then kubelet's checkpoint written for its list), and a kubelet start removes every plugin's socket in one
burst. Questions are at least ``SETTLE`` apart, however fast hints come. A
question that fails for a while (a kubelet starting: no socket yet, or it does not listen yet) is asked
again with a doubling wait, a few times; one that cannot succeed (an older kubelet, the sandbox) is not.

Each answer goes to every subscriber as a ``Word`` stamped with the loop time the question went out, so a
reader can tell a word taken after its own change from one taken before it, with the arrival times of the
other plugins' sockets that left the directory since the question before (a client for a name that went
before kubelet took any device list of it leaves no other trace). That it cannot be had is said
once in the daemon's life (``pod-resources-unanswered``), and its return once (``pod-resources-answers``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

from ate_devplugd.base.inotify import DirEvent
from ate_devplugd.base.logs import EventLog
from ate_devplugd.kubelet import dp_state, podresources
from ate_devplugd.kubelet.watch import KUBELET_SOCKET

log = logging.getLogger(__name__)

#: How long after a hint kubelet is asked, and the least time between two questions (module doc).
SETTLE = 0.25
#: A burst of hints is asked about no later than this after its first.
COALESCE_CAP = 1.0
#: A question asked this much before it was owed is asked on time: it is then not asked again, and its
#: word counts for the change that owed it (``Word.told_after``). Both rules must use the same figure, or
#: a change hinted just after another would be owed a question that is never asked.
EARLY = 0.005
#: How long one question may take.
ASK_TIMEOUT = 5.0
#: A failed question is asked again this long after it, doubling, this many times (0.25 s ... 4 s: about
#: 8 s in all, a kubelet's start), then left to the next hint.
RETRY_FIRST, RETRIES = 0.25, 5


class Word(NamedTuple):
    """One answer: when it was asked (loop time); kubelet's allocatable IDs per resource (None: unanswered,
    or not asked); its checkpoint's last write (None: not read, or unreadable); when each other plugin's
    socket that left since the previous question had appeared (loop time; -inf: before the watch saw it)."""

    asked_at: float
    offered: podresources.Allocatable | None
    recorded: dp_state.Recorded | None
    departed: tuple[float, ...] = ()

    def told_after(self, changed_at: float, wait: float = SETTLE) -> bool:
        """Whether this word was asked ``wait`` or more after a change at ``changed_at``: the question a hint
        owes is asked up to ``EARLY`` before it is due, and counts as on time."""
        return self.asked_at >= changed_at + wait - EARLY


class KubeletWord:
    """Asks kubelet what it offers when hinted; ``api``: its pod-resources API; ``checkpoint``: its file."""

    def __init__(self, plugin_dir: str, *, api: bool = True, checkpoint: bool = False) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = podresources.socket_for(plugin_dir)
        self._api, self._checkpoint = api, checkpoint
        self._subscribers: list[Callable[[Word], None]] = []
        #: SETTLE after the latest hint not yet asked about, and when the first of them came (loop time).
        self._settle: float | None = None
        self._burst: float | None = None
        #: Questions owed at given times (``hint(delay)``).
        self._later: list[float] = []
        self._last_asked = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._retries = 0
        #: Other plugins' sockets seen arriving (name: loop time), and the arrivals of those that left since.
        self._arrived: dict[str, float] = {}
        self._departed: list[float] = []
        self._warned = False
        self._unanswered = False
        self._events = EventLog(log)
        #: Questions sent (tests and figures).
        self.asked = 0

    def subscribe(self, callback: Callable[[Word], None]) -> Callable[[], None]:
        """Hear every answer; returns the undo."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def seen(self, events: list[DirEvent]) -> None:
        """The plugin directory's events that may change what kubelet offers (``KubeletWatch.on_changes``):
        other plugins' sockets noted as they come and go, and kubelet asked."""
        now = asyncio.get_running_loop().time()
        for ev in events:
            if ev.name in (KUBELET_SOCKET, dp_state.CHECKPOINT) or ev.kind not in ("created", "removed"):
                continue
            if ev.kind == "created":
                self._arrived[ev.name] = now
            else:
                self._departed.append(self._arrived.pop(ev.name, float("-inf")))
        self.hint()

    def hint(self, delay: float | None = None) -> None:
        """Something may have changed what kubelet offers: ask SETTLE after the burst's last hint; or, given
        ``delay``, once that long from now has passed."""
        now = asyncio.get_running_loop().time()
        if delay is not None:
            self._later.append(now + delay)
        else:
            self._settle = now + SETTLE
            self._burst = now if self._burst is None else self._burst
        self._arm()

    def close(self) -> None:
        """Ask nothing more until the next hint (a question in flight is dropped)."""
        self._settle = self._burst = None
        self._later.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _due(self) -> float | None:
        """When the next question is owed (None: none is)."""
        owed = list(self._later)
        if self._settle is not None and self._burst is not None:
            owed.append(min(self._settle, self._burst + COALESCE_CAP))
        return max(min(owed), self._last_asked + SETTLE) if owed else None

    def _arm(self) -> None:
        due = self._due()
        if due is None or self._task is not None or self._timer is not None:
            return  # nothing owed, or the question in flight (or armed) re-arms for what is owed after it
        self._timer = asyncio.get_running_loop().call_at(due, self._fire)

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        due = self._due()
        if due is None:
            return
        if due > loop.time() + EARLY:  # the burst's later hints: wait for them
            self._timer = loop.call_at(due, self._fire)
            return
        self._task = loop.create_task(self._ask(), name="kubelet's word")

    async def _ask(self) -> None:
        loop = asyncio.get_running_loop()
        asked_at = self._last_asked = loop.time()
        if self._settle is not None:  # asked at the burst's cap: its last hint is owed a later question
            self._later.append(self._settle)
        self._settle = self._burst = None
        self._later = [at for at in self._later if at > asked_at + EARLY]
        self.asked += 1
        departed, self._departed = tuple(self._departed), []
        offered = await self._allocatable() if self._api else None
        recorded = dp_state.recorded(self.plugin_dir) if self._checkpoint else None
        self._task = None
        word = Word(asked_at, offered, recorded, departed)
        for callback in list(self._subscribers):
            callback(word)
        self._arm()

    async def _allocatable(self) -> podresources.Allocatable | None:
        try:
            offered = await podresources.allocatable(self.socket_path, ASK_TIMEOUT)
        except podresources.Unanswered as exc:
            self._failed(exc)
            return None
        self._retries = 0
        if self._unanswered:
            self._unanswered = False
            if self._warned:
                self._events.info("pod-resources-answers", "kubelet's pod-resources API answers: %s", self.socket_path)
        return offered

    def _failed(self, exc: podresources.Unanswered) -> None:
        """Ask again a few times (a kubelet starting), then wait for the next hint; say so once."""
        self._unanswered = True
        if not exc.lasting and self._retries < RETRIES:
            self.hint(RETRY_FIRST * 2**self._retries)
            self._retries += 1
            self._events.debug("pod-resources-unanswered", "kubelet's pod-resources API: %s; asking again", exc)
            return
        self._retries = 0
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        self._events.log(
            level,
            "pod-resources-unanswered",
            "kubelet's pod-resources API does not answer (%s): whether kubelet offers the units is then told by "
            "its ListAndWatch stream alone, as before kubelet's word was asked",
            exc,
        )
