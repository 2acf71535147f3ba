"""Whether kubelet, still running, holds one round's registration: its ListAndWatch streams (``drops``) and
its own word on what it offers (``offer``); when either says it no longer does, a drop to heal.

The session tells ``Holding`` what it does (registered, a stream opened or ended, a device list sent) and
asks it, each time it wakes, whether a drop is due (``dropped``: no stream for the wait while kubelet still
answers; ``taken``: kubelet's word said it does not offer what we serve, our stream open). The heal itself
(serve anew, register once more) is the session's; the warning (``reregister``, with the drop's number and
cause) and the count are said here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.deviceplugin.drops import STEADY, Drops
from ate_devplugd.deviceplugin.offer import Offer, Verdict
from ate_devplugd.kubelet import dp_state
from ate_devplugd.kubelet.watch import KubeletWatch
from ate_devplugd.kubelet.word import KubeletWord, Word
from ate_devplugd.node.devices import Resource
from ate_devplugd.signals.metrics import Metrics


class Holding:
    """One round's view of kubelet holding ``resource`` (``watch``: which kubelet answers, its directory);
    ``wake`` wakes the session."""

    def __init__(
        self,
        resource: Resource,
        metrics: Metrics,
        word: KubeletWord | None,
        watch: KubeletWatch,
        wake: Callable[[], None],
        *,
        withheld: bool = False,
    ) -> None:
        self._resource = resource
        self._metrics = metrics
        self._word = word
        self._watch = watch
        self._wake = wake
        self._withheld = withheld
        self.drops = Drops()
        self.offer = Offer(withheld=withheld)
        #: Our Healthy units in the latest device list sent to kubelet.
        self._sent = 0
        #: A word said kubelet does not offer the resource, past the wait: heal when the session wakes.
        self._taken = False
        #: kubelet's checkpoint file as our latest Register went out (the withheld path's baseline).
        self._checkpoint: FileIdentity | None = None

    @property
    def streams(self) -> int:
        return self.drops.streams

    @property
    def asks(self) -> bool:
        """Whether kubelet's word is asked at all (else the stream alone tells)."""
        return self._word is not None

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # -- what the session did ------------------------------------------------------------------------
    def registering(self) -> None:
        """A Register of ours goes out: the withheld path's evidence is a checkpoint written after this
        moment. Not after the call returns: kubelet's client runs beside its reply, and may have taken our
        list and written its checkpoint before the reply reaches us."""
        self._checkpoint = dp_state.identity(self._watch.plugin_dir) if self._withheld else None

    def registered(self) -> None:
        """A Register of ours returned: kubelet's earlier word no longer counts."""
        self.offer.registered(self._now(), self._checkpoint, healed=self.drops.heals > 0)
        self._ask()

    def streams_changed(self, streams: int) -> None:
        now = self._now()
        self.drops.streams_changed(streams, now)
        self.offer.changed(now)
        self._ask()

    def list_sent(self, healthy: int) -> None:
        """A device list with ``healthy`` Healthy units goes out to kubelet."""
        self._sent = healthy
        self.offer.changed(self._now())
        self._ask()

    def _ask(self) -> None:
        if self._word is not None:
            self._word.hint()

    # -- kubelet's word ------------------------------------------------------------------------------
    def heard(self, word: Word) -> bool:
        """kubelet's word, while our registration holds: judged if kubelet watches (True); not offering what
        we serve, the wait after our change past, is a drop (the session is woken); before it, asked again then."""
        if not self.drops.streams or self._word is None:
            return False
        now = self._now()
        verdict = self.offer.judge(word, self._resource.name, self._sent, self._resource.is_known_id, now)
        if verdict is Verdict.NOT_HELD and self.offer.overdue(word, self.drops.delay):
            self._taken = True
            self._wake()
        elif verdict is Verdict.NOT_HELD:
            self._word.hint(self.offer.look_again_in(now, self.drops.delay))
        return True

    # -- the drops -----------------------------------------------------------------------------------
    def grace_left(self) -> float | None:
        """How long until kubelet not watching counts as the resource dropped (None: nothing to time)."""
        return self.drops.left(self._now())

    def dropped(self, kubelet_there: bool) -> bool:
        """Whether the kubelet registered with, still running, has let the resource go (no stream for the
        wait since it stopped watching); if so, it is said and counted."""
        now = self._now()
        if not self.drops.due(now) or not kubelet_there:
            return False  # kubelet.sock gone: a kubelet stopping; the next one's socket wakes the session
        if not self._watch.answers():
            self.drops.later(now)  # stopped, its socket left behind: the next kubelet's wipe replaces it
            return False
        name = self._resource.name
        self._heal(f"kubelet has not watched {name} for {now - self.drops.lost_at:.1f} s while it still runs")
        return True

    def taken(self) -> bool:
        """Whether kubelet's word said it does not offer the resource while it watches (and still answers);
        if so, it is said and counted."""
        taken, self._taken = self._taken, False
        if (
            not taken
            or self.offer.verdict is not Verdict.NOT_HELD
            or not self.drops.streams
            or not self._watch.answers()
        ):
            return False  # something changed since that word (or kubelet is stopping): the next one judges
        if self.offer.held_span >= STEADY:
            self.drops.steady()
        name, detail = self._resource.name, self.offer.detail
        if self._withheld and self.offer.suspect:
            self._heal(f"{detail}: kubelet's word cannot show whether it took {name}", precaution=True)
        elif self._withheld:
            self._heal(f"{detail}: another client for {name} took it while DRA mode withholds it")
        else:
            cause = "another client for the name took it (kubelet swaps a name's client without ending ours)"
            self._heal(f"kubelet does not offer {name} while its stream is open ({detail}): {cause}")
        return True

    def _heal(self, cause: str, *, precaution: bool = False) -> None:
        self.drops.healed()
        self._metrics.reregistration(self._resource.name)
        if precaution:  # DRA mode's withheld path: nothing is lost if no client took the name
            self._resource.events.info(
                "withheld-reregister", "%s; registering the withheld path once more, which costs nothing", cause
            )
            return
        self._resource.events.warning(
            "reregister",
            "%s: it no longer holds the resource; serving anew and registering once more (drop %d with this "
            "kubelet; should it drop it again, the next in %.0f s)",
            cause,
            self.drops.heals,
            self.drops.delay,
        )
