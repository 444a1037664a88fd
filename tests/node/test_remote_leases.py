"""Leases on hinted keys in process: a target node driven message by message (``NodeDriver``,
fake clock) and a scripted source, a ROUTER socket of the test that answers what the test
says, or never (spec section 6.11).

What the audit found (issue 23, rows 6 and 7) is checked deterministically here: lease
requests to a source that reads but never answers end at SOURCE_ANSWER_S on a live link and
free what they hold; a late grant is released at once; a link sends a source that does not
read a bounded number of bytes; a pending lease counts against its session's limits; a
remote lease outlives a disconnect until ``peer_dead_ms`` (then PEER_UNREACHABLE), ends
PEER_RESTARTED when the source comes back a new incarnation, and goes on (checked by a
renewal) when it comes back the same. A source carries a reconnecting target's leases over
to the new peer session. Real node processes: tests/integration/test_remote_leases.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvcr_node import lease_requests as lease_requests_module
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, LeaseCount
from kvcr_node.leases import SOURCE_ANSWER_S
from kvcr_node.peers import LinkState, PeerLink
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome
from kvcr_protocol import (
    CURRENT_VERSION,
    Ack,
    Error,
    ErrorCode,
    Lease,
    LeaseColumns,
    LeaseEnded,
    LeaseReply,
    LeaseStatus,
    Message,
    PeerHello,
    PeerWelcome,
    ReleaseLease,
    RenewLease,
    SubmitHint,
    decode,
    encode,
)
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096
PEER_DEAD_MS = 4_000
SOURCE = 42
"""The scripted source's incarnation."""
RECV_TIMEOUT_MS = 5_000
"""A frame or a monitor event reaches the other side within this (bounded waits, no sleeps)."""
POLL_SLICE_MS = 50
HINTED = (b"h0", b"h1")


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/target.sock", name="target", pools=(PoolSpec("kv", SLOT, 16, "dram"),),
                      log_level="ERROR", client_grace_ms=600_000, heartbeat_ms=0, peer_dead_ms=PEER_DEAD_MS,
                      lease_ttl_ms=60_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


class Source:
    """A scripted source node: a ROUTER that reads what the target's link sends and answers
    only what the test tells it to."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.peer = b""

    def recv(self) -> Message:
        self.peer, frame = self.sock.recv_multipart()
        return decode(frame, CURRENT_VERSION)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([self.peer, encode(msg, CURRENT_VERSION)])

    def welcome(self, incarnation: int = SOURCE) -> None:
        hello = self.recv()
        assert isinstance(hello, PeerHello), hello
        # Not NIXL metadata: the target logs and goes on without the source's agent (no transfer here).
        self.send(PeerWelcome(hello.id, CURRENT_VERSION, "source", incarnation, "source-agent", b"no-agent"))

    def grant(self, ask: Message, lease: int) -> None:
        """Answer a ``lease`` from the target: every key LEASED under ``lease``."""
        assert isinstance(ask, Lease), ask
        n = len(ask.keys)
        self.send(LeaseReply(ask.id, lease, ask.ttl_ms, LeaseColumns(bytes([LeaseStatus.LEASED]) * n, bytes(n), ("dram",))))

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("remote-leases-client", np.zeros(SLOT, dtype=np.uint8))
    yield a
    a.close()


def pump(d: NodeDriver, done: Callable[[], bool], what: str) -> None:
    """Read what the links' sockets and monitors report until ``done`` holds (bounded)."""
    deadline = time.monotonic() + RECV_TIMEOUT_MS / 1000
    links = d.node.links
    while not done():
        assert time.monotonic() < deadline, what
        for sock in dict(links.poller.poll(POLL_SLICE_MS)):
            link = links.socks.get(sock)
            if link is not None:
                links.drain(link)


def collect(d: NodeDriver, into: list[Message], identity: bytes = b"c") -> Callable[[], bool]:
    """A ``pump`` condition: what the node sent ``identity`` goes into ``into``; true once any came."""
    def check() -> bool:
        into.extend(d.sent(identity))
        return bool(into)
    return check


