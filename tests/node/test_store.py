"""Store: deposits, claims, eviction through the index, capacity pressure (architecture §2, architecture §3)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcr_node.eviction import EvictionEntry, EvictionPolicy, Layout, make_policy
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import LOOKUP_ABSENT, DepositOutcome, ObjectEntry, ObjectState, Store, StoreError, lookup_code

KiB = 1024
NEW = DepositOutcome.NEW


def span(pool: str, n: int = 1, prefix: str = "L") -> Layout:
    return tuple((f"{prefix}{i}", pool) for i in range(n))


def ok(store: Store) -> None:
    """Every test step ends here: the store reports no breach."""
    assert store.check_invariants() == []


def make(pools: Sequence[tuple[str, int]], policy: str | EvictionPolicy = "fifo", **kw: float) -> Store:
    specs = [PoolSpec(name, 4 * KiB, count) for name, count in pools]
    store = Store(specs, make_policy(policy) if isinstance(policy, str) else policy, **kw)
    ok(store)
    return store


def put(store: Store, key: bytes, layout: Layout, *, commit: bool = True) -> ObjectEntry:
    outcome, entry = store.begin_deposit(key, layout)
    assert outcome is NEW and entry is not None, outcome
    ok(store)
    if commit:
        store.commit(entry)
        ok(store)
    return entry


def present(store: Store, *keys: bytes) -> list[bytes]:
    return [k for k in keys if store.lookup(k) is not None]


# -- deposits -------------------------------------------------------------------------


def test_deposit_commit_lifecycle() -> None:
    store = make([("A", 4)])
    outcome, entry = store.begin_deposit(b"k", span("A", 2))
    assert outcome is NEW and entry is not None
    assert entry.state is ObjectState.WRITING and entry.slots == (0, 1)
    assert entry.layout == (("L0", "A"), ("L1", "A"))
    assert entry not in store.index
    ok(store)
    store.commit(entry)
    assert (entry.state, entry in store.index) == (ObjectState.READY, True)
    assert entry.last_access == store.tick == 1
    assert store.lookup(b"k") is entry and b"k" in store and len(store) == 1
    ok(store)


def test_lookup_codes_say_each_keys_tier_and_state() -> None:
    """One byte per key (spec section 6.9): absent, or the tier of its first span's pool and its state."""
    specs = [PoolSpec("H1", 4 * KiB, 4, "hbm:1"), PoolSpec("D", 4 * KiB, 4), PoolSpec("H1b", 4 * KiB, 4, "hbm:1")]
    store = Store(specs, make_policy("fifo"))
    assert store.tiers == ("hbm:1", "dram")
    writing = put(store, b"w", (("a", "D"), ("b", "H1")), commit=False)
    put(store, b"r", (("a", "H1b"),))
    put(store, b"d", span("D"))
    codes = store.lookup_codes([b"r", b"w", b"none", b"d", b"r"])
    assert codes == bytes([
        lookup_code(0, ObjectState.READY), lookup_code(1, ObjectState.WRITING), LOOKUP_ABSENT,
        lookup_code(1, ObjectState.READY), lookup_code(0, ObjectState.READY),
    ])
    assert LOOKUP_ABSENT == 0 and 1 not in codes  # codes start at 2: callers may use 1
    store.commit(writing)
    assert store.lookup_codes([b"w"]) == bytes([lookup_code(1, ObjectState.READY)]) and store.lookup_codes([]) == b""
    ok(store)
    assert store.remove(b"d") and store.lookup_codes([b"d"]) == bytes([LOOKUP_ABSENT])
    ok(store)


def test_duplicate_for_writing_and_ready() -> None:
    store = make([("A", 4)])
    entry = put(store, b"k", span("A", 2), commit=False)
    same_layout = tuple(("L" + str(i), "A") for i in range(2))  # equal, not identical
    assert store.begin_deposit(b"k", same_layout) == (DepositOutcome.DUPLICATE, entry)
    store.commit(entry)
    assert store.begin_deposit(b"k", same_layout, optional=True) == (DepositOutcome.DUPLICATE, entry)
    assert store.pool_stats()["A"]["allocated"] == 2  # no second set of slots
    ok(store)


def test_layout_mismatch() -> None:
    store = make([("A", 4), ("B", 4)])
    entry = put(store, b"k", span("A", 2))
    for other in (span("A", 1), span("B", 2), span("A", 2, prefix="M"), (("x", "nowhere"),)):
        assert store.begin_deposit(b"k", other) == (DepositOutcome.LAYOUT_MISMATCH, entry)
    assert len(store) == 1
    ok(store)


