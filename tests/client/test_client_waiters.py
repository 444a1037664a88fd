"""Who reads the client's socket (issue #12, item 1; architecture §4).

A caller that waits leads: it selects on the socket and reads until its result is in;
callers that wait meanwhile follow, and one of them leads when the leader leaves. An
asyncio caller's event loop reads for its awaiters. The background thread reads only
when nobody waits. These tests check that every waiter completes whoever reads, that
leadership passes on, and that an awaited reply is read in the awaiting loop's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcr_client import AsyncClient, Client, KeyStatus, Presence, Span
from kvcr_client.core import ClientCore
from kvcr_testing.health import assert_clean, wait_until
from kvcr_testing.layouts import Layout, Registrar
from kvcr_testing.nodes import frozen
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", 4 * KiB) for i in range(2)])
THREADS = 8
ROUNDS = 40
DELIVER_EVERY = 8
"""Each thread's every eighth round also delivers into its own buffer (the agent must be progressed)."""
RESULT_TIMEOUT_S = 30.0
SETTLE_S = 20.0
POLL_S = 0.001
GIVE_UP_S = 0.3
"""How long the first waiter waits on a frozen node before it gives up (and hands over)."""


def _at_rest(core: ClientCore) -> None:
    """Nobody waits, nobody leads, nothing is pending."""
    assert core.waiters.count == 0 and not core.waiters.leading and not core.waiters.followers, (
        core.waiters.count, core.waiters.leading, len(core.waiters.followers)
    )
    assert core.waiters.loop_waiting == 0
    assert core.tables()["pending"] == 0


def _stored(client: Client, reg: Registrar, key: bytes, seed: int) -> np.ndarray:
    src = pattern(LAYOUT.nbytes, seed)
    region = reg(src)
    assert client.deposit({key: LAYOUT.source_spans(region)}).result(10)[key].status is KeyStatus.STORED
    return src


