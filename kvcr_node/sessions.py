"""The node's sessions: who said hello, what each announced, and how long it stays.

A client session starts with ``hello`` (a peer session with ``peer_hello``, in
``kvcr_node.source``), holds the client's NIXL agent, regions and hints (spec section 5.2),
and ends with ``bye``, a new hello from the same identity, or silence longer than
``client_grace_ms`` (liveness). Ending a session aborts what it still waits for and
releases its handles; a closed peer session whose writes still run is ``retired``: it
stays answerable to probes until they end.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvcr_node.agents import AgentUse, RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters
from kvcr_node.leases import Leases
from kvcr_node.operations import Operations
from kvcr_node.outbox import Outbox
from kvcr_node.records import Session
from kvcr_node.store import Store
from kvcr_node.target import Target
from kvcr_node.transfers import Transfers
from kvcr_protocol import (
    Abort,
    Ack,
    Bye,
    CapacityEvent,
    DiscardHint,
    ErrorCode,
    Heartbeat,
    Hello,
    PoolInfo,
    ProtocolError,
    Region,
    RegisterRegions,
    Role,
    SubmitHint,
    UnregisterRegions,
    Welcome,
    endpoint_problem,
    negotiate,
)
from kvcr_protocol.session_rules import region_conflict
from kvcr_protocol.versions import GRANTS_VERSION

if TYPE_CHECKING:
    from kvcr_node.puts import Puts

log = logging.getLogger("kvcr.node")

RESUME_TOKEN_BYTES = 16
"""The length of a session's resume token (spec section 5.2): random, drawn per session."""

MAX_ADDRESS = 1 << 64
"""Regions end at or below the top of a 64-bit address space."""


def checked_regions(regions: Sequence[Region]) -> dict[int, Region]:
    """Announced regions by id; raises ``ProtocolError`` naming the first bad one."""
    for i, region in enumerate(regions):
        if region.length == 0 or region.address == 0:
            raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, "a region needs an address and a length", f"regions[{i}]")
        if region.address + region.length > MAX_ADDRESS:
            raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, "the region wraps around the address space", f"regions[{i}].length")
    refused = region_conflict((), [r.region for r in regions])
    if refused is not None:
        raise refused
    return {r.region: r for r in regions}


