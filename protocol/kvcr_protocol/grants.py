"""Read grants (version 5, spec section 6.12): the slots a lease lets its client READ itself.

A ``lease`` with ``read`` set asks the node for the slots of every key it holds, so the
client's own NIXL agent can READ them into its own memory with no control message per
transfer. The ``lease_reply`` carries them as a ``LeaseGrant``: per key of the lease, the
index of its layout in a table of layouts (0: no grant for the key), and per granted span,
in key order and layout order, its pool (an index into the session's ``welcome.pools``) and
its slot there. A span's bytes are at ``slot * slot_size`` in its pool, ``slot_size`` long.
What the client's agent needs to reach the pools (the node's agent metadata and the pools'
registrations, ``GrantNode``) travels once, when the ``lease`` asks for it (``node_md``).

Across nodes (a key the lease holds at a hinted source, ``LEASED_REMOTE``), the target
passes on the source's grant: ``source`` names per key the node whose pools its row's pool
indices point into (0: this node; i: ``sources[i - 1]``, a ``GrantSource``), and the client
READs from the source's agent directly (spec section 6.12, "Across nodes").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvcr_protocol.columns import NAMES, U32, pack, unpack
from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import NAME, REGIONS, Region
from kvcr_protocol.records import U32_MAX as _U32
from kvcr_protocol.wire import Bytes, Field, Opt, Packed, Record, RecordType, Seq, Str, UInt


@dataclass(frozen=True, slots=True)
class GrantNode(Record):
    """What a client's agent needs to READ the node's pools: the node's agent name and
    metadata, each pool's registration (``region`` is the pool's index in ``welcome.pools``),
    and ``grace_ms``, how long the node keeps a silent session (0: it never ends one for
    silence), which bounds how long a grant can be trusted without asking (section 6.12);
    ``slot_size``, one u32 per pool (empty: the client has them from ``welcome.pools``; a
    source's, passed on by a target, has them)."""

    agent: str
    agent_md: bytes
    pools: tuple[Region, ...]
    grace_ms: int = 0
    slot_size: bytes = b""
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("agent", NAME), Field("agent_md", Bytes("max_metadata")), Field("pools", REGIONS),
        Field("grace_ms", UInt(_U32), 0), Field("slot_size", Packed(4, "max_regions"), b""),
    )

    def check(self, limits: Limits) -> None:
        if self.slot_size and len(self.slot_size) != 4 * len(self.pools):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(self.slot_size) // 4} slot sizes for {len(self.pools)} pools", ".slot_size")

    def slot_sizes(self) -> list[int]:
        """The pools' slot sizes, in pool order (empty when the record carries none)."""
        return unpack(self.slot_size, U32).tolist()


@dataclass(frozen=True, slots=True)
class GrantSource(Record):
    """A source whose grant a target passes on (section 6.12, "Across nodes"): its endpoint
    and incarnation (together they name it; a client caches its agent per pair, per
    session), and its agent, pools and slot sizes (``node``) when the client may not have
    them yet."""

    endpoint: str
    incarnation: int
    node: GrantNode | None = None
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("endpoint", Str("max_text")), Field("incarnation", UInt()), Field("node", Opt(RecordType(GrantNode)), None),
    )


