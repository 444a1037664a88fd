"""``deposit``: place new objects in pool slots and read their bytes from the client (spec section 9).

Each new key gets a WRITING entry whose slots one NIXL READ fills from the client's
memory; the entry becomes READY (or is abandoned) when the READ is terminal. A key that
another writer holds WRITING waits for that writer and is then tried again from the
start (spec section 9: DUPLICATE means stored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvcr_node.memory import PoolMemory
from kvcr_node.operations import Operations
from kvcr_node.records import Operation, OpKind, Outcomes, Session
from kvcr_node.reservations import Reservations, record_extents, row_extents
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, Store
from kvcr_node.transfers import Move, run_moves, uniform_columns
from kvcr_protocol import (
    Deposit,
    DepositColumns,
    ErrorCode,
    KeyResult,
    KeyStatus,
    ProtocolError,
    Put,
    Region,
    SrcSpan,
    resolve_columns,
)
from kvcr_protocol.descriptors import ColumnExtents, resolve_spans

Fills = list[tuple[int, ObjectEntry]]
"""The items that got new WRITING entries: (item index, entry)."""
Source = tuple[str, int, Region, np.ndarray] | list[tuple[int, int, Region]] | tuple["_ColumnBlock", int]
"""Where a placed item's bytes are in its client's memory: one pool, slot size, region and
the spans' offsets there (uniform); per span its address, length and region; or its row of
a column block."""
Placed = list[tuple[int, ObjectEntry, Source]]
"""The items placed: index, their new WRITING entry, where their bytes are."""


class Deposits:
    """Placement of new objects (``deposit`` and ``put``), the ``deposit`` handler and the
    READs it starts, and the commit both end with."""

    def __init__(
        self, store: Store, memories: dict[str, PoolMemory], operations: Operations, reservations: Reservations,
    ) -> None:
        self.reservations = reservations
        """Client memory an uncertain write may still change: never read from (spec section 12)."""
        self.store = store
        self.memories = memories
        self.operations = operations
        self._layouts: dict[tuple[str, str, bytes | int], _Layout] = {}
        """Layouts checked against the pools (which never change in a node's life)."""

    def on_deposit(self, session: Session, msg: Deposit) -> None:
        blocks, where, keys = self.column_blocks(msg)
        # An item whose key another writer holds WRITING waits for that writer's outcome
        # and is then tried again from the start (spec section 9: DUPLICATE means stored).
        op = self.operations.admit(session, msg.id, OpKind.DEPOSIT, len(keys), msg.deadline_ms,
                                   resume=lambda op, indices: self.deposit_items(op, msg, indices, blocks, where))
        if op is None:
            return
        unique = self.operations.unique_keys(op, keys)
        self.deposit_items(op, msg, [i for i in range(len(keys)) if unique[i]], blocks, where)

    def deposit_items(
        self, op: Operation, msg: Deposit, indices: Sequence[int], blocks: Sequence[_ColumnBlock] = (),
        where: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Begin storing the items ``indices`` of a deposit: check, place, and read the source."""
        placed = self.place(op.session, op, msg, indices, blocks, where,
                            lambda i, key: self.operations.wait(op, key, i))
        if placed:
            fills = [(i, entry) for i, entry, _ in placed]
            try:
                moves = self._moves(op.session, placed)
                self.operations.start(op, "READ", moves, lambda ok: self.deposit_done(op, fills, msg.no_evict, ok))
            except BaseException:
                # Slots set aside that no transfer took over are freed (the guard fails the items).
                if not op.transfers:
                    self._abandon(fills)
                raise
        self.operations.settle(op)

    def column_blocks(self, msg: Deposit | Put) -> tuple[list[_ColumnBlock], list[tuple[int, int]], list[bytes]]:
        """A deposit's (or put's) column blocks, each checked once, where each key is in
        them, and every key in item order."""
        blocks = [_ColumnBlock(block, f"columns[{b}]", self.memories, self._layouts)
                  for b, block in enumerate(msg.columns)]
        where = [(b, r) for b, block in enumerate(msg.columns) for r in range(len(block.keys))]
        keys = [item.key for item in msg.items] if not blocks else [k for block in msg.columns for k in block.keys]
        return blocks, where, keys

    def place(
        self, session: Session, outcomes: Outcomes, msg: Deposit | Put, indices: Sequence[int],
        blocks: Sequence[_ColumnBlock], where: Sequence[tuple[int, int]],
        waiting: Callable[[int, bytes], None] | None,
    ) -> Placed:
        """Check and place the items ``indices`` (spec section 9's deposit rules): each new
        key a WRITING entry in free or evicted slots, the others' results in ``outcomes``.
        An item whose key another writer holds is handed to ``waiting`` (a deposit waits
        for that writer), or fails ``BUSY`` without it (a put, section 6.13). Nothing moves."""
        placed: Placed = []
        if self.reservations.holds(session.agent):
            indices = self._unreserved(session, outcomes, msg, indices, blocks, where)
        try:
            if blocks:
                self._place_columns(session, outcomes, msg, indices, blocks, where, placed, waiting)
            else:
                self._place_items(session, outcomes, msg, indices, placed, waiting)
        except BaseException:
            self._abandon([(i, entry) for i, entry, _ in placed])
            raise
        return placed

    def _unreserved(
        self, session: Session, outcomes: Outcomes, msg: Deposit | Put, indices: Sequence[int],
        blocks: Sequence[_ColumnBlock], where: Sequence[tuple[int, int]],
    ) -> list[int]:
        """``indices`` less the items whose source an uncertain write may still change, which
        fail ``DESTINATION_UNCERTAIN`` (spec section 12): what they would store is not known."""
        kept = []
        for i in indices:
            if blocks:
                b, r = where[i]
                extents, path = row_extents(blocks[b].block, r), f"{blocks[b].path}.keys[{r}].spans"
            else:
                extents, path = record_extents(msg.items[i].spans), f"items[{i}].spans"
            # A span outside the session's regions fails as such when the item is placed.
            known = all(region in session.regions for region, _, _ in extents)
            why = self.reservations.reason(session.agent, extents, path) if known else None
            if why is None:
                kept.append(i)
            else:
                outcomes.fail(i, ErrorCode.DESTINATION_UNCERTAIN, why)
        return kept

    def _abandon(self, fills: Fills) -> None:
        self.operations.abandon_fills(
            [e for _, e in fills if self.store.lookup(e.key) is e and e.state is ObjectState.WRITING])

    def _place_items(
        self, session: Session, outcomes: Outcomes, msg: Deposit | Put, indices: Sequence[int], placed: Placed,
        waiting: Callable[[int, bytes], None] | None,
    ) -> None:
        for i in indices:
            item = msg.items[i]
            # Columns of the spans (names, pools, regions, offsets, lengths): one C-level transpose.
            columns = tuple(zip(*item.spans, strict=True))
            source: Source | None = self._uniform_source(session, columns)
            if source is None:
                try:
                    source = self._source_spans(session, item.spans, f"items[{i}].spans")
                except ProtocolError as exc:
                    outcomes.fail(i, exc.code, f"{exc.path}: {exc.reason}")
                    continue
            layout = tuple(zip(columns[0], columns[1], strict=True))
            outcome, entry = self.store.begin_deposit(item.key, layout, msg.optional, msg.parents[i] if msg.parents else b"")
            if outcome is DepositOutcome.NEW:
                assert entry is not None
                placed.append((i, entry, source))
            else:
                self._not_new(outcomes, i, item.key, outcome, entry, waiting)

    def _place_columns(
        self, session: Session, outcomes: Outcomes, msg: Deposit | Put, indices: Sequence[int],
        blocks: Sequence[_ColumnBlock], where: Sequence[tuple[int, int]], placed: Placed,
        waiting: Callable[[int, bytes], None] | None,
    ) -> None:
        """As ``_place_items`` for column blocks: each block's pools, sizes and regions are
        checked once (a column at a time)."""
        for i in indices:
            b, r = where[i]
            block = blocks[b]
            problem = block.problem(session.regions, r)
            if problem is not None:
                outcomes.fail(i, problem.code, f"{problem.path}: {problem.reason}")
                continue
            key = block.block.keys[r]
            outcome, entry = self.store.begin_deposit(key, block.layout, msg.optional, msg.parents[i] if msg.parents else b"")
            if outcome is DepositOutcome.NEW:
                assert entry is not None
                placed.append((i, entry, (block, r)))
            else:
                self._not_new(outcomes, i, key, outcome, entry, waiting)

    def _moves(self, session: Session, placed: Placed) -> list[Move]:
        """The READ of a deposit's placed items: from where their bytes are into their slots."""
        moves: list[Move] = []
        for _, entry, source in placed:
            if isinstance(source, list):  # span by span
                moves.extend((pool, slot, address, length, region, 1) for (_, pool), slot, (address, length, region)
                             in zip(entry.info.layout, entry.slots, source, strict=True))
            elif isinstance(source[0], _ColumnBlock):
                moves.extend(source[0].row_moves(session.regions, source[1], entry))
            else:
                pool, size, region, offsets = source
                moves.extend(run_moves(pool, size, region, offsets, np.frombuffer(entry.slot_view, dtype=np.uint32)))
        return moves

    def _not_new(
        self, outcomes: Outcomes, i: int, key: bytes, outcome: DepositOutcome, entry: ObjectEntry | None,
        waiting: Callable[[int, bytes], None] | None,
    ) -> None:
        """Item ``i``'s key needs no slots: a duplicate, dropped, or refused."""
        if outcome is DepositOutcome.DUPLICATE:
            assert entry is not None
            if entry.state is ObjectState.WRITING and waiting is None:
                outcomes.fail(i, ErrorCode.BUSY, f"items[{i}]: another writer holds the key (WRITING)")
            elif entry.state is ObjectState.WRITING:
                # Another deposit or a fetch is filling the key and may still fail: wait
                # for it (spec section 9); at our deadline, TIMEOUT.
                assert waiting is not None
                waiting(i, key)
            else:
                outcomes.set(i, KeyResult(KeyStatus.DUPLICATE))
        elif outcome is DepositOutcome.DROPPED:
            outcomes.set(i, KeyResult(KeyStatus.DROPPED))
        elif outcome is DepositOutcome.LAYOUT_MISMATCH:
            outcomes.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}]: the key is stored with another layout")
        elif outcome is DepositOutcome.CAPACITY:
            outcomes.fail(i, ErrorCode.CAPACITY, f"items[{i}]: not enough free or evictable slots")
        else:
            outcomes.fail(i, ErrorCode.UNKNOWN_POOL, f"items[{i}].spans: unknown pool")

    def _uniform_source(
        self, session: Session, columns: tuple[tuple[Any, ...], ...]
    ) -> tuple[str, int, Region, np.ndarray] | None:
        """(pool, slot size, region, offsets) for deposit spans of one pool and one region whose
        lengths are the slot size and which lie inside the region; else None (checked per span).
        """
        _, pools, ids, offsets, lengths = columns
        mem = self.memories.get(pools[0])
        if mem is None or len(set(pools)) != 1:
            return None
        uniform = uniform_columns(session.regions, ids, offsets, lengths, mem.spec.slot_size)
        return None if uniform is None else (pools[0], mem.spec.slot_size, *uniform)

    def _source_spans(self, session: Session, spans: Sequence[SrcSpan], path: str) -> list[tuple[int, int, Region]]:
        """Check a deposit's spans (pool, size, region) and resolve them to client addresses."""
        memories = self.memories
        for j, span in enumerate(spans):
            mem = memories.get(span.pool)
            if mem is None:
                raise ProtocolError(ErrorCode.UNKNOWN_POOL, f"pool {span.pool!r} does not exist", f"{path}[{j}].pool")
            if span.length != mem.spec.slot_size:
                raise ProtocolError(
                    ErrorCode.SIZE_MISMATCH, f"span of {span.length} bytes, pool {span.pool!r} slots hold {mem.spec.slot_size}", f"{path}[{j}].length"
                )
        return resolve_spans(session.regions, [(s.region, s.offset, s.length) for s in spans], path)

    def _slot_size(self, pool: str) -> int:
        return self.memories[pool].spec.slot_size

    def commit_fills(
        self, session: Session, fills: Fills, no_evict: bool, stored: Callable[[int, KeyResult], None],
    ) -> None:
        """The new entries' bytes are all in their slots: each READY (claimed, with a handle,
        for ``no_evict``), its item ``STORED`` through ``stored``, its waiters woken. A
        deposit's READ and a put's ``commit`` end here alike."""
        for i, entry in fills:
            keep = no_evict and not session.closing
            self.store.commit(entry, claim=keep)
            self.operations.metrics.deposited(entry.info.need, self._slot_size)
            handle = self.operations.new_handle(session, entry) if keep else None
            stored(i, KeyResult(KeyStatus.STORED, handle=handle))
            self.operations.wake(entry.key)

    def deposit_done(self, op: Operation, fills: list[tuple[int, ObjectEntry]], no_evict: bool, ok: bool) -> None:
        """The READ is terminal: commit (with a handle for ``no_evict``) or abandon each fill."""
        if ok and not op.aborted:
            self.commit_fills(op.session, fills, no_evict, op.set)
        else:
            for i, entry in fills:
                self.store.abandon(entry)
                if op.aborted:
                    op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted"))
                else:
                    op.fail(i, ErrorCode.TRANSFER_FAILED, "reading the source bytes failed")
                self.operations.wake(entry.key)
        self.operations.settle(op)