def link_of(d: NodeDriver, source: Source) -> PeerLink:
    return d.node.links.by_endpoint[source.endpoint]


def welcomed(d: NodeDriver, source: Source, incarnation: int = SOURCE) -> PeerLink:
    """``source`` answers the link's hello; the node reads the welcome (and sends what waited)."""
    source.welcome(incarnation)
    link = link_of(d, source)
    pump(d, lambda: link.state is LinkState.READY and link.incarnation == incarnation, "the welcome was not read")
    return link


def store_local(d: NodeDriver, key: bytes) -> None:
    outcome, entry = d.node.store.begin_deposit(key, (("L0", "kv"),))
    assert outcome is DepositOutcome.NEW and entry is not None
    d.node.store.commit(entry)


def statuses(reply: Message) -> list[LeaseStatus]:
    assert isinstance(reply, LeaseReply) and reply.columns is not None, reply
    return list(reply.columns)


def at_rest(d: NodeDriver) -> dict[str, Any]:
    st = d.stats()
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0 and st["leases"]["held"] == 0, (st["claims"], st["leases"])
    tables = st["tables"]
    assert tables["lease_asks"] == 0 and tables["source_leases"] == 0, tables
    for session in d.node.sessions.table.values():
        assert session.leased_slots == 0 and not session.pool_slots and not session.leases, session.name
    return st


def held_remote_lease(d: NodeDriver, source: Source, source_lease: int = 77) -> int:
    """Lease the hinted keys at ``source`` and the local key: the client's lease id."""
    store_local(d, b"local")
    assert d.receive(b"c", SubmitHint(2, "r", source.endpoint, HINTED)) == [Ack(2)]
    assert d.receive(b"c", Lease(3, (*HINTED, b"local"), "r")) == []  # it waits for the source
    welcomed(d, source)
    source.grant(source.recv(), source_lease)
    replies: list[Message] = []
    pump(d, collect(d, replies), "the lease was not answered")
    assert statuses(replies[0]) == [LeaseStatus.LEASED_REMOTE, LeaseStatus.LEASED_REMOTE, LeaseStatus.LEASED]
    lease: int = replies[0].lease  # type: ignore[attr-defined]
    assert lease and d.stats()["leases"]["at_sources"] == 1
    return lease


def disconnect(d: NodeDriver, source: Source) -> PeerLink:
    link = link_of(d, source)
    source.close()
    pump(d, lambda: link.state is LinkState.DOWN, "the link never saw the source go")
    return link


# ---------------------------------------------------------------- a source that does not answer (row 6)


def test_a_lease_asked_of_a_silent_source_answers_in_time_and_holds_nothing_after(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any],
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        assert d.receive(b"c", SubmitHint(2, "r", source.endpoint, HINTED)) == [Ack(2)]
        assert d.receive(b"c", Lease(3, HINTED, "r")) == []
        welcomed(d, source)
        ask = source.recv()  # read, never answered: a frozen or hostile source on a live link
        assert isinstance(ask, Lease)
        assert d.node.sessions.table[b"c"].leased_slots == 2  # pending: its keys count
        d.tick(SOURCE_ANSWER_S - 0.01)
        assert d.sent(b"c") == []
        d.tick(0.01)
        reply = d.sent(b"c")
        assert len(reply) == 1 and statuses(reply[0]) == [LeaseStatus.UNREACHABLE] * 2
        assert reply[0].lease == 0  # type: ignore[attr-defined]
        # Given up: nothing of it is held but the count of its frame's bytes (still in the queue).
        link = link_of(d, source)
        assert not link.asks and list(link.abandoned) == [ask.id] and link.ask_bytes > 0
        st = at_rest(d)
        assert st["tables"]["lease_asks_abandoned"] == 1 and st["leases"]["held"] == 0
        # The source wakes up and grants it: the lease nobody waits for is released at once.
        source.grant(ask, 78)
        pump(d, lambda: not link.abandoned, "the late answer was not taken")
        release = source.recv()
        assert isinstance(release, ReleaseLease) and release.lease == 78
        source.send(Ack(release.id))
        pump(d, lambda: not link.asks, "the release was not answered")
        assert link.ask_bytes == 0 and d.node.counters[Count.LEASE_ASKS_LATE] == 1
        at_rest(d)
    source.close()


