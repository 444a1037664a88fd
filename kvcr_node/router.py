"""Requests in: decode each frame, hand it to the part of the node that owns it, refuse the rest.

One frame from the ROUTER socket is decoded at its sender's version (spec section 4),
checked against the sender's standing by the protocol's session rules
(``kvcr_protocol.session_rules``: hello first; client and peer requests differ; a stopping
node takes only what ends things) and dispatched by type through the handler table of
the session's role. Nothing raised while handling one message stops the node: the request is
answered ``INTERNAL`` (or its operation's remaining items are, spec section 5.1), and
the failure is counted and logged (architecture §4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from kvcr_node.leases import Leases
from kvcr_node.operations import Failure, Operations
from kvcr_node.ops.deliver import Deliveries
from kvcr_node.ops.deposit import Deposits
from kvcr_node.ops.fetch import Fetches
from kvcr_node.ops.query import Queries
from kvcr_node.outbox import Outbox
from kvcr_node.puts import Puts
from kvcr_node.records import Operation, Session
from kvcr_node.sessions import Sessions
from kvcr_node.source import Source
from kvcr_node.stats import Stats
from kvcr_node.suspects import Suspects
from kvcr_protocol import (
    Abort,
    Bye,
    Commit,
    Deliver,
    Deposit,
    DiscardHint,
    ErrorCode,
    Fetch,
    Heartbeat,
    Hello,
    Lease,
    Limits,
    Message,
    PeerClient,
    PeerForget,
    PeerHello,
    Probe,
    ProtocolError,
    Put,
    Query,
    RegisterRegions,
    Release,
    ReleaseLease,
    RemoteProtocolError,
    RenewLease,
    Role,
    SessionState,
    StatsRequest,
    SubmitHint,
    Suspect,
    Unput,
    UnregisterRegions,
    WriteRequest,
    decode,
    peek_id,
    session_rules,
)

M = TypeVar("M", bound=Message)
To = TypeVar("To")

class Handlers(dict[type[Message], Callable[[To, Message], None]]):
    """Message type -> the handler of that type, taking whom it is from (a session or an identity)."""

    def add(self, kind: type[M], handler: Callable[[To, M], None]) -> Handlers[To]:
        """Register ``handler`` for ``kind``; the type checker holds the handler to that kind."""
        self[kind] = cast(Callable[[To, Message], None], handler)
        return self


class Router:
    """Decodes and dispatches every frame; owns the handler tables and whether the node is stopping."""

    def __init__(
        self, sessions: Sessions, operations: Operations, deposits: Deposits, deliveries: Deliveries,
        fetches: Fetches, queries: Queries, leases: Leases, source: Source, stats: Stats, outbox: Outbox,
        versions: Sequence[int], limits: Limits, clock: Callable[[], float], failure: Failure, puts: Puts,
        suspects: Suspects,
    ) -> None:
        self.sessions = sessions
        self.operations = operations
        self.outbox = outbox
        self.versions = versions
        self.limits = limits
        self.clock = clock
        self.failure = failure
        self.stopping = False
        """Set at shutdown: new sessions and new work are refused SHUTTING_DOWN."""
        self.hellos = Handlers[bytes]().add(Hello, sessions.on_hello).add(PeerHello, source.on_peer_hello)

        def either(table: Handlers[Session]) -> Handlers[Session]:
            """What clients and peers alike may send."""
            return (
                table.add(StatsRequest, stats.on_stats).add(Heartbeat, sessions.on_heartbeat).add(Bye, sessions.on_bye)
                .add(Lease, leases.on_lease).add(RenewLease, leases.on_renew).add(ReleaseLease, leases.on_unlease)
            )

        client_handlers = either(
            Handlers[Session]()
            .add(RegisterRegions, sessions.on_regions)
            .add(UnregisterRegions, sessions.on_unregions)
            .add(Deposit, deposits.on_deposit)
            .add(Query, queries.on_query)
            .add(Deliver, deliveries.on_deliver)
            .add(Fetch, fetches.on_fetch)
            .add(Release, operations.on_release)
            .add(Abort, sessions.on_abort)
            .add(SubmitHint, sessions.on_hint)
            .add(DiscardHint, sessions.on_unhint)
            .add(Put, puts.on_put)
            .add(Commit, puts.on_commit)
            .add(Unput, puts.on_unput)
            .add(Suspect, suspects.on_suspect)
        )
        peer_handlers = either(
            Handlers[Session]()
            .add(PeerClient, source.on_peer_client)
            .add(WriteRequest, source.on_write)
            .add(Probe, source.on_probe)
            .add(PeerForget, source.on_peer_forget)
            .add(Suspect, suspects.on_suspect)
        )
        self.handlers: dict[Role, Handlers[Session]] = {Role.CLIENT: client_handlers, Role.PEER: peer_handlers}
        """The handler table of each role's requests (what each may send: the session rules)."""

    def receive(self, frames: list[bytes]) -> None:
        """Handle one multipart message from the ROUTER socket; whatever happens, it is answered."""
        self.outbox.begin()
        try:
            self._handle(frames)
        except Exception as exc:
            # Hello, decoding or the guard itself failed: the sender still gets an answer.
            self._message_failed(frames, exc)
        finally:
            self.outbox.request = None

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        session = self.sessions.get(identity)
        if len(frames) != 2:
            self.outbox.refuse(session or identity, 0, ProtocolError(
                ErrorCode.MALFORMED, f"expected 1 payload frame, got {len(frames) - 1}"))
            return
        payload = frames[1]
        if session is not None:
            session.last_seen = self.clock()
        try:
            msg = decode(payload, session.version if session else self.versions[-1], self.limits)
        except RemoteProtocolError as exc:
            self.outbox.refuse(session or identity, peek_id(payload), exc)
            return
        msg_id: int = getattr(msg, "id", 0)
        self.outbox.request = (identity, msg_id, msg.TAG)
        if session is None:
            refused = session_rules.refusal(None, SessionState.IDLE, msg.TAG, stopping=self.stopping)
        else:
            refused = session_rules.refusal(session.role, SessionState.OPEN, msg.TAG, stopping=self.stopping)
        if refused is not None:
            # A refused hello travels at version 1 whatever session its identity has (spec
            # section 5.1; ``Outbox.refuse`` asks the rules for the version).
            self.outbox.refuse(session or identity, msg_id, refused)
            return
        hello = self.hellos.get(type(msg))
        if hello is not None:
            hello(identity, msg)
            return
        assert session is not None  # the rules refuse every other message without a session
        handler = self.handlers[session.role][type(msg)]
        before = session.ops.get(msg_id)
        try:
            handler(session, msg)
        except Exception as exc:
            self._handler_failed(session, msg, before, exc)

    def _handler_failed(self, session: Session, msg: Message, before: Operation | None, exc: Exception) -> None:
        """One message's handler raised: fail that message ``INTERNAL``, release what it set aside.

        An operation it registered is broken: its items that no transfer or remote write
        covers fail ``INTERNAL`` once nothing of it runs (spec section 5.1); without one, the
        request gets an ``error`` reply with its id unless it was answered already.
        """
        self.failure(msg.TAG, exc)
        msg_id: int = getattr(msg, "id", 0)
        reason = f"the node failed while handling {msg.TAG}: {type(exc).__name__}: {exc}"
        op = session.ops.get(msg_id)
        if op is not None and op is not before:
            self.operations.break_op(op, reason)
        elif not self.outbox.answered:
            self.outbox.refuse(session, msg_id, ProtocolError(ErrorCode.INTERNAL, reason))

    def _message_failed(self, frames: list[bytes], exc: Exception) -> None:
        self.failure("message", exc)
        if not self.outbox.answered and frames:
            request_id = peek_id(frames[-1]) if len(frames) == 2 else 0
            reason = f"the node failed while handling the message: {type(exc).__name__}: {exc}"
            try:
                self.outbox.refuse(self.sessions.addressee(frames[0]), request_id, ProtocolError(ErrorCode.INTERNAL, reason))
            except Exception as again:
                self.failure("error reply", again)
