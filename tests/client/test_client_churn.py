"""Client churn soaks (issue #10): thousands of operations, nothing grows in the client.

Each test measures this process's descriptors (/proc/self/fd), RSS (VmRSS) and the
client's table sizes (``Client.tables()``: pending, timed out, event loops reading, completed,
regions) before and after thousands of operations, and asserts they come back within a
small bound; the node ends clean (no invariant breach, claim, pending operation, or
leaked slot). Every delivered byte is compared with the source.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvcr_client.session
from kvcr_client import ArgumentError, AsyncClient, Client, KeyStatus, OperationTimeout, Presence, Span
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.layouts import Layout, Registrar, StoredObject
from kvcr_testing.measure import RSS_SLACK_KIB, Heap, Snapshot
from kvcr_testing.nodes import frozen
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

SLOT = 4 * KiB
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(2)])
NODE_ARGS = ("--pool", "kv:4KiB:64", "--heartbeat-ms", "20000")
OPERATIONS = 4000
BATCH = 40
"""Operations issued before looking at those nobody waits on."""
THREADS = 4
PER_THREAD = 300
ROUNDS = 3
LATE = 300
"""Operations that time out in the client while the node is frozen, then are answered late."""
SESSIONS = 40
SESSION_HEAP_SLACK = 256 * 1024
"""Python heap growth allowed over the churn (measured: about 27 KiB over 100 sessions)."""
AGENT_NATIVE_KIB = 64
"""Native memory a client's NIXL agent leaves in the process after it is gone (UCX's, not the
client's: measured about 40 KiB a session on this head and the one before, with the Python
heap flat), allowed per session on top of the churn slack."""
SESSION_WARMUP = 20
SETTLE_S = 15.0
WARMUP = 300


class Fixture(StoredObject):
    """A stored object with its destination, also prepared once (``dest``), for deliver churn."""

    def __init__(self, client: Client, reg: Registrar, key: bytes) -> None:
        super().__init__(client, reg, key, LAYOUT, 21)
        self.dest = client.destination(self.spans)


def _mixed(client: Client, f: Fixture, i: int) -> Any:
    """One operation of a mix: queries, stats, delivers from spans and from a prepared destination."""
    match i % 4:
        case 0:
            return client.query([f.key])
        case 1:
            return client.stats(audit=True)
        case 2:
            return client.deliver({f.key: f.spans})
        case _:
            return client.deliver({f.key: f.dest})


def _check(result: Any, f: Fixture) -> None:
    if isinstance(result, dict):
        assert result["invariants"] == []
    elif f.key in result and hasattr(result[f.key], "presence"):
        assert result[f.key].presence is Presence.HIT
    else:
        assert result[f.key].status is KeyStatus.OK, result[f.key]


def test_thousands_of_operations_without_polling(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="churn") as client:
        reg = Registrar(client)
        f = Fixture(client, reg, b"churn/obj")
        slots = slot_accounting(stats(client))
        for i in range(WARMUP):
            _check(_mixed(client, f, i).result(5), f)
        before = Snapshot.take(client)
        for first in range(0, OPERATIONS, BATCH):
            left = []
            for i in range(first, first + BATCH):
                handle = _mixed(client, f, i)
                if i % 3:
                    _check(handle.result(5), f)  # a waiting engine
                else:
                    left.append(handle)  # nobody waits: the background thread completes it
            assert wait_until(lambda left=left: all(h.future.done() for h in left), SETTLE_S, 0.001)
            for h in left:
                _check(h.future.result(0), f)
        assert_bytes_equal(f.dst, f.src, "destination after the churn")
        Snapshot.take(client).assert_back_within(before, "operations without polling")
        assert client.tables()["completed"] == 0 and client.tables()["pending"] == 0
        assert_clean(client, slots_before=slots)
        reg.close()


def test_many_threads_beside_the_background_thread(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="threads") as client:
        reg = Registrar(client)
        f = Fixture(client, reg, b"threads/obj")
        slots = slot_accounting(stats(client))
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                left = []
                for i in range(PER_THREAD):
                    handle = _mixed(client, f, i + t)
                    if (i + t) % 2:
                        _check(handle.result(10), f)  # this thread drives the socket
                    else:
                        left.append(handle)  # the background thread completes these
                assert wait_until(lambda: all(h.future.done() for h in left), SETTLE_S, 0.001)
                for h in left:
                    _check(h.future.result(0), f)
            except BaseException as exc:
                errors.append(exc)

        def run_threads() -> None:
            threads = [threading.Thread(target=work, args=(t,), name=f"churn-{t}") for t in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
            assert errors == [], errors[:3]

        run_threads()  # warm-up: each new thread's malloc arena and stack are made once
        before = Snapshot.take(client)
        for _ in range(ROUNDS):
            run_threads()
        assert client.core.driver.thread.is_alive()
        assert_bytes_equal(f.dst, f.src, "destination after the threads")
        Snapshot.take(client).assert_back_within(before, "threads beside the background thread")
        assert f.dst_region.in_use == 0
        assert_clean(client, slots_before=slots)
        reg.close()


def test_timed_out_operations_are_all_released(node_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of delivers time out in the client; the node answers them late; nothing is left."""
    node = node_factory(*NODE_ARGS)
    monkeypatch.setattr(kvcr_client.session, "_GRACE_S", 0.0)
    with Client(node.endpoint, name="late-churn") as client:
        reg = Registrar(client)
        f = Fixture(client, reg, b"late/obj")
        slots = slot_accounting(stats(client))
        for i in range(WARMUP):
            _check(_mixed(client, f, i).result(5), f)
        # Each late deliver has a destination of its own: a timed-out one's is held (kvcr_client.uncertain).
        late = np.zeros(LATE * LAYOUT.nbytes, np.uint8)
        late_region = reg(late)
        dests = [client.destination([Span(n, late_region, i * LAYOUT.nbytes + o, size)
                                     for (n, _, size), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)])
                 for i in range(LATE)]
        late[:] = 1  # its pages in place before the measure
        before = Snapshot.take(client)
        for _ in range(2):
            late[:] = 0
            with frozen(node):
                handles = [client.deliver({f.key: dest}, deadline_ms=1) for dest in dests]
                for h in handles:
                    with pytest.raises(OperationTimeout):
                        h.result(SETTLE_S)
                assert client.tables()["timed_out"] == LATE and client.tables()["uncertain_held"] == LATE
                assert late_region.in_use == LATE
                with pytest.raises(ArgumentError):  # the frozen node may still write there
                    client.deliver({f.key: dests[0]})
            # Received late with a 1 ms deadline: each completes OK or TIMEOUT, and answers.
            assert wait_until(lambda: client.tables()["timed_out"] == 0, SETTLE_S), client.tables()
            assert late_region.in_use == 0 and client.tables()["uncertain_held"] == 0
        f.dst[:] = pattern(f.dst.size, 23)
        assert client.deliver({f.key: f.dest}).result(10)[f.key].status is KeyStatus.OK
        assert_bytes_equal(f.dst, f.src, "destination after the late answers")
        Snapshot.take(client).assert_back_within(before, "timed-out operations")
        assert_clean(client, slots_before=slots)
        reg.close()


