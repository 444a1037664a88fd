"""Free-list allocation of the slot indices of one pool.

Pure bookkeeping: a slot is an index into a pool; what the index addresses is someone
else's business. The free list is a packed array used as a stack, so a pool of millions
of slots costs a few bytes per slot, and ``alloc(n)``/``free(slots)`` cost O(n).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvcr_node.poolspec import MAX_SLOTS

_FREE = 0
_USED = 1
_FREE_BYTE = bytes([_FREE])
_USED_BYTE = bytes([_USED])


class OutOfSlots(Exception):
    """Fewer slots are free than an allocation asked for; nothing was allocated."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"wanted {wanted} slots, {free} free")
        self.wanted = wanted
        self.free = free


class SlotError(ValueError):
    """A slot was freed twice, or never belonged to this allocator."""


class SlotAllocator:
    """Hands out slot indices ``0 .. total-1``; all-or-nothing allocation."""

    __slots__ = ("_free", "_total", "_used")

    def __init__(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative int, got {total!r}")
        if total > MAX_SLOTS:
            raise ValueError(f"total {total} exceeds {MAX_SLOTS}")
        self._total = total
        # A stack whose top is the end: initialised high-to-low so that a fresh
        # allocator hands out 0, 1, 2, ... (deterministic and easy to read in tests).
        self._free = array("I", range(total - 1, -1, -1))
        self._used = bytearray(total)

    @property
    def total(self) -> int:
        """Slots in the pool."""
        return self._total

    @property
    def free_count(self) -> int:
        """Slots not allocated."""
        return len(self._free)

    @property
    def allocated_count(self) -> int:
        """Slots allocated and not yet freed."""
        return self._total - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` slots, or raise :class:`OutOfSlots` and take none."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n == 0:
            return []
        have = len(self._free)
        if n > have:
            raise OutOfSlots(n, have)
        taken = self._free[have - n :].tolist()
        del self._free[have - n :]
        taken.reverse()
        used = self._used
        for slot in taken:
            used[slot] = _USED
        return taken

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots``; raise :class:`SlotError` and return none on any misuse."""
        batch = list(slots)
        if not batch:
            return
        used = self._used
        # The checks in bulk (C loops: slots come by the thousand); any doubt takes the
        # per-slot pass, which names the offending slot.
        if (
            set(map(type, batch)) != {int}
            or min(batch) < 0
            or max(batch) >= self._total
            or _FREE_BYTE in bytes(map(used.__getitem__, batch))
        ):
            self._check_free(batch)
        if len(batch) > 1 and len(set(batch)) != len(batch):
            raise SlotError(f"slots freed twice in one call: {sorted(batch)}")
        for slot in batch:
            used[slot] = _FREE
        self._free.extend(reversed(batch))

    def reserve(self, slots: Iterable[int]) -> None:
        """Take exactly ``slots`` (a restarted node adopting its objects), all free and
        distinct, or raise :class:`SlotError` and take none. O(total): once, for many."""
        batch = list(slots)
        if not batch:
            return
        if set(map(type, batch)) != {int} or min(batch) < 0 or max(batch) >= self._total:
            raise SlotError(f"slots to reserve must be ints in 0..{self._total - 1}")
        if len(set(batch)) != len(batch) or _USED_BYTE in bytes(map(self._used.__getitem__, batch)):
            raise SlotError("a slot to reserve is taken or named twice")
        used = self._used
        for slot in batch:
            used[slot] = _USED
        self._free = array("I", [slot for slot in self._free if used[slot] == _FREE])

    def _check_free(self, batch: list[int]) -> None:
        used = self._used
        total = self._total
        for slot in batch:
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise SlotError(f"slot {slot!r} is not an int")
            if not 0 <= slot < total:
                raise SlotError(f"slot {slot} out of range 0..{total - 1}")
            if used[slot] != _USED:
                raise SlotError(f"slot {slot} is not allocated (double free?)")

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is currently allocated."""
        return 0 <= slot < self._total and self._used[slot] == _USED

    def check(self) -> list[str]:
        """Internal consistency, as human-readable breaches (empty when healthy). O(total)."""
        breaches: list[str] = []
        free = self._free
        if len(set(free)) != len(free):
            breaches.append("free list holds a slot twice")
        if any(self._used[s] != _FREE for s in free):
            breaches.append("free list holds an allocated slot")
        used_count = sum(1 for b in self._used if b == _USED)
        if used_count != self.allocated_count:
            breaches.append(f"{used_count} slots marked used but allocated_count is {self.allocated_count}")
        return breaches

    def __repr__(self) -> str:
        return f"SlotAllocator(total={self._total}, free={self.free_count})"
