"""The target side of cross-node delivery (``kvcr_node.links``) in process, with a fake clock.

A scripted source is a plain ROUTER socket of the test on an ipc endpoint: it reads the
link's frames and answers what the test says. No node process and no NIXL transfer run,
so deadlines, probes, the ``max_peers`` cap and the idle close are driven by the clock
alone and checked deterministically (spec sections 5.3 and 12).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvcr_node.agents import AgentUse, RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters, ProtocolErrors
from kvcr_node.lease_requests import LinkError
from kvcr_node.links import Links
from kvcr_node.peers import LinkState, RemoteWrite, WriteStage
from kvcr_node.records import Operation, OpKind, Session
from kvcr_node.write_deadlines import PROBE_INTERVAL_S
from kvcr_protocol import (
    PROTOCOL_VERSIONS,
    Ack,
    Bye,
    DeliverItem,
    DstSpan,
    ErrorCode,
    KeyResult,
    KeyStatus,
    Message,
    PeerClient,
    PeerForget,
    PeerHello,
    PeerWelcome,
    Probe,
    ProbeReply,
    Progress,
    WriteDone,
    WriteRequest,
    WriteState,
    decode,
    encode,
)
from kvcr_protocol.twins import twin_proof
from kvcr_testing.nodes import NamedAgent

RECV_TIMEOUT_MS = 5000
"""A frame reaches the other side within this (bounded waits; never a sleep)."""
POLL_SLICE_MS = 50
VERSION = max(PROTOCOL_VERSIONS)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Owner:
    """Records what Links reports upward."""

    over: list[tuple[RemoteWrite, ErrorCode | None, tuple[KeyResult, ...], bool]] = field(default_factory=list)
    uncertain: list[RemoteWrite] = field(default_factory=list)
    progress: list[tuple[RemoteWrite, Progress]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def write_over(
        self, write: RemoteWrite, code: ErrorCode | None, reason: str, results: Sequence[KeyResult], was_uncertain: bool
    ) -> None:
        self.over.append((write, code, tuple(results), was_uncertain))

    def write_uncertain(self, write: RemoteWrite) -> None:
        self.uncertain.append(write)

    def write_progress(self, write: RemoteWrite, msg: Progress) -> None:
        self.progress.append((write, msg))

    def internal_failure(self, what: str, exc: BaseException) -> None:
        self.failures.append(f"{what}: {exc!r}")


class Source:
    """A scripted source node: a ROUTER that reads what the link sends and answers."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.peer = b""
        self.version = VERSION
        """What it encodes its answers at (the version its session agreed on)."""

    def recv(self) -> Message:
        self.peer, frame = self.sock.recv_multipart()
        return decode(frame, VERSION)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([self.peer, encode(msg, self.version)])


@dataclass
class World:
    links: Links
    owner: Owner
    clock: Clock
    context: zmq.Context[Any]
    ipc: Path
    counters: Counters

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.ipc}/{name}.sock"

    def source(self, name: str) -> Source:
        return Source(self.context, self.endpoint(name))

    def drain_until(self, done: Callable[[], bool]) -> None:
        """Read what the sources and monitors report until ``done`` holds (bounded: fails after
        ``RECV_TIMEOUT_MS``; each poll returns as soon as something arrives)."""
        deadline = time.monotonic() + RECV_TIMEOUT_MS / 1000
        while not done():
            assert time.monotonic() < deadline, "the link never saw the answer"
            for sock in dict(self.links.poller.poll(POLL_SLICE_MS)):
                link = self.links.socks.get(sock)
                if link is not None:
                    self.links.drain(link)


CONFIG = NodeConfig(max_peers=2, peer_idle_ms=1_000, peer_dead_ms=500, heartbeat_ms=0).validated()