def test_sessions_come_and_go(node_factory: Callable[..., Any]) -> None:
    """Clients opened and closed again and again leave no descriptor or memory behind."""
    node = node_factory(*NODE_ARGS)
    src = pattern(SLOT, 31)

    def session(i: int) -> None:
        with Client(node.endpoint, name=f"s{i}") as c:
            region = c.register(src)
            key = b"s/%d" % (i % 4)
            assert c.deposit({key: [Span("L0", region, 0, SLOT, "kv")]}).result(10)[key].ok
            assert c.query([key]).result(5)[key].presence is Presence.HIT
            c.unregister(region)

    for i in range(SESSION_WARMUP):  # NIXL and UCX allocate caches over the first agents a process makes
        session(i)
    asyncio.run(_async_sessions(node.endpoint, 2))
    with Client(node.endpoint, name="watch") as watch:
        before = Snapshot.take(watch)
        with Heap(collect=False) as heap:
            for i in range(SESSIONS):
                session(i)
            asyncio.run(_async_sessions(node.endpoint, SESSIONS // 4))
            after = Snapshot.take(watch)
            heap_grown = heap.grown()
        # Every object the client makes per session is gone: the Python heap is back.
        assert heap_grown <= SESSION_HEAP_SLACK, ("sessions", "Python heap bytes", heap_grown, heap.where)
        sessions = SESSIONS + SESSIONS // 4
        after.assert_back_within(before, "sessions", rss_slack_kib=RSS_SLACK_KIB + sessions * AGENT_NATIVE_KIB)
        assert wait_until(lambda: stats(watch)["clients"] == 1, SETTLE_S), stats(watch)["clients"]
        assert_clean(watch)


async def _async_sessions(endpoint: str, n: int) -> None:
    for i in range(n):
        async with await AsyncClient.connect(endpoint, name=f"a{i}") as c:
            assert (await c.query([b"s/0"]))[b"s/0"].presence is Presence.HIT


def test_a_closed_client_goes_without_the_cyclic_collector(node_factory: Callable[..., Any]) -> None:
    """Nothing a closed client's core holds leads back to it (its parts name the core by a weak
    proxy, the callbacks are dropped): the client, its core and its NIXL agent are freed when
    the last reference goes, not whenever the cyclic collector runs. In a fresh interpreter,
    so that nothing of the test run (captured log records, tracebacks) holds a reference."""
    node = node_factory(*NODE_ARGS)
    proc = subprocess.run([sys.executable, "-c", _GC_SCRIPT, node.endpoint], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"sync": [False] * 3, "async": [False] * 3}


_GC_SCRIPT = """
import asyncio, gc, json, sys, weakref
import numpy as np
from kvcr_client import AsyncClient, Client, Presence, Span

SLOT = 4096
endpoint = sys.argv[1]
src = (np.arange(SLOT, dtype=np.uint32) * 2654435761 >> 7).astype(np.uint8) | 1

def used(c):
    region = c.register(src)
    assert c.deposit({b"gc/0": [Span("L0", region, 0, SLOT, "kv")]}).result(10)[b"gc/0"].ok
    lease = c.lease([b"gc/0"], read=True).result(5)
    assert b"gc/0" in lease.held
    dst = np.zeros(SLOT, np.uint8)
    into = c.register(dst)
    assert c.deliver({b"gc/0": [Span("L0", into, 0, SLOT)]}).result(10)[b"gc/0"].ok  # READ under the grant
    assert np.array_equal(dst, src)
    lease.release().result(5)
    put = c.put({b"gc/1": [Span("L0", region, 0, SLOT, "kv")]})  # WRITEs under a write grant
    put.written.result(10)
    assert put.result(10)[b"gc/1"].ok
    c.unregister(into)
    c.unregister(region)
    held = c.lease([b"gc/0"], read=True).result(5)  # held at close: it ends with the session
    assert b"gc/0" in held.held

async def used_async():
    c = await AsyncClient.connect(endpoint, name="gc-async")
    assert (await c.query([b"gc/0"]))[b"gc/0"].presence is Presence.HIT
    refs = [weakref.ref(c), weakref.ref(c.core), weakref.ref(c.core.agent)]
    await c.close()
    return refs

gc.collect()
gc.disable()
c = Client(endpoint, name="gc")
used(c)
refs = [weakref.ref(c), weakref.ref(c.core), weakref.ref(c.core.agent)]
c.close()
del c
alive = {"sync": [r() is not None for r in refs]}
refs = asyncio.run(used_async())
alive["async"] = [r() is not None for r in refs]
print(json.dumps(alive))
"""
