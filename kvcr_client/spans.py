"""Where a call's bytes are: ``Span``s in registered buffers, checked ``Destination``s, and
the wire items and layer plans built from them.

Spans are checked against the client's table of registered regions (``RegionTable.by_id``)
and, for a deposit, against the node's pools; every fault is an ``ArgumentError`` naming
the span's field. A layer plan (spec section 6.8) becomes each key's group number per span.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

from kvcr_client import checks
from kvcr_client.errors import ArgumentError
from kvcr_client.regions import RegionHandle
from kvcr_protocol import DEFAULT_LIMITS, DeliverItem, DstSpan, PoolInfo, SrcSpan
from kvcr_protocol.columns import MAX_GROUPS, DeliverColumns, deliver_blocks


@dataclass(frozen=True, slots=True)
class Span:
    """Where one named span's bytes are (or go) in a registered buffer.

    ``pool`` is needed by ``deposit`` only: it names the node pool that stores the span.
    """

    name: str
    region: RegionHandle
    offset: int
    length: int
    pool: str = ""


DESTINATION_PLANS = 8
"""Layer plans a ``Destination`` keeps its column block for (it forgets them all past that)."""


@dataclass(frozen=True, eq=False)
class Destination:
    """Destination spans a client checked once (``Client.destination``); reuse it across delivers."""

    client: Any = field(repr=False)
    wire: tuple[DstSpan, ...] = field(repr=False)
    regions: frozenset[RegionHandle] = field(repr=False)
    blocks: dict[tuple[int, ...] | None, DeliverColumns] = field(default_factory=dict, repr=False)
    """The column block of a deliver of one key here, by layer plan (each span's group, or
    None): built once, then only the key changes (``deliver_columns``)."""

    def __len__(self) -> int:
        return len(self.wire)


LayerPlan = Sequence[Sequence[str]] | Mapping[bytes, Sequence[Sequence[str]]]
"""A deliver's layer plan: groups of span names that every key follows, or one per key."""

Regions = Mapping[int, RegionHandle]
"""The registered regions spans may name, by region id."""
Pools = Mapping[str, PoolInfo] | None
"""The node's pools a deposit's spans are checked against; None for a deliver's spans."""

_new_tuple = tuple.__new__


def check_span(span: Any, path: str, regions: Regions, pools: Pools) -> RegionHandle:
    """Check one span field by field, naming the first that is wrong; its region."""
    if not isinstance(span, Span):
        raise ArgumentError(path, f"expected a kvcr_client.Span, got {type(span).__name__}")
    if not isinstance(span.name, str) or len(span.name.encode()) > DEFAULT_LIMITS.max_name:
        raise ArgumentError(f"{path}.name", f"a span name is a str of at most {DEFAULT_LIMITS.max_name} bytes")
    region = span.region
    if not isinstance(region, RegionHandle) or regions.get(region.region) is not region:
        raise ArgumentError(f"{path}.region", "not a region registered with this client")
    if isinstance(span.offset, bool) or not isinstance(span.offset, int) or span.offset < 0:
        raise ArgumentError(f"{path}.offset", f"expected a non-negative int, got {span.offset!r}")
    if isinstance(span.length, bool) or not isinstance(span.length, int) or span.length <= 0:
        raise ArgumentError(f"{path}.length", f"expected a positive int, got {span.length!r}")
    if span.offset + span.length > region.length:
        raise ArgumentError(
            f"{path}.offset",
            f"[{span.offset}, {span.offset + span.length}) lies outside the region of {region.length} bytes",
        )
    if pools is not None:
        pool = pools.get(span.pool)
        if pool is None:
            raise ArgumentError(f"{path}.pool", f"the node has no pool {span.pool!r} (pools: {sorted(pools)})")
        if span.length != pool.slot_size:
            raise ArgumentError(f"{path}.length", f"pool {span.pool!r} holds spans of {pool.slot_size} bytes, got {span.length}")
    return region


