"""``KvcrConnector`` is a facade: the role vLLM builds it for decides its one side.

``vllm_roles_driver.py`` (run in the vLLM environment) builds the connector as vLLM's
scheduler does and as a worker does: each holds its own side only (``KvcrScheduler`` or
``KvcrWorker``) and refuses the other side's calls by name. A ``block_observer`` that is not a
``BlockObserver`` subclass one can make is refused with an error naming the key before any
session opens; an observer that raises on every block changes no load or save: the
blocks land byte-exact, nothing is reported failed, the counts are those of a clean step
(the load READ under the worker's read grant). A worker whose read lease ends mid-read
reports every block of the load failed, for vLLM to recompute: none counts as loaded.
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
DRIVER = Path(__file__).with_name("vllm_roles_driver.py")

require_engines(VLLM_PY)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_each_role_builds_its_side_and_the_observer_is_checked(node_factory: Callable[..., NodeProcess]) -> None:
    node = node_factory("--pool", "kv:16KiB:256")
    r = run_script(DRIVER, node.endpoint, timeout_s=TIMEOUT_S, python=VLLM_PY)
    assert r["scheduler_sides"] == ["KvcrScheduler", "NoneType"] and r["is_scheduler"], r
    assert r["worker_sides"] == ["NoneType", "KvcrWorker"] and r["is_worker"], r
    assert "scheduler-side call on the worker side" in r["worker_refuses"], r
    assert "worker-side call on the scheduler side" in r["scheduler_refuses"], r
    for label, error in r["bad_observers"].items():
        assert error is not None and "block_observer" in error, (label, error)
    assert "is not a BlockObserver subclass" in r["bad_observers"]["a_callable"], r
    assert r["threads_after_bad"] == 0, r
    assert r["failed"] == [] and r["byte_exact"] is True, r
    assert r["observer_calls"] == 3 + 2, r  # three blocks loaded, two saved: each call raised
    stats = r["stats"]
    assert {name: stats[name] for name in ("loads", "grant_loads", "layer_waits", "blocks_loaded", "load_errors",
                                           "blocks_failed", "saves", "blocks_saved", "save_errors")} == {
        "loads": 1, "grant_loads": 1, "layer_waits": 4, "blocks_loaded": 3, "load_errors": 0, "blocks_failed": 0,
        "saves": 1, "blocks_saved": 2, "save_errors": 0}, stats
    lost = r["lease_lost"]
    assert lost["failed"] == [20, 21, 22] and lost["refused"] == 3, lost  # LEASE_LOST, never shown as loaded
    assert {name: lost["stats"][name] for name in ("loads", "grant_loads", "blocks_loaded", "blocks_failed")} == {
        "loads": 1, "grant_loads": 1, "blocks_loaded": 0, "blocks_failed": 3}, lost
    with Client(node.endpoint, name="vllm-roles-check") as c:
        assert_clean(c)
