"""The records the parts of a node share: sessions (a client's or a peer's), withdrawals, operations.

Plain data: the module that owns each table changes its records (``kvcr_node.sessions``
the sessions, ``kvcr_node.operations`` the operations; architecture §1). An ``Operation``
is made whole by ``Operations.admit``; after that the other parts change it only through
its methods (a result set, a remote write begun or answered, the first landing).
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvcr_node.buckets import TokenBucket
from kvcr_node.objects import ObjectEntry
from kvcr_node.transfers import Transfer
from kvcr_protocol import GroupLedger, KeyResult, KeyStatus, Notification, Region, Role, encode_notification
from kvcr_protocol.columns import U32, pack

Hint = tuple[str, frozenset[bytes]]
"""A hint: the source endpoint, and the keys it may hold."""

MAX_NOTIFY_COUNT = 0xFFFF
"""Items one notification covers at most (its ``count`` is a u16, spec section 6.10)."""

RECENT_WRITES = 4096
"""Completed peer writes a source remembers, to answer probes with DONE."""


@dataclass
class Withdrawal:
    """An ``unregions`` whose ack waits: a source may still write into its regions.

    The regions are withdrawn at once (new spans in them fail), and put back if the
    client aborts the request.
    """

    regions: tuple[int, ...]
    """The region ids the request names."""
    records: dict[int, Region]
    """Those the session had announced, as they were."""


@dataclass
class PeerState:
    """What a peer session holds beyond what every session does (spec section 5.3).

    The session's ``regions`` are the target's pools; ``clients`` the regions of the
    target's clients that this (source) node may write into, by their agent name.
    """

    incarnation: int = 0
    """The target's incarnation (its write ids are unique per incarnation, for probes)."""
    link: bytes = b""
    """The target's token for the link this session is on (``peer_hello.link``): a new peer
    session replaces this one only with the same incarnation and token (spec section 5.3)."""
    clients: collections.OrderedDict[str, dict[int, Region]] = field(default_factory=collections.OrderedDict)
    """Announced client agent -> its regions, least recently used first (bounded by the node)."""
    done: collections.OrderedDict[int, None] = field(default_factory=collections.OrderedDict)
    """Writes of this session that ended, most recent last (probes answer DONE for them)."""

    def remember_done(self, op_id: int) -> None:
        self.done[op_id] = None
        while len(self.done) > RECENT_WRITES:
            self.done.popitem(last=False)


class Outcomes(Protocol):
    """Where placement writes an item's result: an ``Operation`` (a deposit), ``ItemResults`` (a put)."""

    def set(self, index: int, result: KeyResult) -> None: ...
    def fail(self, index: int, code: int, reason: str) -> None: ...


class ItemResults:
    """Per item its result, the first one given kept (what a put's placement reports)."""

    def __init__(self, n: int) -> None:
        self.results: list[KeyResult | None] = [None] * n

    def set(self, index: int, result: KeyResult) -> None:
        if self.results[index] is None:
            self.results[index] = result

    def fail(self, index: int, code: int, reason: str) -> None:
        self.set(index, KeyResult(KeyStatus.FAILED, code, reason))


