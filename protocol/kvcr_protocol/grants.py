"""Read grants (version 5, spec section 6.12): the slots a lease lets its client READ itself.

A ``lease`` with ``read`` set asks the node for the slots of every key it holds, so the
client's own NIXL agent can READ them into its own memory with no control message per
transfer. The ``lease_reply`` carries them as a ``LeaseGrant``: per key of the lease, the
index of its layout in a table of layouts (0: no grant for the key), and per granted span,
in key order and layout order, its pool (an index into the session's ``welcome.pools``) and
its slot there. A span's bytes are at ``slot * slot_size`` in its pool, ``slot_size`` long.
What the client's agent needs to reach the pools (the node's agent metadata and the pools'
registrations, ``GrantNode``) travels once, when the ``lease`` asks for it (``node_md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from kvcr_protocol.columns import NAMES, U32, pack, unpack
from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.limits import Limits
from kvcr_protocol.records import NAME, REGIONS, Region
from kvcr_protocol.records import U32_MAX as _U32
from kvcr_protocol.wire import Bytes, Field, Opt, Packed, Record, RecordType, Seq, UInt


@dataclass(frozen=True, slots=True)
class GrantNode(Record):
    """What a client's agent needs to READ the node's pools: the node's agent name and
    metadata, each pool's registration (``region`` is the pool's index in ``welcome.pools``),
    and ``grace_ms``, how long the node keeps a silent session (0: it never ends one for
    silence), which bounds how long a grant can be trusted without asking (section 6.12)."""

    agent: str
    agent_md: bytes
    pools: tuple[Region, ...]
    grace_ms: int = 0
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("agent", NAME), Field("agent_md", Bytes("max_metadata")), Field("pools", REGIONS),
        Field("grace_ms", UInt(_U32), 0),
    )


@dataclass(frozen=True, slots=True)
class LeaseGrant(Record):
    """A lease's read grant as columns: ``layout`` one u32 per key of the lease (0: not
    granted; i: ``layouts[i - 1]``, the stored span names joined by NUL), then ``pool`` (one
    u8) and ``slot`` (one u32) per granted span; ``node`` when the lease asked for it."""

    layout: bytes
    layouts: tuple[str, ...]
    pool: bytes
    slot: bytes
    node: GrantNode | None = None
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("layout", Packed(4, "max_keys")), Field("layouts", Seq(NAMES, "max_keys")),
        Field("pool", Packed(1, "max_spans")), Field("slot", Packed(4, "max_spans")),
        Field("node", Opt(RecordType(GrantNode)), None),
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
) -> LeaseGrant:
    """A ``LeaseGrant`` from one row per key: None (no grant) or its stored names and its
    spans' (pool index, slot); equal layouts share one entry of the table."""
    table: dict[tuple[str, ...], int] = {}
    layout: list[int] = []
    pool = bytearray()
    slot: list[int] = []
    for row in rows:
        if row is None:
            layout.append(0)
            continue
        names, spans = row
        layout.append(table.setdefault(names, len(table) + 1))
        for p, s in spans:
            pool.append(p)
            slot.append(s)
    joined = tuple("\0".join(names) for names in table)
    return LeaseGrant(pack(layout, U32), joined, bytes(pool), pack(slot, U32), node)
