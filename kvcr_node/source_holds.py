"""The keys of leases that hinted sources hold for this node's sessions (spec section 6.11,
and section 6.12 "Across nodes" for their grants), and the records of a lease.

``SourceHolds`` is the part of ``Leases`` (``kvcr_node.leases``) that asks a source to hold
a lease's hinted keys (a ``lease`` of the node's own on its peer session, with ``!read``
for a client's read lease), fills the client's answer from the source's, renews and
releases what the source holds, and ends the keys a source loses (restarted, unreachable
past ``peer_dead_ms``, its own ``lease_end``, or ``UNKNOWN_LEASE`` on a renewal).
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcr_node.config import NodeConfig
from kvcr_node.counters import LeaseCount, LeaseCounters
from kvcr_node.grants import Row
from kvcr_node.records import Session
from kvcr_node.source_grants import SourceGrants
from kvcr_node.store import ObjectEntry
from kvcr_protocol import (
    GRANTS_VERSION,
    Error,
    ErrorCode,
    Lease,
    LeaseEnded,
    LeaseReply,
    LeaseStatus,
    Message,
    ReleaseLease,
    RenewLease,
)

if TYPE_CHECKING:
    from kvcr_node.links import Links
    from kvcr_node.peers import PeerLink

log = logging.getLogger("kvcr.node")

SOURCE_ANSWER_S = 2.0
"""How long a lease waits for a source's answer, whether the link is up or not (``Links``
gives the request up then too); its keys then answer UNREACHABLE (a late answer that leased
something is released at once)."""
_REMOTE_TIER_INDEX = 1
_PASSED_ON = {LeaseStatus.MISS, LeaseStatus.PENDING, LeaseStatus.LEASE_LIMIT}
"""A source's statuses a target passes on as they are (its LEASED becomes LEASED_REMOTE)."""

class HoldState(enum.Enum):
    """Where a lease's keys at one source stand."""

    ASKING = "asking"
    """The source was asked (or will be, once the link is up) and has not answered."""
    HELD = "held"
    """The source holds ``keys`` under ``source_lease``."""
    ENDED = "ended"


@dataclass(eq=False)
class SourceHold:
    """The keys of one lease that one source holds (or was asked to hold) for this node."""

    endpoint: str
    indices: list[int]
    """The request's positions of the keys asked for."""
    keys: tuple[bytes, ...]
    state: HoldState = HoldState.ASKING
    source_lease: int = 0
    held: tuple[bytes, ...] = ()
    """The keys the source holds (HELD)."""
    incarnation: int = 0
    """The source's incarnation that granted ``source_lease`` (its lease ids are its own)."""
    rows: dict[int, Row] = field(default_factory=dict)
    """The source's read grant: position in ``keys`` -> its row there (spec section 6.12)."""
    digests: dict[int, bytes] = field(default_factory=dict)
    """... and the source's digests of that row's spans, passed on with it (empty: none)."""


@dataclass(eq=False)
class PendingReply:
    """A ``lease`` request whose answer waits for sources."""

    request_id: int
    keys: tuple[bytes, ...]
    status: bytearray
    tier: bytearray
    deadline: float
    asking: int


@dataclass(eq=False)
class LeaseRecord:
    """One lease: its session, time to live, the objects it claims here, its keys at sources."""

    id: int
    session: Session
    ttl_ms: int
    expires: float
    entries: list[ObjectEntry] = field(default_factory=list)
    slots: int = 0
    """Slots of ``entries``, and one per key still asked of a source (``waiting``), counted
    against the session's ``max_leased_slots_per_session``."""
    waiting: int = 0
    """Keys asked of sources not yet answered: a pending lease counts them (spec section 6.11)."""
    pool_slots: collections.Counter[str] = field(default_factory=collections.Counter)
    """Pool -> slots of ``entries`` there, counted against the session's share of the pool."""
    sources: list[SourceHold] = field(default_factory=list)
    reply: PendingReply | None = None
    read: bool = False
    """The lease asked for a read grant and may get one (spec section 6.12)."""
    node_md: bool = False
    """... with the node's agent (``GrantNode``)."""
    granted: bool = False
    """Its reply carried a grant: while it lasts, the client may READ the node's pools."""

    @property
    def holds_anything(self) -> bool:
        return bool(self.entries) or any(h.state is not HoldState.ENDED for h in self.sources)


