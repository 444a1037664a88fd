"""Hostile but well-formed hints: bad source endpoints, other clients' request ids, floods.

A hint names a source node for a request's keys (spec section 5.2). A node must refuse a
hint whose endpoint it cannot dial (``BAD_ENDPOINT`` at ``endpoint``) instead of
crashing on it later; keep each session's hints to itself, so that no client can see or
steer another client's request; bound them per session (``HINT_LIMIT``); and forget them
at ``bye`` or when the session expires. After each test the node is alive and clean: no
breach, claim, slot or hint left.

Hints the public client would refuse are sent through the client's core, as a hostile
client would send them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvcr_client import ArgumentError, Client, ErrorCode, KeyStatus, NodeError, Presence, Span
from kvcr_protocol import IPC_PATH_MAX, Ack, Bye, DiscardHint, Hello, Message, SubmitHint, Welcome, decode, encode
from kvcr_testing.health import assert_clean, counter, slot_accounting, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, plain_layout
from kvcr_testing.measure import fd_count, rss_kib
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern
from kvcr_testing.remote import Site, deliver_checked

SLOT = 4 * KiB
POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(4)])
FETCH_LAYOUT = [(name, "kv") for name in LAYOUT.names]
GRACE_MS = 400
"""Client grace of the expiry test: a silent session is dropped after this."""

SOAK_ROUNDS = 3
SOAK_HINTS = 5000
"""Hints one session submits and discards per round."""
SOAK_BATCH = 500
"""Hints in flight at once (replies stay under the sockets' high-water marks)."""
SOAK_SESSIONS = 40
SOAK_LEFT = 100
"""Hints each of ``SOAK_SESSIONS`` sessions leaves behind at bye, per round."""
SOAK_KEYS = 16
FD_SLACK = 2
SETTLE_S = 5.0
"""Bound on the wait for closed connections' descriptors to go."""
RSS_SLACK_KIB = 4096
"""The node's growth allowed over the soak; leaked hints would cost about 3 MiB a round."""

BAD_ENDPOINTS = [
    "bogus://x",
    "tcp://no such host:1",
    "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1:0",
    "tcp://999.1.1.1:5",
    "tcp://*:5555",
    "tcp://[::1:5555",
    "tcp://127.0.0.1:5\x00",
    "ipc://",
    "ipc:///tmp/" + "x" * IPC_PATH_MAX,
    "ipc:///tmp/with space",
    "inproc://kvcr-zap",
    "udp://127.0.0.1:5555",
    "no-scheme-at-all",
]


def _ack(msg: Message) -> None:
    assert isinstance(msg, Ack), msg


def raw_hint(client: Client, request_id: str, endpoint: str, keys: Sequence[bytes]) -> None:
    """A hint sent as is, past the client's own checks; raises the node's refusal."""
    _, fut = client.core.request(lambda i: SubmitHint(i, request_id, endpoint, tuple(keys)), _ack, RESULT_TIMEOUT_S)
    client.core.wait(fut, RESULT_TIMEOUT_S)


def dst_spans(region: Any) -> list[Span]:
    return [Span(name, region, off, size) for (name, _, size), off in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]


def deposit(client: Client, reg: Registrar, key: bytes, seed: int) -> np.ndarray:
    src = pattern(LAYOUT.nbytes, seed)
    out = client.deposit({key: LAYOUT.source_spans(reg(src))}).result(RESULT_TIMEOUT_S)[key]
    assert out.status is KeyStatus.STORED, out
    return src


def deliver_into_fresh(client: Client, reg: Registrar, key: bytes, seed: int, request_id: str | None = None) -> Any:
    """Deliver ``key`` into a new sentinel buffer; returns (outcome, buffer, its pattern)."""
    dst = pattern(LAYOUT.nbytes, seed)
    before = dst.copy()
    out = client.deliver({key: dst_spans(reg(dst))}, request_id=request_id).result(RESULT_TIMEOUT_S)[key]
    return out, dst, before


def test_hint_with_a_bad_endpoint_is_refused_and_the_node_goes_on(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL)
    with Client(node.endpoint, name="hinter") as client:
        reg = Registrar(client)
        src = deposit(client, reg, b"here", seed=1)
        slots = slot_accounting(stats(client))
        for n, endpoint in enumerate(BAD_ENDPOINTS):
            rid = f"r{n}"
            with pytest.raises(ArgumentError) as arg:
                client.submit_hint(rid, endpoint, [b"k"])
            assert arg.value.field == "source_endpoint", arg.value
            with pytest.raises(NodeError) as refused:
                raw_hint(client, rid, endpoint, [b"k"])
            assert refused.value.code == ErrorCode.BAD_ENDPOINT, (endpoint, refused.value)
            assert refused.value.path == "endpoint", (endpoint, refused.value)
            # Nothing of the hint was kept: the key is a plain miss, for query, deliver and fetch.
            assert client.query([b"k"], request_id=rid).result(RESULT_TIMEOUT_S)[b"k"].presence is Presence.MISS
            out, dst, before = deliver_into_fresh(client, reg, b"k", seed=10 + n, request_id=rid)
            assert out.status is KeyStatus.FAILED and out.code == ErrorCode.NOT_FOUND, (endpoint, out)
            assert_bytes_equal(dst, before, f"destination after a refused hint to {endpoint!r}")
            fetched = client.fetch({b"k": FETCH_LAYOUT}, request_id=rid).result(RESULT_TIMEOUT_S)[b"k"]
            assert fetched.code == ErrorCode.NOT_FOUND, (endpoint, fetched)
            assert node.proc.poll() is None, "".join(node.output)
        # The node still serves: a local key comes back byte-exact.
        out, dst, _ = deliver_into_fresh(client, reg, b"here", seed=99)
        assert out.status is KeyStatus.OK, out
        assert_bytes_equal(dst, src, "local deliver after the refused hints")
        st = assert_clean(client, slots_before=slots)
        assert st["peers"] == {}, st["peers"]
        reg.close()
    assert node.proc.poll() is None


# --------------------------------------------------------------------------- scope, limits, lifetime


def tables(st: dict[str, Any]) -> dict[str, int]:
    return dict(st["tables"])


def test_a_hint_belongs_to_the_client_that_submitted_it(sites: Any) -> None:
    """A second client sees nothing of the first one's hint under the same request id, and
    its own hint under that id steers only its own requests."""
    a, b = sites.start("a", "b")
    src = b.deposit(b"k", plain_layout(2), seed=1)
    layout = plain_layout(2)
    a.client.submit_hint("req", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
    nowhere = f"ipc://{Path(a.endpoint.removeprefix('ipc://')).parent}/nobody.sock"
    with Client(a.endpoint, name="other") as other:
        other_site = Site(a.node, other, Registrar(other))
        try:
            assert other.query([b"k"], request_id="req").result(RESULT_TIMEOUT_S)[b"k"].presence is Presence.MISS
            deliver_checked(other_site, b"k", layout, None, range(2), seed=2, request_id="req",
                                           code=ErrorCode.NOT_FOUND)
            fetched = other.fetch({b"k": [(n, "kv") for n in layout.names]}, request_id="req").result(RESULT_TIMEOUT_S)
            assert fetched[b"k"].code == ErrorCode.NOT_FOUND, fetched[b"k"]
            # The other client's own hint under the same id: its requests only.
            other.submit_hint("req", nowhere, [b"k"]).result(RESULT_TIMEOUT_S)
            assert other.query([b"k"], request_id="req").result(RESULT_TIMEOUT_S)[b"k"].presence is Presence.FETCHABLE
            assert tables(stats(other))["hints"] == 2
            # The first client's request still goes to the source it named, byte-exact.
            assert a.client.query([b"k"], request_id="req").result(RESULT_TIMEOUT_S)[b"k"].presence is Presence.FETCHABLE
            deliver_checked(a, b"k", layout, src, range(2), seed=3, request_id="req")
            other.discard_hint("req").result(RESULT_TIMEOUT_S)
            # Discarding it is the other client's business only: the first one's hint stays.
            deliver_checked(a, b"k", layout, src, range(2), seed=4, request_id="req")
            assert nowhere not in stats(other)["peers"], "the other client's hint was never used"
        finally:
            other_site.reg.close()
    a.client.discard_hint("req").result(RESULT_TIMEOUT_S)
    assert tables(a.stats())["hints"] == 0


def test_hint_limits_per_session(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL, "--max-hints-per-session", "4", "--max-hinted-keys-per-session", "10")
    keys = [f"k{i}".encode() for i in range(12)]
    with Client(node.endpoint, name="hinter") as client, Client(node.endpoint, name="neighbour") as neighbour:
        for i in range(4):
            client.submit_hint(f"r{i}", "tcp://127.0.0.1:7", keys[2 * i : 2 * i + 2]).result(RESULT_TIMEOUT_S)
        with pytest.raises(NodeError) as err:
            client.submit_hint("r4", "tcp://127.0.0.1:7", keys[:1]).result(RESULT_TIMEOUT_S)
        assert (err.value.code, err.value.path) == (ErrorCode.HINT_LIMIT, "request_id"), err.value
        assert "max_hints_per_session" in err.value.reason, err.value
        # Replacing a request's hint is not one more hint; its keys count instead of the old ones.
        client.submit_hint("r0", "tcp://127.0.0.1:8", keys[:4]).result(RESULT_TIMEOUT_S)  # 10 keys in all
        with pytest.raises(NodeError) as err:
            client.submit_hint("r1", "tcp://127.0.0.1:7", keys[:3]).result(RESULT_TIMEOUT_S)  # would be 11
        assert (err.value.code, err.value.path) == (ErrorCode.HINT_LIMIT, "keys"), err.value
        assert "max_hinted_keys_per_session" in err.value.reason, err.value
        # A refused hint changed nothing: r1 still names its own keys.
        assert client.query(keys[2:4], request_id="r1").result(RESULT_TIMEOUT_S)[keys[2]].presence is Presence.FETCHABLE
        assert client.query(keys[:1], request_id="r1").result(RESULT_TIMEOUT_S)[keys[0]].presence is Presence.MISS
        # Another session has a budget of its own.
        for i in range(4):
            neighbour.submit_hint(f"r{i}", "tcp://127.0.0.1:7", keys[:2]).result(RESULT_TIMEOUT_S)
        st = stats(client)
        assert (tables(st)["hints"], tables(st)["hinted_keys"]) == (8, 18), tables(st)
        client.discard_hint("r3").result(RESULT_TIMEOUT_S)
        client.submit_hint("r4", "tcp://127.0.0.1:7", keys[:2]).result(RESULT_TIMEOUT_S)
        for i in range(5):
            client.discard_hint(f"r{i}").result(RESULT_TIMEOUT_S)
    st = assert_clean(stats_client := Client(node.endpoint, name="after"))
    stats_client.close()
    assert (tables(st)["hints"], tables(st)["hinted_keys"]) == (0, 0), tables(st)


class RawSession:
    """A session opened on a plain DEALER with another client's agent (its memory is never touched).

    Sharing the agent keeps the node from loading and dropping one NIXL agent per session,
    so these tests measure hints, not agents.
    """

    def __init__(self, sock: zmq.Socket[bytes], agent: Any, name: str) -> None:
        self.sock = sock
        self.next_id = 1
        welcome = self.call(Hello(self._id(), (1, 2), name, agent.name, agent.metadata(), ()), version=1)
        assert isinstance(welcome, Welcome), welcome

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def call(self, msg: Message, version: int = 2) -> Message:
        self.send_all([msg], version)
        return self.recv()

    def send_all(self, msgs: Sequence[Message], version: int = 2) -> None:
        for msg in msgs:
            self.sock.send(encode(msg, version))

    def recv(self) -> Message:
        assert self.sock.poll(int(RESULT_TIMEOUT_S * 1000)), "no reply from the node"
        return decode(self.sock.recv(), 2)

    def hints(self, request_ids: Sequence[str], keys: Sequence[bytes]) -> None:
        """Submit one hint per request id, pipelined; every one must be acknowledged."""
        self.send_all([SubmitHint(self._id(), rid, "tcp://127.0.0.1:7", tuple(keys)) for rid in request_ids])
        for _ in request_ids:
            reply = self.recv()
            assert isinstance(reply, Ack), reply

    def discard(self, request_ids: Sequence[str]) -> None:
        self.send_all([DiscardHint(self._id(), rid) for rid in request_ids])
        for _ in request_ids:
            assert isinstance(self.recv(), Ack)

    def bye(self) -> None:
        assert isinstance(self.call(Bye(self._id())), Ack)
        self.sock.close(0)


@contextmanager
def raw_sessions(endpoint: str, agent: Any) -> Iterator[Callable[[str], RawSession]]:
    """Opens ``RawSession`` s by name; every socket is closed (and the context ended) on exit."""
    ctx: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def open_session(name: str) -> RawSession:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        socks.append(sock)
        sock.connect(endpoint)
        return RawSession(sock, agent, name)

    try:
        yield open_session
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def test_hints_vanish_at_bye_and_when_the_session_expires(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*POOL, "--heartbeat-ms", "100", "--client-grace-ms", str(GRACE_MS))
    with Client(node.endpoint, name="keeper") as keeper, raw_sessions(node.endpoint, keeper.core.agent) as session:
        polite, silent = session("polite"), session("silent")
        polite.hints([f"p{i}" for i in range(20)], [b"k1", b"k2"])
        silent.hints([f"s{i}" for i in range(30)], [b"k1", b"k2", b"k3"])
        assert (tables(stats(keeper))["hints"], tables(stats(keeper))["hinted_keys"]) == (50, 130)
        polite.bye()
        assert (tables(stats(keeper))["hints"], tables(stats(keeper))["hinted_keys"]) == (30, 90)
        # The silent session says nothing more: it expires, and its hints with it.
        assert wait_until(lambda: counter(stats(keeper), "clients_expired") == 1, 20 * GRACE_MS / 1000)
        st = assert_clean(keeper)
        assert (tables(st)["hints"], tables(st)["hinted_keys"]) == (0, 0), tables(st)
        assert st["clients"] == 1, st
    assert node.proc.poll() is None


def test_hint_churn_soak(node_factory: Callable[..., Any]) -> None:
    """Thousands of hints submitted and discarded, and many sessions that leave theirs at
    bye: the node's descriptors, memory and hint table come back to where they were."""
    node = node_factory(*POOL)
    keys = [bytes([i]) * 32 for i in range(SOAK_KEYS)]
    with Client(node.endpoint, name="keeper") as keeper, raw_sessions(node.endpoint, keeper.core.agent) as session:
        keeper_fds = fd_count(node.proc.pid)

        def churn(round_no: int) -> None:
            # One session: SOAK_HINTS hints, submitted and discarded in batches.
            churner = session(f"churn{round_no}")
            for start in range(0, SOAK_HINTS, SOAK_BATCH):
                ids = [f"c{round_no}-{n}" for n in range(start, start + SOAK_BATCH)]
                churner.hints(ids, keys)
                churner.discard(ids)
            churner.bye()
            # Many sessions, each leaving its hints behind at bye.
            for s in range(SOAK_SESSIONS):
                leaver = session(f"leaver{round_no}-{s}")
                leaver.hints([f"l{round_no}-{s}-{n}" for n in range(SOAK_LEFT)], keys)
                leaver.bye()

        churn(0)  # warm-up: the node's allocator reaches its working size
        assert tables(stats(keeper))["hints"] == 0
        # Connections of closed sessions are closed by ZeroMQ's I/O thread, a little later.
        assert wait_until(lambda: fd_count(node.proc.pid) <= keeper_fds, SETTLE_S)
        fds_before, rss_before = fd_count(node.proc.pid), rss_kib(node.proc.pid)
        for round_no in range(1, SOAK_ROUNDS + 1):
            churn(round_no)
        wait_until(lambda: fd_count(node.proc.pid) <= fds_before + FD_SLACK, SETTLE_S)
        fds_after, rss_after = fd_count(node.proc.pid), rss_kib(node.proc.pid)
        st = assert_clean(keeper)
        print(f"\nhint churn: {SOAK_ROUNDS} rounds; descriptors {fds_before} -> {fds_after}, "
              f"RSS {rss_before} -> {rss_after} KiB, tables {tables(st)}")
        assert (tables(st)["hints"], tables(st)["hinted_keys"]) == (0, 0), tables(st)
        assert st["clients"] == 1, st
        assert fds_after <= fds_before + FD_SLACK, (fds_before, fds_after)
        assert rss_after <= rss_before + RSS_SLACK_KIB, (rss_before, rss_after)
    assert node.proc.poll() is None
