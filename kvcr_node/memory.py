"""The memory behind a node's pools: page-aligned DRAM (and HBM through CuPy)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from kvcr_node.config import hbm_device
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import MemoryKind


class PoolAllocationError(RuntimeError):
    """A pool's memory could not be allocated; the message names the pool and its size."""

    def __init__(self, spec: PoolSpec, cause: BaseException) -> None:
        self.spec = spec
        super().__init__(
            f"pool {spec.name!r} ({spec.slot_count} slots of {spec.slot_size} bytes = {spec.size} bytes, "
            f"{spec.memory}): cannot allocate its memory: {cause}"
        )


def advise_huge_pages(memory: mmap.mmap) -> None:
    """Ask for transparent huge pages behind a pool (where the kernel has them only on
    request, ``madvise`` mode): a transfer that copies in the kernel (UCX's CMA) pins and
    walks one 2 MiB page where it would walk 512 small ones. Nothing happens where the
    kernel has none."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        memory.madvise(advice)
    except OSError:  # no transparent huge pages in this kernel: small pages
        pass


class PoolMemory:
    """One pool's bytes: ``slot_count`` slots of ``slot_size`` bytes at ``address``."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.device = hbm_device(spec.memory)
        self._keep: Any
        if self.device is None:
            # Anonymous mmap: page aligned, zero filled, never swapped into a Python heap.
            try:
                self._keep = mmap.mmap(-1, spec.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, OverflowError, MemoryError, ValueError) as exc:
                raise PoolAllocationError(spec, exc) from exc
            advise_huge_pages(self._keep)
            self.array: Any = np.frombuffer(self._keep, dtype=np.uint8)
            self.kind = MemoryKind.DRAM
            self.address = int(self.array.ctypes.data)
        else:
            from kvcr_node.gpu import GpuUnavailable, allocate_hbm

            try:
                self.array, self.address = allocate_hbm(spec.size, self.device)
            except GpuUnavailable as exc:
                raise GpuUnavailable(f"pool {spec.name!r} ({spec.size} bytes): {exc}") from exc
            self._keep = self.array
            self.kind = MemoryKind.VRAM

    @property
    def nixl_device(self) -> int:
        return self.device or 0

    def close(self) -> None:
        if isinstance(self._keep, mmap.mmap):
            del self.array
            try:
                self._keep.close()
            except BufferError:  # a view still exists; the mapping goes with the process
                pass
