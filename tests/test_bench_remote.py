"""``bench/remote.py``'s figures from a synthetic result: every ``--json`` key, the granted
ones against their raw READ anchors of the same run. No timing is measured (performance
lives in bench/, not in tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import remote  # noqa: E402
from stats import summary  # noqa: E402

KVCR_MS = {"first": 3.2, "planned_all": 18.0, "whole_big": 24.0, "grant_first": 0.26, "grant_planned_all": 6.0,
           "grant_whole_big": 10.5, "raw_read_first": 0.2, "raw_read_layers": 5.0, "raw_read_hot": 0.1,
           "raw_read_whole": 10.0, "raw_node_first": 0.21}
"""The raw READ anchors of reads under grants run rep by rep beside kvcr's: they are in its samples."""
RAW_MS = {"one_span_xfer": 0.1, "rtt": 0.2, "whole_xfer": 12.0}


def summaries(ms: dict[str, float]) -> dict[str, dict[str, float]]:
    return {name: summary([value / 1e3] * 5) for name, value in ms.items()}


def test_every_figure_is_named_and_the_granted_ones_meet_their_anchors() -> None:
    figures = remote.ratios(summaries(KVCR_MS), summaries(RAW_MS))
    assert set(figures) == {"ttfl_ratio", "first_layer_fraction", "remote_deliver_ratio", "grant_ttfl_ratio",
                            "grant_first_layer_fraction", "grant_remote_deliver_ratio", "grant_first_spread",
                            "grant_whole_big_spread", "grant_ttfl_ratio_hot", "grant_ttfl_ratio_node",
                            "grant_planned_vs_raw"}
    assert figures["ttfl_ratio"] == pytest.approx(3.2 / 0.3)
    assert figures["grant_ttfl_ratio"] == pytest.approx(0.26 / 0.2)
    assert figures["grant_ttfl_ratio_hot"] == pytest.approx(0.26 / 0.1)
    assert figures["grant_ttfl_ratio_node"] == pytest.approx(0.26 / 0.21)
    assert figures["grant_planned_vs_raw"] == pytest.approx(6.0 / 5.0)
    assert figures["grant_first_layer_fraction"] == pytest.approx(0.26 / 6.0)
    assert figures["grant_remote_deliver_ratio"] == pytest.approx(10.0 / 10.5)
    assert figures["grant_first_spread"] == 0.0


def test_the_plot_has_what_the_bench_measures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    k = {"samples": {name: [ms / 1e3] * 5 for name, ms in {**KVCR_MS, "first_deferred": 3.5, "whole_layers": 12.0,
                                                           "whole_big_prepared": 23.0}.items()}}
    r = {"samples": {name: [ms / 1e3] * 5 for name, ms in {**RAW_MS, "one_span_e2e": 0.3}.items()}}
    import plots

    path = tmp_path / "remote.png"
    plots.plot_remote(k, r, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
