"""Typed, frozen messages of the kvcr protocol, each with an explicit wire tag.

The tables here are the protocol: each message class lists its fields in wire order
(``FIELDS``) and names its tag (``TAG``). Renaming a class never changes its tag. The
written form of the same tables is ``spec/kvcr-protocol.md``.

Schema evolution rules: new fields get defaults and a ``since`` version; a field's type
never changes; fields are deprecated, never deleted. A field whose key begins with ``!``
is must-understand: a receiver that does not know it refuses the message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from kvcr_protocol.wire import (
    AnyMap,
    Bool,
    Bytes,
    EnumStr,
    Field,
    Opt,
    Record,
    RecordType,
    Seq,
    Str,
    UInt,
)

# --------------------------------------------------------------------------- enums


class MemoryKind(enum.Enum):
    """Where a region or pool lives."""

    DRAM = "dram"
    VRAM = "vram"


class KeyStatus(enum.Enum):
    """Per-key outcome of an operation."""

    STORED = "STORED"
    """deposit: the object is READY in the node."""
    DUPLICATE = "DUPLICATE"
    """deposit: already READY with the same layout (a writer still WRITING it was waited for); no second transfer."""
    DROPPED = "DROPPED"
    """deposit: the admission policy declined an optional deposit."""
    OK = "OK"
    """deliver/fetch/release: done."""
    FAILED = "FAILED"
    """failed; the code says why."""
    ABORTED = "ABORTED"
    """aborted before it finished."""


class Presence(enum.Enum):
    """Per-key answer of a query."""

    HIT = "HIT"
    FETCHING = "FETCHING"
    FETCHABLE = "FETCHABLE"
    MISS = "MISS"


class WriteState(enum.Enum):
    """What a source node knows of a peer write (probe reply)."""

    UNKNOWN = "UNKNOWN"
    """Never seen, or from another incarnation."""
    WAITING = "WAITING"
    """Accepted, waiting on objects still WRITING; nothing moved yet."""
    IN_FLIGHT = "IN_FLIGHT"
    """A transfer may be writing the destination."""
    DONE = "DONE"
    """Terminal: no transfer of this operation can touch the destination any more."""


# ------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Region(Record):
    """A memory region a client (or node) registered with NIXL and announces."""

    region: int
    kind: MemoryKind
    device: int
    address: int
    length: int
    FIELDS: ClassVar[tuple[Field, ...]] = ()


class _SrcSpanFields(NamedTuple):
    name: str
    pool: str
    region: int
    offset: int
    length: int


class SrcSpan(_SrcSpanFields, Record):
    """A deposit's span: its name and pool, and where its bytes are in client memory."""

    __slots__ = ()


class _DstSpanFields(NamedTuple):
    name: str
    region: int
    offset: int
    length: int


class DstSpan(_DstSpanFields, Record):
    """A deliver's span: the stored span it names and where its bytes must land."""

    __slots__ = ()


class _LayoutSpanFields(NamedTuple):
    name: str
    pool: str


