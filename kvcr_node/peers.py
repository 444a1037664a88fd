"""The records of cross-node delivery on the target side: a link and a write, their states,
and what ``kvcr_node.links`` reports to the parts above it (``LinkOwner``, ``LeaseOwner``).

A link is one DEALER socket from this node to a peer's ROUTER, with the peer session it
carries (spec section 12): hello, version agreement, the peer's incarnation and agent. Writes
wait in the link's queue until the session is up. ``kvcr_node.links`` drives them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from kvcr_node.records import Operation, Session
from kvcr_node.store import ObjectEntry
from kvcr_protocol import DeliverColumns, DeliverItem, ErrorCode, KeyResult, LeaseEnded, Message, Progress, WriteNotify


class LinkState(enum.Enum):
    """Where a link's peer session stands."""

    CONNECTING = "connecting"
    """``peer_hello`` sent, no ``peer_welcome`` yet."""
    READY = "ready"
    DOWN = "down"
    """Disconnected since ``down_since``; ZeroMQ reconnects, and a reconnect says hello again."""


class WriteStage(enum.Enum):
    """Where a write request to a source stands (spec section 12)."""

    QUEUED = "queued"
    """Waiting for the link's session; not sent."""
    SENT = "sent"
    UNCERTAIN = "uncertain"
    """The deadline passed unanswered: the keys failed, the destination stays reserved."""
    DONE = "done"
    """Over: no transfer of it can touch the destination any more."""


@dataclass(eq=False)
class RemoteWrite:
    """One write request to a source node, on behalf of a deliver or a fetch."""

    link: PeerLink
    id: int
    op: Operation
    indices: list[int]
    """The operation's items this write carries, in order."""
    items: tuple[DeliverItem, ...]
    agent: str
    """Whose memory the source writes into: the client's agent, or ours for a fetch."""
    client: Session | None
    """The client whose metadata and regions the source needs first (None for a fetch)."""
    partial: bool
    deadline: float
    fills: list[ObjectEntry] | None = None
    """For a fetch: the WRITING entries the source fills, one per item."""
    state: WriteStage = WriteStage.QUEUED
    """queued (not sent), sent, uncertain (deadline passed, may still be written), done."""
    next_probe: float = 0.0
    probe_id: int = 0
    """Its latest probe (only the latest is kept in ``PeerLink.probes``)."""
    retried: bool = False
    """Sent a second time after the source refused it for an agent it had forgotten."""
    columns: tuple[DeliverColumns, ...] = ()
    """Version 3: the items as the client's column blocks, rows cut out as they came (then
    ``items`` is empty); sent as records to a source below version 3."""
    notify: WriteNotify | None = None
    """Version 3: how the source notifies the client of each group (spec section 6.10)."""
    done: Sequence[int] = ()
    """Version 3: the source's ``write_done.done``, per item (set when it answers)."""
    regions: frozenset[int] = frozenset()
    """The client's region ids the destination names (reserved while the write may run)."""

    def records(self) -> tuple[DeliverItem, ...]:
        """The items as records (for a source below version 3: no plan travels)."""
        if not self.columns:
            return self.items
        return tuple(item for block in self.columns for item in block.to_items())


@dataclass(eq=False)
class Ask:
    """A request on behalf of leases (``lease``, ``renew``, ``unlease``) to a source (``Links.ask``)."""

    build: Callable[[int], Message] | None
    """Makes the message for an id (dropped once sent: it holds the request's keys)."""
    answer: Answer
    deadline: float
    """When it answers None (PEER_UNREACHABLE) if the source has not answered, sent or not."""
    incarnation: int = 0
    """The source incarnation it is meant for (it names that incarnation's lease ids); 0: any."""
    size: int = 0
    """Bytes of its frame once sent (``PeerLink.ask_bytes``)."""
    grants: bool = False
    """A ``lease``: a late answer may hold keys, which are then released."""


