"""``Target`` (the target side of spec section 12 above the links) in process, over a fake ``Links``.

Target holds no socket: the node makes its ``Links`` and hands it in. Here a fake stands in
for it: it opens only the endpoints the test names and keeps what is submitted, and the
test ends each write as ``Links.end_write`` does. So how a source's answer becomes the
client's results, and how a held ``unregions`` waits for a write that may still reach its
regions, are checked with no socket, no source and no NIXL transfer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcr_node.agents import AgentUse, RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters, ProtocolErrors
from kvcr_node.eviction import make_policy
from kvcr_node.lease_requests import LinkError
from kvcr_node.metrics import Metrics
from kvcr_node.operations import Operations
from kvcr_node.outbox import Outbox
from kvcr_node.peers import RemoteWrite, WriteStage
from kvcr_node.records import Operation, OpKind, Plan, Session
from kvcr_node.reservations import Reservations
from kvcr_node.store import Store
from kvcr_node.target import Target
from kvcr_node.wanted import Wanted
from kvcr_protocol import (
    PROTOCOL_VERSIONS,
    Ack,
    Completion,
    DeliverItem,
    DstSpan,
    ErrorCode,
    KeyResult,
    KeyStatus,
    MemoryKind,
    Message,
    Region,
    decode,
)
from kvcr_testing.nodes import FakeClock, NamedAgent

VERSION = PROTOCOL_VERSIONS[-1]
SOURCE = "ipc:///tmp/kvcr-test-target/source.sock"
"""The one endpoint the fake links open (nothing listens there: no socket is made)."""
REGION = Region(1, MemoryKind.DRAM, 0, 0x10000, 1 << 20)


@dataclass
class FakeLink:
    """The part of a ``PeerLink`` Target reads: its endpoint and the writes not over."""

    endpoint: str
    version: int = VERSION
    writes: dict[int, RemoteWrite] = field(default_factory=dict)
    queued: list[RemoteWrite] = field(default_factory=list)


class FakeLinks:
    """``Links`` without sockets: opens ``SOURCE`` only, keeps each write submitted as sent."""

    def __init__(self) -> None:
        self.by_endpoint: dict[str, FakeLink] = {}
        self.submitted: list[RemoteWrite] = []
        self._ids = itertools.count(1)

    def __iter__(self) -> Iterator[FakeLink]:
        return iter(self.by_endpoint.values())

    def open(self, endpoint: str) -> FakeLink:
        if endpoint != SOURCE:
            raise LinkError(ErrorCode.PEER_UNREACHABLE, f"no source listens at {endpoint!r}")
        return self.by_endpoint.setdefault(endpoint, FakeLink(endpoint))

    def new_write(
        self, op: Operation, link: FakeLink, indices: list[int], items: tuple[DeliverItem, ...], agent: str,
        client: Session | None, partial: bool, **whole: object,
    ) -> RemoteWrite:
        link_: Any = link  # a FakeLink stands for the PeerLink
        return RemoteWrite(link_, next(self._ids), op, indices, items, agent, client, partial, op.deadline, **whole)  # type: ignore[arg-type]

    def submit(self, write: RemoteWrite) -> None:
        write.state = WriteStage.SENT
        write.link.writes[write.id] = write
        self.submitted.append(write)

    def end(self, target: Target, write: RemoteWrite, results: Sequence[KeyResult]) -> None:
        """The source answered ``write_done``: what ``Links.end_write`` does, then the report."""
        write.state = WriteStage.DONE
        write.link.writes.pop(write.id, None)
        target.write_over(write, None, "", results, False)


@dataclass
class World:
    target: Target
    links: FakeLinks
    operations: Operations
    outbox: Outbox
    counters: Counters
    client: Session
    failures: list[str]

    def sent(self) -> list[Message]:
        """What went to the client since the last call, decoded."""
        out = []
        for identity, payload in self.outbox.take():
            assert identity == self.client.identity
            out.append(decode(payload))
        return out

    def deliver(self, msg_id: int, n: int, endpoint: str = SOURCE, at: int = 0) -> Operation:
        """A deliver of ``n`` keys into region 1 from byte ``at`` on, 4 KiB each, that a hint
        sends to ``endpoint``."""
        wanted = Wanted(tuple(DeliverItem(f"k{i}".encode(), (DstSpan("L0", 1, at + i * 4096, 4096),)) for i in range(n)), ())
        op = self.operations.admit(self.client, msg_id, OpKind.DELIVER, n, 0, agent=self.client.agent,
                                   regions=self.client.regions, plan=Plan(wanted.group_counts(), wanted.planned))
        assert op is not None
        self.target.remote_write(op, endpoint, list(range(n)), wanted, self.client, False)
        return op


@pytest.fixture
def world() -> World:
    config = NodeConfig().validated()
    clock = FakeClock()
    failures: list[str] = []

    def failure(what: str, exc: BaseException) -> None:
        failures.append(f"{what}: {exc!r}")

    store = Store(config.pools, make_policy(config.policy), config.low_watermark)
    counters, outbox = Counters(), Outbox(ProtocolErrors())
    agents = RemoteAgents(NamedAgent(), lambda name: AgentUse.HELD, clock)  # type: ignore[arg-type]
    # No transfer runs here: every key is forwarded to a source.
    operations = Operations(config, store, None, agents, outbox, clock, "ipc:///tmp/kvcr-test-target/node.sock",  # type: ignore[arg-type]
                            failure, Metrics(clock))
    links = FakeLinks()
    target = Target(links, agents, store, {}, operations, outbox, counters, "target-agent", failure,  # type: ignore[arg-type]
                    Reservations())
    client = Session(b"client", "engine", "client-agent", VERSION, regions={1: REGION})
    return World(target, links, operations, outbox, counters, client, failures)


def test_the_sources_answer_becomes_the_deliver_results(world: World) -> None:
    op = world.deliver(7, 2)
    [write] = world.links.submitted
    assert write.indices == [0, 1] and write.client is world.client and write.agent == "client-agent"
    assert write.regions == frozenset({1}) and [item.key for item in write.items] == [b"k0", b"k1"]
    assert op.remote == 1 and not op.settled and world.sent() == []

    world.links.end(world.target, write, [KeyResult(KeyStatus.OK),
                                          KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, "not stored at the source")])
    [reply] = world.sent()
    assert isinstance(reply, Completion) and reply.id == 7
    assert [(r.status, r.code) for r in reply.results] == [(KeyStatus.OK, 0), (KeyStatus.FAILED, ErrorCode.NOT_FOUND)]
    assert op.remote == 0 and 7 not in world.client.ops
    assert world.operations.outcome_counts() == {"deliver.OK": 1, "deliver.FAILED.NOT_FOUND": 1}
    assert not world.outbox.undeclared_codes and not world.failures


def test_a_code_a_source_may_not_send_fails_the_key_as_a_failed_transfer(world: World) -> None:
    world.deliver(7, 1)
    [write] = world.links.submitted
    world.links.end(world.target, write, [KeyResult(KeyStatus.STORED)])
    [reply] = world.sent()
    assert isinstance(reply, Completion)
    [result] = reply.results
    assert result.status is KeyStatus.FAILED and result.code == ErrorCode.TRANSFER_FAILED
    assert not world.outbox.undeclared_codes


def test_a_source_that_cannot_be_reached_fails_the_keys_at_once(world: World) -> None:
    world.deliver(7, 2, endpoint="ipc:///tmp/kvcr-test-target/elsewhere.sock")
    assert world.links.submitted == [] and world.links.by_endpoint == {}
    [reply] = world.sent()
    assert isinstance(reply, Completion)
    assert [(r.status, r.code) for r in reply.results] == [(KeyStatus.FAILED, ErrorCode.PEER_UNREACHABLE)] * 2
    assert world.operations.outcome_counts() == {"deliver.FAILED.PEER_UNREACHABLE": 2}


def test_an_unregions_waits_for_the_write_that_may_reach_its_region(world: World) -> None:
    """Spec section 12: the ack of an ``unregions`` is held while a write not yet over may
    still write into one of its regions, and goes out once none can."""
    world.deliver(7, 1)
    [write] = world.links.submitted
    assert not world.target.hold(world.client, 8, [2], {})  # no write names region 2: acked at once by the caller
    assert world.target.hold(world.client, 9, [1], {1: REGION})
    assert world.counters[Count.UNREGIONS_HELD] == 1 and 9 in world.client.withdrawals and world.sent() == []

    world.links.end(world.target, write, [KeyResult(KeyStatus.OK)])
    ack, reply = world.sent()
    assert ack == Ack(9) and isinstance(reply, Completion) and reply.id == 7
    assert world.client.withdrawals == {} and world.target.withdrawing == {}


def test_a_write_past_its_deadline_reserves_its_destination_until_it_is_over(world: World) -> None:
    """Spec section 12, "Reserved memory": from the deadline of a write that may still land
    to its end, its destination spans are reserved under the client's agent (what
    ``deliver``, ``deposit`` and ``put`` refuse), and only those."""
    world.deliver(7, 2)  # bytes 0..8192 of region 1
    [first] = world.links.submitted
    reservations = world.target.reservations
    assert not reservations.holds("client-agent")  # sent, not yet past its deadline
    first.state = WriteStage.UNCERTAIN  # what the links do at the deadline
    world.target.write_uncertain(first)
    [reply] = world.sent()
    assert isinstance(reply, Completion)
    assert [r.code for r in reply.results] == [ErrorCode.DESTINATION_UNCERTAIN] * 2
    assert len(reservations) == 1 and reservations.holds("client-agent") and not reservations.holds("other-agent")
    assert reservations.overlap("client-agent", [(1, 8192, 4096), (1, 8191, 1)]) == 1
    assert reservations.overlap("client-agent", [(2, 0, 8192)]) is None

    # The source confirms the write over (a probe, a late answer, or known gone): free again.
    first.state = WriteStage.DONE
    first.link.writes.pop(first.id, None)
    world.target.write_over(first, None, "", (), True)
    assert len(reservations) == 0 and not reservations.holds("client-agent")
    assert world.counters[Count.UNCERTAIN_RESOLVED] == 1 and world.sent() == [] and not world.failures