def test_unknown_pool_and_malformed_layouts() -> None:
    store = make([("A", 4)])
    assert store.begin_deposit(b"k", (("L0", "A"), ("L1", "Z"))) == (DepositOutcome.UNKNOWN_POOL, None)
    for bad in ((), [("L0", "A")], (("L0",),), (("L0", 1),), ("L0A",), (["L0", "A"],)):
        with pytest.raises(StoreError):
            store.begin_deposit(b"k", bad)  # type: ignore[arg-type]
    with pytest.raises(StoreError):
        store.begin_deposit("k", span("A"))  # type: ignore[arg-type]
    assert len(store) == 0
    ok(store)


def test_layout_larger_than_the_pool_is_capacity_without_evicting() -> None:
    store = make([("A", 4), ("B", 2)])
    put(store, b"a", span("A", 4))
    put(store, b"b", span("B", 1))
    assert store.begin_deposit(b"big", span("B", 3)) == (DepositOutcome.CAPACITY, None)
    assert store.begin_deposit(b"mix", span("A", 1) + span("B", 3, prefix="M")) == (DepositOutcome.CAPACITY, None)
    assert present(store, b"a", b"b") == [b"a", b"b"]
    assert store.stats()["evicted_objects"] == 0
    ok(store)


def test_equal_layouts_share_one_tuple_until_the_last_object_goes() -> None:
    store = make([("A", 8)])
    first = put(store, b"1", span("A", 2))
    second = put(store, b"2", span("A", 2))
    assert first.layout is second.layout and first.info is second.info
    store.remove(b"1")
    store.remove(b"2")
    assert store._layouts == {}
    ok(store)


# -- eviction -------------------------------------------------------------------------


def test_repeated_eviction_keeps_the_newest() -> None:
    store = make([("A", 4)])
    for i in range(20):
        put(store, b"%d" % i, span("A"))
        assert len(store) == min(i + 1, 4)
    assert sorted(store._objects) == [b"16", b"17", b"18", b"19"]
    assert store.stats()["evictions"] == {"A": 16}
    assert store.stats()["evicted_objects"] == 16


def test_eviction_takes_whole_objects_and_frees_all_their_pools() -> None:
    store = make([("A", 4), ("B", 4)])
    put(store, b"ab", span("A", 2) + span("B", 3, prefix="M"))
    put(store, b"a", span("A", 2))
    # Needs 1 B slot: only "ab" uses B, so it goes, with its 2 A slots.
    put(store, b"b", span("B", 2))
    assert present(store, b"ab", b"a", b"b") == [b"a", b"b"]
    stats = store.pool_stats()
    assert (stats["A"]["free"], stats["B"]["free"]) == (2, 2)
    assert store.stats()["evictions"] == {"A": 1, "B": 1}


def test_writing_and_claimed_objects_are_never_evicted() -> None:
    store = make([("A", 3)])
    writing = put(store, b"w", span("A"), commit=False)
    claimed = put(store, b"c", span("A"))
    store.claim(claimed)
    put(store, b"e", span("A"))
    n = put(store, b"n", span("A"))  # evicts e, the only evictable one
    assert present(store, b"w", b"c", b"e", b"n") == [b"w", b"c", b"n"]
    store.claim(n)
    assert store.begin_deposit(b"x", span("A")) == (DepositOutcome.CAPACITY, None)
    assert writing.state is ObjectState.WRITING
    ok(store)


def test_all_or_nothing_when_candidates_cannot_cover() -> None:
    store = make([("A", 4), ("B", 2)])
    held = [put(store, b"h%d" % i, span("A")) for i in range(2)]
    for entry in held:
        store.claim(entry)
    put(store, b"e0", span("A"))
    put(store, b"e1", span("A"))
    b0 = put(store, b"b0", span("B", 2))

    def snapshot() -> object:
        return sorted(store._objects), store.stats(), store.pool_stats(), store.index.visits, store.index.order()

    before = snapshot()
    # Three A slots wanted, two evictable.
    assert store.begin_deposit(b"x", span("A", 3)) == (DepositOutcome.CAPACITY, None)
    assert snapshot() == before
    ok(store)
    # A is coverable, B is not (its only object is claimed): nothing at all goes.
    store.claim(b0)
    before = snapshot()
    assert store.begin_deposit(b"y", span("A", 1) + span("B", 1, prefix="M")) == (DepositOutcome.CAPACITY, None)
    assert snapshot() == before
    ok(store)