def _dest(region: Any) -> list[Span]:
    return [Span(n, region, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]


def test_many_threads_wait_at_once(node_factory: Callable[..., Any]) -> None:
    """Eight threads each wait on their own queries and delivers at once: one leads, the others
    follow, leadership passes on as results come in, and every result is right."""
    node = node_factory(*POOL)
    with Client(node.endpoint, name="waiters") as client:
        reg = Registrar(client)
        key = b"waiters/obj"
        src = _stored(client, reg, key, 1)
        buffers = [pattern(LAYOUT.nbytes, 100 + t) for t in range(THREADS)]
        regions = [reg(b) for b in buffers]
        errors: list[BaseException] = []
        start = threading.Barrier(THREADS)

        def work(t: int) -> None:
            try:
                start.wait(SETTLE_S)
                for r in range(ROUNDS):
                    miss = b"waiters/missing-%d-%d" % (t, r)
                    res = client.query([key, miss]).result(RESULT_TIMEOUT_S)
                    assert res[key].presence is Presence.HIT and res[miss].presence is Presence.MISS, res
                    if r % DELIVER_EVERY == 0:
                        buffers[t][:] = 0
                        assert client.deliver({key: _dest(regions[t])}).result(RESULT_TIMEOUT_S)[key].ok
                        assert_bytes_equal(buffers[t], src, f"thread {t} round {r}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,), name=f"waiter-{t}") for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(SETTLE_S * 3)
        assert not any(th.is_alive() for th in threads), "a waiter never completed"
        assert errors == [], errors[:3]
        _at_rest(client.core)
        assert_clean(client)
        reg.close()


def test_follower_leads_when_the_leader_gives_up(node_factory: Callable[..., Any]) -> None:
    """The leader times out on a frozen node while another caller still waits: that caller leads
    from then on and reads its own reply once the node answers (nobody else would: the background
    thread stays off the socket while a caller waits)."""
    node = node_factory(*POOL)
    with Client(node.endpoint, name="handover") as client:
        core = client.core
        outcome: dict[str, Any] = {}

        def first() -> None:
            try:
                client.query([b"handover/a"]).result(GIVE_UP_S)
            except TimeoutError:
                outcome["first"] = "gave up"

        def second() -> None:
            outcome["second"] = client.query([b"handover/b"]).result(RESULT_TIMEOUT_S)

        with frozen(node):
            leader = threading.Thread(target=first, name="leader")
            leader.start()
            assert wait_until(lambda: core.waiters.leading, SETTLE_S)
            follower = threading.Thread(target=second, name="follower")
            follower.start()
            assert wait_until(lambda: len(core.waiters.followers) == 1, SETTLE_S)
            leader.join(SETTLE_S)
            assert outcome.get("first") == "gave up"
            # The follower leads now, still waiting on the frozen node.
            assert wait_until(lambda: core.waiters.leading and core.waiters.leader_thread == follower.ident, SETTLE_S)
        follower.join(SETTLE_S)
        assert not follower.is_alive(), "the follower was never woken to lead"
        assert outcome["second"][b"handover/b"].presence is Presence.MISS
        # The first query's late reply was read too (by the new leader or the background thread).
        assert wait_until(lambda: core.tables()["pending"] == 0, SETTLE_S), core.tables()
        _at_rest(core)
        assert_clean(client)


def test_waiter_beside_an_awaiting_event_loop(node_factory: Callable[..., Any]) -> None:
    """One client: an event loop in another thread awaits its queries and delivers while this
    thread waits on its own; both read the same socket and every result is right."""
    node = node_factory(*POOL)
    key = b"mixed/obj"
    src = pattern(LAYOUT.nbytes, 7)
    loop_dst, thread_dst = pattern(LAYOUT.nbytes, 8), pattern(LAYOUT.nbytes, 9)
    ready, done = threading.Event(), threading.Event()
    shared: dict[str, Any] = {}
    errors: list[BaseException] = []

    async def awaiting() -> None:
        async with await AsyncClient.connect(node.endpoint, name="mixed") as client:
            shared["client"] = client
            region = await client.register(src)
            assert (await client.deposit({key: LAYOUT.source_spans(region)}))[key].status is KeyStatus.STORED
            shared["dregion"] = await client.register(thread_dst)
            dregion = await client.register(loop_dst)
            ready.set()
            for r in range(ROUNDS * 2):
                res = await client.query([key, b"mixed/missing"])
                assert res[key].presence is Presence.HIT and res[b"mixed/missing"].presence is Presence.MISS
                if r % DELIVER_EVERY == 0:
                    loop_dst[:] = 0
                    assert (await client.deliver({key: _dest(dregion)}))[key].ok
                    assert_bytes_equal(loop_dst, src, f"awaited deliver {r}")
            await asyncio.to_thread(done.wait, SETTLE_S * 3)
            assert client.core.tables()["pending"] == 0
            st = await client.stats(audit=True)
            assert st["invariants"] == []

    def run_loop() -> None:
        try:
            asyncio.run(awaiting())
        except BaseException as exc:
            errors.append(exc)
            ready.set()

    loop_thread = threading.Thread(target=run_loop, name="event-loop")
    loop_thread.start()
    try:
        assert ready.wait(SETTLE_S) and not errors, errors
        client = shared["client"]
        for r in range(ROUNDS):
            res = client.query([key]).result(RESULT_TIMEOUT_S)  # this thread waits (and leads)
            assert res[key].presence is Presence.HIT
            if r % DELIVER_EVERY == 0:
                thread_dst[:] = 0
                assert client.deliver({key: _dest(shared["dregion"])}).result(RESULT_TIMEOUT_S)[key].ok
                assert_bytes_equal(thread_dst, src, f"waited deliver {r}")
    finally:
        done.set()
        loop_thread.join(SETTLE_S * 3)
    assert not loop_thread.is_alive()
    assert errors == [], errors[:3]


async def test_awaited_reply_is_read_by_the_awaiting_loop(node_factory: Callable[..., Any]) -> None:
    """An awaited reply resolves in the event loop's own thread: the loop reads the socket while
    it has awaiters and the background thread stays off it (heartbeats off: no timer turns)."""
    node = node_factory(*POOL, "--heartbeat-ms", "0")
    async with await AsyncClient.connect(node.endpoint, name="loop-reads") as client:
        core = client.core
        for _ in range(3):
            with frozen(node):
                handle = client.query([b"loop-reads/k"])
                readers: list[int] = []
                handle.future.add_done_callback(lambda _, readers=readers: readers.append(threading.get_ident()))
                task = asyncio.ensure_future(_awaited(handle))
                assert await _until(lambda: core.tables()["loops"] == 1 and core.waiters.loop_waiting == 1)
                assert not handle.future.done()
            result = await asyncio.wait_for(task, RESULT_TIMEOUT_S)
            assert result[b"loop-reads/k"].presence is Presence.MISS
            assert readers == [threading.get_ident()], "the reply was read by another thread"
        assert core.tables()["pending"] == 0
        st = await client.stats(audit=True)
        assert st["invariants"] == []


async def _awaited(handle: Any) -> Any:
    return await handle


async def _until(predicate: Callable[[], bool]) -> bool:
    """Let the loop run until ``predicate`` holds, for at most ``SETTLE_S``."""
    end = asyncio.get_running_loop().time() + SETTLE_S
    while not predicate():
        if asyncio.get_running_loop().time() >= end:
            return False
        await asyncio.sleep(POLL_S)
    return True


BURST = 8000
"""Queries sent at once to a frozen node: beyond ZeroMQ's default high-water mark (1000) plus what the
kernel's socket buffer holds, so a socket with a mark would refuse some of them."""


def test_burst_beyond_a_high_water_mark_completes(node_factory: Callable[..., Any]) -> None:
    """A burst of requests to a node that reads none of them queues in the client instead of failing,
    and every reply comes back once the node reads (none is dropped at the node's ROUTER)."""
    node = node_factory(*POOL)
    with Client(node.endpoint, name="burst") as client:
        reg = Registrar(client)
        key = b"burst/obj"
        _stored(client, reg, key, 3)
        with frozen(node):
            handles = [client.query([key]) for _ in range(BURST)]
            failed = [h for h in handles if h.future.done()]
            assert failed == [], failed[0].future.exception()
        assert wait_until(lambda: all(h.future.done() for h in handles), SETTLE_S * 3), (
            f"{sum(not h.future.done() for h in handles)} of {BURST} queries never completed"
        )
        assert all(h.result(0)[key].presence is Presence.HIT for h in handles)
        st = assert_clean(client)
        assert st["counters"].get("send_dropped", 0) == 0, st["counters"]
        _at_rest(client.core)
        reg.close()
