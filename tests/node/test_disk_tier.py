"""The disk tier's bookkeeping, in process (``kvcr_node.disk_tier``, architecture §9): what
is copied and when, what eviction leaves on disk, what a promotion places and claims, and
that every failure leaves both stores as they were. The bytes themselves move in
``test_disk_pools.py`` (the same moves, through real NIXL) and in the node's tests."""

from __future__ import annotations

import pytest

from kvcr_node import disk_tier
from kvcr_node.disk_pools import FileRegion
from kvcr_node.disk_tier import Demotion, DiskTier, MemoryListener
from kvcr_node.eviction import Layout, make_policy
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, Store

SLOT = 4096
MEMORY = 8
DISK = 6
FD = 99


def layout(n: int = 2, pool: str = "kv") -> Layout:
    return tuple((f"L{i}", pool) for i in range(n))


@pytest.fixture
def memory() -> Store:
    # LRU, the node's default: a copied object keeps its place in the eviction order.
    return Store([PoolSpec("kv", SLOT, MEMORY), PoolSpec("big", 4 * SLOT, 4), PoolSpec("gpu", SLOT, 4, "hbm:0")],
                 make_policy("lru"))


@pytest.fixture
def tier(memory: Store) -> DiskTier:
    spec = PoolSpec("kv-disk", SLOT, DISK, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("fifo"), mark=0.5,
                    in_flight=2)
    memory.listener = MemoryListener(tier)  # as the node has it
    return tier


def put(store: Store, key: bytes, spans: Layout, digests: bytes = b"") -> ObjectEntry:
    outcome, entry = store.begin_deposit(key, spans)
    assert outcome is DepositOutcome.NEW and entry is not None
    entry.digests = digests
    store.commit(entry)
    return entry


def ok(tier: DiskTier) -> None:
    assert tier.memory.check_invariants() == [] and tier.check_invariants() == []


def a_copied(tier: DiskTier, memory: Store, **digests: bytes) -> Demotion:
    """Objects a, b and c of two slots stored (two slots under the mark), and a copied."""
    for key in (b"a", b"b", b"c"):
        put(memory, key, layout(), digests=digests.get(key.decode(), b""))
    [d] = tier.next_demotions()
    assert d.entry.key == b"a"
    tier.demoted(d, True)
    return d


def test_only_pools_with_a_disk_pool_of_their_slot_size_are_copied(tier: DiskTier) -> None:
    assert tier.pairs == {"kv": "kv-disk"}, "DRAM pools only: the node reads HBM through no file backend"
    assert tier.fits(layout()) and not tier.fits(layout(1, "big")) and not tier.fits((("a", "kv"), ("b", "big")))


def test_nothing_is_copied_while_a_pool_has_room(tier: DiskTier, memory: Store) -> None:
    put(memory, b"a", layout())
    put(memory, b"b", layout())  # 4 of 8 slots free: the mark
    assert tier.next_demotions() == []
    ok(tier)


def test_what_eviction_would_take_next_is_copied_claimed_and_bounded(tier: DiskTier, memory: Store) -> None:
    entries = [put(memory, key, layout(), digests=key * 16) for key in (b"a", b"b", b"c")]  # 2 free: 2 under the mark
    demotions = tier.next_demotions()
    assert [d.entry.key for d in demotions] == [b"a"], "the coldest first, as much as the deficit"
    [d] = demotions
    assert d.entry.claims == 1 and d.entry not in memory.index, "an object being copied is not evictable"
    assert d.copy.state is ObjectState.WRITING and tier.disk.lookup(b"a") is d.copy
    # One move per run: memory slots 0-1 -> disk slots 0-1, one descriptor.
    assert [(pool, slot, offset, length, region.device, count) for pool, slot, offset, length, region, count in d.moves] \
        == [("kv", 0, 0, 2 * SLOT, FD, 2)]
    assert tier.next_demotions() == [], "the object being copied covers the deficit"
    put(memory, b"d", layout())  # 0 free: 4 slots under the mark, 2 of them being copied
    [b] = tier.next_demotions()
    assert b.entry.key == b"b"
    assert tier.next_demotions() == []
    ok(tier)

    tier.demoted(d, True)
    assert d.copy.state is ObjectState.READY and d.copy.digests == entries[0].digests
    assert d.entry.claims == 0 and d.entry in memory.index, "evictable again once copied"
    assert tier.copy(b"a") is d.copy and tier.on_disk_only(b"a") is None
    tier.demoted(b, True)
    assert tier.next_demotions() == [], "what eviction takes next is copied"
    memory.claim(d.entry)
    memory.unclaim(d.entry)  # a used again: now b and c go first
    [c] = tier.next_demotions()
    assert c.entry.key == b"c", "copied objects are passed over"
    ok(tier)


