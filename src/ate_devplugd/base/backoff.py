"""Retry delays that double while failures continue: the one back-off of the daemon's retry loops."""

from __future__ import annotations


class Backoff:
    """Retry delays: milliseconds at first, doubling while failures continue, capped."""

    def __init__(self, first: float = 0.005, cap: float = 30.0) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._cap, self._next * 2)
        return delay