class LayoutSpan(_LayoutSpanFields, Record):
    """One span of a layout: name and pool."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class DepositItem(Record):
    key: bytes
    spans: tuple[SrcSpan, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = ()


@dataclass(frozen=True, slots=True)
class DeliverItem(Record):
    key: bytes
    spans: tuple[DstSpan, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = ()


@dataclass(frozen=True, slots=True)
class FetchItem(Record):
    key: bytes
    layout: tuple[LayoutSpan, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = ()


@dataclass(frozen=True, slots=True)
class PoolInfo(Record):
    """A node pool as announced in welcome."""

    name: str
    slot_size: int
    slot_count: int
    memory: str
    FIELDS: ClassVar[tuple[Field, ...]] = ()


@dataclass(frozen=True, slots=True)
class KeyResult(Record):
    """The outcome for one key: status, error code (0 = none), reason, release handle."""

    status: KeyStatus
    code: int = 0
    reason: str = ""
    handle: int | None = None
    FIELDS: ClassVar[tuple[Field, ...]] = ()


@dataclass(frozen=True, slots=True)
class QueryResult(Record):
    """The answer for one key: presence and tier (``dram``, ``hbm:N``, ``remote``, or empty)."""

    presence: Presence
    tier: str = ""
    FIELDS: ClassVar[tuple[Field, ...]] = ()


_U32 = (1 << 32) - 1
_ID = UInt()
_NAME = Str("max_name")
_TEXT = Str("max_text")
_KEY = Bytes("max_key", minimum=1)
_KEYS = Seq(_KEY, "max_keys")
_VERSIONS = Seq(UInt(0xFFFF), "max_regions", minimum=1)

Region.FIELDS = (
    Field("region", UInt(_U32)),
    Field("kind", EnumStr(MemoryKind)),
    Field("device", UInt(0xFFFF)),
    Field("address", UInt()),
    Field("length", UInt()),
)
SrcSpan.FIELDS = (
    Field("name", _NAME), Field("pool", _NAME), Field("region", UInt(_U32)),
    Field("offset", UInt()), Field("length", UInt()),
)
DstSpan.FIELDS = (
    Field("name", _NAME), Field("region", UInt(_U32)), Field("offset", UInt()), Field("length", UInt()),
)
LayoutSpan.FIELDS = (Field("name", _NAME), Field("pool", _NAME))
DepositItem.FIELDS = (Field("key", _KEY), Field("spans", Seq(RecordType(SrcSpan), "max_spans", minimum=1)))
DeliverItem.FIELDS = (Field("key", _KEY), Field("spans", Seq(RecordType(DstSpan), "max_spans", minimum=1)))
FetchItem.FIELDS = (Field("key", _KEY), Field("layout", Seq(RecordType(LayoutSpan), "max_spans", minimum=1)))
PoolInfo.FIELDS = (
    Field("name", _NAME), Field("slot_size", UInt()), Field("slot_count", UInt()), Field("memory", _NAME),
)
KeyResult.FIELDS = (
    Field("status", EnumStr(KeyStatus)), Field("code", UInt(0xFFFF), 0),
    Field("reason", _TEXT, ""), Field("handle", Opt(UInt()), None),
)
QueryResult.FIELDS = (Field("presence", EnumStr(Presence)), Field("tier", _NAME, ""))

_REGIONS = Seq(RecordType(Region), "max_regions")

# ------------------------------------------------------------------------ messages


class Message:
    """Base of all messages; ``TAG`` is the wire type tag, ``FIELDS`` the wire fields."""

    TAG: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    REPLY: ClassVar[bool] = False
    """True for messages that answer a request (their ``id`` echoes it)."""


def _fields(*fields: Field) -> tuple[Field, ...]:
    return (Field("id", _ID), *fields)


# ---- client <-> node


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Client -> node: open a session. Always encoded at version 1 (``v`` = 1)."""

    TAG: ClassVar[str] = "hello"
    id: int
    versions: tuple[int, ...]
    client: str
    agent: str
    agent_md: bytes
    regions: tuple[Region, ...] = ()
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("versions", _VERSIONS), Field("client", _NAME), Field("agent", _NAME),
        Field("agent_md", Bytes("max_metadata")), Field("regions", _REGIONS, ()),
    )


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Node -> client: the agreed version, the node's identity and its pools."""

    TAG: ClassVar[str] = "welcome"
    REPLY: ClassVar[bool] = True
    id: int
    version: int
    node: str
    incarnation: int
    agent: str
    pools: tuple[PoolInfo, ...] = ()
    heartbeat_ms: int = 0
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("version", UInt(0xFFFF)), Field("node", _NAME), Field("incarnation", UInt()),
        Field("agent", _NAME), Field("pools", Seq(RecordType(PoolInfo), "max_regions"), ()),
        Field("heartbeat_ms", UInt(_U32), 0),
    )


@dataclass(frozen=True, slots=True)
class RegisterRegions(Message):
    """Client -> node: new regions, with the agent metadata that now covers them."""

    TAG: ClassVar[str] = "regions"
    id: int
    agent_md: bytes
    regions: tuple[Region, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("agent_md", Bytes("max_metadata")), Field("regions", _REGIONS),
    )


@dataclass(frozen=True, slots=True)
class UnregisterRegions(Message):
    """Client -> node: regions the client will deregister; the node stops using them."""

    TAG: ClassVar[str] = "unregions"
    id: int
    regions: tuple[int, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("regions", Seq(UInt(_U32), "max_regions")))


@dataclass(frozen=True, slots=True)
class Deposit(Message):
    """Client -> node: store objects, reading their bytes from client memory."""

    TAG: ClassVar[str] = "deposit"
    id: int
    items: tuple[DepositItem, ...]
    no_evict: bool = False
    optional: bool = False
    deadline_ms: int = 0
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("items", Seq(RecordType(DepositItem), "max_keys")), Field("no_evict", Bool(), False),
        Field("optional", Bool(), False), Field("deadline_ms", UInt(_U32), 0),
    )


