"""vLLM's own ``Scheduler`` drives ``KvcrConnector``'s scheduler side, outside the engine.

``vllm_scheduler_driver.py`` (run in the vLLM environment) builds a real ``Scheduler`` from
``EngineArgs`` and a KV cache config, with the connector loaded by vLLM's factory, and
steps it with made-up model outputs. Checked here against vLLM's own allocation: the
tokens the lease matched become the request's computed tokens; ``update_state_after_alloc``
puts the leased keys in the request's first allocated blocks, in order; the metadata saves
the full blocks each step computes (every chunk of a chunked prefill, in the blocks vLLM
allocated for it); ``request_finished`` names this node in ``kv_transfer_params``; the
scheduler-side stats reach ``SchedulerStats`` and vLLM's connector-stats logger sums them;
the node ends with no lease held.
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
DRIVER = Path(__file__).with_name("vllm_scheduler_driver.py")

require_engines(VLLM_PY)


def entry(request: str, keys: list[str], block_ids: list[int]) -> dict[str, Any]:
    return {"request": request, "keys": keys, "block_ids": block_ids, "source": None}


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_scheduler_drives_the_connector(node_factory: Callable[..., NodeProcess]) -> None:
    node = node_factory("--pool", "kv:16KiB:256")
    r = run_script(DRIVER, node.endpoint, timeout_s=TIMEOUT_S, python=VLLM_PY)
    steps, loaded, chunked = r["steps"], r["loaded_keys"], r["chunked_keys"]
    assert r["unfinished"] is False and len(steps) == 6, steps

    # 100 tokens, two blocks in the node: 64 tokens matched, 36 computed in one step.
    first = steps[0]
    assert first["new"] == {"loaded": {"num_computed_tokens": 64}}, first
    assert first["scheduled"] == {"loaded": 36}
    blocks = first["block_ids"]["loaded"]
    assert first["loads"] == [entry("loaded", loaded[:2], blocks[:2])]
    assert first["saves"] == [entry("loaded", loaded[2:3], blocks[2:3])]  # the third block, computed here
    assert first["kv_connector_stats"] is not None
    assert {k: v for k, v in first["kv_connector_stats"].items() if v} == {"leases": 1, "matched_tokens": 64}
    # A decode step, then the end: the node that served it is named for a decode engine elsewhere.
    assert steps[1]["loads"] == steps[1]["saves"] == []
    assert steps[1]["finished"] == {"loaded": {"kvcr_endpoint": node.endpoint}}

    # 200 new tokens at 64 a step: each chunk's two full blocks saved where vLLM put them.
    for i, s in enumerate(steps[2:5]):
        assert s["scheduled"] == {"chunked": 64}, s
        ids = s["block_ids"]["chunked"][2 * i : 2 * i + 2]
        assert s["loads"] == [] and s["saves"] == [entry("chunked", chunked[2 * i : 2 * i + 2], ids)], s
    last = steps[5]
    assert last["scheduled"] == {"chunked": 8} and last["saves"] == [], last
    assert last["finished"] == {"chunked": {"kvcr_endpoint": node.endpoint}}
    assert all(s["kv_connector_stats"] is None for s in steps[1:])  # nothing more leased
    # vLLM's own connector-stats logger, fed that step's stats twice, sums them.
    assert len(r["logged"]) == 1 and "leases=2" in r["logged"][0] and "matched_tokens=128" in r["logged"][0], r

    with Client(node.endpoint, name="vllm-check") as c:
        st = assert_clean(c)
    assert st["leases"]["held"] == 0 and st["objects"] == 2
