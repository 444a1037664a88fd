"""The node's inventory events against a real store (spec section 15), with no sockets.

Thousands of deposits and FIFO evictions: applying every batch, in order, gives exactly the
store's READY keys; the replay ring stays within its bounds; replays answer what the ring
holds, cut at their bound, and refuse hostile requests naming the field.
"""

from __future__ import annotations

import random

import pytest

from kvcr_client.events import InventoryMirror
from kvcr_node.eviction import make_policy
from kvcr_node.inventory import BATCH_MAX_BYTES, REPLAY_MAX_BATCHES, REPLAY_MAX_BYTES, RING_BATCHES, Inventory
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, PoolSpec, Store
from kvcr_protocol import ErrorCode
from kvcr_protocol.events import (
    END_SEQ_FRAME,
    MAX_BATCH_KEYS,
    Cleared,
    Removed,
    RemovedReason,
    ReplayEnd,
    Stored,
    decode_batch,
    decode_replay_end,
    decode_seq,
    encode_replay_request,
)

POOLS = (PoolSpec("kv", 4096, 64, "dram"), PoolSpec("full", 4096, 32, "hbm:0"), PoolSpec("swa", 1024, 32, "hbm:0"))
TIERS = {p.name: p.memory for p in POOLS}
PLAIN = (("L0", "kv"),)
HYBRID = (("L0.full", "full"), ("L0.swa", "swa"), ("L1.full", "full"))


def make(ring_batches: int = RING_BATCHES, ring_bytes: int = 64 << 20) -> tuple[Store, Inventory]:
    store = Store(POOLS, make_policy("fifo"))
    inventory = Inventory("node-t", 0x55, TIERS, wall=lambda: 1000.0, ring_batches=ring_batches, ring_bytes=ring_bytes)
    store.listener = inventory
    return store, inventory


def put(store: Store, key: bytes, layout: tuple[tuple[str, str], ...] = PLAIN) -> ObjectEntry:
    outcome, entry = store.begin_deposit(key, layout)
    assert outcome is DepositOutcome.NEW and entry is not None
    store.commit(entry)
    return entry


def ready_keys(store: Store) -> set[bytes]:
    return {k for k in store._objects if store._objects[k].state is ObjectState.READY}


def replayed(inventory: Inventory, start: int) -> tuple[list[int], list[bytes], ReplayEnd]:
    answer, served = inventory.replay(encode_replay_request(start))
    assert served and answer[-1][1] == END_SEQ_FRAME
    return [decode_seq(m[1]) for m in answer[:-1]], [m[2] for m in answer[:-1]], decode_replay_end(answer[-1][2])


def test_a_fresh_inventory_says_cleared_first() -> None:
    _, inventory = make()
    [(seq, payload)] = inventory.take()
    batch = decode_batch(payload)
    assert seq == 0 and batch.events == (Cleared(),) and (batch.node, batch.incarnation) == ("node-t", 0x55)
    assert inventory.take() == [] and not inventory.pending


def test_events_keep_their_order_and_name_pools_and_tier() -> None:
    store, inventory = make()
    inventory.take()
    a = put(store, b"a")
    put(store, b"b")
    put(store, b"h", HYBRID)
    outcome, writing = store.begin_deposit(b"w", PLAIN)
    assert outcome is DepositOutcome.NEW and writing is not None
    store.abandon(writing)  # never READY: never published
    store.remove(a.key)
    put(store, b"a")
    [(_, payload)] = inventory.take()
    assert decode_batch(payload).events == (
        Stored((b"a", b"b"), ("kv",), "dram"),
        Stored((b"h",), ("full", "swa"), "hbm:0"),
        Removed((b"a",), ("kv",), "dram", RemovedReason.REMOVED),
        Stored((b"a",), ("kv",), "dram"),
    )


def test_a_store_without_a_listener_reports_nothing() -> None:
    store = Store(POOLS, make_policy("fifo"))
    assert store.listener is None
    for i in range(200):  # evictions included
        put(store, b"%d" % i)
    assert store.stats()["evicted_objects"] > 0