def test_a_link_sends_a_source_that_does_not_read_a_bounded_number_of_bytes(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = tuple(b"k%03d" % i + b"x" * 96 for i in range(8))
    frame = len(encode(Lease(1 << 40, keys, None, 60_000), CURRENT_VERSION))
    monkeypatch.setattr(lease_requests_module, "ASK_BYTES_PER_LINK", 2 * frame + frame // 2)  # room for two asks
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        assert d.receive(b"c", SubmitHint(2, "r", source.endpoint, keys)) == [Ack(2)]
        assert d.receive(b"c", Lease(3, keys, "r")) == []
        welcomed(d, source)
        first = source.recv()
        pump(d, lambda: bool(link_of(d, source).asks), "the first ask was not sent")
        assert d.receive(b"c", Lease(4, keys, "r")) == []  # sent too
        second = source.recv()
        # A third would pass the link's bytes: answered at once, unsent, holding nothing.
        third = d.receive(b"c", Lease(5, keys, "r"))
        assert len(third) == 1 and statuses(third[0]) == [LeaseStatus.UNREACHABLE] * 8 and third[0].lease == 0  # type: ignore[attr-defined]
        d.tick(SOURCE_ANSWER_S)
        assert [statuses(r) for r in d.sent(b"c")] == [[LeaseStatus.UNREACHABLE] * 8] * 2
        # Given up, their bytes still count: the queue to the source does not grow.
        assert statuses(d.receive(b"c", Lease(6, keys, "r"))[0]) == [LeaseStatus.UNREACHABLE] * 8
        assert d.node.counters[Count.LEASE_ASKS_REFUSED] == 2
        at_rest(d)
        # The source answers them (refusing, as for a session it dropped): the bytes are free again.
        for ask in (first, second):
            source.send(Error(ask.id, ErrorCode.BAD_STATE, "no session"))
        link = link_of(d, source)
        pump(d, lambda: not link.abandoned and link.ask_bytes == 0, "the late answers were not taken")
        assert d.receive(b"c", Lease(7, keys, "r")) == []
        source.grant(source.recv(), 79)
        replies: list[Message] = []
        pump(d, collect(d, replies), "the lease was not answered")
        assert statuses(replies[0]) == [LeaseStatus.LEASED_REMOTE] * 8
        lease = replies[0].lease  # type: ignore[attr-defined]
        assert d.receive(b"c", ReleaseLease(8, lease)) == [Ack(8)]
        release = source.recv()
        assert isinstance(release, ReleaseLease) and release.lease == 79
        source.send(Ack(release.id))
        pump(d, lambda: not link.asks, "the release was not answered")
        at_rest(d)
    source.close()


def test_a_pending_lease_counts_against_its_sessions_limits(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any],
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    hinted = tuple(b"h%d" % i for i in range(4))
    with node_driver(config(ipc_dir, max_leases_per_session=2, max_leased_slots_per_session=3)) as d:
        d.hello(b"c", agent)
        store_local(d, b"local")
        assert d.receive(b"c", SubmitHint(2, "r", source.endpoint, hinted)) == [Ack(2)]
        # Three keys are asked of the source and count one slot each while they wait; the fourth
        # would pass the session's slots: LEASE_LIMIT, never asked.
        assert d.receive(b"c", Lease(3, hinted, "r")) == []
        welcomed(d, source)
        ask = source.recv()
        assert isinstance(ask, Lease) and ask.keys == hinted[:3]
        local = d.receive(b"c", Lease(4, (b"local",)))
        assert statuses(local[0]) == [LeaseStatus.LEASE_LIMIT]  # the pending keys fill the session's slots
        # A pending lease is one of the session's leases: with two pending, a third is refused whole.
        d.hello(b"c2", agent)
        assert d.receive(b"c2", SubmitHint(2, "r", source.endpoint, hinted)) == [Ack(2)]
        assert d.receive(b"c2", Lease(3, hinted[:1], "r")) == []
        assert d.receive(b"c2", Lease(4, hinted[1:2], "r")) == []
        refused = d.receive(b"c2", Lease(5, hinted[2:3], "r"))
        assert len(refused) == 1 and isinstance(refused[0], Error) and refused[0].code == ErrorCode.LEASE_LIMIT
        assert d.stats()["invariants"] == []
        d.tick(SOURCE_ANSWER_S)  # nobody answers: every pending lease answers, holding nothing
        first = d.sent(b"c")
        assert len(first) == 1 and statuses(first[0]) == [LeaseStatus.UNREACHABLE] * 3 + [LeaseStatus.LEASE_LIMIT]
        assert len(d.sent(b"c2")) == 2
        at_rest(d)
        # Its slots are free again.
        local = d.receive(b"c", Lease(6, (b"local",)))
        assert statuses(local[0]) == [LeaseStatus.LEASED]
        assert d.receive(b"c", ReleaseLease(7, local[0].lease)) == [Ack(7)]  # type: ignore[attr-defined]
        at_rest(d)
    source.close()


# ---------------------------------------------------------------- outages and restarts (row 7)


def test_a_remote_lease_outlives_a_disconnect_until_peer_dead_ms(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any],
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        lease = held_remote_lease(d, source)
        disconnect(d, source)
        d.tick(PEER_DEAD_MS / 1000 - 0.01)
        assert d.sent(b"c") == [] and d.stats()["leases"]["at_sources"] == 1  # held through the outage
        d.tick(0.01)
        ended = d.sent(b"c")
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnded), ended
        assert (ended[0].lease, ended[0].code, ended[0].keys) == (lease, ErrorCode.PEER_UNREACHABLE, HINTED)
        assert d.stats()["leases"]["at_sources"] == 0
        assert d.receive(b"c", ReleaseLease(4, lease)) == [Ack(4)]  # the local key was still held
        at_rest(d)


def test_a_link_reconnected_to_a_listener_that_never_welcomes_is_down_for_leases(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any],
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        lease = held_remote_lease(d, source)
        link = disconnect(d, source)
        silent = Source(context, source.endpoint)  # something listens there, and never answers
        pump(d, lambda: link.state is LinkState.CONNECTING, "the link did not reconnect")
        assert isinstance(silent.recv(), PeerHello)
        d.tick(PEER_DEAD_MS / 1000)
        ended = d.sent(b"c")
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnded), ended
        assert (ended[0].code, ended[0].keys) == (ErrorCode.PEER_UNREACHABLE, HINTED)
        assert d.receive(b"c", ReleaseLease(4, lease)) == [Ack(4)]
        at_rest(d)
        silent.close()


