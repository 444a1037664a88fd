"""The read leases engine integrations take where they load (``ReadLeases``), against real nodes.

Where the node grants reads, each load's lease grants the keys the node holds (not the one
it lacks) and the deliver READs them with the client's own agent, byte for byte: the node
delivers nothing. Where it grants none (``--no-client-transfers``) the first lease says so
and later loads ask none; a session below version 5 asks none at all: the node delivers,
byte for byte. A lease ended before the load fails nothing: the node delivers instead. The
node ends clean, with no lease held.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcr_client import Client, Span
from kvcr_client.integrations.readleases import ReadLeases
from kvcr_testing.health import assert_clean, outcome_count, stats
from kvcr_testing.layouts import RESULT_TIMEOUT_S
from kvcr_testing.nodes import running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
KEYS = [b"rl-a", b"rl-b"]
MISSING = b"rl-never-stored"
LOADS = 2


@pytest.mark.parametrize("how", ["grants", "client_transfers off", "version 4"])
def test_loads_read_under_grants_where_the_node_offers_them(how: str) -> None:
    args = ("--pool", "kv:4KiB:16", *(("--no-client-transfers",) if how == "client_transfers off" else ()))
    with (
        short_ipc_dir("rdl") as d,
        running_node(d, "n", *args) as node,
        Client(
            node.endpoint,
            name="test-readleases",
            max_version=4 if how == "version 4" else 5,
        ) as c,
    ):
        src = pattern(len(KEYS) * 2 * SLOT, 11)
        r = c.register(src)
        stored = {
            k: [Span("k", r, (2 * i) * SLOT, SLOT, "kv"), Span("v", r, (2 * i + 1) * SLOT, SLOT, "kv")]
            for i, k in enumerate(KEYS)
        }
        assert c.deposit(stored).result(RESULT_TIMEOUT_S).all_ok
        dst = np.zeros_like(src)
        rd = c.register(dst)
        objects = {k: [Span(s.name, rd, s.offset, s.length) for s in spans] for k, spans in stored.items()}
        reads = ReadLeases(c)
        asked = []
        for _ in range(LOADS):
            dst[:] = 0
            request = reads.ask([*KEYS, MISSING])
            asked.append(request is not None)
            lease = reads.take(request)
            if how == "grants":
                assert lease is not None and lease.grant and lease.granted == frozenset(KEYS), lease
            handle, granted = reads.deliver(lambda: c.deliver(objects))
            res = handle.result(RESULT_TIMEOUT_S)
            reads.release(lease)
            assert res.all_ok and np.array_equal(dst, src), res
            assert granted is (how == "grants")
        st = assert_clean(c)
        if how == "grants":
            assert asked == [True] * LOADS and (reads.granted, reads.node) == (LOADS, 0)
            assert st["leases"]["read_grants"] == LOADS and outcome_count(st, "deliver.OK") == 0
        else:
            # Off: the first lease finds the node grants none, and no later load asks; below 5, none asks.
            assert asked == [how == "client_transfers off", False] and (reads.granted, reads.node) == (0, LOADS)
            assert st["leases"].get("read_grants", 0) == 0 and outcome_count(st, "deliver.OK") == LOADS * len(KEYS)


def test_a_lease_ended_before_the_load_leaves_it_to_the_node() -> None:
    with (
        short_ipc_dir("rdl") as d,
        running_node(d, "n", "--pool", "kv:4KiB:16") as node,
        Client(node.endpoint, name="test-readleases") as c,
    ):
        src = pattern(SLOT, 12)
        r = c.register(src)
        assert c.deposit({KEYS[0]: [Span("k", r, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
        dst = np.zeros_like(src)
        rd = c.register(dst)
        reads = ReadLeases(c)
        lease = reads.lease([KEYS[0]])
        assert lease is not None and lease.granted == {KEYS[0]}
        reads.release(lease)
        handle, granted = reads.deliver(lambda: c.deliver({KEYS[0]: [Span("k", rd, 0, SLOT)]}))
        assert handle.result(RESULT_TIMEOUT_S).all_ok and np.array_equal(dst, src) and not granted
        assert stats(c)["leases"]["read_grants"] == 1
        assert_clean(c)
