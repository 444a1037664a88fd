"""The documentation site builds with ``mkdocs build --strict``: no broken link or anchor, no
page left out of the navigation, and no page naming a metric, TOML key or ``kvcr-node`` flag
the code does not have (``scripts/docs_hooks.py``, which also makes the configuration and
metrics references from the code).

MkDocs is in the optional dependency group ``docs`` (``uv sync --group docs``); outside CI,
without it, the test is skipped, saying why; in CI it must run (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).parent / "mkdocs"
BUILD_S = 300.0


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    if not MKDOCS.exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI needs MkDocs at {MKDOCS}: .ci/run installs the docs group", pytrace=False)
        pytest.skip(f"no MkDocs at {MKDOCS}: uv sync --group docs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BUILD_S, check=False)


@pytest.mark.timeout(2 * BUILD_S)
def test_the_site_builds_strict_with_references_made_from_the_code(tmp_path: Path) -> None:
    done = build(tmp_path / "site")
    assert done.returncode == 0, done.stderr
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "protocol/index.html", "reference/configuration/index.html",
            "reference/metrics/index.html", "node/index.html", "engines/index.html"} <= pages, sorted(pages)
    config = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "disk_demote_mark" in config and "--disk-demote-mark" in config
    metrics = (tmp_path / "site" / "reference" / "metrics" / "index.html").read_text()
    assert "kvcr_disk_tier_transfer_seconds" in metrics and "kvcr_metrics_connections_dropped_total" in metrics


@pytest.mark.timeout(2 * BUILD_S)
def test_a_page_naming_what_the_code_lacks_fails_the_build(tmp_path: Path) -> None:
    """A copy of the docs with one misspelt metric, TOML key, flag and link: each is named, and the build fails."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    with (docs / "node.md").open("a") as page:
        page.write("\n`kvcr_pool_usedd_bytes`\n\n```toml\nmax_peerz = 3\n```\n\n```sh\nkvcr-node --max-peerz 3\n```\n\n"
                   "[gone](nowhere.md)\n")
    config = tmp_path / "mkdocs.yml"
    text = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    config.write_text(text.replace("  - scripts/docs_hooks.py", f"  - {ROOT / 'scripts' / 'docs_hooks.py'}"))
    done = build(tmp_path / "site", config)
    assert done.returncode != 0
    for named in ("kvcr_pool_usedd_bytes", "max_peerz", "--max-peerz", "nowhere.md"):
        assert named in done.stderr, (named, done.stderr)
