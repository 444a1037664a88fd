"""A token bucket: what a rate limit needs, for whoever limits a rate (the metrics
exporter's accepts, the bytes the node reads to check reported objects)."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens a second at most, ``burst`` at once; one thread only."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.at = clock()

    def _refill(self) -> float:
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        return now

    def has(self, amount: float = 1.0) -> bool:
        """Whether ``amount`` tokens may be taken now (nothing is taken)."""
        self._refill()
        return self.tokens >= amount

    def take(self, amount: float = 1.0) -> bool:
        """Take ``amount`` tokens if there are as many; whether it did."""
        if not self.has(amount):
            return False
        self.tokens -= amount
        return True

    def affords(self, amount: float) -> bool:
        """Whether ``amount`` may be spent now: there are as many tokens, or a full bucket
        when ``amount`` is more than ``burst`` holds."""
        return self.has(min(amount, self.burst))

    def spend(self, amount: float) -> None:
        """Take ``amount`` tokens, into debt if need be (after ``affords``): later takes wait
        until it is paid back."""
        self.tokens -= amount

    def give_back(self, amount: float = 1.0) -> None:
        self.tokens = min(float(self.burst), self.tokens + amount)

    def next_at(self) -> float:
        """When the next take of one token succeeds."""
        now = self._refill()
        return now + max(0.0, 1.0 - self.tokens) / self.rate
