"""What a node started on a state directory takes back from the last one (architecture §8).

``replay`` reads the journal's files (``kvcr_node.journal``) in order and keeps, per key,
the last READY record not removed since; a record whose slots a later one takes loses
them (its bytes were written over), and one written under another epoch of a pool's file
(the file was made anew since, ``kvcr_node.state_dir``) describes bytes that are gone.
``verify`` then keeps only what the pools can vouch for: pools this node keeps, slots in
range, and bytes that still match the digests recorded with them. Every record or object not
taken back is counted by reason (``Dropped``); nothing unverified is ever served.

The disk tier's copies (architecture §9) come back the same way from the disk pools' own
state directory (``take_back_copies``), checked against the pools but not read: reading
every byte of a disk at start would cost minutes, and a copy is read back into memory before
it is served, checked then against the digests recorded with it
(``kvcr_node.tiering``). A copy recorded without digests, or without the memory pools it is
read back into, is never taken back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcr_io.digests import UNCHECKED, span_digest, unpack_digests
from kvcr_node.disk_tier import DiskTier
from kvcr_node.journal import (
    Dropped,
    Journal,
    Layout,
    Record,
    RecordKind,
    files_to_read,
    read_file,
    read_frames,
    state_files,
)
from kvcr_node.memory import PoolMemory
from kvcr_node.objects import InventoryListener, Listeners, ObjectEntry
from kvcr_node.state_dir import StateDir
from kvcr_node.store import Store

log = logging.getLogger("kvcr.node")

START_FILES = 3
"""A start writes a snapshot of what it took back when the directory holds more journal files
than this (or something was dropped); else the files read stay the state until the first
compaction."""


@dataclass(frozen=True)
class TakenBack:
    """What a start took back: the journal it writes from now on, and the figures ``stats``
    shows under ``recovery``."""

    journal: Journal
    figures: dict[str, Any]


def take_back(
    state: StateDir, store: Store, memories: Mapping[str, PoolMemory], incarnation: int, compact_bytes: int,
    failed: Callable[[BaseException], None], inventory: InventoryListener | None,
) -> TakenBack:
    """Take back what the journal says the kept pools hold (verified) into ``store``, then
    journal from here on: the journal becomes the store's listener, before ``inventory``."""
    started = time.monotonic()
    replayed = replay(state.path, state.epochs)
    records = verify(replayed, memories)
    entries = store.adopt_all([(r.key, r.layout, r.slots, r.digests, r.parent) for r in records])
    figures = {
        "kept": state.previous if state.kept else 0,
        "recovered": len(entries),
        "dropped": {reason.value: n for reason, n in replayed.dropped.items()},
        "seconds": round(time.monotonic() - started, 6),
    }
    if entries or replayed.dropped:
        log.info("took back %d objects from %s (dropped: %s)", len(entries), state.path, figures["dropped"] or "none")
    kept = {name for name, mem in memories.items() if mem.device is None}

    def kept_whole(entry: ObjectEntry) -> bool:
        return all(pool in kept for pool, _ in entry.info.need)

    # The files read stay the state until the first compaction, unless some of what they
    # say was dropped (or there are many): then a snapshot of what was taken back at once.
    snapshot = bool(replayed.dropped) or len(state_files(state.path)) > START_FILES
    journal = Journal(state.path, incarnation, state.epochs, replayed.generation, replayed.seq,
                      {e.key: e for e in entries}, kept_whole, failed, compact_bytes, snapshot)
    store.listener = journal if inventory is None else Listeners(journal, inventory)
    return TakenBack(journal, figures)


def take_back_copies(
    state: StateDir, tier: DiskTier, incarnation: int, compact_bytes: int, failed: Callable[[BaseException], None],
    inventory: InventoryListener | None,
) -> TakenBack:
    """Take back the copies the disk pools' journal says they hold into ``tier`` (their pools
    checked; their bytes are checked when read back), then journal its copies from here on:
    the journal becomes a listener of the tier's store, after the tier and before ``inventory``."""
    started = time.monotonic()
    replayed = replay(state.path, state.epochs)
    records = verify_copies(replayed, tier)
    if inventory is not None:  # the copies taken back are published stored, after the start's ``cleared``
        tier.disk.listener = Listeners(tier, inventory)
    copies = tier.adopt([(r.key, r.layout, r.slots, r.digests, r.parent, r.origin)
                         for r in records if r.origin is not None])
    figures = {
        "recovered": len(copies),
        "dropped": {reason.value: n for reason, n in replayed.dropped.items()},
        "seconds": round(time.monotonic() - started, 6),
    }
    if copies or replayed.dropped:
        log.info("disk tier: took back %d copies from %s (dropped: %s)", len(copies), state.path,
                 figures["dropped"] or "none")
    snapshot = bool(replayed.dropped) or len(state_files(state.path)) > START_FILES
    journal = Journal(state.path, incarnation, state.epochs, replayed.generation, replayed.seq,
                      {c.key: c for c in copies}, lambda copy: True, failed, compact_bytes, snapshot, tier.origin)
    tier.disk.listener = Listeners(tier, journal) if inventory is None else Listeners(tier, journal, inventory)
    return TakenBack(journal, figures)


