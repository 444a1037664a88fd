"""Write grants (spec section 6.13): puts, the slots they reserve, and their quarantine.

A ``put`` is checked and placed as a deposit's items are (``Deposits.place``), and that is
all the node does with its bytes: its new entries stay ``WRITING`` while the client WRITEs
them with its own agent, and its ``commit`` makes them ``READY`` as a deposit's READ does
(``Deposits.commit_fills``). A put that ends unfinished
(its time to live, or its session's end) is quarantined, not freed: its client may still
be posting a WRITE into those slots. Its entries stay ``WRITING`` (nothing reads them, no
other writer takes the keys) until the session names it in ``commit`` or ``unput``, or
the client's agent was removed from ours and ``put_quarantine_ms`` passed.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvcr_node.agents import RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.eviction import LayoutInfo
from kvcr_node.operations import Operations
from kvcr_node.ops.deposit import Deposits, Fills
from kvcr_node.outbox import Outbox
from kvcr_node.records import ItemResults, OpKind, Session
from kvcr_node.store import ObjectState, Store
from kvcr_protocol import (
    Ack,
    Commit,
    Completion,
    ErrorCode,
    GrantNode,
    KeyResult,
    KeyStatus,
    LeaseGrant,
    ProtocolError,
    Put,
    PutReply,
    Unput,
    session_rules,
)
from kvcr_protocol.columns import U32, pack
from kvcr_protocol.versions import GRANTS_VERSION

log = logging.getLogger("kvcr.node")

QUARANTINE_RETRY_S = 1.0
"""A lost put whose quarantine passed while another session still holds its client's agent
is looked at again this often (that session's end lets the agent go)."""

_LITTLE = sys.byteorder == "little"
"""Slots are stored as native u32 and travel little-endian: on such hosts, as they are."""


class PutState(enum.Enum):
    """Where a put stands."""

    OPEN = "open"
    """Slots reserved; the client is writing them. Ends by commit, unput or expiry."""
    EXPIRED = "expired"
    """Its time to live passed with its session still here: quarantined until the session
    names it (its WRITEs are then over) or the session ends and the rules of LOST apply; a
    session that has not named it ``put_quarantine_ms`` after it expired is ended."""
    LOST = "lost"
    """Its session ended first: quarantined until the client's agent was removed from ours
    and ``put_quarantine_ms`` passed since the put ended."""


@dataclass
class PutRecord:
    """One put: its session, the entries it reserved, its results, its clock."""

    id: int
    session: Session
    agent: str
    fills: Fills
    results: list[KeyResult]
    no_evict: bool
    deadline: float
    state: PutState = PutState.OPEN
    ended: float = 0.0
    """When it ended unfinished (expiry or its session's end)."""
    removed: bool = False
    """Whether the client's agent was removed from ours since it ended."""
    slots: int = field(default=0)
    pool_slots: collections.Counter[str] = field(default_factory=collections.Counter)
    """Pool -> slots its entries take there (counted against its client's share)."""
    retry: float = 0.0
    """When a lost put whose agent another session still held is looked at again."""


class Puts:
    """The ``put``, ``commit`` and ``unput`` handlers and every put's state (by id)."""

    def __init__(
        self, config: NodeConfig, store: Store, deposits: Deposits, operations: Operations, agents: RemoteAgents,
        outbox: Outbox, clock: Callable[[], float], pool_index: Mapping[str, int],
        grant_node: Callable[[Session], GrantNode],
    ) -> None:
        self.config = config
        self.store = store
        self.deposits = deposits
        self.operations = operations
        self.agents = agents
        self.outbox = outbox
        self.clock = clock
        self.pool_index = pool_index
        self.grant_node = grant_node
        self.table: dict[int, PutRecord] = {}
        self.total: collections.Counter[str] = collections.Counter()
        """Pool -> slots all open and quarantined puts hold (``put_pool_fraction``)."""
        self.by_agent: dict[str, collections.Counter[str]] = {}
        """Client agent -> pool -> slots its open and quarantined puts hold, those its
        earlier sessions lost included (``put_session_fraction``)."""
        self.session_count: Callable[[], int] = lambda: 0
        """Client sessions connected, the putter's included (the node sets it): each may keep
        objects in the pools, so a putter's share shrinks as clients arrive."""
        self.end_session: Callable[[Session], None] = lambda session: None
        """Ends a session that sits on an expired put past its quarantine (the node's
        ``Sessions.end``), so that its slots and keys are freed in bounded time."""
        self._next_id = 1
        self.granted_at = -1e18
        """When a put was last granted: its client WRITEs soon (the node paces its agent)."""
        self.counts = {"granted": 0, "committed": 0, "abandoned": 0, "expired": 0, "lost": 0, "freed_late": 0,
                       "refused_share": 0, "sessions_ended": 0, "freed_on_resume": 0}
        agents.on_removed = self.agent_removed

    # ------------------------------------------------------------------ requests

    def on_put(self, session: Session, msg: Put) -> None:
        if not self.config.client_transfers or session.version < GRANTS_VERSION:
            # Not served: the client deposits (spec section 6.13, section 7).
            self.outbox.refuse(session, msg.id, ProtocolError(
                ErrorCode.MUST_UNDERSTAND, "this node grants no writes (client_transfers is off)", "t"))
            return
        conflict = session_rules.request_id_conflict(msg.id, session.ops)
        if conflict is not None:
            self.outbox.refuse(session, msg.id, conflict)
            return
        if len(session.puts) >= self.config.max_puts_per_session:
            self.outbox.refuse(session, msg.id, ProtocolError(
                ErrorCode.BUSY, f"{len(session.puts)} puts held (max_puts_per_session); commit or unput some first"))
            return
        over = self._past_share(session, msg)
        if over is not None:
            self.counts["refused_share"] += 1
            self.outbox.refuse(session, msg.id, ProtocolError(ErrorCode.BUSY, over))
            return
        blocks, where, keys = self.deposits.column_blocks(msg)
        now = self.clock()
        # Placed as a deposit's items are, checked alike; its client moves the bytes.
        placement = ItemResults(len(keys))
        unique = self.operations.unique_keys(placement, keys)
        placed = self.deposits.place(session, placement, msg, [i for i in range(len(keys)) if unique[i]], blocks, where,
                                     waiting=None)
        reserved: Fills = [(i, entry) for i, entry, _ in placed]
        for i, _ in reserved:
            placement.set(i, KeyResult(KeyStatus.OK))
        results = [r if r is not None else KeyResult(KeyStatus.FAILED, ErrorCode.INTERNAL, "not placed")
                   for r in placement.results]
        self.outbox.check_results("put", results)
        if not reserved:
            self.operations.count_outcomes(OpKind.PUT, results)  # a put's final results (put.DUPLICATE, ...)
            self.outbox.reply(session, PutReply(msg.id, 0, 0, tuple(results)))
            return
        ttl = min(msg.ttl_ms or self.config.put_ttl_ms, self.config.max_put_ttl_ms)
        put = self._next_id
        self._next_id += 1
        record = PutRecord(put, session, session.agent, reserved, results, msg.no_evict, now + ttl / 1000,
                           slots=sum(len(e.slots) for _, e in reserved))
        for _, entry in reserved:
            record.pool_slots.update(dict(entry.info.need))
        self.by_agent.setdefault(record.agent, collections.Counter()).update(record.pool_slots)
        self.total.update(record.pool_slots)
        self.table[put] = record
        session.puts.add(put)
        self.counts["granted"] += 1
        self.granted_at = now
        grant = self._put_grant(reserved, len(keys), self.grant_node(session) if msg.node_md else None)
        self.outbox.reply(session, PutReply(msg.id, put, ttl, tuple(results), grant))

    def _put_grant(self, reserved: Fills, n: int, node: GrantNode | None) -> LeaseGrant:
        """The slots of the reserved entries as a ``LeaseGrant`` (spec sections 6.12 and 6.13):
        one row per key of the put; each entry's slots are already a u32 column."""
        table: dict[str, int] = {}
        layout = [0] * n
        pool, slot = bytearray(), bytearray()
        for i, entry in reserved:
            names, column = self._grant_layout(entry.info)
            layout[i] = table.setdefault(names, len(table) + 1)
            pool += column
            slot += entry.slot_view.cast("B") if _LITTLE else pack(entry.slot_view.tolist(), U32)
        return LeaseGrant(pack(layout, U32), tuple(table), bytes(pool), bytes(slot), node)

    def _grant_layout(self, info: LayoutInfo) -> tuple[str, bytes]:
        """A layout as a grant names it: its span names joined, and its pools' indices;
        worked out once per layout, kept with it (``LayoutInfo.grant``)."""
        if info.grant is None:
            info.grant = ("\0".join(name for name, _ in info.layout), bytes(self.pool_index[p] for _, p in info.layout))
        return info.grant

    def on_commit(self, session: Session, msg: Commit) -> None:
        record = self._held(session, msg.id, msg.put)
        if record is None:
            return
        self._end(record)
        self.deposits.commit_fills(session, record.fills, record.no_evict, record.results.__setitem__)
        self.counts["committed"] += 1
        self.operations.count_outcomes(OpKind.PUT, record.results)  # as a deposit's (put.STORED)
        self.outbox.settled(session, "commit", msg.id, record.results)
        self.outbox.reply(session, Completion(msg.id, tuple(record.results)))

    def on_unput(self, session: Session, msg: Unput) -> None:
        record = self._held(session, msg.id, msg.put)
        if record is None:
            return
        self._free(record)
        self.counts["abandoned"] += 1
        self.outbox.reply(session, Ack(msg.id))

    def _held(self, session: Session, request_id: int, put: int) -> PutRecord | None:
        """The open put ``put`` of ``session``, or None after refusing the request (an
        expired one is freed: the request says no WRITE of it can land any more)."""
        record = self.table.get(put)
        if record is None or record.session is not session:
            self.outbox.refuse(session, request_id, ProtocolError(
                ErrorCode.UNKNOWN_PUT, f"put {put} is not held by this session (never granted, committed or abandoned)",
                "put"))
            return None
        if record.state is not PutState.OPEN:
            self._free(record)
            self.outbox.refuse(session, request_id, ProtocolError(
                ErrorCode.TIMEOUT, f"put {put} expired before its commit; its slots are freed", "put"))
            return None
        return record

    def _past_share(self, session: Session, msg: Put) -> str | None:
        """Why ``msg`` could take its client's puts past their share of a pool (every span
        counted as a new slot: nothing is placed or evicted before this check), or None. The
        share is ceil(max(put_session_fraction, 1/clients) * slots), clients connected."""
        asked: collections.Counter[str] = collections.Counter()
        for item in msg.items:
            asked.update(span.pool for span in item.spans)
        for block in msg.columns:
            rows = len(block.keys)
            for pool, count in collections.Counter(block.pool_names()).items():
                asked[pool] += count * rows
        held = self.by_agent.get(session.agent, collections.Counter())
        fraction = max(self.config.put_session_fraction, 1 / max(1, self.session_count()))
        pools = self.store.pools
        for pool, count in asked.items():
            spec = pools.get(pool)
            if spec is None:
                continue  # no such pool: the placement fails those keys by name
            budget = math.ceil(self.config.put_pool_fraction * spec.slot_count)
            if self.total[pool] + count > budget:
                return (f"puts hold {self.total[pool]} slots of pool {pool!r} and this one asks up to {count}: past the "
                        f"pool's put budget of {budget} (put_pool_fraction); try again once puts are committed")
            share = math.ceil(fraction * spec.slot_count)
            if held[pool] + count > share:
                return (f"this client's puts hold {held[pool]} slots of pool {pool!r} and this one asks up to {count}: "
                        f"past its share of {share} (put_session_fraction); commit or unput some first")
        return None

    def _end(self, record: PutRecord) -> None:
        """Forget ``record`` (its entries are the caller's to commit or free)."""
        del self.table[record.id]
        record.session.puts.discard(record.id)
        self.total.subtract(record.pool_slots)
        self.total = +self.total
        held = self.by_agent[record.agent]
        held.subtract(record.pool_slots)
        if not +held:
            del self.by_agent[record.agent]
        else:
            self.by_agent[record.agent] = +held

    def _free(self, record: PutRecord) -> None:
        """Free a put's reserved slots: no WRITE of it can land any more."""
        self._end(record)
        for _, entry in record.fills:
            if self.store.lookup(entry.key) is entry and entry.state is ObjectState.WRITING:
                self.store.abandon(entry)
            self.operations.wake(entry.key)

    # ------------------------------------------------------------------ ends unfinished

    def end_session_puts(self, session: Session) -> bool:
        """``session`` ends: its open and expired puts are lost (quarantined). Whether any
        was, so that the caller has the client's agent removed once nothing else holds it."""
        now = self.clock()
        lost = False
        for put in sorted(session.puts):
            record = self.table[put]
            if record.state is PutState.OPEN:
                record.ended = now
            record.state = PutState.LOST
            record.removed = False
            self.counts["lost"] += 1
            lost = True
        return lost

    def free_session_puts(self, session: Session) -> int:
        """``session``'s client resumed (spec section 5.2): it says no WRITE of the session's
        puts can land any more, so each is freed at once, as ``unput`` would; how many."""
        freed = 0
        for put in sorted(session.puts):
            self._free(self.table[put])
            freed += 1
        self.counts["freed_on_resume"] += freed
        return freed

    def agent_removed(self, name: str) -> None:
        """Our agent let go of ``name``: the connection its lost puts' WRITEs need is closed."""
        for record in self.table.values():
            if record.agent == name and record.state is PutState.LOST:
                record.removed = True

    def next_put_event(self) -> float | None:
        """When ``check_puts`` has something to do next (None: nothing timed). An expired put
        waits for its session, not for the clock; a lost one for its quarantine, then (while
        another session still holds the agent) every ``QUARANTINE_RETRY_S``."""
        quarantine = self.config.put_quarantine_ms / 1000
        times = [r.deadline if r.state is PutState.OPEN else max(r.ended + quarantine, r.retry)
                 for r in self.table.values()]
        return min(times) if times else None

    def check_puts(self, now: float) -> None:
        """Expire puts past their time to live; free lost ones whose quarantine is over."""
        quarantine = self.config.put_quarantine_ms / 1000
        for record in list(self.table.values()):
            if record.state is PutState.OPEN and now >= record.deadline:
                record.state = PutState.EXPIRED
                record.ended = now
                self.counts["expired"] += 1
                log.info("put %d of %s expired unfinished: %d slots quarantined", record.id, record.session.name,
                         record.slots)
            elif record.state is PutState.EXPIRED and now >= record.ended + quarantine and not record.session.closing:
                # Its session sits on it past the quarantine (a client that names its puts
                # would have): it ends, so that the put is LOST and freed once its agent goes.
                self.counts["sessions_ended"] += 1
                log.warning("client %s sat on expired put %d for %.1f s: ending its session", record.session.name,
                            record.id, now - record.ended)
                self.end_session(record.session)
            elif record.state is PutState.LOST and now >= max(record.ended + quarantine, record.retry):
                if not record.removed:
                    # Nothing else may hold the agent; once it is removed, the hook marks it.
                    self.agents.remove_unused(record.agent)
                if record.removed:
                    self._free(record)
                    self.counts["freed_late"] += 1
                else:
                    record.retry = now + QUARANTINE_RETRY_S

    # ------------------------------------------------------------------ statistics

    def put_stats(self) -> dict[str, int]:
        by = {state: 0 for state in PutState}
        slots = 0
        for record in self.table.values():
            by[record.state] += 1
            if record.state is not PutState.OPEN:
                slots += record.slots
        return {**self.counts, "open": by[PutState.OPEN], "quarantined": by[PutState.EXPIRED] + by[PutState.LOST],
                "quarantined_slots": slots}

    def sizes(self) -> dict[str, int]:
        """For the node's ``tables``: puts tracked (open, expired or lost and quarantined)."""
        return {"puts": len(self.table)}

    def check_invariants(self) -> list[str]:
        breaches = []
        for record in self.table.values():
            if record.id not in record.session.puts:
                breaches.append(f"put {record.id} is not in its session")
            for _, entry in record.fills:
                if self.store.lookup(entry.key) is not entry or entry.state is not ObjectState.WRITING:
                    breaches.append(f"put {record.id}: {entry.key!r} is not its WRITING entry")
        return breaches
