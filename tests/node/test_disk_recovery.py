"""The disk tier's journal and what a restarted node takes back from it, in process
(``kvcr_node.recovery.take_back_copies``, architecture §9): real state directories and
journal files under ``tmp_path``, the tier's bookkeeping as the node drives it, and no bytes
(the copies' bytes are checked when read back: ``tests/faults/test_disk_restart.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from kvcr_client.events import InventoryMirror
from kvcr_node.disk_pools import FileRegion
from kvcr_node.disk_tier import DiskTier, MemoryListener
from kvcr_node.eviction import Layout, make_policy
from kvcr_node.inventory import Inventory
from kvcr_node.journal import Dropped, Journal, RecordKind, _frame, read_frames, state_files
from kvcr_node.objects import Listeners
from kvcr_node.poolspec import PoolSpec
from kvcr_node.recovery import TakenBack, take_back_copies
from kvcr_node.state_dir import StateDir, StateDirError
from kvcr_node.store import DepositOutcome, ObjectEntry, Store
from kvcr_protocol.events import decode_batch

SLOT = 4096
DISK = PoolSpec("kv-disk", SLOT, 32, "disk:/unused")


class Site:
    """One disk directory across the in-process nodes started on it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = {DISK.name: path / "kv-disk.kvcr-pool"}
        self.incarnation = 0
        self.open: list[tuple[StateDir, Journal]] = []

    def start(self, memory_pools: list[PoolSpec] | None = None, disk: PoolSpec = DISK,
              compact_bytes: int = 1 << 20, inventory: Inventory | None = None) -> tuple[Store, DiskTier, TakenBack]:
        self.incarnation += 1
        state = StateDir(self.path / "state", [disk], str(self.path), self.incarnation, files=self.files)
        memory = Store(memory_pools or [PoolSpec("kv", SLOT, 8), PoolSpec("kv2", SLOT, 8)], make_policy("lru"))
        tier = DiskTier(memory, [disk], {disk.name: FileRegion(99, disk.size)}, make_policy("lru"), mark=0.5)
        memory.listener = MemoryListener(tier)
        taken = take_back_copies(state, tier, self.incarnation, compact_bytes, self._failed, inventory)
        self.open.append((state, taken.journal))
        return memory, tier, taken

    @staticmethod
    def _failed(exc: BaseException) -> None:
        raise AssertionError(f"a journal write failed: {exc}")

    def stop(self) -> None:
        state, journal = self.open.pop()
        journal.close()
        state.close()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    yield s
    while s.open:
        s.stop()


def layout(pool: str = "kv", n: int = 2) -> Layout:
    return tuple((f"L{i}", pool) for i in range(n))


def put(store: Store, key: bytes, spans: Layout) -> ObjectEntry:
    outcome, entry = store.begin_deposit(key, spans)
    assert outcome is DepositOutcome.NEW and entry is not None
    entry.digests = key.ljust(8, b"-")[:8] * len(spans)
    store.commit(entry)
    return entry


def copy_all(tier: DiskTier) -> None:
    """Write every copy the tier asks for, until it asks for none (each write ends well)."""
    while demotions := tier.next_demotions():
        for demotion in demotions:
            tier.demoted(demotion, True)


def fill(memory: Store, tier: DiskTier, keys: list[bytes], pool: str = "kv") -> None:
    for key in keys:
        put(memory, key, layout(pool))
        copy_all(tier)


def held(tier: DiskTier) -> dict[bytes, tuple[Layout, Layout, tuple[int, ...], bytes]]:
    """Each copy: its disk layout, its memory layout, its disk slots and its digests."""
    out = {}
    for key in list(tier.disk._objects):
        copy = tier.copy(key)
        assert copy is not None
        out[key] = (copy.layout, tier.layout(key), tuple(copy.slots), copy.digests)
    return out


def test_a_restart_takes_back_every_copy_with_its_slots_layouts_and_digests(site: Site) -> None:
    memory, tier, taken = site.start()
    assert taken.figures["recovered"] == 0 and taken.figures["dropped"] == {}
    fill(memory, tier, [b"a%d" % i for i in range(10)])
    fill(memory, tier, [b"b%d" % i for i in range(10)], pool="kv2")  # a second memory pool shares the disk pool
    before = held(tier)
    assert len(before) >= 12 and {m[0][1] for _, m, _, _ in before.values()} == {"kv", "kv2"}
    site.stop()

    memory, tier, taken = site.start()
    assert taken.figures["recovered"] == len(before) and taken.figures["dropped"] == {}
    assert held(tier) == before, "each copy in its slots, read back into the memory pool it came from"
    assert tier.check_invariants() == [] and tier.disk.check_invariants() == []
    # A copy taken back is read back as any other: into its memory pool, its disk copy claimed.
    key = next(k for k, (_, m, _, _) in before.items() if m[0][1] == "kv2" and k not in memory)
    promotion = tier.promote(key)
    assert not isinstance(promotion, DepositOutcome)
    assert promotion.entry.layout == before[key][1] and promotion.copy.claims == 1
    tier.promoted(promotion, True)
    assert memory.lookup(key) is not None and memory.lookup(key).digests == before[key][3]  # type: ignore[union-attr]


