"""Enums and records of the kvcr protocol: the small structs that messages carry.

Records travel as msgpack arrays in ``FIELDS`` order (spec section 6.3). Spans, which come
by the thousand, are tuple subclasses so that a decoded array becomes one in a single C
call; version 3 carries many spans as columns instead (``kvcr_protocol.columns``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from kvcr_protocol.wire import Bytes, EnumStr, Field, Opt, Record, RecordType, Seq, Str, UInt

__all__ = [
    "DeliverItem",
    "DepositItem",
    "DstSpan",
    "FetchItem",
    "KeyResult",
    "KeyStatus",
    "LayoutSpan",
    "MemoryKind",
    "PoolInfo",
    "Presence",
    "QueryResult",
    "Region",
    "SrcSpan",
    "WriteState",
]

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


U32_MAX = (1 << 32) - 1
"""The largest uint32."""

# Wire types that several records and messages share.
ID = UInt()
NAME = Str("max_name")
TEXT = Str("max_text")
KEY = Bytes("max_key", minimum=1)
KEYS = Seq(KEY, "max_keys")
VERSIONS = Seq(UInt(0xFFFF), "max_regions", minimum=1)

Region.FIELDS = (
    Field("region", UInt(U32_MAX)),
    Field("kind", EnumStr(MemoryKind)),
    Field("device", UInt(0xFFFF)),
    Field("address", UInt()),
    Field("length", UInt()),
)
SrcSpan.FIELDS = (
    Field("name", NAME), Field("pool", NAME), Field("region", UInt(U32_MAX)),
    Field("offset", UInt()), Field("length", UInt()),
)
DstSpan.FIELDS = (
    Field("name", NAME), Field("region", UInt(U32_MAX)), Field("offset", UInt()), Field("length", UInt()),
)
LayoutSpan.FIELDS = (Field("name", NAME), Field("pool", NAME))
DepositItem.FIELDS = (Field("key", KEY), Field("spans", Seq(RecordType(SrcSpan), "max_spans", minimum=1)))
DeliverItem.FIELDS = (Field("key", KEY), Field("spans", Seq(RecordType(DstSpan), "max_spans", minimum=1)))
FetchItem.FIELDS = (Field("key", KEY), Field("layout", Seq(RecordType(LayoutSpan), "max_spans", minimum=1)))
PoolInfo.FIELDS = (
    Field("name", NAME), Field("slot_size", UInt()), Field("slot_count", UInt()), Field("memory", NAME),
)
KeyResult.FIELDS = (
    Field("status", EnumStr(KeyStatus)), Field("code", UInt(0xFFFF), 0),
    Field("reason", TEXT, ""), Field("handle", Opt(UInt()), None),
)
QueryResult.FIELDS = (Field("presence", EnumStr(Presence)), Field("tier", NAME, ""))

REGIONS = Seq(RecordType(Region), "max_regions")