def test_a_source_back_as_a_new_incarnation_ends_its_keys_peer_restarted(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any],
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        lease = held_remote_lease(d, source)
        link = disconnect(d, source)
        d.tick(PEER_DEAD_MS / 2000)
        assert d.sent(b"c") == []
        restarted = Source(context, source.endpoint)
        pump(d, lambda: link.state is LinkState.CONNECTING, "the link did not reconnect")
        welcomed(d, restarted, SOURCE + 1)
        ended: list[Message] = []
        pump(d, collect(d, ended), "no lease_end")
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnded), ended
        assert (ended[0].lease, ended[0].code, ended[0].keys) == (lease, ErrorCode.PEER_RESTARTED, HINTED)
        d.tick(PEER_DEAD_MS / 1000)  # nothing more once peer_dead_ms passes
        assert d.sent(b"c") == []
        assert d.receive(b"c", ReleaseLease(4, lease)) == [Ack(4)]
        at_rest(d)
        restarted.close()


@pytest.mark.parametrize("kept", [True, False])
def test_a_source_back_as_the_same_incarnation_keeps_the_lease_once_it_says_so(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any], kept: bool,
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        lease = held_remote_lease(d, source)
        link = disconnect(d, source)
        d.tick(1.0)
        back = Source(context, source.endpoint)
        pump(d, lambda: link.state is LinkState.CONNECTING, "the link did not reconnect")
        welcomed(d, back, SOURCE)
        # Back within peer_dead_ms: the target renews the source's lease to the time left, which
        # also asks whether the source still holds it.
        renew = back.recv()
        assert isinstance(renew, RenewLease) and renew.lease == 77 and 0 < renew.ttl_ms <= 59_000
        if kept:
            back.send(LeaseReply(renew.id, 77, renew.ttl_ms))
            pump(d, lambda: not link.asks, "the renewal was not answered")
            d.tick(PEER_DEAD_MS / 1000)
            assert d.sent(b"c") == [] and d.stats()["leases"]["at_sources"] == 1
            assert d.receive(b"c", ReleaseLease(4, lease)) == [Ack(4)]
            release = back.recv()
            assert isinstance(release, ReleaseLease) and release.lease == 77
            back.send(Ack(release.id))
        else:
            back.send(Error(renew.id, ErrorCode.UNKNOWN_LEASE, "lease 77 is not held by this session", "lease"))
            ended: list[Message] = []
            pump(d, collect(d, ended), "no lease_end")
            assert isinstance(ended[0], LeaseEnded) and (ended[0].code, ended[0].keys) == (ErrorCode.PEER_UNREACHABLE, HINTED)
            assert d.receive(b"c", ReleaseLease(4, lease)) == [Ack(4)]
        pump(d, lambda: not link.asks, "the release was not answered")
        at_rest(d)
        back.close()