@dataclass(frozen=True, slots=True)
class Query(Message):
    """Client -> node: where are these keys (advisory)."""

    TAG: ClassVar[str] = "query"
    id: int
    keys: tuple[bytes, ...]
    request_id: str | None = None
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("keys", _KEYS), Field("request_id", Opt(_TEXT), None),
    )


@dataclass(frozen=True, slots=True)
class QueryReply(Message):
    TAG: ClassVar[str] = "query_reply"
    REPLY: ClassVar[bool] = True
    id: int
    results: tuple[QueryResult, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("results", Seq(RecordType(QueryResult), "max_keys")))


@dataclass(frozen=True, slots=True)
class Deliver(Message):
    """Client -> node: put objects' bytes (whole or a named subset) into client memory.

    ``partial`` (version 2) says the span names may select an ordered subset of each
    stored layout. A node projects local objects either way; for an object it must
    fetch from a peer, only a ``partial`` deliver may name a subset, and only a version 2
    peer can serve one.
    """

    TAG: ClassVar[str] = "deliver"
    id: int
    items: tuple[DeliverItem, ...]
    request_id: str | None = None
    deadline_ms: int = 0
    partial: bool = False
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("items", Seq(RecordType(DeliverItem), "max_keys")),
        Field("request_id", Opt(_TEXT), None), Field("deadline_ms", UInt(_U32), 0),
        Field("partial", Bool(), False, since=2),
    )


@dataclass(frozen=True, slots=True)
class Fetch(Message):
    """Client -> node: make objects resident in the node (whole layouts only)."""

    TAG: ClassVar[str] = "fetch"
    id: int
    items: tuple[FetchItem, ...]
    request_id: str | None = None
    deadline_ms: int = 0
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("items", Seq(RecordType(FetchItem), "max_keys")),
        Field("request_id", Opt(_TEXT), None), Field("deadline_ms", UInt(_U32), 0),
    )


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Client -> node: drop handle claims (from fetch or no_evict deposits)."""

    TAG: ClassVar[str] = "release"
    id: int
    handles: tuple[int, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("handles", Seq(UInt(), "max_keys")))


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Client -> node: abort operation ``op`` (best effort)."""

    TAG: ClassVar[str] = "abort"
    id: int
    op: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("op", UInt()))


@dataclass(frozen=True, slots=True)
class SubmitHint(Message):
    """Client -> node: for ``request_id``, ``keys`` may be held by the node at ``endpoint``."""

    TAG: ClassVar[str] = "hint"
    id: int
    request_id: str
    endpoint: str
    keys: tuple[bytes, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("request_id", _TEXT), Field("endpoint", _TEXT), Field("keys", _KEYS),
    )


@dataclass(frozen=True, slots=True)
class DiscardHint(Message):
    TAG: ClassVar[str] = "unhint"
    id: int
    request_id: str
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("request_id", _TEXT))


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    TAG: ClassVar[str] = "stats"
    id: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields()


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    TAG: ClassVar[str] = "stats_reply"
    REPLY: ClassVar[bool] = True
    id: int
    stats: dict[str, Any]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("stats", AnyMap()))


@dataclass(frozen=True, slots=True)
class Completion(Message):
    """Node -> client (or source -> target as write_done): one result per item, in order."""

    TAG: ClassVar[str] = "complete"
    REPLY: ClassVar[bool] = True
    id: int
    results: tuple[KeyResult, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("results", Seq(RecordType(KeyResult), "max_keys")))


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """A request without per-key results was accepted and done."""

    TAG: ClassVar[str] = "ack"
    REPLY: ClassVar[bool] = True
    id: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields()


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A request was refused whole. ``id`` is 0 when the request id could not be read."""

    TAG: ClassVar[str] = "error"
    REPLY: ClassVar[bool] = True
    id: int
    code: int
    reason: str = ""
    path: str = ""
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("code", UInt(0xFFFF)), Field("reason", _TEXT, ""), Field("path", _TEXT, ""),
    )


@dataclass(frozen=True, slots=True)
class CapacityEvent(Message):
    """Node -> clients: a pool's reclaimable slots fell under its low watermark."""

    TAG: ClassVar[str] = "capacity"
    id: int
    pool: str
    reclaimable: int
    total: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("pool", _NAME), Field("reclaimable", UInt()), Field("total", UInt()),
    )


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Either direction: I am alive. ``id`` counts heartbeats."""

    TAG: ClassVar[str] = "heartbeat"
    id: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields()


@dataclass(frozen=True, slots=True)
class Bye(Message):
    """Client -> node: closing; drop this client's handles and regions."""

    TAG: ClassVar[str] = "bye"
    id: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields()


# ---- node <-> node