def test_copies_in_flight_are_bounded(memory: Store) -> None:
    spec = PoolSpec("kv-disk", SLOT, DISK, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("lru"), mark=1.0, in_flight=2)
    for key in (b"a", b"b", b"c", b"d"):
        put(memory, key, layout(1))
    first = tier.next_demotions()
    assert [d.entry.key for d in first] == [b"a", b"b"] and tier.next_demotions() == []
    tier.demoted(first[0], True)
    assert [d.entry.key for d in tier.next_demotions()] == [b"c"]
    ok(tier)


def test_evicting_a_copied_object_leaves_it_on_disk_and_promotion_reads_it_back(tier: DiskTier, memory: Store) -> None:
    d = a_copied(tier, memory, a=b"a" * 16)
    put(memory, b"d", layout())
    outcome, e = memory.begin_deposit(b"e", layout())  # evicts a, the oldest
    assert outcome is DepositOutcome.NEW and e is not None and memory.lookup(b"a") is None
    copy = tier.on_disk_only(b"a")
    assert copy is d.copy
    ok(tier)

    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    assert p.entry.state is ObjectState.WRITING and memory.lookup(b"a") is p.entry and p.copy.claims == 1
    assert tier.on_disk_only(b"a") is None and tier.promote(b"a") is p, "one promotion per key"
    assert [(pool, offset // SLOT, length, count) for pool, _, offset, length, _, count in p.moves] == [("kv", 0, 2 * SLOT, 2)]
    ok(tier)
    tier.promoted(p, True)
    assert p.entry.state is ObjectState.READY and p.entry.digests == b"a" * 16 and p.copy.claims == 0
    assert tier.copy(b"a") is copy, "the copy stays: a later eviction needs no second write"
    assert tier.counts["promoted"] == 1 and tier.counts["dropped"] == 0
    ok(tier)
    memory.remove(b"a")
    put(memory, b"a", layout())  # the key stored anew: only the bytes stored last are served
    assert tier.copy(b"a") is None and tier.counts["dropped"] == 1
    ok(tier)


def test_a_read_back_that_fails_or_does_not_match_drops_the_object(tier: DiskTier, memory: Store) -> None:
    a_copied(tier, memory)
    put(memory, b"d", layout())
    put(memory, b"e", layout())  # evicts a
    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    tier.promoted(p, False)
    assert memory.lookup(b"a") is None and tier.disk.lookup(b"a") is None and tier.counts["promotions_failed"] == 1
    ok(tier)


def test_a_copy_that_fails_or_outlives_its_object_is_not_kept(tier: DiskTier, memory: Store) -> None:
    for key in (b"a", b"b", b"c"):
        put(memory, key, layout())
    [d] = tier.next_demotions()
    tier.demoted(d, False)
    assert tier.disk.lookup(b"a") is None and d.entry.claims == 0 and d.entry in memory.index
    assert tier.counts["demotions_failed"] == 1
    ok(tier)
    # Copied again on the next look; its object condemned meanwhile: the copy goes.
    [again] = tier.next_demotions()
    assert again.entry is d.entry
    memory.condemn(again.entry)
    tier.demoted(again, True)
    assert tier.disk.lookup(b"a") is None and memory.lookup(b"a") is None
    ok(tier)


def test_a_full_disk_evicts_its_oldest_copies_by_the_policy(memory: Store) -> None:
    spec = PoolSpec("kv-disk", SLOT, 2, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("fifo"), mark=1.0,
                    in_flight=8)
    for key in (b"a", b"b", b"c"):
        put(memory, key, layout(1))
    first = tier.next_demotions()
    assert [d.entry.key for d in first] == [b"a", b"b"], "two disk slots: two copies in flight"
    for d in first:
        tier.demoted(d, True)
    [c] = tier.next_demotions()  # evicts a's copy (the oldest) to make room
    assert c.entry.key == b"c" and tier.disk.lookup(b"a") is None
    tier.demoted(c, True)
    memory.remove(b"b")
    assert tier.drop(b"b") and tier.disk.lookup(b"b") is None
    ok(tier)


def test_promotion_into_a_full_memory_is_refused_and_changes_nothing(tier: DiskTier, memory: Store) -> None:
    d = a_copied(tier, memory)
    memory.remove(b"a")  # on disk only now
    for key in (b"x", b"y"):
        memory.claim(put(memory, key, layout()))
    for key in (b"b", b"c"):
        memory.claim(memory.lookup(key))  # type: ignore[arg-type]
    assert tier.promote(b"a") is DepositOutcome.CAPACITY
    assert tier.disk.lookup(b"a") is d.copy and d.copy.claims == 0 and memory.lookup(b"a") is None
    ok(tier)


def test_a_look_visits_a_bounded_number_of_objects(memory: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A look walks at most ``LOOK_AHEAD`` objects of what would be evicted next: copies run at
    most that far ahead of evictions, and a look costs the node a bounded time."""
    monkeypatch.setattr(disk_tier, "LOOK_AHEAD", 3)
    spec = PoolSpec("kv-disk", SLOT, DISK, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("lru"), mark=1.0)
    entries = [put(memory, key, layout(1)) for key in (b"a", b"b", b"c", b"d", b"e")]
    first = tier.next_demotions()
    assert [d.entry.key for d in first] == [b"a", b"b", b"c"]
    for d in first:
        tier.demoted(d, True)
    assert tier.next_demotions() == [], "the three coldest are copied: the look goes no further"
    memory.claim(entries[0])
    memory.unclaim(entries[0])  # a used again: d comes within reach
    assert [d.entry.key for d in tier.next_demotions()] == [b"d"]
    assert memory.index.visits < 40
    ok(tier)


def test_what_one_look_finds_is_placed_over_several_turns_each_looked_at_again(
    memory: Store, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look keeps what it found to copy and the turns after place it, a few a turn, without
    walking the eviction order again; an object that meanwhile left, was stored anew or is
    held by a reader is passed over, and once the finds are used up the order is walked anew."""
    monkeypatch.setattr(disk_tier, "DEMOTIONS_PER_LOOK", 1)
    spec = PoolSpec("kv-disk", SLOT, DISK, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("lru"), mark=1.0)
    memory.listener = MemoryListener(tier)
    entries = {key: put(memory, key, layout(1)) for key in (b"a", b"b", b"c", b"d", b"e")}
    [a] = tier.next_demotions()
    visits = memory.index.visits
    assert a.entry.key == b"a" and visits == 5, "one walk found all five"
    memory.remove(b"b")
    memory.remove(b"c")
    put(memory, b"c", layout(1))  # stored anew: another object under the same key
    memory.claim(entries[b"d"])  # a reader holds d
    [e] = tier.next_demotions()
    assert e.entry.key == b"e" and memory.index.visits == visits, "b, c and d passed over, no walk"
    memory.unclaim(entries[b"d"])  # used: now after the new c
    [c] = tier.next_demotions()
    assert c.entry.key == b"c" and c.entry is not entries[b"c"] and memory.index.visits > visits, \
        "the finds used up: a new walk"
    assert [d.entry.key for d in tier.next_demotions()] == [b"d"]
    assert set(tier.demoting) == {b"a", b"e", b"c", b"d"}
    for d in list(tier.demoting.values()):
        tier.demoted(d, True)
    assert tier.next_demotions() == [] and tier.copy(b"c") is not None and tier.copy(b"b") is None
    ok(tier)


def test_copying_a_whole_pool_visits_each_object_a_few_times_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects already copied sit at the front of the eviction order; were each look to find
    only what one turn places, every look would walk past all of them again (copying 64
    objects four a turn: 17 looks, 608 visits; now 5 looks, 224). A look's finds last several turns instead."""
    monkeypatch.setattr(disk_tier, "DEMOTIONS_PER_LOOK", 4)
    monkeypatch.setattr(disk_tier, "LOOK_QUEUE", 16)
    memory = Store([PoolSpec("kv", SLOT, 64)], make_policy("lru"))
    spec = PoolSpec("kv-disk", SLOT, 64, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("lru"), mark=1.0)
    for i in range(64):
        put(memory, b"k%d" % i, layout(1))
    copied = 0
    while demotions := tier.next_demotions():
        assert len(demotions) <= 4
        for d in demotions:
            tier.demoted(d, True)
        copied += len(demotions)
    assert copied == 64 and len(tier.disk) == 64
    assert memory.index.visits <= 4 * 64, memory.index.visits
    ok(tier)


def test_with_promotion_off_an_object_read_back_leaves_memory_with_its_last_reader(memory: Store) -> None:
    spec = PoolSpec("kv-disk", SLOT, DISK, "disk:/unused")
    tier = DiskTier(memory, [spec], {"kv-disk": FileRegion(FD, spec.size)}, make_policy("fifo"), mark=0.5,
                    in_flight=2, promote=False)
    memory.listener = MemoryListener(tier)
    d = a_copied(tier, memory)
    put(memory, b"d", layout())
    put(memory, b"e", layout())  # evicts a: on disk only
    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    tier.promoted(p, True)
    evictions = memory.stats()["evicted_objects"]
    entry = p.entry
    assert entry.state is ObjectState.READY and memory.lookup(b"a") is entry
    ok(tier)

    # A hold while other objects are placed (a batch that reads others back) is no reader.
    memory.claim_all([entry])
    memory.unclaim_all([entry], held_only=True)
    assert memory.lookup(b"a") is entry
    # Two readers: it leaves memory with the last one, as an eviction; its copy stays.
    memory.claim(entry)
    memory.claim(entry)
    memory.unclaim(entry)
    assert memory.lookup(b"a") is entry
    memory.unclaim(entry)
    assert memory.lookup(b"a") is None and tier.on_disk_only(b"a") is d.copy
    assert memory.stats()["evicted_objects"] == evictions + 1
    ok(tier)

    # Read back again, then held by a lease that ends: the same.
    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    tier.promoted(p, True)
    memory.claim_all([p.entry])
    memory.unclaim_all([p.entry])
    assert memory.lookup(b"a") is None and tier.on_disk_only(b"a") is d.copy
    assert tier.counts["promoted"] == 2
    ok(tier)


def test_with_promotion_on_an_object_read_back_stays_after_its_readers(tier: DiskTier, memory: Store) -> None:
    a_copied(tier, memory)
    put(memory, b"d", layout())
    put(memory, b"e", layout())
    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    tier.promoted(p, True)
    memory.claim(p.entry)
    memory.unclaim(p.entry)
    assert memory.lookup(b"a") is p.entry and tier.on_disk_only(b"a") is None
    ok(tier)


def test_a_copy_and_its_read_back_keep_the_parent_the_deposit_named(tier: DiskTier, memory: Store) -> None:
    """The tier's copy is published with the object's parent (spec section 15.2), and so is
    the object read back from it."""
    outcome, a = memory.begin_deposit(b"a", layout(), parent=b"root")
    assert outcome is DepositOutcome.NEW and a is not None
    memory.commit(a)
    for key in (b"b", b"c"):
        put(memory, key, layout())
    [d] = tier.next_demotions()
    tier.demoted(d, True)
    assert d.copy.key == b"a" and d.copy.parent == b"root"
    put(memory, b"d", layout())
    outcome, _ = memory.begin_deposit(b"e", layout())  # evicts a: held on disk only
    assert outcome is DepositOutcome.NEW and memory.lookup(b"a") is None
    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    tier.promoted(p, True)
    assert memory.lookup(b"a") is p.entry and p.entry.parent == b"root"
    ok(tier)


def test_a_read_back_is_committed_with_the_digests_it_was_checked_against(tier: DiskTier, memory: Store) -> None:
    """The node checked every span read back against the copy's digests: committed, the
    object keeps those and is not hashed again (``Store.on_ready`` is the node's ``take``);
    any other fill still is."""
    a_copied(tier, memory, a=b"\x07" * 16)
    put(memory, b"d", layout())
    put(memory, b"e", layout())  # evicts a: on disk only
    taken: list[bytes] = []
    memory.on_ready = lambda entry: taken.append(entry.key)
    p = tier.promote(b"a")
    assert not isinstance(p, DepositOutcome)
    tier.promoted(p, True)
    assert taken == [] and p.entry.digests == b"\x07" * 16
    put(memory, b"f", layout())
    assert taken == [b"f"], "a deposit's digests are taken at READY"
    ok(tier)
