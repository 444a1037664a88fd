"""The node's digests of its objects (spec section 6.12, "Integrity").

When an object becomes ``READY`` (a deposit, a put's commit, a fetch landed), ``Digests``
takes the digest of each of its spans in host memory (``kvcr_io.digests``) and keeps them
on the entry; grants carry them to readers, who check what they read. A span in GPU
memory gets none (``UNCHECKED``): the node does not read device memory on its loop, and
the spec says so.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping

from kvcr_io.digests import UNCHECKED, pack_digests, span_digest
from kvcr_node.memory import PoolMemory
from kvcr_node.store import ObjectEntry
from kvcr_protocol import MemoryKind


class Digests:
    """Takes and checks the digests of objects in the node's pools."""

    def __init__(self, memories: Mapping[str, PoolMemory]) -> None:
        self.memories = memories

    def of(self, entry: ObjectEntry) -> bytes:
        """The digests of ``entry``'s spans as they are now, one u64 each in layout order."""
        out = array("Q")
        for (_, pool), slot in zip(entry.info.layout, entry.slot_view, strict=True):
            memory = self.memories[pool]
            if memory.kind is not MemoryKind.DRAM:
                out.append(UNCHECKED)
                continue
            size = memory.spec.slot_size
            out.append(span_digest(memory.array[slot * size:(slot + 1) * size]))
        return pack_digests(out)

    def take(self, entry: ObjectEntry) -> None:
        """``entry`` becomes READY: keep the digests of its bytes."""
        entry.digests = self.of(entry)
