"""The inventory event stream of a real ``kvcr-node`` (spec section 15).

A subscriber that follows a node through deposits and FIFO evictions ends with exactly
the node's own index (the keys a query finds there), in the right pools and tier; one
that loses a range of batches, or connects late, recovers them by replay; hostile replay
requests get an answer that names the field, and the node goes on, clean.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from kvcr_client import ArgumentError, Client, KeyStatus, Presence
from kvcr_client.events import EventStream, InventoryMirror
from kvcr_node.event_publisher import REPLAY_MAX_FRAME
from kvcr_node.inventory import REPLAY_MAX_BATCHES
from kvcr_node.replays import REPLAY_HWM, REQUESTER_BYTES
from kvcr_protocol import ErrorCode
from kvcr_protocol.events import (
    END_SEQ_FRAME,
    Cleared,
    EventBatch,
    Removed,
    Stored,
    decode_batch,
    decode_replay_end,
    encode_replay_request,
)
from kvcr_testing.health import assert_clean, counter, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar, plain_layout
from kvcr_testing.measure import rss_kib
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, pattern
from kvcr_testing.remote import Sites, deliver_checked

SLOT = 4 * KiB
SLOTS = 16
FOLLOW_TIMEOUT_S = 15.0
"""How long a subscriber may take to see what the node did."""
RAW_TIMEOUT_MS = 5000


@contextmanager
def events_node(node_factory: Callable[..., NodeProcess], ipc_dir: Path) -> Iterator[tuple[NodeProcess, str]]:
    """A node of one small FIFO pool publishing inventory events; yields it and its events endpoint."""
    endpoint = f"ipc://{ipc_dir}/events.sock"
    node = node_factory("--pool", f"kv:4KiB:{SLOTS}", "--pool", "big:4KiB:8", "--policy", "fifo",
                        "--events-endpoint", endpoint)
    assert any("inventory events on" in line for line in node.output) or wait_until(
        lambda: any("inventory events on" in line for line in node.output), 5.0)
    yield node, endpoint


def deposit(client: Client, register: Registrar, keys: list[bytes], seed: int, spans: int = 1, pool: str = "kv") -> None:
    layout = plain_layout(spans, pool, SLOT)
    src = pattern(layout.nbytes * len(keys), seed)
    region = register(src)
    objects = {k: layout.source_spans(region, i * layout.nbytes) for i, k in enumerate(keys)}
    results = client.deposit(objects).result(RESULT_TIMEOUT_S)
    assert all(results[k].status is KeyStatus.STORED for k in keys), results


def held(client: Client, keys: list[bytes]) -> set[bytes]:
    """The node's own index over ``keys``: those a query finds there."""
    presences = client.query(keys).result(RESULT_TIMEOUT_S)
    return {k for k in keys if presences[k].presence is Presence.HIT}


def follow(stream: EventStream, mirror: InventoryMirror, want: set[bytes]) -> bool:
    """Apply what arrives until the mirror holds exactly ``want`` (bounded)."""
    def caught_up() -> bool:
        for _, batch in stream.recv(0.05):
            mirror.apply(batch)
        return set(mirror.keys) == want
    return wait_until(caught_up, FOLLOW_TIMEOUT_S)


def churn(client: Client, register: Registrar, rounds: int, tag: str) -> list[bytes]:
    """Deposits that overfill the FIFO pools (so older objects are evicted); returns every key deposited."""
    keys: list[bytes] = []
    for r in range(rounds):
        batch = [f"{tag}/{r}/{i}".encode() for i in range(3)]
        deposit(client, register, batch, seed=r)
        keys += batch
        if r % 4 == 0:
            two = [f"{tag}/{r}/big".encode()]
            deposit(client, register, two, seed=100 + r, spans=2, pool="big")
            keys += two
    return keys