def test_churn_mirror_equals_the_store_and_the_ring_stays_bounded() -> None:
    store, inventory = make()
    rng = random.Random(7)
    mirror = InventoryMirror()
    published = 0
    for turn in range(RING_BATCHES + 1500):
        for _ in range(rng.randint(1, 3)):  # deposits into small pools: FIFO evicts all along
            key = b"k%d" % rng.randrange(3000)
            if key not in store:  # a third name a parent, so the ring's batches carry them too
                chain_put(store, key, b"k%d" % rng.randrange(3000) if rng.random() < 0.3 else b"",
                          HYBRID if rng.random() < 0.2 else PLAIN)
        for seq, payload in inventory.take():
            assert seq == published
            published += 1
            mirror.apply(decode_batch(payload))
        assert len(inventory.ring) <= RING_BATCHES
        if turn % 1000 == 0:
            assert set(mirror.keys) == ready_keys(store)
    assert set(mirror.keys) == ready_keys(store)
    # The mirror's parents are those of the objects held, no more: they leave with their keys.
    assert mirror.parents == {k: store._objects[k].parent for k in ready_keys(store) if store._objects[k].parent}
    assert store.stats()["evicted_objects"] > 1000
    assert len(inventory.ring) == RING_BATCHES and inventory.oldest == published - RING_BATCHES
    assert inventory.sizes()["events_ring"] == RING_BATCHES
    assert inventory.sizes()["events_ring_bytes"] == sum(len(p) for _, p in inventory.ring)
    # A replay from a seq the ring no longer holds starts at its oldest and says so.
    seqs, _, end = replayed(inventory, 0)
    assert seqs == list(range(inventory.oldest, inventory.oldest + REPLAY_MAX_BATCHES))
    assert (end.oldest, end.next) == (inventory.oldest, published)


def test_ring_byte_bound_keeps_the_newest_batch() -> None:
    store, inventory = make(ring_bytes=2000)
    inventory.take()
    for i in range(300):
        put(store, b"key-%04d" % i)
        inventory.take()
        assert inventory.ring_size <= 2000
    put(store, b"x" * 200, PLAIN)
    for i in range(10):
        put(store, bytes([i]) * 250)
    inventory.take()  # one batch larger than the byte bound: it stays, alone
    assert len(inventory.ring) == 1 and inventory.ring_size > 2000


def test_a_long_turn_is_split_into_batches_of_bounded_keys() -> None:
    store = Store((PoolSpec("kv", 64, 20000, "dram"),), make_policy("fifo"))
    inventory = Inventory("n", 1, {"kv": "dram"})
    store.listener = inventory
    for i in range(2 * MAX_BATCH_KEYS + 10):
        put(store, b"%d" % i)
    batches = [decode_batch(p) for _, p in inventory.take()]
    assert [b.key_count for b in batches] == [MAX_BATCH_KEYS - 1, MAX_BATCH_KEYS, 11]  # the first also holds cleared
    mirror = InventoryMirror()
    for b in batches:
        mirror.apply(b)
    assert set(mirror.keys) == ready_keys(store)


def test_replays_from_anywhere_and_cut_at_their_bound() -> None:
    store, inventory = make()
    for i in range(REPLAY_MAX_BATCHES + 100):
        put(store, b"%d" % i)
        inventory.take()
    n = inventory.next_seq
    seqs, payloads, end = replayed(inventory, 0)
    assert seqs == list(range(REPLAY_MAX_BATCHES)) and (end.oldest, end.next) == (0, n)
    seqs, _, _ = replayed(inventory, REPLAY_MAX_BATCHES)
    assert seqs == list(range(REPLAY_MAX_BATCHES, n))
    assert replayed(inventory, n)[0] == []  # up to date: only the end
    assert decode_batch(payloads[0]).events == (Cleared(), Stored((b"0",), ("kv",), "dram"))


@pytest.mark.parametrize(
    ("frames", "code", "path"),
    [
        ([b"", b"\xff" * 8], ErrorCode.OUT_OF_RANGE, "replay.start"),
        ([b"", (10**6).to_bytes(8, "big")], ErrorCode.OUT_OF_RANGE, "replay.start"),
        ([b"", b"\x01"], ErrorCode.MALFORMED, "replay.start"),
        ([b"\x00" * 8], ErrorCode.MALFORMED, "replay"),
        ([], ErrorCode.MALFORMED, "replay"),
    ],
    ids=["negative", "past-next", "short", "no-delimiter", "empty"],
)
def test_hostile_replay_requests_are_refused(frames: list[bytes], code: ErrorCode, path: str) -> None:
    _, inventory = make()
    inventory.take()
    answer, served = inventory.replay(frames)
    assert not served and len(answer) == 1 and answer[0][:2] == [b"", END_SEQ_FRAME]
    end = decode_replay_end(answer[0][2])
    assert (end.code, end.path, end.oldest, end.next) == (code, path, 0, 1) and end.reason


