"""Requests in: decode each frame, hand it to the part of the node that owns it, refuse the rest.

One frame from the ROUTER socket is decoded at its sender's version (spec section 4),
checked against the sender's standing (hello first; client and peer requests differ; a
stopping node takes only what ends things) and dispatched by type through a handler
table. Nothing raised while handling one message stops the node: the request is
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
from kvcr_node.records import ClientSession, Operation, PeerSession
from kvcr_node.sessions import Sessions
from kvcr_node.source import Source
from kvcr_node.stats import Stats
from kvcr_protocol import (
    Abort,
    Bye,
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
    Query,
    RegisterRegions,
    Release,
    ReleaseLease,
    RemoteProtocolError,
    RenewLease,
    StatsRequest,
    SubmitHint,
    UnregisterRegions,
    WriteRequest,
    decode,
    peek_id,
)

M = TypeVar("M", bound=Message)
To = TypeVar("To")
S = TypeVar("S", bound=ClientSession)

WHILE_STOPPING = (Release, ReleaseLease, Bye, Heartbeat, StatsRequest, PeerForget)
"""What a stopping node still serves: requests that end or release things, and stats."""

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
        versions: Sequence[int], limits: Limits, clock: Callable[[], float], failure: Failure,
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

        def either(table: Handlers[S]) -> Handlers[S]:
            """What clients and peers alike may send."""
            return (
                table.add(StatsRequest, stats.on_stats).add(Heartbeat, sessions.on_heartbeat).add(Bye, sessions.on_bye)
                .add(Lease, leases.on_lease).add(RenewLease, leases.on_renew).add(ReleaseLease, leases.on_unlease)
            )

        self.client_handlers = either(
            Handlers[ClientSession]()
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
        )
        self.peer_handlers = either(
            Handlers[PeerSession]()
            .add(PeerClient, source.on_peer_client)
            .add(WriteRequest, source.on_write)
            .add(Probe, source.on_probe)
            .add(PeerForget, source.on_peer_forget)
        )

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
        hello = self.hellos.get(type(msg))
        if hello is not None:
            if self.stopping:
                self.outbox.refuse(self.sessions.addressee(identity), msg_id, ProtocolError(
                    ErrorCode.SHUTTING_DOWN, "the node is stopping"))
                return
            hello(identity, msg)
        elif session is None:
            self.outbox.refuse(identity, msg_id, ProtocolError(ErrorCode.BAD_STATE, "say hello first"))
        elif isinstance(session, PeerSession):
            self._dispatch(session, msg, self.peer_handlers.get(type(msg)), "a peer")
        else:
            self._dispatch(session, msg, self.client_handlers.get(type(msg)), "a client")

    def _dispatch(self, session: S, msg: Message, handler: Callable[[S, Message], None] | None, what: str) -> None:
        msg_id: int = getattr(msg, "id", 0)
        if handler is None:
            self.outbox.refuse(session, msg_id, ProtocolError(ErrorCode.BAD_STATE, f"{msg.TAG} is not {what} request"))
            return
        if self.stopping and not isinstance(msg, WHILE_STOPPING):
            self.outbox.refuse(session, msg_id, ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping"))
            return
        before = session.ops.get(msg_id)
        try:
            handler(session, msg)
        except Exception as exc:
            self._handler_failed(session, msg, before, exc)

    def _handler_failed(self, session: ClientSession, msg: Message, before: Operation | None, exc: Exception) -> None:
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