@dataclass(eq=False)
class PeerLink:
    """Our connection to one source node."""

    endpoint: str
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    state: LinkState = LinkState.CONNECTING
    """connecting (hello sent), ready, down (disconnected since ``down_since``)."""
    hello_id: int = 0
    version: int = 0
    incarnation: int = 0
    node: str = ""
    agent: str = ""
    down_since: float | None = None
    writes: dict[int, RemoteWrite] = field(default_factory=dict)
    """Writes sent or uncertain, by id."""
    queued: list[RemoteWrite] = field(default_factory=list)
    clients_sent: dict[str, int] = field(default_factory=dict)
    """Client agent -> the regions version the peer has (or is being sent); live clients only."""
    announcing: dict[int, str] = field(default_factory=dict)
    """peer_client messages not yet answered: id -> client agent."""
    forgets: set[str] = field(default_factory=set)
    """Agents of clients that left and that the peer may know: ``peer_forget`` goes (version 5)
    once the session is up and no write for them on it may still run (spec section 5.3)."""
    probes: dict[int, RemoteWrite] = field(default_factory=dict)
    """Probe id -> the uncertain write it asks about (one per write: its latest)."""
    next_heartbeat: float = 0.0
    """When to tell the peer we are alive (it drops sessions silent for its client grace)."""
    asks: dict[int, Ask] = field(default_factory=dict)
    """Lease requests sent and not yet answered, by id (``Links.ask``)."""
    asks_queued: list[Ask] = field(default_factory=list)
    """Lease requests waiting for the session."""
    abandoned: dict[int, tuple[int, bool]] = field(default_factory=dict)
    """Lease requests given up unanswered (past their deadline) on this connection: id ->
    (their frame's bytes, whether a late answer may hold keys). Their bytes may still sit in
    the socket's queue to a source that does not read, so they count in ``ask_bytes`` until
    their late answer or the connection's end."""
    ask_bytes: int = 0
    """Bytes of the frames of ``asks`` and ``abandoned`` (bounded: ``ASK_BYTES_PER_LINK``)."""
    leases: set[int] = field(default_factory=set)
    """The source's lease ids it holds for this node (the link stays open while it does)."""
    last_used: float = field(default_factory=time.monotonic)
    """When a write last started or ended on it (idle links close, spec section 5.3)."""
    closed: bool = False
    token: bytes = b""
    """Our token for this link, as our ``peer_hello`` said it (``peer_hello.link``)."""
    twins: bytes = b""
    """The proofs of the source's latest ``peer_welcome`` (version 5, spec section 5.3 "Twin
    links"): which of our other links reached it before this one."""
    aliases: set[str] = field(default_factory=set)
    """Other spellings of the source's endpoint whose requests go through this link."""
    twin: PeerLink | None = None
    """The link of the same source that this one is to fold into, once it holds no lease."""
    draining: bool = False
    """Folded into its twin: takes no new request, serves what was sent on it, then closes."""

    @property
    def busy(self) -> bool:
        """Whether a write is sent, queued or uncertain on it (or probed), or a lease is asked
        for or held through it: it must stay open."""
        return bool(self.writes or self.queued or self.probes or self.asks or self.asks_queued or self.leases)

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (after up to ``linger_ms`` to deliver what was sent) and the monitor."""
        self.closed = True
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.sock.close(linger_ms)
        self.monitor.close(0)

    @property
    def fds(self) -> tuple[Any, ...]:
        return (self.sock, self.monitor)


# ---------------------------------------------------------------- what links report upward


class LinkOwner(Protocol):
    """What ``Links`` reports upward: the node owns the operations its writes serve."""

    def write_over(
        self, write: RemoteWrite, code: ErrorCode | None, reason: str, results: Sequence[KeyResult], was_uncertain: bool
    ) -> None:
        """No transfer of ``write`` can touch its destination any more (code None: ``results`` say how it went)."""

    def write_uncertain(self, write: RemoteWrite) -> None:
        """``write``'s deadline passed unanswered: its keys fail, its destination stays reserved."""

    def write_progress(self, write: RemoteWrite, msg: Progress) -> None:
        """A version-3 source reports groups of ``write``'s items delivered so far."""

    def internal_failure(self, what: str, exc: BaseException) -> None:
        """Handling a source's message raised (counted and logged by the owner)."""


class LeaseOwner(Protocol):
    """Who holds the leases asked for through links (``kvcr_node.leases``)."""

    def source_lease_ended(self, link: PeerLink, msg: LeaseEnded) -> None:
        """The source ended one of the leases it holds for us."""

    def source_lost(self, link: PeerLink, code: ErrorCode) -> None:
        """The source restarted (``PEER_RESTARTED``), its link stayed down past ``peer_dead_ms``
        or its session cannot be had again (``PEER_UNREACHABLE``): it holds no lease for us any more."""

    def source_resumed(self, link: PeerLink) -> None:
        """The link to the source is back, to the same incarnation: the leases it held for us
        may go on (spec section 6.11); the owner checks them."""


Answer = Callable[[Message | None, ErrorCode | None], None]
"""Takes a source's reply to a request sent by ``Links.ask``, or None and why none came."""
