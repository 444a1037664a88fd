"""Session conformance: one test per MUST of the spec's session sections (4.2, 5.1 to 5.3,
7, 10.1), each against the real node, driven in process through its ``Router`` with a
fake clock (``kvcr_testing.nodes.NodeDriver``), as jupyter_kernel_test does for the
Jupyter protocol.

Each test quotes the sentence it checks in its docstring and asserts the node's outcome on
the wire (decoded replies, and the envelope's ``v`` where the version is the point). The
last part holds the places where the spec, the code and the docs once said different
things: each says one thing now, and a test holds them together.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import kvcr_protocol as kp
from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import (
    Ack,
    Bye,
    CapacityEvent,
    Completion,
    Deposit,
    DepositItem,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    KeyStatus,
    MemoryKind,
    Message,
    PeerHello,
    PeerWelcome,
    Query,
    QueryReply,
    Region,
    RegisterRegions,
    Role,
    SrcSpan,
    StatsReply,
    StatsRequest,
    UnregisterRegions,
    Welcome,
    decode,
    encode,
    session_rules,
)
from kvcr_protocol.operations import REQUEST_CODES
from kvcr_protocol.session_rules import RULES, WHILE_STOPPING
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "spec" / "kvcr-protocol.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
SLOT = 4096
GRACE_MS = 10_000
V = kp.CURRENT_VERSION

SAMPLES: dict[str, Message] = {}
"""One message of every tag, from the version-5 vectors (spec section 13)."""
for _vec in json.loads((ROOT / "spec" / "vectors" / "valid-v5.json").read_text())["vectors"]:
    SAMPLES.setdefault(_vec["tag"], decode(bytes.fromhex(_vec["hex"]), V))


def sample(tag: str, request_id: int) -> Message:
    """The vectors' message of ``tag`` under ``request_id``."""
    return dataclasses.replace(SAMPLES[tag], id=request_id)  # type: ignore[type-var]


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/rules.sock", name="rules", pools=(PoolSpec("kv", SLOT, 8, "dram"),),
                      log_level="WARNING", client_grace_ms=GRACE_MS, heartbeat_ms=2_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    """The test's NIXL agent, with one registered buffer (region 1) holding a pattern."""
    a = ClientAgent("rules-client", np.arange(4 * SLOT, dtype=np.uint32).astype(np.uint8))
    yield a
    a.close()


@pytest.fixture
def driver(ipc_dir: Path) -> Iterator[NodeDriver]:
    with node_driver(config(ipc_dir)) as d:
        yield d


def frames_to(d: NodeDriver, identity: bytes) -> list[bytes]:
    """The payloads the node sent to ``identity`` since last asked, raw (their envelope unread)."""
    return [payload for to, payload in d.node.outbox.take() if to == identity]


def envelope_version(payload: bytes) -> int:
    v: int = msgpack.unpackb(payload, raw=False)["v"]
    return v


def only(replies: list[Message], kind: type[Message], request_id: int) -> Any:
    assert len(replies) == 1 and isinstance(replies[0], kind) and replies[0].id == request_id, replies
    return replies[0]


def hello(agent: ClientAgent, request_id: int = 1, versions: tuple[int, ...] = (V,),
          regions: tuple[Region, ...] | None = None) -> Hello:
    return Hello(request_id, versions, agent.name, agent.name, agent.metadata, agent.regions if regions is None else regions)


def peer_hello(agent: ClientAgent, request_id: int = 1, versions: tuple[int, ...] = (V,), incarnation: int = 7) -> PeerHello:
    return PeerHello(request_id, versions, "target", incarnation, agent.name, agent.metadata, ())


def deposit(request_id: int, key: bytes = b"k") -> Deposit:
    return Deposit(request_id, (DepositItem(key, (SrcSpan("L0", "kv", 1, 0, SLOT),)),))


def assert_no_session(d: NodeDriver, identity: bytes) -> None:
    """The identity holds no session: a request is refused BAD_STATE (spec section 5.2)."""
    assert d.node.sessions.get(identity) is None
    assert only(d.receive(identity, StatsRequest(999), 1), Error, 999).code == ErrorCode.BAD_STATE


# --------------------------------------------------------------------------- 4.2 and 5.1: ids and replies


