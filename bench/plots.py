"""Plots of benchmark results (``--plot FILE``): PNGs a person can look at.

Each kvcr measurement is drawn beside its raw anchor from the same run, as distributions of
the per-iteration samples (boxes: quartiles; whiskers: 5th to 95th percentile; the median
written beside each), and throughput against span size as medians with a p10..p90 band.
matplotlib is imported here only, with the Agg backend, so a run without ``--plot`` never
loads it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

KVCR_COLOUR = "#1f77b4"
RAW_COLOUR = "#999999"
DPI = 100
"""Small enough for a README (about 100 KB), sharp enough to read."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _percentile(samples: Sequence[float], q: float) -> float:
    """The sample at quantile ``q`` (nearest rank)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _figure(value: float) -> str:
    """Three significant digits, without an exponent: ``1,300``, ``13.2``, ``0.105``."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def distributions(ax: Any, rows: Sequence[tuple[str, Sequence[float], bool]], scale: float, unit: str, title: str) -> None:
    """Horizontal boxes, one per ``(label, samples in seconds, is_raw)``, top to bottom, in ``unit``."""
    rows = [row for row in rows if row[1]]
    if not rows:
        ax.set_axis_off()
        return
    data = [[s * scale for s in samples] for _, samples, _ in reversed(rows)]
    boxes = ax.boxplot(data, orientation="horizontal", whis=(5, 95), showfliers=False, widths=0.6,
                       patch_artist=True, medianprops={"color": "black"})
    for patch, (_, _, raw) in zip(boxes["boxes"], reversed(rows), strict=True):
        patch.set_facecolor(RAW_COLOUR if raw else KVCR_COLOUR)
        patch.set_alpha(0.8)
    ax.set_yticks(range(1, len(rows) + 1), [label for label, _, _ in reversed(rows)])
    ends = [max(line.get_xdata()) for line in boxes["whiskers"][1::2]]  # each box's upper whisker
    right = max(ends) * 1.25
    for y, (d, end) in enumerate(zip(data, ends, strict=True), start=1):
        ax.text(end + right * 0.02, y, f"{_figure(statistics.median(d))} {unit}", va="center", fontsize=8)
    ax.set_xlim(0, right)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def throughput(ax: Any, sweep: Mapping[int, Mapping[str, Sequence[float]]], nbytes: int, title: str) -> None:
    """GB/s against span size: kvcr and the raw anchor, medians with a p10..p90 band."""
    if not sweep:
        ax.text(0.5, 0.5, "no span sweep in this run\n(--sweep or --plot)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    spans = sorted(sweep)
    for name, label, colour in (("kvcr", "kvcr deliver (client, end to end)", KVCR_COLOUR),
                                ("raw", "raw NIXL WRITE (timed in the writer)", RAW_COLOUR)):
        gbps = [[nbytes / s / 1e9 for s in sweep[span][name]] for span in spans]
        ax.plot(spans, [statistics.median(g) for g in gbps], marker="o", color=colour, label=label)
        ax.fill_between(spans, [_percentile(g, 0.1) for g in gbps], [_percentile(g, 0.9) for g in gbps],
                        color=colour, alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(spans, [f"{s >> 10} KiB" if s < 1 << 20 else f"{s >> 20} MiB" for s in spans])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("span size")
    ax.set_ylabel("GB/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def _finish(fig: Any, plt: Any, path: Path, title: str) -> None:
    load = os.getloadavg()[0]
    fig.suptitle(f"{title}: kvcr (blue) beside its raw anchors (grey), one run; boxes: quartiles, "
                 f"whiskers: p5..p95, medians written; load average {load:.2f}, {os.cpu_count()} CPUs", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_local(k: Mapping[str, Any], path: Path, *, quick: bool = False, object_bytes: int = 64 << 20,
               sweep_bytes: int = 16 << 20) -> None:
    """``bench/local.py``'s figure: control round trips, 64 MiB transfers, throughput by span size."""
    plt = _pyplot()
    s = k["samples"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1, 1.15, 1]})
    distributions(axes[0], [
        ("kvcr query, Client", s.get("query", []), False),
        ("kvcr query, AsyncClient", s.get("query_async", []), False),
        ("raw ZeroMQ msgpack echo", s.get("echo", []), True),
    ], 1e6, "µs", "one-key query round trip")
    distributions(axes[1], [
        ("kvcr deliver, list of spans", s.get("deliver", []), False),
        ("kvcr deliver, prepared", s.get("deliver_prepared", []), False),
        ("raw NIXL WRITE (in the writer)", s.get("raw_write", []), True),
        ("raw NIXL WRITE + trigger", s.get("raw_write_e2e", []), True),
        ("kvcr deposit", s.get("deposit", []), False),
        ("raw NIXL READ (in the reader)", s.get("raw_read", []), True),
    ], 1e3, "ms", f"{object_bytes >> 20} MiB object, 1024 spans of 64 KiB, DRAM to DRAM")
    throughput(axes[2], k.get("sweep", {}), sweep_bytes, f"deliver throughput, {sweep_bytes >> 20} MiB per object")
    _finish(fig, plt, path, f"bench/local.py{' --quick' if quick else ''}")


def plot_remote(k: Mapping[str, Any], r: Mapping[str, Any], path: Path) -> None:
    """``bench/remote.py``'s figure: time to first layer, and whole objects across two nodes."""
    plt = _pyplot()
    s, raw = k["samples"], r["samples"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.2))
    distributions(axes[0], [
        ("kvcr first layer landed", s["first"], False),
        ("kvcr first layer, deferred source", s["first_deferred"], False),
        ("raw NIXL 1 MiB + ZeroMQ trigger", raw["one_span_e2e"], True),
        ("raw NIXL 1 MiB (in the writer)", raw["one_span_xfer"], True),
        ("raw ZeroMQ round trip", raw["rtt"], True),
        *((("kvcr first layer under B's grant", s["grant_first"], False),
           ("raw NIXL READ, first of 32 layers", s["raw_read_first"], True)) if "grant_first" in s else ()),
    ], 1e6, "µs", "time to first layer (32 layers of 1 MiB, one group each)")
    distributions(axes[1], [
        ("kvcr 32 MiB, every layer landed", s["planned_all"], False),
        ("kvcr 32 MiB, no plan", s["whole_layers"], False),
        ("kvcr 64 MiB, list of spans", s["whole_big"], False),
        ("kvcr 64 MiB, prepared", s["whole_big_prepared"], False),
        ("raw NIXL WRITE 64 MiB (in the writer)", raw["whole_xfer"], True),
        *((("kvcr 64 MiB under B's grant", s["grant_whole_big"], False),
           ("raw NIXL READ 64 MiB (consumer)", s["raw_read_whole"], True)) if "grant_whole_big" in s else ()),
    ], 1e3, "ms", "whole objects from node B into a client of node A")
    _finish(fig, plt, path, "bench/remote.py")
