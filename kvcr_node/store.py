"""The node's object store: pools, slots, object states, claims and eviction.

Pure and single-threaded: no I/O, no clock, no locks. The caller (the node's progress
loop) moves the bytes; the store only decides which slots hold which object and which
objects may go. Every method runs in time proportional to the object it touches and,
when it evicts, O(k log n) for k victims (architecture §3).

Lifecycle (architecture §2)::

    begin_deposit -> WRITING --commit--> READY <--claim/unclaim--> READY (claimed)
                        |                  |
                     abandon         remove / eviction (unclaimed only)
                                     condemn: the key goes now, the slots with the last claim
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Sequence

from kvcr_node.eviction import EvictionIndex, EvictionPolicy, Layout, LayoutInfo
from kvcr_node.objects import (
    LOOKUP_ABSENT,
    MAX_TIERS,
    DepositOutcome,
    InventoryListener,
    ObjectEntry,
    ObjectState,
    lookup_code,
)
from kvcr_node.poolspec import PoolSpec
from kvcr_node.slots import SlotAllocator
from kvcr_node.store_audit import StoreTables, audit

__all__ = [
    "LOOKUP_ABSENT",
    "DepositOutcome",
    "InventoryListener",
    "ObjectEntry",
    "ObjectState",
    "PoolSpec",
    "Store",
    "StoreError",
    "lookup_code",
]


class StoreError(ValueError):
    """The caller misused the store (claim on WRITING, double commit, ...)."""


_WRITING = ObjectState.WRITING
_READY = ObjectState.READY
_CONDEMNED = ObjectState.CONDEMNED


class Store:
    """Pools of slots, the objects in them, and the eviction index over them."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        policy: EvictionPolicy,
        low_watermark: float = 0.1,
    ) -> None:
        if not pools:
            raise ValueError("a store needs at least one pool")
        if not 0.0 <= low_watermark <= 1.0:
            raise ValueError(f"low_watermark must be within [0, 1], got {low_watermark!r}")
        self._pools: dict[str, PoolSpec] = {}
        for spec in pools:
            if spec.name in self._pools:
                raise ValueError(f"pool {spec.name!r} is defined twice")
            self._pools[spec.name] = spec
        self.tiers: tuple[str, ...] = tuple(dict.fromkeys(spec.memory for spec in pools))
        """The distinct memories of the pools, in pool order: an object's tier is its first span's pool's."""
        if len(self.tiers) > MAX_TIERS:
            raise ValueError(f"{len(self.tiers)} distinct pool memories, at most {MAX_TIERS}")
        self._tier_of = {spec.name: self.tiers.index(spec.memory) for spec in pools}
        self._alloc = {name: SlotAllocator(spec.slot_count) for name, spec in self._pools.items()}
        self._policy = policy
        self._index: EvictionIndex[ObjectEntry] = EvictionIndex(policy)
        self._objects: dict[bytes, ObjectEntry] = {}
        # Equal layouts share one LayoutInfo (and so one layout tuple); an info leaves
        # this table with its last object.
        self._layouts: dict[Layout, LayoutInfo] = {}
        self._tick = 0
        self._writing = 0
        self._ready = 0
        self._claims = 0
        self._pool_objects = dict.fromkeys(self._pools, 0)
        self._evictions = dict.fromkeys(self._pools, 0)
        self._evicted_objects = 0
        self._condemned: dict[int, ObjectEntry] = {}
        """Condemned entries still claimed, by id: their slots are not free yet."""
        self._condemned_objects = 0
        self._read_through: dict[int, ObjectEntry] = {}
        """Objects read back from the disk tier for their readers only (``read_through``), by id:
        they leave memory with their last claim."""
        self._low_watermark = low_watermark
        self._threshold = {name: low_watermark * spec.slot_count for name, spec in self._pools.items()}
        self._armed = dict.fromkeys(self._pools, True)
        self._events: list[str] = []
        self.listener: InventoryListener | None = None
        self.on_ready: Callable[[ObjectEntry], None] | None = None
        """Called as an object becomes READY, before anyone can read it (the node's digests)."""
        """Told of READY objects and removals when the node publishes inventory events; None costs nothing."""

    # -- reading ----------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def index(self) -> EvictionIndex[ObjectEntry]:
        """The eviction index (read it; never change it from outside)."""
        return self._index

    @property
    def pools(self) -> dict[str, PoolSpec]:
        return dict(self._pools)

    @property
    def tick(self) -> int:
        """The logical clock: advances on every access (commit, accessed claim or unclaim)."""
        return self._tick

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: bytes) -> bool:
        return key in self._objects

    def lookup(self, key: bytes) -> ObjectEntry | None:
        """The entry stored under ``key``, WRITING or READY, or None. Not an access."""
        return self._objects.get(key)

    def lookup_codes(self, keys: Sequence[bytes]) -> bytes:
        """One byte per key, in order: its object's lookup code, or ``LOOKUP_ABSENT``. Not an access.

        A batch lookup with no object made per key: what a query turns into its answer
        columns with two table translations (spec section 6.9).
        """
        get = self._objects.get
        return bytes([LOOKUP_ABSENT if (entry := get(key)) is None else entry.lookup for key in keys])

    # -- deposit ----------------------------------------------------------------------

    def begin_deposit(
        self, key: bytes, layout: Layout, optional: bool = False, parent: bytes = b""
    ) -> tuple[DepositOutcome, ObjectEntry | None]:
        """Place a new object, evicting if it must; see :class:`DepositOutcome`. ``parent``:
        the key its deposit named as its parent, kept for the inventory events.

        Returns the entry for NEW and for an existing key (DUPLICATE,
        LAYOUT_MISMATCH), else None. Nothing changes unless the outcome is NEW.
        """
        if not isinstance(key, bytes):
            raise StoreError(f"key must be bytes, got {type(key).__name__}")
        existing = self._objects.get(key)
        if existing is not None:
            # architecture §2: "A later deposit of the same key with another layout fails."
            if existing.info.layout is layout or existing.info.layout == layout:
                return DepositOutcome.DUPLICATE, existing
            return DepositOutcome.LAYOUT_MISMATCH, existing
        if type(layout) is not tuple:
            raise StoreError(f"layout must be a tuple of (span, pool) pairs, got {layout!r}")
        try:
            info = self._layouts.get(layout)
        except TypeError:  # an unhashable span, e.g. a list
            raise StoreError(f"a span must be a (name, pool) pair of str, in {layout!r}") from None
        if info is None:
            _check_layout(layout)
            if any(pool not in self._pools for _, pool in layout):
                return DepositOutcome.UNKNOWN_POOL, None
            info = LayoutInfo(layout)
        if optional and not self._policy.admit(key, info.layout):
            return DepositOutcome.DROPPED, None

        # architecture §3: "count the slots it needs per pool. If free slots suffice, take
        # them. Otherwise find the pools in deficit."
        deficit: dict[str, int] = {}
        for pool, count in info.need:
            if count > self._pools[pool].slot_count:
                return DepositOutcome.CAPACITY, None
            free = self._alloc[pool].free_count
            if count > free:
                deficit[pool] = count - free
        if deficit:
            victims = self._index.select_victims(deficit)
            if victims is None:
                # "Eviction removes whole objects and is all or nothing."
                return DepositOutcome.CAPACITY, None
            for victim in victims:
                self._evict(victim)

        if len(info.need) == 1:
            pool, count = info.need[0]
            packed = array("I", self._alloc[pool].alloc(count)).tobytes()
        else:
            taken = {pool: iter(self._alloc[pool].alloc(count)) for pool, count in info.need}
            packed = array("I", [next(taken[pool]) for pool in info.signature]).tobytes()
        if info.users == 0:
            self._layouts[info.layout] = info
        info.users += 1
        entry = ObjectEntry(key, info, packed, self._tier_of[info.layout[0][1]], parent)
        self._objects[key] = entry
        self._writing += 1
        for pool, _ in info.need:
            self._pool_objects[pool] += 1
        self._check_pressure(info)
        return DepositOutcome.NEW, entry

    def commit(self, entry: ObjectEntry, claim: bool = False, digested: bool = False) -> None:
        """The fill succeeded: WRITING -> READY, an access.

        The object becomes evictable, unless ``claim`` hands the caller its first claim
        at once (a ``no_evict`` deposit), which skips a useless trip through the index.
        ``digested``: the entry's digests were checked against these very bytes already (a
        read back from the disk tier), so ``on_ready`` does not take them again, as ``adopt``
        does not for the objects it is given with theirs.
        """
        self._own(entry)
        if entry.state is not _WRITING:
            raise StoreError(f"commit of {entry.key!r}: it is {entry.state.name}, not WRITING")
        entry.state = _READY
        entry.lookup += 1  # lookup_code: READY follows WRITING
        self._writing -= 1
        self._ready += 1
        self._access(entry)
        if self.on_ready is not None and not digested:
            self.on_ready(entry)
        if self.listener is not None:
            self.listener.stored(entry)
        if claim:
            entry.claims = 1
            self._claims += 1
        else:
            self._index.add(entry)
            self._check_pressure(entry.info)

    def abandon(self, entry: ObjectEntry) -> None:
        """The fill failed: drop the WRITING entry and free its slots.

        The caller guarantees that no transfer can still touch those slots.
        """
        self._own(entry)
        if entry.state is not _WRITING:
            raise StoreError(f"abandon of {entry.key!r}: it is {entry.state.name}, not WRITING")
        self._drop(entry)
        self._check_pressure(entry.info)

    def adopt_all(self, objects: Sequence[tuple[bytes, Layout, bytes, bytes, bytes]]) -> list[ObjectEntry]:
        """Place READY objects in the slots they already hold (a restarted node adopting what
        its journal recorded, ``kvcr_node.recovery``): each ``(key, layout, packed slots,
        digests, parent)``, keys distinct and absent, slots in range and owned by one object each.
        In order, each an access; each is reported stored. Raises ``StoreError`` before
        placing any when they are not."""
        wanted: dict[str, list[int]] = {}
        checked: set[Layout] = set()
        for key, layout, packed, *_ in objects:
            if key in self._objects:
                raise StoreError(f"adopt of {key!r}: the key is stored")
            if layout not in checked:
                _check_layout(layout)
                if any(pool not in self._pools for _, pool in layout):
                    raise StoreError(f"adopt of {key!r}: a pool of {layout!r} is unknown")
                checked.add(layout)
            slots = memoryview(packed).cast("I")
            if len(slots) != len(layout):
                raise StoreError(f"adopt of {key!r}: {len(slots)} slots for {len(layout)} spans")
            if len(layout) == 1:
                wanted.setdefault(layout[0][1], []).append(slots[0])
            else:
                for (_, pool), slot in zip(layout, slots, strict=True):
                    wanted.setdefault(pool, []).append(slot)
        if len({key for key, *_ in objects}) != len(objects):
            raise StoreError("adopt: a key is named twice")
        reserved: list[str] = []
        try:
            for pool, taken in wanted.items():
                self._alloc[pool].reserve(taken)
                reserved.append(pool)
        except ValueError as exc:
            for pool in reserved:
                self._alloc[pool].free(wanted[pool])
            raise StoreError(f"adopt: {exc}") from None
        entries = []
        used: dict[int, LayoutInfo] = {}
        stored = self._objects
        on_ready, listener = self.on_ready, self.listener
        layout_of: Layout | None = None
        info = tier = None
        for key, layout, packed, digests, parent in objects:
            if layout is not layout_of:  # runs of one layout (the journal shares them) look it up once
                info = self._layouts.get(layout)
                if info is None:
                    info = self._layouts[layout] = LayoutInfo(layout)
                used[id(info)] = info
                layout_of, tier = layout, self._tier_of[layout[0][1]]
            assert info is not None and tier is not None
            info.users += 1
            entry = ObjectEntry(key, info, packed, tier, parent)
            entry.state = _READY
            entry.lookup += 1
            entry.digests = digests
            stored[key] = entry
            self._tick += 1
            entry.last_access = self._tick
            if not digests and on_ready is not None:
                on_ready(entry)
            if listener is not None:
                listener.stored(entry)
            entries.append(entry)
        self._index.add_all(entries)
        self._ready += len(entries)
        users = Counter(id(entry.info) for entry in entries)
        for key_of_info, info in used.items():
            for pool, _ in info.need:
                self._pool_objects[pool] += users[key_of_info]
            self._check_pressure(info)
        return entries

    # -- claims -----------------------------------------------------------------------

    def claim(self, entry: ObjectEntry, accessed: bool = False) -> None:
        """Hold a READY object against eviction (counted).

        ``accessed`` records an access now (a fetch claim is one for LRU, architecture §3).
        """
        self._own(entry)
        if entry.state is not _READY:
            raise StoreError(f"claim of {entry.key!r}: it is {entry.state.name}, not READY")
        if accessed:
            self._access(entry)
        if entry.claims == 0:
            # architecture §3: "Claims, releases, removals and evictions update both."
            self._index.remove(entry)
            self._check_pressure(entry.info)
        entry.claims += 1
        self._claims += 1

    def unclaim(self, entry: ObjectEntry, accessed: bool = True) -> None:
        """Drop one claim; the last one makes the object evictable again.

        ``accessed`` records an access (a successful deliver or peer write) now, which
        is what LRU scores; FIFO puts the object at the back either way.
        """
        self._own(entry)
        if entry.claims <= 0:
            raise StoreError(f"unclaim of {entry.key!r}: it holds no claim")
        entry.claims -= 1
        self._claims -= 1
        if entry.state is _CONDEMNED:
            if entry.claims == 0:
                self._drop(entry)
            return
        if accessed:
            self._access(entry)
        if entry.claims == 0:
            self._unclaimed(entry, read=True)
            self._check_pressure(entry.info)

    def read_through(self, entry: ObjectEntry) -> None:
        """``entry`` (READY) was read back from the disk tier for its readers only (the node's
        ``disk_promote`` off): it leaves memory, as an eviction, with the last claim of a
        reader, and its copy on disk stays."""
        self._own(entry)
        if entry.state is not _READY:
            raise StoreError(f"read through of {entry.key!r}: it is {entry.state.name}, not READY")
        self._read_through[id(entry)] = entry

    def claim_all(self, entries: Sequence[ObjectEntry], accessed: int = 0) -> None:
        """``claim`` each of ``entries`` once: a lease holding many objects checks capacity
        pressure once per layout, not once per object. The first ``accessed`` of them are an
        access now, in order (a lease's leading keys: its client reads them, unseen here)."""
        layouts: dict[int, LayoutInfo] = {}
        for n, entry in enumerate(entries):
            self._own(entry)
            if entry.state is not _READY:
                raise StoreError(f"claim of {entry.key!r}: it is {entry.state.name}, not READY")
            if n < accessed:
                self._tick += 1
                entry.last_access = self._tick
            if entry.claims == 0:
                self._index.remove(entry)
                layouts[id(entry.info)] = entry.info
            entry.claims += 1
        self._claims += len(entries)
        for info in layouts.values():
            self._check_pressure(info)

    def unclaim_all(self, entries: Sequence[ObjectEntry], held_only: bool = False) -> None:
        """``unclaim`` each of ``entries`` once, recording no access (a lease that ends).
        ``held_only``: the claims only held the objects while others were placed, nobody read
        them (a read-through object stays for the reader that comes next)."""
        layouts: dict[int, LayoutInfo] = {}
        for entry in entries:
            self._own(entry)
            if entry.claims <= 0:
                raise StoreError(f"unclaim of {entry.key!r}: it holds no claim")
            entry.claims -= 1
            if entry.claims == 0:
                if entry.state is _CONDEMNED:
                    self._drop(entry)
                    continue
                self._unclaimed(entry, read=not held_only)
                layouts[id(entry.info)] = entry.info
        self._claims -= len(entries)
        for info in layouts.values():
            self._check_pressure(info)

    def _unclaimed(self, entry: ObjectEntry, read: bool) -> None:
        """``entry``'s last claim went: evictable again, or, read through and ``read`` by a
        reader, evicted now."""
        self._index.add(entry)
        if read and self._read_through.pop(id(entry), None) is not None:
            self._evict(entry)

    def _access(self, entry: ObjectEntry) -> None:
        """Record an access to ``entry`` now: what LRU scores (architecture §3)."""
        self._tick += 1
        entry.last_access = self._tick

    # -- removal ----------------------------------------------------------------------

    def remove(self, key: bytes) -> bool:
        """Delete an unclaimed READY object; False when the key is not stored."""
        entry = self._objects.get(key)
        if entry is None:
            return False
        if entry.state is not _READY:
            raise StoreError(f"remove of {key!r}: it is {entry.state.name}; abandon it instead")
        if entry.claims:
            raise StoreError(f"remove of {key!r}: it holds {entry.claims} claim(s)")
        self._index.remove(entry)
        self._drop(entry)
        self._check_pressure(entry.info)
        if self.listener is not None:
            self.listener.removed(entry, False)
        return True

    def _evict(self, entry: ObjectEntry) -> None:
        self._index.remove(entry)
        self._drop(entry)
        self._evicted_objects += 1
        for pool, _ in entry.info.need:
            self._evictions[pool] += 1
        if self.listener is not None:
            self.listener.removed(entry, True)

    def condemn(self, entry: ObjectEntry) -> None:
        """``entry``'s bytes are no longer the ones stored (spec section 6.12, "Integrity"):
        its key leaves the store now (lookups miss it, a deposit may place the key again),
        and its slots with its last claim, since a holder may still be reading them."""
        self._own(entry)
        if entry.state is not _READY:
            raise StoreError(f"condemn of {entry.key!r}: it is {entry.state.name}, not READY")
        self._condemned_objects += 1
        if entry.claims == 0:
            self.remove(entry.key)
            return
        del self._objects[entry.key]
        self._ready -= 1
        entry.state = _CONDEMNED
        self._condemned[id(entry)] = entry
        if self.listener is not None:
            self.listener.removed(entry, False)

    def _drop(self, entry: ObjectEntry) -> None:
        """Forget ``entry`` and free its slots (it is already out of the index)."""
        self._read_through.pop(id(entry), None)
        if entry.state is _CONDEMNED:
            del self._condemned[id(entry)]
        else:
            del self._objects[entry.key]
            if entry.state is _WRITING:
                self._writing -= 1
            else:
                self._ready -= 1
        info = entry.info
        for pool, slots in entry.pool_slots().items():
            self._alloc[pool].free(slots)
        info.users -= 1
        if info.users == 0:
            del self._layouts[info.layout]
        for pool, _ in info.need:
            self._pool_objects[pool] -= 1

    def _own(self, entry: ObjectEntry) -> None:
        if self._objects.get(entry.key) is not entry and self._condemned.get(id(entry)) is not entry:
            raise StoreError(f"{entry.key!r}: this entry is not (or no longer) in the store")

    # -- capacity pressure ------------------------------------------------------------

    def _check_pressure(self, info: LayoutInfo) -> None:
        # architecture §2: "when a pool's reclaimable slots (free plus evictable) fall under
        # its low watermark, connected clients get one event for that pool
        # (edge-triggered)". Re-armed once reclaimable is back at or above it.
        for pool, _ in info.need:
            reclaimable = self._alloc[pool].free_count + self._index.evictable_slots(pool)
            if reclaimable < self._threshold[pool]:
                if self._armed[pool]:
                    self._armed[pool] = False
                    self._events.append(pool)
            elif not self._armed[pool]:
                self._armed[pool] = True

    def take_capacity_events(self) -> list[str]:
        """The pools that went under their low watermark since the last call."""
        events, self._events = self._events, []
        return events

    # -- statistics -------------------------------------------------------------------

    def pool_stats(self) -> dict[str, dict[str, int]]:
        """Per pool: total, free, allocated and evictable slots, objects, slot size."""
        out: dict[str, dict[str, int]] = {}
        for name, spec in self._pools.items():
            alloc = self._alloc[name]
            out[name] = {
                "total": alloc.total,
                "free": alloc.free_count,
                "allocated": alloc.allocated_count,
                "evictable": self._index.evictable_slots(name),
                "objects": self._pool_objects[name],
                "slot_size": spec.slot_size,
            }
        return out

    def stats(self) -> dict[str, int | dict[str, int]]:
        """Object counts, claims held, and evictions (objects) per pool."""
        return {
            "objects": len(self._objects),
            "ready": self._ready,
            "writing": self._writing,
            "evictable": len(self._index),
            "claims": self._claims,
            "evicted_objects": self._evicted_objects,
            "condemned_objects": self._condemned_objects,
            "condemned_claimed": len(self._condemned),
            "evictions": dict(self._evictions),
        }

    def check_invariants(self) -> list[str]:
        """Every breach of the store's invariants, human-readable; empty when healthy.

        O(objects + slots): for tests and debugging, not for the hot path.
        """
        passing = [f"read-through {e.key!r} is not a stored READY object" for e in self._read_through.values()
                   if self._objects.get(e.key) is not e or e.state is not _READY]
        return passing + audit(StoreTables(
            self._objects, self._condemned, self._alloc, self._layouts, self._tier_of, self._pool_objects,
            (self._writing, self._ready, self._claims), self._index))


def _check_layout(layout: Layout) -> None:
    if not layout:
        raise StoreError("a layout needs at least one span")
    for span in layout:
        if type(span) is not tuple or len(span) != 2 or not isinstance(span[0], str) or not isinstance(span[1], str):
            raise StoreError(f"a span must be a (name, pool) pair of str, got {span!r}")