def test_a_release_during_an_outage_reaches_the_source_when_it_is_back(
    ipc_dir: Path, agent: ClientAgent, context: zmq.Context[Any],
) -> None:
    source = Source(context, f"ipc://{ipc_dir}/source.sock")
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        lease = held_remote_lease(d, source)
        link = disconnect(d, source)
        assert d.receive(b"c", ReleaseLease(4, lease)) == [Ack(4)]
        d.tick(1.0)
        back = Source(context, source.endpoint)
        pump(d, lambda: link.state is LinkState.CONNECTING, "the link did not reconnect")
        welcomed(d, back, SOURCE)
        release = back.recv()
        assert isinstance(release, ReleaseLease) and release.lease == 77
        back.send(Ack(release.id))
        pump(d, lambda: not link.asks, "the release was not answered")
        at_rest(d)
        back.close()


# ---------------------------------------------------------------- the source's side


def test_a_source_carries_a_reconnecting_targets_leases_over(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        store_local(d, b"k")

        def peer_hello(identity: bytes, incarnation: int) -> None:
            hello = PeerHello(1, (CURRENT_VERSION,), "target", incarnation, agent.name, agent.metadata, agent.regions)
            replies = d.receive(identity, hello)
            assert len(replies) == 1 and isinstance(replies[0], PeerWelcome), replies

        peer_hello(b"t1", 7)
        reply = d.receive(b"t1", Lease(2, (b"k",), None, 60_000))
        assert statuses(reply[0]) == [LeaseStatus.LEASED]
        lease = reply[0].lease  # type: ignore[attr-defined]
        # The same target process reconnects (a new connection, a new identity): its lease goes on there.
        peer_hello(b"t2", 7)
        assert d.stats()["leases"]["held"] == 1 and d.stats()["invariants"] == []
        renewed = d.receive(b"t2", RenewLease(3, lease, 30_000))
        assert isinstance(renewed[0], LeaseReply) and renewed[0].lease == lease
        # Another target process (a new incarnation) takes nothing over.
        peer_hello(b"t3", 8)
        refused = d.receive(b"t3", ReleaseLease(2, lease))
        assert isinstance(refused[0], Error) and refused[0].code == ErrorCode.UNKNOWN_LEASE
        assert d.receive(b"t2", ReleaseLease(4, lease)) == [Ack(4)]
        assert d.node.leases.counters[LeaseCount.CARRIED_OVER] == 1
        at_rest(d)
