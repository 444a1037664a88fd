"""The churn tests' heap check: what is kept per cycle counts, an interpreter table that doubled does not."""

from __future__ import annotations

from kvcr_testing.measure import RESIZE_BYTES, Heap

SMALL = 200


def _blocks(sizes: list[int]) -> list[bytearray]:
    return [bytearray(size) for size in sizes]  # one call site for every block, small or large


def test_many_small_blocks_count() -> None:
    with Heap() as heap:
        kept = _blocks([SMALL] * 5000)
        grown = heap.grown()
    assert grown >= 5000 * SMALL, heap.where
    assert not any("not counted" in line for line in heap.where)
    del kept


def test_one_large_block_is_a_table_even_where_its_site_freed_others() -> None:
    # The site that allocated the table also freed blocks in the window, so its count of
    # blocks went down while its bytes went up: the table is still left out, block by block.
    with Heap() as heap:
        for window, sizes in enumerate(([SMALL] * 6, [2 * RESIZE_BYTES])):
            kept = _blocks(sizes)  # the same call site in both windows
            if window == 0:
                heap.rebase()
        grown = heap.grown()
    assert grown < RESIZE_BYTES, heap.where
    assert any(line.startswith("(a table resized, not counted)") and " in -" in line for line in heap.where), heap.where
    del kept


def test_a_table_present_at_both_ends_counts_only_its_growth() -> None:
    with Heap() as heap:
        for window, sizes in enumerate(([RESIZE_BYTES], [RESIZE_BYTES, SMALL * 10])):
            kept = _blocks(sizes)
            if window == 0:
                heap.rebase()
        grown = heap.grown()
    assert grown < RESIZE_BYTES // 2, heap.where
    del kept
