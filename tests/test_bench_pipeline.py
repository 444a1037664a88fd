"""``bench/pipeline.py``'s figures from a synthetic result: the raw anchor of each run is its
fastest raw progressive form, and ``--json`` names every run's ratio. No timing is measured
(performance lives in bench/, not in tests)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import pipeline  # noqa: E402
from stats import summary  # noqa: E402


def run(ms: dict[str, float], granted: bool = True) -> dict[str, Any]:
    """One run's summaries of constant samples of ``ms`` milliseconds per form, and its ratios."""
    s = {name: summary([value / 1e3] * 5) for name, value in ms.items()}
    return {**s, **pipeline.ratios(s), "granted": granted}


FORMS = {"progressive": 30.0, "whole": 24.0, "raw_thread": 22.0, "raw_posted": 20.0, "raw_whole": 21.0}


def test_the_anchor_is_the_fastest_raw_form() -> None:
    r = run(FORMS)
    assert r["raw"] == "raw_posted"
    assert r["vs_raw"] == pytest.approx(30.0 / 20.0)
    assert r["speedup"] == pytest.approx(24.0 / 30.0)
    assert r["raw_speedup"] == pytest.approx(21.0 / 20.0)
    assert run({**FORMS, "raw_thread": 15.0})["raw"] == "raw_thread"


def test_json_figures_name_each_run() -> None:
    results = {"across nodes": run(FORMS), "local, by the node": run({**FORMS, "progressive": 40.0}),
               "across nodes, under a read grant": run({**FORMS, "progressive": 22.0}, granted=True),
               "local, under a read grant": run({**FORMS, "progressive": 21.0, "whole": 21.0}, granted=False)}
    figures = pipeline.figures(results)
    assert figures["pipeline_vs_raw"] == pytest.approx(1.5)
    assert figures["pipeline_vs_raw_local_node"] == pytest.approx(2.0)
    assert figures["pipeline_vs_raw_local"] == pytest.approx(21.0 / 20.0)
    assert figures["overlap_speedup"] == pytest.approx(0.8)
    assert figures["grant_overlap_speedup"] == pytest.approx(1.0)
    assert figures["raw_overlap_speedup"] == pytest.approx(21.0 / 20.0)
    assert figures["grant_used"] == 0.0
    assert figures["grant_used_remote"] == 1.0
    assert figures["pipeline_vs_raw_grant"] == pytest.approx(22.0 / 20.0)
    assert figures["grant_overlap_speedup_remote"] == pytest.approx(24.0 / 22.0)
    assert figures["raw_progressive_ms_local"] == pytest.approx(20.0)
    assert figures["progressive_spread"] == 0.0


def test_json_figures_with_digests_off_and_on() -> None:
    results = {"across nodes": run(FORMS), "local, by the node": run(FORMS),
               "across nodes, under a read grant": run(FORMS),
               "local, under a read grant": run({**FORMS, "progressive": 24.0}),
               pipeline.NO_DIGESTS: run({**FORMS, "progressive": 22.0})}
    figures = pipeline.figures(results)
    assert figures["pipeline_digest_cost"] == pytest.approx(24.0 / 22.0)
    assert figures["pipeline_vs_raw_local"] == pytest.approx(24.0 / 20.0)
    assert figures["pipeline_vs_raw_local_nodigest"] == pytest.approx(22.0 / 20.0)
    assert figures["grant_used_nodigest"] == 1.0
    del results[pipeline.NO_DIGESTS]
    assert "pipeline_digest_cost" not in pipeline.figures(results)
