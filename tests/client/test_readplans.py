"""Planning READs under grants (``kvcr_client.readplans``), in process: the array path for
objects of many spans gives exactly the descriptors the span-by-span path gives, for
whole layouts, subsets, layer plans, scattered slots, several regions and bad sizes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvcr_client import readplans
from kvcr_client.readplans import LocalColumns, RemoteSpans, plan, remote_spans
from kvcr_client.regions import RegionHandle
from kvcr_protocol import DeliverItem, DstSpan, ErrorCode, MemoryKind

SLOT = 4096


@dataclass(frozen=True)
class Pool:
    kind: MemoryKind
    device: int
    address: int
    slot_size: int


@dataclass(frozen=True)
class Grant:
    names: tuple[str, ...]
    remote: RemoteSpans
    peer: str = "node"


POOLS = [Pool(MemoryKind.DRAM, 0, 1 << 40, SLOT), Pool(MemoryKind.DRAM, 0, 1 << 41, 2 * SLOT)]
REGIONS = {r: RegionHandle(r, MemoryKind.DRAM, (r + 1) << 36, 1 << 30, 0, None) for r in range(3)}


def rows(descs: Any) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in row) for row in (descs.tolist() if isinstance(descs, np.ndarray) else descs)]


def normal(plans: readplans.Plans) -> dict[Any, tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], list[int]]]:
    return {key: (rows(local), rows(remote), owners) for key, (local, remote, owners) in plans.items()}


def case(rng: random.Random, n: int, scattered: bool, regions: int) -> tuple[Grant, DeliverItem]:
    """A key of ``n`` spans of one slot each, its slots consecutive or scattered, its
    destination in one or several regions, with runs of consecutive offsets."""
    slots = list(range(n)) if not scattered else rng.sample(range(4 * n), n)
    grant = Grant(tuple(f"L{i}" for i in range(n)), remote_spans(POOLS, bytes(n), slots))
    spans, offset = [], 0
    for i in range(n):
        if rng.random() < 0.1:
            offset += SLOT  # a gap: a new run on the local side
        spans.append(DstSpan(f"L{i}", rng.randrange(regions) if regions > 1 else 0, offset, SLOT))
        offset += SLOT
    return grant, DeliverItem(b"k", tuple(spans))


def both(items: list[DeliverItem], grants: list[Grant], groups: Any = None) -> tuple[Any, Any, list[int], list[int]]:
    codes_rows, codes_arrays = [0] * len(items), [0] * len(items)
    old = readplans.VECTOR_SPANS
    try:
        readplans.VECTOR_SPANS = 10**9
        by_rows = plan(items, grants, groups, REGIONS, codes_rows, LocalColumns())
    finally:
        readplans.VECTOR_SPANS = old
    by_arrays = plan(items, grants, groups, REGIONS, codes_arrays, LocalColumns())
    return normal(by_rows), normal(by_arrays), codes_rows, codes_arrays


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("regions", [1, 3])
@pytest.mark.parametrize("planned", ["no", "in order", "interleaved"])
def test_the_array_path_plans_what_the_row_path_plans(scattered: bool, regions: int, planned: str) -> None:
    rng = random.Random(f"{scattered}{regions}{planned}")
    for n in (64, 65, 300, 1024):
        grant, item = case(rng, n, scattered, regions)
        numbers = [rng.randrange(8) for _ in range(n)]
        groups = None if planned == "no" else [tuple(sorted(numbers) if planned == "in order" else numbers)]
        by_rows, by_arrays, codes_rows, codes_arrays = both([item], [grant], groups)
        assert codes_rows == codes_arrays == [0]
        assert by_arrays == by_rows
        total = sum(size for local, _, _ in by_arrays.values() for _, size, _ in local)
        assert total == n * SLOT


def test_consecutive_slots_and_offsets_merge_into_one_descriptor() -> None:
    n = 1024
    grant = Grant(tuple(f"L{i}" for i in range(n)), remote_spans(POOLS, bytes(n), range(7, 7 + n)))
    item = DeliverItem(b"k", tuple(DstSpan(f"L{i}", 1, i * SLOT, SLOT) for i in range(n)))
    by_rows, by_arrays, _, _ = both([item], [grant])
    assert by_arrays == by_rows == {
        (0, "node", MemoryKind.DRAM, MemoryKind.DRAM): ([(REGIONS[1].address, n * SLOT, 0)], [((1 << 40) + 7 * SLOT, n * SLOT, 0)], [0]),
    }


def test_a_subset_and_a_second_key_in_the_same_reads() -> None:
    rng = random.Random(5)
    grant_a, item_a = case(rng, 200, True, 1)
    grant_b, item_b = case(rng, 100, False, 1)
    subset = DeliverItem(b"a", tuple(span for span in item_a.spans if int(span.name[1:]) % 3 == 0))
    small = DeliverItem(b"s", item_b.spans[:5])  # below the array threshold: rows
    grant_s = Grant(grant_b.names[:5], remote_spans(POOLS, bytes(5), range(500, 505)))
    by_rows, by_arrays, codes_rows, codes_arrays = both([subset, item_b, small], [grant_a, grant_b, grant_s])
    assert codes_rows == codes_arrays == [0, 0, 0]
    assert by_arrays == by_rows
    (owners,) = [owners for _, _, owners in by_arrays.values()]
    assert owners == [0, 1, 2]


def test_a_span_of_the_wrong_size_fails_its_key_alone() -> None:
    rng = random.Random(9)
    grant, item = case(rng, 128, False, 1)
    wrong = DeliverItem(b"w", (*item.spans[:-1], item.spans[-1]._replace(length=2 * SLOT)))
    ok_grant, ok_item = case(rng, 96, True, 1)
    by_rows, by_arrays, codes_rows, codes_arrays = both([wrong, ok_item], [grant, ok_grant])
    assert codes_rows == codes_arrays == [ErrorCode.SIZE_MISMATCH, 0]
    assert by_arrays == by_rows
    assert all(owners == [1] for _, _, owners in by_arrays.values())


def test_a_prepared_destinations_columns_are_kept_and_bounded() -> None:
    columns = LocalColumns()
    spans = tuple(DstSpan(f"L{i}", 0, i * SLOT, SLOT) for i in range(100))
    assert columns.of(spans) is columns.of(spans)
    for i in range(3 * readplans.COLUMNS_KEPT):
        columns.of(tuple(DstSpan(f"L{j}", 0, (i + j) * SLOT, SLOT) for j in range(70)))
    assert len(columns) == readplans.COLUMNS_KEPT
    offsets = columns.of(spans)[1]
    assert offsets.tolist() == [i * SLOT for i in range(100)]
