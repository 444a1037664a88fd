"""What a read under grants checks once its bytes landed: the node's digests (spec section
6.12, "Integrity").

``SpanChecks`` holds, per item and group of one deliver, the spans read into host memory
whose digest the node took, and hashes them again where they landed; a group whose bytes
differ fails its key ``DIGEST_MISMATCH``. Spans in GPU memory, and spans the node took no
digest of, are counted unchecked.

Hashing what landed costs about half the READ when it comes after the whole copy: the
bytes are no longer in cache. So a whole deliver larger than ``PART_BYTES`` is read in
parts (``parts``), and each part is hashed on the digest worker while the next is copied:
over CMA the copy is NIXL's post, which releases the GIL, and a part just copied is still
in cache. One worker thread serves the process (``on_worker``); a part's check runs there,
the group it belongs to is reported once it is done. The last part is checked by the
thread that copied it: nothing is left to copy meanwhile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from kvcr_client.readplans import by_group
from kvcr_client.regions import RegionHandle
from kvcr_io.digests import UNCHECKED, digest_at, host_view, span_digest
from kvcr_io.runs import distinct
from kvcr_protocol import DeliverItem, MemoryKind

PART_BYTES = 4 << 20
"""The largest part of a whole deliver read and checked at once: a part's bytes stay in
cache between their copy and their hash (the reference machine's last-level cache is 32
MiB, shared by both cores), and parts of this size cost no more to post than one READ
(``bench/integrity.py``)."""

Run = tuple[Any, int, list[int], list[int], list[int]]
"""Spans of one region to check: a host view of it and the view's address (or None: read
by address), the region's address, and per span its offset in the region, length and the
node's digest."""


class Digested(Protocol):
    """What checking reads of a key's grant (``GrantedKey``)."""

    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def digests(self) -> bytes: ...


class Columns(Protocol):
    """Destination spans as arrays (``kvcr_client.readplans.LocalColumns``)."""

    def of(self, spans: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class SpanChecks:
    """The spans of one deliver to check, per (item, group)."""

    def __init__(self, checks: dict[tuple[int, int], list[Run]]) -> None:
        self._checks = checks

    def count(self, k: int, g: int) -> int:
        """How many spans group ``g`` of item ``k`` checks."""
        return sum(len(run[2]) for run in self._checks.get((k, g), ()))

    def intact(self, k: int, g: int) -> bool:
        """Whether group ``g`` of item ``k`` holds, where it landed, the bytes the node
        digested. Reads memory only: safe on any thread while the destination is held."""
        for host, base, offsets, lengths, digests in self._checks.get((k, g), ()):
            if host is not None:
                view, start = host
                delta = base - start
                for offset, length, digest in zip(offsets, lengths, digests, strict=True):
                    at = delta + offset
                    if span_digest(view[at:at + length]) != digest:
                        return False
            else:
                for offset, length, digest in zip(offsets, lengths, digests, strict=True):
                    if digest_at(base + offset, length) != digest:
                        return False
        return True

    def failed(self, g: int, members: Sequence[int]) -> list[int]:
        """The members whose group ``g`` is not intact."""
        return [k for k in members if not self.intact(k, g)]


def span_checks(
    items: Sequence[DeliverItem], granted: Sequence[Digested], groups: Sequence[Sequence[int]] | None,
    regions: Mapping[int, RegionHandle], columns: Columns,
) -> tuple[SpanChecks | None, int]:
    """The checks of a deliver (None when no span has a digest to check by) and how many of
    its spans go unchecked (no digest, or not host memory)."""
    checks: dict[tuple[int, int], list[Run]] = {}
    views: dict[int, Any] = {}
    unchecked = 0
    for k, (item, key) in enumerate(zip(items, granted, strict=True)):
        spans = item.spans
        if not key.digests or not spans:
            unchecked += len(spans)
            continue
        stored = np.frombuffer(key.digests, dtype="<u8")
        names = tuple([span[0] for span in spans])
        if names == key.names:
            digests = stored
        else:
            index = {name: j for j, name in enumerate(key.names)}
            picked = np.fromiter((index.get(name, -1) for name in names), np.int64, len(names))
            digests = np.where(picked >= 0, stored[np.maximum(picked, 0)], np.uint64(UNCHECKED))
        region_ids, offsets, lengths = columns.of(spans)
        numbers = groups[k] if groups is not None and groups[k] else None
        g = np.zeros(len(spans), np.int64) if numbers is None else np.asarray(numbers, np.int64)
        wanted = digests != UNCHECKED
        checked = 0
        for r in distinct(region_ids):
            region = regions[r]
            mine = np.flatnonzero(wanted & (region_ids == r))
            if region.kind is not MemoryKind.DRAM or not len(mine):
                continue
            checked += len(mine)
            if r not in views:
                views[r] = host_view(region.buffer, region.length)
            offs, lens, digs = offsets[mine], lengths[mine], digests[mine]
            for group, at in by_group(g[mine]):
                checks.setdefault((k, group), []).append(
                    (views[r], region.address, offs[at].tolist(), lens[at].tolist(), digs[at].tolist()))
        unchecked += len(spans) - checked
    return (SpanChecks(checks) if checks else None), unchecked


def parts(
    items: Sequence[DeliverItem], granted: Sequence[Digested], columns: Columns,
) -> list[tuple[int, ...]] | None:
    """A whole deliver's spans numbered into parts by where each begins in its item, one part
    every ``PART_BYTES``, for the items whose digests will be checked; None when every item
    fits one part (nothing to gain)."""
    numbers: list[tuple[int, ...]] = []
    split = False
    for item, key in zip(items, granted, strict=True):
        lengths = columns.of(item.spans)[2] if key.digests and item.spans else None
        if lengths is None or int(lengths.sum()) <= PART_BYTES:
            numbers.append((0,) * len(item.spans))
            continue
        begins = np.cumsum(lengths) - lengths
        numbers.append(tuple((begins // np.uint64(PART_BYTES)).tolist()))
        split = True
    return numbers if split else None


_lock = threading.Lock()
_worker: tuple[int, ThreadPoolExecutor] | None = None


def _forked() -> None:
    """A forked child has neither the parent's worker thread nor, safely, its lock."""
    global _lock, _worker
    _lock, _worker = threading.Lock(), None


os.register_at_fork(after_in_child=_forked)


def on_worker(work: Callable[[], list[int]]) -> Future[list[int]]:
    """Run ``work`` on the process's digest worker (one thread, started when first needed,
    and again in a process forked after it was)."""
    global _worker
    with _lock:
        if _worker is None or _worker[0] != os.getpid():
            _worker = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="kvcr-digests"))
        return _worker[1].submit(work)
