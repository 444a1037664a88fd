"""SlotAllocator: all-or-nothing allocation, strict frees, O(n) bookkeeping."""

from __future__ import annotations

import pytest

from kvcr_node.slots import OutOfSlots, SlotAllocator, SlotError


def healthy(alloc: SlotAllocator) -> None:
    assert alloc.check() == []
    assert alloc.free_count + alloc.allocated_count == alloc.total


def test_fresh_allocator_hands_out_low_indices_first() -> None:
    alloc = SlotAllocator(8)
    assert (alloc.total, alloc.free_count, alloc.allocated_count) == (8, 8, 0)
    assert alloc.alloc(3) == [0, 1, 2]
    assert alloc.alloc(2) == [3, 4]
    assert (alloc.free_count, alloc.allocated_count) == (3, 5)
    healthy(alloc)


def test_alloc_is_all_or_nothing() -> None:
    alloc = SlotAllocator(4)
    alloc.alloc(3)
    with pytest.raises(OutOfSlots) as info:
        alloc.alloc(2)
    assert (info.value.wanted, info.value.free) == (2, 1)
    assert alloc.free_count == 1
    healthy(alloc)
    assert alloc.alloc(1) == [3]
    with pytest.raises(OutOfSlots):
        alloc.alloc(1)
    healthy(alloc)


def test_alloc_zero_and_bad_counts() -> None:
    alloc = SlotAllocator(2)
    assert alloc.alloc(0) == []
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError):
            alloc.alloc(bad)  # type: ignore[arg-type]
    assert alloc.free_count == 2


def test_freed_slots_are_reused_in_the_order_they_were_freed() -> None:
    alloc = SlotAllocator(6)
    alloc.alloc(6)
    alloc.free([4, 1])
    assert alloc.is_allocated(0) and not alloc.is_allocated(4) and not alloc.is_allocated(1)
    assert alloc.alloc(2) == [4, 1]
    healthy(alloc)


def test_double_free_and_out_of_range_raise_and_free_nothing() -> None:
    alloc = SlotAllocator(4)
    slots = alloc.alloc(3)
    alloc.free([slots[0]])
    with pytest.raises(SlotError, match="not allocated"):
        alloc.free([slots[1], slots[0]])
    assert alloc.is_allocated(slots[1])
    with pytest.raises(SlotError, match="out of range"):
        alloc.free([slots[1], 4])
    with pytest.raises(SlotError, match="out of range"):
        alloc.free([-1])
    with pytest.raises(SlotError, match="twice"):
        alloc.free([slots[1], slots[1]])
    with pytest.raises(SlotError, match="not an int"):
        alloc.free(["1"])  # type: ignore[list-item]
    assert alloc.allocated_count == 2
    healthy(alloc)
    alloc.free(slots[1:])
    assert alloc.allocated_count == 0
    healthy(alloc)


def test_large_batches_name_the_bad_slot_and_free_nothing() -> None:
    """Batches of thousands are checked in bulk; one bad slot anywhere still names itself."""
    alloc = SlotAllocator(5000)
    slots = alloc.alloc(4000)
    alloc.free(slots[3000:])
    cases = [
        ([*slots[:2000], slots[3500]], "not allocated"),
        ([*slots[:1000], 5000, *slots[1000:2000]], "out of range"),
        ([*slots[:10], True, *slots[10:20]], "not an int"),
        ([*slots[:500], 1.0, *slots[500:600]], "not an int"),
        ([*slots[:800], slots[5]], "twice"),
    ]
    for batch, message in cases:
        with pytest.raises(SlotError, match=message):
            alloc.free(batch)  # type: ignore[arg-type]
        assert alloc.allocated_count == 3000
    healthy(alloc)
    alloc.free(slots[:3000])
    assert alloc.allocated_count == 0
    healthy(alloc)


def test_empty_and_invalid_totals() -> None:
    empty = SlotAllocator(0)
    assert empty.alloc(0) == []
    with pytest.raises(OutOfSlots):
        empty.alloc(1)
    for bad in (-1, 2**32, 1.5):
        with pytest.raises(ValueError):
            SlotAllocator(bad)  # type: ignore[arg-type]


def test_churn_keeps_every_slot_owned_once() -> None:
    alloc = SlotAllocator(100)
    held: list[list[int]] = []
    for i in range(500):
        n = (i * 7) % 9 + 1
        if alloc.free_count >= n:
            held.append(alloc.alloc(n))
        else:
            alloc.free(held.pop(0))
        owned = [s for batch in held for s in batch]
        assert len(owned) == len(set(owned)) == alloc.allocated_count
    healthy(alloc)
