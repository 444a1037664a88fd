"""Typed, frozen messages of the kvcr protocol, each with an explicit wire tag.

The tables here are the protocol: each message class lists its fields in wire order
(``FIELDS``) and names its tag (``TAG``). Renaming a class never changes its tag. The
written form of the same tables is ``spec/kvcr-protocol.md``.

Schema evolution rules: new fields get defaults and a ``since`` version; a field's type
never changes; fields are deprecated, never deleted. A field whose key begins with ``!``
is must-understand: a receiver that does not know it refuses the message.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from kvcr_protocol.columns import (
    PREFIX_ALL,
    U32,
    DeliverColumns,
    DepositColumns,
    QueryColumns,
    unpack,
)
from kvcr_protocol.declare import F_CODE as _F_CODE
from kvcr_protocol.declare import F_PARENTS as _F_PARENTS
from kvcr_protocol.declare import F_REASON as _F_REASON
from kvcr_protocol.declare import F_REQUEST_ID as _F_REQUEST_ID
from kvcr_protocol.declare import Message as Message
from kvcr_protocol.declare import _check_items, _fields, check_parents, message, message_keys
from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.integrity import INTEGRITY_MESSAGES
from kvcr_protocol.leases import Lease, LeaseEnded, LeaseReply, ReleaseLease, RenewLease
from kvcr_protocol.limits import Limits
from kvcr_protocol.notify import WriteNotify
from kvcr_protocol.puts import PUT_MESSAGES
from kvcr_protocol.records import *  # noqa: F403 - messages re-export the records they carry
from kvcr_protocol.records import KEYS as _KEYS
from kvcr_protocol.records import NAME as _NAME
from kvcr_protocol.records import REGIONS as _REGIONS
from kvcr_protocol.records import TEXT as _TEXT
from kvcr_protocol.records import U32_MAX as _U32
from kvcr_protocol.records import VERSIONS as _VERSIONS
from kvcr_protocol.records import (
    DeliverItem,
    DepositItem,
    FetchItem,
    KeyResult,
    PoolInfo,
    QueryResult,
    Region,
    WriteState,
)
from kvcr_protocol.versions import AUDIT_VERSION
from kvcr_protocol.wire import AnyMap, Bool, Bytes, EnumStr, Field, Opt, Packed, RecordType, Seq, UInt

# ------------------------------------------------------------------------ messages


# Fields that several messages share, declared once.
_F_VERSIONS = Field("versions", _VERSIONS)
_F_INCARNATION = Field("incarnation", UInt())
_F_AGENT = Field("agent", _NAME)
_F_AGENT_MD = Field("agent_md", Bytes("max_metadata"))
_F_REGIONS = Field("regions", _REGIONS)
_F_REGIONS_OPT = Field("regions", _REGIONS, ())
_F_AGREED = Field("version", UInt(0xFFFF))
_F_NODE = Field("node", _NAME)
_F_DEADLINE = Field("deadline_ms", UInt(_U32), 0)
_F_OP = Field("op", UInt())
_F_DONE = Field("done", Packed(4, "max_keys"), b"", since=3)


@dataclass(frozen=True, slots=True)
class _IdOnly(Message):
    """A message whose only field is its ``id``."""

    id: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields()


@dataclass(frozen=True, slots=True)
class _OpRef(Message):
    """A request about an earlier operation ``op``."""

    id: int
    op: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(_F_OP)


@dataclass(frozen=True, slots=True)
class _KeyResults(Message):
    """A reply with one ``KeyResult`` per item of its request, in order.

    ``done`` (version 3) is empty, or a packed u32 column with, per item, how many groups
    of its layer plan were delivered in a row from the first (spec section 6.8).
    """

    id: int
    results: tuple[KeyResult, ...]
    done: bytes = b""
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("results", Seq(RecordType(KeyResult), "max_keys")), _F_DONE)

    def check(self, limits: Limits) -> None:
        if self.done and len(self.done) != 4 * len(self.results):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(self.done) // 4} group counts for {len(self.results)} results", "done"
            )

    def done_counts(self) -> array[int]:
        """Per item, the groups delivered in a row (empty when the reply carries none)."""
        return unpack(self.done, U32)


# ---- client <-> node


@message("hello")
class Hello(Message):
    """Client -> node: open a session. Always encoded at version 1 (``v`` = 1)."""

    id: int
    versions: tuple[int, ...]
    client: str
    agent: str
    agent_md: bytes
    regions: tuple[Region, ...] = ()
    resume: bytes = b""
    """The resume token of this client's previous session with the node (``welcome.resume``;
    spec section 5.2): that session ends at once, its puts freed. Added with version 5; a
    ``hello`` is read by version 1's rules, and a node that does not know it ignores it."""
    FIELDS = _fields(
        _F_VERSIONS, Field("client", _NAME), _F_AGENT, _F_AGENT_MD, _F_REGIONS_OPT,
        Field("resume", Bytes("max_key"), b"", sparse=True),
    )