def test_overlapping_layouts_keep_the_global_policy_order() -> None:
    # Groups (A,), (A,B), (B,) all touch the deficit pools: the global FIFO order decides.
    # a first: a covers A, then ab covers B. b first: b covers B, then ab covers A
    # (the walk reaches ab before a). Either way the newest object of the three stays.
    for first, expect_gone in ((b"a", {b"a", b"ab"}), (b"b", {b"b", b"ab"})):
        store = make([("A", 2), ("B", 2)])
        order = [first, b"ab", b"a" if first == b"b" else b"b"]
        layouts = {b"a": span("A"), b"b": span("B"), b"ab": span("A") + span("B", prefix="M")}
        for key in order:
            put(store, key, layouts[key])
        put(store, b"new", span("A") + span("B", prefix="M"))
        gone = {k for k in order if store.lookup(k) is None}
        assert gone == expect_gone, (order, gone)
        ok(store)


def test_fifo_and_lru_orders_differ_on_a_release_without_access() -> None:
    for policy, victim in (("fifo", b"b"), ("lru", b"a")):
        store = make([("A", 3)], policy)
        a = put(store, b"a", span("A"))
        put(store, b"b", span("A"))
        put(store, b"c", span("A"))
        store.claim(a)
        store.unclaim(a, accessed=False)  # FIFO: back of the queue; LRU: keeps its old access
        put(store, b"d", span("A"))
        assert store.lookup(victim) is None, policy
        assert len(store) == 3
        ok(store)


def test_lru_evicts_least_recently_accessed() -> None:
    store = make([("A", 3)], "lru")
    a, b, c = (put(store, k, span("A")) for k in (b"a", b"b", b"c"))
    for entry in (b, a):  # accesses: c oldest, then b, then a
        store.claim(entry)
        store.unclaim(entry)
    assert c.last_access < b.last_access < a.last_access
    put(store, b"d", span("A"))
    assert present(store, b"a", b"b", b"c") == [b"a", b"b"]
    put(store, b"e", span("A"))
    assert present(store, b"a", b"b") == [b"a"]
    ok(store)


def test_fifo_release_puts_the_object_at_the_back() -> None:
    store = make([("A", 3)], "fifo")
    a = put(store, b"a", span("A"))
    put(store, b"b", span("A"))
    put(store, b"c", span("A"))
    store.claim(a)
    store.unclaim(a)
    assert [e.key for e in store.index.order()] == [b"b", b"c", b"a"]
    put(store, b"d", span("A"))
    put(store, b"e", span("A"))
    assert present(store, b"a", b"b", b"c") == [b"a"]
    ok(store)


def test_disjoint_fast_path_visits_only_the_victims() -> None:
    store = make([("A", 10_000), ("B", 8)])
    for i in range(10_000):
        put_fast(store, b"a%d" % i, span("A"))
    for i in range(8):
        put_fast(store, b"b%d" % i, span("B"))
    ok(store)
    before = store.index.visits
    for i in range(8):
        outcome, entry = store.begin_deposit(b"n%d" % i, span("B"))
        assert outcome is NEW and entry is not None
        store.commit(entry)
    assert store.index.visits - before == 8
    assert store.stats()["evictions"] == {"A": 0, "B": 8}
    assert store.pool_stats()["A"]["evictable"] == 10_000
    ok(store)


def put_fast(store: Store, key: bytes, layout: Layout) -> None:
    outcome, entry = store.begin_deposit(key, layout)
    assert outcome is NEW and entry is not None
    store.commit(entry)


def test_custom_policy_with_its_own_score() -> None:
    class OldestKeyNumberLast(EvictionPolicy):
        """Evicts the highest-numbered key first."""

        name = "custom"

        def score(self, entry: EvictionEntry) -> float:
            return -int(entry.key)

    store = make([("A", 3)], OldestKeyNumberLast())
    for key in (b"5", b"9", b"2"):
        put(store, key, span("A"))
    put(store, b"1", span("A"))
    put(store, b"0", span("A"))
    assert sorted(store._objects) == [b"0", b"1", b"2"]
    ok(store)


def test_dropped_by_an_admission_hook_only_when_optional() -> None:
    class NoShortKeys(EvictionPolicy):
        name = "no-short"

        def __init__(self) -> None:
            self.asked: list[tuple[bytes, Layout]] = []

        def score(self, entry: EvictionEntry) -> float:
            return 0

        def admit(self, key: bytes, layout: Layout) -> bool:
            self.asked.append((key, layout))
            return len(key) > 2

    policy = NoShortKeys()
    store = make([("A", 4)], policy)
    assert store.begin_deposit(b"k", span("A"), optional=True) == (DepositOutcome.DROPPED, None)
    assert store.begin_deposit(b"long", span("A"), optional=True)[0] is NEW
    assert store.begin_deposit(b"k", span("A"))[0] is NEW  # not optional: no hook
    assert policy.asked == [(b"k", span("A")), (b"long", span("A"))]
    ok(store)


