"""Cross-node delivery between real node processes (spec section 8, architecture §4, spec section 12).

Node A is where the client connects; node B (and C) hold the objects, named to A by a
request's hint. B writes from its pool straight into the client's memory. Every
delivered byte is compared with the patterned deposit; every refused delivery must leave
the destination's own pattern untouched; after each test every surviving node is at rest
(no claim, no breach, nothing pending, no write to a peer outstanding) and its allocated
slots are exactly those of the objects the test knows it holds.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from pathlib import Path
from typing import Any

import zmq

from kvcr_client import ErrorCode, Presence, Span
from kvcr_io.agent import Agent
from kvcr_protocol import (
    CURRENT_VERSION,
    Deliver,
    DeliverItem,
    DstSpan,
    Error,
    Heartbeat,
    PeerClient,
    PeerHello,
    PeerWelcome,
    Refuse,
    WriteRequest,
    decode,
    encode,
)
from kvcr_testing.health import counter, outcome_count, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, hybrid_layout, plain_layout
from kvcr_testing.nodes import start_node
from kvcr_testing.patterns import KiB
from kvcr_testing.remote import (
    FAILED,
    OK,
    POOLS,
    Dest,
    Sites,
    assert_site_clean,
    deliver_checked,
    expect,
    poll_stats,
)

DEFERRED_SOURCE = Path(__file__).resolve().parents[2] / "bench" / "deferred_source.py"
"""The benchmark's launcher of a source node that submits peer writes a loop turn late."""


def hinted(site: Any, request_id: str, source: Any, keys: list[bytes]) -> str:
    site.client.submit_hint(request_id, source.endpoint, keys).result(RESULT_TIMEOUT_S)
    return request_id


# --------------------------------------------------------------------------- byte-exact remote delivery


