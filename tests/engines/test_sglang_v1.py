"""SGLang's zero-copy HiCache interface (``batch_set_v1``/``batch_get_v1``) against a real node.

``sglang_v1_driver.py`` (run in the engine environment) gives the backend SGLang's own
page-first ``MHATokenToKVPoolHost``: pages are deposited from the host pool and delivered
into other host pages in place, one span for a page's K and one for its V across every
layer, byte for byte; a page never stored reads False and its memory is untouched, as is
every byte outside the destinations; the node ends clean. The pages come by READs under
the backend's read grant, or from the node with ``--no-client-transfers``, alike. The
driver needs SGLang's import-time extras (``<engine venv>/hicache-extras``, made by ``scripts/engines_env.sh``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcr_client import Client
from kvcr_testing.engines import ENGINE_PY, require_engines, run_script
from kvcr_testing.health import assert_clean, outcome_count
from kvcr_testing.nodes import NodeProcess

TIMEOUT_S = 180.0
DRIVER = Path(__file__).with_name("sglang_v1_driver.py")
EXTRAS = Path(os.environ.get("KVCR_HICACHE_EXTRAS") or ENGINE_PY.parent.parent / "hicache-extras")
SPAN_BYTES = 4 * 16 * 2 * 32 * 4
"""Four layers x a page of 16 tokens x 2 KV heads x head dim 32 x float32: K (or V) of a page."""

require_engines()
if not EXTRAS.is_dir():
    if os.environ.get("CI"):
        pytest.fail(f"CI needs {EXTRAS}: scripts/engines_env.sh makes it", pytrace=False)
    pytest.skip(f"no SGLang import extras at {EXTRAS}: run scripts/engines_env.sh", allow_module_level=True)


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("grants", [True, False], ids=["grants", "no-client-transfers"])
def test_zero_copy_pages_round_trip_byte_exact(node_factory: Callable[..., NodeProcess], grants: bool) -> None:
    node = node_factory("--pool", "kv:16KiB:64", *(() if grants else ("--no-client-transfers",)))
    r = run_script(DRIVER, node.endpoint, timeout_s=TIMEOUT_S)
    assert r["backend"] == "KvcrHiCacheStorage"
    assert r["spans_per_page"] == 2 and r["span_bytes"] == [SPAN_BYTES], r
    assert r["set"] == [True] * 10 and r["set_again"] == [True, True] and r["exists"] == 10, r
    assert r["get"] == [True] * 10 + [False], r
    assert r["pages_equal"] is True and r["layer_views_equal"] is True, r
    assert r["missing_untouched"] is True and r["rest_untouched"] is True, r
    assert r["stats"] == {"set": 12, "set_failed": 0, "get": 10, "get_missed": 1, "get_granted": 10 if grants else 0}, r
    with Client(node.endpoint, name="sglang-check") as c:
        st = assert_clean(c)
    assert st["objects"] == 10
    assert st["leases"].get("read_grants", 0) == int(grants), st["leases"]
    assert outcome_count(st, "deliver.OK") == (0 if grants else 10), st["outcomes"]