@pytest.fixture
def world(ipc_dir: Path) -> Iterator[World]:
    context: zmq.Context[Any] = zmq.Context()
    poller = zmq.Poller()
    clock = Clock()
    owner = Owner()
    agents = RemoteAgents(NamedAgent(), lambda name: AgentUse.HELD, clock)  # type: ignore[arg-type]
    counters = Counters()
    links = Links(
        CONFIG, context, poller, agents,
        lambda i, endpoint: PeerHello(i, PROTOCOL_VERSIONS, "target", 7, "target-agent", b"target-agent", (),
                                      token(endpoint)),
        PROTOCOL_VERSIONS, counters, ProtocolErrors(), clock, owner=owner,
    )
    yield World(links, owner, clock, context, ipc_dir, counters)
    links.close_all()
    context.destroy(linger=0)


def token(endpoint: str) -> bytes:
    """The link token the fixture's target sends to ``endpoint`` (the node's is an HMAC of a secret)."""
    return hashlib.sha256(b"secret" + endpoint.encode()).digest()[:16]


def operation(clock: Clock, deadline_s: float, keys: int = 1) -> Operation:
    session = Session(b"client", "engine", "client-agent", VERSION)
    return Operation(session, 1, OpKind.DELIVER, clock.now + deadline_s, [None] * keys)


def items(n: int = 1) -> tuple[DeliverItem, ...]:
    return tuple(DeliverItem(f"k{i}".encode(), (DstSpan("L0", 1, 0, 4096),)) for i in range(n))


def ready_link(world: World, source: Source, version: int = VERSION) -> Any:
    """Open a link to ``source`` and answer its hello (agreeing on ``version``): the link's session is up."""
    link = world.links.open(source.endpoint)
    hello = source.recv()
    assert isinstance(hello, PeerHello) and hello.versions == PROTOCOL_VERSIONS
    source.send(PeerWelcome(hello.id, version, "source", 42, "source-agent", b"source-agent"))
    world.drain_until(lambda: link.state is LinkState.READY)
    assert link.incarnation == 42
    return link


def sent_write(world: World, source: Source, link: Any, deadline_s: float) -> RemoteWrite:
    op = operation(world.clock, deadline_s)
    write = world.links.new_write(op, link, [0], items(), "target-agent", None, False)
    world.links.submit(write)
    msg = source.recv()
    assert isinstance(msg, WriteRequest) and msg.id == write.id
    assert write.state is WriteStage.SENT
    return write


def test_a_write_answered_by_its_source_ends_with_the_sources_results(world: World) -> None:
    source = world.source("s")
    link = ready_link(world, source)
    write = sent_write(world, source, link, deadline_s=5)
    source.send(WriteDone(write.id, (KeyResult(KeyStatus.OK),)))
    world.drain_until(lambda: bool(world.owner.over))
    assert world.owner.over == [(write, None, (KeyResult(KeyStatus.OK),), False)]
    assert write.state is WriteStage.DONE and not link.writes and not link.busy


def test_deadline_makes_a_write_uncertain_and_a_probe_confirms_it_over(world: World) -> None:
    source = world.source("s")
    link = ready_link(world, source)
    write = sent_write(world, source, link, deadline_s=1)
    world.links.check(world.clock.now)
    assert world.owner.uncertain == [] and write.state is WriteStage.SENT  # not yet
    world.clock.now += 1
    world.links.check(world.clock.now)
    assert world.owner.uncertain == [write] and write.state is WriteStage.UNCERTAIN
    probe = source.recv()
    assert isinstance(probe, Probe) and probe.op == write.id
    # Probes are paced by the clock, and only the latest is kept.
    world.links.check(world.clock.now)
    assert len(link.probes) == 1
    world.clock.now += PROBE_INTERVAL_S
    world.links.check(world.clock.now)
    second = source.recv()
    assert isinstance(second, Probe) and second.id != probe.id and list(link.probes) == [second.id]
    # An answer to the older probe is not taken; then the latest says the write still runs.
    # Both come on one connection, in order: once the latest is read, so was the older.
    source.send(ProbeReply(probe.id, write.id, WriteState.DONE, 42))
    source.send(ProbeReply(second.id, write.id, WriteState.IN_FLIGHT, 42))
    world.drain_until(lambda: not link.probes)
    assert world.owner.over == [] and write.state is WriteStage.UNCERTAIN
    world.clock.now += PROBE_INTERVAL_S
    world.links.check(world.clock.now)
    third = source.recv()
    assert isinstance(third, Probe)
    source.send(ProbeReply(third.id, write.id, WriteState.DONE, 42))
    world.drain_until(lambda: bool(world.owner.over))
    assert world.owner.over == [(write, None, (), True)]
    assert not link.probes and not link.writes and not link.busy


