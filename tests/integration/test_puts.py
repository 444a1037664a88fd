"""Write grants against real ``kvcr-node`` processes (spec section 6.13).

``put`` reserves slots, the client WRITEs its bytes with its own agent (the node posts
nothing) and commits; a later ``deliver`` returns every byte. The node-driven deposit stays
for ``client_transfers = false`` and sessions below version 5. Hostile commits and unputs
are refused by name; a put that expires, and a client killed mid-put, leave their slots
quarantined until it is safe to free them, then every slot comes back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcr_client import ArgumentError, AsyncClient, Client, ErrorCode, KeyStatus, NodeError, Span
from kvcr_client.requests import CONTROL_TIMEOUT_S
from kvcr_protocol import Commit, Completion, DepositItem, Put, PutReply, SrcSpan, Unput
from kvcr_testing.health import assert_clean, outcome_count, slot_accounting, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.measure import fd_count, rss_kib, thread_count
from kvcr_testing.nodes import frozen, running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
SLOTS = 64
LAYERS = 8
FD_SLACK = 10
THREAD_SLACK = 2
RSS_GROWTH_KIB = 8192
"""What a churn may leave on the node: descriptors and threads of a reconnect in progress, allocator slack."""
QUARANTINE_MS = 2000

pytestmark = pytest.mark.usefixtures("node_left_clean")


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return ("--pool", f"kv:4KiB:{SLOTS}", "--policy", "fifo", "--put-quarantine-ms", str(QUARANTINE_MS),
            "--heartbeat-ms", "100", "--client-grace-ms", "400")


def spans(region: Any, layers: int = LAYERS) -> list[Span]:
    return [Span(f"L{i}", region, i * SLOT, SLOT, "kv") for i in range(layers)]


def posted(client: Client) -> int:
    return int(stats(client)["transfers"]["posted"])


def read_back(client: Client, register: Registrar, key: bytes, layers: int = LAYERS) -> np.ndarray:
    dst = np.zeros(layers * SLOT, np.uint8)
    rd = register(dst)
    res = client.deliver({key: [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(layers)]}).result(RESULT_TIMEOUT_S)
    assert res[key].ok, res
    return dst


def ask(client: Client, build: Callable[[int], Any]) -> Any:
    """Send a raw request and wait for its reply (the message itself)."""
    _, fut = client.core.request(build, lambda m: m, 10.0)
    return client.core.wait(fut, 12.0)


def test_a_put_writes_from_the_client_and_a_deliver_returns_every_byte(client: Client, register: Registrar,
                                                                      key: Callable[[str], bytes]) -> None:
    before = slot_accounting(stats(client))
    srcs = {key(f"obj{j}"): pattern(LAYERS * SLOT, 10 + j) for j in range(3)}
    objects = {k: spans(register(src)) for k, src in srcs.items()}
    node_posts, stored = posted(client), outcome_count(stats(client), "put.STORED")
    res = client.put(objects).result(RESULT_TIMEOUT_S)
    assert all(o.status is KeyStatus.STORED for o in res.values()), res
    assert posted(client) == node_posts, "the node moved no byte of a put"
    assert outcome_count(stats(client), "put.STORED") == stored + 3, "the node counts what puts stored"
    assert client.counters()["puts"] == 1 and client.counters()["put_fallbacks"] == 0
    for k, src in srcs.items():
        assert np.array_equal(read_back(client, register, k), src)
    st = stats(client)
    assert st["puts"]["committed"] >= 1 and st["puts"]["open"] == 0 and st["puts"]["quarantined"] == 0
    # Again: DUPLICATE, nothing written, no put kept.
    again = client.put(objects).result(RESULT_TIMEOUT_S)
    assert all(o.status is KeyStatus.DUPLICATE for o in again.values()), again
    assert outcome_count(stats(client), "put.DUPLICATE") >= 3
    assert stats(client)["puts"]["open"] == 0
    del before


def test_a_put_of_spans_in_several_regions_writes_span_by_span(client: Client, register: Registrar,
                                                                key: Callable[[str], bytes]) -> None:
    a, b = pattern(4 * SLOT, 21), pattern(4 * SLOT, 22)
    ra, rb = register(a), register(b)
    layout = [Span(f"L{i}", ra if i % 2 else rb, (i // 2) * SLOT, SLOT, "kv") for i in range(LAYERS)]
    res = client.put({key("mixed"): layout}).result(RESULT_TIMEOUT_S)
    assert res[key("mixed")].status is KeyStatus.STORED and client.counters()["put_fallbacks"] == 0
    got = read_back(client, register, key("mixed"))
    want = np.concatenate([(a if i % 2 else b)[(i // 2) * SLOT:(i // 2 + 1) * SLOT] for i in range(LAYERS)])
    assert np.array_equal(got, want)


def test_a_no_evict_put_returns_handles(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    src = pattern(2 * SLOT, 3)
    res = client.put({key("h"): spans(register(src), 2)}, no_evict=True).result(RESULT_TIMEOUT_S)
    outcome = res[key("h")]
    assert outcome.status is KeyStatus.STORED and outcome.handle is not None
    client.release([outcome.handle]).result(RESULT_TIMEOUT_S)
    assert np.array_equal(read_back(client, register, key("h"), 2), src)


def test_bad_input_is_refused_naming_the_field(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    region = register(pattern(2 * SLOT, 4))
    with pytest.raises(ArgumentError, match=r"length|size"):
        client.put({key("a"): [Span("L0", region, 0, SLOT - 1, "kv")]})
    with pytest.raises(ArgumentError, match="ttl_ms"):
        client.put({key("a"): spans(region, 1)}, ttl_ms=1 << 40)
    with pytest.raises(ArgumentError, match="ttl_ms"):
        client.put({key("a"): spans(region, 1)}, ttl_ms=-1)
    with pytest.raises(ArgumentError, match="pool"):
        client.put({key("a"): [Span("L0", region, 0, SLOT, "nope")]})
    with pytest.raises(ArgumentError, match="region"):
        client.put({key("a"): [Span("L0", region, SLOT * 2, SLOT, "kv")]})
    with pytest.raises(ArgumentError, match="deadline_ms"):
        client.put({key("a"): spans(region, 1)}, deadline_ms=1 << 32)
    # The node checks what the client library would: an unknown region, a span past its end.
    bad = ask(client, lambda i: Put(i, (DepositItem(key("b"), (SrcSpan("L0", "kv", 999, 0, SLOT),)),
                                        DepositItem(key("c"), (SrcSpan("L0", "kv", region.region, SLOT, 2 * SLOT),)))))
    assert isinstance(bad, PutReply) and bad.put == 0
    assert [r.code for r in bad.results] == [ErrorCode.BAD_DESCRIPTOR, ErrorCode.SIZE_MISMATCH]


async def delivered_back(c: AsyncClient, key: bytes, src: np.ndarray, region: Any) -> None:
    """``key`` delivered into fresh memory holds ``src``; both regions go."""
    dst = np.zeros(len(src), np.uint8)
    rd = await c.register(dst)
    assert (await c.deliver({key: [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(len(src) // SLOT)]}))[key].ok
    assert np.array_equal(dst, src)
    await c.unregister(region)
    await c.unregister(rd)


async def test_an_async_client_puts(node: Any) -> None:
    async with AsyncClient(node.endpoint, name="itest-puts-async") as c:
        src = pattern(2 * SLOT, 11)
        r = await c.register(src)
        res = await c.put({b"async-put": spans(r, 2)})
        assert res[b"async-put"].status is KeyStatus.STORED and c.counters()["puts"] == 1
        await delivered_back(c, b"async-put", src, r)


async def test_a_put_waited_for_on_the_loops_own_thread_is_written_there(node: Any) -> None:
    """An event loop that reads the socket leaves a put's WRITE to the background thread; a
    caller that blocks in ``result()`` on that loop's thread parks the background thread
    meanwhile, so its own turns post the WRITE (not leave it to a thread that is parked)."""
    async with AsyncClient(node.endpoint, name="itest-puts-loop-blocked") as c:
        src = pattern(2 * SLOT, 12)
        r = await c.register(src)
        first = await c.put({b"loop-first": spans(r, 2)})  # the loop now reads the socket
        assert first[b"loop-first"].status is KeyStatus.STORED
        handle = c.put({b"loop-blocked": spans(r, 2)})
        # Blocks the loop's own thread. A WRITE left to the parked background thread would be
        # posted only by the put's deadline (30 s), past this bound.
        res = handle.result(20)
        assert res[b"loop-blocked"].status is KeyStatus.STORED and c.counters()["puts"] == 2
        await delivered_back(c, b"loop-blocked", src, r)


def raw_put(client: Client, region: Any, keys: list[bytes], ttl_ms: int = 0) -> PutReply:
    items = tuple(DepositItem(k, (SrcSpan("L0", "kv", region.region, 0, SLOT),)) for k in keys)
    reply = ask(client, lambda i: Put(i, items, ttl_ms=ttl_ms))
    assert isinstance(reply, PutReply)
    return reply


def test_commits_and_unputs_that_name_no_put_of_the_session_are_refused(client: Client, register: Registrar,
                                                                         key: Callable[[str], bytes],
                                                                         node: Any) -> None:
    before = slot_accounting(stats(client))
    region = register(pattern(SLOT, 5))
    reply = raw_put(client, region, [key("d"), key("d")])
    assert reply.results[0].status is KeyStatus.OK
    assert reply.results[1].code == ErrorCode.DUPLICATE_KEY
    with pytest.raises(NodeError) as info:
        ask(client, lambda i: Commit(i, reply.put + 1000))
    assert info.value.code is ErrorCode.UNKNOWN_PUT and info.value.path == "put"
    with Client(node.endpoint, name="itest-puts-other") as other:
        with pytest.raises(NodeError) as info:
            ask(other, lambda i: Commit(i, reply.put))
        assert info.value.code is ErrorCode.UNKNOWN_PUT
        with pytest.raises(NodeError) as info:
            ask(other, lambda i: Unput(i, reply.put))
        assert info.value.code is ErrorCode.UNKNOWN_PUT
    ask(client, lambda i: Unput(i, reply.put))
    for again in (Commit, Unput):
        with pytest.raises(NodeError) as info:
            ask(client, lambda i, again=again: again(i, reply.put))
        assert info.value.code is ErrorCode.UNKNOWN_PUT, "a put ends once"
    assert slot_accounting(stats(client)) == before
    # A committed put cannot be committed again, nor abandoned.
    reply = raw_put(client, region, [key("c")])
    done = ask(client, lambda i: Commit(i, reply.put))
    assert isinstance(done, Completion) and done.results[0].status is KeyStatus.STORED
    with pytest.raises(NodeError) as info:
        ask(client, lambda i: Commit(i, reply.put))
    assert info.value.code is ErrorCode.UNKNOWN_PUT


def test_a_key_another_writer_holds_is_busy_for_a_put(client: Client, register: Registrar,
                                                       key: Callable[[str], bytes]) -> None:
    src = pattern(SLOT, 7)
    region = register(src)
    held = raw_put(client, region, [key("w")])
    assert held.put and held.grant is not None
    second = raw_put(client, region, [key("w")])
    assert second.put == 0 and second.results[0].code == ErrorCode.BUSY, "a put does not wait for another writer"
    assert client.query([key("w")]).result(RESULT_TIMEOUT_S)[key("w")].presence.value == "FETCHING"
    # The raw put never wrote its slot: abandoning it frees it, and a put then stores the key.
    ask(client, lambda i: Unput(i, held.put))
    res = client.put({key("w"): [Span("L0", region, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S)
    assert res[key("w")].status is KeyStatus.STORED
    dst = np.zeros(SLOT, np.uint8)
    rd = register(dst)
    assert client.deliver({key("w"): [Span("L0", rd, 0, SLOT)]}).result(RESULT_TIMEOUT_S)[key("w")].ok
    assert np.array_equal(dst, src)


def test_a_put_whose_key_another_writer_holds_keeps_the_memory_until_its_deposit_read_it(
        client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """A ``BUSY`` key goes by deposit, which waits for the other writer and only then reads the
    caller's memory: ``written`` must wait for that read too, or a caller that reuses its
    buffer at ``written`` has other bytes stored under ``STORED``."""
    w, x = key("held"), key("free")
    held = raw_put(client, register(pattern(SLOT, 20)), [w])
    assert held.put
    src = pattern(2 * SLOT, 21)
    original = src.copy()
    region = register(src)
    handle = client.put({w: [Span("L0", region, 0, SLOT, "kv")], x: [Span("L0", region, SLOT, SLOT, "kv")]})
    assert wait_until(lambda: client.query([x]).result(RESULT_TIMEOUT_S)[x].presence.value == "HIT", 10), \
        "the free key was written and committed"
    assert not handle.written.done(), "the held key's deposit has not read the memory yet"
    ask(client, lambda i: Unput(i, held.put))  # the other writer gives up: the deposit reads now
    handle.written.result(RESULT_TIMEOUT_S)
    src[:] = pattern(2 * SLOT, 22)  # the caller reuses its buffer once told it may
    res = handle.result(RESULT_TIMEOUT_S)
    assert res[w].status is KeyStatus.STORED and res[x].status is KeyStatus.STORED
    dst = np.zeros(SLOT, np.uint8)
    rd = register(dst)
    for k, at in ((w, 0), (x, SLOT)):
        assert client.deliver({k: [Span("L0", rd, 0, SLOT)]}).result(RESULT_TIMEOUT_S)[k].ok
        assert np.array_equal(dst, original[at:at + SLOT]), k


def test_an_expired_put_stays_quarantined_until_the_session_names_it(client: Client, register: Registrar,
                                                                      key: Callable[[str], bytes]) -> None:
    before = slot_accounting(stats(client))
    region = register(pattern(SLOT, 8))
    reply = raw_put(client, region, [key("x")], ttl_ms=20)
    assert wait_until(lambda: stats(client)["puts"]["quarantined"] == 1, 10.0)
    st = stats(client)
    assert slot_accounting(st) != before, "a quarantined slot is not free"
    assert st["writing"] == 1
    with pytest.raises(NodeError) as info:
        ask(client, lambda i: Commit(i, reply.put))
    assert info.value.code is ErrorCode.TIMEOUT and info.value.path == "put"
    assert slot_accounting(stats(client)) == before


def test_a_puts_memory_is_free_once_written_with_its_commit_to_come(client: Client, register: Registrar,
                                                                    key: Callable[[str], bytes]) -> None:
    """``put`` returns at once; its handle's ``written`` resolves once its WRITE is terminal
    and the commit's reply resolves the handle, so the caller may overwrite its buffer once
    written and the node still holds what was written."""
    src = pattern(LAYERS * SLOT, 31)
    want = src.copy()
    handle = client.put({key("early"): spans(register(src))})
    handle.written.result(RESULT_TIMEOUT_S)
    src[:] = 0  # the caller's memory is its own again
    assert handle.result(RESULT_TIMEOUT_S)[key("early")].status is KeyStatus.STORED
    assert np.array_equal(read_back(client, register, key("early")), want)


def test_a_deposits_handle_says_written_as_a_puts_does(client: Client, register: Registrar,
                                                       key: Callable[[str], bytes]) -> None:
    """A deposit's ``written`` resolves once the node has read the caller's memory (its
    answer): an integration waits on ``written`` whichever path stored its objects."""
    src = pattern(LAYERS * SLOT, 32)
    want = src.copy()
    handle = client.deposit({key("dep"): spans(register(src))})
    handle.written.result(RESULT_TIMEOUT_S)
    assert handle.done(), "the memory is free only once the node answered"
    src[:] = 0
    assert handle.result(0)[key("dep")].status is KeyStatus.STORED
    assert np.array_equal(read_back(client, register, key("dep")), want)


def test_a_put_a_frozen_node_never_answers_gives_up_at_its_deadline_and_hands_the_slots_back() -> None:
    """A stalled node costs a put its deadline, not the control timeout; its keys fail
    ``TIMEOUT``; the reservation the node makes once it runs again is freed by ``unput``."""
    with short_ipc_dir("pfz") as d, running_node(d, "n", "--pool", "kv:4KiB:16") as node, \
            Client(node.endpoint, name="itest-puts-frozen") as c:
        src = pattern(LAYERS * SLOT, 41)
        r = c.register(src)
        before = slot_accounting(stats(c))
        with frozen(node):
            t0 = time.monotonic()
            handle = c.put({b"frozen": spans(r)}, deadline_ms=200)
            returned = time.monotonic() - t0
            assert not handle.done(), "nothing answered: the put cannot be over"
            res = handle.result(RESULT_TIMEOUT_S)
            took = time.monotonic() - t0
            assert handle.written.done(), "nothing was written: the memory is free"
        assert res[b"frozen"].status is KeyStatus.FAILED and res[b"frozen"].code is ErrorCode.TIMEOUT, res
        assert returned < 0.2 <= took < CONTROL_TIMEOUT_S, "the put waited for the node, or past its deadline"
        assert c.counters()["puts_unanswered"] == 1
        assert wait_until(lambda: c.counters()["puts_handed_back"] == 1, 10.0)
        assert wait_until(lambda: stats(c)["puts"]["open"] == 0, 10.0)
        st = stats(c)
        assert slot_accounting(st) == before and st["puts"]["quarantined"] == 0 and st["writing"] == 0
        # The node serves puts again: the same key is stored and read back byte for byte.
        assert c.put({b"frozen": spans(r)}).result(RESULT_TIMEOUT_S)[b"frozen"].status is KeyStatus.STORED
        dst = np.zeros(LAYERS * SLOT, np.uint8)
        rd = c.register(dst)
        assert c.deliver({b"frozen": [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(LAYERS)]}).result(
            RESULT_TIMEOUT_S)[b"frozen"].ok
        assert np.array_equal(dst, src)
        assert_clean(c)


@pytest.mark.parametrize("how", ["client_transfers off", "version 4"])
def test_without_write_grants_put_deposits(how: str) -> None:
    args = ("--pool", "kv:4KiB:16", *(("--no-client-transfers",) if how == "client_transfers off" else ()))
    with short_ipc_dir("nop") as d, running_node(d, "n", *args) as node, Client(
        node.endpoint, name="itest-puts-none", max_version=4 if how == "version 4" else 5,
    ) as c:
        src = pattern(2 * SLOT, 9)
        r = c.register(src)
        res = c.put({b"k": [Span("a", r, 0, SLOT, "kv"), Span("b", r, SLOT, SLOT, "kv")]}).result(RESULT_TIMEOUT_S)
        assert res[b"k"].status is KeyStatus.STORED and c.counters()["put_fallbacks"] == 1 and c.counters()["puts"] == 0
        assert stats(c)["transfers"]["posted"] == 1, "the node read the bytes"
        dst = np.zeros(2 * SLOT, np.uint8)
        rd = c.register(dst)
        assert c.deliver({b"k": [Span("a", rd, 0, SLOT), Span("b", rd, SLOT, SLOT)]}).result(RESULT_TIMEOUT_S)[b"k"].ok
        assert np.array_equal(dst, src)
        assert_clean(c)


KILLED = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kvcr_client import Client, Span
    c = Client(sys.argv[1], name="itest-puts-killed")
    src = np.full(4 * 4096, 7, np.uint8)
    r = c.register(src)
    said = []
    def hook(stage):  # the WRITE is over; the put never goes on to its commit
        if not said:
            said.append(stage)
            print(stage, flush=True)
        return False
    c._puts.gate = hook
    c.put({b"killed-mid-put": [Span(f"L{i}", r, i * 4096, 4096, "kv") for i in range(4)]})
    time.sleep(600)
""")


