"""``fetch``: a handle claim on objects stored here, or pulled here from a hinted node first.

A key READY here is claimed at once (the claim is an LRU access, architecture §3); a key
a hint names gets WRITING slots in our pools that the source fills (``kvcr_node.target``);
fetch never projects: the expected layout must be the stored one.
"""

from __future__ import annotations

from kvcr_node.memory import PoolMemory
from kvcr_node.operations import Operations
from kvcr_node.records import Operation, OpKind, Session
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, Store
from kvcr_node.target import Target
from kvcr_protocol import ErrorCode, Fetch, FetchItem, KeyResult, KeyStatus


class Fetches:
    """The ``fetch`` handler."""

    def __init__(self, store: Store, memories: dict[str, PoolMemory], operations: Operations, target: Target) -> None:
        self.store = store
        self.memories = memories
        self.operations = operations
        self.target = target

    def on_fetch(self, session: Session, msg: Fetch) -> None:
        items = msg.items
        def resume(op: Operation, indices: list[int]) -> None:
            for i in indices:
                self.fetch_ready(op, i, items[i])

        op = self.operations.admit(session, msg.id, OpKind.FETCH, len(items), msg.deadline_ms, resume=resume)
        if op is None:
            return
        ready, remote = self.operations.sort_items(op, [item.key for item in items], msg.request_id)
        for i in ready:
            self.fetch_ready(op, i, items[i])
        for source, indices in remote.items():
            parents = msg.parents
            fills = [(i, fill) for i in indices
                     if (fill := self._begin_fill(op, i, items[i], parents[i] if parents else b"")) is not None]
            if fills:
                self.target.remote_fetch(op, source, fills)
        self.operations.settle(op)

    def fetch_ready(self, op: Operation, i: int, item: FetchItem) -> None:
        """Claim item ``i``'s key for a handle, if READY here with the expected layout."""
        entry = self.store.lookup(item.key)
        if entry is not None and entry.state is ObjectState.WRITING:
            self.operations.wait(op, item.key, i)  # written again since the wait began: wait for that writer
        elif entry is None or entry.state is not ObjectState.READY:
            op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
        elif tuple((s.name, s.pool) for s in item.layout) != entry.layout:
            # "fetch never projects": the expected layout must be the stored one.
            op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}].layout differs from the stored layout")
        else:
            self.store.claim(entry, accessed=True)  # architecture §3: a fetch claim is an LRU access
            op.set(i, KeyResult(KeyStatus.OK, handle=self.operations.new_handle(op.session, entry)))
        self.operations.settle(op)

    def _begin_fill(self, op: Operation, i: int, item: FetchItem, parent: bytes) -> ObjectEntry | None:
        """A WRITING entry for a fetch from a peer (whole layouts only: fetch never projects),
        with the parent the fetch names for it."""
        layout = tuple((s.name, s.pool) for s in item.layout)
        for j, (_, pool) in enumerate(layout):
            if pool not in self.memories:
                op.fail(i, ErrorCode.UNKNOWN_POOL, f"items[{i}].layout[{j}].pool: pool {pool!r} does not exist")
                return None
        outcome, entry = self.store.begin_deposit(item.key, layout, parent=parent)
        if outcome is DepositOutcome.NEW:
            return entry
        if outcome is DepositOutcome.CAPACITY:
            op.fail(i, ErrorCode.CAPACITY, f"items[{i}]: not enough free or evictable slots to fetch into")
        else:
            op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}]: cannot place the layout ({outcome.value})")
        return None
