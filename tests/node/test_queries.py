"""Queries in process (``kvcr_node.ops.query``), with a fake clock: the column and record
forms, prefix queries, and the version-3 fields the node does not serve.

The node's loop never runs (``kvcr_testing.nodes.NodeDriver``). Keys are put in every state
a query reports through the node's own store (READY, WRITING) and hints (a hinted key the
node lacks), so each answer is known before asking; a version-2 and a version-3 session of
the same node must then give the same answers, the one as records, byte for byte as
version 2 always did, the other as columns (spec sections 5.2 and 6.9).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.ops.query import FIRST_RUN
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome
from kvcr_protocol import (
    CURRENT_VERSION,
    PREFIX_ALL,
    Ack,
    Error,
    ErrorCode,
    Hello,
    Message,
    Presence,
    Query,
    QueryReply,
    QueryResult,
    SubmitHint,
    Welcome,
    encode,
    prefix_mask,
)
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver
from kvcr_testing.patterns import pattern

SLOT = 4096
LAYOUT = (("L0", "kv"),)
READY, WRITING, HINTED, ABSENT = "ready", "writing", "hinted", "absent"
ANSWER = {
    READY: QueryResult(Presence.HIT, "dram"),
    WRITING: QueryResult(Presence.FETCHING, "dram"),
    HINTED: QueryResult(Presence.FETCHABLE, "remote"),
    ABSENT: QueryResult(Presence.MISS),
}
REQUEST = "req-1"
"""The request id whose hint names the HINTED keys."""
V3, V2 = b"c3", b"c2"
"""A version-3 and a version-2 session of the same client agent."""


def config(ipc_dir: Path) -> NodeConfig:
    return NodeConfig(endpoint=f"ipc://{ipc_dir}/q.sock", name="q", pools=(PoolSpec("kv", SLOT, 256, "dram"),),
                      log_level="WARNING", client_grace_ms=600_000, heartbeat_ms=2_000).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("query-client", pattern(2 * SLOT, 31))
    yield a
    a.close()


@pytest.fixture
def driver(ipc_dir: Path, agent: ClientAgent) -> Iterator[NodeDriver]:
    """A node with a session at the newest version (``V3``: columns) and a version-2 one (``V2``)."""
    with node_driver(config(ipc_dir)) as d:
        assert d.hello(V3, agent).version == CURRENT_VERSION >= 3  # the newest speaks columns
        welcome = d.receive(V2, Hello(1, (1, 2), agent.name, agent.name, agent.metadata, agent.regions), 2)
        assert len(welcome) == 1 and isinstance(welcome[0], Welcome) and welcome[0].version == 2, welcome
        yield d
        st = d.stats()
        assert st["invariants"] == [] and st["operations_pending"] == 0 and st["claims"]["total"] == 0, st


def only(replies: list[Message], kind: type[Message]) -> Any:
    assert len(replies) == 1 and isinstance(replies[0], kind), replies
    return replies[0]


def place(d: NodeDriver, states: dict[bytes, str]) -> None:
    """Put each key in its state: READY and WRITING in the store, HINTED in both sessions' hint."""
    store = d.node.store
    for key, state in states.items():
        if state in (READY, WRITING):
            outcome, entry = store.begin_deposit(key, LAYOUT)
            assert outcome is DepositOutcome.NEW and entry is not None
            if state == READY:
                store.commit(entry)
    hinted = tuple(k for k, s in states.items() if s == HINTED) or (b"never-asked",)
    for identity, version in ((V3, CURRENT_VERSION), (V2, 2)):
        assert d.receive(identity, SubmitHint(90, REQUEST, "tcp://127.0.0.1:1", hinted), version) == [Ack(90)]


def clear(d: NodeDriver, states: dict[bytes, str]) -> None:
    """Take the keys out of the store again (WRITING ones abandoned, READY ones removed)."""
    store = d.node.store
    for key, state in states.items():
        entry = store.lookup(key)
        if state == WRITING and entry is not None:
            store.abandon(entry)
        elif state == READY:
            assert store.remove(key)


