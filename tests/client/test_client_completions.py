"""Completed operations are kept for ``poll_completed`` only for engines that poll (issue #10, defect 7).

The client used to append every handle to its completion queue, so an engine that waited
on or awaited its handles, and never polled, kept every handle it ever made (20,000
operations: +57 MB). Now a handle is queued only once the engine has called
``poll_completed`` (it polls), only when nobody waited on or awaited it, and at most
``max_completed`` at once (older ones are dropped and counted).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcr_client import AsyncClient, Client, KeyStatus, OpHandle, Presence, Span
from kvcr_client.completions import Completions
from kvcr_testing.health import assert_clean, wait_until
from kvcr_testing.layouts import Layout, Registrar
from kvcr_testing.measure import RSS_SLACK_KIB, rss_kib
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", 4 * KiB) for i in range(2)])
OPERATIONS = 5000
WARMUP = 500
"""Operations before the first RSS reading: allocator pools and caches warm up once."""


def test_waited_handles_are_not_kept(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    with Client(node.endpoint, name="waiter") as client:
        for i in range(WARMUP):
            client.query([b"k%d" % i]).result(5)
        before = rss_kib()
        for i in range(OPERATIONS):
            handle = client.query([b"k%d" % i]) if i % 2 else client.stats()
            handle.result(5)
        after = rss_kib()
        assert client.tables()["completed"] == 0, f"{client.tables()['completed']} handles kept for a queue nobody reads"
        assert after - before <= RSS_SLACK_KIB, (before, after)
        assert_clean(client)


async def test_awaited_handles_are_not_kept(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    async with await AsyncClient.connect(node.endpoint, name="awaiter") as client:
        for i in range(OPERATIONS // 5):
            assert (await client.query([b"k%d" % i]))[b"k%d" % i].presence is Presence.MISS
        assert client.tables()["completed"] == 0
        st = await client.stats(audit=True)
        assert st["invariants"] == []


def test_poll_completed_returns_each_unwaited_handle_once(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    with Client(node.endpoint, name="poller") as client:
        reg = Registrar(client)
        src = pattern(LAYOUT.nbytes, 1)
        region = reg(src)
        key = b"poll/obj"
        assert client.deposit({key: LAYOUT.source_spans(region)}).result(10)[key].status is KeyStatus.STORED
        dst = pattern(LAYOUT.nbytes, 2)
        dregion = reg(dst)
        spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        assert client.poll_completed() == []  # the engine polls from now on
        issued: set[OpHandle[Any]] = set()
        seen: list[OpHandle[Any]] = []
        for i in range(200):
            issued.add(client.deliver({key: spans}) if i % 20 == 0 else client.query([key]))
            if i % 10 == 0:
                seen.extend(client.poll_completed())  # once per engine step
        waited = client.query([key])
        waited.result(5)
        assert wait_until(lambda: bool(seen.extend(client.poll_completed())) or issued <= set(seen), 10.0)
        assert len(seen) == len(set(seen)) == len(issued), "a handle was returned twice, or one that nobody issued"
        assert waited not in seen, "a handle its caller waited on was queued"
        assert all(h.done() and h.result(0).all_ok for h in seen)
        assert_bytes_equal(dst, src, "deliver a polling engine looked at")
        assert client.poll_completed() == [] and client.tables()["completed"] == 0
        assert_clean(client)
        reg.close()


def test_completion_queue_is_bounded(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    bound = 64
    with Client(node.endpoint, name="bounded", max_completed=bound) as client:
        assert client.poll_completed() == []
        handles = [client.query([b"k"]) for _ in range(3 * bound)]
        assert wait_until(lambda: all(h.future.done() for h in handles), 10.0)
        # Done callbacks run right after each result is set; the last one may trail its future.
        assert wait_until(lambda: client.completed_dropped == 2 * bound, 5.0), client.completed_dropped
        assert client.tables()["completed"] == bound
        out = client.poll_completed()
        assert out == handles[-bound:], "the newest completions are kept, in order"
        assert client.tables()["completed"] == 0
        assert_clean(client)


def test_a_handle_waited_on_after_it_was_queued_is_not_returned() -> None:
    """An operation may finish (its reply read by another thread) before its caller waits on
    it: it is queued then, and ``poll_completed`` must still not return it. This raced in the
    test above under load: the waited query came back from ``poll_completed``."""
    queue = Completions(8)
    assert queue.drain() == []  # the engine polls from now on
    finished: Future[Any] = Future()
    waited, unwaited = OpHandle(1, "query", finished), OpHandle(2, "query", finished)
    queue.when_done(finished, waited)
    queue.when_done(finished, unwaited)
    finished.set_result(None)
    assert len(queue) == 2  # both queued: nobody had waited yet
    waited.result(0)
    assert queue.drain() == [unwaited]