def test_an_uncertain_write_to_a_source_gone_past_peer_dead_ms_is_over(world: World) -> None:
    source = world.source("s")
    link = ready_link(world, source)
    write = sent_write(world, source, link, deadline_s=1)
    world.clock.now += 1
    world.links.check(world.clock.now)
    assert write.state is WriteStage.UNCERTAIN
    source.sock.close(0)  # the source dies
    world.drain_until(lambda: link.state is LinkState.DOWN)  # the monitor reports the disconnect
    world.clock.now += CONFIG.peer_dead_ms / 1000 - 0.001
    world.links.check(world.clock.now)
    assert world.owner.over == []
    world.clock.now += 0.001
    world.links.check(world.clock.now)
    assert world.owner.over == [(write, None, (), True)]


def test_a_queued_write_fails_at_its_deadline_when_the_session_never_opens(world: World) -> None:
    link = world.links.open(world.endpoint("nobody"))
    write = world.links.new_write(operation(world.clock, 1), link, [0], items(), "target-agent", None, False)
    world.links.submit(write)
    assert link.queued == [write] and link.state is LinkState.CONNECTING
    world.clock.now += 1
    world.links.check(world.clock.now)
    assert [(w, code) for w, code, _, _ in world.owner.over] == [(write, ErrorCode.PEER_UNREACHABLE)]
    assert not link.busy


def test_links_are_capped_and_idle_ones_close(world: World) -> None:
    first = world.links.open(world.endpoint("a"))
    world.clock.now += 0.1
    second = world.links.open(world.endpoint("b"))
    sockets = len(world.links.socks)
    # At max_peers=2, a third closes the least recently used idle link.
    world.clock.now += 0.1
    third = world.links.open(world.endpoint("c"))
    assert [link.endpoint for link in world.links] == [second.endpoint, third.endpoint]
    assert first.closed and len(world.links.socks) == sockets
    assert world.counters[Count.LINKS_EVICTED] == 1
    # With a write queued on each, a third endpoint is refused PEER_LIMIT.
    for link in (second, third):
        world.links.submit(world.links.new_write(operation(world.clock, 60), link, [0], items(), "a", None, False))
    with pytest.raises(LinkError) as refused:
        world.links.open(world.endpoint("d"))
    assert refused.value.code is ErrorCode.PEER_LIMIT and "max_peers=2" in refused.value.reason
    # Idle links close after peer_idle_ms without work; busy ones stay.
    idle = world.links.open(world.endpoint("b"))
    idle.queued.clear()
    world.clock.now += CONFIG.peer_idle_ms / 1000
    world.links.check(world.clock.now)
    assert [link.endpoint for link in world.links] == [third.endpoint]
    assert idle.closed and world.counters[Count.LINKS_CLOSED_IDLE] == 1
    assert world.links.next_wakeup(world.clock.now) is not None  # the busy link's write deadline


def test_a_restarted_source_voids_the_writes_of_its_predecessor(world: World) -> None:
    source = world.source("s")
    link = ready_link(world, source)
    write = sent_write(world, source, link, deadline_s=5)
    # The connection drops and comes back (what the link's monitor reports): hello again.
    link.state = LinkState.DOWN
    world.links._say_hello(link)
    hello = source.recv()
    assert isinstance(hello, PeerHello)
    source.send(PeerWelcome(hello.id, VERSION, "source", 43, "source-agent-2", b"source-agent-2"))
    world.drain_until(lambda: link.incarnation == 43)
    assert [(w, code) for w, code, _, _ in world.owner.over] == [(write, ErrorCode.PEER_RESTARTED)]
    assert link.incarnation == 43 and link.agent == "source-agent-2"


