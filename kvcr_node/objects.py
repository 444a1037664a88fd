"""What the store keeps per object: its state, its entry, and its lookup code.

An ``ObjectEntry`` is one stored object (key, layout, slots, state, claims, digests); the
store (``kvcr_node.store``) owns every entry and writes its fields, everyone else reads
them. Lifecycle (architecture §2): WRITING while its bytes arrive, READY once stored, and
CONDEMNED when its bytes are found no longer its own (spec section 6.12, "Integrity").
"""

from __future__ import annotations

import enum
from typing import Protocol

from kvcr_node.eviction import Layout, LayoutInfo


class ObjectState(enum.Enum):
    """architecture §2: an object is WRITING while its bytes arrive, then READY."""

    WRITING = "writing"
    READY = "ready"
    CONDEMNED = "condemned"
    """Its bytes were found changed: out of the store, its slots held until its last claim
    drops (``Store.condemn``)."""


class DepositOutcome(enum.Enum):
    """What ``begin_deposit`` did with one key."""

    NEW = "new"
    """A WRITING entry now holds slots; fill them, then ``commit`` or ``abandon``."""
    DUPLICATE = "duplicate"
    """The key is WRITING or READY with the same layout: no second transfer."""
    LAYOUT_MISMATCH = "layout_mismatch"
    """The key is stored with another layout."""
    CAPACITY = "capacity"
    """Not enough free and evictable slots; nothing was evicted."""
    DROPPED = "dropped"
    """An optional deposit the policy's admission hook declined."""
    UNKNOWN_POOL = "unknown_pool"
    """The layout names a pool this store does not have."""


_WRITING = ObjectState.WRITING
_READY = ObjectState.READY

LOOKUP_ABSENT = 0
"""``Store.lookup_codes``' code of a key the store does not hold."""
MAX_TIERS = 126
"""Distinct pool memories (tiers) a store may have: each tier takes two lookup codes of one byte."""


def lookup_code(tier: int, state: ObjectState) -> int:
    """The lookup code of an object in tier ``tier`` (an index into ``Store.tiers``) in ``state``.

    Codes start at 2 (0 is ``LOOKUP_ABSENT``, 1 is left to callers), two per tier: WRITING,
    then READY. One byte per key lets a batch lookup fill a column (spec section 6.9).
    """
    return 2 + 2 * tier + (state is _READY)


class ObjectEntry:
    """One stored object: its key, layout, slots, state, claims and last access.

    Small on purpose (the goal: under 1 KiB of index memory per object, everything
    counted): the layout lives in a
    :class:`LayoutInfo` shared by every object with an equal layout, and the slots are
    packed as 32-bit integers. Treat every field as read-only: the store writes them.
    """

    __slots__ = ("_slots", "claims", "digests", "index_seq", "info", "key", "last_access", "lookup", "parent", "state")

    key: bytes
    info: LayoutInfo
    _slots: bytes
    state: ObjectState
    claims: int
    last_access: int
    index_seq: int
    lookup: int
    """The object's lookup code (``lookup_code``): its tier and state in one byte."""
    digests: bytes
    """One u64 per span in layout order, taken when it became READY (``kvcr_node.digests``);
    empty when none were taken."""
    parent: bytes
    """The key its deposit named as its parent (spec section 6.4, "Parents"); b"" for none.
    Only the inventory events carry it on."""

    def __init__(self, key: bytes, info: LayoutInfo, slots: bytes, tier: int = 0, parent: bytes = b"") -> None:
        self.key = key
        self.info = info
        self._slots = slots
        self.digests = b""
        self.parent = parent
        self.state = _WRITING
        self.claims = 0
        self.last_access = 0
        self.index_seq = 0
        self.lookup = lookup_code(tier, _WRITING)

    @property
    def layout(self) -> Layout:
        """The spans, each ``(span name, pool name)``, in order."""
        return self.info.layout

    @property
    def slots(self) -> tuple[int, ...]:
        """One slot per span, in that span's pool, in layout order."""
        return tuple(memoryview(self._slots).cast("I"))

    @property
    def packed_slots(self) -> bytes:
        """The slots packed as 32-bit integers, in layout order (what the store keeps)."""
        return self._slots

    @property
    def slot_view(self) -> memoryview:
        """The slots as a read-only view of 32-bit integers (no copy)."""
        return memoryview(self._slots).cast("I")

    def pool_slots(self) -> dict[str, list[int]]:
        """The slots grouped by pool, each list in layout order."""
        need = self.info.need
        if len(need) == 1:
            return {need[0][0]: memoryview(self._slots).cast("I").tolist()}
        out: dict[str, list[int]] = {}
        for pool, slot in zip(self.info.signature, memoryview(self._slots).cast("I"), strict=True):
            out.setdefault(pool, []).append(slot)
        return out

    def __repr__(self) -> str:
        return f"ObjectEntry(key={self.key!r}, state={self.state.name}, claims={self.claims}, slots={self.slots!r})"


class InventoryListener(Protocol):
    """Told of each object that becomes READY and each READY object that leaves (spec section 15)."""

    def stored(self, entry: ObjectEntry) -> None: ...

    def removed(self, entry: ObjectEntry, evicted: bool) -> None: ...


class Listeners:
    """Tells each of ``listeners`` in turn (the journal before the inventory's events)."""

    def __init__(self, *listeners: InventoryListener) -> None:
        self.listeners = listeners

    def stored(self, entry: ObjectEntry) -> None:
        for listener in self.listeners:
            listener.stored(entry)

    def removed(self, entry: ObjectEntry, evicted: bool) -> None:
        for listener in self.listeners:
            listener.removed(entry, evicted)