def test_hello_is_always_encoded_at_version_1() -> None:
    """4.2: "`hello` and `peer_hello` are always encoded with `v` = 1 (section 7)."
    """
    for msg in (SAMPLES["hello"], SAMPLES["peer_hello"]):
        for version in kp.PROTOCOL_VERSIONS:
            assert envelope_version(encode(msg, version)) == 1


def test_a_request_id_in_flight_is_refused(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.1: "A sender MUST give each request an `id` that is unique among its requests in
    flight in that session" (the node refuses a second one: section 10.1, "a request id
    already in flight", ``BAD_STATE``)."""
    d = driver
    d.hello(b"c", agent)
    assert d.receive(b"c", deposit(5)) == []  # its transfer runs: the deposit is in flight
    refused = only(d.receive(b"c", deposit(5, b"other")), Error, 5)
    assert (refused.code, refused.path) == (ErrorCode.BAD_STATE, "id")
    d.finish_transfers(agent)
    done = only(d.sent(b"c"), Completion, 5)
    assert [r.status for r in done.results] == [KeyStatus.STORED]  # the first one, untouched
    assert d.stats()["invariants"] == []


def test_a_reply_carries_the_id_of_its_request_and_each_request_gets_exactly_one(
    driver: NodeDriver, agent: ClientAgent
) -> None:
    """5.1: "A reply MUST carry the `id` of the request it answers." and "Every request gets
    exactly one reply: the reply its exchange names, or `error`."

    Every client request of the vectors goes to one open session (``hint`` aside: its
    endpoint is not loopback, so nothing may follow it there), ``bye`` last.
    """
    d = driver
    d.hello(b"c", agent)
    tags = [*sorted(RULES[Role.CLIENT].requests - {"hint", "bye"}), "bye"]
    for n, tag in enumerate(tags, start=100):
        replies = [m for m in d.receive(b"c", sample(tag, n)) if m.TAG != "progress"]
        assert len(replies) == 1, (tag, replies)
        assert replies[0].TAG in session_rules.answers(Role.CLIENT, tag), (tag, replies[0])
        assert replies[0].id == n, (tag, replies[0])
    assert d.stats()["invariants"] == []


def test_an_undecodable_frame_is_answered_with_its_id_or_0(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.1: "A receiver that cannot decode a frame but can read an unsigned integer `id`
    from it MUST reply `error` with that id, the code and the path. If it cannot read the
    id it MUST count the frame and reply `error` with id 0."
    """
    d = driver
    d.hello(b"c", agent)
    bad = msgpack.packb({"v": V, "t": "query", "id": 41, "keys": "not a list"})
    d.receive_frames([b"c", bad])
    refused = only(d.sent(b"c"), Error, 41)
    assert (refused.code, refused.path) == (ErrorCode.WRONG_TYPE, "keys")
    before = d.stats()["protocol_errors"].get("MALFORMED", 0)
    d.receive_frames([b"c", b"\xc1"])
    assert only(d.sent(b"c"), Error, 0).code == ErrorCode.MALFORMED
    assert d.stats()["protocol_errors"]["MALFORMED"] == before + 1


def test_malformed_input_disturbs_no_other_session(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.1: "Malformed input MUST NOT stop a node or disturb any other session."
    """
    d = driver
    d.hello(b"good", agent)
    for junk in (b"", b"\x93\x01\x02", b"\xc1", msgpack.packb({"v": V}), msgpack.packb({"v": V, "t": "nope", "id": 3})):
        d.receive_frames([b"bad", junk])
    d.receive_frames([b"bad"])
    d.receive_frames([b"bad", b"a", b"b"])
    assert all(isinstance(m, Error) for m in d.sent(b"bad"))
    assert only(d.receive(b"good", Query(2, (b"k",))), QueryReply, 2)
    assert d.node.sessions.get(b"good") is not None and len(d.node.sessions) == 1


def test_replies_travel_at_version_1_before_agreement_and_at_the_agreed_version_after(
    driver: NodeDriver, agent: ClientAgent
) -> None:
    """5.1: "Before a version is agreed, replies (including `error`) MUST be encoded at
    version 1. After agreement, every message of the session MUST be encoded at the agreed
    version."
    """
    d = driver
    d.node.router.receive([b"new", encode(Query(3, (b"k",)), 2)])  # no session yet
    assert [envelope_version(p) for p in frames_to(d, b"new")] == [1]
    d.node.router.receive([b"new", encode(hello(agent, 4, versions=(1, 2)), 1)])
    d.node.router.receive([b"new", encode(Query(5, (b"k",)), 2)])
    d.node.router.receive([b"new", encode(RegisterRegions(6, b"not nixl", ()), 2)])
    payloads = frames_to(d, b"new")
    assert [decode(p, 2).TAG for p in payloads] == ["welcome", "query_reply", "error"]
    assert [envelope_version(p) for p in payloads] == [2, 2, 2]


# --------------------------------------------------------------------------- 7: versions of a session


def test_a_hello_is_read_by_the_rules_of_version_1_whatever_its_v(driver: NodeDriver, agent: ClientAgent) -> None:
    """7: "`hello` and `peer_hello` MUST be encoded with `v` = 1, and a receiver MUST read
    them by the rules of version 1 whatever their `v`, so that endpoints of any version can
    open a session."
    """
    d = driver
    for identity, v in ((b"future", 9), (b"v3", 3)):
        obj = msgpack.unpackb(encode(hello(agent, 4, versions=(1, 2, 3)), 1), raw=False)
        obj["v"] = v
        d.receive_frames([identity, msgpack.packb(obj, use_bin_type=True)])
        assert only(d.sent(identity, 3), Welcome, 4).version == 3


def test_no_common_version_is_refused_unsupported_version_at_version_1(driver: NodeDriver, agent: ClientAgent) -> None:
    """7: "If the sets do not meet, it MUST reply `error` with `UNSUPPORTED_VERSION`, encoded
    at version 1."
    """
    d = driver
    d.node.router.receive([b"new", encode(hello(agent, 2, versions=(V + 1, V + 7)), 1)])
    payloads = frames_to(d, b"new")
    assert len(payloads) == 1 and envelope_version(payloads[0]) == 1
    refused = only([decode(payloads[0], V)], Error, 2)
    assert (refused.code, refused.path) == (ErrorCode.UNSUPPORTED_VERSION, "versions")
    assert len(d.node.sessions) == 0


def test_a_message_above_the_agreed_version_is_refused(driver: NodeDriver, agent: ClientAgent) -> None:
    """7: "After agreement, a receiver MUST refuse a message whose `v` is above the agreed
    version or is not a version it speaks, with `UNSUPPORTED_VERSION`. It MAY accept a
    message at a lower version it speaks"
    """
    d = driver
    only(d.receive(b"c", hello(agent, 1, versions=(1, 2)), 2), Welcome, 1)
    d.node.router.receive([b"c", encode(Query(2, (b"k",)), 3)])
    payloads = frames_to(d, b"c")
    assert len(payloads) == 1 and envelope_version(payloads[0]) == 2
    assert only([decode(payloads[0], 2)], Error, 2).code == ErrorCode.UNSUPPORTED_VERSION
    d.node.router.receive([b"c", encode(Query(3, (b"k",)), 1)])  # a lower version it speaks: read
    assert only(d.sent(b"c", 2), QueryReply, 3)
    assert d.node.sessions.get(b"c") is not None


# --------------------------------------------------------------------------- 5.2: the client session


@pytest.mark.parametrize("tag", sorted(RULES[Role.CLIENT].requests | RULES[Role.PEER].requests))
def test_every_message_before_hello_is_refused_bad_state(driver: NodeDriver, tag: str) -> None:
    """5.2: "A node MUST reply `error` with `BAD_STATE` to every other message from an
    identity that has no session, `heartbeat` and `bye` included"; 5.3: "A MUST NOT send
    any other message before `peer_welcome`."
    """
    d = driver
    d.node.router.receive([b"nobody", encode(sample(tag, 9), V)])
    payloads = frames_to(d, b"nobody")
    assert len(payloads) == 1 and envelope_version(payloads[0]) == 1
    assert only([decode(payloads[0], V)], Error, 9).code == ErrorCode.BAD_STATE
    assert len(d.node.sessions) == 0


def test_a_hello_ends_the_identitys_session_and_opens_a_new_one(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "A `hello` from an identity that has a session ends that session (as `bye`
    would) and opens a new one."
    """
    d = driver
    d.hello(b"c", agent)
    old = d.node.sessions.get(b"c")
    d.receive(b"c", Deposit(2, (DepositItem(b"k", (SrcSpan("L0", "kv", 1, 0, SLOT),)),), no_evict=True))
    d.finish_transfers(agent)
    (stored,) = only(d.sent(b"c"), Completion, 2).results
    assert stored.status is KeyStatus.STORED and stored.handle
    assert d.stats()["claims"]["handles"] == 1
    d.hello(b"c", agent, request_id=3)
    new = d.node.sessions.get(b"c")
    assert new is not None and new is not old and old is not None and old.closing
    assert d.stats()["claims"]["handles"] == 0  # the old session's handles went with it, as for bye


def test_a_hello_repeating_a_region_id_is_refused(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "The region ids of a session MUST be unique; a node MUST refuse a `hello` or
    `regions` that repeats one with `error` `BAD_DESCRIPTOR`" (here: the hello names it twice)."""
    d = driver
    twice = hello(agent, regions=(*agent.regions, *agent.regions))
    refused = only(d.receive(b"c", twice), Error, 1)
    assert (refused.code, refused.path) == (ErrorCode.BAD_DESCRIPTOR, "regions")
    assert len(d.node.sessions) == 0


def test_a_region_id_withdrawn_and_acknowledged_is_free_again(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "The region ids of a session MUST be unique" ... "An id whose `unregions` was
    acknowledged is free again."
    """
    d = driver
    d.hello(b"c", agent)
    extra = Region(2, MemoryKind.DRAM, 0, agent.regions[0].address, SLOT)
    assert d.receive(b"c", RegisterRegions(2, agent.metadata, (extra,))) == [Ack(2)]
    assert d.receive(b"c", UnregisterRegions(3, (2,))) == [Ack(3)]
    assert d.receive(b"c", RegisterRegions(4, agent.metadata, (extra,))) == [Ack(4)]
    session = d.node.sessions.get(b"c")
    assert session is not None and set(session.regions) == {1, 2}


def test_a_session_whose_node_sends_no_heartbeats_is_not_dropped_for_silence(ipc_dir: Path, agent: ClientAgent) -> None:
    """5.2: "A node whose `welcome.heartbeat_ms` is 0 MUST NOT end a session for silence
    (its clients send no heartbeats)"
    """
    with node_driver(config(ipc_dir, heartbeat_ms=0)) as d:
        assert d.hello(b"c", agent).heartbeat_ms == 0
        d.tick(10 * GRACE_MS / 1000)
        assert d.node.sessions.get(b"c") is not None
        assert only(d.receive(b"c", Query(2, (b"k",))), QueryReply, 2)


def test_a_silent_session_ends_after_the_grace_period(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "A node MAY end a session it has heard nothing from for its grace period ... as
    for `bye`"; the endpoint then learns it from the ``BAD_STATE`` the MUST above requires."""
    d = driver
    d.hello(b"c", agent)
    d.tick(GRACE_MS / 1000 / 2)
    assert d.receive(b"c", Heartbeat(1)) == [Heartbeat(1)]  # heard: the grace starts again
    d.tick(GRACE_MS / 1000 * 0.9)
    assert d.node.sessions.get(b"c") is not None
    d.tick(GRACE_MS / 1000)
    assert_no_session(d, b"c")


def test_a_node_refuses_a_span_outside_every_announced_region(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "A node MUST refuse a span that lies outside every region the client announced
    and has not withdrawn (`BAD_DESCRIPTOR`, per key)."
    """
    d = driver
    d.hello(b"c", agent)
    outside = Deposit(2, (DepositItem(b"k", (SrcSpan("L0", "kv", 1, 4 * SLOT, SLOT),)),))
    unknown = Deposit(3, (DepositItem(b"k", (SrcSpan("L0", "kv", 7, 0, SLOT),)),))
    for msg in (outside, unknown):
        (result,) = only(d.receive(b"c", msg), Completion, msg.id).results
        assert (result.status, result.code) == (KeyStatus.FAILED, ErrorCode.BAD_DESCRIPTOR)
    assert d.receive(b"c", UnregisterRegions(4, (1,))) == [Ack(4)]
    (result,) = only(d.receive(b"c", deposit(5)), Completion, 5).results
    assert (result.status, result.code) == (KeyStatus.FAILED, ErrorCode.BAD_DESCRIPTOR)


def test_capacity_goes_once_to_each_client_when_a_pool_crosses_under_its_watermark(
    ipc_dir: Path, agent: ClientAgent
) -> None:
    """5.2: "It is edge-triggered: a node MUST send it once to each connected client when the
    pool crosses under its low watermark, and not again for that pool until the pool has
    risen to or above the watermark and fallen under it again." and "`id` counts the events
    of the session ... from 1. A client MUST NOT reply." (a peer session is no client: it
    gets none)."""
    peer = ClientAgent("rules-peer")
    try:
        with node_driver(config(ipc_dir, low_watermark=0.5)) as d:
            d.hello(b"a", agent)
            d.hello(b"b", agent)
            only(d.receive(b"p", peer_hello(peer)), PeerWelcome, 1)
            held = tuple(DepositItem(f"k{k}".encode(), (SrcSpan("L0", "kv", 1, (k % 4) * SLOT, SLOT),)) for k in range(5))
            assert d.receive(b"a", Deposit(2, held, no_evict=True)) == []
            d.finish_transfers(agent)
            done = only(d.sent(b"a"), Completion, 2)
            assert [r.status for r in done.results] == [KeyStatus.STORED] * 5
            d.tick()
            for identity in (b"a", b"b"):
                event = only(d.sent(identity), CapacityEvent, 1)
                assert (event.pool, event.reclaimable, event.total) == ("kv", 3, 8)
            assert d.sent(b"p") == []
            assert d.receive(b"a", Deposit(3, (DepositItem(b"k5", held[0].spans),), no_evict=True)) == []
            d.finish_transfers(agent)
            only(d.sent(b"a"), Completion, 3)
            d.tick()
            assert d.sent(b"a") == [] and d.sent(b"b") == []  # still under: not again
    finally:
        peer.close()


# --------------------------------------------------------------------------- 5.3 and 10.1: roles and stopping


@pytest.mark.parametrize("role", list(Role))
def test_a_request_of_the_other_kind_of_session_is_refused(driver: NodeDriver, agent: ClientAgent, role: Role) -> None:
    """10.1: ``BAD_STATE`` refuses "a request that is not allowed now (no session, a request
    id already in flight, a message of the other kind of session)"; the peer requests are
    those of section 5.3, the client's those of 5.2."""
    d = driver
    if role is Role.CLIENT:
        d.hello(b"s", agent)
    else:
        only(d.receive(b"s", peer_hello(agent)), PeerWelcome, 1)
    other = RULES[Role.PEER if role is Role.CLIENT else Role.CLIENT].requests - RULES[role].requests
    for n, tag in enumerate(sorted(other), start=10):
        refused = only(d.receive(b"s", sample(tag, n)), Error, n)
        assert refused.code == ErrorCode.BAD_STATE, tag
    assert d.node.sessions.get(b"s") is not None
    assert only(d.receive(b"s", StatsRequest(99)), StatsReply, 99)


def test_a_refused_peer_hello_travels_at_version_1_and_ends_the_identitys_session(
    driver: NodeDriver, agent: ClientAgent
) -> None:
    """5.3: "A `peer_hello` ends the session its identity had, whatever its answer, as a
    client's `hello` does (section 5.2); an `error` answering it travels at version 1."
    """
    d = driver
    only(d.receive(b"a", peer_hello(agent)), PeerWelcome, 1)
    d.node.router.receive([b"a", encode(peer_hello(agent, 2, versions=(99,)), 1)])
    payloads = frames_to(d, b"a")
    assert len(payloads) == 1 and envelope_version(payloads[0]) == 1
    assert only([decode(payloads[0], V)], Error, 2).code == ErrorCode.UNSUPPORTED_VERSION
    assert_no_session(d, b"a")


def test_a_stopping_node_refuses_new_work_and_serves_what_ends_things(driver: NodeDriver, agent: ClientAgent) -> None:
    """10.1: ``SHUTTING_DOWN`` for every request but those that end or release things
    (section 6.11: "A stopping node still serves `unlease`"; 10.1: `peer_forget` "is
    answered `ack` ... also while the node stops"); a hello is refused at version 1."""
    d = driver
    d.hello(b"c", agent)
    d.node.router.stopping = True
    for n, tag in enumerate(sorted(RULES[Role.CLIENT].requests - WHILE_STOPPING), start=10):
        assert only(d.receive(b"c", sample(tag, n)), Error, n).code == ErrorCode.SHUTTING_DOWN, tag
    d.node.router.receive([b"late", encode(hello(agent, 30), 1)])
    payloads = frames_to(d, b"late")
    assert len(payloads) == 1 and envelope_version(payloads[0]) == 1
    assert only([decode(payloads[0], V)], Error, 30).code == ErrorCode.SHUTTING_DOWN
    assert only(d.receive(b"c", StatsRequest(31)), StatsReply, 31)
    assert d.receive(b"c", Heartbeat(32)) == [Heartbeat(32)]
    assert only(d.receive(b"c", sample("unlease", 33)), Error, 33).code == ErrorCode.UNKNOWN_LEASE
    assert d.receive(b"c", Bye(34)) == [Ack(34)]
    d.node.router.stopping = False


def test_the_router_serves_exactly_the_requests_the_rules_allow(driver: NodeDriver) -> None:
    """5.2 and 5.3 list the requests of each kind of session; the router's handler tables
    are the same sets (``kvcr_protocol.session_rules``), and every request has the codes
    of section 10.1."""
    handlers = driver.node.router.handlers
    for role, rules in RULES.items():
        assert {kind.TAG for kind in handlers[role]} == rules.requests, role
    assert {kind.TAG for kind in driver.node.router.hellos} == set(session_rules.OPENING)
    assert set(REQUEST_CODES) == set(session_rules.OPENING).union(*(r.requests for r in RULES.values()))


def test_the_spec_exchanges_are_the_rules_table() -> None:
    """Sections 5.2 and 5.3 name each exchange as ``request→reply``; they are the
    answers of ``kvcr_protocol.session_rules``, request for request."""
    for role, title in ((Role.CLIENT, "### 5.2 Client session"), (Role.PEER, "### 5.3 Peer session")):
        section = SPEC.split(f"{title}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
        named: dict[str, frozenset[str]] = {}
        for heading in re.findall(r"^[A-Z][^\n(]*\(([a-z_→|, ]+)\)", section, re.MULTILINE):
            for exchange in heading.split(", "):
                request, reply = exchange.split("→")
                named[request] = frozenset(reply.split("|"))
        rules = RULES[role]
        assert named == dict(rules.replies), (role, set(named) ^ rules.requests)
        assert f"Opening ({rules.opening}/{rules.welcome}):" in section


# --------------------------------------------------------------------------- the drifts, one test each


def test_regions_reusing_a_hello_region_id_is_refused_and_changes_nothing(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "The region ids of a session MUST be unique; a node MUST refuse a `hello` or
    `regions` that repeats one with `error` `BAD_DESCRIPTOR`, and takes nothing of it."

    It was acked, and replaced hello's region 1.
    """
    d = driver
    d.hello(b"c", agent)
    session = d.node.sessions.get(b"c")
    assert session is not None
    before, version = dict(session.regions), session.regions_version
    reuse = Region(1, MemoryKind.DRAM, 0, agent.regions[0].address + SLOT, SLOT)
    new = Region(2, MemoryKind.DRAM, 0, agent.regions[0].address, SLOT)
    refused = only(d.receive(b"c", RegisterRegions(2, agent.metadata, (new, reuse))), Error, 2)
    assert (refused.code, refused.path) == (ErrorCode.BAD_DESCRIPTOR, "regions[1].region")
    assert session.regions == before and session.regions_version == version  # region 2 not taken either
    assert session.regions[1].address == agent.regions[0].address
    assert d.receive(b"c", RegisterRegions(3, agent.metadata, (new,))) == [Ack(3)]  # a new id alone is taken
    assert set(session.regions) == {1, 2}


def test_a_refused_hello_from_an_identity_with_a_session_travels_at_version_1(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.1: "Before a version is agreed, replies (including `error`) MUST be encoded at
    version 1"; 5.2: a `hello` "ends it whatever the answer: after a refused `hello` the
    identity has no session, and the `error` travels at version 1".

    It was answered in the old session's version-4 envelope, and the old session stayed.
    """
    d = driver
    only(d.receive(b"c", hello(agent, 1, versions=(1, 2, 3, 4)), 4), Welcome, 1)
    d.node.router.receive([b"c", encode(hello(agent, 2, versions=(99,)), 1)])
    payloads = frames_to(d, b"c")
    assert len(payloads) == 1 and envelope_version(payloads[0]) == 1
    assert only([decode(payloads[0], V)], Error, 2).code == ErrorCode.UNSUPPORTED_VERSION
    assert_no_session(d, b"c")


def test_bye_is_answered_ack_and_ends_the_session(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "Bye (bye→ack): ... N: `ack`, sent before the session ends"; section 2 no longer
    calls `bye` an event."""
    d = driver
    d.hello(b"c", agent)
    assert d.receive(b"c", Bye(5)) == [Ack(5)]
    assert_no_session(d, b"c")
    terms = SPEC.split("## 2. Terms\n", 1)[1].split("\n## ", 1)[0]
    events = terms.split("**event**", 1)[1].split(").", 1)[0]
    assert "`bye`" not in events and "`heartbeat`" not in events
    assert "`bye` is a request (its reply is `ack`)" in terms
    assert session_rules.answers(Role.CLIENT, "bye") == session_rules.answers(Role.PEER, "bye") == {"ack", "error"}


def test_a_heartbeat_is_answered_with_a_heartbeat_of_the_same_id(driver: NodeDriver, agent: ClientAgent) -> None:
    """5.2: "Heartbeat (heartbeat→heartbeat): 1. C: `heartbeat` ... 2. N: `heartbeat` with
    the same `id`"; section 6.4 calls it a request whose reply is that heartbeat."""
    d = driver
    d.hello(b"c", agent)
    for n in (1, 2, 7):
        assert d.receive(b"c", Heartbeat(n)) == [Heartbeat(n)]
    description = SPEC.split("#### `heartbeat`\n", 1)[1].split("|", 1)[0]
    assert "request; reply `heartbeat` with the same `id`" in description
    assert "event" not in description.split(".", 1)[0]


def test_unauthorized_is_never_sent_by_a_node_and_the_spec_says_so_once(driver: NodeDriver, agent: ClientAgent) -> None:
    """10.1: "Not sent by a node: `OK`, `NO_HINT`, `NODE_LOST`, `UNAUTHORIZED`"; 5.2 no longer
    lists it among a hello's errors (a node with CurveZMQ refuses in the handshake, section 14)."""
    opening = SPEC.split("### 5.2 Client session\n", 1)[1].split("- A client MUST send `hello`", 1)[0]
    errors = opening.split("or `error`", 1)[1].split("and no session is opened", 1)[0]
    assert "UNAUTHORIZED" not in errors and "TOO_MANY_CLIENTS" in errors
    assert "client reports `UNAUTHORIZED` itself" in opening
    assert ErrorCode.UNAUTHORIZED not in REQUEST_CODES["hello"].refusals
    # Every way a hello is refused in process carries another code.
    d = driver
    codes = [only(d.receive(b"c", hello(agent, 1, versions=(99,)), 1), Error, 1).code,
             only(d.receive(b"c", hello(agent, 2, regions=(*agent.regions, *agent.regions))), Error, 2).code]
    assert ErrorCode.UNAUTHORIZED not in codes


def test_the_docs_name_the_versions_the_package_speaks_under_one_name() -> None:
    """docs/architecture.md says which versions the package speaks; ``kvcr_protocol.versions``
    names them once (``PROTOCOL_VERSIONS``, the newest ``CURRENT_VERSION``)."""
    row = next(line for line in ARCHITECTURE.splitlines() if line.startswith("| `kvcr_protocol.versions`"))
    assert f"the package speaks 1-{kp.CURRENT_VERSION};" in row
    assert kp.PROTOCOL_VERSIONS == tuple(range(1, kp.CURRENT_VERSION + 1))
    names = [name for name in vars(kp.versions) if name.endswith("_VERSIONS")]
    assert names == ["PROTOCOL_VERSIONS"]
    for stale in ("SUPPORTED_VERSIONS", "LATEST_VERSION"):
        assert stale not in SPEC and stale not in ARCHITECTURE
