"""The description of one memory pool, importable without the store.

architecture §2: a pool is a named region of one memory kind (``dram``, or ``hbm`` on a device)
cut into fixed-size slots; a disk pool (``disk:/DIR``, architecture §9) the same in a file. Config parsing builds these; the store only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DISK_PREFIX = "disk:"
"""A pool's memory ``disk:/DIR``: its slots in a file under that directory (architecture §9)."""

MAX_SLOTS = (1 << 32) - 1
"""Slot indices are stored packed as unsigned 32-bit integers."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool: ``slot_count`` slots of ``slot_size`` bytes each, in ``memory``."""

    name: str
    slot_size: int
    slot_count: int
    memory: str = "dram"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"pool name must be a non-empty string, got {self.name!r}")
        for field in ("slot_size", "slot_count"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"pool {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.slot_count > MAX_SLOTS:
            raise ValueError(f"pool {self.name!r}: slot_count {self.slot_count} exceeds {MAX_SLOTS}")
        if not isinstance(self.memory, str) or not self.memory:
            raise ValueError(f"pool {self.name!r}: memory must be a non-empty string, got {self.memory!r}")

    @property
    def size(self) -> int:
        """Bytes in the whole pool."""
        return self.slot_size * self.slot_count


def disk_directory(memory: str) -> Path | None:
    """The directory of a ``disk:/DIR`` memory, or None for any other memory."""
    if not memory.startswith(DISK_PREFIX):
        return None
    return Path(memory[len(DISK_PREFIX):])