# --------------------------------------------------------------------------- a client left (version 5)


def client_session(name: str = "client-agent") -> Session:
    return Session(b"client", "engine", name, VERSION, b"md")


def client_write(world: World, link: Any, client: Session, deadline_s: float = 5) -> RemoteWrite:
    """Submit a write into ``client``'s memory on ``link``."""
    op = Operation(client, 1, OpKind.DELIVER, world.clock.now + deadline_s, [None])
    write = world.links.new_write(op, link, [0], items(), client.agent, client, False)
    world.links.submit(write)
    return write


def received_write(source: Source, write: RemoteWrite) -> None:
    """The source reads the client's announcement, then the write."""
    announce = source.recv()
    assert isinstance(announce, PeerClient) and announce.agent == write.agent, announce
    source.send(Ack(announce.id))
    msg = source.recv()
    assert isinstance(msg, WriteRequest) and msg.id == write.id, msg


def leave(world: World, client: Session) -> None:
    """The client's session ends, as ``Sessions.close`` does it."""
    client.closing = True
    world.links.forget_client(client.agent)


def marker(world: World, source: Source, link: Any) -> int:
    """A fetch write sent now: whatever the link sent before it, the source reads first."""
    write = world.links.new_write(operation(world.clock, 5), link, [0], items(), "target-agent", None, False)
    world.links.submit(write)
    return write.id


def test_a_client_that_left_is_forgotten_at_its_source(world: World) -> None:
    """Spec section 5.3: once no write of the client runs, the source gets peer_forget."""
    source = world.source("s")
    link = ready_link(world, source)
    client = client_session()
    write = client_write(world, link, client)
    received_write(source, write)
    source.send(WriteDone(write.id, (KeyResult(KeyStatus.OK),)))
    world.drain_until(lambda: not link.writes and not link.announcing)
    leave(world, client)
    forget = source.recv()
    assert isinstance(forget, PeerForget) and forget.agent == client.agent
    assert not link.forgets and not link.clients_sent and world.counters[Count.PEER_FORGETS_SENT] == 1
    source.send(Ack(forget.id))
    world.drain_until(lambda: True)
    leave(world, client)  # twice: the link no longer knows it, nothing more is sent
    fetch = marker(world, source, link)
    assert isinstance(first := source.recv(), WriteRequest) and first.id == fetch, first
    assert world.links.sizes()["forgets"] == 0 and world.counters[Count.PEER_FORGETS_SENT] == 1


def test_the_forget_waits_for_every_write_of_the_client(world: World) -> None:
    """A write sent before the client left, then uncertain past its deadline: no peer_forget
    while it may still land; the probe that confirms it over lets it go, after it."""
    source = world.source("s")
    link = ready_link(world, source)
    client = client_session()
    write = client_write(world, link, client, deadline_s=1)
    received_write(source, write)
    leave(world, client)
    assert link.forgets == {client.agent}
    fetch = marker(world, source, link)
    assert isinstance(first := source.recv(), WriteRequest) and first.id == fetch, first  # no forget before it
    world.clock.now += 1
    world.links.check(world.clock.now)
    assert write.state is WriteStage.UNCERTAIN and link.forgets == {client.agent}
    probe = source.recv()
    assert isinstance(probe, Probe) and probe.op == write.id
    source.send(ProbeReply(probe.id, write.id, WriteState.IN_FLIGHT, 42))
    world.drain_until(lambda: not link.probes)
    assert link.forgets == {client.agent}  # may still land
    world.clock.now += PROBE_INTERVAL_S
    world.links.check(world.clock.now)
    probe = source.recv()
    assert isinstance(probe, Probe)
    source.send(ProbeReply(probe.id, write.id, WriteState.DONE, 42))
    world.drain_until(lambda: not link.forgets)
    forget = source.recv()
    assert isinstance(forget, PeerForget) and forget.agent == client.agent
    assert world.counters[Count.PEER_FORGETS_SENT] == 1


