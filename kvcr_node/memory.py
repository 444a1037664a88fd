"""The memory behind a node's pools: page-aligned DRAM (and HBM through CuPy)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
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


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14's advice that faults a range in, writable, as a write would (the number where
this Python's ``mmap`` does not name it)."""


def available_bytes() -> int | None:
    """The host's ``MemAvailable`` (bytes), or None where the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def make_resident(memory: mmap.mmap, array: Any) -> None:
    """Fault every page of a pool in now, at start, as memory registered for RDMA is pinned:
    otherwise the first transfer into each page pays its allocation (zeroing, and for a huge
    page compaction), about 5 ms per MiB early in a node's life, inside the poster's call."""
    try:
        memory.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):  # an older kernel: write one byte a page
        array[:: mmap.PAGESIZE] = 0


class PoolMemory:
    """One pool's bytes: ``slot_count`` slots of ``slot_size`` bytes at ``address``."""

    def __init__(self, spec: PoolSpec, available: int | None = None, file: Path | None = None) -> None:
        """``available``: the host memory left for this pool (bytes; None: not checked). A DRAM
        pool is made resident at once, so one larger than that is refused here, naming it,
        rather than the kernel ending the process as its pages are faulted in.

        ``file``: keep the pool in this file, of the pool's size (shared memory under a state
        directory, ``kvcr_node.state_dir``), so that its bytes outlive the process."""
        self.spec = spec
        self.device = hbm_device(spec.memory)
        self._keep: Any
        if self.device is None:
            if file is not None:
                self._keep = _map_file(spec, file)
            else:
                if available is not None and spec.size > available:
                    raise PoolAllocationError(spec, MemoryError(f"the host has {available} bytes available"))
                # Anonymous mmap: page aligned, zero filled, never swapped into a Python heap.
                try:
                    self._keep = mmap.mmap(-1, spec.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                except (OSError, OverflowError, MemoryError, ValueError) as exc:
                    raise PoolAllocationError(spec, exc) from exc
            advise_huge_pages(self._keep)
            self.array: Any = np.frombuffer(self._keep, dtype=np.uint8)
            make_resident(self._keep, self.array)
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


def _map_file(spec: PoolSpec, file: Path) -> mmap.mmap:
    """Map ``file`` shared as ``spec``'s pool (the state directory made it at the pool's size)."""
    try:
        fd = os.open(file, os.O_RDWR)
    except OSError as exc:
        raise PoolAllocationError(spec, exc) from exc
    try:
        size = os.fstat(fd).st_size
        if size != spec.size:
            raise PoolAllocationError(spec, ValueError(f"{file} has {size} bytes"))
        # Every page allocated now: a full tmpfs fails here, by name, not with SIGBUS at a
        # transfer's first touch.
        os.posix_fallocate(fd, 0, spec.size)
        return mmap.mmap(fd, spec.size, flags=mmap.MAP_SHARED)
    except (OSError, OverflowError, ValueError) as exc:
        raise PoolAllocationError(spec, exc) from exc
    finally:
        os.close(fd)