LAYOUTS_KEPT = 16
"""Distinct layouts (names, pools, lengths) whose check ``Deposits`` keeps: an engine sends
the same few for every block of a model."""
LAYOUT_KEPT_SPANS = 4096
"""The most spans of a layout kept: 16 of them hold a few MiB at most, whatever layouts a
client sends; a larger one is checked each time it comes."""


@dataclass(frozen=True, slots=True)
class _Layout:
    """A layout that fits the node's pools: its (name, pool) pairs and each span's slot size."""

    layout: tuple[tuple[str, str], ...]
    pools: tuple[str, ...]
    sizes: list[int]


def _fit_pools(block: DepositColumns, path: str, memories: dict[str, PoolMemory]) -> _Layout | ProtocolError:
    """The block's layout, where each span's pool exists and its length is that pool's slot
    size; else the error naming the first span that does not fit. Each distinct pool is looked
    up once and the lengths compared in one C-level pass; the span to name is looked for
    only when something is wrong."""
    names, pools = block.span_names(), block.pool_names()
    slot_sizes = {pool: None if (mem := memories.get(pool)) is None else mem.spec.slot_size
                  for pool in dict.fromkeys(pools)}
    if len(slot_sizes) == 1:
        sizes: list[int | None] = list(slot_sizes.values()) * len(pools)
    else:
        sizes = [slot_sizes[pool] for pool in pools]
    lengths = block.length_column().tolist()
    if sizes == lengths:
        return _Layout(tuple(zip(names, pools, strict=True)), pools, cast(list[int], sizes))
    for j, (pool, size, length) in enumerate(zip(pools, sizes, lengths, strict=True)):
        if size is None:
            return ProtocolError(ErrorCode.UNKNOWN_POOL, f"pool {pool!r} does not exist", f"{path}.pools[{j}]")
        if length != size:
            where = "" if isinstance(block.lengths, int) else f"[{j}]"
            return ProtocolError(ErrorCode.SIZE_MISMATCH, f"span {j} of {length} bytes, pool {pool!r} slots hold {size}",
                                 f"{path}.lengths{where}")
    raise AssertionError("every span fits its pool")


