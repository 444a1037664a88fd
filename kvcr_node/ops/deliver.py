"""``deliver``, and the source side of a peer ``write``: stored spans into remote memory (spec section 8).

Each READY key's destination is projected onto its stored layout, checked (sizes, and
regions a column at a time where it can be), the whole object claimed, runs of
consecutive slots and bytes merged into moves, and the WRITEs submitted: one for every
key of the batch without a layer plan, else one per group number, in group order, each
carrying the group's NIXL notification when the client asked for them (spec sections 6.8
and 6.10). The claims drop when the key's last transfer is terminal (architecture §5).
Keys a session's hint sends to another node go to ``kvcr_node.target``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvcr_node.counters import Count
from kvcr_node.digests import Digests
from kvcr_node.operations import Failure, Operations
from kvcr_node.records import Operation, OpKind, Plan, Session
from kvcr_node.store import ObjectEntry, ObjectState, Store
from kvcr_node.target import Target
from kvcr_node.transfers import Move, Prepared, list_moves, run_moves, uniform_columns
from kvcr_node.wanted import Block, GroupMoves, Wanted
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

GROUP_WINDOW = 4
"""Groups of one batch in flight at once after the first (which goes alone): enough to keep
the link busy across a loop turn, few enough that each group lands soon after its turn.
A group's completion can wait for the destination's agent to progress (its notification
goes through), so with two in flight the layers moved at the client's polling pace: four took
a 32-layer planned deliver from 6.4 to 4.7 ms in ``bench/remote.py``'s setting."""


class _GroupRun:
    """The claimed keys of one batch and how far their groups have been submitted."""

    __slots__ = ("changed", "claimed", "deepest", "entries", "first_done", "next", "prepared", "running")

    def __init__(self, claimed: list[tuple[int, ObjectEntry, GroupMoves]]) -> None:
        self.claimed = claimed
        self.prepared: Prepared | None = None
        """The descriptor lists of every later group of every key, prepared once, right after
        group 0 was posted (with lists of its own, so that nothing comes before it)."""
        self.entries: dict[tuple[int, int], int] = {}
        """(item, group) -> its entry in ``prepared``."""
        self.changed: set[int] = set()
        """Items a group of which sent bytes that no longer matched their digests."""
        self.deepest = max(len(groups) for _, _, groups in claimed)
        self.next = 0
        self.running = 0
        self.first_done = False
        """Whether group 0 is terminal: until then it is the only group in flight."""

    def window(self) -> int:
        """How many groups may be in flight now."""
        return GROUP_WINDOW if self.first_done else 1


