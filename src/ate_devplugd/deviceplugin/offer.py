"""Whether kubelet offers what a session serves: kubelet's word (``kubelet.word``) judged against the
session's own last change (no I/O, so any order of words and changes can be tested alone).

A word counts only if it was asked ``SETTLE`` or more after the session's latest change (its Register, a
stream opened or ended, a device list sent; ``Word.told_after``, whose tolerance is the asking's own):
kubelet takes that long at most to act on it, and a word older than the change says nothing of it. Then:

- a session serving Healthy units is *held* when kubelet's pod-resources API offers every one of them, and
  *not held* when it offers fewer (only the session's own IDs count: units another plugin offers under the
  name are granted by that plugin, not by us). No Healthy unit served, or the API unanswered: *untold*, and
  the stream alone says whether kubelet holds the registration;
- DRA mode's withheld path serves every unit Unhealthy, which the API cannot show (kubelet lists a resource
  with no healthy unit as it lists one it does not hold). Its evidence is kubelet's device-manager
  checkpoint (``kubelet.dp_state``): kubelet rewrites it each time it takes in a device list, with the name's
  healthy IDs. In a write made after our Register, any ID there came from another client for the name: not
  held. No such write yet: pending; none to be read: untold. A client that registers and goes before kubelet
  takes its first list leaves no write, and no other trace but its socket: so another plugin's socket that
  appeared after our Register and has left (``Word.departed``) makes it *suspect*, not held, whatever the
  checkpoint says until the next Register. That may be a plugin of another name; registering the withheld
  path once more costs nothing (kubelet offers none of it either way), so it is done as a precaution.

A *not held* word is a drop to heal once it comes the session's wait (``drops.Drops.delay``) or more after
its change; before that kubelet is asked again at that moment (a slow kubelet has caught up by then).

Until a word counts (*pending*), kubelet's own acts stand for it: after the round's first Register, kubelet
opening its ListAndWatch stream is its answer (it opens one for the client it has just made current). After
a heal, the session has just seen kubelet not offer the resource, so it waits for kubelet's word
(``confirming``) before it calls the resource registered again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.kubelet.word import Word


class Verdict(enum.Enum):
    """What kubelet's latest word that counts says of the session's registration."""

    PENDING = "pending"
    HELD = "held"
    NOT_HELD = "not held"
    UNTOLD = "untold"


class Offer:
    """One round's judgement of kubelet's word; ``withheld``: DRA mode's path (every unit Unhealthy)."""

    def __init__(self, *, withheld: bool = False) -> None:
        self.withheld = withheld
        self.verdict = Verdict.PENDING
        #: What kubelet offers, in an operator's words, while not held.
        self.detail = ""
        #: Since when (loop time) kubelet has held the registration without a break; None while it does not.
        self.held_since: float | None = None
        #: How long the latest unbroken hold lasted, once it ended.
        self.held_span = 0.0
        self._changed_at = float("-inf")
        self._registered_at = float("-inf")
        self._baseline: FileIdentity | None = None
        #: The withheld path: another plugin's socket came after our Register and went (module doc).
        self.suspect = False
        #: Registered again after a drop: pending is not held until kubelet's word has come (module doc).
        self._confirm = False

    @property
    def confirming(self) -> bool:
        """Registered again after a drop, and no word since (the module doc)."""
        return self._confirm and self.verdict is Verdict.PENDING

    def registered(self, now: float, checkpoint: FileIdentity | None, *, healed: bool = False) -> None:
        """A Register of ours returned (``healed``: after a drop); ``checkpoint``: kubelet's checkpoint file
        as the call went out (the withheld path's evidence is a later write)."""
        self._baseline, self.suspect, self._confirm = checkpoint, False, healed
        self._set(Verdict.PENDING, "", now)
        self._changed_at = self._registered_at = now

    def changed(self, now: float) -> None:
        """Our stream or device list changed: words asked before ``now`` + SETTLE no longer count (the
        withheld path's evidence, a checkpoint written after our Register, still does)."""
        self._changed_at = now
        if not self.withheld:
            self._set(Verdict.PENDING, "", now)

    def judge(self, word: Word, name: str, served: int, ours: Callable[[str], bool], now: float) -> Verdict:
        """Take ``word`` (``served``: our Healthy units on the stream now; ``ours``: whether an ID is ours)."""
        if self.withheld:  # a socket's coming and going counts whenever it is told
            self.suspect = self.suspect or any(arrived > self._registered_at for arrived in word.departed)
        if not word.told_after(self._changed_at):
            return self.verdict
        if self.withheld:
            return self._judge_withheld(word, name, now)
        if word.offered is None or not served:
            return self._set(Verdict.UNTOLD, "", now)
        offered = sum(1 for device in word.offered.ids.get(name, ()) if ours(device))
        if offered >= served:
            return self._set(Verdict.HELD, "", now)
        return self._set(Verdict.NOT_HELD, f"it offers {offered or 'none'} of the {served} units served Healthy", now)

    def _judge_withheld(self, word: Word, name: str, now: float) -> Verdict:
        recorded = word.recorded
        fresh = recorded is not None and recorded.identity != self._baseline  # written since our Register
        others = len(recorded.healthy.get(name, ())) if recorded is not None and fresh else 0
        if others:
            self.suspect = False
            return self._set(Verdict.NOT_HELD, f"kubelet's checkpoint records {others} Healthy units of it", now)
        if self.suspect:
            detail = "another plugin's socket came and went since our Register, and the checkpoint cannot tell"
            return self._set(Verdict.NOT_HELD, detail, now)
        if recorded is None:
            return self._set(Verdict.UNTOLD, "", now)
        return self._set(Verdict.HELD, "", now) if fresh else self.verdict

    def overdue(self, word: Word, wait: float) -> bool:
        """Whether a not-held ``word`` came ``wait`` or more after our change: a drop to heal now."""
        return self.verdict is Verdict.NOT_HELD and word.told_after(self._changed_at, wait)

    def look_again_in(self, now: float, wait: float) -> float:
        """How long until a not-held word would be a drop (when kubelet is to be asked again)."""
        return max(0.0, self._changed_at + wait - now)

    def _set(self, verdict: Verdict, detail: str, now: float) -> Verdict:
        if verdict in (Verdict.HELD, Verdict.UNTOLD):
            self._confirm = False
        if verdict is Verdict.HELD and self.held_since is None:
            self.held_since = now
        elif verdict is not Verdict.HELD and self.held_since is not None:
            self.held_span, self.held_since = now - self.held_since, None
        self.verdict, self.detail = verdict, detail
        return verdict