def test_remote_whole_and_progressive_subsets(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = plain_layout(8)
    src = b.deposit(b"k", layout, seed=1)

    assert a.client.query([b"k"]).result(5)[b"k"].presence is Presence.MISS
    rid = hinted(a, "r1", b, [b"k"])
    presence = a.client.query([b"k"], request_id=rid).result(5)[b"k"]
    assert presence.presence is Presence.FETCHABLE, presence

    deliver_checked(a, b"k", layout, src, range(8), seed=100, request_id=rid)
    deliver_checked(a, b"k", layout, src, range(8), seed=101, request_id=rid, reverse=True)

    # Progressive: the first layer, then the rest, into one buffer.
    dst = Dest(a, layout, range(8), seed=102)
    first = a.client.deliver({b"k": dst.spans[:1]}, request_id=rid, partial=True).result(RESULT_TIMEOUT_S)[b"k"]
    expect(first, OK)
    # After the first layer only its bytes have landed.
    partial_expected = dst.before.copy()
    partial_expected[dst.offsets[0] : dst.offsets[0] + 64 * KiB] = layout.src_bytes(src, 0)
    assert (dst.buf == partial_expected).all()
    rest = a.client.deliver({b"k": dst.spans[1:]}, request_id=rid, partial=True).result(RESULT_TIMEOUT_S)[b"k"]
    expect(rest, OK)
    dst.assert_delivered(src)

    # Other ordered subsets, one span at a time and scattered.
    for n, indices in enumerate(([7], [0, 2, 5], [1, 3, 4, 6], list(range(1, 8)))):
        deliver_checked(a, b"k", layout, src, indices, seed=110 + n, request_id=rid, partial=True)
    # A subset without ``partial`` reaches B as a whole-layout request and fails closed there.
    deliver_checked(a, b"k", layout, None, [0], seed=120, request_id=rid, code=ErrorCode.LAYOUT_SUBSET_INVALID)
    # Invalid subsets fail closed even with the flag (B projects them like a local deliver).
    for n, indices in enumerate(([2, 1], [0, 0])):
        dst = Dest(a, layout, [0, 1], seed=130 + n)
        spans = [Span(layout.names[i], dst.region, dst.offsets[j], 64 * KiB) for j, i in enumerate(indices)]
        out = a.client.deliver({b"k": spans}, request_id=rid, partial=True).result(RESULT_TIMEOUT_S)[b"k"]
        expect(out, FAILED, ErrorCode.LAYOUT_SUBSET_INVALID)
        dst.assert_untouched()

    sb, sa = b.stats(), a.stats()
    # Every write named a READY key: each was submitted (or refused) in the turn that decoded it.
    assert counter(sb, "writes_inline") == outcome_count(sb, "write."), sb["counters"]
    assert counter(sb, "writes_deferred") == 0, sb["counters"]
    assert sa["peers"][b.endpoint]["state"] == "ready"
    assert sa["peers"][b.endpoint]["version"] == CURRENT_VERSION
    assert sa["peers"][b.endpoint]["incarnation"] == sb["incarnation"]


def test_remote_hybrid_layout(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = hybrid_layout(3)  # L0.full L0.swa L1.full L1.swa L2.full L2.swa state
    src = b.deposit(b"hy", layout, seed=2)
    rid = hinted(a, "rh", b, [b"hy"])

    deliver_checked(a, b"hy", layout, src, range(len(layout.spans)), seed=200, request_id=rid)
    deliver_checked(a, b"hy", layout, src, range(len(layout.spans)), seed=201, request_id=rid, reverse=True)
    # Layer by layer into one buffer, then the state.
    dst = Dest(a, layout, range(len(layout.spans)), seed=202)
    for group in ([0, 1], [2, 3], [4, 5], [6]):
        spans = [dst.spans[i] for i in group]
        expect(a.client.deliver({b"hy": spans}, request_id=rid, partial=True).result(RESULT_TIMEOUT_S)[b"hy"], OK)
    dst.assert_delivered(src)
    for n, indices in enumerate(([6], [1, 3, 5], [0, 6])):
        deliver_checked(a, b"hy", layout, src, indices, seed=210 + n, request_id=rid, partial=True)
    # A destination span of the wrong size: SIZE_MISMATCH at B, nothing written.
    dst = Dest(a, Layout([("L0.full", "full", 16 * KiB)]), [0], seed=220)
    out = a.client.deliver({b"hy": dst.spans}, request_id=rid, partial=True).result(RESULT_TIMEOUT_S)[b"hy"]
    expect(out, FAILED, ErrorCode.SIZE_MISMATCH)
    dst.assert_untouched()


def test_remote_fetch_then_local_deliver(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = hybrid_layout(2)
    src = b.deposit(b"f", layout, seed=3)
    rid = hinted(a, "rf", b, [b"f", b"f-wrong"])
    b.deposit(b"f-wrong", layout, seed=4)
    before = a.stats()["pools"]

    expected = {b"f": [(name, pool) for name, pool, _ in layout.spans]}
    res = a.client.fetch(expected, request_id=rid).result(RESULT_TIMEOUT_S)[b"f"]
    expect(res, OK)
    assert res.handle is not None
    a.resident[b"f"] = tuple(pool for _, pool, _ in layout.spans)
    assert a.client.query([b"f"]).result(5)[b"f"].presence is Presence.HIT
    after = a.stats()
    for pool, p in after["pools"].items():
        used = sum(1 for _, sp, _ in layout.spans if sp == pool)
        assert p["allocated"] == before[pool]["allocated"] + used, (pool, p)
    remote_writes = counter(after, "remote_writes")

    # Local deliveries from A now (no hint, no partial flag needed for a subset).
    deliver_checked(a, b"f", layout, src, range(len(layout.spans)), seed=300)
    deliver_checked(a, b"f", layout, src, [0, 1], seed=301)
    deliver_checked(a, b"f", layout, src, [4], seed=302)
    # A second fetch is local: another handle, no remote write.
    again = a.client.fetch(expected, request_id=rid).result(RESULT_TIMEOUT_S)[b"f"]
    expect(again, OK)
    assert counter(a.stats(), "remote_writes") == remote_writes
    # Held: the claims are the two handles.
    assert a.stats()["claims"]["handles"] == 2
    rel = a.client.release([res.handle, again.handle]).result(RESULT_TIMEOUT_S)
    assert all(o.status is OK for o in rel.values()), rel

    # Fetching with a layout the source does not store fails closed, and A frees the slots.
    # (A local fetch says LAYOUT_MISMATCH; the source judges a remote one by its names.)
    wrong = {b"f-wrong": [(name, pool) for name, pool, _ in layout.spans][:-1]}
    out = a.client.fetch(wrong, request_id=rid).result(RESULT_TIMEOUT_S)[b"f-wrong"]
    expect(out, FAILED)
    assert out.code in (ErrorCode.LAYOUT_SUBSET_INVALID, ErrorCode.LAYOUT_MISMATCH), out
    assert a.client.query([b"f-wrong"]).result(5)[b"f-wrong"].presence is Presence.MISS

    # Two fetches of one key at once: one remote write; the second waits on the first's fill.
    src_twice = b.deposit(b"twice", layout, seed=5)
    hinted(a, "rt", b, [b"twice"])
    twice = {b"twice": [(name, pool) for name, pool, _ in layout.spans]}
    remote_writes = counter(a.stats(), "remote_writes")
    h1, h2 = a.client.fetch(twice, request_id="rt"), a.client.fetch(twice, request_id="rt")
    o1, o2 = h1.result(RESULT_TIMEOUT_S)[b"twice"], h2.result(RESULT_TIMEOUT_S)[b"twice"]
    expect(o1, OK)
    expect(o2, OK)
    assert o1.handle != o2.handle
    a.resident[b"twice"] = tuple(pool for _, pool, _ in layout.spans)
    assert counter(a.stats(), "remote_writes") == remote_writes + 1
    deliver_checked(a, b"twice", layout, src_twice, range(len(layout.spans)), seed=303)
    a.client.release([o1.handle, o2.handle]).result(RESULT_TIMEOUT_S)


def test_three_nodes_and_hint_routing(sites: Sites) -> None:
    a, b, c = sites.start("a", "b", "c")
    layout = plain_layout(4)
    src_local = a.deposit(b"local", layout, seed=5)
    src_b = b.deposit(b"kb", layout, seed=6)
    src_c = c.deposit(b"kc", layout, seed=7)
    # The same key on B and C with different bytes: the hint decides which one A uses.
    same_b = b.deposit(b"same", layout, seed=8)
    same_c = c.deposit(b"same", layout, seed=9)
    rb = hinted(a, "rb", b, [b"kb", b"same"])
    rc = hinted(a, "rc", c, [b"kc", b"same"])

    # One batch: a local key, a remote one, and one nobody holds.
    dl, db, dm = Dest(a, layout, range(4), 400), Dest(a, layout, range(4), 401), Dest(a, layout, range(4), 402)
    res = a.client.deliver({b"local": dl.spans, b"kb": db.spans, b"nowhere": dm.spans}, request_id=rb).result(RESULT_TIMEOUT_S)
    expect(res[b"local"], OK)
    expect(res[b"kb"], OK)
    expect(res[b"nowhere"], FAILED, ErrorCode.NOT_FOUND)
    dl.assert_delivered(src_local)
    db.assert_delivered(src_b)
    dm.assert_untouched()

    # Two requests in flight at once, one per source (a hint names one source per request).
    d1, d2 = Dest(a, layout, range(4), 403), Dest(a, layout, [1, 3], 404)
    d3, d4 = Dest(a, layout, range(4), 405), Dest(a, layout, range(4), 406)
    h1 = a.client.deliver({b"kb": d1.spans, b"same": d3.spans}, request_id=rb)
    h2 = a.client.deliver({b"kc": d2.spans, b"same": d4.spans}, request_id=rc, partial=True)
    r1, r2 = h1.result(RESULT_TIMEOUT_S), h2.result(RESULT_TIMEOUT_S)
    assert all(o.status is OK for o in [*r1.values(), *r2.values()]), (r1, r2)
    d1.assert_delivered(src_b)
    d2.assert_delivered(src_c)
    d3.assert_delivered(same_b)
    d4.assert_delivered(same_c)

    # B's key asked for under C's hint: not in that hint, so A answers NOT_FOUND itself.
    deliver_checked(a, b"kb", layout, None, range(4), seed=407, request_id=rc, code=ErrorCode.NOT_FOUND)
    peers = a.stats()["peers"]
    assert set(peers) == {b.endpoint, c.endpoint}, peers
    assert all(p["state"] == "ready" for p in peers.values()), peers


def test_hints_and_absent_keys(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = plain_layout(2)
    src = b.deposit(b"here", layout, seed=10)
    keys = [b"here", b"absent"]
    presence = a.client.query(keys).result(5)
    assert [presence[k].presence for k in keys] == [Presence.MISS, Presence.MISS]
    rid = hinted(a, "rq", b, keys)
    presence = a.client.query([*keys, b"unhinted"], request_id=rid).result(5)
    assert presence[b"here"].presence is Presence.FETCHABLE
    assert presence[b"absent"].presence is Presence.FETCHABLE  # advisory: A does not ask B
    assert presence[b"unhinted"].presence is Presence.MISS

    writes_before = outcome_count(b.stats(), "write.FAILED.NOT_FOUND")
    # Hinted, but B does not hold it: B answers NOT_FOUND, nothing lands.
    deliver_checked(a, b"absent", layout, None, range(2), seed=500, request_id=rid, code=ErrorCode.NOT_FOUND)
    assert outcome_count(b.stats(), "write.FAILED.NOT_FOUND") == writes_before + 1
    fetched = a.client.fetch({b"absent": [("L0", "kv"), ("L1", "kv")]}, request_id=rid).result(RESULT_TIMEOUT_S)
    expect(fetched[b"absent"], FAILED, ErrorCode.NOT_FOUND)
    # One key of a batch fails, the other is delivered.
    d_here, d_absent = Dest(a, layout, range(2), 501), Dest(a, layout, range(2), 502)
    res = a.client.deliver({b"here": d_here.spans, b"absent": d_absent.spans}, request_id=rid).result(RESULT_TIMEOUT_S)
    expect(res[b"here"], OK)
    expect(res[b"absent"], FAILED, ErrorCode.NOT_FOUND)
    d_here.assert_delivered(src)
    d_absent.assert_untouched()

    # Once the hint is discarded, the key is a plain miss again.
    a.client.discard_hint(rid).result(5)
    assert a.client.query([b"here"], request_id=rid).result(5)[b"here"].presence is Presence.MISS
    deliver_checked(a, b"here", layout, None, range(2), seed=503, request_id=rid, code=ErrorCode.NOT_FOUND)
    # A hint naming the node itself is no source.
    hinted(a, "self", a, [b"here"])
    deliver_checked(a, b"here", layout, None, range(2), seed=504, request_id="self", code=ErrorCode.NOT_FOUND)


def test_target_checks_many_span_destinations_before_asking(sites: Sites) -> None:
    """Destinations past the client's checks (raw frames): A refuses them itself and asks B nothing."""
    a, b = sites.start("a", "b")
    n = 24
    layout = plain_layout(n)
    src = b.deposit(b"k", layout, seed=20)
    rid = hinted(a, "rq", b, [b"k"])
    dst = Dest(a, layout, range(n), seed=520, gap=0)
    region, slot = dst.region.region, 64 * KiB

    def raw(spans: list[DstSpan]) -> Any:
        build = lambda i: Deliver(i, (DeliverItem(b"k", tuple(spans)),), rid)  # noqa: E731
        return a.client.core.request(build, lambda m: m, 10.0, True)[1].result(RESULT_TIMEOUT_S).results[0]

    good = [DstSpan(f"L{i}", region, dst.offsets[i], slot) for i in range(n)]
    writes = counter(a.stats(), "remote_writes")
    for spans, where in (
        ([*good[:-1], DstSpan(f"L{n - 1}", region, n * slot - slot + 1, slot)], f"spans[{n - 1}].offset"),
        ([*good[:4], DstSpan("L4", 424242, 0, slot), *good[5:]], "spans[4].region"),
        ([*good[:2], DstSpan("L2", region, (1 << 64) - 1, slot), *good[3:]], "spans[2].offset"),
    ):
        out = raw(spans)
        assert (out.status, out.code) == (FAILED, ErrorCode.BAD_DESCRIPTOR), out
        assert where in out.reason, out.reason
    assert counter(a.stats(), "remote_writes") == writes
    dst.assert_untouched()
    assert raw(good).status is OK
    dst.assert_delivered(src)


class RefusingSource:
    """A source node stand-in: welcomes targets, refuses every client announcement and write."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.agent = Agent(f"refusing-source.{os.getpid()}.{secrets.token_hex(4)}")
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.seen: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        version = 2
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = decode(frame, 2)
            self.seen.append(msg.TAG)
            reply: Any = None
            if isinstance(msg, PeerHello):
                version = max(set(msg.versions) & {1, 2})
                reply = PeerWelcome(msg.id, version, "refusing", 7, self.agent.name, self.agent.metadata())
            elif isinstance(msg, PeerClient):
                reply = Error(msg.id, ErrorCode.BAD_DESCRIPTOR, "client refused for the test", "agent_md")
            elif isinstance(msg, WriteRequest):
                reply = Refuse(msg.id, ErrorCode.BAD_STATE, f"agent {msg.agent!r} was not announced")
            elif isinstance(msg, Heartbeat):
                reply = msg
            if reply is not None:
                self.sock.send_multipart([identity, encode(reply, version)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_refused_client_announcement_is_sent_again(sites: Sites, tmp_path: Path) -> None:
    """A source that refuses a client's announcement gets it again with that client's next write."""
    (a,) = sites.start("a")
    source = RefusingSource(f"ipc://{tmp_path}/refusing.sock")
    try:
        layout = plain_layout(2)
        rid = hinted(a, "rq", source, [b"k"])
        for attempt in range(2):
            dst = Dest(a, layout, range(2), seed=530 + attempt)
            out = a.client.deliver({b"k": dst.spans}, request_id=rid).result(RESULT_TIMEOUT_S)[b"k"]
            expect(out, FAILED, ErrorCode.BAD_STATE)
            dst.assert_untouched()
        # Each write went out after a fresh announcement, not unannounced after the refusal.
        assert source.seen.count("peer_client") == 2, source.seen
        assert source.seen.count("write") == 2, source.seen
        assert counter(a.stats(), "peer_client_refused") == 2
    finally:
        source.close()


def test_evicted_between_query_and_deliver(sites: Sites) -> None:
    a, b = sites.start("a", ("b", {"pools": ("--pool", "kv:64KiB:4")}))
    layout = plain_layout(4)
    b.deposit(b"old", layout, seed=11)
    assert b.client.query([b"old"]).result(5)[b"old"].presence is Presence.HIT
    rid = hinted(a, "re", b, [b"old"])
    assert a.client.query([b"old"], request_id=rid).result(5)[b"old"].presence is Presence.FETCHABLE
    # B's pool holds one object: the next deposit evicts the first.
    src_new = b.deposit(b"new", layout, seed=12)
    assert b.client.query([b"old"]).result(5)[b"old"].presence is Presence.MISS
    deliver_checked(a, b"old", layout, None, range(4), seed=600, request_id=rid, code=ErrorCode.NOT_FOUND)
    deliver_checked(a, b"old", layout, None, [0], seed=601, request_id=rid, partial=True, code=ErrorCode.NOT_FOUND)
    # The evicting object is delivered from the very slots the old one had.
    hinted(a, "rn", b, [b"new"])
    deliver_checked(a, b"new", layout, src_new, range(4), seed=602, request_id="rn")


# --------------------------------------------------------------------------- inline and deferred writes


def test_write_is_submitted_in_the_decoding_turn(sites: Sites) -> None:
    a, b = sites.start("a", "b")
    layout = plain_layout(4)
    src = b.deposit(b"k", layout, seed=13)
    rid = hinted(a, "ri", b, [b"k"])
    for n in range(3):
        deliver_checked(a, b"k", layout, src, range(4), seed=700 + n, request_id=rid)
        st = b.stats()
        assert counter(st, "writes_inline") == n + 1, st["counters"]
        assert counter(st, "writes_deferred") == 0, st["counters"]


def test_deferred_source_launcher(sites: Sites, ipc_dir: Path) -> None:
    """The benchmark's source node that submits writes a turn late (bench/deferred_source.py):
    the same bytes arrive, and it counts every write deferred, none inline."""
    a = sites("a")
    launcher = (str(DEFERRED_SOURCE),)
    b = sites.adopt(start_node(f"ipc://{ipc_dir}/deferred.sock", *POOLS, launcher=launcher), "b")
    layout = plain_layout(4)
    src = b.deposit(b"k", layout, seed=14)
    rid = hinted(a, "rd", b, [b"k"])
    deliver_checked(a, b"k", layout, src, range(4), seed=710, request_id=rid)
    deliver_checked(a, b"k", layout, src, [1, 2], seed=711, request_id=rid, partial=True)
    st = b.stats()
    assert counter(st, "writes_deferred") == 2, st["counters"]
    assert counter(st, "writes_inline") == 0, st["counters"]


def test_write_waits_while_the_source_object_is_writing(sites: Sites) -> None:
    """B is itself fetching the key from a frozen C: A's write waits on B's WRITING entry."""
    a, b, c = sites.start("a", "b", "c")
    layout = plain_layout(4)
    src = c.deposit(b"k", layout, seed=15)
    b_rid = hinted(b, "rb", c, [b"k"])
    a_rid = hinted(a, "ra", b, [b"k"])
    c.node.proc.send_signal(signal.SIGSTOP)
    try:
        fetch = b.client.fetch({b"k": [(n, "kv") for n in layout.names]}, request_id=b_rid, deadline_ms=20_000)
        poll_stats(b, lambda st: st["writing"] == 1, 10, "B's entry WRITING")
        assert b.client.query([b"k"]).result(5)[b"k"].presence is Presence.FETCHING
        dst = Dest(a, layout, range(4), seed=720)
        deliver = a.client.deliver({b"k": dst.spans}, request_id=a_rid, deadline_ms=20_000)
        # A's write reached B and waits there (B's own fetch is the other pending operation).
        st = poll_stats(b, lambda st: st["operations_pending"] == 2, 10, "A's write waiting at B")
        assert counter(st, "writes_inline") == 0
        assert not deliver.done()
        dst.assert_untouched()
    finally:
        c.node.proc.send_signal(signal.SIGCONT)
    fetched = fetch.result(RESULT_TIMEOUT_S)[b"k"]
    expect(fetched, OK)
    b.resident[b"k"] = ("kv",) * 4
    expect(deliver.result(RESULT_TIMEOUT_S)[b"k"], OK)
    dst.assert_delivered(src)
    st = b.stats()
    assert counter(st, "writes_deferred") == 1, st["counters"]
    assert counter(st, "writes_inline") == 0, st["counters"]
    assert fetched.handle is not None
    b.client.release([fetched.handle]).result(RESULT_TIMEOUT_S)
    assert_site_clean(b)


# --------------------------------------------------------------------------- an idle peer session


def test_idle_peer_session_outlives_the_client_grace(sites: Sites) -> None:
    """A target that has nothing to ask of its source for a while keeps its peer session:
    the source must not drop it as a silent client, or the next write is refused."""
    fast = ("--client-grace-ms", "600", "--heartbeat-ms", "150")
    a, b = sites.start(("a", {"args": fast}), ("b", {"args": fast}))
    layout = plain_layout(2)
    src = b.deposit(b"k", layout, seed=16)
    rid = hinted(a, "ridle", b, [b"k"])
    deliver_checked(a, b"k", layout, src, range(2), seed=800, request_id=rid)
    # Idle for more than twice the grace: the peer session must survive it.
    assert not wait_until(lambda: counter(b.stats(), "peers_expired") > 0, 1.5)
    assert b.stats()["peer_sessions"] == 1
    deliver_checked(a, b"k", layout, src, range(2), seed=801, request_id=rid)
    deliver_checked(a, b"k", layout, src, [1], seed=802, request_id=rid, partial=True)
