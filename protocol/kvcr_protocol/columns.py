"""Column encodings of version 3 (spec section 6.7).

Thousands of spans, or the answers for thousands of keys, travel as a few columns instead
of one record each: the span names once (``Joined``), the offsets as one bin of
little-endian u64, one region and one length when they are uniform, a query's presence
and tier as one byte per key. Reading a column is one C call, and nothing here builds a
Python object per span or per key unless asked to (``to_items``, ``results``): a target
passes a client's span columns on to a source as they came.

Entries are key-major: entry ``e`` of a block of ``n`` spans is span ``e % n`` of key
``e // n``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, ClassVar, TypeVar

from kvcr_protocol.errors import ErrorCode, RemoteProtocolError
from kvcr_protocol.limits import DEFAULT_LIMITS, Limits
from kvcr_protocol.records import KEY, NAME, U32_MAX, DeliverItem, DepositItem, DstSpan, Presence, QueryResult, SrcSpan
from kvcr_protocol.wire import NUL, U64_MAX, Field, Joined, Packed, Record, Seq, UIntOrPacked

_BIG_ENDIAN = sys.byteorder == "big"
U16, U32, U64 = "H", "I", "Q"
"""``array`` type codes of the packed column widths (2, 4 and 8 bytes)."""
assert array(U16).itemsize == 2 and array(U32).itemsize == 4 and array(U64).itemsize == 8

MAX_GROUPS = 1 << 16
"""Groups in one layer plan: a group number is a u16."""
MAX_TIERS = DEFAULT_LIMITS.max_tiers
"""Entries in a query reply's tier table: a tier index is one byte."""
_MEMO_SIZE = 64
"""Layer plans remembered as validated (a deployment sends few distinct plans)."""


def pack(values: Iterable[int], code: str) -> bytes:
    """A packed little-endian column of ``values`` (``code``: ``U16``, ``U32`` or ``U64``)."""
    column = array(code, values)
    if _BIG_ENDIAN:
        column.byteswap()
    return column.tobytes()


def unpack(data: bytes, code: str) -> array[int]:
    """The integers of a packed little-endian column, as an ``array`` (one C call)."""
    column = array(code)
    column.frombytes(data)
    if _BIG_ENDIAN:
        column.byteswap()
    return column


def _refuse(code: ErrorCode, reason: str, path: str) -> RemoteProtocolError:
    return RemoteProtocolError(code, reason, path)


NAMES = Joined("max_name")
"""The wire type of every names or pools column (one instance: one memo of layouts)."""
_KEYS = Seq(KEY, "max_keys", minimum=1)
_REGIONS = UIntOrPacked(U32_MAX, 4, "max_spans")
_LENGTHS = UIntOrPacked(U64_MAX, 8, "max_spans")
_OFFSETS = Packed(8, "max_spans")


# --------------------------------------------------------------------- span columns