def verify_copies(replayed: Replayed, tier: DiskTier) -> list[Record]:
    """The replayed copies whose disk pools, slots and memory pools fit ``tier`` as it is
    now, with digests to check them by when read back, in record order; the rest counted."""
    pools = tier.disk.pools
    pairs = tier.pairs
    kept: list[Record] = []
    dropped = replayed.dropped
    for record in replayed.objects.values():
        origin = record.origin
        if origin is None or not record.digests:
            dropped[Dropped.MALFORMED] += 1
            continue
        slots = memoryview(record.slots).cast("I")
        fits = all(
            pool in pools and slot < pools[pool].slot_count and pairs.get(memory) == pool
            for (_, pool), slot, memory in zip(record.layout, slots, origin, strict=True))
        if fits:
            kept.append(record)
        else:
            dropped[Dropped.FOREIGN] += 1
    return kept


@dataclass
class Replayed:
    """The objects a directory's journal holds, and what it could not."""

    objects: dict[bytes, Record] = field(default_factory=dict)
    dropped: Counter[Dropped] = field(default_factory=Counter)
    seq: int = 0
    """The number the next record takes."""
    generation: int = 0
    """The generation the next node starts."""


def replay(directory: Path, epochs: Mapping[str, int]) -> Replayed:
    """Read ``directory``'s journal: what it holds, in record order. ``epochs``: the pools'
    files' epochs now; a record written under another epoch of a pool it names describes
    bytes that file no longer holds."""
    out = Replayed()
    files = state_files(directory)
    out.generation = max((gen for gen, _, _ in files), default=-1) + 1
    owners: dict[str, dict[int, bytes]] = {}
    """Pool -> slot -> the key of the object recorded in it."""
    objects = out.objects
    layouts: dict[Layout, Layout] = {}

    def forget(key: bytes) -> None:
        record = objects.pop(key)
        for (_, pool), slot in zip(record.layout, memoryview(record.slots).cast("I"), strict=True):
            owner = owners[pool]
            if owner.get(slot) == key:
                del owner[slot]

    def count(reason: Dropped) -> None:
        out.dropped[reason] += 1

    seq = 0
    for path in files_to_read(directory):
        read = read_file(path)
        if read is None:
            out.dropped[Dropped.CORRUPT] += 1  # its head: none of its records can be trusted
            continue
        written_under, body = read
        lost = {pool for pool, epoch in epochs.items() if written_under.get(pool) != epoch}
        for record in read_frames(body, count, layouts):
            if record.seq >= seq:
                seq = record.seq + 1
            key = record.key
            if key in objects:
                forget(key)  # placed again, or removed
            if record.kind is RecordKind.REMOVED:
                continue
            if lost and any(pool in lost for _, pool in record.layout):
                out.dropped[Dropped.POOL_LOST] += 1
                continue
            slots = memoryview(record.slots).cast("I")
            for (_, pool), slot in zip(record.layout, slots, strict=True):
                owner = owners.get(pool)
                if owner is None:
                    owner = owners[pool] = {}
                other = owner.get(slot)
                if other is not None and other != key:
                    forget(other)
                    out.dropped[Dropped.SLOT_REUSED] += 1
                owner[slot] = key
            objects[key] = record
    out.seq = seq
    return out


def verify(replayed: Replayed, memories: Mapping[str, PoolMemory]) -> list[Record]:
    """The replayed objects whose pools and bytes vouch for them, in record order; the rest
    counted in ``replayed.dropped``."""
    pools = {name: (memory.spec.slot_count, memory.spec.slot_size, memory.array)
             for name, memory in memories.items() if memory.device is None}
    kept: list[Record] = []
    dropped = replayed.dropped
    for record in replayed.objects.values():
        reason = _check(record, pools)
        if reason is None:
            kept.append(record)
        else:
            dropped[reason] += 1
    return kept


def _check(record: Record, pools: Mapping[str, tuple[int, int, Any]]) -> Dropped | None:
    """Why ``record`` cannot be taken back, or None. ``pools``: each kept pool's slot count,
    slot size and bytes."""
    slots = memoryview(record.slots).cast("I")
    recorded = unpack_digests(record.digests) if record.digests else None
    for i, ((_, pool), slot) in enumerate(zip(record.layout, slots, strict=True)):
        kept = pools.get(pool)
        if kept is None or slot >= kept[0]:
            return Dropped.FOREIGN
        if recorded is not None and recorded[i] != UNCHECKED:
            size = kept[1]
            if span_digest(kept[2][slot * size:(slot + 1) * size]) != recorded[i]:
                return Dropped.DIGEST_MISMATCH
    return None