def test_subscriber_follows_deposits_and_evictions_to_the_nodes_index(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    with events_node(node_factory, ipc_dir) as (node, endpoint), Client(node.endpoint, name="events") as client, \
            EventStream(endpoint) as stream:
        reg = Registrar(client)
        mirror = InventoryMirror()
        seen: list[EventBatch] = []
        keys = churn(client, reg, 20, "follow")
        want = held(client, keys)
        st = stats(client)
        assert st["evictions"]["kv"] > 0 and st["evictions"]["big"] > 0, st["evictions"]
        assert 0 < len(want) < len(keys)

        def caught_up() -> bool:
            for _, batch in stream.recv(0.05):
                seen.append(batch)
                mirror.apply(batch)
            return set(mirror.keys) == want
        assert wait_until(caught_up, FOLLOW_TIMEOUT_S), (sorted(set(mirror.keys) ^ want))
        assert stream.complete and mirror.incarnation == st["incarnation"] and mirror.node == st["node"]
        # The incarnation began with cleared; evictions came as removed events of their pool.
        assert isinstance(seen[0].events[0], Cleared)
        removed = [e for b in seen for e in b.events if isinstance(e, Removed)]
        assert removed and all(e.reason.value == "evicted" and e.tier == "dram" for e in removed)
        for key in want:
            assert list(mirror.keys[key]) == ["dram"]
            assert mirror.keys[key]["dram"].pools == (("big",) if key.endswith(b"/big") else ("kv",))
        stored = sum(len(e.keys) for b in seen for e in b.events if isinstance(e, Stored))
        assert stored == len(keys)
        reg.close()
        st = assert_clean(client)
        assert st["tables"]["events_ring"] == stream.expected and st["tables"]["events_pending"] == 0
        # Stopping says cleared, so a router forgets the node's keys.
        assert node.stop() == 0
        assert follow(stream, mirror, set())


def test_stored_events_carry_the_parents_that_deposits_and_puts_name(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    """Blocks of one sequence stored with their parents, by a deposit and by a put under a
    write grant: a subscriber learns each key's parent (spec section 15.2), so a router can
    build the tree of prefixes; a call naming parents badly is refused before it is sent."""
    with events_node(node_factory, ipc_dir) as (node, endpoint), Client(node.endpoint, name="events") as client, \
            EventStream(endpoint) as stream:
        reg = Registrar(client)
        layout = plain_layout(1, "kv", SLOT)
        src = pattern(layout.nbytes * 6, 5)
        region = reg(src)
        keys = [b"seq/%d" % i for i in range(6)]
        spans = {k: layout.source_spans(region, i * layout.nbytes) for i, k in enumerate(keys)}
        chain = {keys[i]: keys[i - 1] for i in range(1, 6)}
        first = client.deposit({k: spans[k] for k in keys[:3]}, parents={k: chain[k] for k in keys[1:3]})
        assert all(r.status is KeyStatus.STORED for r in first.result(RESULT_TIMEOUT_S).values())
        second = client.put({k: spans[k] for k in keys[3:]}, parents={k: chain[k] for k in keys[3:]})
        assert all(r.status is KeyStatus.STORED for r in second.result(RESULT_TIMEOUT_S).values())
        assert client.counters()["puts"] == 1, "the put went under a write grant"
        mirror = InventoryMirror()
        assert follow(stream, mirror, set(keys))
        assert mirror.parents == chain

        # Well-formed but hostile parents: the longest a key may be, a cycle, and keys
        # another session stored. The node keeps them only to publish them.
        with Client(node.endpoint, name="other") as other:
            long_parent = b"p" * 256
            hostile = {b"h/a": b"h/b", b"h/b": b"h/a", b"h/c": keys[0], b"h/d": long_parent}
            region2 = other.register(src)
            got = other.deposit({k: layout.source_spans(region2, i * layout.nbytes) for i, k in enumerate(hostile)},
                                parents=hostile).result(RESULT_TIMEOUT_S)
            assert all(r.status is KeyStatus.STORED for r in got.values()), got
            other.unregister(region2)
            assert follow(stream, mirror, {*keys, *hostile})
            assert {k: mirror.parents[k] for k in hostile} == hostile
            assert_clean(other)

        for parents, path in [({b"seq/9": b"seq/0"}, "parents[b'seq/9']"), ({b"x": b"x"}, "parents[b'x']"),
                              ({b"x": b""}, "parents[b'x']"), ([(b"x", b"w")], "parents")]:
            with pytest.raises(ArgumentError) as info:
                client.deposit({b"x": spans[keys[0]]}, parents=parents)  # type: ignore[arg-type]
            assert info.value.field == path, info.value
        reg.close()
        assert_clean(client)


def test_a_fetch_from_a_source_publishes_the_parents_it_names(sites: Sites, ipc_dir: Path) -> None:
    """Blocks fetched from another node (spec section 6.4, "Parents": ``fetch`` names them as
    ``deposit`` does) are published by the fetching node with those parents, so the router
    sees the tree at the node that now holds them, and the bytes are the source's."""
    events = f"ipc://{ipc_dir}/fetch-events.sock"
    a, b = sites.start(("a", {"args": ("--events-endpoint", events)}), "b")
    layout = plain_layout(2, "kv")
    keys = [b"chain/%d" % i for i in range(3)]
    sources = {k: b.deposit(k, layout, seed=40 + i) for i, k in enumerate(keys)}
    a.client.submit_hint("fetch-parents", b.endpoint, keys).result(RESULT_TIMEOUT_S)
    with EventStream(events) as stream:
        mirror = InventoryMirror()
        assert follow(stream, mirror, set())
        expected = {k: [(name, pool) for name, pool, _ in layout.spans] for k in keys}
        chain = {keys[1]: keys[0], keys[2]: keys[1]}
        got = a.client.fetch(expected, request_id="fetch-parents", parents=chain).result(RESULT_TIMEOUT_S)
        assert all(r.status is KeyStatus.OK for r in got.values()), got
        assert follow(stream, mirror, set(keys))
        assert mirror.parents == chain
        a.resident.update({k: ("kv", "kv") for k in keys})
        for i, k in enumerate(keys):
            deliver_checked(a, k, layout, sources[k], range(2), seed=50 + i)
        released = a.client.release([r.handle for r in got.values() if r.handle is not None]).result(RESULT_TIMEOUT_S)
        assert all(r.status is KeyStatus.OK for r in released.values()), released


class Lossy(EventStream):
    """A subscriber whose network loses every published batch with a seq in ``lose``."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.lose = range(0)
        self.dropped = 0

    def _published(self, timeout: float) -> tuple[int, bytes] | None:
        while (message := super()._published(timeout)) is not None and message[0] in self.lose:
            self.dropped += 1
        return message


def test_lost_range_and_late_start_are_recovered_by_replay(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    with events_node(node_factory, ipc_dir) as (node, endpoint), Client(node.endpoint, name="events") as client, \
            Lossy(endpoint) as lossy:
        reg = Registrar(client)
        keys = churn(client, reg, 6, "early")
        mirror = InventoryMirror()
        assert follow(lossy, mirror, held(client, keys))
        # From now on the network loses ten batches; the next one that arrives shows the gap.
        lossy.lose = range(lossy.expected + 2, lossy.expected + 12)
        replays = lossy.replays
        # A subscriber that connects only now asks for the incarnation from its start.
        with EventStream(endpoint) as late:
            keys += churn(client, reg, 14, "later")
            want = held(client, keys)
            late_mirror = InventoryMirror()
            assert follow(lossy, mirror, want), sorted(set(mirror.keys) ^ want)
            assert follow(late, late_mirror, want), sorted(set(late_mirror.keys) ^ want)
            assert lossy.dropped == 10 and lossy.replays > replays and lossy.complete
            assert late.replays >= 1 and late.complete and late.expected == lossy.expected
            # sync asks the node directly: nothing newer is missing.
            assert lossy.sync() == [] and lossy.last_end is not None and lossy.expected == lossy.last_end.next
        reg.close()
        assert_clean(client)


def test_a_restarted_node_is_followed_from_its_new_incarnation(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    mirror = InventoryMirror()
    with events_node(node_factory, ipc_dir) as (first, endpoint), EventStream(endpoint) as stream:
        with Client(first.endpoint, name="events") as client:
            reg = Registrar(client)
            deposit(client, reg, [b"old-1", b"old-2"], seed=1)
            assert follow(stream, mirror, {b"old-1", b"old-2"})
            old = mirror.incarnation
            reg.close()
        assert first.stop() == 0
        assert follow(stream, mirror, set())  # the stop's cleared
        with events_node(node_factory, ipc_dir) as (second, _), Client(second.endpoint, name="events") as client:
            reg = Registrar(client)
            deposit(client, reg, [b"new-1"], seed=2)
            assert follow(stream, mirror, {b"new-1"})
            assert mirror.incarnation == stats(client)["incarnation"] != old and stream.complete
            reg.close()
            assert_clean(client)


def raw_replay(endpoint: str, frames: list[bytes]) -> list[list[bytes]]:
    """Send ``frames`` to the replay socket; every message of the answer, up to the end message."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint + ".replay")
        sock.send_multipart(frames)
        answer: list[list[bytes]] = []
        while True:
            assert sock.poll(RAW_TIMEOUT_MS), "no replay answer"
            message = sock.recv_multipart()
            answer.append(message)
            if message[1] == END_SEQ_FRAME:
                sock.close(0)
                return answer
    finally:
        ctx.destroy(linger=0)  # closes the socket too, should an assertion leave it open


@pytest.mark.parametrize(
    ("frames", "code", "path"),
    [
        ([b"", b"\xff" * 8], "OUT_OF_RANGE", "replay.start"),
        ([b"", (1 << 62).to_bytes(8, "big")], "OUT_OF_RANGE", "replay.start"),
        ([b"", b"\x00" * 7], "MALFORMED", "replay.start"),
        ([b"", b"\x00" * 9], "MALFORMED", "replay.start"),
        ([b"\x00" * 8], "MALFORMED", "replay"),
        ([b"", b"\x00" * 8, b"more"], "MALFORMED", "replay"),
        ([b"x", b"\x00" * 8], "MALFORMED", "replay"),
    ],
    ids=["negative", "past-next", "short", "long", "no-delimiter", "extra-frame", "bad-delimiter"],
)
def test_hostile_replay_requests_get_a_clear_answer(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path, frames: list[bytes], code: str, path: str,
) -> None:
    with events_node(node_factory, ipc_dir) as (node, endpoint), Client(node.endpoint, name="events") as client:
        reg = Registrar(client)
        deposit(client, reg, [b"k1", b"k2"], seed=1)
        [end_frames] = raw_replay(endpoint, frames)
        end = decode_replay_end(end_frames[2])
        assert (ErrorCode(end.code).name, end.path) == (code, path) and end.reason
        assert end.oldest == 0 and end.next >= 2
        # The node goes on: a valid request replays the incarnation from its start.
        answer = raw_replay(endpoint, encode_replay_request(0))
        batches = [decode_batch(m[2]) for m in answer[:-1]]
        assert [int.from_bytes(m[1], "big") for m in answer[:-1]] == list(range(len(batches)))
        assert decode_replay_end(answer[-1][2]).ok
        mirror = InventoryMirror()
        for b in batches:
            mirror.apply(b)
        assert set(mirror.keys) == {b"k1", b"k2"}
        reg.close()
        st = assert_clean(client)
        assert counter(st, "events_replays_refused") == 1 and counter(st, "events_replays") == 1



CUT_REQUESTS_MAX = 200
"""Replay requests a requester that never reads sends at most before its queue must overflow."""


def test_a_requester_that_never_reads_has_its_answers_cut_and_the_node_goes_on(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    with events_node(node_factory, ipc_dir) as (node, endpoint), Client(node.endpoint, name="events") as client:
        reg = Registrar(client)
        for i in range(REPLAY_MAX_BATCHES + 8):  # one batch a deposit: whole replay answers are 513 messages
            deposit(client, reg, [f"cut-{i}".encode()], seed=i)
        ctx = zmq.Context()
        try:
            hog = ctx.socket(zmq.DEALER)
            hog.setsockopt(zmq.RCVHWM, 1)
            hog.connect(endpoint + ".replay")

            def cut() -> bool:
                return counter(stats(client), "events_replay_cut") >= 1

            for _ in range(CUT_REQUESTS_MAX):  # asks again and again, reads nothing
                hog.send_multipart(encode_replay_request(0))
                if wait_until(cut, 0.2):
                    break
            assert cut(), "the replay queue of a requester that never reads never filled"
        finally:
            ctx.destroy(linger=0)
        # The node goes on, and a requester that reads gets whole answers.
        answer = raw_replay(endpoint, encode_replay_request(0))
        assert len(answer) == REPLAY_MAX_BATCHES + 1 and decode_replay_end(answer[-1][2]).ok
        reg.close()
        assert_clean(client)


# ------------------------------------------------------------------ replay budgets (spec section 15.4)

BIG_KEY = 250
"""Bytes of the keys of the budget tests: batches near ``BATCH_MAX_BYTES``, so queues fill with bytes."""
BIG_DEPOSITS = 16
BIG_KEYS_PER_DEPOSIT = 1000
HOGS = 20
HOG_REQUESTS = 20
FLOOD_TIMEOUT_S = 30.0
"""How long the node may take to cut every hog's answer (each is cut ``REPLAY_STALL_S`` after it stops)."""
RSS_SLACK_MIB = 24
"""RSS a flood may add beyond what the budgets allow (allocator arenas, ZeroMQ's buffers per connection)."""
QUERY_TIMEOUT_S = 5.0


def big_node(node_factory: Callable[..., NodeProcess], ipc_dir: Path, *extra: str) -> tuple[NodeProcess, str]:
    endpoint = f"ipc://{ipc_dir}/big-events.sock"
    node = node_factory("--pool", "kv:1KiB:2048", "--policy", "fifo", "--events-endpoint", endpoint, *extra)
    assert wait_until(lambda: any("inventory events on" in line for line in node.output), 5.0)
    return node, endpoint


def fill_ring(client: Client, register: Registrar) -> list[bytes]:
    """Deposits of many long keys, evicting older ones: the ring fills with batches of about 128 KiB."""
    layout = plain_layout(1, "kv", KiB)
    src = pattern(layout.nbytes * BIG_KEYS_PER_DEPOSIT, 7)
    region = register(src)
    keys: list[bytes] = []
    for d in range(BIG_DEPOSITS):
        batch = [b"%02d-%05d-" % (d, i) + b"k" * (BIG_KEY - 9) for i in range(BIG_KEYS_PER_DEPOSIT)]
        objects = {k: layout.source_spans(region, i * layout.nbytes) for i, k in enumerate(batch)}
        results = client.deposit(objects).result(RESULT_TIMEOUT_S)
        assert all(results[k].status is KeyStatus.STORED for k in batch)
        keys += batch
    return keys


@contextmanager
def hogs(endpoint: str, count: int, requests: int) -> Iterator[list[zmq.Socket[bytes]]]:
    """``count`` requesters that each ask ``requests`` times from seq 0 and never read."""
    ctx = zmq.Context()
    try:
        socks = []
        for _ in range(count):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 64 * KiB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint + ".replay")
            socks.append(sock)
        for _ in range(requests):
            for sock in socks:
                sock.send_multipart(encode_replay_request(0))
        yield socks
    finally:
        ctx.destroy(linger=0)


def whole_answer(endpoint: str) -> tuple[list[int], object]:
    """A requester that reads: the seqs of one answer from 0, and its end."""
    answer = raw_replay(endpoint, encode_replay_request(0))
    return [int.from_bytes(m[1], "big") for m in answer[:-1]], decode_replay_end(answer[-1][2])


def test_a_request_frame_too_large_closes_its_connection_and_the_node_goes_on(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    with events_node(node_factory, ipc_dir) as (node, endpoint), Client(node.endpoint, name="events") as client:
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint + ".replay")
            sock.send_multipart([b"", b"\x00" * (REPLAY_MAX_FRAME + 1)])
            assert not sock.poll(200), "a request past the frame bound was answered"
        finally:
            ctx.destroy(linger=0)
        answer = raw_replay(endpoint, encode_replay_request(0))
        assert decode_replay_end(answer[-1][2]).ok
        st = assert_clean(client)
        assert counter(st, "events_replays_refused") == 0 and st["tables"]["events_replay_requesters"] <= 1


def test_requesters_that_never_read_cost_bounded_memory_and_the_node_goes_on(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    """20 requesters x 20 requests that never read (the audit's flood): the node's RSS grows
    by at most their queues' bytes (``REQUESTER_BYTES`` each), each hog's answer is cut and its
    repeated requests refused BUSY, queries and a reading requester are served meanwhile, and
    the requester table is empty once the hogs disconnect."""
    node, endpoint = big_node(node_factory, ipc_dir)
    with Client(node.endpoint, name="events") as client:
        reg = Registrar(client)
        keys = fill_ring(client, reg)
        st = stats(client)
        ring_bytes = st["tables"]["events_ring_bytes"]
        assert st["tables"]["events_ring"] > 2 * REPLAY_HWM and ring_bytes > 4 << 20, st["tables"]
        seqs, end = whole_answer(endpoint)  # warm: the ring and a whole answer's copies were made once
        assert end.ok and seqs == list(range(end.next))  # type: ignore[attr-defined]
        before = rss_kib(node.proc.pid)
        peak = before
        latencies: list[float] = []
        probe = keys[-3:]

        def query() -> None:
            start = time.monotonic()
            assert held(client, probe) == set(probe)
            latencies.append(time.monotonic() - start)

        with hogs(endpoint, HOGS, HOG_REQUESTS):
            def all_cut() -> bool:
                nonlocal peak
                query()
                peak = max(peak, rss_kib(node.proc.pid))
                return counter(stats(client), "events_replay_cut") >= HOGS

            assert wait_until(all_cut, FLOOD_TIMEOUT_S, 0.05), stats(client)["counters"]
            st = stats(client)
            assert counter(st, "events_replays_busy") >= HOGS * (HOG_REQUESTS - 1) - HOGS, st["counters"]
            tables = st["tables"]
            assert tables["events_replay_requesters"] == HOGS and tables["events_replay_answers"] <= HOGS, tables
            assert 0 < tables["events_replay_queued_bytes"] <= HOGS * REQUESTER_BYTES, tables
            # A requester that reads is served whole while the hogs hold their queues.
            seqs, end = whole_answer(endpoint)
            assert end.ok and seqs == list(range(end.next))  # type: ignore[attr-defined]
            peak = max(peak, rss_kib(node.proc.pid))
        grown_mib = (peak - before) / 1024
        bound_mib = HOGS * REQUESTER_BYTES / (1 << 20) + RSS_SLACK_MIB
        assert grown_mib <= bound_mib, (f"RSS grew {grown_mib:.0f} MiB (bound {bound_mib:.0f}) "
                                        f"for {HOGS} x {HOG_REQUESTS} requests of a {ring_bytes >> 20} MiB ring")
        assert max(latencies) < QUERY_TIMEOUT_S and len(latencies) > 1
        # Disconnected, the hogs are forgotten: the table is back to zero, their bytes with it.
        assert wait_until(lambda: stats(client)["tables"]["events_replay_requesters"] == 0, FOLLOW_TIMEOUT_S)
        st = stats(client)
        assert st["tables"]["events_replay_queued_bytes"] == 0 and st["tables"]["events_replay_answers"] == 0
        reg.close()
        assert_clean(client)


def test_past_the_requester_and_byte_budgets_the_end_message_says_busy(
    node_factory: Callable[..., NodeProcess], ipc_dir: Path,
) -> None:
    """A node that tracks 3 requesters within two requesters' queues of bytes: a fourth is
    refused ``BUSY`` naming the bound (the reference subscriber takes it as "nothing more
    now"); a hog's answer waits on the budget and is cut; once the hogs leave, a requester
    that reads is served whole."""
    node, endpoint = big_node(node_factory, ipc_dir, "--events-replay-requesters", "3",
                              "--events-replay-bytes", str(2 * REQUESTER_BYTES))
    with Client(node.endpoint, name="events") as client, EventStream(endpoint) as stream:
        reg = Registrar(client)
        fill_ring(client, reg)
        with hogs(endpoint, 3, 1):
            assert wait_until(lambda: counter(stats(client), "events_replay_cut") >= 3, FLOOD_TIMEOUT_S)
            [refusal] = raw_replay(endpoint, encode_replay_request(0))
            end = decode_replay_end(refusal[2])
            assert (ErrorCode(end.code), end.path) == (ErrorCode.BUSY, "replay") and "3 replay requesters" in end.reason
            st = stats(client)
            assert counter(st, "events_replays_busy") == 1 and st["tables"]["events_replay_requesters"] == 3
            assert st["tables"]["events_replay_queued_bytes"] <= 2 * REQUESTER_BYTES
            stream.sync()  # learns the incarnation
            assert stream.sync() == [] and stream.last_end is not None and stream.last_end.code == ErrorCode.BUSY
        assert wait_until(lambda: stats(client)["tables"]["events_replay_requesters"] == 0, FOLLOW_TIMEOUT_S)
        seqs, end = whole_answer(endpoint)
        assert end.ok and seqs == list(range(end.next))  # type: ignore[attr-defined]
        # Once the hogs left, the subscriber catches up.
        assert [seq for seq, _ in stream.sync()] == seqs and stream.last_end.ok
        reg.close()
        assert_clean(client)
