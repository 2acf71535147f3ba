"""The timing of healing kubelet-side drops, alone: the grace, the doubling wait, its reset."""

from __future__ import annotations

from ate_devplugd.deviceplugin.drops import REREGISTER_CAP, STEADY, STREAM_GRACE, Drops


def test_grace_then_doubling_then_capped() -> None:
    drops = Drops()
    assert drops.left(0.0) is None  # nothing lost yet
    drops.streams_changed(1, 0.0)
    waits = []
    now = 10.0
    for _ in range(8):
        drops.streams_changed(0, now)
        assert drops.left(now) == drops.delay and not drops.due(now)
        now += drops.delay
        assert drops.due(now) and drops.left(now) is None  # looked at once
        waits.append(drops.delay)
        drops.healed()
        drops.expect(now)  # registered again, no stream yet
        drops.streams_changed(1, now + 0.001)  # kubelet watches: nothing to time
        assert drops.left(now) is None
    assert waits[:3] == [STREAM_GRACE, 2 * STREAM_GRACE, 4 * STREAM_GRACE]
    assert max(waits) == REREGISTER_CAP and drops.heals == 8


def test_steady_watching_starts_again_at_the_grace() -> None:
    drops = Drops()
    drops.streams_changed(1, 0.0)
    for _ in range(3):
        drops.healed()
    assert drops.delay == 8 * STREAM_GRACE
    drops.streams_changed(1, 1.0)
    drops.streams_changed(0, 1.0 + STEADY)
    assert drops.delay == STREAM_GRACE


def test_a_register_with_no_stream_is_a_drop_and_a_silent_kubelet_is_looked_at_again() -> None:
    drops = Drops()
    drops.expect(0.0)
    assert drops.left(0.0) == STREAM_GRACE
    assert drops.due(STREAM_GRACE)
    drops.later(STREAM_GRACE)  # kubelet did not answer
    assert drops.left(STREAM_GRACE) == 2 * STREAM_GRACE
    drops.stopped()
    assert drops.left(100.0) is None and drops.streams == 0


def test_a_steady_hold_starts_again_at_the_grace() -> None:
    """kubelet held the registration for STEADY (by its word): the next drop waits STREAM_GRACE again."""
    drops = Drops()
    for _ in range(3):
        drops.healed()
    assert drops.delay == 8 * STREAM_GRACE
    drops.steady()
    assert drops.delay == STREAM_GRACE and drops.heals == 3
