"""Tensor-parallel ranks each store and load their own KV slice; evicted blocks are saved again.

``vllm_ranks_driver.py`` (run in the vLLM environment) drives vLLM's own ``Scheduler``
configured for tensor parallel 2 and the worker sides of ranks 0 and 1 in one process, each
rank's cache with bytes of its own. The scheduler leases every rank's slice of each block
and a block is a hit only when all are held; each rank deposits and loads its slice under
a key of its own, so that each loads, byte for byte (by digest), what the same rank saved,
never the other rank's. The pool slot is one layer's block of one rank (half a block's KV
here). On a node whose pool holds three blocks' slices, a prompt evicted by another is
saved again when it comes back (the scheduler skips only what the node holds), and loaded
the time after.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvcr_client import Client
from kvcr_testing.engines import VLLM_PY, require_engines, run_script
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import NodeProcess

TIMEOUT_S = 300.0
DRIVER = Path(__file__).with_name("vllm_ranks_driver.py")
SLOT = "8KiB"
"""One layer's block of one rank: 32 tokens x 1 of 2 KV heads x 32 x K and V x 4 bytes."""

require_engines(VLLM_PY)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_each_rank_loads_its_own_slice_and_evicted_blocks_are_saved_again(
    node_factory: Callable[..., NodeProcess],
) -> None:
    node = node_factory("--pool", f"kv:{SLOT}:256")
    # Three blocks x two ranks x four layers fill 24 slots: a second prompt's evict most of the first's;
    # one session's lease may hold all of a prompt's.
    small = node_factory("--pool", f"kv:{SLOT}:32", "--lease-pool-fraction", "1", "--lease-session-fraction", "1")
    r = run_script(DRIVER, node.endpoint, small.endpoint, timeout_s=TIMEOUT_S, python=VLLM_PY)
    ranks = r["ranks"]
    assert ranks["tp_size"] == 2 and "num_kv_heads=1" in ranks["kv_layout"], ranks
    save, load = ranks["save"], ranks["load"]
    assert save["unfinished"] is False and load["unfinished"] is False, ranks
    assert save["matched"] == 0 and all(len(s) == 3 for s in save["saved"]), save
    assert save["saved"][0].keys() == save["saved"][1].keys()
    assert all(save["saved"][0][k] != save["saved"][1][k] for k in save["saved"][0]), save  # the ranks' bytes differ
    assert load["matched"] == 96 and load["failed"] == [[], []], load
    assert load["loaded"] == save["saved"], (load["loaded"], save["saved"])  # each rank its own slice, byte-exact
    assert all(s == {} for s in load["saved"]), load
    # Rank 0's slice alone of block 1: block 0 is the hit, block 1 a miss, and so block 2.
    assert ranks["partial"] == 32, ranks
    assert ranks["rank1_only"] == 0, ranks
    for stats in ranks["stats"]:  # each rank: the prompt's three blocks, then the partial prompt's first
        assert {k: stats[k] for k in ("loads", "blocks_loaded", "load_errors", "blocks_failed", "save_errors")} == {
            "loads": 2,
            "blocks_loaded": 4,
            "load_errors": 0,
            "blocks_failed": 0,
            "save_errors": 0,
        }, stats

    first, other, again, last = r["evict"]["runs"]
    assert first["matched"] == 0 and [len(s) for s in first["saved"]] == [3, 3], first
    assert other["matched"] == 0 and [len(s) for s in other["saved"]] == [3, 3], other  # evicts most of the first
    assert again["matched"] == 0 and [len(s) for s in again["saved"]] == [3, 3], again  # saved again
    assert last["matched"] == 96 and last["loaded"] == again["saved"] and last["failed"] == [[], []], last
    for stats in r["evict"]["stats"]:
        assert stats["blocks_saved"] == 9 and stats["save_errors"] == 0 and stats["blocks_loaded"] == 3, stats
    for n in (node, small):
        with Client(n.endpoint, name="vllm-ranks-check") as c:
            st = assert_clean(c)
        assert st["leases"]["held"] == 0