@dataclass
class Session:
    """One session on the node's ROUTER socket: an engine's client, or (with ``peer``) a
    target node's peer session. Its role says which requests it may send (``kvcr_protocol.session_rules``)."""

    identity: bytes
    name: str
    agent: str
    version: int
    agent_md: bytes = b""
    regions: dict[int, Region] = field(default_factory=dict)
    regions_version: int = 0
    """Bumped whenever ``regions`` or ``agent_md`` change, so peers get them again."""
    handles: set[int] = field(default_factory=set)
    ops: dict[int, Operation] = field(default_factory=dict)
    closing: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    events: int = 0
    """Capacity events sent in this session (their ids count from 1)."""
    withdrawals: dict[int, Withdrawal] = field(default_factory=dict)
    """``unregions`` requests whose ack is held, by request id (spec section 5.2)."""
    hints: dict[str, Hint] = field(default_factory=dict)
    """This session's hints by request id (spec section 5.2): no other session sees them."""
    hinted_keys: int = 0
    """Keys summed over ``hints`` (bounded by the node's ``max_hinted_keys_per_session``)."""
    leases: set[int] = field(default_factory=set)
    """The ids of the leases this session holds (``kvcr_node.leases`` owns them)."""
    leased_slots: int = 0
    """Slots of the objects those leases hold here, each object once however many of them
    hold it, and one per key they wait on at a source (bounded by
    ``max_leased_slots_per_session``)."""
    pool_slots: collections.Counter[str] = field(default_factory=collections.Counter)
    """Pool -> slots of that pool those objects take (bounded by the session's share of
    the pool's lease budget, spec section 6.11)."""
    held_objects: dict[ObjectEntry, int] = field(default_factory=dict)
    """Object -> how many of those leases hold it here: a second lease of an object the
    session holds pins nothing more (two requests sharing a prefix)."""
    grant_sources: set[tuple[str, int]] = field(default_factory=set)
    """Sources (endpoint, incarnation) whose agent a read grant gave this client (spec
    section 6.12, "Across nodes"): later grants of them leave it out."""
    puts: set[int] = field(default_factory=set)
    """The ids of this session's puts, quarantined ones included (``kvcr_node.puts`` owns them)."""
    suspect_budget: TokenBucket | None = None
    """Bytes the node may still read to check this session's reports (``kvcr_node.suspects``
    makes it at the first one)."""
    suspects_at_sources: int = 0
    """This session's reports passed on to sources and not yet answered (``kvcr_node.suspects``)."""
    resume: bytes = b""
    """Its resume token (``welcome.resume``, version 5): a later ``hello`` of the same agent
    that presents it ends this session at once (spec section 5.2)."""
    peer: PeerState | None = None
    """The peer part of a peer session (None: a client's session)."""

    @property
    def role(self) -> Role:
        """A peer session's or a client's: what opened it (``peer_hello`` or ``hello``)."""
        return Role.CLIENT if self.peer is None else Role.PEER

    def as_peer(self) -> PeerState:
        """The peer part; the router hands peer requests to peer sessions only."""
        if self.peer is None:
            raise TypeError(f"session {self.name!r} is a client's, not a peer's")
        return self.peer

    def held_regions(self) -> set[int]:
        """The region ids the session holds: announced and not withdrawn, or withdrawn by an
        ``unregions`` whose ack is held (an ``abort`` puts those back; spec section 5.2)."""
        held = set(self.regions)
        for withdrawal in self.withdrawals.values():
            held.update(withdrawal.records)
        return held

    def forget_hints(self) -> None:
        """Drop every hint (bye or expiry: hints end with their session)."""
        self.hints.clear()
        self.hinted_keys = 0


class OpKind(enum.StrEnum):
    """What an operation serves: the type tag of the request that made it."""

    DEPOSIT = "deposit"
    DELIVER = "deliver"
    FETCH = "fetch"
    WRITE = "write"
    """A peer's write (this node is its source, spec section 12)."""
    PUT = "put"
    """A client's put (spec section 6.13): admitted and checked as a deposit, never started."""


Resume = Callable[["Operation", list[int]], None]
"""Continues one waiting item of an operation once its key is READY (or gone)."""
Report = Callable[["Operation", tuple[KeyResult, ...]], None]
"""Sends an operation's results when they do not go back as a client's ``complete``."""


