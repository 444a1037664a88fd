"""Leases: objects held from a lookup through every delivery of them (spec section 6.11).

A lease holds each READY key it names with one claim (architecture §2), so the object
cannot be evicted or removed while the lease lasts, and every deliver or fetch of it finds
it. Keys the session's hint sends to a source are leased there, on the peer session, by a
lease this node holds for the client (a ``SourceHold``). ``Leases`` owns every lease: the
table by id, each session's ids, the slots leases pin per pool, and the limits that keep
leases from starving the cache. A lease ends at ``unlease``, at the end of its time to
live (``lease_end`` LEASE_EXPIRED), with its session, or (the keys of one source) when that
source restarts, stays unreachable, or ends its own lease.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcr_node.config import NodeConfig
from kvcr_node.counters import LeaseCount, LeaseCounters
from kvcr_node.grants import grant_rows, with_digests
from kvcr_node.outbox import Outbox
from kvcr_node.records import Session
from kvcr_node.source_grants import SourceGrants, SourceRow
from kvcr_node.source_holds import (
    _REMOTE_TIER_INDEX,
    SOURCE_ANSWER_S,
    HoldState,
    LeaseRecord,
    PendingReply,
    SourceHold,
    SourceHolds,
)

__all__ = ["SOURCE_ANSWER_S", "HoldState", "LeaseRecord", "Leases", "PendingReply", "SourceHold"]
from kvcr_node.store import ObjectEntry, ObjectState, Store
from kvcr_protocol import (
    GRANTS_VERSION,
    Ack,
    ErrorCode,
    GrantNode,
    Lease,
    LeaseColumns,
    LeaseEnded,
    LeaseGrant,
    LeaseReply,
    LeaseStatus,
    ProtocolError,
    ReleaseLease,
    RenewLease,
    Role,
    packed_grant_columns,
)

if TYPE_CHECKING:
    from kvcr_node.links import Links

log = logging.getLogger("kvcr.node")

REMOTE_TIER = "remote"
"""The tier a key held by a source is reported in (as for queries)."""
EXPIRY_SLACK = 64
"""Stale expiry entries (of leases renewed or ended) tolerated beyond twice the live leases."""


class Leases(SourceHolds):
    """The ``lease``, ``renew`` and ``unlease`` handlers, expiry, and the leases' accounting."""

    def __init__(
        self, config: NodeConfig, store: Store, outbox: Outbox, links: Links, clock: Callable[[], float], endpoint: str,
    ) -> None:
        self.config = config
        self.store = store
        self.outbox = outbox
        self.links = links
        self.clock = clock
        self.endpoint = endpoint
        """This node's own endpoint: a hint naming it asks no source."""
        self.tiers: tuple[str, ...] = ("", REMOTE_TIER, *store.tiers)
        self.table: dict[int, LeaseRecord] = {}
        self.holders: dict[ObjectEntry, int] = {}
        """Object -> how many leases hold it (by object, not key: a condemned object and its
        key stored again are two, spec section 6.12)."""
        self.pinned: dict[str, int] = dict.fromkeys(store.pools, 0)
        """Pool -> slots of objects held by at least one lease."""
        self.pin_limit = {name: int(config.lease_pool_fraction * spec.slot_count) for name, spec in store.pools.items()}
        """Pool -> its lease budget: the slots leased objects may pin."""
        self.session_count: Callable[[], int] = lambda: 0
        """How many sessions (clients and peers) the node serves now that announced memory or
        hold a lease: those that share the lease budgets (the node sets it)."""
        self._ids = itertools.count(1)
        self._expiry: list[tuple[float, int]] = []
        """(expires, lease id), a heap; an entry whose lease was renewed or ended is skipped."""
        self._asking: dict[int, LeaseRecord] = {}
        self.counters = LeaseCounters()
        self.grant_node: Callable[[Session], GrantNode] | None = None
        """What a grant's ``node`` says to a session (the node sets it; None: no grants)."""
        self.pool_index: dict[str, int] = {}
        """Pool name -> its index in ``welcome.pools`` (the node sets it)."""
        self.granted = 0
        """Leases whose reply carried a read grant, alive now: while any is, the node
        progresses its agent for the reads the grants allow (spec section 6.12)."""
        self.granted_at = -math.inf
        """When a grant was last given or a granted lease renewed: its client reads soon."""
        self.source_grants = SourceGrants()
        self.on_disk: Callable[[bytes], bool] | None = None
        """Whether a key missing from memory is held in the disk tier (architecture §9; the node sets it)."""
        self.promote: Callable[[bytes], bool] | None = None
        """Read a key back from the disk tier; whether it is coming (PENDING). Called once the
        lease's own entries are claimed: a read back evicts, and must not take those."""

    # ------------------------------------------------------------------ requests

    def on_lease(self, session: Session, msg: Lease) -> None:
        if len(session.leases) >= self.config.max_leases_per_session:
            self.counters.inc(LeaseCount.REFUSED_LEASE_LIMIT)
            self.outbox.refuse(session, msg.id, ProtocolError(
                ErrorCode.LEASE_LIMIT, f"this session holds {len(session.leases)} leases, the most the node allows "
                "(max_leases_per_session); release some first"))
            return
        now = self.clock()
        ttl = self._granted(msg.ttl_ms)
        shares = self.shares(session)
        record = LeaseRecord(next(self._ids), session, ttl, now + ttl / 1000)
        if msg.read and self.grants_for(session):
            record.read, record.node_md = True, msg.node_md
        keys = msg.keys
        status, tier = bytearray(len(keys)), bytearray(len(keys))
        hint = None if session.role is Role.PEER or msg.request_id is None else session.hints.get(msg.request_id)
        remote: dict[str, list[int]] = {}
        seen: set[bytes] = set()
        on_disk: list[int] = []
        leading = len(keys)  # entries held before the first key not held here (no gap: all)
        for i, key in enumerate(keys):
            if key in seen:
                continue  # a repeated key is held once; it reports its first answer (``_answer``)
            seen.add(key)
            entry = self.store.lookup(key)
            if entry is None and self.on_disk is not None and self.on_disk(key):
                on_disk.append(i)  # read back once this lease's entries are claimed (below)
                leading = min(leading, len(record.entries))
                continue
            if entry is None or entry.state is ObjectState.WRITING:
                leading = min(leading, len(record.entries))
            if entry is None:
                if hint is not None and key in hint[1] and hint[0] != self.endpoint:
                    if session.leased_slots + 1 > self.config.max_leased_slots_per_session:
                        # A key asked of a source counts one slot while it waits (spec section
                        # 6.11): a flood of pending leases meets the session's limit.
                        self.counters.inc(LeaseCount.KEYS_REFUSED_LIMIT)
                        status[i], tier[i] = LeaseStatus.LEASE_LIMIT, _REMOTE_TIER_INDEX
                        continue
                    remote.setdefault(hint[0], []).append(i)
                    record.waiting += 1
                    record.slots += 1
                    session.leased_slots += 1
                continue  # MISS: status 0, tier 0
            tier[i] = 2 + (entry.lookup - 2) // 2  # the store's lookup code says the tier
            if entry.state is ObjectState.WRITING:
                status[i] = LeaseStatus.PENDING
            elif self._fits(session, entry, shares) or self._take_back(session, entry, shares):
                self._hold(record, entry)
                status[i] = LeaseStatus.LEASED
            else:
                self.counters.inc(LeaseCount.KEYS_REFUSED_LIMIT)
                status[i] = LeaseStatus.LEASE_LIMIT
                leading = min(leading, len(record.entries))
        # A lease is an access (LRU's only sign that its client reads what it holds, unseen
        # under a grant) for the keys it holds up to a gap: an engine looks up a prefix.
        self.store.claim_all(record.entries, accessed=leading)
        for i in on_disk:
            # Read back from the disk tier: PENDING; with no room in memory for it, a MISS.
            if self.promote is not None and self.promote(keys[i]):
                entry = self.store.lookup(keys[i])
                assert entry is not None  # placed, WRITING
                status[i], tier[i] = LeaseStatus.PENDING, 2 + (entry.lookup - 2) // 2
        self.table[record.id] = record
        session.leases.add(record.id)
        self._schedule(record)
        if remote:
            record.reply = PendingReply(msg.id, keys, status, tier, now + SOURCE_ANSWER_S, len(remote))
            self._asking[record.id] = record
            for endpoint, indices in remote.items():
                hold = SourceHold(endpoint, indices, tuple(keys[i] for i in indices))
                record.sources.append(hold)
                self._ask_source(record, hold)
            return
        self._answer(record, msg.id, keys, status, tier)

    def on_renew(self, session: Session, msg: RenewLease) -> None:
        record = self._own(session, msg.id, msg.lease)
        if record is None:
            return
        ttl = self._granted(msg.ttl_ms or record.ttl_ms)
        record.ttl_ms = ttl
        record.expires = self.clock() + ttl / 1000
        self._schedule(record)
        self.counters.inc(LeaseCount.RENEWED)
        if record.granted:
            self.granted_at = self.clock()
        # Version 5: whether every key held at the grant still is (a lease that is still
        # known held its local keys throughout; keys lost at a source break it). Keys a
        # client READs at a source under its grant are vouched for by the source's own
        # ``!held`` on this renewal: the reply waits for it (spec section 6.12, "Across nodes").
        held = session.version >= GRANTS_VERSION and not any(h.state is HoldState.ENDED and h.held for h in record.sources)
        vouching = [h for h in record.sources if h.state is HoldState.HELD and h.rows] if held else []
        left, broken = [len(vouching)], [False]

        def vouched(ok: bool) -> None:
            left[0] -= 1
            broken[0] = broken[0] or not ok
            if left[0] == 0:
                still = not broken[0] and self.table.get(record.id) is record
                self.outbox.reply(session, LeaseReply(msg.id, record.id, ttl, None, still))

        for hold in record.sources:
            if hold.state is HoldState.HELD:
                self._renew_at_source(record, hold, ttl, then=vouched if hold in vouching else None)
        if not vouching:
            self.outbox.reply(session, LeaseReply(msg.id, record.id, ttl, None, held))

    def on_unlease(self, session: Session, msg: ReleaseLease) -> None:
        record = self._own(session, msg.id, msg.lease)
        if record is None:
            return
        self.counters.inc(LeaseCount.RELEASED)
        self.end_lease(record)
        self.outbox.reply(session, Ack(msg.id))

    def _own(self, session: Session, request_id: int, lease: int) -> LeaseRecord | None:
        """The session's own lease ``lease``, or None after refusing the request UNKNOWN_LEASE:
        another session's lease, an ended or a released one are all unknown here."""
        record = self.table.get(lease) if lease in session.leases else None
        if record is None or record.session is not session:
            self.counters.inc(LeaseCount.UNKNOWN_LEASE)
            self.outbox.refuse(session, request_id, ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"lease {lease} is not held by this session (never granted, released or ended)",
                "lease"))
            return None
        return record

    def _schedule(self, record: LeaseRecord) -> None:
        """Put the lease's expiry in the heap; entries of leases renewed or ended since are
        dropped when they outnumber the live leases, so the heap stays bounded under churn."""
        heapq.heappush(self._expiry, (record.expires, record.id))
        if len(self._expiry) > 2 * len(self.table) + EXPIRY_SLACK:
            self._expiry = [(r.expires, r.id) for r in self.table.values()]
            heapq.heapify(self._expiry)

    def _granted(self, ttl_ms: int) -> int:
        return min(ttl_ms or self.config.lease_ttl_ms, self.config.max_lease_ttl_ms)

    def _answer(self, record: LeaseRecord, request_id: int, keys: Sequence[bytes], status: bytearray, tier: bytearray) -> None:
        """Send the ``lease_reply``; a lease that holds nothing is not kept (lease id 0)."""
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            j = first.setdefault(key, i)
            if j != i:
                status[i], tier[i] = status[j], tier[j]
        lease = record.id
        if record.holds_anything:
            self.counters.inc(LeaseCount.GRANTED)
        else:
            self._forget(record)
            lease = 0
        held = bool(lease) and record.session.version >= GRANTS_VERSION
        grant = self._grant(record, keys, status) if lease and record.read else None
        self.outbox.reply(record.session, LeaseReply(request_id, lease, record.ttl_ms,
                                                     LeaseColumns(bytes(status), bytes(tier), self.tiers), held, grant))

    # ------------------------------------------------------------------ read grants

    def grants_for(self, session: Session) -> bool:
        """Whether ``session`` may get read grants: a client, or (with ``peer_grants`` on) a
        target passing them on to its clients, of version 5 or later, and
        ``client_transfers`` on (spec section 6.12)."""
        if session.role is Role.PEER and not self.config.peer_grants:
            return False  # this node never authenticated a target's clients (spec section 14)
        return (self.config.client_transfers and self.grant_node is not None and session.version >= GRANTS_VERSION)

    def _grant(self, record: LeaseRecord, keys: Sequence[bytes], status: bytearray) -> LeaseGrant:
        """The read grant of a lease answered now: the slots of every key it holds here, and
        those its sources granted for the keys they hold (a client session only)."""
        record.granted = True
        self.granted += 1
        self.granted_at = self.clock()
        self.counters.inc(LeaseCount.READ_GRANTS)
        assert self.grant_node is not None
        rows = grant_rows(record.entries, keys, status, self.pool_index)
        node = self.grant_node(record.session) if record.node_md else None
        remote: dict[int, SourceRow] = {}
        remote_digests: dict[int, bytes] = {}
        for hold in record.sources:
            if hold.state is HoldState.HELD:
                for k, row in hold.rows.items():
                    remote[hold.indices[k]] = (hold.endpoint, hold.incarnation, row)
                    remote_digests[hold.indices[k]] = hold.digests.get(k, b"")
        if not remote or record.session.role is Role.PEER:
            grant = packed_grant_columns(rows, node)
        else:
            # A repeated key has its row at its first position only, as a local one (spec 6.12).
            grant = self.source_grants.columns(record.session, rows, remote, node)
        entries = record.entries if self.config.integrity else ()
        return with_digests(grant, entries, keys, remote_digests)

    # ------------------------------------------------------------------ holding

    def shares(self, session: Session) -> dict[str, int]:
        """Pool -> the slots ``session``'s leases may hold there: its share of the pool's lease
        budget, ceil(max(lease_session_fraction, 1/sessions) * budget), counting the sessions
        that announced memory or hold leases, and this one (spec section 6.11)."""
        sessions = self.session_count() + (0 if session.regions or session.leases else 1)
        fraction = max(self.config.lease_session_fraction, 1 / max(1, sessions))
        return {pool: min(limit, math.ceil(fraction * limit)) for pool, limit in self.pin_limit.items()}

    def _fits(self, session: Session, entry: ObjectEntry, shares: dict[str, int]) -> bool:
        """Whether holding ``entry`` keeps the session (its slots, its share of each pool) and
        every pool within the lease limits; an object the session holds already always fits."""
        if entry in session.held_objects:
            return True  # held by another of its leases: it pins nothing more, for it or the node
        slots = len(entry.info.layout)
        if session.leased_slots + slots > self.config.max_leased_slots_per_session:  # ``_hold`` counts there at once
            return False
        held = session.pool_slots
        if any(held[pool] + count > shares[pool] for pool, count in entry.info.need):
            return False  # an object another session pinned counts for this one too: it holds it
        if entry in self.holders:
            return True  # already pinned by another lease: it pins nothing more
        return all(self.pinned[pool] + count <= self.pin_limit[pool] for pool, count in entry.info.need)

    def _take_back(self, session: Session, entry: ObjectEntry, shares: dict[str, int]) -> bool:
        """``entry`` would take ``session`` past no limit of its own, but a pool's lease budget
        is full: end the leases of sessions holding more than their share there (the largest
        excess first, its oldest lease first) until it fits; whether it fits now. So a first
        comer that took the whole budget while alone gives back what later sessions' shares
        need (spec section 6.11); the keys of those leases fail or are recomputed, safely."""
        need = dict(entry.info.need)
        if session.leased_slots + len(entry.info.layout) > self.config.max_leased_slots_per_session or any(
                session.pool_slots[pool] + count > shares[pool] for pool, count in need.items()):
            return False
        for pool, count in need.items():
            while self.pinned[pool] + count > self.pin_limit[pool]:
                over = [(s.pool_slots[pool] - shares[pool], s) for s in {id(r.session): r.session for r in self.table.values()
                                                                         if r.session is not session}.values()]
                excess, victim = max(over, key=lambda o: o[0], default=(0, session))
                if excess <= 0:
                    return False
                record = min((self.table[lease] for lease in victim.leases
                              if lease in self.table and self.table[lease].pool_slots[pool]), key=lambda r: r.id)
                self.counters.inc(LeaseCount.TAKEN_BACK)
                self.end_lease(record, ErrorCode.LEASE_LIMIT, f"lease {record.id} was ended: its session held more "
                               f"than its share of pool {pool!r}'s lease budget, which another session needed")
        # Ending those leases dropped their claims: an object removed meanwhile is gone now.
        return self.store.lookup(entry.key) is entry and self._fits(session, entry, shares)

    def _hold(self, record: LeaseRecord, entry: ObjectEntry) -> None:
        """Count ``entry`` as held by ``record`` (the caller claims it: ``Store.claim_all``);
        its session is charged for it once, by the first of its leases that holds it."""
        record.entries.append(entry)
        record.slots += len(entry.info.layout)
        for pool, count in entry.info.need:
            record.pool_slots[pool] += count
        _charge(record.session, entry)
        held = self.holders.get(entry, 0)
        if not held:
            for pool, count in entry.info.need:
                self.pinned[pool] += count
        self.holders[entry] = held + 1

    def _unhold(self, session: Session, entries: Sequence[ObjectEntry]) -> None:
        """``entries`` are held by one lease of ``session`` less; their claims drop, and the
        session's charge for those it no longer holds under any lease."""
        # Each count (this session's, every lease's) drops by one; what reaches 0 is let go.
        for entry in entries:
            if _drop_one(session.held_objects, entry):
                session.leased_slots -= len(entry.info.layout)
                for pool, count in entry.info.need:
                    session.pool_slots[pool] -= count
            if _drop_one(self.holders, entry):
                for pool, count in entry.info.need:
                    self.pinned[pool] -= count
        session.pool_slots = +session.pool_slots
        self.store.unclaim_all(entries)

    # ------------------------------------------------------------------ the end of a lease

    def end_lease(self, record: LeaseRecord, code: ErrorCode | None = None, reason: str = "") -> None:
        """End the lease: its claims drop, its sources release theirs; with ``code``, the
        client is told (``lease_end``)."""
        if self.table.get(record.id) is not record:
            return
        self._unhold(record.session, record.entries)
        record.entries.clear()
        for hold in record.sources:
            self._release_at_source(hold)
        reply = record.reply
        self._forget(record)
        if reply is not None and not record.session.closing:
            # Ended while it waited for sources (at shutdown): the request still gets its
            # answer, holding nothing.
            status = bytes(reply.status).translate(_NOTHING_HELD)
            self.outbox.reply(record.session, LeaseReply(
                reply.request_id, 0, record.ttl_ms, LeaseColumns(status, bytes(reply.tier), self.tiers)))
        if code is not None and not record.session.closing:
            self._tell(record.session, record.id, code, reason, ())

    def _forget(self, record: LeaseRecord) -> None:
        """The lease's table entries go (its objects were let go of: ``_unhold``); the session
        stops counting the keys it still waited on at sources."""
        session = record.session
        session.leased_slots -= record.waiting
        record.slots = record.waiting = 0
        record.pool_slots.clear()
        record.session.leases.discard(record.id)
        self.table.pop(record.id, None)
        if record.granted:
            record.granted = False
            self.granted -= 1
        self._asking.pop(record.id, None)
        record.reply = None

    def end_session_leases(self, session: Session) -> None:
        """The session ended: every lease it holds ends with it (spec section 6.11)."""
        for lease in list(session.leases):
            record = self.table.get(lease)
            if record is not None:
                self.counters.inc(LeaseCount.ENDED_WITH_SESSION)
                self.end_lease(record)

    def carry_over(self, old: Session, new: Session) -> None:
        """A target reconnected (same incarnation, a new peer session): the leases of its old
        session go on in the new one, with their ids, so that a brief outage loses none
        (spec section 6.11)."""
        for lease in sorted(old.leases):
            record = self.table.get(lease)
            if record is None or record.session is not old:
                continue
            record.session = new
            new.leases.add(lease)
            new.leased_slots += record.waiting
            for entry in record.entries:
                _charge(new, entry)
            self.counters.inc(LeaseCount.CARRIED_OVER)
        old.leases.clear()
        old.leased_slots = 0
        old.pool_slots.clear()
        old.held_objects.clear()

    def end_all(self, code: ErrorCode, reason: str) -> None:
        """At shutdown: every lease ends and its client is told."""
        for record in list(self.table.values()):
            self.end_lease(record, code, reason)

    def _tell(self, session: Session, lease: int, code: ErrorCode, reason: str, keys: tuple[bytes, ...]) -> None:
        session.events += 1
        self.outbox.reply(session, LeaseEnded(session.events, lease, int(code), reason, keys))

    # ------------------------------------------------------------------ time

    def check(self, now: float) -> None:
        """Expire leases past their time to live; answer leases whose sources are too slow."""
        while self._expiry and self._expiry[0][0] <= now:
            expires, lease = heapq.heappop(self._expiry)
            record = self.table.get(lease)
            if record is not None and record.expires == expires:
                self.counters.inc(LeaseCount.EXPIRED)
                self.end_lease(record, ErrorCode.LEASE_EXPIRED, f"lease {lease} was not renewed within {record.ttl_ms} ms")
        for record in [r for r in self._asking.values() if r.reply is not None and r.reply.deadline <= now]:
            for hold in record.sources:
                if hold.state is HoldState.ASKING:
                    self._source_answered(record, hold, None, ErrorCode.PEER_UNREACHABLE)

    def next_expiry(self) -> float | None:
        """When ``check`` has something to do next."""
        times = [r.reply.deadline for r in self._asking.values() if r.reply is not None]
        while self._expiry:
            expires, lease = self._expiry[0]
            record = self.table.get(lease)
            if record is not None and record.expires == expires:
                times.append(expires)
                break
            heapq.heappop(self._expiry)  # renewed or ended: not due
        return min(times) if times else None

    # ------------------------------------------------------------------ reporting

    @property
    def claims(self) -> int:
        """Store claims the leases hold (one per leased object per lease)."""
        return sum(len(r.entries) for r in self.table.values())

    def stats(self) -> dict[str, object]:
        return {
            "held": len(self.table),
            "objects": len(self.holders),
            "pinned_slots": dict(self.pinned),
            "at_sources": sum(1 for r in self.table.values() for h in r.sources if h.state is HoldState.HELD),
            "with_grants": self.granted,
            **self.counters.snapshot(),
        }

    def sizes(self) -> dict[str, int]:
        return {"leases": len(self.table), "lease_holders": len(self.holders), "lease_expiry": len(self._expiry),
                **self.source_grants.sizes()}

    def check_invariants(self) -> list[str]:
        """Holders, pinned slots and each session's slots recounted from the leases."""
        breaches: list[str] = []
        granted = sum(1 for r in self.table.values() if r.granted)
        if granted != self.granted:
            breaches.append(f"{self.granted} leases counted with grants, {granted} in the table")
        holders: collections.Counter[ObjectEntry] = collections.Counter()
        slots: collections.Counter[int] = collections.Counter()
        pool_slots: dict[int, collections.Counter[str]] = {}
        session_objects: dict[int, dict[ObjectEntry, int]] = {}
        """Per session: object -> its leases holding it (each object charged once)."""
        for lease, record in self.table.items():
            if lease not in record.session.leases:
                breaches.append(f"lease {lease} is not in its session")
            own: collections.Counter[str] = collections.Counter()
            for entry in record.entries:
                holders[entry] += 1
                condemned = entry.state is ObjectState.CONDEMNED  # out of the store, slots held (spec 6.12)
                if (self.store.lookup(entry.key) is not entry and not condemned) or entry.claims < 1:
                    breaches.append(f"lease {lease} holds {entry.key!r}, which is not a claimed stored object")
                for pool, count in entry.info.need:
                    own[pool] += count
            waiting = sum(len(h.indices) for h in record.sources if h.state is HoldState.ASKING) if record.reply else 0
            if record.waiting != waiting or record.slots != sum(len(e.info.layout) for e in record.entries) + waiting:
                breaches.append(f"lease {lease}: {record.slots} slots and {record.waiting} keys waiting, it holds "
                                f"{len(record.entries)} objects and waits on {waiting} keys")
            if +record.pool_slots != +own:
                breaches.append(f"lease {lease}: pool slots {dict(record.pool_slots)} disagree with its objects {dict(own)}")
            slots[id(record.session)] += record.waiting
            mine = session_objects.setdefault(id(record.session), {})
            for entry in record.entries:
                mine[entry] = mine.get(entry, 0) + 1
            pool_slots.setdefault(id(record.session), collections.Counter())
        if dict(holders) != self.holders:
            breaches.append(f"lease holders {len(self.holders)} disagree with the leases ({len(holders)})")
        pinned = dict.fromkeys(self.pinned, 0)
        for entry in holders:
            for pool, count in entry.info.need:
                pinned[pool] += count
        if pinned != self.pinned:
            breaches.append(f"pinned slots {self.pinned} disagree with the leased objects {pinned}")
        for sid, objects in session_objects.items():
            for entry in objects:  # each object once, however many leases hold it
                slots[sid] += len(entry.info.layout)
                pool_slots[sid].update(dict(entry.info.need))
        for record in self.table.values():
            session = record.session
            if session_objects.get(id(session), {}) != session.held_objects:
                breaches.append(f"session {session.name}: {len(session.held_objects)} objects counted held, its leases "
                                f"hold {len(session_objects.get(id(session), {}))}")
            if slots[id(session)] != session.leased_slots:
                breaches.append(f"session {session.name}: leased slots {session.leased_slots}, leases hold {slots[id(session)]}")
            if +session.pool_slots != +pool_slots[id(session)]:
                breaches.append(f"session {session.name}: pool slots {dict(session.pool_slots)}, leases hold "
                                f"{dict(pool_slots[id(session)])}")
        return breaches


def _charge(session: Session, entry: ObjectEntry) -> None:
    """One more of ``session``'s leases holds ``entry``; the first charges the session for it."""
    mine = session.held_objects.get(entry, 0)
    session.held_objects[entry] = mine + 1
    if not mine:
        session.leased_slots += len(entry.info.layout)
        for pool, count in entry.info.need:
            session.pool_slots[pool] += count


def _drop_one(counts: dict[ObjectEntry, int], entry: ObjectEntry) -> bool:
    """One holder of ``entry`` fewer; whether that was the last (it is gone from ``counts``)."""
    left = counts[entry] - 1
    if left:
        counts[entry] = left
        return False
    del counts[entry]
    return True


_NOTHING_HELD = bytes(
    LeaseStatus.MISS if code in (LeaseStatus.LEASED, LeaseStatus.LEASED_REMOTE) else code for code in range(256))
"""Translates a status column so that no key reads as held."""
