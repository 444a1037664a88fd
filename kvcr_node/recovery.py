"""What a node started on a state directory takes back from the last one (architecture §8).

``replay`` reads the journal's files (``kvcr_node.journal``) in order and keeps, per key,
the last READY record not removed since; a record whose slots a later one takes loses
them (its bytes were written over). ``verify`` then keeps only what the pools can vouch
for: pools this node keeps, whose files were there at the pool's size, slots in range,
and bytes that still match the digests recorded with them. Every record or object not
taken back is counted by reason (``Dropped``); nothing unverified is ever served.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvcr_io.digests import UNCHECKED, span_digest, unpack_digests
from kvcr_node.journal import Dropped, Record, RecordKind, file_body, files_to_read, read_frames, state_files
from kvcr_node.memory import PoolMemory


@dataclass
class Replayed:
    """The objects a directory's journal holds, and what it could not."""

    objects: dict[bytes, Record] = field(default_factory=dict)
    dropped: Counter[Dropped] = field(default_factory=Counter)
    seq: int = 0
    """The number the next record takes."""
    generation: int = 0
    """The generation the next node starts."""


def replay(directory: Path) -> Replayed:
    """Read ``directory``'s journal: what it holds, in record order."""
    out = Replayed()
    files = state_files(directory)
    out.generation = max((gen for gen, _, _ in files), default=-1) + 1
    owner: dict[tuple[str, int], bytes] = {}
    objects = out.objects

    def forget(key: bytes) -> None:
        record = objects.pop(key)
        for (_, pool), slot in zip(record.layout, memoryview(record.slots).cast("I"), strict=True):
            if owner.get((pool, slot)) == key:
                del owner[(pool, slot)]

    def count(reason: Dropped) -> None:
        out.dropped[reason] += 1

    for path in files_to_read(directory):
        for record in read_frames(file_body(path), count):
            out.seq = max(out.seq, record.seq + 1)
            if record.key in objects:
                forget(record.key)  # placed again, or removed
            if record.kind is RecordKind.REMOVED:
                continue
            for (_, pool), slot in zip(record.layout, memoryview(record.slots).cast("I"), strict=True):
                other = owner.get((pool, slot))
                if other is not None:
                    forget(other)
                    out.dropped[Dropped.SLOT_REUSED] += 1
            for (_, pool), slot in zip(record.layout, memoryview(record.slots).cast("I"), strict=True):
                owner[(pool, slot)] = record.key
            objects[record.key] = record
    return out


def verify(replayed: Replayed, memories: Mapping[str, PoolMemory]) -> list[Record]:
    """The replayed objects whose pools and bytes vouch for them, in record order; the rest
    counted in ``replayed.dropped``."""
    kept: list[Record] = []
    dropped = replayed.dropped
    for record in replayed.objects.values():
        reason = _check(record, memories)
        if reason is None:
            kept.append(record)
        else:
            dropped[reason] += 1
    return kept


def _check(record: Record, memories: Mapping[str, PoolMemory]) -> Dropped | None:
    slots = memoryview(record.slots).cast("I")
    for (_, pool), slot in zip(record.layout, slots, strict=True):
        memory = memories.get(pool)
        if memory is None or memory.device is not None or slot >= memory.spec.slot_count:
            return Dropped.FOREIGN
        if not memory.kept:
            return Dropped.POOL_LOST
    if record.digests:
        recorded = unpack_digests(record.digests)
        for (_, pool), slot, digest in zip(record.layout, slots, recorded, strict=True):
            if digest == UNCHECKED:
                continue
            size = memories[pool].spec.slot_size
            if span_digest(memories[pool].array[slot * size:(slot + 1) * size]) != digest:
                return Dropped.DIGEST_MISMATCH
    return None

