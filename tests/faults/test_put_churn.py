"""Churn on write grants (spec section 6.13): thousands of puts, hundreds of sessions that put and go,
and rounds of puts given up on a frozen node.

Each put reserves a slot, the client WRITEs it and commits; the pool is FIFO, so older
objects are evicted as new keys come. Afterwards the node holds no open or quarantined put,
its threads, descriptors and RSS are within a bound of where they started, every slot is
accounted for, and the client's Python heap is back: nothing is kept per put or per session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcr_client import Client, ErrorCode, Span
from kvcr_node.agents import DEPARTED_AGENTS
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.measure import Heap, fd_count, rss_kib, thread_count
from kvcr_testing.nodes import frozen
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
PUTS = 1500
SESSIONS = 150
FD_SLACK = 10
THREAD_SLACK = 2
HEAP_SLACK = 256 * KiB
"""Python heap the puts may leave in the client (caches warmed once); a put record or a
WRITE handle kept per put would pass it within the first thousand."""
RSS_GROWTH_KIB = 8192
"""As for granted leases (tests/faults/test_grant_load.py): allocator and UCX pools grow
in steps once; a record leaked per put would pass it."""


def put_stats(client: Client) -> dict[str, int]:
    puts: dict[str, int] = stats(client)["puts"]
    return puts


def at_rest(client: Client) -> bool:
    p = put_stats(client)
    st = stats(client)
    # The puts table itself is in ``tables`` (a soak's bound), and empty at rest.
    return p["open"] == 0 and p["quarantined"] == 0 and p["quarantined_slots"] == 0 and st["invariants"] == [] \
        and st["tables"]["puts"] == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_put_churn_leaves_nothing_behind(node_factory: Callable[..., Any]) -> None:
    node = node_factory("--pool", "kv:4KiB:128", "--policy", "fifo")
    pid = node.proc.pid
    with Client(node.endpoint, name="put-churn") as client:
        reg = Registrar(client)
        src = pattern(SLOT, 41)
        spans = [Span("L0", reg(src), 0, SLOT, "kv")]
        dst = np.zeros(SLOT, np.uint8)
        into = [Span("L0", reg(dst), 0, SLOT)]
        for i in range(50):  # warm
            assert client.put({b"w%d" % i: spans}).result(RESULT_TIMEOUT_S).all_ok
        before = {"fds": fd_count(pid), "threads": thread_count(pid), "rss": rss_kib(pid)}
        written = client.counters()["puts"]
        with Heap() as heap:
            for i in range(PUTS):
                key = b"p%d" % i
                assert client.put({key: spans}).result(RESULT_TIMEOUT_S).all_ok
                if i % 250 == 0:
                    dst[:] = 0
                    assert client.deliver({key: into}).result(RESULT_TIMEOUT_S)[key].ok
                    assert np.array_equal(dst, src)
            heap_grown = heap.grown()
        assert heap_grown <= HEAP_SLACK, ("puts", "Python heap bytes", heap_grown, heap.where)
        assert client.counters()["puts"] == written + PUTS, "a put went as a deposit"
        assert at_rest(client), put_stats(client)

        # Sessions that put and close: their puts are committed, nothing is left open.
        mid = 0
        for n in range(SESSIONS):
            if n == SESSIONS // 2:
                mid = fd_count(pid)
            with Client(node.endpoint, name=f"putter{n}") as putter:
                region = putter.register(src)
                assert putter.put({b"s%d" % n: [Span("L0", region, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
        assert wait_until(lambda: at_rest(client) and stats(client)["clients"] == 1, 10), put_stats(client)
        after = {"fds": fd_count(pid), "threads": thread_count(pid), "rss": rss_kib(pid)}
        assert after["threads"] <= before["threads"] + THREAD_SLACK, (before, after)
        # Gone clients' agents stay loaded up to DEPARTED_AGENTS (kvcr_node.agents), each with
        # its connection's descriptor: bounded, so the second half of the sessions adds none.
        assert SESSIONS // 2 > DEPARTED_AGENTS
        assert after["fds"] <= before["fds"] + DEPARTED_AGENTS + FD_SLACK, (before, after)
        assert after["fds"] <= mid + FD_SLACK, (before, mid, after)
        assert after["rss"] - before["rss"] <= RSS_GROWTH_KIB, (before, after)
        reg.close()
        assert_clean(client)


ABANDONED_ROUNDS = 5
ABANDONED_PER_ROUND = 40
"""Puts given up on a frozen node per round: under ``max_puts_per_session`` (64), so every one
is reserved once the node runs again, and must be handed back."""


@pytest.mark.timeout(120)
def test_puts_abandoned_on_a_frozen_node_are_all_handed_back(node_factory: Callable[..., Any]) -> None:
    """Rounds of puts whose deadline passes while the node is frozen: each fails ``TIMEOUT``
    at its deadline, and once the node runs again every reservation it makes is freed by ``unput``;
    nothing stays open or quarantined, the session's in-flight table empties, every slot is
    back, and puts go on."""
    node = node_factory("--pool", "kv:4KiB:256", "--policy", "fifo")
    with Client(node.endpoint, name="put-abandoned") as client:
        reg = Registrar(client)
        src = pattern(SLOT, 43)
        spans = [Span("L0", reg(src), 0, SLOT, "kv")]
        before = slot_accounting(stats(client))
        for r in range(ABANDONED_ROUNDS):
            with frozen(node):
                handles = [client.put({b"a%d.%d" % (r, i): spans}, deadline_ms=1) for i in range(ABANDONED_PER_ROUND)]
                outcomes = [handle.result(RESULT_TIMEOUT_S) for handle in handles]
            assert all(o[b"a%d.%d" % (r, i)].code is ErrorCode.TIMEOUT for i, o in enumerate(outcomes))
            want = (r + 1) * ABANDONED_PER_ROUND
            assert wait_until(lambda want=want: client.counters()["puts_handed_back"] == want and at_rest(client)
                              and not client.core.session.pending, 20), (client.counters()["puts_handed_back"], put_stats(client))
            assert slot_accounting(stats(client)) == before
        assert client.counters()["puts_unanswered"] == ABANDONED_ROUNDS * ABANDONED_PER_ROUND
        assert client.put({b"after": spans}).result(RESULT_TIMEOUT_S).all_ok
        reg.close()
        assert_clean(client)
