"""Host memory for the benchmarks: one kind for kvcr and its raw anchors alike.

A CMA copy between processes runs up to 1.5x slower when the local buffer starts a few
bytes past a page (numpy's large arrays start 16 bytes in) than from a page-aligned,
huge-page buffer (measured here: 64 MiB in 1024 spans, 9-10 ms against 6-7 ms). A ratio
is only about kvcr when both of its sides move the same kind of memory, so every buffer a
benchmark transfers comes from ``aligned``: what a node's DRAM pool is
(``kvcr_node.memory``) and what pinned host memory of an engine is (page aligned).
"""

from __future__ import annotations

import mmap

import numpy as np

from kvcr_node.memory import advise_huge_pages


def aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed bytes on fresh pages (anonymous ``mmap``, asked for huge pages), as
    a ``uint8`` array that keeps its mapping alive."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(memory)
    return np.frombuffer(memory, dtype=np.uint8)
