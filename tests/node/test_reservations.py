"""``Reservations``: client memory a write past its deadline may still reach (spec section 12).

Spans overlap when they share a byte of one region of one agent; touching ends do not. The
extents of a key are the same whether it came as records or as a column block, and the
reason for a refusal names the span by its field path.
"""

from __future__ import annotations

from kvcr_node.reservations import Reservations, record_extents, row_extents, write_extents
from kvcr_node.wanted import Wanted
from kvcr_protocol import DeliverItem, DstSpan, SrcSpan, deliver_blocks

ITEMS = (
    DeliverItem(b"a", (DstSpan("L0", 1, 0, 100), DstSpan("L1", 1, 200, 100))),
    DeliverItem(b"b", (DstSpan("L0", 2, 0, 100), DstSpan("L1", 1, 400, 100))),
)


def test_only_a_shared_byte_of_one_region_of_one_agent_overlaps() -> None:
    r = Reservations()
    assert not r.holds("x") and len(r) == 0 and r.overlap("x", [(1, 0, 1 << 40)]) is None
    r.reserve("x", 7, [(1, 100, 100)])
    r.reserve("x", 8, [(3, 0, 10)])
    r.reserve("y", 7, [(1, 0, 1000)])  # another agent's memory: write ids are the node's, agents apart
    assert len(r) == 3 and r.holds("x")
    assert r.overlap("x", [(1, 0, 100), (1, 200, 5), (2, 100, 100)]) is None  # touching ends, other regions
    assert r.overlap("x", [(1, 0, 100), (1, 199, 1)]) == 1
    assert r.overlap("x", [(3, 9, 100)]) == 0
    assert r.reason("x", [(1, 0, 100), (1, 150, 10)], "items[3].spans") == (
        "items[3].spans[1]: region 1 bytes 150..160 may still be written by an earlier transfer that failed "
        "DESTINATION_UNCERTAIN; reserved until that write is over (section 12)")
    r.end("x", 7)
    r.end("x", 7)  # once or more
    assert r.overlap("x", [(1, 150, 10)]) is None and r.overlap("x", [(3, 0, 1)]) == 0
    r.end("x", 8)
    assert not r.holds("x") and r.holds("y") and len(r) == 1
    r.reserve("z", 9, [])  # nothing to reserve: nothing kept
    assert not r.holds("z")


def test_records_and_columns_give_the_same_extents() -> None:
    [block] = deliver_blocks(ITEMS, None)
    expected = [[(1, 0, 100), (1, 200, 100)], [(2, 0, 100), (1, 400, 100)]]
    assert [record_extents(item.spans) for item in ITEMS] == expected
    assert [row_extents(block, row) for row in range(2)] == expected
    assert write_extents(ITEMS, ()) == write_extents((), (block,)) == expected[0] + expected[1]
    assert [Wanted(ITEMS).extents(i) for i in range(2)] == [Wanted((), (block,)).extents(i) for i in range(2)] == expected
    assert record_extents((SrcSpan("L0", "kv", 5, 64, 32),)) == [(5, 64, 32)]
