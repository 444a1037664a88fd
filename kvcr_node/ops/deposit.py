"""``deposit``: place new objects in pool slots and read their bytes from the client (spec section 9).

Each new key gets a WRITING entry whose slots one NIXL READ fills from the client's
memory; the entry becomes READY (or is abandoned) when the READ is terminal. A key that
another writer holds WRITING waits for that writer and is then tried again from the
start (spec section 9: DUPLICATE means stored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcr_node.memory import PoolMemory
from kvcr_node.operations import Operations
from kvcr_node.records import Operation, OpKind, Session
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
Begin = Callable[[Operation, list[Move], Fills], None]
"""What starts once a batch's items are placed: the deposit's READ (or a put's reservation)."""


class Deposits:
    """The ``deposit`` handler and the READs it starts."""

    def __init__(self, store: Store, memories: dict[str, PoolMemory], operations: Operations) -> None:
        self.store = store
        self.memories = memories
        self.operations = operations

    def on_deposit(self, session: Session, msg: Deposit) -> None:
        blocks, where, keys = self.column_blocks(msg)
        # An item whose key another writer holds WRITING waits for that writer's outcome
        # and is then tried again from the start (spec section 9: DUPLICATE means stored).
        op = self.operations.admit(session, msg.id, OpKind.DEPOSIT, len(keys), msg.deadline_ms,
                                   resume=lambda op, i: self.deposit_items(op, msg, [i], blocks, where))
        if op is None:
            return
        unique = self.operations.unique_keys(op, keys)
        self.deposit_items(op, msg, [i for i in range(len(keys)) if unique[i]], blocks, where)

    def deposit_items(
        self, op: Operation, msg: Deposit, indices: Sequence[int], blocks: Sequence[_ColumnBlock] = (),
        where: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Begin storing the items ``indices`` of a deposit: check, place, and read the source."""
        def read(op: Operation, moves: list[Move], fills: Fills) -> None:
            self.operations.start(op, "READ", moves, lambda ok: self.deposit_done(op, fills, msg.no_evict, ok))

        self.place(op, msg, indices, blocks, where, read)

    def column_blocks(self, msg: Deposit | Put) -> tuple[list[_ColumnBlock], list[tuple[int, int]], list[bytes]]:
        """A deposit's (or put's) column blocks, each checked once, where each key is in
        them, and every key in item order."""
        blocks = [_ColumnBlock(block, f"columns[{b}]", self.memories) for b, block in enumerate(msg.columns)]
        where = [(b, r) for b, block in enumerate(msg.columns) for r in range(len(block.keys))]
        keys = [item.key for item in msg.items] if not blocks else [k for block in msg.columns for k in block.keys]
        return blocks, where, keys

    def place(
        self, op: Operation, msg: Deposit | Put, indices: Sequence[int], blocks: Sequence[_ColumnBlock],
        where: Sequence[tuple[int, int]], begin: Begin, wait: bool = True,
    ) -> None:
        """Check and place the items ``indices`` (spec section 9's deposit rules), then
        ``begin`` what fills the new entries. ``wait``: an item whose key another writer
        holds waits for it (a deposit); else it fails ``BUSY`` (a put, section 6.13)."""
        fills: Fills = []
        try:
            if blocks:
                self._begin_columns(op, msg, indices, blocks, where, fills, begin, wait)
            else:
                self._begin_items(op, msg, indices, fills, begin, wait)
        except BaseException:
            # Slots set aside that no transfer took over are freed (the guard fails the items).
            if not any(t.running for t in op.transfers):
                self.operations.abandon_fills(
                    [e for _, e in fills if self.store.lookup(e.key) is e and e.state is ObjectState.WRITING])
            raise

    def _begin_items(
        self, op: Operation, msg: Deposit | Put, indices: Sequence[int], fills: Fills, begin: Begin, wait: bool,
    ) -> None:
        session = op.session
        moves: list[Move] = []
        for i in indices:
            item = msg.items[i]
            # Columns of the spans (names, pools, regions, offsets, lengths): one C-level transpose.
            columns = tuple(zip(*item.spans, strict=True))
            uniform = self._uniform_source(session, columns)
            item_moves: list[tuple[int, int, Region]] = []
            if uniform is None:
                try:
                    item_moves = self._source_moves(session, item.spans, f"items[{i}].spans")
                except ProtocolError as exc:
                    op.fail(i, exc.code, f"{exc.path}: {exc.reason}")
                    continue
            layout = tuple(zip(columns[0], columns[1], strict=True))
            outcome, entry = self.store.begin_deposit(item.key, layout, msg.optional)
            if outcome is DepositOutcome.NEW:
                assert entry is not None
                fills.append((i, entry))
                if uniform is not None:
                    pool, size, region, offsets = uniform
                    slots = np.frombuffer(entry.slot_view, dtype=np.uint32)
                    moves.extend(run_moves(pool, size, region, offsets, slots))
                else:
                    moves.extend(
                        (span.pool, slot, address, length, region, 1)
                        for span, slot, (address, length, region) in zip(item.spans, entry.slots, item_moves, strict=True)
                    )
            else:
                self._not_new(op, i, item.key, outcome, entry, wait)
        if fills:
            begin(op, moves, fills)
        self.operations.settle(op)

    def _begin_columns(
        self, op: Operation, msg: Deposit | Put, indices: Sequence[int], blocks: Sequence[_ColumnBlock],
        where: Sequence[tuple[int, int]], fills: Fills, begin: Begin, wait: bool,
    ) -> None:
        """As ``_begin_items`` for column blocks: each block's pools, sizes and regions are
        checked once (a column at a time), each key's moves cut out of the block's columns."""
        session = op.session
        moves: list[Move] = []
        for i in indices:
            b, r = where[i]
            block = blocks[b]
            problem = block.problem(session.regions, r)
            if problem is not None:
                op.fail(i, problem.code, f"{problem.path}: {problem.reason}")
                continue
            key = block.block.keys[r]
            outcome, entry = self.store.begin_deposit(key, block.layout, msg.optional)
            if outcome is DepositOutcome.NEW:
                assert entry is not None
                fills.append((i, entry))
                moves.extend(block.row_moves(session.regions, r, entry))
            else:
                self._not_new(op, i, key, outcome, entry, wait)
        if fills:
            begin(op, moves, fills)
        self.operations.settle(op)

    def _not_new(
        self, op: Operation, i: int, key: bytes, outcome: DepositOutcome, entry: ObjectEntry | None, wait: bool,
    ) -> None:
        """Item ``i``'s key needs no READ: a duplicate, dropped, or refused."""
        if outcome is DepositOutcome.DUPLICATE:
            assert entry is not None
            if entry.state is ObjectState.WRITING and not wait:
                op.fail(i, ErrorCode.BUSY, f"items[{i}]: another writer holds the key (WRITING)")
            elif entry.state is ObjectState.WRITING:
                # Another deposit or a fetch is filling the key and may still fail: wait
                # for it (spec section 9); at our deadline, TIMEOUT.
                self.operations.wait(op, key, i)
            else:
                op.set(i, KeyResult(KeyStatus.DUPLICATE))
        elif outcome is DepositOutcome.DROPPED:
            op.set(i, KeyResult(KeyStatus.DROPPED))
        elif outcome is DepositOutcome.LAYOUT_MISMATCH:
            op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}]: the key is stored with another layout")
        elif outcome is DepositOutcome.CAPACITY:
            op.fail(i, ErrorCode.CAPACITY, f"items[{i}]: not enough free or evictable slots")
        else:
            op.fail(i, ErrorCode.UNKNOWN_POOL, f"items[{i}].spans: unknown pool")

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

    def _source_moves(self, session: Session, spans: Sequence[SrcSpan], path: str) -> list[tuple[int, int, Region]]:
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

    def deposit_done(self, op: Operation, fills: list[tuple[int, ObjectEntry]], no_evict: bool, ok: bool) -> None:
        """The READ is terminal: commit (with a handle for ``no_evict``) or abandon each fill."""
        for i, entry in fills:
            if ok and not op.aborted:
                keep = no_evict and not op.session.closing
                self.store.commit(entry, claim=keep)
                self.operations.metrics.deposited(entry.info.need, self._slot_size)
                handle = self.operations.new_handle(op.session, entry) if keep else None
                op.set(i, KeyResult(KeyStatus.STORED, handle=handle))
            else:
                self.store.abandon(entry)
                if op.aborted:
                    op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted"))
                else:
                    op.fail(i, ErrorCode.TRANSFER_FAILED, "reading the source bytes failed")
            self.operations.wake(entry.key)
        self.operations.settle(op)


class _ColumnBlock:
    """One ``DepositColumns`` block, checked once for all its keys (spec section 6.7)."""

    def __init__(self, block: DepositColumns, path: str, memories: dict[str, PoolMemory]) -> None:
        self.block = block
        self.path = path
        names, pools = block.span_names(), block.pool_names()
        self.layout = tuple(zip(names, pools, strict=True))
        self.pools = pools
        self.lengths = block.length_column()
        self.sizes: list[int] = []
        self.failure: ProtocolError | None = None
        for j, pool in enumerate(pools):
            mem = memories.get(pool)
            if mem is None:
                self.failure = ProtocolError(ErrorCode.UNKNOWN_POOL, f"pool {pool!r} does not exist", f"{path}.pools[{j}]")
                break
            if self.lengths[j] != mem.spec.slot_size:
                where = "" if isinstance(block.lengths, int) else f"[{j}]"
                self.failure = ProtocolError(
                    ErrorCode.SIZE_MISMATCH, f"span {j} of {self.lengths[j]} bytes, pool {pool!r} slots hold {mem.spec.slot_size}",
                    f"{path}.lengths{where}",
                )
                break
            self.sizes.append(mem.spec.slot_size)
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