def test_a_source_below_version_5_is_told_nothing(world: World) -> None:
    """Spec section 7: a session that agreed on 4 carries no peer_forget; the source bounds
    its table itself."""
    source = world.source("s")
    link = ready_link(world, source, version=4)
    source.version = 4
    client = client_session()
    write = client_write(world, link, client)
    received_write(source, write)
    source.send(WriteDone(write.id, (KeyResult(KeyStatus.OK),)))
    world.drain_until(lambda: not link.writes)
    leave(world, client)
    fetch = marker(world, source, link)
    assert isinstance(first := source.recv(), WriteRequest) and first.id == fetch, first
    assert not link.forgets and not link.clients_sent and world.counters[Count.PEER_FORGETS_SENT] == 0


def test_a_queued_write_of_a_client_that_left_goes_first_then_the_forget(world: World) -> None:
    """The link was not up when the client left: its queued write is sent once the session
    opens (announcing the client again), and peer_forget follows its write_done."""
    source = world.source("s")
    link = world.links.open(source.endpoint)
    client = client_session()
    write = client_write(world, link, client)
    assert link.queued == [write]
    leave(world, client)
    assert link.forgets == {client.agent}
    hello = source.recv()
    assert isinstance(hello, PeerHello)
    source.send(PeerWelcome(hello.id, VERSION, "source", 42, "source-agent", b"source-agent"))
    world.drain_until(lambda: link.state is LinkState.READY)
    received_write(source, write)
    assert link.forgets == {client.agent}
    source.send(WriteDone(write.id, (KeyResult(KeyStatus.OK),)))
    world.drain_until(lambda: not link.forgets)
    forget = source.recv()
    assert isinstance(forget, PeerForget) and forget.agent == client.agent
    assert not link.clients_sent


def test_a_client_back_under_the_same_agent_is_not_forgotten(world: World) -> None:
    """The client left while its write ran, and came back (same agent) before the forget
    went: its new announcement cancels it."""
    source = world.source("s")
    link = ready_link(world, source)
    old = client_session()
    write = client_write(world, link, old)
    received_write(source, write)
    leave(world, old)
    back = client_session()
    again = client_write(world, link, back)
    received_write(source, again)
    assert not link.forgets
    for w in (write, again):
        source.send(WriteDone(w.id, (KeyResult(KeyStatus.OK),)))
    world.drain_until(lambda: not link.writes)
    fetch = marker(world, source, link)
    assert isinstance(first := source.recv(), WriteRequest) and first.id == fetch, first
    assert world.counters[Count.PEER_FORGETS_SENT] == 0 and link.clients_sent == {back.agent: back.regions_version}


def test_a_reconnected_session_is_not_told_of_clients_it_never_knew(world: World) -> None:
    """The connection dropped after the client left with a write running: the new session
    never heard of the client (the source dropped the old one's), so nothing is sent."""
    source = world.source("s")
    link = ready_link(world, source)
    client = client_session()
    write = client_write(world, link, client)
    received_write(source, write)
    leave(world, client)
    link.state = LinkState.DOWN
    world.links._say_hello(link)
    hello = source.recv()
    assert isinstance(hello, PeerHello)
    source.send(PeerWelcome(hello.id, VERSION, "source", 43, "source-agent", b"source-agent"))  # restarted
    world.drain_until(lambda: link.incarnation == 43)
    assert write.state is WriteStage.DONE and not link.forgets
    fetch = marker(world, source, link)
    assert isinstance(first := source.recv(), WriteRequest) and first.id == fetch, first


# --------------------------------------------------------------------------- twin links (spec section 5.3)


def twin_source(world: World, *names: str) -> Source:
    """One scripted source reached by several spellings (one ROUTER bound to each)."""
    source = world.source(names[0])
    for name in names[1:]:
        source.sock.bind(world.endpoint(name))
    return source


