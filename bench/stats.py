"""Small helpers shared by the benchmarks: robust summaries of repeated timings."""

from __future__ import annotations

import statistics
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
