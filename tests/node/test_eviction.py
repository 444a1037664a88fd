"""EvictionIndex and the built-in policies (architecture §3), on bare entries without a store."""

from __future__ import annotations

import pytest

from kvcr_node.eviction import (
    EvictionEntry,
    EvictionIndex,
    EvictionPolicy,
    FifoPolicy,
    Layout,
    LayoutInfo,
    LruPolicy,
    make_policy,
)

A: Layout = (("x", "A"),)
B: Layout = (("x", "B"),)
AB: Layout = (("x", "A"), ("y", "B"))
AA: Layout = (("x", "A"), ("y", "A"))
INFOS = {layout: LayoutInfo(layout) for layout in (A, B, AB, AA)}


class Entry:
    """The least an object needs to sit in the index."""

    __slots__ = ("index_seq", "info", "key", "last_access")

    def __init__(self, key: str, layout: Layout, last_access: int = 0) -> None:
        self.key = key.encode()
        self.info = INFOS[layout]
        self.last_access = last_access
        self.index_seq = 0

    @property
    def layout(self) -> Layout:
        return self.info.layout


def keys(entries: list[Entry] | None) -> list[str] | None:
    return None if entries is None else [e.key.decode() for e in entries]


def healthy(index: EvictionIndex[Entry]) -> None:
    assert index.check() == []
    in_global, in_groups = index.members()
    assert {id(e) for e in in_global} == {id(e) for e in in_groups}
    assert len(in_global) == len(index)


def filled(policy: EvictionPolicy, spec: list[tuple[str, Layout]]) -> tuple[EvictionIndex[Entry], dict[str, Entry]]:
    index: EvictionIndex[Entry] = EvictionIndex(policy)
    entries = {}
    for i, (key, layout) in enumerate(spec):
        entries[key] = Entry(key, layout, last_access=i + 1)
        index.add(entries[key])
    healthy(index)
    return index, entries


def test_make_policy() -> None:
    assert isinstance(make_policy("fifo"), FifoPolicy)
    assert isinstance(make_policy("lru"), LruPolicy)
    assert make_policy("lru").name == "lru"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")


_CALLED: list[str] = []


def _not_a_policy() -> EvictionPolicy:
    """A callable that returns a policy but is not a policy class: it must never run."""
    _CALLED.append("called")
    return FifoPolicy()


class _NotAPolicy:
    def __init__(self) -> None:
        _CALLED.append("instantiated")


@pytest.mark.parametrize("attr", ["_not_a_policy", "_NotAPolicy", "_CALLED", "A"])
def test_make_policy_checks_the_class_before_calling_it(attr: str) -> None:
    """``module:attr`` must name an EvictionPolicy subclass; anything else is refused unrun."""
    _CALLED.clear()
    with pytest.raises(ValueError, match="is not an EvictionPolicy subclass"):
        make_policy(f"{__name__}:{attr}")
    assert _CALLED == []


def test_make_policy_refuses_the_abstract_base_and_loads_a_subclass() -> None:
    with pytest.raises(ValueError, match="abstract"):
        make_policy("kvcr_node.eviction:EvictionPolicy")
    assert make_policy("kvcr_node.eviction:FifoPolicy").name == "fifo"


def test_default_admission_hook_admits() -> None:
    assert make_policy("fifo").admit(b"k", A)


def test_fifo_order_and_selection_changes_nothing() -> None:
    index, e = filled(FifoPolicy(), [("a", A), ("b", A), ("c", A)])
    assert keys(index.select_victims({"A": 2})) == ["a", "b"]
    assert keys(index.select_victims({"A": 2})) == ["a", "b"]
    assert len(index) == 3 and all(x in index for x in e.values())
    assert keys(index.order()) == ["a", "b", "c"]
    healthy(index)


def test_fifo_release_goes_to_the_back() -> None:
    index, e = filled(FifoPolicy(), [("a", A), ("b", A), ("c", A)])
    index.remove(e["a"])  # claimed
    assert e["a"] not in index
    healthy(index)
    index.add(e["a"])  # released
    assert keys(index.order()) == ["b", "c", "a"]
    assert keys(index.select_victims({"A": 1})) == ["b"]
    healthy(index)


def test_lru_scores_last_access_when_added() -> None:
    index, e = filled(LruPolicy(), [("a", A), ("b", A), ("c", A)])
    index.remove(e["a"])
    e["a"].last_access = 10
    index.add(e["a"])
    index.remove(e["b"])
    index.add(e["b"])  # re-added without a new access: keeps its old place
    assert keys(index.order()) == ["b", "c", "a"]
    assert keys(index.select_victims({"A": 2})) == ["b", "c"]
    healthy(index)


def test_ties_go_in_insertion_order() -> None:
    index, _ = filled(LruPolicy(), [])
    for name in "pqr":
        index.add(Entry(name, A, last_access=5))
    assert keys(index.order()) == ["p", "q", "r"]


def test_custom_policy_score() -> None:
    class LargestKeyFirst(EvictionPolicy):
        name = "largest-key"

        def score(self, entry: EvictionEntry) -> float:
            return -int(entry.key)

    index, _ = filled(LargestKeyFirst(), [("3", A), ("9", A), ("1", A)])
    assert keys(index.select_victims({"A": 2})) == ["9", "3"]


