"""The disk tier beside a node's memory pools (architecture §9): which objects have a copy
on disk, which copies are being written or read back, and what to copy next.

Pure, as the store is: no I/O, no clock. The copies live in a ``Store`` of their own over
the disk pools (its slots, its eviction by the node's policy, its claims: a copy being
read back is claimed), under the object's key; a copy's layout is the object's span names,
each in the disk pool paired with the span's memory pool (the first disk pool of the same
slot size). The node posts the moves this returns through its ``Transfers`` (a WRITE of a
demotion, a READ of a promotion, with its own agent on the other side) and reports each
one's end back.

- **Demotion** copies an object that stays READY in memory, claimed while its copy is
  written, so that eviction, which never waits on a disk, finds the copy already there:
  evicting an object with a READY copy leaves the object on disk. What is copied is what
  the memory store would evict next, once a pool's free slots fall under ``mark`` of it:
  as many slots' worth as are missing to the mark, counting the objects being copied.
  The claim's release records no access, so under LRU a copied object keeps its place
  in the eviction order; under FIFO a release puts it at the back, as any release does.
- **Promotion** places a memory copy of an object held only on disk (WRITING: operations
  wait on it as on any fill) and reads it back; the node checks its bytes against the
  digests taken when it was first stored before it commits it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvcr_node.eviction import EvictionPolicy, Layout
from kvcr_node.objects import DepositOutcome, ObjectEntry, ObjectState
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import Store
from kvcr_node.transfers import Move, Remote, list_moves

DEMOTIONS_IN_FLIGHT = 256
"""Objects being copied at once, at most."""
LOOK_AHEAD = 1024
"""Objects a look at what a pool would evict next visits at most: copies run that far ahead
of evictions at most, whatever the mark, so that a look costs the node's loop a bounded
time (about half a millisecond) however large the pool."""
DEMOTIONS_PER_LOOK = 32
"""Copies one look places at most (they go as one transfer): placing one costs the node's
loop some tens of microseconds, and a request waits for the turn it arrives in."""
LOOK_QUEUE = 256
"""Objects one look finds to copy at most, placed ``DEMOTIONS_PER_LOOK`` a turn. A walk costs
a few microseconds per object it visits, and the objects already copied sit at the front of
the eviction order: when each look found only what one turn places, every look walked past
all of them again (about 19 visits per object copied, half the node's time per copy in
``bench/disk.py``); a walk's finds now last several turns."""
DEMOTION_BYTES_IN_FLIGHT = 64 << 20
"""Bytes being copied at once, at most (a single larger object still goes alone): the disk's
queue stays short, and so does the time a claim holds an object."""


@dataclass(eq=False)
class Demotion:
    """An object's copy being written: the memory object (claimed) and its copy (WRITING)."""

    entry: ObjectEntry
    copy: ObjectEntry
    moves: list[Move]
    digests: bytes = b""
    """The copy's digests when the object has none (taken with ``integrity`` off, by the
    node, so that no copy is ever read back unchecked); else the object's own are kept."""


@dataclass(eq=False)
class Promotion:
    """An object read back from its copy (claimed) into a memory copy (WRITING)."""

    entry: ObjectEntry
    copy: ObjectEntry
    moves: list[Move]


