"""The journal, its replay and the state directory, in process (architecture §8).

A real store and real files: objects become READY and leave, the journal records them, and
a replay of the directory gives back exactly what the store holds, whatever was cut,
flipped or left half-compacted. Pool memory is file-backed as a node's is, so verification
reads real bytes.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr_io.digests import pack_digests, span_digest
from kvcr_node.eviction import make_policy
from kvcr_node.journal import FILE_MAGIC, Dropped, Journal, file_head, files_to_read, state_files
from kvcr_node.memory import PoolMemory
from kvcr_node.objects import ObjectEntry
from kvcr_node.poolspec import PoolSpec
from kvcr_node.recovery import replay, verify
from kvcr_node.slots import SlotAllocator, SlotError
from kvcr_node.state_dir import StateDir, StateDirError
from kvcr_node.store import Store, StoreError

SLOT = 4096
POOLS = (PoolSpec("kv", SLOT, 32), PoolSpec("small", 512, 16))


class Held:
    """A store, its journal in ``path``, and pools in files: what a node with a state directory has."""

    def __init__(self, path: Path, pool_dir: Path, compact_bytes: int = 1 << 20, incarnation: int = 7,
                 snapshot: bool = True) -> None:
        self.path = path
        self.state = StateDir(path, POOLS, str(pool_dir), incarnation)
        self.memories = {spec.name: PoolMemory(spec, None, self.state.files[spec.name]) for spec in POOLS}
        self.store = Store(POOLS, make_policy("lru"))
        self.store.on_ready = self.digest
        self.replayed = replay(path, self.state.epochs)
        records = verify(self.replayed, self.memories)
        entries = self.store.adopt_all([(r.key, r.layout, r.slots, r.digests, r.parent) for r in records])
        self.failures: list[BaseException] = []
        self.journal = Journal(path, incarnation, self.state.epochs, self.replayed.generation, self.replayed.seq,
                               {e.key: e for e in entries}, lambda entry: True, self.failures.append, compact_bytes,
                               snapshot)
        self.store.listener = self.journal

    def digest(self, entry: ObjectEntry) -> None:
        out = array("Q")
        for (_, pool), slot in zip(entry.layout, entry.slot_view, strict=True):
            size = self.memories[pool].spec.slot_size
            out.append(span_digest(self.memories[pool].array[slot * size:(slot + 1) * size]))
        entry.digests = pack_digests(out)

    def put(self, key: bytes, spans: int = 2, pool: str = "kv", parent: bytes = b"") -> ObjectEntry:
        layout = tuple((f"L{i}", pool) for i in range(spans))
        _, entry = self.store.begin_deposit(key, layout, parent=parent)
        assert entry is not None
        for slot in entry.slots:
            size = self.memories[pool].spec.slot_size
            self.memories[pool].array[slot * size:(slot + 1) * size] = (hash((key, slot)) & 0xFF)
        self.store.commit(entry)
        return entry

    def close(self) -> None:
        self.journal.close()
        for memory in self.memories.values():
            memory.close()
        self.state.close()


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    pool_dir = Path(os.environ.get("KVCR_TEST_POOL_DIR", "/dev/shm")) / f"kvcr-journal-{os.getpid()}-{tmp_path.name}"
    pool_dir.mkdir()
    try:
        yield tmp_path / "state", pool_dir
    finally:
        for p in pool_dir.iterdir():
            p.unlink()
        pool_dir.rmdir()


def reopen(dirs: tuple[Path, Path], **kw: int) -> Held:
    return Held(dirs[0], dirs[1], **kw)


def test_what_was_ready_comes_back_and_what_left_does_not(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs)
    for i in range(20):
        held.put(b"k%d" % i)
    held.store.remove(b"k3")
    _, writing = held.store.begin_deposit(b"writing", (("L0", "kv"),))  # never committed: never recorded
    assert writing is not None
    before = {key: (e.layout, e.slots, e.digests) for key in [b"k%d" % i for i in range(20) if i != 3]
              for e in [held.store.lookup(key)] if e is not None}
    held.journal.flush()
    held.close()

    again = reopen(dirs, incarnation=9)
    assert again.state.previous == 7
    after = {key: (e.layout, e.slots, e.digests) for key in before if (e := again.store.lookup(key)) is not None}
    assert after == before
    assert again.store.lookup(b"k3") is None and again.store.lookup(b"writing") is None
    assert again.replayed.dropped == {}
    assert again.store.check_invariants() == []
    again.close()


def test_parents_come_back_with_their_objects_through_journal_and_snapshot(dirs: tuple[Path, Path]) -> None:
    """A restarted node publishes what it took back with the parents they were stored
    with (spec section 15.2): the journal records them, a snapshot too."""
    held = reopen(dirs, compact_bytes=1)  # every append compacts: the objects come back from a snapshot
    held.put(b"p0")
    held.put(b"p1", parent=b"p0")
    held.put(b"p2", parent=b"p1")
    held.journal.flush()
    held.close()
    again = reopen(dirs)
    assert {key: e.parent for key in (b"p0", b"p1", b"p2") if (e := again.store.lookup(key)) is not None} == {
        b"p0": b"", b"p1": b"p0", b"p2": b"p1"}
    again.put(b"p3", parent=b"p2")
    again.journal.flush()
    again.close()
    third = reopen(dirs)
    assert third.replayed.dropped == {}
    assert [e.parent for key in (b"p0", b"p1", b"p2", b"p3") if (e := third.store.lookup(key)) is not None] == [
        b"", b"p0", b"p1", b"p2"]
    third.close()


def test_evictions_are_recorded_and_a_reused_slot_drops_the_old_record(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs)
    for i in range(40):  # 32 slots of 2 spans: evictions
        held.put(b"k%d" % i)
    live = {e.key for e in held.store.index.members()[0]}
    held.close()
    again = reopen(dirs)
    assert {key for key in (b"k%d" % i for i in range(40)) if key in again.store} == live
    again.close()


def test_a_torn_tail_and_a_flipped_record_are_dropped_and_counted(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs, compact_bytes=1 << 30)
    for i in range(10):
        held.put(b"k%d" % i, spans=1)
    held.close()
    journal = max(p for _, kind, p in state_files(dirs[0]) if kind == "journal")
    data = bytearray(journal.read_bytes())
    head = len(file_head(held.state.epochs))
    assert data.startswith(FILE_MAGIC)
    data[head + 20] ^= 0xFF  # inside the first record
    journal.write_bytes(bytes(data[:-5]))  # and the last one cut short
    again = reopen(dirs)
    assert again.replayed.dropped[Dropped.CORRUPT] == 1
    assert again.replayed.dropped[Dropped.TORN] == 1
    assert len(again.store) == 8
    again.close()


def test_bytes_changed_while_no_node_ran_are_never_adopted(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs)
    entry = held.put(b"changed", spans=1)
    held.put(b"intact", spans=1)
    slot = entry.slots[0]
    held.close()
    with open(reopen_pool_file(dirs, "kv"), "r+b") as f:
        f.seek(slot * SLOT + 100)
        f.write(b"\x00\x01\x02")
    again = reopen(dirs)
    assert again.replayed.dropped == {Dropped.DIGEST_MISMATCH: 1}
    assert b"changed" not in again.store and b"intact" in again.store
    again.close()


def reopen_pool_file(dirs: tuple[Path, Path], pool: str) -> Path:
    [path] = [p for p in dirs[1].iterdir() if p.name.endswith("-" + pool)]
    return path


def test_a_pool_file_cut_or_removed_drops_its_objects_and_keeps_the_others(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs)
    held.put(b"kv-object")
    held.put(b"small-object", pool="small")
    held.close()
    os.truncate(reopen_pool_file(dirs, "kv"), SLOT)
    again = reopen(dirs)
    assert again.replayed.dropped == {Dropped.POOL_LOST: 1}
    assert b"kv-object" not in again.store and b"small-object" in again.store
    again.close()
    reopen_pool_file(dirs, "small").unlink()
    third = reopen(dirs)
    assert len(third.store) == 0 and third.replayed.dropped == {Dropped.POOL_LOST: 1}
    third.close()


def test_compaction_keeps_the_files_bounded_and_the_state_whole(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs, compact_bytes=4096)
    for round_ in range(30):
        for i in range(12):
            held.put(b"r%d-%d" % (round_, i), spans=1)
        for i in range(12):
            if i % 3:
                held.store.remove(b"r%d-%d" % (round_, i))
        held.journal.flush()
        held.journal.settle()  # a compaction is not started while one runs: at any machine load, one per bound
    live = {key for key in list(held.journal.held)}
    held.close()
    assert held.journal.compactions >= 3
    files = state_files(dirs[0])
    assert len(files) <= 3, files
    again = reopen(dirs)
    assert {e.key for e in again.store.index.members()[0]} == live
    again.close()


def test_a_compaction_cut_short_leaves_a_state_that_reads_whole(dirs: tuple[Path, Path]) -> None:
    """A node killed between a new generation's first append and its snapshot's rename:
    the new journal has no snapshot; the old snapshot and both journals make the state."""
    held = reopen(dirs, compact_bytes=1 << 30)
    for i in range(6):
        held.put(b"a%d" % i, spans=1)
    held.journal.flush()
    gen = held.journal.generation
    held.journal.close()
    # What a compaction leaves when killed before the rename: a new journal, a partial snapshot.
    partial = dirs[0] / f"snapshot.{gen + 1:08d}.tmp"
    partial.write_bytes(FILE_MAGIC + b"\x00" * 10)
    held.journal.fd = os.open(dirs[0] / f"journal.{gen + 1:08d}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(held.journal.fd, file_head(held.state.epochs))
    held.store.remove(b"a0")
    held.put(b"b0", spans=1)
    held.journal.close()
    for memory in held.memories.values():
        memory.close()
    held.state.close()
    assert [p.name for p in files_to_read(dirs[0])] == [f"snapshot.{gen:08d}", f"journal.{gen:08d}", f"journal.{gen + 1:08d}"]
    again = reopen(dirs)
    assert sorted(again.store.index.members()[0], key=lambda e: e.key) and \
        {e.key for e in again.store.index.members()[0]} == {b"a1", b"a2", b"a3", b"a4", b"a5", b"b0"}
    again.close()


def test_a_write_that_fails_drops_the_journal_and_the_next_one_starts_again(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs)
    held.put(b"before", spans=1)
    held.journal.flush()
    os.close(held.journal.fd)
    held.journal.fd = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    held.put(b"during", spans=1)
    held.journal.flush()
    assert len(held.failures) == 1 and held.journal.write_failures == 1
    assert state_files(dirs[0]) == []  # a restart now starts empty, not from a journal with a hole
    held.put(b"after", spans=1)
    held.journal.flush()  # a new generation from what is held
    held.close()
    again = reopen(dirs)
    assert {b"before", b"during", b"after"} <= set(again.journal.held)
    again.close()


def test_a_second_node_on_the_directory_and_other_pools_are_refused(dirs: tuple[Path, Path]) -> None:
    held = reopen(dirs)
    with pytest.raises(StateDirError, match=r"in use by a live node \(pid \d+\)"):
        StateDir(dirs[0], POOLS, str(dirs[1]), 8)
    held.close()
    with pytest.raises(StateDirError, match="written with other pools"):
        StateDir(dirs[0], (PoolSpec("kv", SLOT, 64),), str(dirs[1]), 8)
    layout = dirs[0] / "layout.json"
    layout.write_text(layout.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(StateDirError, match="state version 99"):
        StateDir(dirs[0], POOLS, str(dirs[1]), 8)
    layout.write_text("{not json")
    with pytest.raises(StateDirError, match="unreadable"):
        StateDir(dirs[0], POOLS, str(dirs[1]), 8)


def test_adopt_refuses_what_it_cannot_place_and_places_nothing() -> None:
    store = Store(POOLS, make_policy("lru"))
    slots = array("I", [0, 1]).tobytes()
    with pytest.raises(StoreError):
        store.adopt_all([(b"a", (("L0", "kv"), ("L1", "kv")), slots, b"", b""), (b"b", (("L0", "kv"),), array("I", [1]).tobytes(), b"", b"")])
    assert len(store) == 0 and store.pool_stats()["kv"]["free"] == 32
    with pytest.raises(StoreError):
        store.adopt_all([(b"a", (("L0", "nope"),), array("I", [0]).tobytes(), b"", b"")])
    entries = store.adopt_all([(b"a", (("L0", "kv"), ("L1", "kv")), slots, b"", b"")])
    assert entries[0].slots == (0, 1) and store.pool_stats()["kv"]["free"] == 30
    _, entry = store.begin_deposit(b"c", (("L0", "kv"),))
    assert entry is not None and entry.slots[0] not in (0, 1)
    assert store.check_invariants() == []


def test_reserve_takes_exactly_the_slots_named() -> None:
    alloc = SlotAllocator(8)
    alloc.reserve([5, 2])
    assert alloc.free_count == 6 and alloc.is_allocated(5) and alloc.is_allocated(2)
    for bad in ([2], [9], [3, 3]):
        with pytest.raises(SlotError):
            alloc.reserve(bad)
    assert sorted(alloc.alloc(6)) == [0, 1, 3, 4, 6, 7]
    assert alloc.check() == []


@pytest.mark.parametrize("body", [
    [0, 1, 7, "str-key", [["L0", "kv"]], b"\x00" * 4, b""],  # a key as str
    [0, 1, 7, b"k", [], b"", b""],  # no span
    [0, 1, 7, b"k", [["L0", "kv"]], b"\x00" * 8, b""],  # two slots for one span
    [0, 1, 7, b"k", [["L0", "kv"]], b"\x00" * 4, b"\x00" * 3],  # digests of the wrong length
    [9, 1, 7, b"k"],  # an unknown kind
    [0, 1],  # cut short
    {"kind": 0},  # not a list
    7,
    [0, 1, 7, b"k", [["L0", "kv"]], b"\x00" * 4, b"", None, "parent"],  # a parent as str
    [0, 1, 7, b"k", [["L0", "kv"]], b"\x00" * 4, b"", None, b"k"],  # its own parent
    [0, 1, 7, b"k", [["L0", "kv"]], b"\x00" * 4, b"", None, b"p", 1],  # a field past the parent
], ids=["str-key", "no-span", "slots-count", "digests-length", "kind", "short", "map", "int", "parent-str",
        "parent-self", "past-parent"])
def test_a_record_whose_bytes_check_out_but_do_not_decode_is_dropped(body: object, dirs: tuple[Path, Path]) -> None:
    import msgpack

    from kvcr_node.journal import _frame

    held = reopen(dirs, compact_bytes=1 << 30)
    held.put(b"good", spans=1)
    held.journal.pending += _frame(msgpack.packb(body))
    held.close()
    again = reopen(dirs)
    assert again.replayed.dropped == {Dropped.MALFORMED: 1}
    assert set(again.journal.held) == {b"good"}
    again.close()


def test_records_naming_pools_or_slots_this_node_does_not_have_are_foreign(dirs: tuple[Path, Path]) -> None:
    import msgpack

    from kvcr_node.journal import _frame

    held = reopen(dirs, compact_bytes=1 << 30)
    for key, pool, slot in ((b"no-pool", "gone", 0), (b"past-end", "kv", 32)):
        body = [0, 5, 7, key, [["L0", pool]], array("I", [slot]).tobytes(), b""]
        held.journal.pending += _frame(msgpack.packb(body))
    held.close()
    again = reopen(dirs)
    assert again.replayed.dropped == {Dropped.FOREIGN: 2} and len(again.store) == 0
    again.close()


def test_a_pool_file_made_anew_is_never_taken_for_the_old_one_without_digests(dirs: tuple[Path, Path]) -> None:
    """No digests to catch it (``integrity`` off): the epochs alone keep records of a lost
    pool file's bytes from describing the zeros of the file made in its place, however many
    restarts come between."""
    held = reopen(dirs, compact_bytes=1 << 30, snapshot=False)
    held.store.on_ready = None
    held.put(b"old", spans=1)
    held.close()
    os.truncate(reopen_pool_file(dirs, "kv"), 1)
    for start in range(3):  # nothing written in between: each start reads the same old records
        again = reopen(dirs, snapshot=False)
        # The first start makes the file anew; the next ones find it whole, under its new epoch.
        assert ("kv" in again.state.kept) == (start > 0)
        assert b"old" not in again.store and again.replayed.dropped == {Dropped.POOL_LOST: 1}
        again.close()