class SourceHolds:
    """Keys held by sources for this node's leases (mixed into ``Leases``)."""

    config: NodeConfig
    links: Links
    clock: Callable[[], float]
    counters: LeaseCounters
    table: dict[int, LeaseRecord]
    _asking: dict[int, LeaseRecord]
    source_grants: SourceGrants

    def _answer(self, record: LeaseRecord, request_id: int, keys: Sequence[bytes], status: bytearray, tier: bytearray) -> None:
        raise NotImplementedError

    def end_lease(self, record: LeaseRecord, code: ErrorCode | None = None, reason: str = "") -> None:
        raise NotImplementedError

    def _tell(self, session: Session, lease: int, code: ErrorCode, reason: str, keys: tuple[bytes, ...]) -> None:
        raise NotImplementedError

    def _ask_source(self, record: LeaseRecord, hold: SourceHold) -> None:
        keys, ttl, read, endpoint = hold.keys, record.ttl_ms, record.read, hold.endpoint
        self.counters.inc(LeaseCount.ASKED_SOURCES)

        def build(i: int) -> Lease:
            # Built once the peer session is up: its incarnation says whether the source's
            # agent is cached (spec section 6.12, "Across nodes"); below 5 the flags stay off the wire.
            if not read or self.links.version(endpoint) < GRANTS_VERSION:
                return Lease(i, keys, None, ttl)
            return Lease(i, keys, None, ttl, True, self.source_grants.wants_node(endpoint, self.links.incarnation(endpoint)))

        self.links.ask(endpoint, build, lambda reply, code: self._source_answered(record, hold, reply, code), SOURCE_ANSWER_S)

    def _source_answered(self, record: LeaseRecord, hold: SourceHold, reply: Message | None, code: ErrorCode | None) -> None:
        """A source answered our lease request (or cannot): fill the client's answer."""
        if hold.state is not HoldState.ASKING or self.table.get(record.id) is not record or record.reply is None:
            # Too late (answered UNREACHABLE, or the lease ended): hold nothing there.
            if isinstance(reply, LeaseReply) and reply.lease:
                self._release_granted(hold.endpoint, reply.lease)
            return
        pending = record.reply
        waited = len(hold.indices)  # answered: those keys no longer count as waiting
        record.waiting -= waited
        record.slots -= waited
        record.session.leased_slots -= waited
        held: list[bytes] = []
        columns = reply.columns if isinstance(reply, LeaseReply) else None
        if columns is not None and len(columns) == len(hold.indices):
            for k, i in enumerate(hold.indices):
                answer = columns.status_of(k)
                if answer is LeaseStatus.LEASED:
                    pending.status[i] = LeaseStatus.LEASED_REMOTE
                    held.append(hold.keys[k])
                else:
                    pending.status[i] = answer if answer in _PASSED_ON else LeaseStatus.UNREACHABLE
                pending.tier[i] = _REMOTE_TIER_INDEX
        else:
            # No answer to use: a source that speaks no leases reserves nothing (ADVISORY,
            # never a silent lease that is not one); one at its lease limit is LEASE_LIMIT;
            # any other failure is UNREACHABLE.
            answer = LeaseStatus.ADVISORY if code is ErrorCode.PEER_UNSUPPORTED else LeaseStatus.UNREACHABLE
            if isinstance(reply, Error) and reply.code == ErrorCode.LEASE_LIMIT:
                answer = LeaseStatus.LEASE_LIMIT  # the source holds as many of our leases as it allows
            if isinstance(reply, Error):
                log.info("source %s refused a lease (code %d): %s", hold.endpoint, reply.code, reply.reason)
            for i in hold.indices:
                pending.status[i], pending.tier[i] = answer, _REMOTE_TIER_INDEX
        if held and isinstance(reply, LeaseReply) and reply.lease:
            hold.state, hold.source_lease, hold.held = HoldState.HELD, reply.lease, tuple(held)
            # Held by the session of the link the request went through: renewals and its
            # release go there whatever spelling asked (spec section 5.3, "Twin links").
            hold.endpoint = self.links.canonical(hold.endpoint)
            hold.incarnation = self.links.hold_lease(hold.endpoint, reply.lease)
            if record.read and reply.grant is not None and reply.held:
                rows = self.source_grants.rows(hold.endpoint, hold.incarnation, reply.grant, len(hold.indices))
                granted = {k for k in rows if pending.status[hold.indices[k]] == LeaseStatus.LEASED_REMOTE}
                hold.rows = {k: rows[k][0] for k in granted}
                hold.digests = {k: rows[k][1] for k in granted}
        else:
            hold.state = HoldState.ENDED
            if isinstance(reply, LeaseReply) and reply.lease:  # it holds nothing we count: let it go
                self._release_granted(hold.endpoint, reply.lease)
        pending.asking -= 1
        if pending.asking == 0:
            record.reply = None
            self._asking.pop(record.id, None)
            self._answer(record, pending.request_id, pending.keys, pending.status, pending.tier)

    def _release_granted(self, endpoint: str, source_lease: int) -> None:
        """A source granted a lease we do not keep: release it there (its lease id is the
        incarnation's that answered just now)."""
        self.links.ask(endpoint, lambda i: ReleaseLease(i, source_lease), _ignore, SOURCE_ANSWER_S,
                       self.links.incarnation(endpoint))

    def _release_at_source(self, hold: SourceHold) -> None:
        if hold.state is HoldState.HELD:
            source_lease = hold.source_lease
            self.links.release_lease(hold.endpoint, source_lease)
            # Through an outage the release waits for the link to come back, up to peer_dead_ms.
            wait_s = max(SOURCE_ANSWER_S, self.config.peer_dead_ms / 1000)
            self.links.ask(hold.endpoint, lambda i: ReleaseLease(i, source_lease), _ignore, wait_s, hold.incarnation)
        hold.state = HoldState.ENDED

    def _renew_at_source(
        self, record: LeaseRecord, hold: SourceHold, ttl: int, lost: ErrorCode = ErrorCode.LEASE_EXPIRED,
        then: Callable[[bool], None] | None = None,
    ) -> None:
        """Renew ``hold`` at its source; ``then`` learns whether the source says its lease held
        without a break up to its reply (``!held``), and the hold is still ours."""
        source_lease = hold.source_lease
        self.links.ask(hold.endpoint, lambda i: RenewLease(i, source_lease, ttl),
                       lambda reply, code: self._renewed_at_source(record, hold, source_lease, reply, lost, then),
                       SOURCE_ANSWER_S, hold.incarnation)

    def _renewed_at_source(
        self, record: LeaseRecord, hold: SourceHold, source_lease: int, reply: Message | None, lost: ErrorCode,
        then: Callable[[bool], None] | None = None,
    ) -> None:
        mine = hold.state is HoldState.HELD and hold.source_lease == source_lease
        if isinstance(reply, Error) and reply.code == ErrorCode.UNKNOWN_LEASE and mine:
            self._lost_at_source(record, hold, lost, f"the source {hold.endpoint} no longer holds them")
        if then is not None:
            then(mine and isinstance(reply, LeaseReply) and reply.held and reply.lease == source_lease)

    def _lost_at_source(self, record: LeaseRecord, hold: SourceHold, code: ErrorCode, reason: str) -> None:
        """The source no longer holds ``hold``'s keys: the client is told which."""
        self.links.release_lease(hold.endpoint, hold.source_lease)
        hold.state = HoldState.ENDED
        self.counters.inc(LeaseCount.LOST_AT_SOURCE)
        if record.holds_anything:
            self._tell(record.session, record.id, code, reason, hold.held)
        else:
            self.end_lease(record, code, reason)

    def source_lease_ended(self, link: PeerLink, msg: LeaseEnded) -> None:
        """A source ended one of the leases it holds for us (its time to live passed)."""
        for record, hold in self._holds(link.endpoint):
            if hold.source_lease == msg.lease:
                self._lost_at_source(record, hold, ErrorCode(msg.code) if msg.code in _ENDING_CODES else ErrorCode.LEASE_EXPIRED,
                                     f"the source {link.endpoint} ended its lease: {msg.reason}")

    def source_lost(self, link: PeerLink, code: ErrorCode) -> None:
        """A source restarted or is gone: nothing it held for us is held any more. The client
        hears PEER_RESTARTED or PEER_UNREACHABLE, the codes a ``lease_end`` carries (spec
        section 10.1), whatever made the link give up."""
        restarted = code is ErrorCode.PEER_RESTARTED
        code = code if restarted else ErrorCode.PEER_UNREACHABLE
        reason = "restarted" if restarted else f"is unreachable (down past peer_dead_ms={self.config.peer_dead_ms})"
        for record, hold in self._holds(link.endpoint):
            self._lost_at_source(record, hold, code, f"the source {link.endpoint} {reason}")

    def source_resumed(self, link: PeerLink) -> None:
        """The link came back to the same incarnation within ``peer_dead_ms``: the source kept
        our leases (spec section 6.11). Each is renewed to its time left, which also tells
        whether the source still holds it; one it does not is lost (PEER_UNREACHABLE)."""
        now = self.clock()
        for record, hold in self._holds(link.endpoint):
            self.counters.inc(LeaseCount.RESUMED_AT_SOURCE)
            left_ms = max(1, int((record.expires - now) * 1000))
            self._renew_at_source(record, hold, left_ms, ErrorCode.PEER_UNREACHABLE)

    def granted_at_sources(self, session: Session) -> dict[bytes, tuple[str, int]]:
        """Key -> the source (endpoint, incarnation) whose read grant of it one of
        ``session``'s leases passed on: the keys its client may have read from a source's
        pools (spec section 6.12, "Integrity": their reports go on to that source)."""
        out: dict[bytes, tuple[str, int]] = {}
        for lease_id in session.leases:
            record = self.table.get(lease_id)
            if record is None:
                continue
            for hold in record.sources:
                if hold.state is HoldState.HELD:
                    for k in hold.rows:
                        out.setdefault(hold.keys[k], (hold.endpoint, hold.incarnation))
        return out

    def _holds(self, endpoint: str) -> list[tuple[LeaseRecord, SourceHold]]:
        return [(r, h) for r in list(self.table.values()) for h in r.sources
                if h.endpoint == endpoint and h.state is HoldState.HELD]


_ENDING_CODES = frozenset({ErrorCode.LEASE_EXPIRED, ErrorCode.SHUTTING_DOWN, ErrorCode.PEER_RESTARTED, ErrorCode.PEER_UNREACHABLE})
"""Codes a source's ``lease_end`` may pass on; any other is reported as LEASE_EXPIRED."""


def _ignore(reply: Message | None, code: ErrorCode | None) -> None:
    """An answer nobody waits for (a release or renewal at a source is best effort)."""
