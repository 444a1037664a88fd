"""``Presences``: a query's answers read lazily, the same from columns as from records (spec section 6.9)."""

from __future__ import annotations

import random

import pytest

from kvcr_client import KeyPresence, Presence, Presences
from kvcr_protocol import QueryColumns, QueryResult

ANSWERS = [QueryResult(Presence.HIT, "dram"), QueryResult(Presence.HIT, "hbm:3"), QueryResult(Presence.FETCHING, "dram"),
           QueryResult(Presence.FETCHABLE, "remote"), QueryResult(Presence.MISS)]


@pytest.mark.parametrize("seed", range(5))
def test_columns_and_records_read_the_same(seed: int) -> None:
    rng = random.Random(seed)
    keys = tuple(f"k{rng.randrange(40)}".encode() for _ in range(rng.randrange(1, 60)))  # repeats included
    results = [rng.choice(ANSWERS) for _ in keys]
    views = [Presences(keys, QueryColumns.from_results(results)), Presences(keys, tuple(results))]
    expected = [KeyPresence(r.presence, r.tier) for r in results]
    last = dict(zip(keys, expected, strict=True))  # a key asked twice reads its last answer
    for view in views:
        assert len(view) == len(keys) and list(view) == list(keys)
        assert [view.at(i) for i in range(len(keys))] == expected
        assert {k: view[k] for k in keys} == last and dict(view.items()) == last
        assert keys[0] in view and b"other" not in view and 5 not in view
        with pytest.raises(KeyError):
            view[b"other"]
        assert view.all_ok
    assert views[0] == views[1]
    assert views[0].at(0) is views[0].at(0)  # one KeyPresence per distinct answer


def test_answers_and_keys_must_match() -> None:
    with pytest.raises(ValueError, match="2 answers for 1 keys"):
        Presences((b"k",), (ANSWERS[0], ANSWERS[1]))