class FaultyPolicy(EvictionPolicy):
    """A plug-in with defects: scores and admission answers that raise or are not what they must be."""

    name = "faulty"

    def score(self, entry: EvictionEntry) -> float:
        key = entry.key
        if key.startswith(b"raise"):
            raise RuntimeError("score defect")
        if key.startswith(b"nan"):
            return float("nan")
        if key.startswith(b"text"):
            return "late"  # type: ignore[return-value]
        return 10.0

    def admit(self, key: bytes, layout: Layout) -> bool:
        if key.startswith(b"raise"):
            raise RuntimeError("admit defect")
        if key.startswith(b"none"):
            return None  # type: ignore[return-value]
        if key.startswith(b"badrepr"):
            return BadRepr()  # type: ignore[return-value]
        return not key.startswith(b"no")


class BadRepr:
    """An answer whose repr raises: logging the defect must not raise out of the guard."""

    def __repr__(self) -> str:
        raise RuntimeError("repr defect")


def test_plug_in_policy_failures_are_contained(caplog: pytest.LogCaptureFixture) -> None:
    """A plug-in that raises or answers nonsense never breaks the store: defaults apply, failures count."""
    policy = make_policy(f"{__name__}:FaultyPolicy")
    assert policy.name == "faulty"
    store = make([("A", 4)], policy)
    # Admission: a defect admits (as if there were no hook); a plain "no" still drops.
    assert store.begin_deposit(b"raise-1", span("A"), optional=True)[0] is NEW
    assert store.begin_deposit(b"none-1", span("A"), optional=True)[0] is NEW
    assert store.begin_deposit(b"no-1", span("A"), optional=True) == (DepositOutcome.DROPPED, None)
    assert store.begin_deposit(b"badrepr", span("A"), optional=True)[0] is NEW
    store.abandon(store.lookup(b"badrepr"))  # type: ignore[arg-type]
    for key in (b"raise-1", b"none-1"):
        entry = store.lookup(key)
        assert entry is not None
        store.commit(entry)
    ok(store)
    # Scores: a defect counts as 0 (evicted before the well-scored objects).
    put(store, b"good", span("A"))
    put(store, b"nan", span("A"))
    put(store, b"text", span("A"), commit=False)  # the pool is full now; this one evicts
    ok(store)
    assert present(store, b"raise-1", b"none-1", b"good", b"nan", b"text") == [b"none-1", b"good", b"nan", b"text"]
    entry = store.lookup(b"text")
    assert entry is not None
    store.commit(entry)
    ok(store)
    assert getattr(policy, "failures", 0) == 6  # three admits, three scores (raise-1, nan, text)
    assert "admit(b'raise-1') raised" in caplog.text and "not a number" in caplog.text


class HugeScorePolicy(EvictionPolicy):
    """Scores that are numbers but not floats: ints past float range, numpy scalars, infinities."""

    name = "huge"

    def score(self, entry: EvictionEntry) -> float:
        key = entry.key
        if key.startswith(b"big"):
            return 10**400  # type: ignore[return-value]
        if key.startswith(b"neg"):
            return -(10**400)  # type: ignore[return-value]
        if key.startswith(b"np"):
            return np.int64(5)  # type: ignore[return-value]
        if key.startswith(b"inf"):
            return float("inf")
        return 1.0


def test_plug_in_policy_scores_past_float_range() -> None:
    """A score of 10**400 is a number: it orders last (-10**400 first), and never raises out of the store."""
    policy = make_policy(f"{__name__}:HugeScorePolicy")
    store = make([("A", 4)], policy)
    for key in (b"big", b"np", b"neg", b"plain"):
        put(store, key, span("A"))
    ok(store)
    # Full: each new object evicts the lowest score first: neg (-inf), plain (1), np (5), then big (+inf).
    for n, key in enumerate((b"inf-1", b"inf-2", b"inf-3")):
        put(store, key, span("A"))
        ok(store)
        assert len(present(store, b"big", b"np", b"neg", b"plain")) == 3 - n
    assert present(store, b"big", b"np", b"neg", b"plain") == [b"big"]
    assert getattr(policy, "failures", 0) == 0


