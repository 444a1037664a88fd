"""The shares of a pool that leases and puts may hold, against a greedy client, on a real node.

A greedy client that leased a pool's whole lease budget while alone gives back, lease by
lease, what an innocent client's share needs (spec section 6.11, ``lease_end``
``LEASE_LIMIT``); over hundreds of rounds the innocent client gets every key it asks
within its share, and the node's tables and accounting stay bounded. A client flooding
puts it never commits is refused past its share of the pool (spec section 6.13) before
anything is evicted, and all puts together past the pool's put budget, however many times
the flooder comes back: the innocent client's objects stay, and once the flooder's sessions
are gone every slot comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, ErrorCode, KeyStatus, LeaseStatus, NodeError, Span
from kvcr_protocol import DepositItem, Put, PutReply, SrcSpan
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.nodes import running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
SLOTS = 64
ROUNDS = 300
INNOCENT_KEYS = 8
"""The innocent client's share of the lease budget: 64 slots, two sessions, at least 1/2."""
FD_SLACK = 10
THREAD_SLACK = 2
RSS_GROWTH_KIB = 8192
FLOOD_TTL_MS = 120_000
"""The flooder's puts outlive its flood however slow the machine: an expired put its session
never names ends that session ``put_quarantine_ms`` later, which a flood of 200 requests that
took longer than the time to live plus the quarantine (once 500 ms) met as ``BAD_STATE``."""


def deposit_all(client: Client, keys: list[bytes], seed: int) -> np.ndarray:
    src = pattern(len(keys) * SLOT, seed)
    region = client.register(src)
    res = client.deposit({k: [Span("L0", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(keys)}).result(RESULT_TIMEOUT_S)
    assert res.all_ok, res
    client.unregister(region)
    return src


def ask(client: Client, build: Callable[[int], Any]) -> Any:
    """A raw request and its reply (the message itself; an error raises ``NodeError``)."""
    _, fut = client.core.request(build, lambda m: m, 10.0)
    return client.core.wait(fut, 12.0)


@pytest.mark.slow
def test_a_greedy_lease_holder_gives_back_what_an_innocent_share_needs_round_after_round() -> None:
    args = ("--pool", f"kv:4KiB:{SLOTS}", "--lease-pool-fraction", "0.5", "--lease-session-fraction", "0.125")
    with short_ipc_dir("share") as d, running_node(d, "n", *args) as node, \
            Client(node.endpoint, name="greedy") as greedy, Client(node.endpoint, name="innocent") as innocent:
        keys = [b"g%d" % i for i in range(SLOTS // 2)]
        mine = [b"i%d" % i for i in range(INNOCENT_KEYS)]
        deposit_all(greedy, keys, 1)
        deposit_all(innocent, mine, 2)
        fds, threads, rss = fd_count(node.proc.pid), thread_count(node.proc.pid), rss_kib(node.proc.pid)
        scratch = np.zeros(INNOCENT_KEYS * SLOT, np.uint8)
        for round_ in range(ROUNDS):
            # Alone (the innocent client holds neither memory nor leases now), the greedy one
            # may lease the whole budget: its 32 keys.
            held = greedy.lease(keys, ttl_ms=600_000).result(RESULT_TIMEOUT_S)
            assert held.held_prefix() == len(keys), round_
            taken = stats(greedy)["leases"].get("taken_back", 0)
            # The innocent client arrives (memory makes it a session sharing the budget): its
            # share is half, and the greedy client gives its lease back for it.
            region = innocent.register(scratch)
            lease = innocent.lease(mine).result(RESULT_TIMEOUT_S)
            assert [lease.status(k) for k in mine] == [LeaseStatus.LEASED] * INNOCENT_KEYS, round_
            assert stats(greedy)["leases"]["taken_back"] == taken + 1
            assert wait_until(lambda held=held: held.ended is not None, RESULT_TIMEOUT_S), "no lease_end reached the greedy"
            assert held.ended == ErrorCode.LEASE_LIMIT
            lease.release().result(RESULT_TIMEOUT_S)
            innocent.unregister(region)
        st = stats(innocent)
        assert st["leases"]["taken_back"] == ROUNDS, st["leases"]
        assert wait_until(lambda: stats(innocent)["leases"]["held"] == 0, RESULT_TIMEOUT_S)
        st = stats(innocent)
        assert st["invariants"] == [] and st["tables"]["leases"] == 0 and st["tables"]["lease_holders"] == 0
        assert st["tables"]["lease_expiry"] <= 2 * ROUNDS, st["tables"]
        assert fd_count(node.proc.pid) <= fds + FD_SLACK and thread_count(node.proc.pid) <= threads + THREAD_SLACK
        assert rss_kib(node.proc.pid) <= rss + RSS_GROWTH_KIB
        assert_clean(innocent)


def test_a_put_flood_is_refused_past_its_share_and_evicts_nothing() -> None:
    args = ("--pool", f"kv:4KiB:{SLOTS}", "--policy", "fifo", "--put-session-fraction", "0.125",
            "--put-quarantine-ms", "300", "--put-ttl-ms", str(FLOOD_TTL_MS), "--max-puts-per-session", "1024")
    with short_ipc_dir("putshare") as d, running_node(d, "n", *args) as node, \
            Client(node.endpoint, name="innocent") as innocent:
        kept = [b"keep%d" % i for i in range(8)]
        src = deposit_all(innocent, kept, 3)
        refused = granted = 0
        for reconnect in range(3):
            with Client(node.endpoint, name="flooder") as flooder:
                buf = pattern(SLOT, 4)
                region = flooder.register(buf)
                for i in range(200):
                    item = DepositItem(b"f%d-%d" % (reconnect, i), (SrcSpan("L0", "kv", region.region, 0, SLOT),))
                    try:
                        reply = ask(flooder, lambda rid, item=item: Put(rid, (item,)))
                    except NodeError as exc:
                        assert exc.code is ErrorCode.BUSY and "_fraction" in str(exc), exc
                        refused += 1
                        continue
                    assert isinstance(reply, PutReply)
                    granted += reply.put != 0  # never committed: open until the session ends
            # Whatever the flooder holds, its share (32 of 64 slots: two clients) and the pool's
            # put budget (32, its earlier sessions' quarantined puts included) bound it, and the
            # innocent client's objects were never evicted for it.
            res = innocent.query(kept).result(RESULT_TIMEOUT_S)
            assert all(res[k].presence.name == "HIT" for k in kept), res
            st = stats(innocent)
            assert st["puts"]["open"] + st["puts"]["quarantined"] <= SLOTS // 2, st["puts"]
        assert granted <= 3 * (SLOTS // 2) and refused >= 3 * 200 - granted
        # The flooder's sessions are gone: after the quarantine every one of its slots is back.
        assert wait_until(lambda: stats(innocent)["tables"]["puts"] == 0, RESULT_TIMEOUT_S), stats(innocent)["puts"]
        dst = np.zeros(len(kept) * SLOT, np.uint8)
        region = innocent.register(dst)
        res = innocent.deliver({k: [Span("L0", region, i * SLOT, SLOT)] for i, k in enumerate(kept)}).result(RESULT_TIMEOUT_S)
        assert all(res[k].status is KeyStatus.OK for k in kept) and np.array_equal(dst, src)
        innocent.unregister(region)
        st = stats(innocent)
        assert st["invariants"] == [] and st["puts"]["refused_share"] == refused
        assert_clean(innocent)