def wire_spans(spans: Any, path: str, regions: Regions, pools: Pools) -> tuple[tuple[Any, ...], set[RegionHandle]]:
    """Check spans and turn them into wire records (``SrcSpan`` where ``pools`` is given,
    else ``DstSpan``); the regions they use."""
    if isinstance(spans, Span) or not isinstance(spans, Sequence) or not spans:
        raise ArgumentError(path, "expected a non-empty sequence of Span")
    fast = _wire_columns(spans, regions, pools)
    if fast is not None:
        return fast
    deposit = pools is not None
    out: list[Any] = []
    append = out.append
    used: set[RegionHandle] = set()
    table: Mapping[Any, Any] = regions
    by_name = pools if pools is not None else {}
    max_name = DEFAULT_LIMITS.max_name // 4  # a str this short is within the byte limit in any encoding
    checked: RegionHandle | None = None
    for j, span in enumerate(spans):
        # Fast path for well-formed spans; anything unusual gets the detailed check,
        # which names the field.
        if type(span) is not Span:
            check_span(span, f"{path}[{j}]", regions, pools)
        name, region, offset, length = span.name, span.region, span.offset, span.length
        if region is not checked:
            if table.get(getattr(region, "region", None)) is not region:
                check_span(span, f"{path}[{j}]", regions, pools)
            used.add(region)
            checked = region
        if (
            type(name) is not str or len(name) > max_name
            or type(offset) is not int or type(length) is not int
            or offset < 0 or length <= 0
            or offset + length > region.length
            or (deposit and ((pool := by_name.get(span.pool)) is None or length != pool.slot_size))
        ):
            check_span(span, f"{path}[{j}]", regions, pools)
        # Spans are tuples on the wire: build them as tuples (what NamedTuple._make does).
        if deposit:
            append(_new_tuple(SrcSpan, (name, span.pool, region.region, offset, length)))
        else:
            append(_new_tuple(DstSpan, (name, region.region, offset, length)))
    return tuple(out), used


_FIELDS = operator.attrgetter("name", "region", "offset", "length", "pool")
_WIRE_COLUMNS_FROM = 32
"""Spans per key from which ``wire_spans`` first tries ``_wire_columns``."""


def _wire_columns(spans: Sequence[Any], regions: Regions, pools: Pools) -> tuple[tuple[Any, ...], set[RegionHandle]] | None:
    """``wire_spans`` for many well-formed ``Span`` in one region (an engine's usual layout),
    checked a column at a time in C loops (``map``, ``min``, ``max``) instead of span by span;
    None when they are not such spans, and the span-by-span path checks them and names the
    field at fault."""
    if len(spans) < _WIRE_COLUMNS_FROM or set(map(type, spans)) != {Span}:
        return None
    names, regs, offsets, lengths, span_pools = zip(*map(_FIELDS, spans), strict=True)
    region = regions.get(getattr(regs[0], "region", -1))
    if region is None or region is not regs[0] or regs.count(region) != len(regs):
        return None
    if set(map(type, names)) != {str} or max(map(len, names)) > DEFAULT_LIMITS.max_name // 4:
        return None
    if set(map(type, offsets)) != {int} or set(map(type, lengths)) != {int} or min(offsets) < 0 or min(lengths) <= 0 \
            or max(map(operator.add, offsets, lengths)) > region.length:
        return None
    if pools is None:
        return tuple(map(_new_tuple, repeat(DstSpan), zip(names, repeat(region.region), offsets, lengths))), {region}
    pool = pools.get(span_pools[0]) if span_pools.count(span_pools[0]) == len(span_pools) else None
    if pool is None or lengths.count(pool.slot_size) != len(lengths):
        return None
    return tuple(map(_new_tuple, repeat(SrcSpan), zip(names, span_pools, repeat(region.region), offsets, lengths))), {region}


def destination(spans: Any, owner: object, regions: Regions) -> Destination:
    """Destination spans checked once, for ``owner`` (the client that checked them)."""
    if isinstance(spans, Sequence) and len(spans) > DEFAULT_LIMITS.max_spans:
        raise ArgumentError("spans", f"{len(spans)} spans, at most {DEFAULT_LIMITS.max_spans}")
    wire, used = wire_spans(spans, "spans", regions, None)
    return Destination(owner, wire, frozenset(used))


def destination_wire(dest: Destination, owner: object, path: str, regions: Regions) -> tuple[tuple[Any, ...], set[RegionHandle]]:
    """A prepared ``Destination``'s wire spans and regions, if ``owner`` made it and its regions are still registered."""
    if dest.client is not owner:
        raise ArgumentError(path, "a Destination made by another client")
    for region in dest.regions:
        if regions.get(region.region) is not region:
            raise ArgumentError(path, f"region {region.region} of this Destination is no longer registered")
    return dest.wire, set(dest.regions)


