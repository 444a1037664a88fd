"""SGLang's HiCache storage interface against a real kvcr node (``kvcr_client.integrations.sglang``).

SGLang's own storage backend factory creates the backend (the ``dynamic`` backend, as
``--hicache-storage-backend dynamic`` does); pages go in and come back byte for byte,
``batch_exists`` counts the pages held in a row, a page never stored reads as missing, and
the node ends clean. The engine side runs ``examples/sglang_hicache.py`` in the engine
environment (``scripts/engines_env.sh``; skipped outside CI without it).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcr_client import Client
from kvcr_testing.engines import require_engines, run_example
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import NodeProcess

TIMEOUT_S = 120.0

require_engines()


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_hicache_pages_round_trip_byte_exact(node_factory: Callable[..., NodeProcess]) -> None:
    node = node_factory("--pool", "kv:32KiB:256")
    r = run_example("sglang_hicache.py", "--node", node.endpoint, timeout_s=TIMEOUT_S)
    assert r["backend"] == "KvcrHiCacheStorage"
    assert r["batch_set"] is True and r["set"] is True and r["set_again"] is True, r
    assert r["batch_exists_all"] == 91 and r["batch_exists_gap"] == 10 and r["exists_missing"] is False, r
    assert r["batch_get_equal"] is True and r["get_equal"] is True and r["get_missing"] is True, r
    assert r["batch_get_mixed"] == [True, False, True], r
    assert r["stats"] == {"set": 92, "set_failed": 0, "get": 94, "get_missed": 2}, r
    with Client(node.endpoint, name="sglang-check") as c:
        st = assert_clean(c)
        assert st["objects"] == 91
