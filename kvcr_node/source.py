"""The source side of cross-node delivery (spec sections 5.3 and 12): what a target node asks of us.

A target opens a peer session (``peer_hello``), announces the clients it writes for
(``peer_client``, bounded by ``max_peer_clients``), asks for writes of objects stored here
into a client's memory or its own pools (``write``, served by ``kvcr_node.ops.deliver``),
asks whether a write whose deadline passed is over (``probe``), and (version 5) says when
an announced client left (``peer_forget``). A write whose objects
are all READY is claimed and its WRITE submitted in the turn that decoded it
(architecture §4); ``write_done`` goes back when the transfer is terminal.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence

from kvcr_node import logs
from kvcr_node.agents import RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters, ProtocolErrors
from kvcr_node.operations import Operations
from kvcr_node.ops.deliver import Deliveries
from kvcr_node.outbox import Outbox
from kvcr_node.records import Operation, OpKind, PeerState, Plan, Session
from kvcr_node.sessions import Sessions
from kvcr_node.wanted import Wanted
from kvcr_protocol import (
    Ack,
    ErrorCode,
    KeyResult,
    PeerClient,
    PeerForget,
    PeerHello,
    PeerWelcome,
    Probe,
    ProbeReply,
    ProtocolError,
    Refuse,
    WriteDone,
    WriteRequest,
    WriteState,
    negotiate,
)
from kvcr_protocol.twins import twin_proofs
from kvcr_protocol.versions import GRANTS_VERSION, LEASES_VERSION

log = logging.getLogger("kvcr.node")

SubmitWrite = Callable[[Callable[[], None]], None]
"""Where a peer write's submission goes when it is not made at once: handed the call that
claims the READY keys and submits the WRITE, it runs it when it chooses. The product has
none (architecture §4: submitted in the turn that decoded the request); a measurement
passes one to ``Node`` (``bench/deferred_source.py`` holds it to the end of the turn)."""


class Source:
    """Peer sessions' requests: hello, announced clients, writes and probes."""

    def __init__(
        self, config: NodeConfig, sessions: Sessions, operations: Operations, deliveries: Deliveries,
        agents: RemoteAgents, outbox: Outbox, counters: Counters,
        protocol_errors: ProtocolErrors, versions: Sequence[int], incarnation: int,
        agent_name: str, metadata: Callable[[], bytes], *, submit_write: SubmitWrite | None = None,
    ) -> None:
        self.config = config
        self.sessions = sessions
        self.operations = operations
        self.deliveries = deliveries
        self.agents = agents
        self.outbox = outbox
        self.counters = counters
        self.protocol_errors = protocol_errors
        self.versions = versions
        self.incarnation = incarnation
        self.agent_name = agent_name
        self.metadata = metadata
        """Our agent's NIXL metadata (sent in ``peer_welcome``)."""
        self.submit_write = submit_write
        """Given each READY write's submission instead of making it at once (measurement only)."""

    def on_peer_hello(self, identity: bytes, msg: PeerHello) -> None:
        # A reconnecting target opens a new session (a new identity); its old sessions
        # retire: their writes run to the end and stay answerable to probes. The leases of
        # the same target process (its incarnation) go on in the new session (spec section 6.11).
        # As for a client's hello (spec section 5.2), they end whatever the answer; a refusal
        # travels at version 1 (section 5.1).
        # A session of the same target's link: the same incarnation and the same link token,
        # which only that target knows (spec section 5.3). Knowing an incarnation (stats show
        # it) takes nobody's session over; two spellings of our endpoint are two links.
        olds = [s for s in self.sessions if s.identity == identity or (
            s.peer is not None and s.peer.incarnation == msg.incarnation and hmac.compare_digest(s.peer.link, msg.link))]
        refused: ProtocolError | None = None
        try:
            version = negotiate(self.versions, msg.versions)
        except ProtocolError as exc:
            version, refused = 0, exc
        session = None if refused is not None else self.sessions.open_session(
            identity, msg.id, msg.agent_md, msg.regions,
            lambda agent: Session(identity, msg.node, agent, version, msg.agent_md,
                                  peer=PeerState(msg.incarnation, msg.link)),
        )
        for old in olds:
            if (session is not None and old.peer is not None and old.peer.incarnation == msg.incarnation
                    and hmac.compare_digest(old.peer.link, msg.link) and version >= LEASES_VERSION):
                self.sessions.leases.carry_over(old, session)
            self.sessions.close(old)
            if old.ops:
                self.sessions.retired.append(old)
        if refused is not None:
            self.outbox.refuse(identity, msg.id, refused)
        if session is None:
            return
        self.counters.inc(Count.PEER_HELLOS)
        log.info("peer %s (incarnation %x) joined at version %d", msg.node, msg.incarnation, version)
        twins = b""
        if version >= GRANTS_VERSION:
            # Spec section 5.3, "Twin links": prove to the target which of its other links
            # reach us too (only we received their tokens), so that it keeps one of them.
            twins = twin_proofs((s.peer.link for s in self.sessions if s is not session and s.peer is not None
                                 and s.peer.incarnation == msg.incarnation), msg.link)
        self.outbox.reply(session, PeerWelcome(
            msg.id, version, self.config.name, self.incarnation, self.agent_name, self.metadata(), twins))

    def on_peer_client(self, peer: Session, msg: PeerClient) -> None:
        announced = self.sessions.announce(peer, msg.id, msg.agent_md, msg.regions)
        if announced is None:
            return
        agent, regions = announced
        clients = peer.as_peer().clients
        clients[agent] = regions
        clients.move_to_end(agent)
        self._bound_peer_clients(peer)
        self.outbox.reply(peer, Ack(msg.id))

    def on_peer_forget(self, peer: Session, msg: PeerForget) -> None:
        """The target's client left (spec section 5.3, version 5): forget it in this peer
        session only, as if never announced. Its agent goes once nothing names it (a
        running write keeps the regions it was accepted with and runs to the end). An agent
        this session does not hold changes nothing: forgetting is idempotent, answered ack."""
        if peer.as_peer().clients.pop(msg.agent, None) is None:
            # Never announced here, forgotten or evicted already, or another session's client.
            self.counters.inc(Count.PEER_FORGETS_UNKNOWN)
        else:
            self.counters.inc(Count.PEER_CLIENTS_FORGOTTEN)
            self.agents.forget(msg.agent)
        self.outbox.reply(peer, Ack(msg.id))

    def _bound_peer_clients(self, peer: Session) -> None:
        """Forget the least recently used announced clients beyond ``max_peer_clients`` (spec
        section 5.3), except those a running write of this peer names: that table is then
        over the bound by at most the peer's operations in progress (``max_pending``)."""
        clients = peer.as_peer().clients
        excess = len(clients) - self.config.max_peer_clients
        if excess <= 0:
            return
        running = {op.agent for op in peer.ops.values()}
        for agent in [a for a in clients if a not in running][:excess]:
            del clients[agent]
            self.counters.inc(Count.PEER_CLIENTS_EVICTED)
            self.agents.release(agent)

    def on_write(self, peer: Session, msg: WriteRequest) -> None:
        clients = peer.as_peer().clients
        regions = peer.regions if msg.agent == peer.agent else clients.get(msg.agent)
        if regions is not None and msg.agent != peer.agent:
            clients.move_to_end(msg.agent)
        if regions is None:
            self.protocol_errors.inc(ErrorCode.BAD_STATE)
            refused = ProtocolError(ErrorCode.BAD_STATE, f"agent {msg.agent!r} was not announced (peer_client first)")
            logs.refusal("write", msg.id, refused, peer.name, peer.identity, True)
            self.outbox.reply(peer, Refuse(msg.id, refused.code, refused.reason))
            return
        wanted = Wanted(msg.items, msg.columns)
        notify = msg.notify

        def resume(op: Operation, indices: list[int]) -> None:
            self.counters.inc(Count.WRITES_DEFERRED, len(indices))
            self.deliveries.deliver_ready(indices, op, wanted)

        op = self.operations.admit(
            peer, msg.id, OpKind.WRITE, len(wanted), msg.deadline_ms, agent=msg.agent, regions=regions,
            exact=not msg.partial,
            # Spec section 6.10: the payloads name the client's deliver and its item indices.
            plan=Plan(wanted.group_counts(), wanted.planned,
                      notify=None if notify is None else (notify.token, notify.request, notify.item_indices())),
            resume=resume, report=lambda op, results: self.write_settled(peer, op, results),
        )
        if op is None:
            return
        # A source never forwards: request_id None names no hint.
        ready, _ = self.operations.sort_items(op, wanted.keys, None)
        if ready and self.submit_write is not None:
            self.counters.inc(Count.WRITES_DEFERRED)
            self.submit_write(lambda: self.deliveries.deliver_ready(ready, op, wanted))
            return
        if ready:
            # architecture §4: claims taken and the WRITE submitted in the turn that decoded the request.
            self.counters.inc(Count.WRITES_INLINE)
        self.deliveries.deliver_ready(ready, op, wanted)

    def write_settled(self, peer: Session, op: Operation, results: tuple[KeyResult, ...]) -> None:
        """A write is over here: remember it for probes, and answer ``write_done`` while the session lasts."""
        peer.as_peer().remember_done(op.id)
        if not peer.closing:
            self.outbox.reply(peer, WriteDone(op.id, results, op.done_column()))
        elif not peer.ops and peer in self.sessions.retired:
            self.sessions.retired.remove(peer)

    def on_probe(self, peer: Session, msg: Probe) -> None:
        # Write ids are unique per target incarnation: look through every session of it,
        # retired ones included (a write from before a reconnect may still be running).
        state = WriteState.UNKNOWN
        incarnation = peer.as_peer().incarnation
        for session in [*self.sessions, *self.sessions.retired]:
            if session.peer is None or session.peer.incarnation != incarnation:
                continue
            op = session.ops.get(msg.op)
            if op is not None and op.kind is OpKind.WRITE:
                state = WriteState.IN_FLIGHT if op.transfers else WriteState.WAITING
                break
            if msg.op in session.peer.done:
                state = WriteState.DONE
                break
        self.outbox.reply(peer, ProbeReply(msg.id, msg.op, state, self.incarnation))
