"""SGLang's HiCache storage interface against a real kvcr node (``kvcr_client.integrations.sglang``).

SGLang's own storage backend factory creates the backend (the ``dynamic`` backend, as
``--hicache-storage-backend dynamic`` does); pages go in and come back byte for byte,
``batch_exists`` counts the pages held in a row, a page never stored reads as missing, and
the node ends clean. Each get READs its pages under a read grant of the backend's own
lease (the node delivers only what it does not hold: nothing), or, with
``--no-client-transfers``, the node delivers them all: the bytes are the same. The engine
side runs ``examples/sglang_hicache.py`` in the engine environment
(``scripts/engines_env.sh``; skipped outside CI without it).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcr_client import Client
from kvcr_testing.engines import require_engines, run_example
from kvcr_testing.health import assert_clean, outcome_count
from kvcr_testing.nodes import NodeProcess

TIMEOUT_S = 120.0

require_engines()


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("grants", [True, False], ids=["grants", "no-client-transfers"])
def test_hicache_pages_round_trip_byte_exact(node_factory: Callable[..., NodeProcess], grants: bool) -> None:
    node = node_factory("--pool", "kv:32KiB:256", *(() if grants else ("--no-client-transfers",)))
    r = run_example("sglang_hicache.py", "--node", node.endpoint, timeout_s=TIMEOUT_S)
    assert r["backend"] == "KvcrHiCacheStorage"
    assert r["batch_set"] is True and r["set"] is True and r["set_again"] is True, r
    assert r["batch_exists_all"] == 91 and r["batch_exists_gap"] == 10 and r["exists_missing"] is False, r
    assert r["batch_get_equal"] is True and r["get_equal"] is True and r["get_missing"] is True, r
    assert r["batch_get_mixed"] == [True, False, True], r
    assert r["stats"] == {"set": 92, "set_failed": 0, "get": 94, "get_missed": 2, "get_granted": 94 if grants else 0}, r
    with Client(node.endpoint, name="sglang-check") as c:
        st = assert_clean(c)
        assert st["objects"] == 91
    # The node's own record: five granted leases (three batch chunks, a get, the mixed batch)
    # and no page delivered, or no grant and every page delivered by the node.
    assert st["leases"].get("read_grants", 0) == (5 if grants else 0), st["leases"]
    assert outcome_count(st, "deliver.OK") == (0 if grants else 94), st["outcomes"]