def test_hybrid_layouts() -> None:
    pools = [
        PoolSpec("full", 64 * KiB, 16),
        PoolSpec("swa", 16 * KiB, 8),
        PoolSpec("state", 1536 * KiB, 2),
    ]
    store = Store(pools, make_policy("lru"))
    hybrid: Layout = (
        ("L0", "full"),
        ("L1", "swa"),
        ("L2", "full"),
        ("L3", "swa"),
        ("L4", "full"),
        ("L5", "full"),
        ("M", "state"),
    )
    a = put(store, b"a", hybrid)
    assert a.slots == (0, 0, 1, 1, 2, 3, 0)
    assert a.pool_slots() == {"full": [0, 1, 2, 3], "swa": [0, 1], "state": [0]}
    b = put(store, b"b", hybrid)
    assert b.pool_slots() == {"full": [4, 5, 6, 7], "swa": [2, 3], "state": [1]}
    stats = store.pool_stats()
    assert {p: (s["allocated"], s["evictable"], s["objects"]) for p, s in stats.items()} == {
        "full": (8, 8, 2),
        "swa": (4, 4, 2),
        "state": (2, 2, 2),
    }
    assert stats["state"]["slot_size"] == 1536 * KiB
    # The state pool is full: a third object evicts the least recently used one whole.
    store.claim(a)
    store.unclaim(a)
    put(store, b"c", hybrid)
    assert present(store, b"a", b"b", b"c") == [b"a", b"c"]
    assert store.stats()["evictions"] == {"full": 1, "swa": 1, "state": 1}
    # A full-attention-only object fits in free slots without evicting.
    put(store, b"f", span("full", 8))
    assert store.pool_stats()["full"]["free"] == 0
    # More full slots: the LRU order across layouts is global (groups overlap on "full").
    put(store, b"g", span("full", 2, prefix="G"))
    assert present(store, b"a", b"c", b"f", b"g") == [b"c", b"f", b"g"]
    ok(store)


# -- claims ---------------------------------------------------------------------------


def test_claim_and_release_move_an_object_out_of_and_back_into_both_structures() -> None:
    store = make([("A", 4)])
    entry = put(store, b"k", span("A"))

    def where() -> tuple[bool, bool, bool]:
        in_global, in_groups = store.index.members()
        return entry in store.index, entry in in_global, entry in in_groups

    assert where() == (True, True, True)
    store.claim(entry)
    store.claim(entry)
    assert where() == (False, False, False) and entry.claims == 2
    assert store.stats()["claims"] == 2
    ok(store)
    store.unclaim(entry)
    assert where() == (False, False, False)
    ok(store)
    store.unclaim(entry)
    assert where() == (True, True, True) and entry.claims == 0
    ok(store)


def test_commit_with_a_claim_skips_the_index() -> None:
    store = make([("A", 2)])
    entry = put(store, b"k", span("A"), commit=False)
    store.commit(entry, claim=True)
    assert entry.claims == 1 and entry not in store.index
    ok(store)
    store.unclaim(entry, accessed=False)
    assert entry in store.index
    ok(store)


def test_tick_advances_on_every_access_only() -> None:
    store = make([("A", 4)], "lru")
    entry = put(store, b"k", span("A"))
    assert store.tick == 1
    store.lookup(b"k")
    store.claim(entry)
    assert store.tick == 1
    store.unclaim(entry, accessed=False)
    assert store.tick == 1 and entry.last_access == 1
    store.claim(entry)
    store.unclaim(entry)
    assert store.tick == entry.last_access == 2


def test_misuse_raises_store_error() -> None:
    store = make([("A", 4)])
    writing = put(store, b"w", span("A"), commit=False)
    ready = put(store, b"r", span("A"))
    with pytest.raises(StoreError, match="not READY"):
        store.claim(writing)
    with pytest.raises(StoreError, match="no claim"):
        store.unclaim(ready)
    with pytest.raises(StoreError, match="not WRITING"):
        store.commit(ready)
    with pytest.raises(StoreError, match="not WRITING"):
        store.abandon(ready)
    with pytest.raises(StoreError, match="abandon"):
        store.remove(b"w")
    store.claim(ready)
    with pytest.raises(StoreError, match="claim"):
        store.remove(b"r")
    store.abandon(writing)
    for op in (store.commit, store.abandon, store.claim, store.unclaim):
        with pytest.raises(StoreError, match="no longer"):
            op(writing)
    # A new object under the same key does not revive the old entry.
    put(store, b"w", span("A"))
    with pytest.raises(StoreError, match="no longer"):
        store.claim(writing)
    ok(store)


def test_abandon_frees_the_slots() -> None:
    store = make([("A", 2)])
    entry = put(store, b"k", span("A", 2), commit=False)
    assert store.pool_stats()["A"]["free"] == 0
    store.abandon(entry)
    assert store.lookup(b"k") is None and store.pool_stats()["A"]["free"] == 2
    assert store.stats()["writing"] == 0
    ok(store)