@dataclass(frozen=True, slots=True)
class SpanColumns(Record):
    """Keys that share one layout, and where each span of each key lies.

    ``names`` are the layout's span names joined by NUL; ``regions`` is one region id for
    every entry, or a packed u32 column with one per span (the same for every key) or one
    per entry; ``offsets`` a packed u64 column with one per entry; ``lengths`` one length
    for every span, or a packed u64 column with one per span.
    """

    keys: tuple[bytes, ...]
    names: str
    regions: int | bytes
    offsets: bytes
    lengths: int | bytes
    CHECKED: ClassVar[bool] = True

    @property
    def key_count(self) -> int:
        return len(self.keys)

    @property
    def span_count(self) -> int:
        return NAMES.count(self.names)

    @property
    def entry_count(self) -> int:
        return len(self.keys) * NAMES.count(self.names)

    def span_names(self, limits: Limits = DEFAULT_LIMITS) -> tuple[str, ...]:
        """The layout's names, split once per distinct layout (remembered, bounded)."""
        return NAMES.split(self.names, "names", limits)

    def offset_column(self) -> array[int]:
        """Every entry's offset (u64), key-major."""
        return unpack(self.offsets, U64)

    def length_column(self) -> array[int]:
        """Every span's length (u64), one per span."""
        if isinstance(self.lengths, int):
            return array(U64, [self.lengths]) * self.span_count
        return unpack(self.lengths, U64)

    def region_column(self) -> array[int]:
        """Every entry's region id (u32), key-major."""
        n, k = self.span_count, len(self.keys)
        if isinstance(self.regions, int):
            return array(U32, [self.regions]) * (n * k)
        column = unpack(self.regions, U32)
        return column * k if len(column) == n and k > 1 else column

    def entry(self, key: int, span: int) -> tuple[int, int, int]:
        """``(region, offset, length)`` of span ``span`` of key ``key`` (block-relative)."""
        n = self.span_count
        if not (0 <= key < len(self.keys) and 0 <= span < n):
            raise IndexError(f"entry ({key}, {span}) of {len(self.keys)} keys of {n} spans")
        e = key * n + span
        offset = int.from_bytes(self.offsets[8 * e : 8 * e + 8], "little")
        if isinstance(self.lengths, int):
            length = self.lengths
        else:
            length = int.from_bytes(self.lengths[8 * span : 8 * span + 8], "little")
        if isinstance(self.regions, int):
            region = self.regions
        else:
            r = span if len(self.regions) == 4 * n else e
            region = int.from_bytes(self.regions[4 * r : 4 * r + 4], "little")
        return region, offset, length

    def select(self, keys: Sequence[int]) -> SpanColumns:
        """The same columns for the keys at ``keys`` (block-relative, in that order).

        Rows are cut out of the packed columns as bytes, so a target splitting a client's
        block by source re-encodes nothing per span.
        """
        n = self.span_count
        per_entry_regions = isinstance(self.regions, bytes) and len(self.regions) == 4 * n * len(self.keys) and len(self.keys) > 1
        offsets = b"".join(self.offsets[8 * n * i : 8 * n * (i + 1)] for i in keys)
        regions = self.regions
        if per_entry_regions:
            assert isinstance(regions, bytes)
            regions = b"".join(regions[4 * n * i : 4 * n * (i + 1)] for i in keys)
        return replace(self, keys=tuple(self.keys[i] for i in keys), offsets=offsets, regions=regions)

    def check(self, limits: Limits) -> None:
        """The columns agree with each other: one offset per entry, one length per span, ..."""
        n, k = self.span_count, len(self.keys)
        entries = n * k
        if entries > limits.max_spans:
            raise _refuse(ErrorCode.TOO_MANY, f"{entries} spans ({k} keys of {n}), limit {limits.max_spans}", ".offsets")
        if len(self.offsets) != 8 * entries:
            raise _refuse(
                ErrorCode.OUT_OF_RANGE, f"{len(self.offsets) // 8} offsets for {k} keys of {n} spans", ".offsets"
            )
        if isinstance(self.regions, bytes) and len(self.regions) not in (4 * n, 4 * entries):
            raise _refuse(
                ErrorCode.OUT_OF_RANGE,
                f"{len(self.regions) // 4} regions: one per span ({n}) or per entry ({entries}) is needed",
                ".regions",
            )
        if isinstance(self.lengths, bytes) and len(self.lengths) != 8 * n:
            raise _refuse(ErrorCode.OUT_OF_RANGE, f"{len(self.lengths) // 8} lengths for {n} spans", ".lengths")


_SPAN_FIELDS = (
    Field("keys", _KEYS), Field("names", NAMES), Field("regions", _REGIONS), Field("offsets", _OFFSETS),
    Field("lengths", _LENGTHS),
)


@dataclass(frozen=True, slots=True)
class DepositColumns(SpanColumns):
    """A deposit's keys of one layout: the span columns and each span's pool."""

    pools: str
    FIELDS: ClassVar[tuple[Field, ...]] = (*_SPAN_FIELDS, Field("pools", NAMES))

    def pool_names(self, limits: Limits = DEFAULT_LIMITS) -> tuple[str, ...]:
        """Each span's pool, in layout order."""
        return NAMES.split(self.pools, "pools", limits)

    def check(self, limits: Limits) -> None:
        SpanColumns.check(self, limits)
        if NAMES.count(self.pools) != self.span_count:
            raise _refuse(ErrorCode.OUT_OF_RANGE, f"{NAMES.count(self.pools)} pools for {self.span_count} spans", ".pools")

    def to_items(self) -> tuple[DepositItem, ...]:
        """The same keys as record items (one ``SrcSpan`` per span: for older peers and tests)."""
        names, pools = self.span_names(), self.pool_names()
        return tuple(
            DepositItem(key, tuple(SrcSpan(names[j], pools[j], *self.entry(i, j)) for j in range(len(names))))
            for i, key in enumerate(self.keys)
        )