def test_the_copies_taken_back_are_published_and_so_is_every_later_change(site: Site) -> None:
    memory, tier, _ = site.start()
    fill(memory, tier, [b"a%d" % i for i in range(10)])
    before = held(tier)
    site.stop()
    inventory = Inventory("n", 2, {"kv": "dram", "kv2": "dram", DISK.name: "disk"})
    memory, tier, _ = site.start(inventory=inventory)
    memory.listener = Listeners(inventory, MemoryListener(tier))  # as the node has it

    def mirrored() -> dict[bytes, set[str]]:
        for _, payload in inventory.take():
            mirror.apply(decode_batch(payload))
        return {key: set(tiers) for key, tiers in mirror.keys.items()}

    mirror = InventoryMirror()
    assert mirrored() == {k: {"disk"} for k in before}, "cleared, then each copy taken back"
    key = next(iter(before))
    promotion = tier.promote(key)
    assert not isinstance(promotion, DepositOutcome)
    tier.promoted(promotion, True)
    assert mirrored()[key] == {"dram", "disk"}, "read back: held in both"
    other = next(k for k in before if k != key)
    memory.remove(key)  # a copy of a key stored anew goes; here its memory object is removed alone
    promotion = tier.promote(other)
    assert not isinstance(promotion, DepositOutcome)
    tier.promoted(promotion, False)  # its bytes did not match: the copy is dropped
    assert other not in mirrored() and mirrored()[key] == {"disk"}


def test_copies_let_go_stay_gone_and_their_slots_go_to_the_last_record(site: Site) -> None:
    memory, tier, _ = site.start()
    fill(memory, tier, [b"a%d" % i for i in range(10)])
    gone = sorted(k for k in held(tier) if k not in memory)[:2]
    for key in gone:
        assert tier.drop(key)
    # More objects than the disk pool holds: copies evicted for others, slots written again.
    fill(memory, tier, [b"c%d" % i for i in range(30)])
    before = held(tier)
    assert not set(gone) & set(before)
    site.stop()
    memory, tier, taken = site.start()
    assert held(tier) == before and taken.figures["dropped"] == {}


def test_a_journal_compacted_into_snapshots_reads_back_whole(site: Site) -> None:
    memory, tier, taken = site.start(compact_bytes=2048)
    for round_ in range(6):
        fill(memory, tier, [b"r%d-%d" % (round_, i) for i in range(12)])
        taken.journal.settle()
    assert taken.journal.compactions >= 2
    before = held(tier)
    site.stop()
    _, tier, taken = site.start()
    assert held(tier) == before and taken.figures["dropped"] == {}


def test_a_torn_last_record_is_dropped_and_the_rest_taken_back(site: Site) -> None:
    memory, tier, taken = site.start()
    fill(memory, tier, [b"a%d" % i for i in range(10)])
    before = held(tier)
    site.stop()
    journal = max(path for _, kind, path in state_files(site.path / "state") if kind == "journal")
    with open(journal, "ab") as f:
        f.write(_frame(msgpack.packb([RecordKind.READY, 999, 1, b"torn", [["L0", "kv-disk"]], b"\0\0\0\0",
                                      b"x" * 8, ["kv"]]))[:-3])
    _, tier, taken = site.start()
    assert held(tier) == before and taken.figures["dropped"] == {"torn": 1}


def test_records_that_do_not_fit_the_pools_now_are_dropped_by_reason(site: Site) -> None:
    memory, tier, _ = site.start()
    fill(memory, tier, [b"a%d" % i for i in range(10)])
    fill(memory, tier, [b"b%d" % i for i in range(10)], pool="kv2")
    before = held(tier)
    from_kv2 = [k for k, (_, m, _, _) in before.items() if m[0][1] == "kv2"]
    site.stop()
    # Memory pool kv2 is gone: its copies have nowhere to be read back into.
    memory, tier, taken = site.start([PoolSpec("kv", SLOT, 8), PoolSpec("other", SLOT, 8)])
    assert taken.figures["dropped"] == {"foreign": len(from_kv2)}
    assert set(held(tier)) == set(before) - set(from_kv2)
    site.stop()
    # A memory pool of another slot size is not paired with the disk pool: nothing fits.
    _, tier, taken = site.start([PoolSpec("kv", 2 * SLOT, 8)])
    assert held(tier) == {} and taken.figures["dropped"] == {"foreign": len(before) - len(from_kv2)}


def test_a_disk_pool_of_another_shape_is_refused_with_one_line(site: Site) -> None:
    site.start()
    site.stop()
    with pytest.raises(StateDirError, match="was written with other pools") as err:
        site.start(disk=PoolSpec("kv-disk", SLOT, 64, "disk:/unused"))
    assert "\n" not in str(err.value)


def test_a_directory_in_use_is_refused(site: Site) -> None:
    site.start()
    with pytest.raises(StateDirError, match="in use by a live node"):
        StateDir(site.path / "state", [DISK], str(site.path), 7, files=site.files)


@pytest.mark.parametrize(("origin", "why"), [
    (["kv"], None),
    (["kv", "kv"], "malformed"),
    ([1], "malformed"),
    ("kv", "malformed"),
])
def test_a_records_origin_is_checked_when_read(origin: object, why: str | None) -> None:
    body = [RecordKind.READY, 3, 1, b"k", [["L0", "kv-disk"]], b"\0\0\0\0", b"d" * 8, origin]
    dropped: list[Dropped] = []
    records = list(read_frames(_frame(msgpack.packb(body)), dropped.append))
    if why is None:
        assert [r.origin for r in records] == [("kv",)] and dropped == []
    else:
        assert records == [] and [d.value for d in dropped] == [why]


def test_a_memory_record_has_no_origin() -> None:
    body = [RecordKind.READY, 3, 1, b"k", [["L0", "kv"]], b"\0\0\0\0", b""]
    [record] = read_frames(_frame(msgpack.packb(body)), lambda d: None)
    assert record.origin is None