def test_remove() -> None:
    store = make([("A", 2)])
    entry = put(store, b"k", span("A"))
    assert store.remove(b"k") is True
    assert store.remove(b"k") is False
    assert entry not in store.index and len(store.index) == 0
    assert store.stats()["evicted_objects"] == 0
    ok(store)


def test_condemn_of_an_unclaimed_object_frees_it_at_once() -> None:
    store = make([("A", 4)])
    put(store, b"k", span("A", 2))
    entry = store.lookup(b"k")
    assert entry is not None
    store.condemn(entry)
    assert store.lookup(b"k") is None and store.lookup_codes([b"k"]) == bytes([LOOKUP_ABSENT])
    assert store.pool_stats()["A"]["free"] == 4 and len(store.index) == 0
    assert store.stats()["condemned_objects"] == 1 and store.stats()["condemned_claimed"] == 0
    ok(store)


def test_condemned_while_claimed_keeps_its_slots_until_the_last_claim() -> None:
    """A holder may still be reading a condemned object's slots: they are not reused
    until its last claim drops, while its key is free for a new deposit at once."""
    store = make([("A", 4)])
    entry = put(store, b"k", span("A", 2))
    store.claim(entry)
    store.claim_all([entry])
    store.condemn(entry)
    ok(store)
    assert entry.state is ObjectState.CONDEMNED and store.lookup(b"k") is None
    assert store.pool_stats()["A"]["free"] == 2 and store.stats()["condemned_claimed"] == 1
    again = put(store, b"k", span("A", 2))  # the key is placed anew, in the other slots
    assert set(again.slots).isdisjoint(entry.slots)
    with pytest.raises(StoreError):
        store.claim(entry)
    with pytest.raises(StoreError):
        store.condemn(entry)
    # The condemned slots are neither free nor evictable: three slots cannot be had.
    assert store.pool_stats()["A"]["free"] == 0
    assert store.begin_deposit(b"other", span("A", 3)) == (DepositOutcome.CAPACITY, None)
    store.unclaim(entry)
    ok(store)
    assert store.pool_stats()["A"]["free"] == 0
    store.unclaim_all([entry])
    ok(store)
    assert store.pool_stats()["A"]["free"] == 2
    assert store.stats()["condemned_claimed"] == 0 and store.stats()["claims"] == 0
    with pytest.raises(StoreError):
        store.unclaim(entry)


def test_condemn_refuses_a_writing_object() -> None:
    store = make([("A", 4)])
    entry = put(store, b"w", span("A"), commit=False)
    with pytest.raises(StoreError):
        store.condemn(entry)
    ok(store)


# -- capacity pressure ----------------------------------------------------------------


def test_capacity_events_are_per_pool_and_edge_triggered() -> None:
    store = make([("A", 10), ("B", 10)], low_watermark=0.2)  # under 2 reclaimable slots
    entries = [put(store, b"a%d" % i, span("A"), commit=False) for i in range(8)]
    assert store.take_capacity_events() == []  # 2 left: at the watermark, not under
    ninth = put(store, b"a8", span("A"), commit=False)
    put(store, b"a9", span("A"), commit=False)
    assert store.take_capacity_events() == ["A"]  # once, though it stays under
    assert store.take_capacity_events() == []
    store.commit(entries[0])  # 1 evictable: still under
    assert store.take_capacity_events() == []
    store.commit(ninth)  # 2 reclaimable: re-armed, no event
    assert store.take_capacity_events() == []
    store.claim(ninth)  # under again: one new event
    assert store.take_capacity_events() == ["A"]
    store.abandon(entries[1])  # back to 2
    put(store, b"x", span("A"), commit=False)  # 1: fires
    assert store.take_capacity_events() == ["A"]
    # Pool B is untouched by all of this; it fires on its own.
    put(store, b"b", span("B", 9))
    assert store.take_capacity_events() == ["B"]
    ok(store)


def test_zero_watermark_never_fires() -> None:
    store = make([("A", 2)], low_watermark=0.0)
    put(store, b"a", span("A", 2), commit=False)
    assert store.take_capacity_events() == []


def test_bad_store_arguments() -> None:
    with pytest.raises(ValueError):
        Store([], make_policy("fifo"))
    with pytest.raises(ValueError):
        make([("A", 1), ("A", 2)])
    with pytest.raises(ValueError):
        make([("A", 1)], low_watermark=1.5)
    for bad in (("", 1, 1), ("A", 0, 1), ("A", 1, 0), ("A", 1, -1), ("A", True, 1)):
        with pytest.raises(ValueError):
            PoolSpec(*bad)