@dataclass(frozen=True, slots=True)
class DeliverColumns(SpanColumns):
    """A deliver's (or write's) keys of one layout, with an optional layer plan.

    ``groups`` is empty (no plan: the key is one group) or a packed u16 column giving each
    span's group. Groups are numbered from 0 without a gap and run in number order; a
    group's spans are those that name it, in layout order (spec section 6.8).
    """

    groups: bytes = b""
    FIELDS: ClassVar[tuple[Field, ...]] = (*_SPAN_FIELDS, Field("groups", Packed(2, "max_spans"), b""))

    @property
    def group_count(self) -> int:
        return len(self.plan())

    def plan(self) -> tuple[tuple[int, ...], ...]:
        """The span indices of each group, in group order (one group of all spans without a plan)."""
        if not self.groups:
            return (tuple(range(self.span_count)),)
        return _plan(self.groups, self.span_count)

    def check(self, limits: Limits) -> None:
        SpanColumns.check(self, limits)
        if self.groups:
            n = self.span_count
            if len(self.groups) != 2 * n:
                raise _refuse(ErrorCode.OUT_OF_RANGE, f"{len(self.groups) // 2} group numbers for {n} spans", ".groups")
            _plan(self.groups, n)

    def to_items(self) -> tuple[DeliverItem, ...]:
        """The same keys as record items (one ``DstSpan`` per span: for older peers and tests)."""
        names = self.span_names()
        return tuple(
            DeliverItem(key, tuple(DstSpan(names[j], *self.entry(i, j)) for j in range(len(names))))
            for i, key in enumerate(self.keys)
        )


_PLANS: dict[bytes, tuple[tuple[int, ...], ...]] = {}


def _plan(groups: bytes, n: int) -> tuple[tuple[int, ...], ...]:
    """The validated plan of a groups column of ``n`` spans (remembered, bounded).

    Nothing proportional to the largest group number is built before it is known to be at
    most ``n``: a 4-byte column naming group 65,535 costs what its two spans cost."""
    plan = _PLANS.get(groups)
    if plan is not None:
        return plan
    numbers = unpack(groups, U16)
    count = max(numbers) + 1
    if count > n:
        # More groups than spans leaves a group empty. Find the first without building
        # ``count`` lists: the numbers name at most n groups, so one below n + 1 is missing.
        named = set(numbers)
        missing = next(g for g in range(n + 1) if g not in named)
        raise _refuse(ErrorCode.OUT_OF_RANGE, f"group {missing} of {count} has no span", ".groups")
    members: list[list[int]] = [[] for _ in range(count)]
    for j, g in enumerate(numbers):
        members[g].append(j)
    for g, spans in enumerate(members):
        if not spans:
            raise _refuse(ErrorCode.OUT_OF_RANGE, f"group {g} of {count} has no span", ".groups")
    plan = tuple(tuple(spans) for spans in members)
    if len(_PLANS) >= _MEMO_SIZE:
        _PLANS.clear()
    _PLANS[groups] = plan
    return plan


def _uniform_or_packed(values: Sequence[int], code: str) -> int | bytes:
    return values[0] if len(set(values)) == 1 else pack(values, code)


def _layout_columns(
    spans: Sequence[tuple[Any, ...]], names: Sequence[str]
) -> tuple[int | bytes, bytes, int | bytes]:
    """``(regions, offsets, lengths)`` columns of keys' spans, each key given as its
    ``(regions, offsets, lengths)`` per span (transposed with ``zip``: C loops, not Python ones)."""
    if NUL in "".join(names):
        raise ValueError("a span name contains NUL: send these keys as record items")
    lengths = spans[0][2]
    if any(key[2] != lengths for key in spans):
        raise ValueError("the keys' span lengths differ: one block holds one layout")
    per_span = spans[0][0]
    if all(key[0] == per_span for key in spans):
        regions = _uniform_or_packed(per_span, U32)
    else:
        regions = pack(chain.from_iterable(key[0] for key in spans), U32)
    offsets = pack(chain.from_iterable(key[1] for key in spans), U64)
    return regions, offsets, _uniform_or_packed(lengths, U64)


