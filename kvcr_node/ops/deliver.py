"""``deliver``, and the source side of a peer ``write``: stored spans into remote memory (spec section 8).

Each READY key's destination is projected onto its stored layout, checked (sizes, and
regions a column at a time where it can be), the whole object claimed, runs of
consecutive slots and bytes merged into moves, and one NIXL WRITE submitted for the
batch; the claims drop when it is terminal (architecture §5). Keys a session's hint
sends to another node go to ``kvcr_node.target``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcr_node.operations import Failure, Operations
from kvcr_node.records import ClientSession, Operation
from kvcr_node.store import ObjectEntry, ObjectState, Store
from kvcr_node.target import Target
from kvcr_node.transfers import Move, run_moves, uniform_columns
from kvcr_protocol import (
    Deliver,
    DeliverItem,
    ErrorCode,
    KeyResult,
    KeyStatus,
    Projection,
    ProjectionCache,
    ProtocolError,
)
from kvcr_protocol.descriptors import resolve_spans

_FULL = Projection((), True)
"""The whole layout (its indices are never read: full deliveries take every slot in order)."""


class Deliveries:
    """The ``deliver`` handler, and the WRITEs of delivers and peer writes."""

    def __init__(
        self, store: Store, slot_sizes: dict[str, int], projections: ProjectionCache, operations: Operations,
        target: Target, failure: Failure,
    ) -> None:
        self.store = store
        self.slot_sizes = slot_sizes
        self.projections = projections
        self.operations = operations
        self.target = target
        self.failure = failure

    def on_deliver(self, session: ClientSession, msg: Deliver) -> None:
        op = self.operations.admit(session, msg.id, "deliver", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        op.agent, op.regions = session.agent, session.regions
        items = msg.items
        op.resume = lambda i: self.deliver_ready([i], op, items)
        ready, remote = self.operations.sort_items(op, [item.key for item in items], msg.request_id)
        self.deliver_ready(ready, op, items)
        for source, indices in remote.items():
            self.target.remote_write(op, source, indices, tuple(items[i] for i in indices), session.agent, session, msg.partial)

    def deliver_ready(self, indices: list[int], op: Operation, items: Sequence[DeliverItem]) -> None:
        """Claim the READY keys ``indices`` and submit one WRITE of their spans."""
        claimed: list[tuple[int, ObjectEntry]] = []
        moves: list[Move] = []
        for i in indices:
            item = items[i]
            entry = self.store.lookup(item.key)
            if entry is not None and entry.state is ObjectState.WRITING:
                # Written again since the wait began (a waiting deposit took over a failed
                # writer's key): wait for that writer too.
                self.operations.wait(op, item.key, i)
                continue
            if entry is None or entry.state is not ObjectState.READY:
                op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
                continue
            try:
                item_moves = self._moves(op, entry, item, f"items[{i}]")
            except ProtocolError as exc:
                where = f"{exc.path or f'items[{i}].spans'}: "
                op.fail(i, exc.code, where + exc.reason)
                continue
            except Exception as exc:
                # Before the claim: this item fails alone, the claims of the others stay owned.
                self.failure(f"{op.kind} item", exc)
                op.fail(i, ErrorCode.INTERNAL, f"items[{i}]: the node failed: {type(exc).__name__}: {exc}")
                continue
            # Spec section 8: "While any projected span is being delivered, the claim covers the
            # whole object."
            self.operations.claim(entry)
            claimed.append((i, entry))
            moves.extend(item_moves)
        if claimed:
            self.operations.start(op, "WRITE", moves, lambda ok: self.deliver_done(op, claimed, ok))
        self.operations.settle(op)

    def _moves(self, op: Operation, entry: ObjectEntry, item: DeliverItem, path: str) -> list[Move]:
        """Project the destination onto the stored layout, check sizes and regions.

        Spans of one pool and one region are checked a column at a time; others, and
        every refusal, span by span, so that an error names its span.
        """
        spans = item.spans
        stored = tuple([name for name, _ in entry.layout])
        # Columns of the spans (names, regions, offsets, lengths): one C-level transpose.
        columns = tuple(zip(*spans, strict=True))
        requested: tuple[str, ...] = columns[0]
        if op.exact and requested != stored:
            # A peer write without the partial-layout flag names the whole layout, exactly.
            raise ProtocolError(
                ErrorCode.LAYOUT_SUBSET_INVALID, "without the partial-layout flag the names must be the stored layout"
            )
        # Projection rule: "same names, same order: a full delivery" (no cache lookup, which
        # would hash both name tuples).
        projection = _FULL if requested == stored else self.projections.project(stored, requested)
        need = entry.info.need
        sizes = self.slot_sizes
        size = sizes[need[0][0]] if len(need) == 1 else -1
        if size > 0:
            # One pool, one region, every length right (the common case): checked and
            # merged a column at a time.
            uniform = uniform_columns(op.regions, columns[1], columns[2], columns[3], size)
            if uniform is not None:
                region, offsets = uniform
                slots_array = np.frombuffer(entry.slot_view, dtype=np.uint32)
                if not projection.full:
                    slots_array = slots_array[np.array(projection.indices, dtype=np.intp)]
                return run_moves(need[0][0], size, region, offsets, slots_array)
        slots: Sequence[int] = entry.slots
        pools: Sequence[str] = entry.info.signature
        if not projection.full:  # a subset: only the selected stored spans
            slots = [slots[i] for i in projection.indices]
            pools = [pools[i] for i in projection.indices]
        # Projection rule: "each destination length equals the stored span's size".
        for j, (span, pool) in enumerate(zip(spans, pools, strict=True)):
            if span[3] != sizes[pool]:
                raise ProtocolError(
                    ErrorCode.SIZE_MISMATCH, f"span of {span[3]} bytes, the stored span holds {sizes[pool]}",
                    f"{path}.spans[{j}].length",
                )
        # Span rule: inside a region the client announced (errors name the span).
        resolved = resolve_spans(op.regions, [(s[1], s[2], s[3]) for s in spans], f"{path}.spans")
        return [
            (pool, slot, address, length, region, 1)
            for pool, slot, (address, length, region) in zip(pools, slots, resolved, strict=True)
        ]

    def deliver_done(self, op: Operation, claimed: list[tuple[int, ObjectEntry]], ok: bool) -> None:
        """The WRITE is terminal: drop the claims, one result per key."""
        for i, entry in claimed:
            self.operations.unclaim(entry, accessed=ok)
            if op.aborted:
                op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted; the destination may have been written"))
            elif ok:
                op.set(i, KeyResult(KeyStatus.OK))
            else:
                op.fail(i, ErrorCode.TRANSFER_FAILED, "writing the destination failed; it may be partly written")
        self.operations.settle(op)
