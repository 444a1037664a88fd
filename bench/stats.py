"""Small helpers shared by the benchmarks: robust summaries of repeated timings, progress."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile, and the relative spread (p90 - p10) / median."""
    ordered = sorted(samples)
    n = len(ordered)
    med = statistics.median(ordered)
    p10 = ordered[max(0, int(0.1 * (n - 1)))]
    p90 = ordered[min(n - 1, round(0.9 * (n - 1)))]
    return {"median": med, "p10": p10, "p90": p90, "spread": (p90 - p10) / med if med else 0.0, "n": n}


def fmt_us(s: dict[str, float]) -> str:
    return f"median {s['median'] * 1e6:8.1f} us  p10 {s['p10'] * 1e6:8.1f}  p90 {s['p90'] * 1e6:8.1f}  (n={int(s['n'])})"


def fmt_gbps(nbytes: int, s: dict[str, float]) -> str:
    return (
        f"median {nbytes / s['median'] / 1e9:6.2f} GB/s  ({s['median'] * 1e3:7.2f} ms, "
        f"p10 {s['p10'] * 1e3:6.2f} ms, p90 {s['p90'] * 1e3:6.2f} ms, n={int(s['n'])})"
    )


class Progress:
    """Where a long benchmark run is, on stderr: never stdout, whose ``--json`` output stays one
    JSON object. ``step`` starts the next of ``steps`` named steps; ``tick`` reports n of N
    inside one, at most every ``TICK_S``."""

    TICK_S = 2.0

    def __init__(self, name: str, steps: int, enabled: bool = True) -> None:
        self.name = name
        self.steps = steps
        self.enabled = enabled
        self.done = 0
        self.t0 = time.monotonic()
        self._last_tick = 0.0

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"[{self.name} {time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def step(self, what: str) -> None:
        self.done += 1
        self._last_tick = time.monotonic()
        self._say(f"step {self.done}/{self.steps}: {what}")

    def tick(self, what: str, n: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last_tick >= self.TICK_S:
            self._last_tick = now
            self._say(f"  {what} {n}/{total}")