@message("welcome", reply=True)
class Welcome(Message):
    """Node -> client: the agreed version, the node's identity and its pools."""

    id: int
    version: int
    node: str
    incarnation: int
    agent: str
    pools: tuple[PoolInfo, ...] = ()
    heartbeat_ms: int = 0
    resume: bytes = b""
    """Version 5: this session's resume token, which only the node and this client know; the
    client's next ``hello`` presents it (spec section 5.2)."""
    kept: int = 0
    """The incarnation whose cache this node took back when it started (a restart on a state
    directory, spec section 5.2): what it held is held still, unless evicted since. 0: none."""
    FIELDS = _fields(
        _F_AGREED, _F_NODE, _F_INCARNATION, _F_AGENT,
        Field("pools", Seq(RecordType(PoolInfo), "max_regions"), ()), Field("heartbeat_ms", UInt(_U32), 0),
        Field("resume", Bytes("max_key"), b"", since=5, sparse=True),
        Field("kept", UInt(), 0, since=5, sparse=True),
    )


@message("regions")
class RegisterRegions(Message):
    """Client -> node: new regions, with the agent metadata that now covers them."""

    id: int
    agent_md: bytes
    regions: tuple[Region, ...]
    FIELDS = _fields(_F_AGENT_MD, _F_REGIONS)


@message("unregions")
class UnregisterRegions(Message):
    """Client -> node: regions the client will deregister; the node stops using them."""

    id: int
    regions: tuple[int, ...]
    FIELDS = _fields(Field("regions", Seq(UInt(_U32), "max_regions")))


@message("deposit")
class Deposit(Message):
    """Client -> node: store objects, reading their bytes from client memory."""

    id: int
    items: tuple[DepositItem, ...]
    no_evict: bool = False
    optional: bool = False
    deadline_ms: int = 0
    columns: tuple[DepositColumns, ...] = ()
    parents: tuple[bytes, ...] = ()
    """Each key's parent key in key order, b"" for none (spec section 6.4, "Parents")."""
    FIELDS = _fields(
        Field("items", Seq(RecordType(DepositItem), "max_keys")), Field("no_evict", Bool(), False),
        Field("optional", Bool(), False), _F_DEADLINE,
        Field("columns", Seq(RecordType(DepositColumns), "max_keys"), (), since=3, must_understand=True),
        _F_PARENTS,
    )

    def check(self, limits: Limits) -> None:
        _check_items(self.items, self.columns, limits)
        if self.parents:
            check_parents(message_keys(self.items, self.columns), self.parents)


@message("query")
class Query(Message):
    """Client -> node: where are these keys (advisory)."""

    id: int
    keys: tuple[bytes, ...]
    request_id: str | None = None
    prefix: int = 0
    FIELDS = _fields(Field("keys", _KEYS), _F_REQUEST_ID, Field("prefix", UInt(0xFF), 0, since=3, must_understand=True))

    def check(self, limits: Limits) -> None:
        if self.prefix & ~PREFIX_ALL:
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"prefix mask {self.prefix:#x} sets a bit outside {PREFIX_ALL:#x}", "prefix"
            )