class Deliveries:
    """The ``deliver`` handler, and the WRITEs of delivers and peer writes."""

    def __init__(
        self, store: Store, slot_sizes: dict[str, int], projections: ProjectionCache, operations: Operations,
        target: Target, failure: Failure, digests: Digests | None = None,
    ) -> None:
        self.digests = digests
        """Checks each group's spans once it landed (spec section 6.12, "Integrity"); None:
        nobody but the writer can have touched the pools (no grants), or integrity is off."""
        self.store = store
        self.slot_sizes = slot_sizes
        self.projections = projections
        self.operations = operations
        self.target = target
        self.failure = failure

    def moves_of(self, op: Operation, entry: ObjectEntry, wanted: Wanted, i: int) -> GroupMoves:
        """Item ``i``'s moves per group; ``ProtocolError`` naming the field when it cannot be served."""
        if not wanted.blocks:
            return [self.record_moves(op, entry, wanted.items[i], f"items[{i}]")]
        b, r = wanted.where[i]
        return self.column_moves(op, entry, wanted.blocks[b], r)

    def on_deliver(self, session: Session, msg: Deliver) -> None:
        wanted = Wanted(msg.items, msg.columns)
        op = self.operations.admit(
            session, msg.id, OpKind.DELIVER, len(wanted), msg.deadline_ms, agent=session.agent, regions=session.regions,
            plan=Plan(wanted.group_counts(), wanted.planned, notify=(msg.notify, msg.id, None) if msg.notify else None),
            resume=lambda op, indices: self.deliver_ready(indices, op, wanted),
        )
        if op is None:
            return
        reservations = self.target.reservations
        if reservations.holds(session.agent):
            # Spec section 12, "Reserved memory": an earlier write may still land there after this one.
            for i in range(len(wanted)):
                if wanted.descriptor_problem(i, session.regions) is not None:
                    continue  # failed as such below
                why = reservations.reason(session.agent, wanted.extents(i), f"{wanted.item_path(i)}.spans")
                if why is not None:
                    op.fail(i, ErrorCode.DESTINATION_UNCERTAIN, why)
        ready, remote = self.operations.sort_items(op, wanted.keys, msg.request_id)
        self.deliver_ready(ready, op, wanted)
        for source, indices in remote.items():
            self.target.remote_write(op, source, indices, wanted, session, msg.partial)

    def deliver_ready(self, indices: list[int], op: Operation, wanted: Wanted) -> None:
        """Claim the READY keys ``indices`` and submit their WRITEs, group by group."""
        claimed: list[tuple[int, ObjectEntry, GroupMoves]] = []
        for i in indices:
            key = wanted.keys[i]
            entry = self.store.lookup(key)
            if entry is not None and entry.state is ObjectState.WRITING:
                # Written again since the wait began (a waiting deposit took over a failed
                # writer's key): wait for that writer too.
                self.operations.wait(op, key, i)
                continue
            if entry is None or entry.state is not ObjectState.READY:
                op.fail(i, ErrorCode.NOT_FOUND, f"{wanted.item_path(i)}.key is not stored on this node")
                continue
            try:
                groups = self.moves_of(op, entry, wanted, i)
            except ProtocolError as exc:
                where = f"{exc.path or f'{wanted.item_path(i)}.spans'}: "
                op.fail(i, exc.code, where + exc.reason)
                continue
            except Exception as exc:
                # Before the claim: this item fails alone, the claims of the others stay owned.
                self.failure(f"{op.kind} item", exc)
                op.fail(i, ErrorCode.INTERNAL, f"{wanted.item_path(i)}: the node failed: {type(exc).__name__}: {exc}")
                continue
            # Spec section 8: "While any projected span is being delivered, the claim covers the
            # whole object" - here until the key's last group is terminal.
            self.operations.claim(entry)
            claimed.append((i, entry, groups))
        if claimed:
            self._submit(op, claimed)
        self.operations.settle(op)

    def _submit(self, op: Operation, claimed: list[tuple[int, ObjectEntry, GroupMoves]]) -> None:
        """One WRITE per group number, in group order (spec section 6.8): group g of every
        claimed key goes before group g + 1 of any. Group 0 goes alone, so that it gets the
        whole bandwidth and lands first; after it ``GROUP_WINDOW`` groups are in flight, so
        that the link never waits for a loop turn between groups. A key whose group failed,
        or an aborted operation, submits no later group."""
        plan = op.plan
        assert plan is not None
        run = _GroupRun(claimed)
        for i, _, groups in claimed:
            plan.outstanding[i] = len(groups)
        self._pump(op, run)
        if run.deepest > 1 and run.next < run.deepest:
            # The later groups' descriptor lists once, not once per group (architecture §6),
            # while group 0 moves.
            entries: list[list[Move]] = []
            for i, _, groups in claimed:
                for g in range(1, len(groups)):
                    run.entries[(i, g)] = len(entries)
                    entries.append(groups[g])
            run.prepared = self.operations.prepare(op, entries)

    def _pump(self, op: Operation, run: _GroupRun) -> None:
        """Submit the next groups of ``run`` while fewer than its window are in flight."""
        plan = op.plan
        assert plan is not None
        while run.next < run.deepest and run.running < run.window():
            g = run.next
            run.next += 1
            members: list[tuple[int, ObjectEntry, list[Move]]] = []
            moves: list[Move] = []
            for i, entry, groups in run.claimed:
                if g >= len(groups) or i not in plan.outstanding:
                    continue
                if plan.ledger.failed(i) or op.aborted:
                    # An earlier group failed (or the client aborted): the later ones are never submitted.
                    self._finish_item(op, run, i, entry, len(groups) - g)
                    continue
                members.append((i, entry, groups[g]))
                moves.extend(groups[g])
            if members:
                run.running += 1
                # Checked before it is reported: then the group's notifications follow the
                # check instead of riding on the WRITE (spec sections 6.10 and 6.12).
                notifs = plan.payloads(g, [i for i, _, _ in members]) if self.digests is None else ()
                done = functools.partial(self.group_done, op, run, g, members, moves)
                prepared = None
                if run.prepared is not None and g > 0:
                    prepared = (run.prepared, [run.entries[(i, g)] for i, _, _ in members])
                self.operations.start(op, "WRITE", moves, done, notifs, prepared)
        if run.prepared is not None and run.running == 0 and run.next >= run.deepest:
            # Nothing of the run runs any more, and nothing is left to post.
            self.operations.transfers.release_prepared(run.prepared)
            run.prepared = None

    def group_done(
        self, op: Operation, run: _GroupRun, group: int, members: list[tuple[int, ObjectEntry, list[Move]]],
        moves: list[Move], ok: bool,
    ) -> None:
        """Group ``group``'s WRITE is terminal: its keys advance (or fail from it on); a key's
        claim drops and its result is set with its last transfer; the next group starts.
        A key lands only if the spans it sent still match their digests (spec 6.12)."""
        plan = op.plan
        assert plan is not None
        run.running -= 1
        run.first_done = True
        if ok:
            self._count_landed(op, moves)
        landed: list[int] = []
        for i, entry, sent in members:
            if ok and self.digests is not None and i not in run.changed and not self.digests.moves_intact(entry, sent):
                run.changed.add(i)
                self.digests.condemn(entry, Count.DELIVER_MISMATCHES)
            if ok and i not in run.changed:
                plan.land(i, group)
                landed.append(i)
            else:
                plan.fail(i, group)
            self._finish_item(op, run, i, entry, 1)
        if self.digests is not None and landed:
            self.operations.transfers.notify(op.agent or op.session.agent, plan.payloads(group, landed))
        self._pump(op, run)
        self.operations.note_progress(op)
        self.operations.settle(op)

    def _finish_item(self, op: Operation, run: _GroupRun, i: int, entry: ObjectEntry, transfers: int) -> None:
        plan = op.plan
        assert plan is not None
        plan.outstanding[i] -= transfers
        if plan.outstanding[i] > 0:
            return
        del plan.outstanding[i]
        ok = plan.delivered[i] == plan.groups[i]
        self.operations.unclaim(entry, accessed=ok)
        if op.aborted:
            op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted; the destination may have been written"))
        elif i in run.changed:
            op.fail(i, ErrorCode.DIGEST_MISMATCH, "the stored bytes changed since they were stored (the node dropped "
                    "the object); the destination holds them, and is not the key's")
        elif ok:
            op.set(i, KeyResult(KeyStatus.OK))
            self.operations.metrics.delivered_key(entry.info.need)
        else:
            where = f" from group {plan.delivered[i]} on" if plan.groups[i] > 1 else ""
            op.fail(i, ErrorCode.TRANSFER_FAILED, f"writing the destination failed{where}; it may be partly written")

    def _count_landed(self, op: Operation, moves: list[Move]) -> None:
        """A WRITE landed: its bytes per pool, and the first one's latency (a client's deliver)."""
        metrics = self.operations.metrics
        delivered = metrics.delivered_bytes
        for move in moves:
            delivered[move[0]] += move[3]
        if op.first_landing() and op.kind is OpKind.DELIVER:
            metrics.first_landed(op.received)

    # ------------------------------------------------------------------ moves

    def _projection(self, op: Operation, entry: ObjectEntry, requested: tuple[str, ...]) -> Projection:
        stored = tuple([name for name, _ in entry.layout])
        if op.exact and requested != stored:
            # A peer write without the partial-layout flag names the whole layout, exactly.
            raise ProtocolError(
                ErrorCode.LAYOUT_SUBSET_INVALID, "without the partial-layout flag the names must be the stored layout"
            )
        # Projection rule: "same names, same order: a full delivery" (no cache lookup, which
        # would hash both name tuples).
        return _FULL if requested == stored else self.projections.project(stored, requested)

    def record_moves(self, op: Operation, entry: ObjectEntry, item: DeliverItem, path: str) -> list[Move]:
        """Project a record item's destination onto the stored layout, check sizes and regions.

        Spans of one pool and one region are checked a column at a time; others, and
        every refusal, span by span, so that an error names its span.
        """
        spans = item.spans
        # Columns of the spans (names, regions, offsets, lengths): one C-level transpose.
        columns = tuple(zip(*spans, strict=True))
        projection = self._projection(op, entry, columns[0])
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

    def column_moves(self, op: Operation, entry: ObjectEntry, block: Block, row: int) -> GroupMoves:
        """Row ``row`` of a column block: projected, sizes and regions checked a column at a
        time, and its moves cut per group of the block's plan."""
        names = block.names
        n = len(names)
        projection = self._projection(op, entry, names)
        sizes = self.slot_sizes
        pools: Sequence[str] = entry.info.signature
        slots = np.frombuffer(entry.slot_view, dtype=np.uint32)
        if not projection.full:
            picked = np.array(projection.indices, dtype=np.intp)
            slots = slots[picked]
            pools = [pools[i] for i in projection.indices]
        lengths = block.lengths
        for j, pool in enumerate(pools):
            if lengths[j] != sizes[pool]:
                where = "" if isinstance(block.block.lengths, int) else f"[{j}]"
                raise ProtocolError(
                    ErrorCode.SIZE_MISMATCH, f"span {j} of {lengths[j]} bytes, the stored span holds {sizes[pool]}",
                    f"{block.path}.lengths{where}",
                )
        uniform = block.uniform(op.regions)
        one_pool = len(entry.info.need) == 1
        if uniform is not None and one_pool:
            region, offsets = uniform
            pool = pools[0]
            size = sizes[pool]
            mine = offsets[row * n : (row + 1) * n]
            if len(block.plan) == 1:
                return [run_moves(pool, size, region, mine, slots)]
            # A layer plan: many small groups, cut from plain lists.
            offset_list, slot_list = mine.tolist(), slots.tolist()
            return [
                list_moves(pool, size, region, [offset_list[j] for j in spans], [slot_list[j] for j in spans])
                for spans in block.plan
            ]
        extents = block.extents(op.regions)
        failure = extents.failures.get(row)
        if failure is not None:
            raise failure
        base = row * n
        addresses, regions = extents.addresses, extents.regions
        slot_list = slots.tolist()
        return [
            [(pools[j], slot_list[j], addresses[base + j], lengths[j], regions[base + j], 1) for j in spans]
            for spans in block.plan
        ]
