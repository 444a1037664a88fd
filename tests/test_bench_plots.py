"""The benchmarks' plots and progress (``bench/plots.py``, ``bench/stats.py``) on a small synthetic
result: a valid PNG is written, matplotlib is loaded only when plotting, progress goes to stderr.
No timing is asserted (performance lives in bench/, not in tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import plots  # noqa: E402
from stats import Progress  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic(sweep: bool = True) -> dict[str, Any]:
    rng = np.random.default_rng(7)

    def times(median_s: float, n: int = 40) -> list[float]:
        return list(median_s * rng.lognormal(0.0, 0.15, n))

    samples = {
        "query": times(120e-6), "query_async": times(130e-6), "echo": times(80e-6),
        "deliver": times(12e-3), "deliver_prepared": times(11e-3), "deposit": times(13e-3),
        "raw_write": times(10e-3), "raw_write_e2e": times(11e-3), "raw_write_merged": times(9e-3), "raw_read": times(10e-3),
    }
    spans = (4 << 10, 64 << 10, 1 << 20)
    return {"samples": samples,
            "sweep": {s: {"kvcr": times(16e6 / (2e9 * (i + 1))), "raw": times(16e6 / 8e9)} for i, s in enumerate(spans)}
            if sweep else {}}


@pytest.mark.parametrize("sweep", [True, False])
def test_plot_local_writes_a_png(tmp_path: Path, sweep: bool) -> None:
    import matplotlib.image

    path = tmp_path / "local.png"
    plots.plot_local(synthetic(sweep), path, quick=True)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) < 300_000
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (1600, 460)


def test_plot_remote_writes_a_png(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)

    def times(median_s: float) -> list[float]:
        return list(median_s * rng.lognormal(0.0, 0.2, 20))

    k = {"samples": {"first": times(1.3e-3), "first_deferred": times(1.5e-3), "planned_all": times(6e-3),
                     "whole_layers": times(3.5e-3), "whole_big": times(9.7e-3), "whole_big_prepared": times(9.5e-3)}}
    r = {"samples": {"one_span_e2e": times(2e-4), "one_span_xfer": times(1e-4), "rtt": times(8e-5),
                     "whole_xfer": times(19e-3)}}
    path = tmp_path / "remote.png"
    plots.plot_remote(k, r, path)
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_matplotlib_is_loaded_only_to_plot() -> None:
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import plots, stats; print('matplotlib' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "False"


def test_progress_goes_to_stderr_only(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("demo", 2)
    progress.step("first")
    progress.TICK_S = 0.0
    progress.tick("items", 3, 10)
    progress.step("second")
    Progress("quiet", 1, enabled=False).step("nothing")
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["step 1/2: first", "  items 3/10", "step 2/2: second"]