@message("query_reply", reply=True)
class QueryReply(Message):
    """Node -> client: one result per key of the query, in order, as records or (version 3)
    as ``columns``; for a prefix query, one per counted key."""

    id: int
    results: tuple[QueryResult, ...]
    columns: QueryColumns | None = None
    FIELDS = _fields(
        Field("results", Seq(RecordType(QueryResult), "max_keys")),
        Field("columns", Opt(RecordType(QueryColumns)), None, since=3, must_understand=True),
    )

    def check(self, limits: Limits) -> None:
        if self.columns is not None and self.results:
            raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, "results travel as records or as columns, not both", "columns")

    def view(self) -> QueryColumns:
        """The answers as columns, whichever form they travel in."""
        return self.columns if self.columns is not None else QueryColumns.from_results(self.results)


@message("deliver")
class Deliver(Message):
    """Client -> node: put objects' bytes (whole or a named subset) into client memory.

    ``partial`` (version 2) says the span names may select an ordered subset of each
    stored layout. A node projects local objects either way; for an object it must
    fetch from a peer, only a ``partial`` deliver may name a subset, and only a version 2
    peer can serve one.
    """

    id: int
    items: tuple[DeliverItem, ...]
    request_id: str | None = None
    deadline_ms: int = 0
    partial: bool = False
    columns: tuple[DeliverColumns, ...] = ()
    notify: int = 0
    FIELDS = _fields(
        Field("items", Seq(RecordType(DeliverItem), "max_keys")), _F_REQUEST_ID, _F_DEADLINE,
        Field("partial", Bool(), False, since=2),
        Field("columns", Seq(RecordType(DeliverColumns), "max_keys"), (), since=3, must_understand=True),
        Field("notify", UInt(_U32), 0, since=3, must_understand=True),
    )

    def check(self, limits: Limits) -> None:
        _check_items(self.items, self.columns, limits)


@message("fetch")
class Fetch(Message):
    """Client -> node: make objects resident in the node (whole layouts only)."""

    id: int
    items: tuple[FetchItem, ...]
    request_id: str | None = None
    deadline_ms: int = 0
    parents: tuple[bytes, ...] = ()
    """As a deposit's: the parent the fetched objects are stored with."""
    FIELDS = _fields(Field("items", Seq(RecordType(FetchItem), "max_keys")), _F_REQUEST_ID, _F_DEADLINE, _F_PARENTS)

    def check(self, limits: Limits) -> None:
        _check_items(self.items, (), limits)
        if self.parents:
            check_parents(message_keys(self.items, ()), self.parents)


@message("release")
class Release(Message):
    """Client -> node: drop handle claims (from fetch or no_evict deposits)."""

    id: int
    handles: tuple[int, ...]
    FIELDS = _fields(Field("handles", Seq(UInt(), "max_keys")))


@message("abort")
class Abort(_OpRef):
    """Client -> node: abort operation ``op`` (best effort)."""



@message("hint")
class SubmitHint(Message):
    """Client -> node: for ``request_id``, ``keys`` may be held by the node at ``endpoint``."""

    id: int
    request_id: str
    endpoint: str
    keys: tuple[bytes, ...]
    FIELDS = _fields(
        Field("request_id", _TEXT), Field("endpoint", _TEXT), Field("keys", _KEYS),
    )


@message("unhint")
class DiscardHint(Message):
    """Client -> node: forget the hints of ``request_id``."""

    id: int
    request_id: str
    FIELDS = _fields(Field("request_id", _TEXT))


@message("stats")
class StatsRequest(Message):
    """Client -> node: ask for statistics. ``audit`` (version 5, sent only when set): the node
    also runs its accounting check, O(objects), and answers its breaches under ``invariants``
    (spec section 6.4, ``stats``)."""

    id: int
    audit: bool = False
    FIELDS = _fields(Field("audit", Bool(), False, since=AUDIT_VERSION, sparse=True))


@message("stats_reply", reply=True)
class StatsReply(Message):
    """Node -> client: statistics (free-form, not part of the protocol)."""

    id: int
    stats: dict[str, Any]
    FIELDS = _fields(Field("stats", AnyMap()))