def deliver_columns(items: Sequence[DeliverItem], groups: Sequence[int] = (),
                    columns: Sequence[tuple[tuple[Any, ...], ...]] | None = None) -> DeliverColumns:
    """One block of columns for items that share a layout (same names and lengths).

    ``groups`` is each span's group number (a layer plan), or empty; ``columns``, each
    item's spans as columns, when the caller has them already. Raises ``ValueError`` when
    the items cannot share one block.
    """
    if not items:
        raise ValueError("a block holds at least one key")
    if columns is None:
        columns = [tuple(zip(*item.spans, strict=True)) for item in items]
    names = columns[0][0]
    if any(key[0] != names for key in columns):
        raise ValueError("the keys' span names differ: one block holds one layout")
    regions, offsets, lengths = _layout_columns([key[1:] for key in columns], names)
    block = DeliverColumns(
        tuple(item.key for item in items), NUL.join(names), regions, offsets, lengths, pack(groups, U16) if groups else b""
    )
    block.check(DEFAULT_LIMITS)
    return block


def deposit_columns(items: Sequence[DepositItem], columns: Sequence[tuple[tuple[Any, ...], ...]] | None = None) -> DepositColumns:
    """One block of columns for deposit items that share a layout (names, pools, lengths);
    ``columns``, each item's spans as columns, when the caller has them already."""
    if not items:
        raise ValueError("a block holds at least one key")
    if columns is None:
        columns = [tuple(zip(*item.spans, strict=True)) for item in items]
    names, pools = columns[0][0], columns[0][1]
    if any(key[0] != names or key[1] != pools for key in columns):
        raise ValueError("the keys' span names or pools differ: one block holds one layout")
    if NUL in "".join(pools):
        raise ValueError("a pool name contains NUL: send these keys as record items")
    regions, offsets, lengths = _layout_columns([key[2:] for key in columns], names)
    block = DepositColumns(tuple(item.key for item in items), NUL.join(names), regions, offsets, lengths, NUL.join(pools))
    block.check(DEFAULT_LIMITS)
    return block


_Item = TypeVar("_Item")
_Shape = TypeVar("_Shape")


def layout_runs(items: Sequence[_Item], shape: Callable[[int, _Item], _Shape]) -> list[tuple[_Shape, int, int]]:
    """``(shape, start, stop)`` of each run of consecutive items whose ``shape(n, item)`` is
    equal: the keys one column block can carry (spec section 6.7)."""
    if not items:
        return []
    runs: list[tuple[_Shape, int, int]] = []
    start, current = 0, shape(0, items[0])
    for n in range(1, len(items)):
        this = shape(n, items[n])
        if this != current:
            runs.append((current, start, n))
            start, current = n, this
    runs.append((current, start, len(items)))
    return runs


def deliver_blocks(
    items: Sequence[DeliverItem], groups: Sequence[Sequence[int]] | None = None
) -> tuple[DeliverColumns, ...]:
    """A deliver's items as column blocks, one per run of consecutive keys with one layout
    and one plan (spec section 6.7); none, to send them as records, when a span name holds NUL.

    ``groups`` is each item's group number per span (a layer plan; empty: one group), or
    None for no plan at all.
    """

    columns = [tuple(zip(*item.spans, strict=True)) for item in items]

    def shape(n: int, item: DeliverItem) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
        names, _, _, lengths = columns[n]
        return names, lengths, tuple(groups[n]) if groups is not None else ()

    runs = layout_runs(items, shape)
    if any(NUL in "".join(names) for (names, _, _), _, _ in runs):
        return ()
    return tuple(deliver_columns(items[start:stop], plan, columns[start:stop]) for (_, _, plan), start, stop in runs)


def deposit_blocks(items: Sequence[DepositItem]) -> tuple[DepositColumns, ...]:
    """A deposit's items as column blocks, one per run of consecutive keys with one layout
    (names, pools, lengths); none, to send them as records, when a name or pool holds NUL."""

    # Each item's spans as columns, once: its shape and its block's columns both read them.
    columns = [tuple(zip(*item.spans, strict=True)) for item in items]

    def shape(n: int, item: DepositItem) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
        names, pools, _, _, lengths = columns[n]
        return names, pools, lengths

    runs = layout_runs(items, shape)
    if any(NUL in "".join(names) or NUL in "".join(pools) for (names, pools, _), _, _ in runs):
        return ()
    return tuple(deposit_columns(items[start:stop], columns[start:stop]) for _, start, stop in runs)


# -------------------------------------------------------------------- query columns

PRESENCE_BY_CODE: tuple[Presence, ...] = (Presence.MISS, Presence.HIT, Presence.FETCHING, Presence.FETCHABLE)
"""A presence code (one byte of a ``presence`` column) is its index here."""
PRESENCE_CODE: dict[Presence, int] = {p: i for i, p in enumerate(PRESENCE_BY_CODE)}
_VALID_PRESENCE = bytes(range(len(PRESENCE_BY_CODE)))


