"""How often to look at transfers in flight: spin briefly, then back off.

A small transfer between two processes completes in tens of microseconds when both ends
progress their NIXL agents promptly, so the first ~100 us are spent polling without
sleeping; after that the interval doubles from 20 us up to 250 us, which keeps a long
transfer's completion visible within a quarter of a millisecond at a few percent of a
core. Idle, nobody polls at all.
"""

from __future__ import annotations

import time

SPIN_S = 100e-6
FIRST_S = 20e-6
MAX_S = 250e-6


class Pacer:
    """The wait before the next look; ``reset`` when nothing is in flight any more."""

    __slots__ = ("_delay", "_since")

    def __init__(self) -> None:
        self._since: float | None = None
        self._delay = FIRST_S

    def reset(self) -> None:
        self._since = None

    def next(self) -> float:
        now = time.perf_counter()
        if self._since is None:
            self._since = now
            self._delay = FIRST_S
            return 0.0
        if now - self._since < SPIN_S:
            return 0.0
        delay = self._delay
        self._delay = min(MAX_S, delay * 2)
        return delay