def span_items(
    objects: Mapping[bytes, Any], item: Callable[[bytes, tuple[Any, ...]], Any], owner: object, regions: Regions,
    pools: Pools,
) -> tuple[tuple[Any, ...], list[bytes], set[RegionHandle]]:
    """A deposit's (``pools`` given) or deliver's wire items (each key's checked spans; a
    deliver may name a prepared ``Destination``), their keys, and the regions they use."""
    items, keys, used_all = [], [], set()
    for key, spans in checks.batch(objects, "objects", mapping=True):
        path = f"objects[{key!r}]"
        checks.key(key, path)
        if pools is None and type(spans) is Destination:
            wire, used = destination_wire(spans, owner, f"{path}.spans", regions)
        else:
            wire, used = wire_spans(spans, f"{path}.spans", regions, pools)
        items.append(item(key, wire))
        keys.append(key)
        used_all |= used
    checks.span_total(items, "spans", "objects")
    return tuple(items), keys, used_all


def deliver_columns(
    objects: Mapping[bytes, Any], items: tuple[DeliverItem, ...], groups: Sequence[Sequence[int]] | None,
) -> tuple[DeliverColumns, ...]:
    """``deliver_blocks`` of a deliver's items; one key delivered to a ``Destination`` takes
    the block that destination keeps for its plan, with only the key put in (an engine
    delivers layer after layer to the same spans: the columns of 1,024 spans are built once)."""
    if len(items) != 1 or type(dest := next(iter(objects.values()))) is not Destination:
        return deliver_blocks(items, groups)
    plan = None if groups is None else tuple(groups[0])
    kept = dest.blocks.get(plan)
    if kept is not None:
        return (replace(kept, keys=(items[0].key,)),)
    made = deliver_blocks(items, groups)
    if len(made) == 1:
        if len(dest.blocks) >= DESTINATION_PLANS:
            dest.blocks.clear()
        dest.blocks[plan] = made[0]
    return made


# --------------------------------------------------------------------- layer plans


PLAN_CACHE_SIZE = 256
"""Layer plans (with the span names they were applied to) whose group numbers are kept: an
engine passes the same plan for every request of a model."""
_plans: dict[tuple[tuple[tuple[str, ...], ...], tuple[str, ...]], tuple[int, ...]] = {}


SPANS_KEPT = 16
"""Spans tuples whose group numbers are kept by identity (``_by_spans``): the prepared
destinations an engine reuses. Few, since each keeps its tuple alive, and a deliver of a
list of spans brings a new tuple every time."""
_by_spans: dict[int, tuple[tuple[Any, ...], tuple[tuple[str, ...], ...], tuple[int, ...]]] = {}
"""Spans tuple id -> (the tuple, the plan's hashable form, its group numbers): the plan
applied to the spans last seen with it."""

_last: tuple[Any, Any, tuple[tuple[str, ...], ...] | None] = (None, None, None)
"""The plan seen last: the object, a copy of it (it may have changed since), its hashable form."""


def _frozen(plan: Any) -> tuple[tuple[str, ...], ...] | None:
    """A plan of lists or tuples of names as a hashable value, or None for anything else. The
    same plan object as last time, still equal to its copy, costs one comparison in C."""
    global _last
    last = _last
    if plan is last[0] and plan == last[1]:
        return last[2]
    if type(plan) not in (list, tuple) or len(plan) > MAX_GROUPS:
        return None
    try:
        frozen = tuple([tuple(names) if type(names) in (list, tuple) else names[()] for names in plan])
    except (TypeError, KeyError, IndexError):
        return None
    if not all(type(n) is str for names in frozen for n in names):
        return None
    _last = (plan, type(plan)(type(names)(names) for names in plan), frozen)
    return frozen