def raw_reply(d: NodeDriver, identity: bytes, msg: Query, version: int) -> bytes:
    """The one frame the node sends for ``msg``, undecoded."""
    d.node.router.receive([identity, encode(msg, version)])
    frames = d.node.outbox.take()
    assert [to for to, _ in frames] == [identity], frames
    return frames[0][1]


def random_states(rng: random.Random, n: int) -> dict[bytes, str]:
    return {f"key-{rng.random():.12f}".encode(): rng.choice([READY, WRITING, HINTED, ABSENT]) for _ in range(n)}


# --------------------------------------------------------------------------- columns and records


@pytest.mark.parametrize("seed", range(6))
def test_columns_and_records_say_the_same_for_random_mixes(driver: NodeDriver, seed: int) -> None:
    rng = random.Random(seed)
    states = random_states(rng, rng.randrange(1, 300))
    place(driver, states)
    keys = list(states)
    rng.shuffle(keys)
    keys += rng.choices(keys, k=5)  # a key asked twice is answered twice
    expected = tuple(ANSWER[states[k]] for k in keys)
    for request_id, want in ((REQUEST, expected), (None, tuple(ANSWER[ABSENT if states[k] == HINTED else states[k]]
                                                                 for k in keys))):
        query = Query(7, tuple(keys), request_id)
        columns = only(driver.receive(V3, query), QueryReply)
        assert columns.results == () and columns.columns is not None
        assert columns.columns.results() == want == columns.view().results()
        # The record form of a version-2 session: byte for byte what version 2 always sent.
        assert raw_reply(driver, V2, query, 2) == encode(QueryReply(7, want), 2)
    clear(driver, states)


def test_an_empty_query_and_a_node_without_objects(driver: NodeDriver) -> None:
    reply = only(driver.receive(V3, Query(3, ())), QueryReply)
    assert reply.columns is not None and len(reply.columns) == 0
    assert raw_reply(driver, V2, Query(3, ()), 2) == encode(QueryReply(3, ()), 2)
    keys = tuple(f"none-{i}".encode() for i in range(1000))
    reply = only(driver.receive(V3, Query(4, keys)), QueryReply)
    assert reply.columns is not None and reply.columns.presence == bytes(1000) and reply.view().results() == (
        (ANSWER[ABSENT],) * 1000)


# --------------------------------------------------------------------------- prefix queries


