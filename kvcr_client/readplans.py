"""The descriptors of a deliver's READs under grants (spec section 6.12): which bytes of
the node's (or a source's) pools go where in the client's registered memory.

``plan`` turns a deliver's items and their grants into one descriptor pair list per
(group, remote agent, local memory kind, remote memory kind), spans that continue the
previous one on both sides merged (``kvcr_io.runs``: most objects sit in consecutive slots). Where each
granted slot is comes with the grant (``RemoteSpans``, worked out once when it arrives);
an object of many spans is planned with array arithmetic, and a prepared destination's
columns are kept between delivers (``LocalColumns``), so a deliver of 1024 spans costs
tens of microseconds of planning rather than a Python turn per span.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvcr_client.regions import RegionHandle
from kvcr_io.agent import Desc
from kvcr_io.runs import cut, cut_rows, distinct
from kvcr_protocol import DeliverItem, ErrorCode, MemoryKind, ProtocolError, compute_projection

VECTOR_SPANS = 64
"""Objects with at least this many spans are planned with arrays."""
COLUMNS_KEPT = 16
"""Destinations of many spans whose columns are kept, the oldest dropped first (a list of
spans makes a new tuple each deliver: it never hits, and holds at most this many)."""

PlanKey = tuple[int, str, MemoryKind, MemoryKind]
"""(group, remote agent, local kind, remote kind): one READ."""
Descs = list[Desc] | np.ndarray
"""Descriptors as (address, length, device) rows: a list, or an N x 3 ``uint64`` array."""
Plans = dict[PlanKey, tuple[Descs, Descs, list[int]]]
"""Per READ: its local and remote descriptors, and the items it carries."""


@dataclass(frozen=True, slots=True)
class RemoteSpans:
    """Where a granted key's slots are, per stored span: address, slot size, memory kind and
    device (``rows``), and for many spans the same as arrays, with the kind and device when
    every span shares them (``uniform``)."""

    rows: tuple[tuple[int, int, MemoryKind, int], ...]
    addresses: np.ndarray | None = None
    sizes: np.ndarray | None = None
    uniform: tuple[MemoryKind, int] | None = None


class Pool(Protocol):
    @property
    def kind(self) -> MemoryKind: ...
    @property
    def device(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def slot_size(self) -> int: ...


class Granted(Protocol):
    """What planning reads of a key's grant (``GrantedKey``)."""

    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def remote(self) -> RemoteSpans: ...
    @property
    def peer(self) -> str: ...


def remote_spans(pools: Sequence[Pool], pool_of: bytes, slots: Sequence[int]) -> RemoteSpans:
    """A granted key's ``RemoteSpans`` from the agent's pools and its per span pool and slot."""
    where = [(p.address, p.slot_size, p.kind, p.device) for p in pools]
    rows = []
    for pool, slot in zip(pool_of, slots, strict=True):
        address, size, kind, device = where[pool]
        rows.append((address + slot * size, size, kind, device))
    if len(rows) < VECTOR_SPANS:
        return RemoteSpans(tuple(rows))
    kinds = {(kind, device) for _, _, kind, device in rows}
    return RemoteSpans(
        tuple(rows), np.fromiter(map(operator.itemgetter(0), rows), np.uint64, len(rows)),
        np.fromiter(map(operator.itemgetter(1), rows), np.uint64, len(rows)),
        next(iter(kinds)) if len(kinds) == 1 else None,
    )


class LocalColumns:
    """Region ids, offsets and lengths of destination spans as arrays, kept for the spans of
    prepared destinations (the same tuple each deliver) and bounded."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[tuple[Any, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def of(self, spans: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        kept = self._kept.get(id(spans))
        if kept is not None and kept[0] is spans:  # the tuple itself is kept: its id is not reused
            return kept[1]
        n = len(spans)
        columns = (np.fromiter(map(operator.itemgetter(1), spans), np.int64, n),
                   np.fromiter(map(operator.itemgetter(2), spans), np.uint64, n),
                   np.fromiter(map(operator.itemgetter(3), spans), np.uint64, n))
        if len(self._kept) >= COLUMNS_KEPT:
            del self._kept[next(iter(self._kept))]
        self._kept[id(spans)] = (spans, columns)
        return columns

    def __len__(self) -> int:
        return len(self._kept)


def plan(
    items: Sequence[DeliverItem], granted: Sequence[Granted], groups: Sequence[tuple[int, ...]] | None,
    regions: Mapping[int, RegionHandle], codes: list[int], columns: LocalColumns,
) -> Plans:
    """The descriptor pairs of every READ, with the items each carries. Keys whose names or
    sizes do not fit get their code in ``codes`` and no descriptor."""
    plans: Plans = {}
    for k, (item, grant) in enumerate(zip(items, granted, strict=True)):
        spans = item.spans
        names = tuple([span[0] for span in spans])
        indices: Sequence[int]
        if names == grant.names:
            indices = range(len(names))  # the whole layout, in order: the usual deliver
        else:
            try:
                indices = compute_projection(grant.names, names).indices
            except ProtocolError:
                codes[k] = ErrorCode.LAYOUT_SUBSET_INVALID
                continue
        numbers = groups[k] if groups is not None and groups[k] else None
        if len(spans) >= VECTOR_SPANS and grant.remote.uniform is not None:
            if _plan_arrays(k, spans, indices, numbers, grant, regions, columns, plans, codes):
                continue
        _plan_rows(k, spans, indices, numbers, grant, regions, plans, codes)
    return plans


def _plan_rows(
    k: int, spans: tuple[Any, ...], indices: Sequence[int], numbers: tuple[int, ...] | None, grant: Granted,
    regions: Mapping[int, RegionHandle], plans: Plans, codes: list[int],
) -> None:
    """One key's runs, span by span."""
    where = grant.remote.rows
    if any(span[3] != where[i][1] for span, i in zip(spans, indices, strict=True)):
        codes[k] = ErrorCode.SIZE_MISMATCH
        return
    peer = grant.peer
    rows = []
    for (_, span_region, offset, length), index, g in zip(spans, indices, numbers or (0,) * len(spans), strict=True):
        raddr, _, rkind, rdev = where[index]
        region = regions[span_region]
        # One READ per group and pair of memory kinds; a run never spans two devices.
        rows.append(((g, region.kind, rkind, region.device, rdev), region.address + offset, raddr, length))
    key: PlanKey | None = None
    local: list[Desc] = []
    remote: list[Desc] = []
    for (g, lkind, rkind, ldev, rdev), l0, r0, size, _ in cut_rows(rows):
        here = (g, peer, lkind, rkind)
        if here != key:
            local, remote, owners = _entry(plans, here)
            if not owners or owners[-1] != k:
                owners.append(k)
            key = here
        local.append((l0, size, ldev))
        remote.append((r0, size, rdev))