class Sessions:
    """Every open session by identity, the retired peer sessions, and liveness."""

    def __init__(
        self, config: NodeConfig, store: Store, operations: Operations, target: Target, leases: Leases, agents: RemoteAgents,
        transfers: Transfers, outbox: Outbox, counters: Counters, clock: Callable[[], float],
        versions: Sequence[int], incarnation: int, agent_name: str, pool_info: tuple[PoolInfo, ...],
    ) -> None:
        self.config = config
        self.store = store
        self.operations = operations
        self.target = target
        self.leases = leases
        self.agents = agents
        self.transfers = transfers
        self.outbox = outbox
        self.counters = counters
        self.clock = clock
        self.versions = versions
        self.incarnation = incarnation
        self.agent_name = agent_name
        self.pool_info = pool_info
        self.kept = 0
        """The incarnation whose cache this node took back at its start (``welcome.kept``); 0: none."""
        self.table: dict[bytes, Session] = {}
        """Open sessions by ROUTER identity."""
        self.retired: list[Session] = []
        """Closed peer sessions whose writes are still running."""
        self._next_liveness = 0.0
        self.puts: Puts | None = None
        """The node's puts (spec section 6.13): a session's end quarantines its unfinished ones."""

    def __len__(self) -> int:
        return len(self.table)

    def __iter__(self) -> Iterator[Session]:
        return iter(self.table.values())

    def get(self, identity: bytes) -> Session | None:
        return self.table.get(identity)

    def addressee(self, identity: bytes) -> Session | bytes:
        """Whom a refusal to ``identity`` goes to: its session (at its version), else the bare identity."""
        return self.table.get(identity) or identity

    def clients(self) -> list[Session]:
        return [s for s in self.table.values() if s.role is Role.CLIENT]

    # ------------------------------------------------------------------ opening

    def announce(
        self, to: Session | bytes, request_id: int, agent_md: bytes, regions: Sequence[Region], expect: str = "",
    ) -> tuple[str, dict[int, Region]] | None:
        """Load an announced NIXL agent and check its regions; None after refusing the request.

        ``expect`` names the agent the metadata must be (a session's own, for ``regions``).
        A refused announcement keeps no agent it loaded (unless something else holds it).
        """
        try:
            agent = self.agents.add(agent_md)
        except Exception as exc:
            self.outbox.refuse(to, request_id, ProtocolError(
                ErrorCode.BAD_DESCRIPTOR, f"agent metadata refused by NIXL: {exc}", "agent_md"))
            return None
        try:
            if expect and agent != expect:
                # Another agent's metadata: nothing may ever write through it.
                raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"the metadata is agent {agent!r}'s, the session's agent is "
                                    f"{expect!r}", "agent_md")
            return agent, checked_regions(regions)
        except ProtocolError as exc:
            self.agents.release(agent)
            self.outbox.refuse(to, request_id, exc)
            return None

    def open_session(
        self, identity: bytes, request_id: int, agent_md: bytes, regions: Sequence[Region],
        make: Callable[[str], Session],
    ) -> Session | None:
        """Load the sender's NIXL metadata, make its session and take its regions; None after a refusal."""
        announced = self.announce(self.addressee(identity), request_id, agent_md, regions)
        if announced is None:
            return None
        session = make(announced[0])
        session.last_seen = self.clock()
        session.regions.update(announced[1])
        self.table[identity] = session
        return session

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        # Spec section 5.2: a hello ends the identity's session first, whatever its answer
        # (its sender starts over); a refused one leaves the identity with none, answered at
        # version 1 (section 5.1: the hello's versions are not agreed).
        resumed = self._resumed(msg)
        old = self.table.get(identity)
        if old is not None and old is resumed:
            # The same socket resumes its own session: it ends, its puts freed (below).
            self._end_resumed(old, msg)
            resumed = None
        elif old is not None:
            self.close(old)
        try:
            version = negotiate(self.versions, msg.versions)
        except ProtocolError as exc:
            self.outbox.refuse(identity, msg.id, exc)
            return
        if len(self.clients()) - (resumed is not None) >= self.config.max_clients:
            # The session its token names makes way for it: a reconnect is not one client more.
            self.outbox.refuse(self.addressee(identity), msg.id, ProtocolError(
                ErrorCode.TOO_MANY_CLIENTS, f"this node serves at most {self.config.max_clients} clients"))
            return
        session = self.open_session(
            identity, msg.id, msg.agent_md, msg.regions,
            lambda agent: Session(identity, msg.client, agent, version, msg.agent_md),
        )
        if session is None:
            return
        if resumed is not None and resumed.agent == session.agent and not resumed.closing:
            self._end_resumed(resumed, msg)
        if version >= GRANTS_VERSION:
            session.resume = secrets.token_bytes(RESUME_TOKEN_BYTES)
        self.counters.inc(Count.HELLOS)
        log.info("client %s (agent %s) joined at version %d", msg.client, session.agent, version)
        self.outbox.reply(session, Welcome(
            msg.id, version, self.config.name, self.incarnation, self.agent_name, self.pool_info, self.config.heartbeat_ms,
            session.resume, self.kept if version >= GRANTS_VERSION else 0))

    def _end_resumed(self, session: Session, msg: Hello) -> None:
        """Spec section 5.2: the client's previous session ends now, as bye would, and its puts
        are freed (the token it presented says none of their WRITEs can land any more)."""
        self.counters.inc(Count.SESSIONS_RESUMED)
        log.info("client %s (agent %s) resumed: its previous session ends, %d puts freed", msg.client,
                 session.agent, len(session.puts))
        self.end(session, resumed=True)

    def _resumed(self, msg: Hello) -> Session | None:
        """The live client session of ``msg``'s agent whose resume token ``msg`` presents, or
        None: a token of no session, of another agent's, or guessed ends nothing (counted)."""
        if not msg.resume:
            return None
        for session in self.table.values():
            if session.role is Role.CLIENT and session.resume and session.agent == msg.agent \
                    and hmac.compare_digest(session.resume, msg.resume):
                return session
        self.counters.inc(Count.RESUMES_UNMATCHED)
        return None

    # ------------------------------------------------------------------ regions

    def on_regions(self, session: Session, msg: RegisterRegions) -> None:
        refused = region_conflict(session.held_regions(), [r.region for r in msg.regions])
        if refused is not None:
            # Spec section 5.2: region ids are unique in a session; nothing of it is taken.
            self.outbox.refuse(session, msg.id, refused)
            return
        announced = self.announce(session, msg.id, msg.agent_md, msg.regions, expect=session.agent)
        if announced is None:
            return
        session.regions.update(announced[1])
        session.agent_md = msg.agent_md
        session.regions_version += 1
        self.outbox.reply(session, Ack(msg.id))

    def on_unregions(self, session: Session, msg: UnregisterRegions) -> None:
        records = {rid: region for rid in msg.regions if (region := session.regions.pop(rid, None)) is not None}
        session.regions_version += 1
        if self.target.hold(session, msg.id, msg.regions, records):
            # Spec section 12: a source may still write there (DESTINATION_UNCERTAIN); the
            # ack waits until it cannot. The regions take no new work meanwhile.
            return
        self.outbox.reply(session, Ack(msg.id))

    def on_abort(self, session: Session, msg: Abort) -> None:
        op = session.ops.get(msg.op)
        if op is None and msg.op in session.withdrawals:
            self.outbox.reply(session, Ack(msg.id))
            self.target.cancel_withdrawal(session, msg.op)
            return
        if op is None:
            self.outbox.refuse(session, msg.id, ProtocolError(ErrorCode.UNKNOWN_OP, f"operation {msg.op} is not in progress", "op"))
            return
        self.outbox.reply(session, Ack(msg.id))
        self.operations.abort(op)

    # ------------------------------------------------------------------ hints

    def on_hint(self, session: Session, msg: SubmitHint) -> None:
        problem = endpoint_problem(msg.endpoint)
        if problem is not None:
            # Spec section 5.2: only endpoints this node can dial are kept, so that no
            # deliver or fetch ever hands a socket an address it cannot connect to.
            self.outbox.refuse(session, msg.id, ProtocolError(ErrorCode.BAD_ENDPOINT, problem, "endpoint"))
            return
        keys = frozenset(msg.keys)
        old = session.hints.get(msg.request_id)
        limit = self.config.max_hints_per_session
        if old is None and len(session.hints) >= limit:
            # Spec section 5.2: hints are bounded per session; a replacement is not one more.
            self.outbox.refuse(session, msg.id, ProtocolError(
                ErrorCode.HINT_LIMIT,
                f"this session holds {len(session.hints)} hints, the most the node allows (max_hints_per_session); "
                "discard some first", "request_id"))
            return
        total = session.hinted_keys - (len(old[1]) if old is not None else 0) + len(keys)
        if total > self.config.max_hinted_keys_per_session:
            self.outbox.refuse(session, msg.id, ProtocolError(
                ErrorCode.HINT_LIMIT,
                f"this hint would bring the session's hinted keys to {total}, over the "
                f"{self.config.max_hinted_keys_per_session} the node allows (max_hinted_keys_per_session); "
                "discard some first", "keys"))
            return
        session.hints[msg.request_id] = (msg.endpoint, keys)
        session.hinted_keys = total
        self.outbox.reply(session, Ack(msg.id))

    def on_unhint(self, session: Session, msg: DiscardHint) -> None:
        old = session.hints.pop(msg.request_id, None)
        if old is not None:
            session.hinted_keys -= len(old[1])
        self.outbox.reply(session, Ack(msg.id))

    # ------------------------------------------------------------------ liveness and the end

    def on_heartbeat(self, session: Session, msg: Heartbeat) -> None:
        self.outbox.reply(session, Heartbeat(msg.id))

    def on_bye(self, session: Session, msg: Bye) -> None:
        self.outbox.reply(session, Ack(msg.id))
        self.end(session)

    def end(self, session: Session, resumed: bool = False) -> None:
        """Close a session that ends (bye, silence, its client resuming: ``resumed``); a
        peer's running writes stay answerable to probes."""
        self.close(session, resumed)
        if session.ops and session.role is Role.PEER:
            # Only peer sessions retire (probes look there); a client's ops hold their session.
            self.retired.append(session)

    def close(self, session: Session, resumed: bool = False) -> None:
        """Abort what can be aborted and release the session's handle claims and agents.

        Operations with a transfer in flight keep their claims until it is terminal. A
        session whose client resumed (``resumed``) has its puts freed, not quarantined.
        """
        session.closing = True
        session.forget_hints()  # spec section 5.2: hints end with their session
        self.leases.end_session_leases(session)  # spec section 6.11: and so do leases
        self.target.drop_withdrawals(session)  # held unregions end unanswered with the session
        self.operations.end_session(session)
        if self.table.get(session.identity) is session:
            del self.table[session.identity]
        if resumed and self.puts is not None:
            self.puts.free_session_puts(session)
        if self.puts is not None and self.puts.end_session_puts(session):
            # Its unfinished puts wait for its agent's removal (spec section 6.13).
            self.agents.forget(session.agent)
        else:
            self.agents.release(session.agent)
        if session.peer is None:
            # Sources forget it too: told so at version 5 (peer_forget, once none of its
            # writes may run), else in time (max_peer_clients); announce it afresh if it returns.
            self.target.links.forget_client(session.agent)
        else:
            # The agents its target announced go with it (spec section 5.3, bye).
            announced = list(session.peer.clients)
            session.peer.clients.clear()
            for agent in announced:
                self.agents.release(agent)

    def check_liveness(self, now: float) -> None:
        """Drop sessions silent for longer than the grace period (spec section 12: no leaks)."""
        if not self.config.heartbeat_ms:
            return  # heartbeats off: clients send none, so silence means nothing (spec section 5.2)
        if now < self._next_liveness:
            return
        self._next_liveness = now + min(self.config.heartbeat_ms, self.config.client_grace_ms) / 1000
        if self.agents.pending:
            self.agents.release_pending()
        grace = self.config.client_grace_ms / 1000
        for session in [s for s in self.table.values() if now - s.last_seen > grace]:
            peer = session.role is Role.PEER
            self.counters.inc(Count.PEERS_EXPIRED if peer else Count.CLIENTS_EXPIRED)
            log.warning("%s %s silent for %.1f s: dropping its session", "peer" if peer else "client",
                        session.name, now - session.last_seen)
            self.end(session)

    def next_wakeup(self) -> float | None:
        """When ``check_liveness`` has something to do next (None: never while nobody is here)."""
        return self._next_liveness if self.table and self.config.heartbeat_ms else None

    def flush_capacity_events(self) -> None:
        """Tell every client about each pool whose reclaimable slots fell under the low watermark."""
        for pool in self.store.take_capacity_events():
            stats = self.store.pool_stats()[pool]
            self.counters.inc(Count.CAPACITY_EVENTS)
            for session in self.clients():
                session.events += 1
                self.outbox.reply(session, CapacityEvent(session.events, pool, stats["free"] + stats["evictable"], stats["total"]))

    # ------------------------------------------------------------------ remote agents

    def agent_use(self, name: str) -> AgentUse | None:
        """Who still needs the remote agent ``name`` (``RemoteAgents`` asks before letting go)."""
        running = False
        for session in self.table.values():
            if session.agent == name:
                return AgentUse.HELD
            if session.peer is not None:
                if name in session.peer.clients:
                    return AgentUse.HELD
                running = running or any(op.agent == name for op in session.ops.values())
        if any(link.agent == name for link in self.target.links):
            return AgentUse.HELD
        if running or any(t.agent == name for t in self.transfers.inflight):
            return AgentUse.RUNNING
        return None