@dataclass
class Operation:
    """One batch request in progress: a result slot per item, transfers, waits."""

    session: Session
    id: int
    kind: OpKind
    deadline: float
    results: list[KeyResult | None]
    transfers: dict[int, Transfer] = field(default_factory=dict)
    """Its transfers still running, by ``id()``: each leaves once terminal, so that whether
    any still runs costs one look however many a request of many keys made."""
    waiting: dict[bytes, list[int]] = field(default_factory=dict)
    """Keys still WRITING that items wait on (key -> item indices)."""
    resume: Resume | None = None
    """Continues waiting items once their keys are READY (or gone)."""
    report: Report | None = None
    """Sends the results when they do not go back as a client's ``complete`` (a peer write's
    ``write_done``); called once, when the operation settles."""
    aborted: bool = False
    agent: str = ""
    """The agent whose memory the transfers touch (the client's, or a peer write's target)."""
    regions: dict[int, Region] = field(default_factory=dict)
    """The regions destination spans are checked against."""
    exact: bool = False
    """Destination names must equal the stored layout (a peer write without ``!partial``)."""
    remote: int = 0
    """Remote writes sent to peers for this operation and not yet answered."""
    broken: str | None = None
    """Why handling it failed unexpectedly: items no transfer or write covers then fail
    ``INTERNAL`` with this reason once nothing of the operation runs any more."""
    plan: Plan | None = None
    """Per-group state of a deliver or write whose items carry layer plans (spec section 6.8)."""
    received: float = 0.0
    """When the request arrived (node clock), for its latency."""
    landed: bool = False
    """Whether a transfer of it has landed (its first-layer latency is observed once)."""

    def set(self, index: int, result: KeyResult) -> None:
        if self.results[index] is None:
            self.results[index] = result

    def fail(self, index: int, code: int, reason: str) -> None:
        self.set(index, KeyResult(KeyStatus.FAILED, code, reason))

    def remote_sent(self) -> None:
        """A remote write for some of its items went to a source (settling waits for its answer)."""
        self.remote += 1

    def remote_answered(self) -> None:
        """A remote write of it is answered, or given up as uncertain."""
        self.remote -= 1

    def first_landing(self) -> bool:
        """A transfer of it landed: True the first time only (its first-layer latency)."""
        if self.landed:
            return False
        self.landed = True
        return True

    @property
    def settled(self) -> bool:
        """Every item has a result (or the op is broken) and no transfer of it can touch memory any more."""
        return (
            not self.waiting
            and not self.remote
            and not self.transfers
            and (self.broken is not None or all(r is not None for r in self.results))
        )

    def done_column(self) -> bytes:
        """The reply's ``done`` column: per item, the groups delivered in a row from the first
        (the plan's count for an ``OK`` item); empty for a request that planned no key."""
        plan = self.plan
        if plan is None or not plan.planned:
            return b""
        return pack(
            (plan.groups[i] if r is not None and r.status is KeyStatus.OK else plan.delivered[i]
             for i, r in enumerate(self.results)),
            U32,
        )

    def fail_unresolved(self, code: int) -> None:
        """Fail every item that has no result yet (a broken op, once nothing of it runs)."""
        for i, result in enumerate(self.results):
            if result is None:
                self.fail(i, code, self.broken or "failed")


@dataclass
class Plan:
    """Where each item's groups stand (spec section 6.8), in a ``GroupLedger``; the items
    whose count grew since the last ``progress``; transfers still running per item."""

    groups: list[int]
    """Groups per item (1 for an item without a plan)."""
    planned: bool
    """Whether any item carries a plan: progress and ``done`` are then sent."""
    notify: tuple[int, int, Sequence[int] | None] | None = None
    """(token, the client's request id, the client's item index of each item, None: the
    same) when the client asked for notifications (spec section 6.10)."""
    ledger: GroupLedger = field(init=False)
    outstanding: dict[int, int] = field(default_factory=dict)
    """Item -> its transfers not yet terminal."""
    progressed: set[int] = field(default_factory=set)
    """Items whose delivered count grew since the last ``progress``."""

    def __post_init__(self) -> None:
        self.ledger = GroupLedger(self.groups)

    @property
    def delivered(self) -> list[int]:
        """Per item: groups delivered in a row, from the first."""
        return self.ledger.delivered

    def land(self, item: int, group: int) -> bool:
        """Group ``group`` of ``item`` landed; True if the item's delivered count grew."""
        if self.ledger.land(item, group):
            self.progressed.add(item)
            return True
        return False

    def advance(self, item: int, count: int) -> None:
        """Groups 0 .. ``count`` - 1 of ``item`` are known delivered (a source said so)."""
        if self.ledger.advance(item, count):
            self.progressed.add(item)

    def fail(self, item: int, group: int) -> None:
        """Group ``group`` of ``item`` failed: no group from it on is reported delivered (the
        operation's result says why)."""
        self.ledger.fail(item, 0, group)

    def client_index(self, item: int) -> int:
        assert self.notify is not None
        indices = self.notify[2]
        return item if indices is None else indices[item]

    def payloads(self, group: int, items: Sequence[int]) -> list[bytes]:
        """The notifications of group ``group`` of ``items`` (in order): one per run of
        consecutive client item indices (spec section 6.10); none when none was asked."""
        if self.notify is None:
            return []
        token, request, _ = self.notify
        payloads: list[bytes] = []
        start = count = 0
        for i in items:
            k = self.client_index(i)
            if count and k == start + count and count < MAX_NOTIFY_COUNT:
                count += 1
                continue
            if count:
                payloads.append(encode_notification(Notification(token, request, start, group, count)))
            start, count = k, 1
        if count:
            payloads.append(encode_notification(Notification(token, request, start, group, count)))
        return payloads