def _entry(plans: Plans, here: PlanKey) -> tuple[list[Desc], list[Desc], list[int]]:
    """The READ ``here`` as lists to append rows to (arrays an earlier key made become rows)."""
    entry = plans.get(here)
    if entry is None:
        lists: tuple[list[Desc], list[Desc], list[int]] = ([], [], [])
        plans[here] = lists
        return lists
    local, remote, owners = entry
    if isinstance(local, np.ndarray) or isinstance(remote, np.ndarray):
        local = [tuple(row) for row in np.asarray(local).tolist()]
        remote = [tuple(row) for row in np.asarray(remote).tolist()]
        plans[here] = (local, remote, owners)
    assert isinstance(local, list) and isinstance(remote, list)
    return local, remote, owners


def _plan_arrays(
    k: int, spans: tuple[Any, ...], indices: Sequence[int], numbers: tuple[int, ...] | None, grant: Granted,
    regions: Mapping[int, RegionHandle], columns: LocalColumns, plans: Plans, codes: list[int],
) -> bool:
    """One key's runs with array arithmetic; False when its spans lie in several regions of
    different kinds or devices (the row path then plans it)."""
    remote = grant.remote
    assert remote.addresses is not None and remote.sizes is not None and remote.uniform is not None
    region_ids, offsets, lengths = columns.of(spans)
    first = regions[int(region_ids[0])]
    same_region = bool((region_ids == region_ids[0]).all())
    if not same_region:
        handles = {r: regions[r] for r in distinct(region_ids)}
        if len({(h.kind, h.device) for h in handles.values()}) != 1:
            return False
        bases = np.zeros(int(region_ids.max()) + 1, dtype=np.uint64)
        for r, handle in handles.items():
            bases[r] = handle.address
        laddr = bases[region_ids] + offsets
    else:
        laddr = offsets + np.uint64(first.address)
    picked = np.asarray(indices, dtype=np.int64) if not isinstance(indices, range) else None
    raddr = remote.addresses if picked is None else remote.addresses[picked]
    sizes = remote.sizes if picked is None else remote.sizes[picked]
    if not np.array_equal(lengths, sizes):
        codes[k] = ErrorCode.SIZE_MISMATCH
        return True
    g = None if numbers is None else np.asarray(numbers, dtype=np.int64)
    starts, run_sizes = cut(laddr, raddr, lengths, g)
    rkind, rdev = remote.uniform

    all_local = np.column_stack((laddr[starts], run_sizes, np.full(len(starts), np.uint64(first.device), np.uint64)))
    all_remote = np.column_stack((raddr[starts], run_sizes, np.full(len(starts), np.uint64(rdev), np.uint64)))
    cuts = [(0, slice(None))] if g is None else by_group(g[starts])
    for group, mine in cuts:
        local_rows, remote_rows = all_local[mine], all_remote[mine]
        here = (group, grant.peer, first.kind, rkind)
        entry = plans.get(here)
        if entry is None:
            plans[here] = (local_rows, remote_rows, [k])
            continue
        old_local, old_remote, owners = entry
        plans[here] = (np.concatenate((as_array(old_local), local_rows)), np.concatenate((as_array(old_remote), remote_rows)), owners)
        if owners[-1] != k:
            owners.append(k)
    return True


def by_group(groups: np.ndarray) -> list[tuple[int, Any]]:
    """Each group number of a non-empty column and what selects its entries: a slice when
    the numbers never go down (a plan in order, the usual case), else a mask."""
    if bool((groups[1:] >= groups[:-1]).all()):
        bounds = np.flatnonzero(np.concatenate(([True], groups[1:] != groups[:-1], [True]))).tolist()
        return [(int(groups[a]), slice(a, b)) for a, b in itertools.pairwise(bounds)]
    return [(group, groups == group) for group in distinct(groups)]


def as_array(descs: Descs) -> np.ndarray:
    """Descriptor rows as an N x 3 ``uint64`` array."""
    return descs if isinstance(descs, np.ndarray) else np.asarray(descs, dtype=np.uint64).reshape(-1, 3)
