"""``deposit``: place new objects in pool slots and read their bytes from the client (spec section 9).

Each new key gets a WRITING entry whose slots one NIXL READ fills from the client's
memory; the entry becomes READY (or is abandoned) when the READ is terminal. A key that
another writer holds WRITING waits for that writer and is then tried again from the
start (spec section 9: DUPLICATE means stored).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcr_node.memory import PoolMemory
from kvcr_node.operations import Operations
from kvcr_node.records import ClientSession, Operation
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, Store
from kvcr_node.transfers import Move, run_moves, uniform_columns
from kvcr_protocol import Deposit, ErrorCode, KeyResult, KeyStatus, ProtocolError, Region, SrcSpan
from kvcr_protocol.descriptors import resolve_spans


class Deposits:
    """The ``deposit`` handler and the READs it starts."""

    def __init__(self, store: Store, memories: dict[str, PoolMemory], operations: Operations) -> None:
        self.store = store
        self.memories = memories
        self.operations = operations

    def on_deposit(self, session: ClientSession, msg: Deposit) -> None:
        op = self.operations.admit(session, msg.id, "deposit", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        # An item whose key another writer holds WRITING waits for that writer's outcome
        # and is then tried again from the start (spec section 9: DUPLICATE means stored).
        op.resume = lambda i: self.deposit_items(op, msg, [i])
        unique = self.operations.unique_keys(op, [item.key for item in msg.items])
        self.deposit_items(op, msg, [i for i in range(len(msg.items)) if unique[i]])

    def deposit_items(self, op: Operation, msg: Deposit, indices: Sequence[int]) -> None:
        """Begin storing the items ``indices`` of a deposit: check, place, and read the source."""
        fills: list[tuple[int, ObjectEntry]] = []
        try:
            self._begin_items(op, msg, indices, fills)
        except BaseException:
            # Slots set aside that no transfer took over are freed (the guard fails the items).
            if not any(t.running for t in op.transfers):
                self.operations.abandon_fills(
                    [e for _, e in fills if self.store.lookup(e.key) is e and e.state is ObjectState.WRITING])
            raise

    def _begin_items(
        self, op: Operation, msg: Deposit, indices: Sequence[int], fills: list[tuple[int, ObjectEntry]]
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
            elif outcome is DepositOutcome.DUPLICATE:
                assert entry is not None
                if entry.state is ObjectState.WRITING:
                    # Another deposit or a fetch is filling the key and may still fail: wait
                    # for it (spec section 9); at our deadline, TIMEOUT.
                    self.operations.wait(op, item.key, i)
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
        if fills:
            self.operations.start(op, "READ", moves, lambda ok: self.deposit_done(op, fills, msg.no_evict, ok))
        self.operations.settle(op)

    def _uniform_source(
        self, session: ClientSession, columns: tuple[tuple[Any, ...], ...]
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

    def _source_moves(self, session: ClientSession, spans: Sequence[SrcSpan], path: str) -> list[tuple[int, int, Region]]:
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

    def deposit_done(self, op: Operation, fills: list[tuple[int, ObjectEntry]], no_evict: bool, ok: bool) -> None:
        """The READ is terminal: commit (with a handle for ``no_evict``) or abandon each fill."""
        for i, entry in fills:
            if ok and not op.aborted:
                keep = no_evict and not op.session.closing
                self.store.commit(entry, claim=keep)
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