def test_stats() -> None:
    store = make([("A", 4), ("B", 4)])
    w = put(store, b"w", span("A"), commit=False)
    r = put(store, b"r", span("A") + span("B", 2, prefix="M"))
    store.claim(r)
    store.claim(r)
    assert store.stats() == {
        "objects": 2,
        "ready": 1,
        "writing": 1,
        "evictable": 0,
        "claims": 2,
        "evicted_objects": 0,
        "condemned_objects": 0,
        "condemned_claimed": 0,
        "evictions": {"A": 0, "B": 0},
    }
    assert store.pool_stats() == {
        "A": {"total": 4, "free": 2, "allocated": 2, "evictable": 0, "objects": 2, "slot_size": 4 * KiB},
        "B": {"total": 4, "free": 2, "allocated": 2, "evictable": 0, "objects": 1, "slot_size": 4 * KiB},
    }
    store.unclaim(r)
    store.unclaim(r)
    assert store.pool_stats()["B"]["evictable"] == 2 and store.pool_stats()["A"]["evictable"] == 1
    assert w.state is ObjectState.WRITING
    ok(store)


def test_check_invariants_reports_breaches() -> None:
    store = make([("A", 4)])
    entry = put(store, b"k", span("A"))
    entry.claims = 1  # corrupted from outside: claimed yet still evictable
    assert store.check_invariants()
    entry.claims = 0
    ok(store)
    store._alloc["A"].free([entry.slots[0]])  # a slot freed behind the store's back
    assert any("free" in b for b in store.check_invariants())


# -- random sequences against a reference model ---------------------------------------

POOLS = {"a": 5, "b": 4, "c": 3}
LAYOUTS: list[Layout] = [
    span("a"),
    span("a", 2),
    span("b"),
    span("a") + span("b", prefix="M"),
    span("c", 2),
    span("b") + span("c", prefix="M"),
    span("a") + span("b", prefix="M") + span("c", prefix="N"),
    (("x", "a"), ("x", "a")),  # repeated span names are allowed
    span("c", 4),  # larger than pool c: always CAPACITY
    span("a") + span("z", prefix="M"),  # unknown pool
]
KEYS = [b"k%d" % i for i in range(40)]