@message("complete", reply=True)
class Completion(_KeyResults):
    """Node -> client: one result per item of a deposit, deliver, fetch or release, in order."""



@message("ack", reply=True)
class Ack(_IdOnly):
    """A request without per-key results was accepted and done."""



@message("error", reply=True)
class Error(Message):
    """A request was refused whole. ``id`` is 0 when the request id could not be read."""

    id: int
    code: int
    reason: str = ""
    path: str = ""
    FIELDS = _fields(_F_CODE, _F_REASON, Field("path", _TEXT, ""))


@message("capacity")
class CapacityEvent(Message):
    """Node -> clients: a pool's reclaimable slots fell under its low watermark."""

    id: int
    pool: str
    reclaimable: int
    total: int
    FIELDS = _fields(
        Field("pool", _NAME), Field("reclaimable", UInt()), Field("total", UInt()),
    )


@message("heartbeat")
class Heartbeat(_IdOnly):
    """Client (or target node) -> node: I am alive; ``id`` counts heartbeats. The node answers
    with a heartbeat of the same ``id``, which expects no answer (spec section 5.2)."""



@message("bye")
class Bye(_IdOnly):
    """Client (or target node) -> node: closing; drop this session's handles, hints, leases
    and regions. Answered ``ack`` before the session ends (spec section 5.2)."""



# ---- node <-> node


@message("peer_hello")
class PeerHello(Message):
    """Target node -> source node: open a peer session. Always encoded at version 1."""

    id: int
    versions: tuple[int, ...]
    node: str
    incarnation: int
    agent: str
    agent_md: bytes
    regions: tuple[Region, ...] = ()
    link: bytes = b""
    """The target's token for this link (spec section 5.3): a new peer session replaces an
    old one of the same incarnation only when their tokens are equal."""
    FIELDS = _fields(
        _F_VERSIONS, _F_NODE, _F_INCARNATION, _F_AGENT, _F_AGENT_MD, _F_REGIONS_OPT,
        Field("link", Bytes("max_key"), b""),
    )


@message("peer_welcome", reply=True)
class PeerWelcome(Message):
    """Source -> target: the agreed version and the source's identity."""

    id: int
    version: int
    node: str
    incarnation: int
    agent: str
    agent_md: bytes
    twins: bytes = b""
    """Version 5: one proof per other live peer session of the same target incarnation, that
    the source received both its token and this hello's (``kvcr_protocol.twins``, spec
    section 5.3): the target then uses one link for both."""
    FIELDS = _fields(
        _F_AGREED, _F_NODE, _F_INCARNATION, _F_AGENT, _F_AGENT_MD,
        Field("twins", Bytes("max_key"), b"", since=5, sparse=True),
    )


@message("peer_client")
class PeerClient(Message):
    """Target -> source: a client's agent metadata and regions, so the source can write to it."""

    id: int
    agent: str
    agent_md: bytes
    regions: tuple[Region, ...]
    FIELDS = _fields(_F_AGENT, _F_AGENT_MD, _F_REGIONS)


@message("write")
class WriteRequest(Message):
    """Target -> source: write these keys from your pool into ``agent``'s memory.

    ``partial`` (wire key ``!partial``, version 2) says the span names select an ordered
    subset of each stored layout; it is must-understand.
    """

    id: int
    agent: str
    items: tuple[DeliverItem, ...]
    deadline_ms: int = 0
    partial: bool = False
    columns: tuple[DeliverColumns, ...] = ()
    notify: WriteNotify | None = None
    FIELDS = _fields(
        _F_AGENT, Field("items", Seq(RecordType(DeliverItem), "max_keys")), _F_DEADLINE,
        Field("partial", Bool(), False, since=2, must_understand=True),
        Field("columns", Seq(RecordType(DeliverColumns), "max_keys"), (), since=3, must_understand=True),
        Field("notify", Opt(RecordType(WriteNotify)), None, since=3, must_understand=True),
    )

    def check(self, limits: Limits) -> None:
        _check_items(self.items, self.columns, limits)
        if self.notify is not None and len(self.notify.items) != 4 * item_count(self):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE,
                f"{len(self.notify.items) // 4} deliver item indices for {item_count(self)} items",
                "notify.items",
            )