def test_a_replay_answer_is_bounded_in_bytes() -> None:
    store = Store((PoolSpec("kv", 64, 90000, "dram"),), make_policy("fifo"))
    inventory = Inventory("n", 1, {"kv": "dram"})
    store.listener = inventory
    for turn in range(20):  # batches of 4096 keys of 250 bytes: about 1 MiB each
        for i in range(MAX_BATCH_KEYS):
            put(store, b"%02d-%05d-" % (turn, i) + b"k" * 241)
        inventory.take()
    seqs, payloads, end = replayed(inventory, 0)
    assert sum(len(p) for p in payloads) <= REPLAY_MAX_BYTES < sum(len(p) for _, p in inventory.ring)
    assert seqs == list(range(len(seqs))) and 0 < len(seqs) < end.next
    # The next answer goes on from where this one stopped.
    assert replayed(inventory, len(seqs))[0][0] == len(seqs)


def test_a_turn_of_long_keys_is_split_into_batches_of_bounded_bytes() -> None:
    """Every message of the stream is at most ``BATCH_MAX_BYTES`` (what bounds a replay
    requester's queue in bytes, spec section 15.4), and the split loses and reorders nothing."""
    store = Store((PoolSpec("kv", 64, 20000, "dram"), PoolSpec("full", 64, 20000, "hbm:0")), make_policy("fifo"))
    inventory = Inventory("n", 1, {"kv": "dram", "full": "hbm:0"})
    store.listener = inventory
    for i in range(3000):  # changes of two layouts, interleaved in runs: several events a batch
        layout = PLAIN if (i // 700) % 2 == 0 else (("L0", "full"),)
        put(store, b"%05d-" % i + b"k" * 244, layout)
    payloads = [p for _, p in inventory.take()]
    assert len(payloads) > 4 and all(len(p) <= BATCH_MAX_BYTES for p in payloads)
    batches = [decode_batch(p) for p in payloads]
    assert isinstance(batches[0].events[0], Cleared)
    keys = [k for b in batches for e in b.events if isinstance(e, Stored) for k in e.keys]
    assert keys == [b"%05d-" % i + b"k" * 244 for i in range(3000)]
    mirror = InventoryMirror()
    for b in batches:
        mirror.apply(b)
    assert set(mirror.keys) == ready_keys(store)
    for key, tiers in mirror.keys.items():
        assert list(tiers) == ["dram" if (int(key[:5]) // 700) % 2 == 0 else "hbm:0"]


def chain_put(store: Store, key: bytes, parent: bytes, layout: tuple[tuple[str, str], ...] = PLAIN) -> ObjectEntry:
    outcome, entry = store.begin_deposit(key, layout, parent=parent)
    assert outcome is DepositOutcome.NEW and entry is not None
    store.commit(entry)
    return entry


def test_stored_events_carry_the_parents_deposits_named_and_leave_them_out_when_none() -> None:
    store, inventory = make()
    inventory.take()
    chain_put(store, b"b0", b"")
    chain_put(store, b"b1", b"b0")
    chain_put(store, b"b2", b"b1")
    put(store, b"alone")  # same layout, no parent: the event's parents say none for it
    chain_put(store, b"h1", b"b0", HYBRID)
    [(_, payload)] = inventory.take()
    events = decode_batch(payload).events
    assert events == (Stored((b"b0", b"b1", b"b2", b"alone"), ("kv",), "dram", (b"", b"b0", b"b1", b"")),
                      Stored((b"h1",), ("full", "swa"), "hbm:0", (b"b0",)))
    put(store, b"other")
    [(_, payload)] = inventory.take()
    assert decode_batch(payload).events == (Stored((b"other",), ("kv",), "dram"),)
    assert b"parents" not in payload  # a turn that names no parent is the batch it was before parents existed
    mirror = InventoryMirror()
    for payload in replayed(inventory, 0)[1]:
        mirror.apply(decode_batch(payload))
    assert mirror.parents == {b"b1": b"b0", b"b2": b"b1", b"h1": b"b0"}


def test_batches_cut_in_bytes_keep_each_parent_with_its_key() -> None:
    store = Store((PoolSpec("kv", 64, 20000, "dram"),), make_policy("fifo"))
    inventory = Inventory("n", 1, {"kv": "dram"})
    store.listener = inventory
    keys = [b"%05d-" % i + b"k" * 200 for i in range(3000)]
    for i, key in enumerate(keys):
        chain_put(store, key, keys[i - 1] if i % 3 else b"")
    payloads = [p for _, p in inventory.take()]
    assert len(payloads) > 4 and all(len(p) <= BATCH_MAX_BYTES for p in payloads)
    pairs = [(k, e.parent_of(i)) for p in payloads for e in decode_batch(p).events if isinstance(e, Stored)
             for i, k in enumerate(e.keys)]
    assert pairs == [(key, keys[i - 1] if i % 3 else b"") for i, key in enumerate(keys)]