class Model:
    """What the store should hold for one key."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.state = ObjectState.WRITING
        self.claims = 0
        self.last_access = 0
        self.order: tuple[float, int] | None = None  # set while evictable

    def need(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, pool in self.layout:
            out[pool] = out.get(pool, 0) + 1
        return out


class StoreMachine(RuleBasedStateMachine):
    """Random deposit/commit/claim/unclaim/abandon/remove sequences, checked every step.

    The reference picks victims the slow, obvious way: every evictable object sorted by
    (score, moment it became evictable), taking those that use a pool still in deficit.
    The store must evict exactly those, by whatever path it takes.
    """

    policy_name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        specs = [PoolSpec(name, 1, count) for name, count in POOLS.items()]
        self.store = Store(specs, make_policy(self.policy_name), low_watermark=0.3)
        self.model: dict[bytes, Model] = {}
        self.tick = 0
        self.seq = 0
        self.gone: list[ObjectEntry] = []

    def _evictable(self, key: bytes) -> None:
        m = self.model[key]
        self.seq += 1
        m.order = (0 if self.policy_name == "fifo" else m.last_access, self.seq)

    def _policy_order(self) -> list[bytes]:
        live = [(m.order, k) for k, m in self.model.items() if m.order is not None]
        return [k for _, k in sorted(live)]

    def _expect_error(self, op: object, *args: object) -> None:
        with pytest.raises(StoreError):
            op(*args)  # type: ignore[operator]

    @rule(key=st.sampled_from(KEYS), layout=st.sampled_from(LAYOUTS), optional=st.booleans())
    def deposit(self, key: bytes, layout: Layout, optional: bool) -> None:
        self._deposit(key, layout, optional)

    @rule(key=st.sampled_from(KEYS), layout=st.sampled_from(LAYOUTS))
    def deposit_and_commit(self, key: bytes, layout: Layout) -> None:
        if self._deposit(key, layout, False):
            self.commit(key, False)

    def _deposit(self, key: bytes, layout: Layout, optional: bool) -> bool:
        outcome, entry = self.store.begin_deposit(key, layout, optional)
        m = self.model.get(key)
        if m is not None:
            expected = DepositOutcome.DUPLICATE if m.layout == layout else DepositOutcome.LAYOUT_MISMATCH
            assert (outcome, entry) == (expected, self.store.lookup(key))
            return False
        need = Model(layout).need()
        if any(pool not in POOLS for pool in need):
            assert (outcome, entry) == (DepositOutcome.UNKNOWN_POOL, None)
            return False
        if any(n > POOLS[pool] for pool, n in need.items()):
            assert (outcome, entry) == (DepositOutcome.CAPACITY, None)
            return False
        used = {pool: 0 for pool in POOLS}
        for other in self.model.values():
            for pool, n in other.need().items():
                used[pool] += n
        remaining = {p: n - (POOLS[p] - used[p]) for p, n in need.items() if n > POOLS[p] - used[p]}
        victims = []
        for victim in self._policy_order():
            if not remaining:
                break
            victim_need = self.model[victim].need()
            if not any(p in remaining for p in victim_need):
                continue
            victims.append(victim)
            for p, n in victim_need.items():
                if p in remaining:
                    remaining[p] -= n
                    if remaining[p] <= 0:
                        del remaining[p]
        if remaining:
            assert (outcome, entry) == (DepositOutcome.CAPACITY, None)
            return False
        assert outcome is NEW and entry is not None
        for victim in victims:
            del self.model[victim]
        self.model[key] = Model(layout)
        return True

    @rule(key=st.sampled_from(KEYS), claim=st.booleans())
    def commit(self, key: bytes, claim: bool) -> None:
        entry, m = self.store.lookup(key), self.model.get(key)
        if entry is None or m is None:
            return
        if m.state is not ObjectState.WRITING:
            self._expect_error(self.store.commit, entry)
            return
        self.store.commit(entry, claim=claim)
        self.tick += 1
        m.state, m.last_access = ObjectState.READY, self.tick
        if claim:
            m.claims = 1
        else:
            self._evictable(key)

    @rule(key=st.sampled_from(KEYS))
    def abandon(self, key: bytes) -> None:
        entry, m = self.store.lookup(key), self.model.get(key)
        if entry is None or m is None:
            return
        if m.state is not ObjectState.WRITING:
            self._expect_error(self.store.abandon, entry)
            return
        self.store.abandon(entry)
        del self.model[key]
        self.gone.append(entry)

    @rule(key=st.sampled_from(KEYS))
    def claim(self, key: bytes) -> None:
        entry, m = self.store.lookup(key), self.model.get(key)
        if entry is None or m is None:
            return
        if m.state is not ObjectState.READY:
            self._expect_error(self.store.claim, entry)
            return
        self.store.claim(entry)
        m.claims += 1
        m.order = None

    @rule(key=st.sampled_from(KEYS), accessed=st.booleans())
    def unclaim(self, key: bytes, accessed: bool) -> None:
        entry, m = self.store.lookup(key), self.model.get(key)
        if entry is None or m is None:
            return
        if m.claims == 0:
            self._expect_error(self.store.unclaim, entry)
            return
        self.store.unclaim(entry, accessed)
        m.claims -= 1
        if accessed:
            self.tick += 1
            m.last_access = self.tick
        if m.claims == 0:
            self._evictable(key)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        m = self.model.get(key)
        if m is None:
            assert self.store.remove(key) is False
            return
        if m.state is not ObjectState.READY or m.claims:
            self._expect_error(self.store.remove, key)
            return
        entry = self.store.lookup(key)
        assert self.store.remove(key) is True
        del self.model[key]
        assert entry is not None
        self.gone.append(entry)

    @rule()
    def stale_entries_are_refused(self) -> None:
        for entry in self.gone[-3:]:
            if self.store.lookup(entry.key) is not entry:
                self._expect_error(self.store.claim, entry)

    @rule()
    def drain_events(self) -> None:
        events = self.store.take_capacity_events()
        assert set(events) <= set(POOLS)

    @invariant()
    def matches_the_model(self) -> None:
        assert self.store.check_invariants() == []
        assert set(self.store._objects) == set(self.model)
        for key, m in self.model.items():
            entry = self.store.lookup(key)
            assert entry is not None
            assert (entry.state, entry.claims, entry.layout) == (m.state, m.claims, m.layout)
            assert entry.last_access == m.last_access
        assert [e.key for e in self.store.index.order()] == self._policy_order()
        assert self.store.tick == self.tick


class LruStoreMachine(StoreMachine):
    policy_name = "lru"


_settings = settings(
    max_examples=150,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFifoStore = StoreMachine.TestCase
TestFifoStore.settings = _settings
TestLruStore = LruStoreMachine.TestCase
TestLruStore.settings = _settings
