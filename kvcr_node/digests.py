"""The node's digests of its objects, and what it does when bytes no longer match them
(spec section 6.12, "Integrity").

When an object becomes ``READY`` (a deposit, a put's commit, a fetch landed), ``Digests``
takes the digest of each of its spans in host memory (``kvcr_io.digests``) and keeps them
on the entry; grants carry them to readers, who check what they read. A span in GPU
memory gets none (``UNCHECKED``): the node does not read device memory on its loop, and
the spec says so.

Someone with a grant can overwrite any slot, so the node checks again where only it can:
the spans it has just sent in a deliver of its own (``moves_intact``), and an object a
reader reported (``suspect``). An object whose bytes no longer match is condemned: its
key leaves the store at once, its slots with its last claim (``Store.condemn``); counted
and logged. A reader's word alone condemns nothing: the node reads the bytes itself.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Mapping, Sequence

from kvcr_io.digests import UNCHECKED, pack_digests, span_digest, unpack_digests
from kvcr_node.counters import Count, Counters
from kvcr_node.memory import PoolMemory
from kvcr_node.objects import ObjectEntry, ObjectState
from kvcr_node.store import Store
from kvcr_node.transfers import Move
from kvcr_protocol import MemoryKind

log = logging.getLogger("kvcr.node")

POSITIONS_KEPT = 64
"""Objects whose slot -> span map ``moves_intact`` keeps (the groups of one deliver look it
up once each; a few delivers in flight at once share the rest)."""


class Digests:
    """Takes, checks and acts on the digests of objects in the node's pools."""

    def __init__(self, memories: Mapping[str, PoolMemory], store: Store, counters: Counters) -> None:
        self.memories = memories
        self.store = store
        self.counters = counters
        self._positions: dict[int, tuple[ObjectEntry, dict[tuple[str, int], int]]] = {}

    def of(self, entry: ObjectEntry, first: int = 0, end: int | None = None) -> bytes:
        """The digests of ``entry``'s spans (``first`` to ``end - 1``: all by default) as
        they are now, one u64 each in layout order."""
        out = array("Q")
        layout, slots = entry.info.layout, entry.slot_view
        if first or end is not None:
            layout, slots = layout[first:end], slots[first:end]
        for (_, pool), slot in zip(layout, slots, strict=True):
            memory = self.memories[pool]
            if memory.kind is not MemoryKind.DRAM:
                out.append(UNCHECKED)
                continue
            out.append(self._slot_digest(memory, slot))
        return pack_digests(out)

    def take(self, entry: ObjectEntry) -> None:
        """``entry`` becomes READY: keep the digests of its bytes."""
        entry.digests = self.of(entry)

    def intact(self, entry: ObjectEntry) -> bool:
        """Whether every span of ``entry`` with a digest still holds the bytes it had at READY."""
        return not entry.digests or self.matches(entry.digests, entry)

    def matches(self, digests: bytes, entry: ObjectEntry, first: int = 0, end: int | None = None) -> bool:
        """Whether ``entry``'s spans ``first`` to ``end - 1`` (all by default) hold bytes with
        ``digests`` (packed, one per span of the whole object; ``UNCHECKED`` matches any)."""
        taken = unpack_digests(digests)[first:end]
        now = unpack_digests(self.of(entry, first, end))
        return all(was == UNCHECKED or was == is_ for was, is_ in zip(taken, now, strict=True))

    def moves_intact(self, entry: ObjectEntry, moves: Sequence[Move]) -> bool:
        """Whether the spans of ``entry`` that ``moves`` sent (each a run of slots of one
        pool) still hold the bytes they had at READY: checked after the transfer landed,
        before the node reports it, so bytes changed before or during it are found."""
        if not entry.digests:
            return True
        taken = unpack_digests(entry.digests)
        positions = self._positions_of(entry)
        for pool, first, _, _, _, count in moves:
            memory = self.memories[pool]
            if memory.kind is not MemoryKind.DRAM:
                continue
            for slot in range(first, first + count):
                was = taken[positions[(pool, slot)]]
                if was != UNCHECKED and was != self._slot_digest(memory, slot):
                    return False
        return True

    def condemn(self, entry: ObjectEntry, found_by: Count) -> None:
        """``entry``'s bytes were found changed (``found_by`` counts how): out of the store
        (once), counted and logged."""
        self.counters.inc(found_by)
        if entry.state is not ObjectState.READY:
            return
        self.store.condemn(entry)
        self.counters.inc(Count.OBJECTS_CONDEMNED)
        log.warning("object %s condemned: its bytes no longer match their digests (%s)", entry.key.hex(), found_by.value)

    def _slot_digest(self, memory: PoolMemory, slot: int) -> int:
        size = memory.spec.slot_size
        return span_digest(memory.array[slot * size:(slot + 1) * size])

    def _positions_of(self, entry: ObjectEntry) -> dict[tuple[str, int], int]:
        kept = self._positions.get(id(entry))
        if kept is not None and kept[0] is entry:
            return kept[1]
        positions = {(pool, slot): j for j, (pool, slot) in enumerate(zip(entry.info.signature, entry.slot_view, strict=True))}
        if len(self._positions) >= POSITIONS_KEPT:
            del self._positions[next(iter(self._positions))]
        self._positions[id(entry)] = (entry, positions)
        return positions