@dataclass(frozen=True, slots=True)
class LeaseGrant(Record):
    """A lease's read grant as columns: ``layout`` one u32 per key of the lease (0: not
    granted; i: ``layouts[i - 1]``, the stored span names joined by NUL), then ``pool`` (one
    u8) and ``slot`` (one u32) per granted span; ``node`` when the lease asked for it;
    ``source`` one u8 per key (empty: every row is this node's; 0: this node's; i: the
    source ``sources[i - 1]``), whose pools the key's ``pool`` entries index; ``digest``
    one u64 per granted span, in the order of ``pool`` (empty: none; 0: that span's not
    taken), the digest of its bytes when the object became READY (section 6.12)."""

    layout: bytes
    layouts: tuple[str, ...]
    pool: bytes
    slot: bytes
    node: GrantNode | None = None
    source: bytes = b""
    sources: tuple[GrantSource, ...] = ()
    digest: bytes = b""
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("layout", Packed(4, "max_keys")), Field("layouts", Seq(NAMES, "max_keys")),
        Field("pool", Packed(1, "max_spans")), Field("slot", Packed(4, "max_spans")),
        Field("node", Opt(RecordType(GrantNode)), None), Field("source", Packed(1, "max_keys"), b""),
        Field("sources", Seq(RecordType(GrantSource), "max_tiers"), ()),
        Field("digest", Packed(8, "max_spans"), b""),
    )

    def __len__(self) -> int:
        return len(self.layout) // 4

    def check(self, limits: Limits) -> None:
        if len(self.slot) != 4 * len(self.pool):
            raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"{len(self.slot) // 4} slots for {len(self.pool)} pools", ".slot")
        counts = [NAMES.count(names) for names in self.layouts]
        spans = 0
        for i, index in enumerate(unpack(self.layout, U32)):
            if index > len(counts):
                raise RemoteProtocolError(
                    ErrorCode.OUT_OF_RANGE, f"layout {index} is not in the table of {len(counts)}", f".layout[{i}]")
            if index:
                spans += counts[index - 1]
        if spans != len(self.pool):
            raise RemoteProtocolError(ErrorCode.OUT_OF_RANGE, f"{len(self.pool)} granted spans, the layouts name {spans}", ".pool")
        if spans > limits.max_spans:
            raise RemoteProtocolError(ErrorCode.TOO_MANY, f"{spans} granted spans, limit {limits.max_spans}", ".pool")
        if self.digest and len(self.digest) != 8 * len(self.pool):
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(self.digest) // 8} digests for {len(self.pool)} granted spans", ".digest")
        if self.source and len(self.source) != len(self.layout) // 4:
            raise RemoteProtocolError(
                ErrorCode.OUT_OF_RANGE, f"{len(self.source)} sources for {len(self.layout) // 4} keys", ".source")
        for i, index in enumerate(self.source):
            if index > len(self.sources):
                raise RemoteProtocolError(
                    ErrorCode.OUT_OF_RANGE, f"source {index} is not in the table of {len(self.sources)}", f".source[{i}]")

    def source_of(self, i: int) -> GrantSource | None:
        """The source whose pools key ``i``'s row points into; None: this node's."""
        index = self.source[i] if self.source else 0
        return self.sources[index - 1] if index else None

    def keys(self, limits: Limits) -> Iterator[tuple[int, tuple[str, ...], bytes, list[int]]]:
        """Per granted key: its index in the lease, its stored span names, and its spans'
        pools (one byte each) and slots, in layout order."""
        slots = unpack(self.slot, U32)
        at = 0
        for i, index in enumerate(unpack(self.layout, U32)):
            if not index:
                continue
            names = NAMES.split(self.layouts[index - 1], "layouts", limits)
            end = at + len(names)
            yield i, names, self.pool[at:end], slots[at:end].tolist()
            at = end


def grant_columns(
    rows: list[tuple[tuple[str, ...], list[tuple[int, int]]] | None], node: GrantNode | None = None,
    source: list[int] | None = None, sources: tuple[GrantSource, ...] = (),
) -> LeaseGrant:
    """A ``LeaseGrant`` from one row per key: None (no grant) or its stored names and its
    spans' (pool index, slot); equal layouts share one entry of the table. ``source``: per
    key its index in ``sources`` plus one (0: this node's); None or all 0: no column."""
    packed: list[PackedRow | None] = [
        None if row is None else (row[0], bytes(p for p, _ in row[1]), pack([s for _, s in row[1]], U32)) for row in rows
    ]
    return packed_grant_columns(packed, node, source, sources)


PackedRow = tuple[tuple[str, ...], bytes, bytes]
"""A key's row as columns: its stored span names, one pool index byte per span, and one
little-endian u32 slot per span (what a node has at hand: no object per span)."""


def packed_grant_columns(
    rows: Sequence[PackedRow | None], node: GrantNode | None = None, source: list[int] | None = None,
    sources: tuple[GrantSource, ...] = (),
) -> LeaseGrant:
    """``grant_columns`` of rows already packed (``PackedRow``): the columns are joined, one
    step per key whatever its spans."""
    table: dict[tuple[str, ...], int] = {}
    layout: list[int] = []
    pools: list[bytes] = []
    slots: list[bytes] = []
    for row in rows:
        if row is None:
            layout.append(0)
            continue
        names, pool, slot = row
        layout.append(table.setdefault(names, len(table) + 1))
        pools.append(pool)
        slots.append(slot)
    joined = tuple("\0".join(names) for names in table)
    column = bytes(source) if source is not None and any(source) else b""
    return LeaseGrant(pack(layout, U32), joined, b"".join(pools), b"".join(slots), node, column,
                      sources if column else ())