def check_code_columns(codes: bytes, tier: bytes, tiers: Sequence[str], valid: bytes, name: str) -> None:
    """Refuse a column of one-byte ``codes`` (the field ``name``) and its ``tier`` column
    when their lengths differ, a code is not in ``valid``, or an index is past ``tiers``."""
    if len(tier) != len(codes):
        raise _refuse(ErrorCode.OUT_OF_RANGE, f"{len(tier)} tier indices for {len(codes)} keys", ".tier")
    if codes.translate(None, valid):
        i = next(i for i, code in enumerate(codes) if code not in valid)
        raise _refuse(ErrorCode.OUT_OF_RANGE, f"{name} code {codes[i]} is unknown", f".{name}[{i}]")
    if tier.translate(None, bytes(range(len(tiers)))):
        i = next(i for i, index in enumerate(tier) if index >= len(tiers))
        raise _refuse(ErrorCode.OUT_OF_RANGE, f"tier {tier[i]} is not in the table of {len(tiers)}", f".tier[{i}]")


def prefix_mask(*counted: Presence) -> int:
    """The ``!prefix`` mask of a query that counts keys of these presences (spec section 6.9)."""
    if not counted or Presence.MISS in counted:
        raise ValueError("a prefix counts one or more of HIT, FETCHING and FETCHABLE")
    mask = 0
    for presence in counted:
        mask |= 1 << PRESENCE_CODE[presence]
    return mask


PREFIX_ALL = prefix_mask(Presence.HIT, Presence.FETCHING, Presence.FETCHABLE)
"""Every bit a prefix mask may set."""


@dataclass(frozen=True, slots=True)
class QueryColumns(Record):
    """A query's answers as columns: a lazy view that decodes a key's answer on access.

    ``presence`` holds one presence code per key (``PRESENCE_BY_CODE``), ``tier`` one
    index per key into the table ``tiers``.
    """

    presence: bytes
    tier: bytes
    tiers: tuple[str, ...]
    CHECKED: ClassVar[bool] = True
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("presence", Packed(1, "max_keys")), Field("tier", Packed(1, "max_keys")),
        Field("tiers", Seq(NAME, "max_tiers")),
    )

    def __len__(self) -> int:
        return len(self.presence)

    def __getitem__(self, index: int) -> QueryResult:
        return QueryResult(PRESENCE_BY_CODE[self.presence[index]], self.tiers[self.tier[index]])

    def __iter__(self) -> Iterator[QueryResult]:
        return iter(self.results())

    def state_of(self, index: int) -> int:
        """The presence code of key ``index`` (0 is ``MISS``), with no object built."""
        return self.presence[index]

    def presence_of(self, index: int) -> Presence:
        return PRESENCE_BY_CODE[self.presence[index]]

    def tier_of(self, index: int) -> str:
        return self.tiers[self.tier[index]]

    def prefix_length(self, mask: int) -> int:
        """How many keys in a row, from the first, have a presence whose bit ``mask`` sets."""
        counted = bytes(code for code in range(len(PRESENCE_BY_CODE)) if mask >> code & 1)
        return len(self.presence) - len(self.presence.lstrip(counted))

    def results(self) -> tuple[QueryResult, ...]:
        """Every answer as a ``QueryResult`` (the record form)."""
        made = [QueryResult(p, t) for p in PRESENCE_BY_CODE for t in self.tiers]
        width = len(self.tiers)
        return tuple(made[p * width + t] for p, t in zip(self.presence, self.tier, strict=True))

    @classmethod
    def from_results(cls, results: Iterable[QueryResult]) -> QueryColumns:
        """The columns of record-form answers (tiers in order of first use)."""
        table: dict[str, int] = {}
        presence = bytearray()
        tier = bytearray()
        for result in results:
            presence.append(PRESENCE_CODE[result.presence])
            index = table.setdefault(result.tier, len(table))
            if index >= MAX_TIERS:
                raise ValueError(f"more than {MAX_TIERS} distinct tiers")
            tier.append(index)
        return cls(bytes(presence), bytes(tier), tuple(table))

    def check(self, limits: Limits) -> None:
        check_code_columns(self.presence, self.tier, self.tiers, _VALID_PRESENCE, "presence")
