"""The retry delays: doubling from the first while failures continue, capped, and back to the first on reset."""

from __future__ import annotations

from ate_devplugd.base.backoff import Backoff


def test_doubles_up_to_the_cap_then_resets() -> None:
    backoff = Backoff(first=0.05, cap=0.3)
    assert [backoff.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    backoff.reset()
    assert backoff.next() == 0.05


def test_defaults_start_at_milliseconds_and_stop_at_half_a_minute() -> None:
    backoff = Backoff()
    delays = [backoff.next() for _ in range(20)]
    assert delays[0] == 0.005 and max(delays) == delays[-1] == 30.0