def lookups(d: NodeDriver, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every key the store looks up from now on (one entry per batch)."""
    store = d.node.store
    seen: list[int] = []
    real = store.lookup_codes

    def counting(keys: Sequence[bytes]) -> bytes:
        seen.append(len(keys))
        return real(keys)

    monkeypatch.setattr(store, "lookup_codes", counting)
    return seen


BOUNDARIES = {
    "empty": [],
    "first-missing": [ABSENT] + [READY] * 40,
    "all-present": [READY] * 40,
    "last-missing": [READY] * 39 + [ABSENT],
    "one-run": [READY] * FIRST_RUN + [ABSENT] * 5,
    "one-past-a-run": [READY] * (FIRST_RUN + 1) + [ABSENT],
    "writing-stops": [READY, READY, WRITING, READY],
    "hinted-stops": [READY, HINTED, READY],
}


@pytest.mark.parametrize("states", BOUNDARIES.values(), ids=BOUNDARIES.keys())
def test_prefix_on_every_boundary(driver: NodeDriver, monkeypatch: pytest.MonkeyPatch, states: list[str]) -> None:
    keyed = {f"p{i}".encode(): s for i, s in enumerate(states)}
    place(driver, keyed)
    keys = tuple(keyed)
    full = only(driver.receive(V3, Query(5, keys, REQUEST)), QueryReply).view().results()
    seen = lookups(driver, monkeypatch)
    for counted in ((Presence.HIT,), (Presence.HIT, Presence.FETCHING), (Presence.HIT, Presence.FETCHING, Presence.FETCHABLE)):
        seen.clear()
        mask = prefix_mask(*counted)
        expected = 0
        while expected < len(states) and full[expected].presence in counted:
            expected += 1
        reply = only(driver.receive(V3, Query(6, keys, REQUEST, mask)), QueryReply)
        assert reply.columns is not None and reply.results == ()
        # One answer per counted key: the reply's length is the prefix.
        assert len(reply.columns) == expected and reply.columns.results() == full[:expected]
        assert reply.columns.prefix_length(mask) == expected
        # The node stopped after the run that held the first uncounted key.
        assert sum(seen) <= min(len(keys), 2 * expected + FIRST_RUN), (seen, expected)
    clear(driver, keyed)


def test_a_prefix_query_stops_at_a_first_miss_after_one_short_run(
    driver: NodeDriver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = tuple(f"miss-{i}".encode() for i in range(4096))
    seen = lookups(driver, monkeypatch)
    reply = only(driver.receive(V3, Query(8, keys, None, PREFIX_ALL)), QueryReply)
    assert reply.columns is not None and len(reply.columns) == 0
    assert seen == [FIRST_RUN]


# --------------------------------------------------------------------------- refusals


def frame(msg: Message, version: int, **changes: Any) -> bytes:
    """``msg`` encoded at ``version``, with raw fields changed (a hostile or older sender)."""
    obj = msgpack.unpackb(encode(msg, version))
    obj.update(changes)
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def refused(d: NodeDriver, identity: bytes, payload: bytes, version: int) -> tuple[ErrorCode, str]:
    d.receive_frames([identity, payload])
    error = only(d.sent(identity, max(version, CURRENT_VERSION)), Error)
    return ErrorCode(error.code), error.path


@pytest.mark.parametrize("mask", [0x01, 0x03, 0x10, 0x11, 0xF0, 0xFF])
def test_a_prefix_mask_with_unknown_bits_is_refused(driver: NodeDriver, mask: int) -> None:
    payload = frame(Query(9, (b"k",)), 3, **{"!prefix": mask})
    assert refused(driver, V3, payload, 3) == (ErrorCode.OUT_OF_RANGE, "prefix")


def test_older_sessions_cannot_ask_a_prefix_or_send_columns(driver: NodeDriver) -> None:
    # A version-2 frame with a version-3 field: an unknown must-understand key.
    assert refused(driver, V2, frame(Query(10, (b"k",)), 2, **{"!prefix": 2}), 2) == (ErrorCode.MUST_UNDERSTAND, "!prefix")
    # Columns are the node's to send, never the client's: unknown on a query at any version.
    assert refused(driver, V3, frame(Query(11, (b"k",)), 3, **{"!columns": []}), 3) == (ErrorCode.MUST_UNDERSTAND, "!columns")
    # A version-3 frame in a version-2 session.
    assert refused(driver, V2, frame(Query(12, (b"k",)), 3), 2) == (ErrorCode.UNSUPPORTED_VERSION, "v")


def test_oversized_and_malformed_key_lists_are_refused(driver: NodeDriver) -> None:
    too_many = [f"k{i}".encode() for i in range(4097)]
    assert refused(driver, V3, frame(Query(13, ()), 3, keys=too_many), 3) == (ErrorCode.TOO_MANY, "keys")
    assert refused(driver, V3, frame(Query(14, ()), 3, keys=[b"a", b""]), 3) == (ErrorCode.OUT_OF_RANGE, "keys[1]")
    assert refused(driver, V3, frame(Query(15, ()), 3, keys=[b"a", b"x" * 257]), 3) == (ErrorCode.TOO_LARGE, "keys[1]")
    assert refused(driver, V3, frame(Query(16, ()), 3, keys=[b"a", "text"]), 3) == (ErrorCode.WRONG_TYPE, "keys[1]")
    assert refused(driver, V3, frame(Query(17, ()), 3, **{"!prefix": "HIT"}), 3) == (ErrorCode.WRONG_TYPE, "prefix")