class DiskTier:
    """The disk copies of a node's objects, and their demotions and promotions in flight."""

    def __init__(
        self, memory: Store, disk_pools: Sequence[PoolSpec], files: Mapping[str, Remote], policy: EvictionPolicy,
        mark: float, in_flight: int = DEMOTIONS_IN_FLIGHT, promote: bool = True,
    ) -> None:
        """``files``: each disk pool's file, as the remote side of its moves; ``mark``: a DRAM
        pool's free slots under this fraction of it start copying what it would evict next;
        ``promote``: an object read back stays in memory (else it is read through: it leaves
        memory with its readers' last claim, ``Store.read_through``)."""
        self.memory = memory
        self.promote_keeps = promote
        self.disk = Store(disk_pools, policy)
        self.disk.listener = self  # a copy it evicts or removes takes its memory layout with it
        self.files = dict(files)
        self.pairs: dict[str, str] = {}
        """DRAM pool -> the disk pool its spans are copied to (the first of its slot size)."""
        for name, spec in memory.pools.items():
            if spec.memory != "dram":
                continue  # the node reads HBM through no file backend of its own
            pair = next((d.name for d in disk_pools if d.slot_size == spec.slot_size), None)
            if pair is not None:
                self.pairs[name] = pair
        self._marks = {name: math.ceil(mark * memory.pools[name].slot_count) for name in self.pairs}
        self._in_flight = in_flight
        self.demoting: dict[bytes, Demotion] = {}
        self._bytes = 0
        """Bytes of the objects being copied."""
        self._copying = dict.fromkeys(self.pairs, 0)
        """Memory slots per pool whose objects are being copied (claimed, so not evictable,
        but on their way to being what eviction may take without loss)."""
        self.promoting: dict[bytes, Promotion] = {}
        self._layouts: dict[bytes, Layout] = {}
        """Per copy, the object's layout in memory pools (several memory pools may share a disk pool)."""
        self._queued: collections.deque[ObjectEntry] = collections.deque()
        """What the last look found to copy and is not yet placed (``next_demotions``)."""
        self._seen: tuple[int, int] | None = None
        """The memory store as of the last look that found nothing to copy (tick, objects)."""
        self.counts = dict.fromkeys(("demoted", "demotions_failed", "promoted", "promotions_failed", "mismatched",
                                     "dropped"), 0)
        """``mismatched``: read backs whose bytes did not match their digests (counted by the node)."""
        self.moved_bytes = dict.fromkeys(("demoted", "promoted"), 0)
        """Bytes of the copies written and of the read backs committed."""

    # -- reading ---------------------------------------------------------------------

    def copy(self, key: bytes) -> ObjectEntry | None:
        """The READY copy of ``key``, or None."""
        copy = self.disk.lookup(key)
        return copy if copy is not None and copy.state is ObjectState.READY else None

    def on_disk_only(self, key: bytes) -> ObjectEntry | None:
        """The READY copy of an object that is on disk only (not in memory, not being read back)."""
        copy = self.copy(key)
        return copy if copy is not None and key not in self.memory else None

    def layout(self, key: bytes) -> Layout:
        """The layout in memory pools of the object whose copy is under ``key``."""
        return self._layouts[key]

    def origin(self, copy: ObjectEntry) -> tuple[str, ...] | None:
        """Per span of ``copy``, the memory pool its object is read back into (what the
        journal records with it); None once the copy is gone. Safe from the journal's
        compaction thread: one lookup of a dict."""
        layout = self._layouts.get(copy.key)
        return None if layout is None else tuple(pool for _, pool in layout)

    def fits(self, layout: Layout) -> bool:
        """Whether every span of ``layout`` has a disk pool to go to."""
        pairs = self.pairs
        return all(pool in pairs for _, pool in layout)

    def adopt(self, copies: Sequence[tuple[bytes, Layout, bytes, bytes, bytes, tuple[str, ...]]]) -> list[ObjectEntry]:
        """Take back the copies a restarted node's journal recorded (``kvcr_node.recovery``):
        each ``(key, disk layout, packed slots, digests, parent, origin)``, checked by the caller
        against the pools (``pairs``); READY in their slots, in order, each reported stored."""
        memory_layouts: dict[Layout, Layout] = {}
        for key, layout, _, _, _, origin in copies:
            memory = tuple((name, pool) for (name, _), pool in zip(layout, origin, strict=True))
            self._layouts[key] = memory_layouts.setdefault(memory, memory)
        try:
            return self.disk.adopt_all([copy[:5] for copy in copies])
        except BaseException:
            for key, *_ in copies:
                self._layouts.pop(key, None)
            raise

    # -- demotion --------------------------------------------------------------------

    def next_demotions(self) -> list[Demotion]:
        """Copies to write now: what a pool under its mark would evict next and has no copy,
        up to the copies allowed in flight; each object is claimed and its copy placed.

        A look walks the eviction order and keeps up to ``LOOK_QUEUE`` objects to copy; they
        are placed ``DEMOTIONS_PER_LOOK`` a turn, each looked at again first (still this
        key's object, READY, evictable, without a copy), and the order is walked again once
        they are all placed."""
        room = min(self._in_flight - len(self.demoting), DEMOTIONS_PER_LOOK)
        if room <= 0 or self._bytes >= DEMOTION_BYTES_IN_FLIGHT or not self.pairs:
            return []
        memory = self.memory
        seen = (memory.tick, len(memory))
        queued = self._queued
        if not queued:
            if seen == self._seen:
                return []  # nothing changed since the last look found nothing to copy
            queued.extend(self._look())
        out: list[Demotion] = []
        while queued and len(out) < room:
            if self._bytes >= DEMOTION_BYTES_IN_FLIGHT and self.demoting:
                break
            entry = queued.popleft()
            if not self._wanted(entry):
                continue
            demotion = self._place(entry)
            if demotion is None:
                queued.clear()  # the disk pools are full of copies in use: look again later
                break
            out.append(demotion)
        if not out and not queued:
            self._seen = seen
        return out

    def _look(self) -> list[ObjectEntry]:
        """What each pool under its mark would evict next and has no copy, in order, up to ``LOOK_QUEUE``."""
        memory = self.memory
        stats = memory.pool_stats()
        found: list[ObjectEntry] = []
        for pool, mark in self._marks.items():
            want = min(mark - stats[pool]["free"] - self._copying[pool], stats[pool]["evictable"])
            if want <= 0:
                continue
            # Objects copied already (or being copied) still count as covered, but only the
            # first of the others are wanted: the walk ends there.
            found += memory.index.select_victims({pool: want}, LOOK_AHEAD, self._uncopied, LOOK_QUEUE - len(found)) or ()
            if len(found) >= LOOK_QUEUE:
                break
        return found

    def _wanted(self, entry: ObjectEntry) -> bool:
        """Whether a queued ``entry`` is still to copy: the live object of its key, READY and
        evictable (no claim), with no copy (a look of two pools may find it twice)."""
        return (self.memory.lookup(entry.key) is entry and entry.state is ObjectState.READY and not entry.claims
                and self._uncopied(entry))

    def _uncopied(self, entry: ObjectEntry) -> bool:
        """Whether ``entry`` still wants a copy: none held or being written, and a disk pool
        for every span."""
        return entry.key not in self.demoting and self.disk.lookup(entry.key) is None and self.fits(entry.layout)

    def _place(self, entry: ObjectEntry) -> Demotion | None:
        layout = entry.layout
        outcome, copy = self.disk.begin_deposit(
            entry.key, tuple((name, self.pairs[pool]) for name, pool in layout), parent=entry.parent)
        if outcome is not DepositOutcome.NEW or copy is None:
            return None
        self.memory.claim(entry)
        self._layouts[entry.key] = layout
        pools = self.memory.pools
        for pool, count in entry.info.need:
            self._copying[pool] += count
            self._bytes += count * pools[pool].slot_size
        demotion = Demotion(entry, copy, self._moves(layout, entry.slots, copy.slots))
        self.demoting[entry.key] = demotion
        return demotion

    def demoted(self, demotion: Demotion, ok: bool) -> None:
        """A copy's WRITE ended: the copy is READY (with the object's digests), or abandoned;
        the object is unclaimed either way (no access: it stays as cold as it was)."""
        del self.demoting[demotion.entry.key]
        entry, copy = demotion.entry, demotion.copy
        pools = self.memory.pools
        for pool, count in entry.info.need:
            self._copying[pool] -= count
            self._bytes -= count * pools[pool].slot_size
        live = entry.state is ObjectState.READY  # not condemned meanwhile
        self.memory.unclaim(entry, accessed=False)
        if ok and live:
            copy.digests = entry.digests or demotion.digests
            self.disk.commit(copy)
            self.counts["demoted"] += 1
            self.moved_bytes["demoted"] += self._bytes_of(entry)
        else:
            self.disk.abandon(copy)  # a WRITING copy: the store tells no listener
            del self._layouts[entry.key]
            self.counts["demotions_failed"] += 1

    # -- promotion -------------------------------------------------------------------

    def promote(self, key: bytes) -> Promotion | DepositOutcome:
        """Read an object held on disk only back into memory: its memory copy placed
        (WRITING, evicting as a deposit does) and its disk copy claimed; or the outcome that
        refused the placement (``CAPACITY``)."""
        if key in self.promoting:
            return self.promoting[key]
        copy = self.on_disk_only(key)
        if copy is None:
            raise ValueError(f"promote of {key!r}: no copy held on disk only")
        layout = self._layouts[key]
        outcome, entry = self.memory.begin_deposit(key, layout, parent=copy.parent)
        if outcome is not DepositOutcome.NEW or entry is None:
            return outcome
        self.disk.claim(copy, accessed=True)
        promotion = Promotion(entry, copy, self._moves(layout, entry.slots, copy.slots))
        self.promoting[key] = promotion
        return promotion

    def promoted(self, promotion: Promotion, ok: bool) -> None:
        """A READ back ended. ``ok`` (its bytes matched the copy's digests): the memory copy
        is READY with those digests; else it is abandoned and the copy, whose file cannot be
        trusted, dropped."""
        entry, copy = promotion.entry, promotion.copy
        self.disk.unclaim(copy, accessed=False)
        if ok:
            entry.digests = copy.digests  # what the read back was checked against, span by span
            self.memory.commit(entry, digested=True)  # while promoting: its listener keeps the copy (``stored_anew``)
            if not self.promote_keeps:
                self.memory.read_through(entry)
            del self.promoting[entry.key]
            self.counts["promoted"] += 1
            self.moved_bytes["promoted"] += self._bytes_of(entry)
            return
        del self.promoting[entry.key]
        self.memory.abandon(entry)
        self.counts["promotions_failed"] += 1
        self.drop(entry.key)

    def span_bytes(self, promotion: Promotion) -> list[int]:
        """The bytes of each span of a read back, in layout order."""
        pools = self.memory.pools
        return [pools[pool].slot_size for _, pool in promotion.entry.info.layout]

    def moves_of(self, promotion: Promotion, first: int, end: int) -> list[Move]:
        """The moves that read spans ``first`` to ``end - 1`` of a read back."""
        entry, copy = promotion.entry, promotion.copy
        if first == 0 and end == len(entry.info.layout):
            return promotion.moves
        return self._moves(entry.info.layout[first:end], entry.slots[first:end], copy.slots[first:end])

    # -- removal ---------------------------------------------------------------------

    def drop(self, key: bytes) -> bool:
        """Forget ``key``'s copy (its object was removed or condemned, or the copy is
        damaged); a copy being written or read is left to that transfer's end."""
        copy = self.disk.lookup(key)
        if copy is None or copy.state is not ObjectState.READY or copy.claims:
            return False
        self.disk.remove(key)
        self.counts["dropped"] += 1
        return True

    def stored_anew(self, entry: ObjectEntry) -> None:
        """``entry`` became READY in memory: unless it is a promotion's, the key was stored
        anew (a deposit, a put, a fetch), and a copy of what it held before goes: only the
        bytes stored last are ever served."""
        if entry.key not in self.promoting:
            self.drop(entry.key)

    # -- the disk store's listener (kvcr_node.objects.InventoryListener) ---------------

    def stored(self, copy: ObjectEntry) -> None:
        pass

    def removed(self, copy: ObjectEntry, evicted: bool) -> None:
        """A copy left the disk store (evicted for another, or removed): its layout goes too."""
        del self._layouts[copy.key]

    def _bytes_of(self, entry: ObjectEntry) -> int:
        pools = self.memory.pools
        return sum(count * pools[pool].slot_size for pool, count in entry.info.need)

    # -- moves -----------------------------------------------------------------------

    def _moves(self, layout: Layout, memory_slots: Sequence[int], disk_slots: Sequence[int]) -> list[Move]:
        """The moves between an object's memory slots and its copy's disk slots, span by
        span, runs merged per (memory pool, disk pool)."""
        pools = self.memory.pools
        by_pair: dict[str, tuple[list[int], list[int]]] = {}
        for (_, pool), slot, disk_slot in zip(layout, memory_slots, disk_slots, strict=True):
            offsets, slots = by_pair.setdefault(pool, ([], []))
            size = pools[pool].slot_size
            offsets.append(disk_slot * size)
            slots.append(slot)
        moves: list[Move] = []
        for pool, (offsets, slots) in by_pair.items():
            moves += list_moves(pool, pools[pool].slot_size, self.files[self.pairs[pool]], offsets, slots)
        return moves

    # -- accounting ------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {**self.counts, "copies": len(self.disk), "demoting": len(self.demoting),
                "promoting": len(self.promoting)}

    def check_invariants(self) -> list[str]:
        """Breaches, human-readable: the disk store's own, and copies and moves in flight
        that disagree with the stores."""
        out = [f"disk: {breach}" for breach in self.disk.check_invariants()]
        for key, demotion in self.demoting.items():
            if demotion.copy.state is not ObjectState.WRITING or demotion.entry.claims < 1:
                out.append(f"demotion of {key!r}: copy {demotion.copy.state.name}, {demotion.entry.claims} claims")
        for key, promotion in self.promoting.items():
            if promotion.entry.state is not ObjectState.WRITING or promotion.copy.claims < 1:
                out.append(f"promotion of {key!r}: entry {promotion.entry.state.name}, {promotion.copy.claims} claims")
        stray = [key for key in self._layouts if key not in self.disk]
        if stray or len(self._layouts) != len(self.disk):
            out.append(f"{len(self.disk)} copies, {len(self._layouts)} memory layouts ({len(stray)} of no copy)")
        return out


class MemoryListener:
    """The memory store's listener for the disk tier (``kvcr_node.objects.InventoryListener``):
    a key stored anew takes its old copy with it (``DiskTier.stored_anew``)."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier

    def stored(self, entry: ObjectEntry) -> None:
        self.tier.stored_anew(entry)

    def removed(self, entry: ObjectEntry, evicted: bool) -> None:
        pass