@dataclass(frozen=True, slots=True)
class PeerHello(Message):
    """Target node -> source node: open a peer session. Always encoded at version 1."""

    TAG: ClassVar[str] = "peer_hello"
    id: int
    versions: tuple[int, ...]
    node: str
    incarnation: int
    agent: str
    agent_md: bytes
    regions: tuple[Region, ...] = ()
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("versions", _VERSIONS), Field("node", _NAME), Field("incarnation", UInt()),
        Field("agent", _NAME), Field("agent_md", Bytes("max_metadata")), Field("regions", _REGIONS, ()),
    )


@dataclass(frozen=True, slots=True)
class PeerWelcome(Message):
    TAG: ClassVar[str] = "peer_welcome"
    REPLY: ClassVar[bool] = True
    id: int
    version: int
    node: str
    incarnation: int
    agent: str
    agent_md: bytes
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("version", UInt(0xFFFF)), Field("node", _NAME), Field("incarnation", UInt()),
        Field("agent", _NAME), Field("agent_md", Bytes("max_metadata")),
    )


@dataclass(frozen=True, slots=True)
class PeerClient(Message):
    """Target -> source: a client's agent metadata and regions, so the source can write to it."""

    TAG: ClassVar[str] = "peer_client"
    id: int
    agent: str
    agent_md: bytes
    regions: tuple[Region, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("agent", _NAME), Field("agent_md", Bytes("max_metadata")), Field("regions", _REGIONS),
    )


@dataclass(frozen=True, slots=True)
class WriteRequest(Message):
    """Target -> source: write these keys from your pool into ``agent``'s memory.

    ``partial`` (wire key ``!partial``, version 2) says the span names select an ordered
    subset of each stored layout; it is must-understand.
    """

    TAG: ClassVar[str] = "write"
    id: int
    agent: str
    items: tuple[DeliverItem, ...]
    deadline_ms: int = 0
    partial: bool = False
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("agent", _NAME), Field("items", Seq(RecordType(DeliverItem), "max_keys")),
        Field("deadline_ms", UInt(_U32), 0),
        Field("partial", Bool(), False, since=2, must_understand=True),
    )


@dataclass(frozen=True, slots=True)
class WriteDone(Message):
    """Source -> target: the write's outcome per key; no transfer of it can touch the destination now."""

    TAG: ClassVar[str] = "write_done"
    REPLY: ClassVar[bool] = True
    id: int
    results: tuple[KeyResult, ...]
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("results", Seq(RecordType(KeyResult), "max_keys")))


@dataclass(frozen=True, slots=True)
class Refuse(Message):
    """Source -> target: the write request was refused whole; nothing moved."""

    TAG: ClassVar[str] = "refuse"
    REPLY: ClassVar[bool] = True
    id: int
    code: int
    reason: str = ""
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("code", UInt(0xFFFF)), Field("reason", _TEXT, ""))


@dataclass(frozen=True, slots=True)
class Probe(Message):
    """Target -> source: what is the state of write ``op``?"""

    TAG: ClassVar[str] = "probe"
    id: int
    op: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(Field("op", UInt()))


@dataclass(frozen=True, slots=True)
class ProbeReply(Message):
    TAG: ClassVar[str] = "probe_reply"
    REPLY: ClassVar[bool] = True
    id: int
    op: int
    state: WriteState
    incarnation: int
    FIELDS: ClassVar[tuple[Field, ...]] = _fields(
        Field("op", UInt()), Field("state", EnumStr(WriteState)), Field("incarnation", UInt()),
    )


CLIENT_MESSAGES: tuple[type[Message], ...] = (
    Hello, Welcome, RegisterRegions, UnregisterRegions, Deposit, Query, QueryReply, Deliver,
    Fetch, Release, Abort, SubmitHint, DiscardHint, StatsRequest, StatsReply, Completion, Ack,
    Error, CapacityEvent, Heartbeat, Bye,
)
PEER_MESSAGES: tuple[type[Message], ...] = (
    PeerHello, PeerWelcome, PeerClient, WriteRequest, WriteDone, Refuse, Probe, ProbeReply,
)
ALL_MESSAGES: tuple[type[Message], ...] = CLIENT_MESSAGES + PEER_MESSAGES
MESSAGE_BY_TAG: dict[str, type[Message]] = {m.TAG: m for m in ALL_MESSAGES}
assert len(MESSAGE_BY_TAG) == len(ALL_MESSAGES), "duplicate wire tag"

BASE_ENCODED: frozenset[type[Message]] = frozenset({Hello, PeerHello})
"""Messages always encoded at version 1, so that any version can read them before agreement."""