@message("write_done", reply=True)
class WriteDone(_KeyResults):
    """Source -> target: the write's outcome per key; no transfer of it can touch the destination now."""



@message("refuse", reply=True)
class Refuse(Message):
    """Source -> target: the write request was refused whole; nothing moved."""

    id: int
    code: int
    reason: str = ""
    FIELDS = _fields(_F_CODE, _F_REASON)


@message("probe")
class Probe(_OpRef):
    """Target -> source: what is the state of write ``op``?"""



@message("probe_reply", reply=True)
class ProbeReply(Message):
    """Source -> target: the state of write ``op`` and the source's incarnation."""

    id: int
    op: int
    state: WriteState
    incarnation: int
    FIELDS = _fields(_F_OP, Field("state", EnumStr(WriteState)), _F_INCARNATION)


# ---- version 3, both sessions


@message("progress", since=3)
class Progress(Message):
    """Node -> client (or source -> target): layer-plan groups delivered so far.

    Not a reply: ``id`` is the id of the deliver (or write) it reports on, which goes on.
    For each listed item, ``done`` says how many groups of its plan, from the first, have
    landed (spec section 6.8). Counts only grow; a repeated or lower count changes nothing.
    """

    id: int
    items: bytes
    done: bytes
    FIELDS = _fields(Field("items", Packed(4, "max_keys")), Field("done", Packed(4, "max_keys")))

    def check(self, limits: Limits) -> None:
        if len(self.done) != len(self.items):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(self.done) // 4} counts for {len(self.items) // 4} items", "done"
            )

    def pairs(self) -> Iterator[tuple[int, int]]:
        """``(item index, groups done)`` per listed item."""
        return zip(unpack(self.items, U32), unpack(self.done, U32), strict=True)


# ---- version 4, both sessions: leases (spec section 6.11), in ``kvcr_protocol.leases``


# ---- version 5, peer sessions: a client left (spec section 5.3)


@message("peer_forget", since=5)
class PeerForget(Message):
    """Target -> source: the client whose agent ``agent`` this peer session announced left;
    forget it (its agent is let go once no write of the session names it). Answered ``ack``,
    also when the session holds no such client (nothing changes)."""

    id: int
    agent: str
    FIELDS = _fields(_F_AGENT)


def item_count(msg: Deposit | Deliver | WriteRequest) -> int:
    """How many items (keys) a message carries, as records or as columns."""
    return len(msg.items) + sum(len(block.keys) for block in msg.columns)


def record_items(msg: Deposit | Deliver | WriteRequest) -> tuple[DepositItem | DeliverItem, ...]:
    """A message's items in record form, whichever form they travel in (for older peers)."""
    if not msg.columns:
        return msg.items
    return tuple(item for block in msg.columns for item in block.to_items())


CLIENT_MESSAGES: tuple[type[Message], ...] = (
    Hello, Welcome, RegisterRegions, UnregisterRegions, Deposit, Query, QueryReply, Deliver,
    Fetch, Release, Abort, SubmitHint, DiscardHint, StatsRequest, StatsReply, Completion, Ack,
    Error, CapacityEvent, Heartbeat, Bye, Progress, Lease, LeaseReply, RenewLease, ReleaseLease, LeaseEnded,
    *PUT_MESSAGES, *INTEGRITY_MESSAGES,
)
PEER_MESSAGES: tuple[type[Message], ...] = (
    PeerHello, PeerWelcome, PeerClient, WriteRequest, WriteDone, Refuse, Probe, ProbeReply, PeerForget,
)
ALL_MESSAGES: tuple[type[Message], ...] = CLIENT_MESSAGES + PEER_MESSAGES
MESSAGE_BY_TAG: dict[str, type[Message]] = {m.TAG: m for m in ALL_MESSAGES}
assert len(MESSAGE_BY_TAG) == len(ALL_MESSAGES), "duplicate wire tag"

BASE_ENCODED: frozenset[type[Message]] = frozenset({Hello, PeerHello})
"""Messages always encoded at version 1, so that any version can read them before agreement."""