def welcome(world: World, source: Source, link: Any, incarnation: int = 42, twins: bytes = b"") -> None:
    hello = source.recv()
    assert isinstance(hello, PeerHello) and hello.link == token(link.endpoint)
    source.send(PeerWelcome(hello.id, VERSION, "source", incarnation, "source-agent", b"source-agent", twins))
    world.drain_until(lambda: link.state is LinkState.READY or link.closed)


def test_a_second_spelling_proved_to_reach_the_same_source_folds_into_the_first(world: World) -> None:
    source = twin_source(world, "s", "s-again")
    first, again = world.endpoint("s"), world.endpoint("s-again")
    a = world.links.open(first)
    welcome(world, source, a)
    b = world.links.open(again)
    write = world.links.new_write(operation(world.clock, 5), b, [0], items(), "target-agent", None, False)
    world.links.submit(write)
    assert write.state is WriteStage.QUEUED
    # The source received a's token first, so b's welcome proves that it holds both.
    welcome(world, source, b, twins=twin_proof(token(first), token(again)))
    assert b.closed and world.links.link_of(again) is a and world.links.open(again) is a
    assert write.link is a and write.state is WriteStage.SENT, "the queued write went through the twin"
    got = {type(source.recv()), type(source.recv())}
    assert got == {WriteRequest, Bye}, got  # the write on a, bye on b
    sizes = world.links.sizes()
    assert (sizes["links"], sizes["link_aliases"], sizes["links_draining"]) == (1, 1, 0)
    assert world.counters.snapshot()["links_folded"] == 1
    assert world.links.stats()[first]["aliases"] == [again]
    # The alias goes when its link closes: its spelling opens a link of its own again.
    world.links.retire(a)
    assert world.links.sizes()["link_aliases"] == 0 and world.links.link_of(again) is None


def test_the_proof_may_come_in_the_older_links_welcome(world: World) -> None:
    """Both hellos reached the source before either welcome came back: the link whose hello
    came second there carries the proof; whichever is welcomed last folds."""
    source = twin_source(world, "s", "s-again")
    first, again = world.endpoint("s"), world.endpoint("s-again")
    a = world.links.open(first)
    b = world.links.open(again)
    hellos = {source.recv().link: source.peer for _ in range(2)}  # type: ignore[attr-defined]
    ids = {link.token: link.hello_id for link in (a, b)}
    source.peer = hellos[token(first)]
    source.send(PeerWelcome(ids[a.token], VERSION, "source", 42, "source-agent", b"source-agent",
                            twin_proof(token(again), token(first))))
    world.drain_until(lambda: a.state is LinkState.READY)
    source.peer = hellos[token(again)]
    source.send(PeerWelcome(ids[b.token], VERSION, "source", 42, "source-agent", b"source-agent"))
    world.drain_until(lambda: b.closed)
    assert world.links.link_of(again) is a and world.links.sizes()["links"] == 1


@pytest.mark.parametrize("forged", ["none", "random", "other tokens", "the incarnation only, proof of itself"])
def test_a_welcome_claiming_anothers_incarnation_without_proof_folds_nothing(world: World, forged: str) -> None:
    """Hostile: a source that names the incarnation of another (statistics show it) and no
    valid proof keeps its own link; no spelling is steered to another source."""
    real = world.source("real")
    liar = world.source("liar")
    a = world.links.open(real.endpoint)
    welcome(world, real, a)
    b = world.links.open(liar.endpoint)
    twins = {"none": b"", "random": bytes(range(32)), "other tokens": twin_proof(token("x"), token(liar.endpoint)),
             "the incarnation only, proof of itself": twin_proof(token(liar.endpoint), token(liar.endpoint))}[forged]
    welcome(world, liar, b, twins=twins)
    assert not b.closed and world.links.link_of(liar.endpoint) is b and world.links.link_of(real.endpoint) is a
    assert world.links.sizes()["link_aliases"] == 0 and "links_folded" not in world.counters.snapshot()


