"""A request cannot choose what the node dials, nor crash or stall vLLM's scheduler (audit rows 1, 2).

``kv_transfer_params`` are fields of an OpenAI API request's body. ``vllm_sources_driver.py``
(run in the vLLM environment) drives vLLM's own ``Scheduler`` with the requests an attacker
would send: ``{"kvcr_endpoint": "http://127.0.0.1/"}`` (which once raised out of
``schedule()`` and left the engine raising on every step), huge strings, wrong types, the
ipc path and loopback port of listeners that never answer, and node C, which holds every one
of their prompts' blocks but is not in ``allowed_sources``. Each is a miss with no exception
and no dial: the listeners' backlogs stay empty, C never sees a peer session and its blocks
are not matched, and the connector counts each refusal. Beside them, a request naming the
allowed node B still matches its blocks there (with a request id too long for the protocol,
too), one naming A itself in another spelling matches on A, and an innocent one is served.

With the default ``lookup_wait_s``, a request whose allowed source is frozen (connects, never answers)
is answered "not yet" and then a miss after ``lookup_timeout_s``; the innocent request
beside it is admitted with its blocks meanwhile, and no ``schedule()`` call waits longer
than a generous bound (the figures are printed). The worker side, handed metadata that names
sources not allowed or does not add up, raises nothing: those blocks are reported failed (so
vLLM recomputes them) and an allowed load lands byte-exact. Every node ends clean.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_testing.engines import VLLM_PY, require_engines, run_script
from kvcr_testing.health import assert_clean, stats
from kvcr_testing.nodes import short_ipc_dir, start_node

TIMEOUT_S = 400.0
DRIVER = Path(__file__).with_name("vllm_sources_driver.py")
MATCHED = 96
"""Three full blocks of 32 of a 100-token prompt (its last token is always computed)."""
SCHEDULE_BOUND_S = 2.0
"""Generous: the longest one ``schedule()`` may take while a lookup is in flight (the default
``lookup_wait_s`` is 0.02 s; the audit saw 2 s per call)."""

require_engines(VLLM_PY)


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


@pytest.fixture(scope="module")
def report() -> Iterator[Any]:
    """One driver run against nodes A (the engine's), B (allowed) and C (not allowed); each
    node is checked clean after it."""
    with short_ipc_dir("vsrc") as folder:
        nodes = [start_node(f"ipc://{folder}/{name}.sock", "--pool", "kv:16KiB:256") for name in "abc"]
        try:
            a, b, c = nodes
            r = run_script(DRIVER, a.endpoint, b.endpoint, c.endpoint, timeout_s=TIMEOUT_S, python=VLLM_PY)
            after = {}
            for node in nodes:
                with Client(node.endpoint, name="vllm-check") as client:
                    assert_clean(client)
                    after[node.endpoint] = stats(client)
            yield r, nodes, after
        finally:
            for node in nodes:
                node.stop()


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_hostile_params_are_misses_without_a_dial(report: Any) -> None:
    r, (a, b, c), after = report
    assert r["unfinished"] is False, r["admitted"]
    hostile = r["hostile"]
    assert len(hostile) == 13
    # Every hostile request was scheduled (schedule() kept working), computing its whole prompt.
    assert {label: r["admitted"].get(label) for label in hostile} == dict.fromkeys(hostile, 0), r["admitted"]
    assert not any(label in r["loads"] for label in hostile), r["loads"]
    # The requests beside them: B through the allow-list (as the operator spelled it), A itself, A's own blocks.
    for label in ("allowed", "allowed_long_id", "own_spelling", "innocent"):
        assert r["admitted"][label] == MATCHED, (label, r["admitted"])
    # A remote lease is not in when its first call returns (lookup_wait_s 0 here): "not yet", then the count.
    assert r["not_yet"].get("allowed", 0) >= 1 and r["not_yet"].get("allowed_long_id", 0) >= 1, r["not_yet"]
    assert r["loads"]["allowed"] == [{"source": b.endpoint, "blocks": 3}], r["loads"]
    assert r["loads"]["allowed_long_id"] == [{"source": b.endpoint, "blocks": 3}], r["loads"]
    assert r["loads"]["own_spelling"] == [{"source": None, "blocks": 3}], r["loads"]
    assert all(params == {"kvcr_endpoint": a.endpoint} for params in r["finished"].values()), r["finished"]
    # One refusal counted per hostile request, one lease per request that matched, nothing else failed.
    assert nonzero(r["stats"]) == {"sources_refused": 13, "leases": 4, "matched_tokens": 4 * MATCHED}, r["stats"]
    # Nothing was dialled: the silent listeners' backlogs are empty, C never had a peer session, A
    # has links to B and the frozen source of the other run only, and C's blocks were never
    # leased or delivered.
    assert r["silent_ipc_connections"] == 0 and r["silent_tcp_connections"] == 0, r
    st_a, st_c = after[a.endpoint], after[c.endpoint]
    assert st_c["peer_sessions"] == 0 and st_c["tables"]["peer_clients"] == 0, st_c
    assert not any(k.startswith("deliver.") or k.startswith("lease.") for k, v in st_c["outcomes"].items() if v), st_c
    assert set(st_a["peers"]) == {b.endpoint, r["frozen"]["endpoint"]}, st_a["peers"]


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_frozen_source_costs_only_its_own_request(report: Any) -> None:
    r = report[0]["frozen"]
    assert r["unfinished"] is False, r
    assert r["admitted"] == {"frozen": 0, "innocent": MATCHED}, r["admitted"]
    # The innocent request is admitted while the frozen one is "not yet".
    assert r["admitted_at"]["innocent"] < r["admitted_at"]["frozen"], r["admitted_at"]
    assert r["not_yet"]["frozen"] >= 1, r["not_yet"]  # "not yet" until lookup_timeout_s, then the miss
    assert nonzero(r["stats"]) == {"lookups_timed_out": 1, "leases": 1, "matched_tokens": MATCHED}, r["stats"]
    assert r["frozen_connections"] >= 1, r  # allowed, so dialled: the listener saw it
    times = r["schedule_s"]
    assert max(times) < SCHEDULE_BOUND_S, times
    print(f"\nfrozen allowed source, lookup_timeout_s={r['lookup_timeout_s']} lookup_wait_s={r['lookup_wait_s']}: "
          f"{r['steps']} schedule() calls until both requests finished in {r['wall_s']:.3f} s; "
          f"schedule() median {statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms")


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_worker_side_never_raises_and_loads_what_is_allowed(report: Any) -> None:
    w = report[0]["worker"]
    # Refused sources (a URL, a silent listener, node C) and metadata that does not add up:
    # their blocks are reported failed, for vLLM to recompute; the allowed load is exact.
    assert w["failed"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], w
    assert w["byte_exact"] is True, w
    assert nonzero(w["stats"]) == {"sources_refused": 3, "load_errors": 4, "loads": 1, "layer_waits": 4,
                                   "blocks_loaded": 3, "blocks_failed": 10}, w["stats"]
    assert w["silent_connections"] == 0, w


def test_schedule_times_are_reported(report: Any) -> None:
    """The main run's ``schedule()`` times, beside the hostile requests (for the record)."""
    times = report[0]["schedule_s"]
    assert max(times) < SCHEDULE_BOUND_S, times
    print(f"\nhostile run: {len(times)} schedule() calls, median {statistics.median(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms")