def plan_groups(items: Sequence[DeliverItem], plan: Any) -> list[tuple[int, ...]]:
    """Each key's group number per span (empty: one group) from a layer plan; ``ArgumentError``
    naming the part of the plan that is wrong.

    A plan shared by every key is read once, and kept with the span names it fitted (a
    plan is checked once per layout, not once per deliver); each other key costs one
    lookup per span. Only a plan that does not fit is walked again, to name what is wrong."""
    frozen = _frozen(plan)
    if frozen is not None:
        out = []
        for item in items:
            # A prepared Destination hands every deliver the same spans tuple: its numbers
            # under this plan are one identity lookup away.
            seen = _by_spans.get(id(item.spans))
            if seen is not None and seen[0] is item.spans and seen[1] is frozen:
                out.append(seen[2])
                continue
            names = tuple([span[0] for span in item.spans])
            numbers = _plans.get((frozen, names))
            if numbers is None:
                numbers = _fit(item, plan, names)
                if len(_plans) >= PLAN_CACHE_SIZE:
                    _plans.clear()
                _plans[frozen, names] = numbers
            if len(_by_spans) >= SPANS_KEPT:
                _by_spans.clear()
            _by_spans[id(item.spans)] = (item.spans, frozen, numbers)  # keeps the spans alive: the id stays theirs
            out.append(numbers)
        return out
    return _plan_groups(items, plan)


def _fit(item: DeliverItem, groups: Any, names: tuple[str, ...]) -> tuple[int, ...]:
    """One key's group numbers from a plan shared by every key (``plan_groups``, uncached)."""
    index = group_index(groups)
    if index is None or len(index) != len(names) or index.keys() != set(names):
        return plan_numbers(item, groups, "plan")
    return tuple([index[name] for name in names])


def _plan_groups(items: Sequence[DeliverItem], plan: Any) -> list[tuple[int, ...]]:
    """``plan_groups`` for a plan per key, or one of an unusual shape (walked every time)."""
    per_key = isinstance(plan, Mapping)
    if not per_key and (isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence)):
        raise ArgumentError("plan", "expected a sequence of groups of span names, or a mapping of key -> such a sequence")
    if per_key:
        unknown = [k for k in plan if k not in {item.key for item in items}]
        if unknown:
            raise ArgumentError(f"plan[{unknown[0]!r}]", "not a key of this deliver")
    shared = None if per_key else group_index(plan)
    out: list[tuple[int, ...]] = []
    for item in items:
        groups = plan.get(item.key) if per_key else plan
        if groups is None:
            out.append(())
            continue
        index = shared if shared is not None else group_index(groups)
        names = [span[0] for span in item.spans]
        # Fits when the plan names exactly the key's spans, each once.
        if index is None or len(index) != len(names) or index.keys() != set(names):
            out.append(plan_numbers(item, groups, f"plan[{item.key!r}]" if per_key else "plan"))
            continue
        out.append(tuple([index[name] for name in names]))
    return out


def group_index(groups: Any) -> dict[str, int] | None:
    """Span name -> group number of a plan for one key made of lists or tuples, each name
    once; None for anything else (``plan_numbers`` then walks it and names any fault)."""
    if type(groups) not in (list, tuple) or not groups or len(groups) > MAX_GROUPS:
        return None
    index: dict[str, int] = {}
    named = 0
    for g, names in enumerate(groups):
        if type(names) not in (list, tuple) or not names:
            return None
        named += len(names)
        for name in names:
            index[name] = g
    return index if len(index) == named else None


def plan_numbers(item: DeliverItem, groups: Any, path: str) -> tuple[int, ...]:
    """``item``'s group number per span from ``groups``, checked name by name; an
    ``ArgumentError`` naming the first thing that is wrong."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ArgumentError(path, "expected a non-empty sequence of groups of span names")
    if len(groups) > MAX_GROUPS:
        raise ArgumentError(path, f"{len(groups)} groups, at most {MAX_GROUPS}")
    index = {span[0]: j for j, span in enumerate(item.spans)}
    if len(index) != len(item.spans):
        raise ArgumentError(path, f"key {item.key!r} names a span twice: a plan names spans by name")
    numbers = [-1] * len(item.spans)
    for g, names in enumerate(groups):
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not names:
            raise ArgumentError(f"{path}[{g}]", "expected a non-empty sequence of span names")
        for n, name in enumerate(names):
            j = index.get(name)
            if j is None:
                raise ArgumentError(f"{path}[{g}][{n}]", f"{name!r} is not a span of key {item.key!r}")
            if numbers[j] != -1:
                raise ArgumentError(f"{path}[{g}][{n}]", f"span {name!r} is already in group {numbers[j]}")
            numbers[j] = g
    if -1 in numbers:
        missing = item.spans[numbers.index(-1)][0]
        raise ArgumentError(path, f"span {missing!r} of key {item.key!r} is in no group")
    return tuple(numbers)