def test_nan_score_is_refused() -> None:
    class Broken(EvictionPolicy):
        def score(self, entry: EvictionEntry) -> float:
            return float("nan")

    index: EvictionIndex[Entry] = EvictionIndex(Broken())
    entry = Entry("a", A)
    with pytest.raises(ValueError, match="NaN"):
        index.add(entry)
    assert entry not in index and len(index) == 0
    healthy(index)


def test_add_twice_and_remove_absent_raise() -> None:
    index, e = filled(FifoPolicy(), [("a", A)])
    with pytest.raises(ValueError, match="already"):
        index.add(e["a"])
    index.remove(e["a"])
    with pytest.raises(ValueError, match="not in"):
        index.remove(e["a"])
    healthy(index)


def test_empty_deficit_and_uncoverable_deficit() -> None:
    index, _ = filled(FifoPolicy(), [("a", A), ("b", AB)])
    assert index.select_victims({}) == []
    assert index.select_victims({"A": 0, "B": -3}) == []
    before = index.visits
    assert index.select_victims({"A": 4}) is None  # two A slots evictable, not four
    assert index.select_victims({"C": 1}) is None
    assert index.select_victims({"A": 1, "B": 2}) is None
    assert index.visits == before  # decided without walking
    assert len(index) == 2
    healthy(index)


def test_victims_are_whole_objects_and_stop_once_covered() -> None:
    index, _ = filled(FifoPolicy(), [("a", AA), ("b", AA), ("c", AA)])
    # One slot short: the whole first object goes (both its slots), nothing more.
    assert keys(index.select_victims({"A": 1})) == ["a"]
    assert keys(index.select_victims({"A": 3})) == ["a", "b"]


def test_a_look_ahead_leaves_out_what_keep_refuses_and_ends_at_most() -> None:
    """The disk tier's look (``visits`` given): objects ``keep`` refuses still cover the
    deficit but are not returned, and the walk ends once ``most`` were found."""
    index, _ = filled(FifoPolicy(), [(k, A) for k in "abcdefgh"])
    copied = {"a", "b", "d"}

    def keep(entry: Entry) -> bool:
        return entry.key.decode() not in copied

    assert keys(index.select_victims({"A": 5}, 100, keep)) == ["c", "e"]  # a..e cover five slots
    before = index.visits
    assert keys(index.select_victims({"A": 8}, 100, keep, most=2)) == ["c", "e"]
    assert index.visits - before == 5, "the walk ends at the second object kept"
    assert keys(index.select_victims({"A": 8}, 100, keep, most=0)) == []
    assert keys(index.order()) == list("abcdefgh"), "a look changes nothing"
    healthy(index)


def test_fast_path_looks_at_no_unrelated_object() -> None:
    spec = [(f"a{i}", A) for i in range(10_000)] + [(f"b{i}", B) for i in range(8)]
    index, _ = filled(FifoPolicy(), spec)
    assert keys(index.select_victims({"B": 3})) == ["b0", "b1", "b2"]
    assert index.visits == 3


def test_overlapping_groups_walk_the_global_order() -> None:
    # Groups (A,), (A,B), (B,) all touch the deficit pools: the global queue decides.
    index, _ = filled(FifoPolicy(), [("b1", B), ("a1", A), ("ab", AB), ("b2", B)])
    assert keys(index.select_victims({"A": 1, "B": 1})) == ["b1", "a1"]
    assert keys(index.select_victims({"A": 2})) == ["a1", "ab"]
    # The walk looks at b1 but skips it: it uses no pool in deficit.
    before = index.visits
    assert keys(index.select_victims({"A": 2, "B": 1})) == ["b1", "a1", "ab"]
    assert index.visits - before == 3
    healthy(index)


def test_walk_skips_objects_whose_pools_are_already_covered() -> None:
    index, _ = filled(FifoPolicy(), [("a1", A), ("a2", A), ("ab", AB)])
    # After a1, pool A is covered; a2 would free only A, so the walk passes it by.
    assert keys(index.select_victims({"A": 1, "B": 1})) == ["a1", "ab"]


def test_single_group_using_two_deficit_pools_takes_the_fast_path() -> None:
    spec = [(f"a{i}", A) for i in range(1_000)] + [("ab1", AB), ("ab2", AB)]
    index, e = filled(FifoPolicy(), spec)
    for i in range(1_000):
        index.remove(e[f"a{i}"])
    # Only (A,B) touches A and B now.
    assert keys(index.select_victims({"A": 2, "B": 1})) == ["ab1", "ab2"]
    assert index.visits == 2
    healthy(index)


def test_removed_objects_are_skipped_and_dead_items_compacted() -> None:
    index, e = filled(FifoPolicy(), [(f"k{i}", A) for i in range(1_000)])
    for i in range(0, 1_000, 2):
        index.remove(e[f"k{i}"])
    healthy(index)
    assert keys(index.select_victims({"A": 2})) == ["k1", "k3"]
    assert index.visits == 2
    for i in range(1, 1_000, 2):
        index.remove(e[f"k{i}"])
    assert len(index) == 0
    assert index.select_victims({"A": 1}) is None
    # The heaps do not keep more dead items than a small bound once empty.
    for i in range(200):
        index.add(e[f"k{i}"])
        index.remove(e[f"k{i}"])
    assert len(index._global.items) <= 200
    healthy(index)


def test_layout_index_forgets_empty_groups() -> None:
    index, e = filled(FifoPolicy(), [("a", A), ("ab", AB)])
    index.remove(e["ab"])
    assert set(index._groups) == {("A",)}
    assert index._pool_sigs == {"A": {("A",)}}
    assert index.evictable_slots("B") == 0
    healthy(index)
