"""transformers with real weights: a prefix's KV cache shared by two engines across two nodes.

Engine A (a process of the engine environment, ``scripts/engines_env.sh``) prefills a
prompt's prefix with SmolLM2-135M, deposits the KV of its full blocks into node B, and
computes the reference: the rest of the prompt and a greedy continuation on its own cache.
Engine B, another process whose client talks to node A, leases the blocks (held at B
through A), gets them delivered layer by layer into a ``KvcrCache`` and computes only the
rest. Its logits are ``torch.equal`` to A's, its tokens the same, and every layer waited
for its own group once. Both nodes end clean. The engines run ``examples/transformers_prefix.py``,
the example docs/engines.md shows.

On one node (``both``: the two engines one after the other in one process) engine B's
lease gets a read grant and its deliver READs the node's pools itself, layer by layer: the
node delivers nothing; with ``--no-client-transfers`` the node grants none and delivers
the blocks. The logits are A's either way.

Outside CI, without the engine environment, the test is skipped and says why; in CI it
must run (``.ci/run`` makes the environment first).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvcr_client import Client
from kvcr_testing.engines import require_engines, run_example
from kvcr_testing.health import assert_clean, outcome_count
from kvcr_testing.nodes import NodeProcess

POOL = "kv:12KiB:4096"
"""One slot per block (16 tokens) of one layer's keys or values: 16 x 3 KV heads x 64 x 4 bytes."""
ENGINE_TIMEOUT_S = 300.0

require_engines()


def engine(*args: str) -> dict[str, object]:
    return run_example("transformers_prefix.py", *args, timeout_s=ENGINE_TIMEOUT_S)


@pytest.mark.timeout(2 * ENGINE_TIMEOUT_S)
def test_two_engines_share_a_prefix_across_two_nodes(node_factory: Callable[..., NodeProcess], tmp_path: Path) -> None:
    node_a = node_factory("--pool", POOL)
    node_b = node_factory("--pool", POOL, "--peer-grants")  # the source trusts A's clients with its pools
    reference = tmp_path / "reference.pt"
    a = engine("deposit", "--node", node_b.endpoint, "--tokens", "200", "--out", str(reference))
    assert a["prefix_tokens"] == 192 and a["blocks"] == 12, a
    b = engine("load", "--node", node_a.endpoint, "--source", node_b.endpoint, "--reference", str(reference))
    assert b["held_blocks"] == 12 and b["prefix_tokens"] == 192, b
    assert b["lease_statuses"] == ["LEASED_REMOTE"], b
    assert b["kv_equal"] is True, b  # the delivered KV is A's, byte for byte
    assert b["logits_equal"] is True and b["tokens_equal"] is True, (a, b)
    assert b["tokens"] == a["tokens"]
    assert b["layer_waits"] == b["layers"] == 30, b  # layer by layer: each layer waited for its own group
    assert b["granted"] is True, b  # keys held at a source are granted through it: the client READs the source itself
    for node in (node_a, node_b):
        with Client(node.endpoint, name="engines-check") as c:
            st = assert_clean(c)
            assert st["leases"]["held"] == 0


@pytest.mark.timeout(ENGINE_TIMEOUT_S)
@pytest.mark.parametrize("grants", [True, False], ids=["grants", "no-client-transfers"])
def test_one_node_reads_under_grants_where_offered(node_factory: Callable[..., NodeProcess], tmp_path: Path,
                                                   grants: bool) -> None:
    node = node_factory("--pool", POOL, *(() if grants else ("--no-client-transfers",)))
    r = engine("both", "--node", node.endpoint, "--tokens", "200", "--out", str(tmp_path / "reference.pt"))
    a, b = r["deposit"], r["load"]
    assert isinstance(a, dict) and isinstance(b, dict), r
    assert a["blocks"] == b["held_blocks"] == 12 and b["lease_statuses"] == ["LEASED"], r
    assert b["granted"] is grants, b
    assert b["kv_equal"] is True and b["logits_equal"] is True and b["tokens_equal"] is True, r
    assert b["layer_waits"] == b["layers"] == 30, b
    with Client(node.endpoint, name="engines-check") as c:
        st = assert_clean(c)
    assert st["leases"]["held"] == 0
    # The node's own record: a grant and no deliver, or no grant and the twelve blocks delivered.
    assert st["leases"].get("read_grants", 0) == int(grants), st["leases"]
    assert outcome_count(st, "deliver.OK") == (0 if grants else 12), st["outcomes"]