class _ColumnBlock:
    """One ``DepositColumns`` block, checked once for all its keys (spec section 6.7)."""

    def __init__(self, block: DepositColumns, path: str, memories: dict[str, PoolMemory],
                 layouts: dict[tuple[str, str, bytes | int], _Layout]) -> None:
        self.block = block
        self.path = path
        self.failure: ProtocolError | None = None
        self.layout: tuple[tuple[str, str], ...] = ()
        self.pools: tuple[str, ...] = ()
        self.sizes: list[int] = []
        key = (block.names, block.pools, block.lengths)
        known = layouts.get(key)
        if known is None:
            fit = _fit_pools(block, path, memories)
            if isinstance(fit, ProtocolError):
                self.failure = fit
            else:
                known = fit
                if len(known.pools) <= LAYOUT_KEPT_SPANS:
                    if len(layouts) >= LAYOUTS_KEPT:
                        layouts.clear()
                    layouts[key] = known
        if known is not None:
            self.layout, self.pools, self.sizes = known.layout, known.pools, known.sizes
        self._uniform: tuple[Region, np.ndarray] | None = None
        self._extents: ColumnExtents | None = None
        self._resolved = False

    def _resolve(self, regions: dict[int, Region]) -> None:
        if self._resolved:
            return
        self._resolved = True
        block = self.block
        if len(set(self.pools)) == 1 and isinstance(block.regions, int) and isinstance(block.lengths, int):
            reg = regions.get(block.regions)
            offsets = np.frombuffer(block.offsets, dtype="<u8").astype(np.uint64, copy=False)
            length = block.lengths
            if reg is not None and 0 < length <= reg.length and int(offsets.max()) <= reg.length - length:
                self._uniform = (reg, offsets)
                return
        self._extents = resolve_columns(regions, block, self.path)

    def problem(self, regions: dict[int, Region], row: int) -> ProtocolError | None:
        """Why key ``row`` cannot be stored as sent (pools, sizes, descriptors), or None."""
        if self.failure is not None:
            return self.failure
        self._resolve(regions)
        return None if self._extents is None else self._extents.failures.get(row)

    def row_moves(self, regions: dict[int, Region], row: int, entry: ObjectEntry) -> list[Move]:
        """Key ``row``'s READ moves into ``entry``'s slots (after ``problem`` said None)."""
        self._resolve(regions)
        n = len(self.pools)
        if self._uniform is not None:
            region, offsets = self._uniform
            slots = np.frombuffer(entry.slot_view, dtype=np.uint32)
            return run_moves(self.pools[0], self.sizes[0], region, offsets[row * n : (row + 1) * n], slots)
        extents = self._extents
        assert extents is not None
        base = row * n
        return [
            (self.pools[j], slot, extents.addresses[base + j], self.sizes[j], extents.regions[base + j], 1)
            for j, slot in enumerate(entry.slots)
        ]