def test_a_link_holding_leases_at_the_source_folds_once_they_end(world: World) -> None:
    """Leases at the source belong to the link's own peer session there: a twin that holds
    some keeps its link (renewals and releases go there) and folds once they ended."""
    source = twin_source(world, "s", "s-again")
    first, again = world.endpoint("s"), world.endpoint("s-again")
    b = world.links.open(again)
    welcome(world, source, b)
    world.links.hold_lease(again, 9)  # its session at the source holds a lease for us
    a = world.links.open(first)
    welcome(world, source, a)
    b.state = LinkState.DOWN  # b reconnects; its new session takes the lease over at the source
    world.links._say_hello(b)
    welcome(world, source, b, twins=twin_proof(token(first), token(again)))
    assert b.twin is a and not b.closed and world.links.link_of(again) is b
    world.links.check(world.clock.now)
    assert not b.closed, "the lease holds it"
    world.links.release_lease(again, 9)
    world.links.check(world.clock.now)
    assert b.closed and world.links.link_of(again) is a and world.counters.snapshot()["links_folded"] == 1


def test_a_twin_with_writes_sent_drains_them_then_closes(world: World) -> None:
    """A link that reconnects and is then proved a twin of another keeps serving the write
    it had sent (its answer comes on it), takes nothing new, and closes once it is over."""
    source = twin_source(world, "s", "s-again")
    first, again = world.endpoint("s"), world.endpoint("s-again")
    b = world.links.open(again)
    welcome(world, source, b)
    write = sent_write(world, source, b, deadline_s=5)
    b_peer = source.peer
    a = world.links.open(first)
    welcome(world, source, a)  # no proof: b's hello came first and this is not its reconnect
    assert world.links.sizes()["links"] == 2
    b.state = LinkState.DOWN
    world.links._say_hello(b)
    welcome(world, source, b, twins=twin_proof(token(first), token(again)))
    assert b.draining and not b.closed and world.links.link_of(again) is a
    assert world.links.sizes()["links_draining"] == 1
    source.peer = b_peer
    source.send(WriteDone(write.id, (KeyResult(KeyStatus.OK),)))
    world.drain_until(lambda: bool(world.owner.over))
    assert world.owner.over == [(write, None, (KeyResult(KeyStatus.OK),), False)], "the write finished on its link"
    assert world.links.next_wakeup(world.clock.now) == world.clock.now
    world.links.check(world.clock.now)
    assert b.closed and world.links.sizes()["links_draining"] == 0 and world.links.sizes()["link_aliases"] == 1


def test_twin_churn_keeps_one_link_and_a_bounded_alias_table(world: World) -> None:
    """Hundreds of spellings of one source (a client hinting every one): each opens a link
    that folds into the first; the aliases stay within max_peers, and the source's restart
    keeps the link and its aliases (they follow it); its close empties every table."""
    names = [f"s{i}" for i in range(200)]
    source = twin_source(world, *names)
    first = world.endpoint(names[0])
    a = world.links.open(first)
    welcome(world, source, a)
    for name in names[1:]:
        link = world.links.open(world.endpoint(name))
        welcome(world, source, link, twins=twin_proof(token(first), token(world.endpoint(name))))
        assert link.closed and world.links.link_of(world.endpoint(name)) is a
        assert isinstance(source.recv(), Bye)
        sizes = world.links.sizes()
        assert sizes["links"] == 1 and sizes["link_aliases"] <= CONFIG.max_peers and sizes["link_sockets"] == 2
    assert world.counters.snapshot()["links_folded"] == 199
    # The source restarts: the link says hello again and the aliases follow the new incarnation.
    a.state = LinkState.DOWN
    world.links._say_hello(a)
    welcome(world, source, a, incarnation=43)
    assert a.incarnation == 43 and world.links.link_of(world.endpoint(names[-1])) is a
    world.links.retire(a)
    assert {k: v for k, v in world.links.sizes().items() if v} == {}
