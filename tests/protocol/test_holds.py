"""``SpanHolds``: spans held under tokens (the node's reservations, the client's uncertain destinations)."""

from __future__ import annotations

import random

from kvcr_protocol.holds import SpanHolds


def test_a_shared_byte_of_one_region_overlaps_and_touching_ends_do_not() -> None:
    holds = SpanHolds()
    assert not holds and holds.overlap([(1, 0, 1 << 40)]) is None
    holds.add(7, [(1, 100, 100), (2, 0, 10)])
    holds.add(8, [])  # nothing to hold: nothing kept
    assert len(holds) == 1
    assert holds.overlap([(1, 0, 100), (1, 200, 5), (3, 0, 1000)]) is None
    assert holds.overlap([(1, 0, 100), (1, 199, 1)]) == 1
    assert holds.overlap([(2, 9, 1)]) == 0
    holds.add(9, [(1, 150, 1)])
    assert sorted(holds.overlapping([(1, 140, 20)])) == [7, 9] and list(holds.overlapping([(2, 10, 5)])) == []
    holds.drop(7)
    holds.drop(7)  # once or more
    assert list(holds.overlapping([(1, 0, 1000), (2, 0, 10)])) == [9]
    holds.drop(9)
    assert not holds and len(holds) == 0


def test_overlap_agrees_with_a_byte_by_byte_model() -> None:
    rng = random.Random(20261206)
    for _ in range(300):
        holds, model = SpanHolds(), set()
        for token in range(rng.randrange(1, 5)):
            spans = [(rng.randrange(3), rng.randrange(64), rng.randrange(1, 16)) for _ in range(rng.randrange(1, 4))]
            holds.add(token, spans)
            model |= {(r, b) for r, o, n in spans for b in range(o, o + n)}
        probe = [(rng.randrange(3), rng.randrange(64), rng.randrange(1, 16)) for _ in range(rng.randrange(1, 5))]
        hits = [j for j, (r, o, n) in enumerate(probe) if any((r, b) in model for b in range(o, o + n))]
        assert holds.overlap(probe) == (hits[0] if hits else None), (probe, model)
