"""kubelet's word judged against a session's own changes, alone (no I/O): what counts, what it says, when a
not-held word is a drop; DRA mode's withheld path judged by kubelet's checkpoint and sockets' comings."""

from __future__ import annotations

from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.deviceplugin.offer import Offer, Verdict
from ate_devplugd.kubelet.dp_state import Recorded
from ate_devplugd.kubelet.podresources import Allocatable
from ate_devplugd.kubelet.word import SETTLE, Word

NAME = "ate.dev/kvm"
OURS = frozenset(f"kvm-{i}" for i in range(4))


def ours(device: str) -> bool:
    return device in OURS


def offering(asked_at: float, ids: frozenset[str] | None) -> Word:
    return Word(asked_at, None if ids is None else Allocatable({NAME: ids} if ids else {}), None)


def judged(offer: Offer, word: Word, served: int = 4) -> Verdict:
    return offer.judge(word, NAME, served, ours, word.asked_at)


class TestDevicePluginMode:
    def test_a_word_counts_only_once_kubelet_had_time_for_our_change(self) -> None:
        offer = Offer()
        offer.registered(10.0, None)
        assert judged(offer, offering(10.0 + SETTLE / 2, frozenset())) is Verdict.PENDING
        assert judged(offer, offering(10.0 + SETTLE, OURS)) is Verdict.HELD
        offer.changed(20.0)  # a device list sent
        assert offer.verdict is Verdict.PENDING
        assert judged(offer, offering(19.0, OURS)) is Verdict.PENDING  # asked before it

    def test_only_our_units_count(self) -> None:
        """Units another plugin offers under the name are not ours: not held, however many."""
        offer = Offer()
        offer.registered(0.0, None)
        others = frozenset(f"gpu-{i}" for i in range(100))
        assert judged(offer, offering(1.0, others | {"kvm-0"})) is Verdict.NOT_HELD
        assert offer.detail == "it offers 1 of the 4 units served Healthy"
        assert judged(offer, offering(2.0, frozenset())) is Verdict.NOT_HELD
        assert offer.detail == "it offers none of the 4 units served Healthy"
        assert judged(offer, offering(3.0, OURS | others)) is Verdict.HELD and offer.detail == ""

    def test_untold_without_an_answer_or_a_healthy_unit(self) -> None:
        """kubelet's word cannot be had, or we serve no Healthy unit (kubelet then lists none either way)."""
        offer = Offer()
        offer.registered(0.0, None)
        assert judged(offer, offering(1.0, None)) is Verdict.UNTOLD
        assert judged(offer, offering(2.0, frozenset()), served=0) is Verdict.UNTOLD

    def test_a_drop_once_the_wait_after_our_change_has_passed(self) -> None:
        """Not held soon after our own change may be kubelet still taking in our list: asked again when the
        wait has passed; later it is a drop at once."""
        offer = Offer()
        offer.registered(0.0, None)
        early = offering(0.5, frozenset())
        judged(offer, early)
        assert not offer.overdue(early, wait=1.0)
        assert offer.look_again_in(0.5, wait=1.0) == 0.5
        late = offering(1.0, frozenset())
        judged(offer, late)
        assert offer.overdue(late, wait=1.0)
        judged(offer, offering(2.0, OURS))
        assert not offer.overdue(offering(2.0, OURS), wait=1.0)

    def test_after_a_heal_registered_waits_for_kubelets_word(self) -> None:
        offer = Offer()
        offer.registered(0.0, None)
        assert not offer.confirming  # kubelet opening its stream answers for it
        offer.registered(5.0, None, healed=True)
        offer.changed(5.01)  # the stream opened
        assert offer.confirming
        judged(offer, offering(5.01 + SETTLE, OURS))
        assert not offer.confirming and offer.verdict is Verdict.HELD
        offer.changed(9.0)
        assert not offer.confirming  # confirmed once in this registration

    def test_how_long_it_held(self) -> None:
        offer = Offer()
        offer.registered(0.0, None)
        judged(offer, offering(1.0, OURS))
        judged(offer, offering(61.0, OURS))
        judged(offer, offering(70.0, frozenset()))
        assert offer.held_span == 69.0 and offer.held_since is None


ID_A, ID_B = FileIdentity(1, 10, 100), FileIdentity(1, 11, 200)


def recorded(asked_at: float, identity: FileIdentity, ids: frozenset[str], departed: tuple[float, ...] = ()) -> Word:
    return Word(asked_at, None, Recorded(identity, {NAME: ids}), departed)


class TestWithheldPath:
    def test_another_clients_units_in_a_checkpoint_written_after_our_register(self) -> None:
        offer = Offer(withheld=True)
        offer.registered(0.0, ID_A)
        # the write from before our Register (a device-plugin mode's list, say) tells nothing
        assert judged(offer, recorded(1.0, ID_A, OURS), served=0) is Verdict.PENDING
        assert judged(offer, recorded(2.0, ID_B, frozenset()), served=0) is Verdict.HELD
        offer.changed(3.0)  # our lists do not make the evidence stale
        assert offer.verdict is Verdict.HELD
        taken = recorded(4.0, FileIdentity(1, 12, 300), OURS)
        assert judged(offer, taken, served=0) is Verdict.NOT_HELD and not offer.suspect
        assert offer.detail == "kubelet's checkpoint records 4 Healthy units of it"
        assert offer.overdue(taken, wait=1.0)

    def test_a_socket_that_came_after_our_register_and_went_is_suspect(self) -> None:
        """A client that went before kubelet took its list leaves only its socket's coming and going; one
        that came before our Register does not count; the suspicion lasts until the next Register."""
        offer = Offer(withheld=True)
        offer.registered(10.0, ID_A)
        assert judged(offer, recorded(11.0, ID_B, frozenset(), departed=(5.0, float("-inf"))), 0) is Verdict.HELD
        # told by a word too early to count for anything else: still noted
        offer.changed(20.0)
        judged(offer, recorded(20.1, ID_B, frozenset(), departed=(15.0,)), served=0)
        assert offer.suspect
        assert judged(offer, recorded(21.0, ID_B, frozenset()), served=0) is Verdict.NOT_HELD
        offer.registered(30.0, ID_B, healed=True)
        assert not offer.suspect
        assert judged(offer, recorded(31.0, FileIdentity(1, 13, 400), frozenset()), served=0) is Verdict.HELD

    def test_no_checkpoint_to_read_is_untold(self) -> None:
        offer = Offer(withheld=True)
        offer.registered(0.0, None)
        assert judged(offer, Word(1.0, None, None), served=0) is Verdict.UNTOLD