def test_a_client_killed_mid_put_gets_its_slots_back_only_once_safe(client: Client, register: Registrar,
                                                                     node: Any) -> None:
    before = slot_accounting(stats(client))
    proc = subprocess.Popen([sys.executable, "-c", KILLED, node.endpoint], stdout=subprocess.PIPE, text=True,
                            env={**os.environ})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "written"
        st = stats(client)
        assert st["puts"]["open"] == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(RESULT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Its session ends for silence; the put is lost, its slots quarantined, not free.
    assert wait_until(lambda: stats(client)["puts"]["lost"] >= 1, 10.0, 0.005)
    st = stats(client)
    assert st["puts"]["quarantined"] == 1 and st["puts"]["quarantined_slots"] == 4
    assert slot_accounting(st) != before and st["writing"] == 1, "quarantined slots are not free"
    # Nothing serves the key or hands its slots out meanwhile: it stays WRITING.
    assert client.query([b"killed-mid-put"]).result(RESULT_TIMEOUT_S)[b"killed-mid-put"].presence.value == "FETCHING"
    # Then the agent is removed and the quarantine passes: every slot comes back.
    assert wait_until(lambda: stats(client)["puts"]["quarantined"] == 0, 20.0)
    st = stats(client)
    assert st["puts"]["freed_late"] >= 1
    assert slot_accounting(st) == before
    assert st["writing"] == 0


def test_a_reconnecting_client_frees_its_old_sessions_puts_at_once(node: Any) -> None:
    """The issue's case: a client with open puts reconnects (new socket, new hello, same
    agent). Its hello presents the old session's resume token (spec section 5.2): the node
    ends that session at once and frees its puts, so their slots are free when the welcome
    comes, not after heartbeat silence and the quarantine; the new session puts again."""
    with Client(node.endpoint, name="itest-puts-resume") as c:
        src = pattern(LAYERS * SLOT, 51)
        r = c.register(src)
        before = slot_accounting(stats(c))
        replies = [raw_put(c, r, [b"resume-%d" % i]) for i in range(3)]  # reserved, never written
        assert all(reply.put for reply in replies) and stats(c)["puts"]["open"] == 3
        first = c.core.welcome
        assert first is not None and len(first.resume) == 16
        welcome = c.reconnect()
        assert welcome.resume and welcome.resume != first.resume
        st = stats(c)
        assert st["puts"]["open"] == 0 and st["puts"]["quarantined"] == 0 and st["writing"] == 0
        assert slot_accounting(st) == before and st["counters"]["sessions_resumed"] >= 1
        # The new session puts the same keys, writes them and reads them back.
        res = c.put({b"resume-0": spans(r)}).result(RESULT_TIMEOUT_S)
        assert res[b"resume-0"].status is KeyStatus.STORED
        dst = np.zeros(LAYERS * SLOT, np.uint8)
        rd = c.register(dst)
        assert c.deliver({b"resume-0": [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(LAYERS)]}).result(
            RESULT_TIMEOUT_S)[b"resume-0"].ok
        assert np.array_equal(dst, src)
        assert_clean(c)


def test_a_reconnect_while_a_put_writes_presents_no_token(node: Any, client: Client) -> None:
    """While a WRITE of a put may still land, the client presents no resume token: the old
    session ends as the node finds it gone, its put quarantined while the client's agent is
    connected, and freed once it leaves (spec section 6.13)."""
    with Client(node.endpoint, name="itest-puts-busy") as c:
        src = pattern(LAYERS * SLOT, 52)
        r = c.register(src)
        written, release = threading.Event(), threading.Event()

        def hook(stage: str) -> bool:  # the WRITE is over; the commit waits for ``release``
            written.set()
            return release.is_set()

        c._puts.gate = hook
        resumed = stats(c)["counters"].get("sessions_resumed", 0)
        handle = c.put({b"busy": spans(r)})
        try:
            assert written.wait(RESULT_TIMEOUT_S)
            assert not handle.written.done()
            c.reconnect()
            assert c.counters()["resumes_held"] == 1
            assert stats(c)["counters"].get("sessions_resumed", 0) == resumed, "no token: nothing ended at once"
        finally:
            release.set()
        handle.written.result(RESULT_TIMEOUT_S)
        c._puts.gate = None
        assert wait_until(lambda: stats(c)["puts"]["quarantined"] == 1, 10.0)
    assert wait_until(lambda: stats(client)["puts"]["quarantined"] == 0, 20.0)


def test_reconnect_churn_with_open_puts_leaves_slots_and_tables_at_their_bound(node: Any) -> None:
    """A hundred reconnects, each leaving open puts behind: each hello frees the last
    session's, so the client's share never fills, and the node's tables, threads, descriptors
    and RSS end where they began."""
    with Client(node.endpoint, name="itest-puts-churn") as c:
        r = c.register(pattern(LAYERS * SLOT, 53))
        before = slot_accounting(stats(c))
        tables = dict(stats(c)["tables"])
        pid = node.proc.pid
        fds, threads, rss = fd_count(pid), thread_count(pid), rss_kib(pid)
        resumed = stats(c)["counters"].get("sessions_resumed", 0)
        for i in range(100):
            assert raw_put(c, r, [b"churn-%d" % i]).put, i  # refused BUSY if old sessions' puts held slots
            c.reconnect()
        st = stats(c)
        assert st["counters"]["sessions_resumed"] - resumed == 100
        assert slot_accounting(st) == before and st["puts"]["open"] == 0 and st["puts"]["quarantined"] == 0
        assert st["tables"] == tables, (st["tables"], tables)
        assert fd_count(pid) <= fds + FD_SLACK and thread_count(pid) <= threads + THREAD_SLACK
        assert rss_kib(pid) <= rss + RSS_GROWTH_KIB
        assert_clean(c)
