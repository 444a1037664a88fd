"""vLLM with ``KvcrConnector``: requests that differ only in a ``cache_salt`` or a LoRA adapter
never load each other's blocks (issue 39), while identical requests do.

``vllm_isolation_driver.py`` (run in the vLLM environment, the engine in its process: the
tiny Llama of ``examples/vllm_prefix.py`` with LoRA on and two seeded adapters of its K and
V projections) generates one prompt five ways (plain, two cache salts, two adapters), twice.
Block keys come from vLLM's own block hashes, which fold in the adapter and the salt
(docs/architecture.md section 5, "Engine block keys"), so on the first pass each finds
nothing to load though the node holds the same tokens' blocks under the others' keys, and
saves three blocks of its own; on the second each loads exactly its own three (the worker's
digests: the bytes it saved), to its first pass's tokens and logprobs. The adapters' logprobs
differ from the plain model's and from each other's, so a load across them would be wrong,
and the check can fail: with keys over the tokens alone (``vllm_faults.ExtrasBlind``) every
variant loads the plain request's blocks, and an adapter that does generates other logprobs
than its own. Multimodal inputs are covered at the scheduler side with vLLM's own requests
(``test_vllm_scheduler.py``): the tiny model has no vision tower.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_testing.engines import VLLM_PY, require_engines, run_script
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import NodeProcess

TIMEOUT_S = 300.0
DRIVER = Path(__file__).with_name("vllm_isolation_driver.py")
POOL = "kv:16KiB:1024"
"""One slot per layer block: 32 tokens x 2 KV heads x 32 x K and V x 4 bytes."""
VARIANTS = ("plain", "salt_alpha", "salt_beta", "lora_1", "lora_2")
SAVED = {"saves": 1, "blocks_saved": 3}
"""A generation that loaded nothing: the 100-token prompt's three full blocks computed and saved."""
LOADED = {"leases": 1, "matched_tokens": 96, "loads": 1, "grant_loads": 1, "layer_waits": 4, "blocks_loaded": 3}
"""A generation that loaded the three blocks (READ under the worker's grant), a wait per layer."""

require_engines(VLLM_PY)


def isolation(node: NodeProcess, connector: str | None = None) -> list[dict[str, Any]]:
    r = run_script(DRIVER, node.endpoint, *([connector] if connector else []), timeout_s=TIMEOUT_S, python=VLLM_PY)
    passes: list[dict[str, Any]] = r["passes"]
    assert len(passes) == 2 and all(list(p) == list(VARIANTS) for p in passes), r
    return passes


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_requests_differing_in_salt_or_adapter_never_share_blocks(node_factory: Callable[..., NodeProcess]) -> None:
    node = node_factory("--pool", POOL)
    first, second = isolation(node)
    saved = {name: set(g["saved_keys"]) for name, g in first.items()}
    for name, g in first.items():
        assert g["counts"] == SAVED, (name, g["counts"])  # nothing leased or loaded: the others' blocks are no hit
        assert len(saved[name]) == 3, (name, g)
    assert len(set().union(*saved.values())) == 3 * len(VARIANTS), saved  # no key shared between variants
    for name, g in second.items():
        assert g["counts"] == LOADED, (name, g["counts"])
        assert set(g["loaded_keys"]) == saved[name] and g["loaded_match_saved"] is True, (name, g)
        assert g["tokens"] == first[name]["tokens"] and g["logprobs"] == first[name]["logprobs"], name
    # A salt changes nothing the model computes; an adapter does (so a load across adapters would be wrong).
    assert first["salt_alpha"]["logprobs"] == first["salt_beta"]["logprobs"] == first["plain"]["logprobs"]
    lora_logprobs = [first[name]["logprobs"] for name in ("plain", "lora_1", "lora_2")]
    assert all(lora_logprobs.count(lp) == 1 for lp in lora_logprobs), "the adapters change nothing"
    with Client(node.endpoint, name="vllm-check") as c:
        st = assert_clean(c)
    assert st["leases"]["held"] == 0 and st["objects"] == 3 * len(VARIANTS), st

    # The check can fail: keys over the tokens alone share the plain request's blocks with
    # every variant, and an adapter run on the plain model's KV generates something else.
    blind_node = node_factory("--pool", POOL)
    blind, _ = isolation(blind_node, "vllm_faults.ExtrasBlind")
    assert blind["plain"]["counts"] == SAVED, blind["plain"]
    for name in VARIANTS[1:]:
        assert blind[name]["counts"] == LOADED, (name, blind[name]["counts"])
        assert set(blind[name]["loaded_keys"]) == set(blind["plain"]["saved_keys"]), name
    assert blind["lora_1"]["logprobs"] != first["lora_1"]["logprobs"], "a load across adapters changed nothing"
