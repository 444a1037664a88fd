"""The store's invariants, recounted from its tables (``Store.check_invariants``).

Everything the store keeps incrementally (counts per state and pool, layout users, slot
ownership, the eviction index's members) is recounted here from the objects themselves and
compared. O(objects + slots): for tests, soaks and debugging, never on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvcr_node.eviction import EvictionIndex, Layout, LayoutInfo
from kvcr_node.objects import ObjectEntry, ObjectState, lookup_code
from kvcr_node.slots import SlotAllocator

_WRITING = ObjectState.WRITING
_CONDEMNED = ObjectState.CONDEMNED


@dataclass(frozen=True)
class StoreTables:
    """What the store keeps, as the audit reads it (never changed here)."""

    objects: Mapping[bytes, ObjectEntry]
    condemned: Mapping[int, ObjectEntry]
    """Condemned entries still claimed, by id."""
    alloc: Mapping[str, SlotAllocator]
    layouts: Mapping[Layout, LayoutInfo]
    tier_of: Mapping[str, int]
    pool_objects: Mapping[str, int]
    counts: tuple[int, int, int]
    """Objects WRITING, READY, and claims held, as counted."""
    index: EvictionIndex[ObjectEntry]


def audit(tables: StoreTables) -> list[str]:
    """Every breach of the store's invariants, human-readable; empty when healthy."""
    breaches: list[str] = []
    for name, alloc in tables.alloc.items():
        if alloc.free_count + alloc.allocated_count != alloc.total:
            breaches.append(f"pool {name!r}: free + allocated != total")
        breaches.extend(f"pool {name!r}: {b}" for b in alloc.check())
    owner: dict[tuple[str, int], bytes] = {}
    held = dict.fromkeys(tables.alloc, 0)
    objects = dict.fromkeys(tables.alloc, 0)
    expected: set[int] = set()
    writing = ready = claims = 0
    users: dict[int, int] = {}
    for entry in tables.condemned.values():
        if entry.state is not _CONDEMNED or entry.claims <= 0 or tables.objects.get(entry.key) is entry:
            breaches.append(f"condemned {entry.key!r} is {entry.state.name} with {entry.claims} claims")
    for key, entry in [*tables.objects.items(), *((e.key, e) for e in tables.condemned.values())]:
        if entry.key != key:
            breaches.append(f"{key!r} filed under another key {entry.key!r}")
        if entry.claims < 0:
            breaches.append(f"{key!r} holds {entry.claims} claims")
        claims += entry.claims
        info = entry.info
        users[id(info)] = users.get(id(info), 0) + 1
        if entry.state is _CONDEMNED:
            pass
        elif entry.state is _WRITING:
            writing += 1
            if entry.claims:
                breaches.append(f"{key!r} is WRITING yet holds {entry.claims} claims")
        else:
            ready += 1
            if entry.claims == 0:
                expected.add(id(entry))
        tier = tables.tier_of[info.layout[0][1]]
        if entry.state is not _CONDEMNED and entry.lookup != lookup_code(tier, entry.state):
            breaches.append(f"{key!r}: lookup code {entry.lookup} does not say its tier and {entry.state.name}")
        if tables.layouts.get(info.layout) is not info:
            breaches.append(f"{key!r}: its layout is not the shared one")
        slots = entry.slots
        if len(slots) != len(info.layout):
            breaches.append(f"{key!r}: {len(slots)} slots for {len(info.layout)} spans")
        for pool, slot in zip(info.signature, slots, strict=False):
            other = owner.get((pool, slot))
            if other is not None:
                breaches.append(f"slot {slot} of pool {pool!r} owned by {other!r} and {key!r}")
            owner[(pool, slot)] = key
            if not tables.alloc[pool].is_allocated(slot):
                breaches.append(f"{key!r} holds slot {slot} of {pool!r}, which is free")
            held[pool] += 1
        for pool, _ in info.need:
            objects[pool] += 1
    for name, alloc in tables.alloc.items():
        if held[name] != alloc.allocated_count:
            breaches.append(f"pool {name!r}: {alloc.allocated_count} slots allocated, objects hold {held[name]}")
        if objects[name] != tables.pool_objects[name]:
            breaches.append(f"pool {name!r}: object count {tables.pool_objects[name]} is stale")
    if (writing, ready, claims) != tables.counts:
        counted = "/".join(map(str, tables.counts))
        breaches.append(f"counters writing/ready/claims {counted}, recounted {writing}/{ready}/{claims}")
    for layout, info in tables.layouts.items():
        if info.layout is not layout and info.layout != layout:
            breaches.append(f"layout table filed {info!r} under another layout")
        if info.users != users.get(id(info), 0):
            breaches.append(f"{info!r}: {info.users} users counted, {users.get(id(info), 0)} found")
    # architecture §3: "an object is in both or in neither", and it is in both exactly
    # when it is evictable (READY with no claim).
    breaches.extend(tables.index.check())
    in_global, in_groups = tables.index.members()
    for what, members in (("global queue", in_global), ("layout index", in_groups)):
        ids = {id(e) for e in members}
        if ids != expected:
            extra = [e.key for e in members if id(e) not in expected]
            missing = [e.key for e in tables.objects.values() if id(e) in expected - ids]
            breaches.append(f"{what}: extra {extra!r}, missing {missing!r}")
        for e in members:
            if tables.objects.get(e.key) is not e:
                breaches.append(f"{what} holds {e.key!r}, which is not in the store")
    for entry in tables.objects.values():
        if (entry.index_seq != 0) != (id(entry) in expected):
            breaches.append(f"{entry.key!r}: index membership flag disagrees with its state")
    return breaches
