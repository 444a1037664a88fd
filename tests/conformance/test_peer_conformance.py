"""Peer conformance: a target node and a source node of any protocol versions (spec section 12, spec section 7).

``PeerConformance`` holds the cases; a subclass supplies the ``pair`` fixture (a target
node with a client, a source node with a client). ``TestVersionMatrix`` runs them on
local nodes for every (target version, source version) in {1, 2, 3, 4, 5}²; ``TestExternalPair``
points them at nodes already running elsewhere:

    KVCR_PEER_TARGET=ipc:///tmp/a.sock KVCR_PEER_SOURCE=ipc:///tmp/b.sock \\
        pytest tests/conformance/test_peer_conformance.py -k External

(``KVCR_PEER_POOL=name:slot_bytes`` names a pool both nodes have, default ``kv:65536``.)
The expected outcome of each case follows from the versions the two nodes speak:

- whole deliveries and fetches work at every pair;
- a query (and a prefix query) at the target is answered by the target alone, the same at
  every pair;
- a subset sent with ``partial`` works only when both speak version 2 or later. A version-2
  target that knows its source speaks version 1 fails it with ``PEER_UNSUPPORTED`` and
  sends nothing; a version-1 target cannot carry the flag (its client drops it), so the
  source gets a whole-layout request and refuses the subset with ``LAYOUT_SUBSET_INVALID``;
- a deliver with a layer plan completes group by group at every pair; below version 3
  on either side the plan does not travel and the groups land with the key's result;
- a lease on hinted keys is held at the source (``LEASED_REMOTE``) when both speak version
  4 and serves a delivery byte for byte; a version-4 target whose source speaks less
  answers ``ADVISORY`` (nothing reserved); a client below version 4 cannot ask for one;
- a client of the target that delivered from the source and left is forgotten at the
  source at once (``peer_forget``) when both speak version 5; below that the source keeps
  its announcement (until ``max_peer_clients`` or the peer session's end) and the target
  sends nothing;
- a version-1 ``write`` frame carrying the must-understand ``!partial`` is refused whole
  (``MUST_UNDERSTAND``) and writes nothing, whatever version the source speaks.

Every refused delivery leaves the destination's own pattern untouched.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq

from kvcr_client import Client, ErrorCode, LeaseStatus, NodeError, Presence
from kvcr_io.agent import Agent
from kvcr_protocol import (
    Bye,
    DeliverItem,
    DstSpan,
    Error,
    MemoryKind,
    PeerHello,
    PeerWelcome,
    Region,
    WriteDone,
    WriteRequest,
    decode,
    encode,
)
from kvcr_protocol.versions import CLIENT_GONE_VERSION, GRANTS_VERSION, LEASES_VERSION, PARTIAL_LAYOUT_VERSION
from kvcr_testing.health import counter, outcome_count, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar
from kvcr_testing.nodes import short_ipc_dir, start_node
from kvcr_testing.patterns import assert_bytes_equal, pattern
from kvcr_testing.remote import OK, Dest, Site, assert_site_clean, deliver_checked, expect, open_site, sites_of

RAW_TIMEOUT_S = 10.0


@dataclass
class PeerPair:
    """A target node (where the client connects) and a source node (that holds the keys)."""

    target: Any
    source: Any
    target_version: int
    source_version: int
    pool: str
    slot: int
    exclusive: bool
    """The nodes were started for this test: exact slot accounting applies."""

    @property
    def agreed(self) -> int:
        return min(self.target_version, self.source_version)

    @property
    def subsets_travel(self) -> bool:
        return self.agreed >= PARTIAL_LAYOUT_VERSION

    def layout(self, n: int) -> Any:
        return Layout([(f"L{i}", self.pool, self.slot) for i in range(n)])

    def key(self, label: str) -> bytes:
        return f"conf/{label}/{secrets.token_hex(4)}".encode()

    def hint(self, keys: list[bytes]) -> str:
        rid = f"conf-{secrets.token_hex(4)}"
        self.target.client.submit_hint(rid, self.source.endpoint, keys).result(RESULT_TIMEOUT_S)
        return rid

    def check_clean(self) -> None:
        for site in (self.target, self.source):
            if self.exclusive:
                assert_site_clean(site)
            else:
                st = site.stats()
                assert st["invariants"] == [], st["invariants"]
        peer = self.target.stats()["peers"].get(self.source.endpoint)
        if peer is not None:
            assert (peer["writes_outstanding"], peer["queued"], peer["uncertain"]) == (0, 0, 0), peer


class PeerConformance:
    """The cases. Subclasses provide a ``pair`` fixture yielding a ``PeerPair``."""

    def test_lease_on_hinted_keys(self, pair: PeerPair) -> None:
        k = pair.key("lease")
        layout = pair.layout(2)
        src = pair.source.deposit(k, layout, seed=21)
        rid = pair.hint([k])
        client = pair.target.client
        if pair.target_version < LEASES_VERSION:
            with pytest.raises(NodeError) as info:
                client.lease([k], request_id=rid)
            assert info.value.code is ErrorCode.PEER_UNSUPPORTED
            return
        lease = client.lease([k], request_id=rid).result(RESULT_TIMEOUT_S)
        if pair.source_version < LEASES_VERSION:
            # Never a lease that is not one: nothing is reserved at an older source.
            assert lease.status(k) is LeaseStatus.ADVISORY and lease.id == 0
            deliver_checked(pair.target, k, layout, src, range(2), seed=22, request_id=rid)
            return
        assert lease.status(k) is LeaseStatus.LEASED_REMOTE and lease.tier(k) == "remote"
        deliver_checked(pair.target, k, layout, src, range(2), seed=22, request_id=rid)
        lease.release().result(RESULT_TIMEOUT_S)
        assert wait_until(lambda: pair.source.stats()["leases"]["held"] == 0, RAW_TIMEOUT_S)

    def test_read_lease_is_granted_at_the_source_only_at_5(self, pair: PeerPair) -> None:
        """Spec sections 6.12 ("Across nodes") and 7: a read lease of hinted keys carries the
        source's grant, and the client READs the source itself, only when the target, the
        source and their peer session speak version 5; else the keys travel node-driven."""
        if pair.target_version < LEASES_VERSION or pair.source_version < LEASES_VERSION:
            return  # no lease holds at the source (test_lease_on_hinted_keys)
        k = pair.key("grant")
        layout = pair.layout(2)
        src = pair.source.deposit(k, layout, seed=23)
        rid = pair.hint([k])
        client = pair.target.client
        lease = client.lease([k], request_id=rid).result(RESULT_TIMEOUT_S)
        assert lease.status(k) is LeaseStatus.LEASED_REMOTE
        granted = pair.agreed >= GRANTS_VERSION
        assert (k in client.grants().keys) is granted
        posted = pair.source.stats()["transfers"]["posted"]
        reads = client.counters()["grant_reads"]
        deliver_checked(pair.target, k, layout, src, range(2), seed=24, request_id=rid)
        assert (client.counters()["grant_reads"] == reads + 1) is granted
        assert (pair.source.stats()["transfers"]["posted"] == posted) is granted
        lease.release().result(RESULT_TIMEOUT_S)
        assert wait_until(lambda: pair.source.stats()["leases"]["held"] == 0
                          and pair.source.stats()["leases"]["with_grants"] == 0, RAW_TIMEOUT_S)

    def test_departed_client_is_forgotten(self, pair: PeerPair) -> None:
        """Spec sections 5.3 and 7: a client that delivered through the target and left is
        forgotten at the source when both speak version 5; otherwise the source keeps it."""
        k = pair.key("gone")
        layout = pair.layout(2)
        src = pair.source.deposit(k, layout, seed=80)
        sent_before = counter(pair.target.stats(), "peer_forgets_sent")
        source_before = pair.source.stats()
        site = open_site(pair.target.node, f"conf-gone-{secrets.token_hex(2)}", pair.target_version)
        try:
            site.client.submit_hint("gone", pair.source.endpoint, [k]).result(RESULT_TIMEOUT_S)
            deliver_checked(site, k, layout, src, range(2), seed=81, request_id="gone")
        finally:
            site.close()
        both = pair.agreed >= CLIENT_GONE_VERSION
        if both:
            assert wait_until(lambda: counter(pair.target.stats(), "peer_forgets_sent") == sent_before + 1, RAW_TIMEOUT_S)
        if not pair.exclusive:
            return  # shared nodes: other sessions move the source's tables
        forgotten = counter(source_before, "peer_clients_forgotten")
        if both:
            assert wait_until(lambda: counter(pair.source.stats(), "peer_clients_forgotten") == forgotten + 1, RAW_TIMEOUT_S)
            st = pair.source.stats()
            assert st["tables"]["peer_clients"] == source_before["tables"]["peer_clients"], st["tables"]
        else:
            st = pair.source.stats()
            assert counter(pair.target.stats(), "peer_forgets_sent") == sent_before == 0
            assert counter(st, "peer_clients_forgotten") == forgotten == 0, st["counters"]
            assert st["tables"]["peer_clients"] == source_before["tables"]["peer_clients"] + 1, st["tables"]
        assert counter(st, "peer_forgets_unknown") == 0, st["counters"]

    def test_versions_agreed(self, pair: PeerPair) -> None:
        k = pair.key("hello")
        layout = pair.layout(2)
        src = pair.source.deposit(k, layout, seed=1)
        deliver_checked(pair.target, k, layout, src, range(2), seed=2, request_id=pair.hint([k]))
        peer = pair.target.stats()["peers"][pair.source.endpoint]
        assert peer["version"] == pair.agreed, peer
        assert peer["state"] == "ready", peer
        assert peer["incarnation"] == pair.source.stats()["incarnation"], peer

    def test_whole_delivery(self, pair: PeerPair) -> None:
        k = pair.key("whole")
        layout = pair.layout(6)
        src = pair.source.deposit(k, layout, seed=10)
        rid = pair.hint([k])
        deliver_checked(pair.target, k, layout, src, range(6), seed=11, request_id=rid)
        deliver_checked(pair.target, k, layout, src, range(6), seed=12, request_id=rid, reverse=True)
        # ``partial`` naming the whole layout: the target cannot tell it from a subset (it
        # does not hold the object), so towards a version-1 source it fails closed as one.
        if pair.target_version >= PARTIAL_LAYOUT_VERSION > pair.source_version:
            deliver_checked(pair.target, k, layout, None, range(6), seed=13, request_id=rid, partial=True,
                            code=ErrorCode.PEER_UNSUPPORTED)
        else:
            deliver_checked(pair.target, k, layout, src, range(6), seed=13, request_id=rid, partial=True)

    def test_subset_with_partial_flag(self, pair: PeerPair) -> None:
        k = pair.key("subset")
        layout = pair.layout(6)
        src = pair.source.deposit(k, layout, seed=20)
        rid = pair.hint([k])
        before = pair.source.stats()
        if pair.subsets_travel:
            dst = Dest(pair.target, layout, range(6), seed=21)
            for group in ([0], [1, 2, 3, 4, 5]):
                spans = [dst.spans[i] for i in group]
                expect(pair.target.client.deliver({k: spans}, request_id=rid, partial=True).result(RESULT_TIMEOUT_S)[k], OK)
            dst.assert_delivered(src)
            deliver_checked(pair.target, k, layout, src, [1, 4], seed=22, request_id=rid, partial=True)
            return
        if pair.target_version >= PARTIAL_LAYOUT_VERSION:
            # The target knows the source cannot: fail closed, send nothing.
            for n, indices in enumerate(([0], [1, 2, 3, 4, 5], [2])):
                deliver_checked(pair.target, k, layout, None, indices, seed=23 + n, request_id=rid, partial=True,
                                code=ErrorCode.PEER_UNSUPPORTED)
            after = pair.source.stats()
            assert outcome_count(after, "write.") == outcome_count(before, "write."), after["outcomes"]
            assert after["transfers"]["posted"] == before["transfers"]["posted"], after["transfers"]
        else:
            # A version-1 target cannot carry the flag: the source sees a whole-layout request.
            for n, indices in enumerate(([0], [1, 2, 3, 4, 5])):
                deliver_checked(pair.target, k, layout, None, indices, seed=23 + n, request_id=rid, partial=True,
                                code=ErrorCode.LAYOUT_SUBSET_INVALID)
            after = pair.source.stats()
            assert (outcome_count(after, "write.FAILED.LAYOUT_SUBSET_INVALID")
                    == outcome_count(before, "write.FAILED.LAYOUT_SUBSET_INVALID") + 2), after["outcomes"]
            assert after["transfers"]["posted"] == before["transfers"]["posted"], after["transfers"]
        # The whole object still travels on the same session afterwards.
        deliver_checked(pair.target, k, layout, src, range(6), seed=30, request_id=rid)

    def test_subset_without_partial_flag_fails_closed(self, pair: PeerPair) -> None:
        k = pair.key("noflag")
        layout = pair.layout(4)
        pair.source.deposit(k, layout, seed=40)
        rid = pair.hint([k])
        for n, indices in enumerate(([0], [0, 1, 2], [3])):
            deliver_checked(pair.target, k, layout, None, indices, seed=41 + n, request_id=rid,
                            code=ErrorCode.LAYOUT_SUBSET_INVALID)

    def test_layer_plan_delivery(self, pair: PeerPair) -> None:
        """A deliver with a layer plan (spec sections 6.8, 7 and 12): each group lands on its
        own and is known from a notification, progress or the reply. Older peers get the old
        behaviour: a target below 3 keeps the plan on its client; a source below 3 gets
        records and the target reports every group with the key's OK (and notifies the
        client itself)."""
        k = pair.key("plan")
        layout = pair.layout(6)
        src = pair.source.deposit(k, layout, seed=55)
        rid = pair.hint([k])
        client = pair.target.client
        before = (pair.target.stats(), pair.source.stats())
        dst = Dest(pair.target, layout, range(6), seed=56)
        plan = [layout.names[0:2], layout.names[2:4], layout.names[4:6]]
        handle = client.deliver({k: dst.spans}, request_id=rid, plan=plan)
        expected = dst.expected(src)
        for g in range(len(plan)):
            handle.wait(g, RESULT_TIMEOUT_S)
            lo, hi = dst.offsets[2 * g], dst.offsets[2 * g + 1] + pair.slot
            assert_bytes_equal(dst.buf[lo:hi], expected[lo:hi], f"group {g} once wait({g}) returned")
        expect(handle.result(RESULT_TIMEOUT_S)[k], OK)
        dst.assert_delivered(src)
        assert handle.disagreements == 0
        (ta, sa), (tb, sb) = before, (pair.target.stats(), pair.source.stats())
        # A version-3 client is notified by a version-3 source with each group's write, or
        # by the target when an older source's write is over; an older session asks for none.
        by_source = sb["transfers"]["notified"] - sa["transfers"]["notified"]
        by_target = counter(tb, "notified_for_source") - counter(ta, "notified_for_source")
        both = pair.agreed >= 3
        assert (by_source, by_target > 0) == (len(plan) if both else 0, pair.target_version >= 3 and not both), (
            by_source, by_target)

    def test_fetch_whole_objects(self, pair: PeerPair) -> None:
        k = pair.key("fetch")
        layout = pair.layout(3)
        src = pair.source.deposit(k, layout, seed=50)
        rid = pair.hint([k])
        out = pair.target.client.fetch({k: [(n, pair.pool) for n in layout.names]}, request_id=rid).result(RESULT_TIMEOUT_S)[k]
        expect(out, OK)
        pair.target.resident[k] = (pair.pool,) * 3
        # Local on the target now: subsets need no flag.
        deliver_checked(pair.target, k, layout, src, range(3), seed=51)
        deliver_checked(pair.target, k, layout, src, [2], seed=52)
        assert out.handle is not None
        pair.target.client.release([out.handle]).result(RESULT_TIMEOUT_S)

    def test_query_at_the_target(self, pair: PeerPair) -> None:
        """A query is answered by the target alone, at any pair of versions: what it holds,
        and what the session's hint names (spec section 5.2); a prefix query counts the same
        answers in a row (spec section 6.9, or the client's own count below version 3)."""
        here, there, nowhere = pair.key("q-here"), pair.key("q-there"), pair.key("q-nowhere")
        layout = pair.layout(1)
        pair.target.deposit(here, layout, seed=70)
        pair.source.deposit(there, layout, seed=71)
        rid = pair.hint([there])
        client = pair.target.client
        answers = client.query([here, there, nowhere], request_id=rid).result(RESULT_TIMEOUT_S)
        tier = client.pools[pair.pool].memory
        assert [(a.presence, a.tier) for a in answers.values()] == [
            (Presence.HIT, tier), (Presence.FETCHABLE, "remote"), (Presence.MISS, "")]
        assert client.query([there]).result(RESULT_TIMEOUT_S)[there].presence is Presence.MISS  # no hint named
        keys = [here, there, nowhere]
        counts = [client.query_prefix(keys, rid, presences=counted).result(RESULT_TIMEOUT_S) for counted in (
            [Presence.HIT], [Presence.HIT, Presence.FETCHABLE], [Presence.FETCHABLE])]
        assert counts == [1, 2, 0]
        assert client.query_prefix([there, here], rid, [Presence.FETCHABLE, Presence.HIT]).result(RESULT_TIMEOUT_S) == 2
        # The source was not asked: a query reserves nothing and moves nothing.
        assert pair.target.stats()["peers"].get(pair.source.endpoint, {}).get("writes_outstanding", 0) == 0

    @pytest.mark.parametrize("frame", ["v1+!partial", "v1-control", "v2+!partial"])
    def test_raw_write_frames(self, pair: PeerPair, frame: str) -> None:
        """Hand-built peer frames to the source: the must-understand rule (spec section 7)."""
        k = pair.key("raw")
        layout = pair.layout(3)
        src = pair.source.deposit(k, layout, seed=60)
        offer = (1,) if frame.startswith("v1") else (1, 2)
        with RawPeer(pair.source.endpoint, offer, layout.nbytes + 256, seed=61) as raw:
            session = raw.hello()
            before = pair.source.stats()
            if frame == "v1+!partial":
                payload = raw.write_frame(7, k, layout, [1], version=1, partial=False)
                obj = msgpack.unpackb(payload, raw=False)
                assert obj["v"] == 1 and "!partial" not in obj
                obj["!partial"] = True
                reply = raw.request(msgpack.packb(obj, use_bin_type=True), 7)
                assert isinstance(reply, Error), reply
                assert reply.code == ErrorCode.MUST_UNDERSTAND, reply
                written: list[int] = []
            elif frame == "v1-control":
                # The same frame without the flag, naming the whole layout: served, byte-exact.
                reply = raw.request(raw.write_frame(8, k, layout, [0, 1, 2], version=1, partial=False), 8)
                assert isinstance(reply, WriteDone), reply
                assert [r.status for r in reply.results] == [OK], reply
                written = [0, 1, 2]
            elif session >= PARTIAL_LAYOUT_VERSION:
                reply = raw.request(raw.write_frame(9, k, layout, [1], version=2, partial=True), 9)
                assert isinstance(reply, WriteDone), reply
                assert [r.status for r in reply.results] == [OK], reply
                written = [1]
            else:
                # A version-1 source refuses a version-2 frame outright.
                reply = raw.request(raw.write_frame(9, k, layout, [1], version=2, partial=True), 9)
                assert isinstance(reply, Error), reply
                assert reply.code == ErrorCode.UNSUPPORTED_VERSION, reply
                written = []
            expected = raw.before.copy()
            for i in written:
                at = raw.offset + layout.offsets[i]
                expected[at : at + layout.spans[i][2]] = layout.src_bytes(src, i)
            assert_bytes_equal(raw.buf, expected, f"raw destination ({frame})")
            after = pair.source.stats()
            posted = after["transfers"]["posted"] - before["transfers"]["posted"]
            assert (posted > 0) == bool(written), (posted, written)
            if not written:
                assert outcome_count(after, "write.") == outcome_count(before, "write."), after["outcomes"]


class RawPeer:
    """A hand-driven peer session: a DEALER socket and a NIXL agent with one DRAM buffer."""

    def __init__(self, endpoint: str, versions: tuple[int, ...], size: int, seed: int) -> None:
        self.endpoint = endpoint
        self.versions = versions
        self.offset = 128
        self.buf = pattern(size, seed)
        self.before = self.buf.copy()
        self.agent = Agent(f"conf-raw.{os.getpid()}.{secrets.token_hex(4)}")
        self.address = int(self.buf.ctypes.data)
        self.reg = self.agent.register(MemoryKind.DRAM, self.address, size, 0)
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.version = 1

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.request(encode(Bye(99), self.version), 99)  # the source drops the session
        finally:
            self.sock.close(0)
            self.ctx.term()
            self.agent.deregister(self.reg)

    def hello(self) -> int:
        region = Region(0, MemoryKind.DRAM, 0, self.address, self.buf.size)
        msg = PeerHello(1, self.versions, "conf-raw", secrets.randbits(62) | 1, self.agent.name,
                        self.agent.metadata(), (region,))
        reply = self.request(encode(msg, 1), 1)
        assert isinstance(reply, PeerWelcome), reply
        self.agent.add_remote(reply.agent_md)
        self.version = reply.version
        return reply.version

    def write_frame(self, op: int, key: bytes, layout: Any, indices: list[int], version: int, partial: bool) -> bytes:
        spans = tuple(
            DstSpan(layout.spans[i][0], 0, self.offset + layout.offsets[i], layout.spans[i][2]) for i in indices
        )
        return encode(WriteRequest(op, self.agent.name, (DeliverItem(key, spans),), 5000, partial), version)

    def request(self, payload: bytes, op: int) -> Any:
        """Send one frame and wait (bounded) for the reply to ``op``, progressing our agent meanwhile."""
        self.sock.send(payload)
        deadline = time.monotonic() + RAW_TIMEOUT_S
        while time.monotonic() < deadline:
            self.agent.progress()
            if self.sock.poll(5, zmq.POLLIN):
                reply = decode(self.sock.recv(), 2)
                if getattr(reply, "id", None) == op:
                    return reply
        raise AssertionError(f"no reply to {op} within {RAW_TIMEOUT_S}s")


# --------------------------------------------------------------------------- where the cases run


MATRIX = [(t, s) for t in (1, 2, 3, 4, 5) for s in (1, 2, 3, 4, 5)]


@pytest.fixture(scope="module", params=MATRIX, ids=[f"target{t}-source{s}" for t, s in MATRIX])
def matrix_pair(request: pytest.FixtureRequest) -> Iterator[PeerPair]:
    """One pair per version pair, shared by the cases of ``TestVersionMatrix``."""
    tv, sv = request.param
    with short_ipc_dir("conf") as d:
        nodes: list[Any] = []
        numbers = itertools.count()  # next() is atomic: the nodes start in parallel

        def factory(*args: str) -> Any:
            node = start_node(f"ipc://{d}/n{next(numbers)}.sock", *args)
            nodes.append(node)
            return node

        try:
            with sites_of(factory, check=False) as sites:
                target, source = sites.start(
                    ("target", {"args": ("--protocol-version", str(tv))}),
                    # The source trusts targets' clients with its pools (spec section 14),
                    # so that grants across nodes are part of the matrix.
                    ("source", {"args": ("--protocol-version", str(sv), "--peer-grants")}),
                )
                # A client speaks the highest version its node offers.
                assert target.client.node.version == tv and source.client.node.version == sv
                yield PeerPair(target, source, tv, sv, "kv", 64 * 1024, exclusive=True)
        finally:
            codes = [node.stop() for node in nodes]
        assert codes == [0] * len(nodes), [node.output for node in nodes]


class TestVersionMatrix(PeerConformance):
    """Local nodes: ``--protocol-version`` on each side. The cases share one pair per
    version pair (keys are unique per case); each case must leave both nodes clean."""

    @pytest.fixture
    def pair(self, matrix_pair: PeerPair) -> Iterator[PeerPair]:
        yield matrix_pair
        matrix_pair.check_clean()


class _External:
    """A node process started elsewhere: only its endpoint is known."""

    class _Proc:
        @staticmethod
        def poll() -> None:
            return None

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.proc = self._Proc()


class TestExternalPair(PeerConformance):
    """Nodes named by ``KVCR_PEER_TARGET`` / ``KVCR_PEER_SOURCE`` (skipped when unset)."""

    @pytest.fixture
    def pair(self) -> Iterator[PeerPair]:
        target_ep, source_ep = os.environ.get("KVCR_PEER_TARGET"), os.environ.get("KVCR_PEER_SOURCE")
        if not target_ep or not source_ep:
            pytest.skip("set KVCR_PEER_TARGET and KVCR_PEER_SOURCE to run the cases against running nodes")
        pool, _, slot = os.environ.get("KVCR_PEER_POOL", "kv:65536").partition(":")
        opened: list[Any] = []
        try:
            for endpoint, name in ((target_ep, "conf-target"), (source_ep, "conf-source")):
                client = Client(endpoint, name=name)
                opened.append(Site(_External(endpoint), client, Registrar(client)))
            target, source = opened
            pair = PeerPair(target, source, target.client.node.version, source.client.node.version, pool, int(slot),
                            exclusive=False)
            yield pair
            pair.check_clean()
        finally:
            for site in opened:
                site.close()

