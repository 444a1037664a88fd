"""Lookups against one real ``kvcr-node`` process (spec sections 5.2 and 6.9).

At version 3 a query's answers travel as columns and a prefix query stops at the first
key that does not count; both must say exactly what the record form of versions 1 and 2
says, for keys in every state a query reports: held (READY), being filled (WRITING, here
by a fetch from a source that never answers), named by the session's hint, and absent.
Thousands of one-key queries may be in flight from one client. Hostile query frames are
refused with the field they break, and the node is left clean after every test.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvcr_client import Client, ErrorCode, KeyPresence, KeyStatus, OpHandle, Presence, Presences, Results, Span
from kvcr_protocol import (
    CURRENT_VERSION,
    Bye,
    Error,
    Hello,
    Message,
    PeerHello,
    Query,
    Welcome,
    decode,
    encode,
)
from kvcr_testing.health import assert_clean, counter, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import ClientAgent
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
LAYOUT = [("L0", "kv")]
READY, WRITING, HINTED, ABSENT = "ready", "writing", "hinted", "absent"
ANSWER = {
    READY: KeyPresence(Presence.HIT, "dram"),
    WRITING: KeyPresence(Presence.FETCHING, "dram"),
    HINTED: KeyPresence(Presence.FETCHABLE, "remote"),
    ABSENT: KeyPresence(Presence.MISS, ""),
}
COUNTED = [(Presence.HIT,), (Presence.HIT, Presence.FETCHING), (Presence.FETCHABLE,),
           (Presence.HIT, Presence.FETCHING, Presence.FETCHABLE)]
IN_FLIGHT = 3000
"""One-key queries sent before the first is waited on."""
RAW_TIMEOUT_MS = 5000

pytestmark = pytest.mark.usefixtures("node_left_clean")


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return ("--pool", "kv:4KiB:512")


class SilentSource:
    """A "source node" that takes connections and does not answer: a fetch from it keeps its
    keys WRITING until ``refuse`` answers the target's ``peer_hello`` with an error, which
    fails the fetch at once (``PEER_UNSUPPORTED``) and frees its slots (spec section 12)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def refuse(self) -> None:
        """Answer the first ``peer_hello`` waiting (bounded wait)."""
        assert self.sock.poll(RAW_TIMEOUT_MS, zmq.POLLIN), "the target never said peer_hello"
        identity, payload = self.sock.recv_multipart()
        hello = decode(payload, 1)
        assert isinstance(hello, PeerHello), hello
        refusal = Error(hello.id, int(ErrorCode.UNSUPPORTED_VERSION), "a test source speaks no version")
        self.sock.send_multipart([identity, encode(refusal, 1)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def silent_source(ipc_dir: Path) -> Iterator[SilentSource]:
    source = SilentSource(f"ipc://{ipc_dir}/silent.sock")
    yield source
    source.close()


def prefix_of(answers: list[KeyPresence], counted: tuple[Presence, ...]) -> int:
    """The prefix by the record form: the reference every count must agree with."""
    n = 0
    while n < len(answers) and answers[n].presence in counted:
        n += 1
    return n


class Mix:
    """Keys put in random states on the node; ``close`` ends the fetch that keeps some WRITING."""

    def __init__(
        self, client: Client, register: Registrar, source: SilentSource, key: Callable[[str], bytes], seed: int,
    ) -> None:
        rng = random.Random(seed)
        self.client = client
        every = [READY, WRITING, HINTED, ABSENT]  # each state at least once, then a random mix
        chosen = every + rng.choices(every, k=rng.randrange(0, 160))
        self.states = {key(f"{seed}-{i}"): state for i, state in enumerate(chosen)}
        of = {s: [k for k, v in self.states.items() if v == s] for s in (READY, WRITING, HINTED)}
        self.request = f"mix-{seed}"
        if of[READY]:
            region = register(pattern(len(of[READY]) * SLOT, seed))
            spans = {k: [Span("L0", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(of[READY])}
            assert client.deposit(spans).result(RESULT_TIMEOUT_S).all_ok
        self.source = source
        self.fetch: OpHandle[Results[Any]] | None = None
        if of[WRITING]:
            client.submit_hint(f"{self.request}-fill", source.endpoint, of[WRITING]).result(RESULT_TIMEOUT_S)
            self.fetch = client.fetch({k: LAYOUT for k in of[WRITING]}, f"{self.request}-fill", deadline_ms=600_000)
            assert wait_until(lambda: stats(client)["writing"] == len(of[WRITING]), RESULT_TIMEOUT_S)
        client.submit_hint(self.request, "tcp://127.0.0.1:1", of[HINTED] or [b"never-asked"]).result(RESULT_TIMEOUT_S)
        self.keys = list(self.states)
        rng.shuffle(self.keys)
        self.keys += rng.choices(self.keys, k=3)

    def expected(self, hinted: bool = True) -> list[KeyPresence]:
        return [ANSWER[ABSENT if s == HINTED and not hinted else s] for s in map(self.states.__getitem__, self.keys)]

    def close(self) -> None:
        if self.fetch is not None:
            self.source.refuse()
            results = self.fetch.result(RESULT_TIMEOUT_S)
            assert {(r.status, r.code) for r in results.values()} == {(KeyStatus.FAILED, ErrorCode.PEER_UNSUPPORTED)}
            self.client.discard_hint(f"{self.request}-fill").result(RESULT_TIMEOUT_S)
        self.client.discard_hint(self.request).result(RESULT_TIMEOUT_S)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_answer_as_the_record_form(
    node: Any, client: Client, register: Registrar, key: Callable[[str], bytes], silent_source: SilentSource, seed: int,
) -> None:
    assert client.node is not None and client.node.version >= 3  # columns
    mix = Mix(client, register, silent_source, key, seed)
    try:
        with Client(node.endpoint, name="lookups-v2", max_version=2) as v2, \
                Client(node.endpoint, name="lookups-v1", max_version=1) as v1:
            # Hints belong to their session: the older clients name the same keys in theirs.
            for old in (v2, v1):
                hinted = [k for k, s in mix.states.items() if s == HINTED] or [b"never-asked"]
                old.submit_hint(mix.request, "tcp://127.0.0.1:1", hinted).result(RESULT_TIMEOUT_S)
            assert [c.node.version for c in (client, v2, v1) if c.node is not None] == [CURRENT_VERSION, 2, 1]
            views = {v: c.query(mix.keys, mix.request).result(RESULT_TIMEOUT_S) for v, c in ((3, client), (2, v2), (1, v1))}
            for version, answers in views.items():
                assert isinstance(answers, Presences) and list(answers) == mix.keys, version
                assert [answers.at(i) for i in range(len(mix.keys))] == mix.expected(), version
                assert dict(answers.items()) == dict(zip(mix.keys, mix.expected(), strict=True)), version
            assert views[3] == views[2] == views[1]
            plain = client.query(mix.keys).result(RESULT_TIMEOUT_S)
            assert list(plain.values()) == mix.expected(hinted=False)
            for counted in COUNTED:
                want = prefix_of(mix.expected(), counted)
                got = [c.query_prefix(mix.keys, mix.request, counted).result(RESULT_TIMEOUT_S) for c in (client, v2, v1)]
                assert got == [want] * 3, (counted, got, want)
    finally:
        mix.close()


def test_thousands_of_queries_in_flight(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    held, absent = key("held"), key("absent")
    region = register(pattern(SLOT, 7))
    assert client.deposit({held: [Span("L0", region, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
    before = stats(client)
    handles = [client.query([held if i % 3 else absent]) for i in range(IN_FLIGHT)]
    prefixes = [client.query_prefix([held, absent, held]) for _ in range(100)]
    for i, handle in enumerate(handles):
        k = held if i % 3 else absent
        assert handle.result(RESULT_TIMEOUT_S)[k] == ANSWER[READY if i % 3 else ABSENT]
    assert [p.result(RESULT_TIMEOUT_S) for p in prefixes] == [1] * 100
    after = stats(client)
    assert counter(after, "send_dropped") == counter(before, "send_dropped")
    assert after["protocol_errors"] == before["protocol_errors"]
    assert client.tables()["pending"] == 0


class RawSession:
    """A hand-driven client session at version 3: a DEALER socket and a NIXL agent."""

    def __init__(self, endpoint: str) -> None:
        self.agent = ClientAgent("lookups-raw", np.zeros(SLOT, np.uint8))
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, RAW_TIMEOUT_MS)
        self.sock.connect(endpoint)
        a = self.agent
        welcome = self.request(encode(Hello(1, (1, 2, 3), a.name, a.name, a.metadata, a.regions), 1))
        assert isinstance(welcome, Welcome) and welcome.version == 3, welcome

    def request(self, payload: bytes) -> Message:
        self.sock.send(payload)
        return decode(self.sock.recv(), 3)

    def close(self) -> None:
        try:
            self.request(encode(Bye(99), 3))
        finally:
            self.sock.close(0)
            self.ctx.term()
            self.agent.close()


def patched(msg: Message, version: int, **fields: Any) -> bytes:
    obj = msgpack.unpackb(encode(msg, version))
    obj.update(fields)
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def test_hostile_query_frames_leave_the_node_clean(node: Any, client: Client) -> None:
    before = stats(client)["protocol_errors"]
    raw = RawSession(node.endpoint)
    cases: list[tuple[bytes, ErrorCode, str]] = [
        (patched(Query(2, ()), 3, keys=[b"k%d" % i for i in range(4097)]), ErrorCode.TOO_MANY, "keys"),
        (patched(Query(3, ()), 3, keys=[b"k", b"x" * 257]), ErrorCode.TOO_LARGE, "keys[1]"),
        (patched(Query(4, (b"k",)), 3, **{"!prefix": 0x11}), ErrorCode.OUT_OF_RANGE, "prefix"),
        (patched(Query(5, (b"k",)), 3, **{"!prefix": 1}), ErrorCode.OUT_OF_RANGE, "prefix"),
        (patched(Query(6, (b"k",)), 3, **{"!prefix": 256}), ErrorCode.OUT_OF_RANGE, "prefix"),
        (patched(Query(7, (b"k",)), 3, **{"!prefix": -2}), ErrorCode.OUT_OF_RANGE, "prefix"),
        (patched(Query(8, (b"k",)), 2, **{"!prefix": 2}), ErrorCode.MUST_UNDERSTAND, "!prefix"),
        (patched(Query(9, (b"k",)), 3, **{"!columns": [b"\1", b"\0", ["dram"]]}), ErrorCode.MUST_UNDERSTAND, "!columns"),
    ]
    try:
        for payload, code, path in cases:
            reply = raw.request(payload)
            assert isinstance(reply, Error), (path, reply)
            assert (reply.code, reply.path) == (code, path), reply
        # The session is whole afterwards: a prefix query is answered.
        reply = raw.request(encode(Query(11, (b"raw/none", b"raw/none2"), None, 2), 3))
        assert getattr(reply, "columns", None) is not None and len(reply.columns) == 0  # type: ignore[attr-defined]
    finally:
        raw.close()
    after = assert_clean(client)["protocol_errors"]
    for _, code, _ in cases:
        before[code.name] = before.get(code.name, 0) + 1
    assert after == before
