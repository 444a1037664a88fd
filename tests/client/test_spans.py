"""``wire_spans``: the column path for many spans in one region gives what the span-by-span
path gives, and every span it cannot vouch for goes span by span, refused by name.

Pure: regions are described from numpy buffers (``describe_region``), nothing is registered.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcr_client.errors import ArgumentError
from kvcr_client.regions import describe_region
from kvcr_client.spans import (
    _WIRE_COLUMNS_FROM,
    DESTINATION_PLANS,
    Destination,
    Span,
    deliver_columns,
    plan_groups,
    wire_spans,
)
from kvcr_protocol import DeliverItem, DstSpan, PoolInfo
from kvcr_protocol.columns import deliver_blocks

SLOT = 4096
N = 2 * _WIRE_COLUMNS_FROM


@pytest.fixture(scope="module")
def world() -> tuple[Any, Any, dict[int, Any], dict[str, PoolInfo]]:
    a, b = describe_region(np.zeros(N * SLOT, np.uint8), 1), describe_region(np.zeros(N * SLOT, np.uint8), 2)
    pools = {"kv": PoolInfo("kv", SLOT, 64, "dram"), "big": PoolInfo("big", 2 * SLOT, 8, "dram")}
    return a, b, {1: a, 2: b}, pools


def spans(region: Any, n: int = N, pool: str = "kv") -> list[Span]:
    return [Span(f"L{i}", region, i * SLOT, SLOT, pool) for i in range(n)]


def one_by_one(given: list[Span], regions: dict[int, Any], pools: Any) -> tuple[tuple[Any, ...], set[Any]]:
    """The span-by-span path: each span alone (below the column path's threshold)."""
    wire: list[Any] = []
    used: set[Any] = set()
    for span in given:
        w, u = wire_spans([span], "s", regions, pools)
        wire.extend(w)
        used |= u
    return tuple(wire), used


@pytest.mark.parametrize("deposit", [True, False], ids=["deposit", "deliver"])
def test_the_column_path_gives_the_span_by_span_wire(world: Any, deposit: bool) -> None:
    a, _, regions, pools = world
    given = spans(a)
    got = wire_spans(given, "s", regions, pools if deposit else None)
    want = one_by_one(given, regions, pools if deposit else None)
    assert got == want
    assert all(type(w) is type(want[0][0]) for w in got[0])


def test_spans_of_two_regions_or_pools_go_span_by_span_and_are_the_same(world: Any) -> None:
    a, b, regions, pools = world
    mixed = spans(a)[: N // 2] + [Span(s.name + "b", b, s.offset, s.length, "kv") for s in spans(b)[: N // 2]]
    assert wire_spans(mixed, "s", regions, pools) == one_by_one(mixed, regions, pools)
    both = [Span(s.name, a, s.offset, SLOT * (1 + i % 2), "kv" if i % 2 == 0 else "big")
            for i, s in enumerate(spans(a, N // 2))]
    both = [Span(s.name, a, 2 * i * SLOT, s.length, s.pool) for i, s in enumerate(both)]
    assert wire_spans(both, "s", regions, pools) == one_by_one(both, regions, pools)


@pytest.mark.parametrize("bad, field", [
    (lambda s, a: Span(s.name, a, True, s.length, s.pool), "offset"),
    (lambda s, a: Span(s.name, a, -1, s.length, s.pool), "offset"),
    (lambda s, a: Span(s.name, a, s.offset, 0, s.pool), "length"),
    (lambda s, a: Span(s.name, a, N * SLOT, SLOT, s.pool), "offset"),
    (lambda s, a: Span(s.name, a, s.offset, SLOT // 2, s.pool), "length"),
    (lambda s, a: Span(s.name, a, s.offset, s.length, "nope"), "pool"),
    (lambda s, a: Span("x" * 10_000, a, s.offset, s.length, s.pool), "name"),
    (lambda s, a: Span(7, a, s.offset, s.length, s.pool), "name"),  # type: ignore[arg-type]
    (lambda s, a: ("L0", a, 0, SLOT, "kv"), ""),
], ids=["bool-offset", "negative-offset", "zero-length", "past-the-region", "not-a-slot", "unknown-pool",
        "long-name", "name-not-str", "not-a-span"])
def test_one_bad_span_among_many_is_refused_naming_it(world: Any, bad: Any, field: str) -> None:
    a, _, regions, pools = world
    given: list[Any] = spans(a)
    given[N - 3] = bad(given[N - 3], a)
    with pytest.raises(ArgumentError) as many:
        wire_spans(given, "s", regions, pools)
    assert many.value.field.startswith(f"s[{N - 3}]") and many.value.field.endswith(field), many.value.field


def test_a_region_that_is_not_registered_is_refused_among_many(world: Any) -> None:
    a, _, regions, pools = world
    stranger = describe_region(np.zeros(N * SLOT, np.uint8), 1)  # region id 1, not the registered handle
    with pytest.raises(ArgumentError) as info:
        wire_spans(spans(stranger), "s", regions, pools)
    assert info.value.field.startswith("s[0]"), info.value.field
    del a


def _item(key: bytes, names: list[str]) -> DeliverItem:
    return DeliverItem(key, tuple(DstSpan(name, 1, i * 8, 8) for i, name in enumerate(names)))


def test_a_plan_reapplied_to_the_same_spans_gives_its_numbers_and_a_changed_plan_its_own() -> None:
    """``plan_groups`` keeps the numbers of the spans tuple it saw last with a plan (what a
    prepared Destination hands every deliver): the same tuple under the same plan gets
    them; the plan edited in place, another plan, or other spans are worked out anew."""
    item = _item(b"k", ["L0", "L1", "L2", "L3"])
    plan = [["L0"], ["L1"], ["L2"], ["L3"]]
    assert plan_groups([item], plan) == [(0, 1, 2, 3)]
    assert plan_groups([item], plan) == [(0, 1, 2, 3)]
    plan[1:] = [["L1", "L2", "L3"]]  # the same list, edited
    assert plan_groups([item], plan) == [(0, 1, 1, 1)]
    assert plan_groups([item], [["L3", "L2"], ["L1", "L0"]]) == [(1, 1, 0, 0)]
    other = _item(b"k", ["L3", "L2", "L1", "L0"])
    assert plan_groups([other], plan) == [(1, 1, 1, 0)]
    assert plan_groups([item, other], plan) == [(0, 1, 1, 1), (1, 1, 1, 0)]
    with pytest.raises(ArgumentError):
        plan_groups([_item(b"k", ["L0", "L9"])], plan)


def test_a_destination_keeps_its_block_per_plan_and_only_the_key_changes() -> None:
    """One key delivered to a ``Destination``: the block is the one ``deliver_blocks`` makes,
    for every key and plan, built once per plan; several keys, or plain spans, are built anew."""
    wire = tuple(DstSpan(f"L{i}", 3, i * 4096, 4096) for i in range(64))
    dest = Destination(object(), wire, frozenset())
    plans: list[list[tuple[int, ...]] | None] = [None, [tuple(i // 2 for i in range(64))], [tuple(range(64))]]
    for key in (b"a", b"b", b"c"):
        for groups in plans:
            items = (DeliverItem(key, wire),)
            got = deliver_columns({key: dest}, items, groups)
            assert got == deliver_blocks(items, groups) and got[0].keys == (key,)
    assert set(dest.blocks) == {None, tuple(i // 2 for i in range(64)), tuple(range(64))}
    kept = dict(dest.blocks)
    two = (DeliverItem(b"a", wire), DeliverItem(b"b", wire))
    assert deliver_columns({b"a": dest, b"b": dest}, two, None) == deliver_blocks(two, None)
    assert deliver_columns({b"a": list(wire)}, two[:1], None) == deliver_blocks(two[:1], None)
    assert dest.blocks == kept
    for n in range(DESTINATION_PLANS + 1):  # bounded: past the limit it forgets them all
        deliver_columns({b"a": dest}, two[:1], [tuple(min(i, n) for i in range(64))])
    assert len(dest.blocks) <= DESTINATION_PLANS
