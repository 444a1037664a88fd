"""The ``suspect`` handler (spec section 6.12, "Integrity"): a reader reports keys whose
bytes did not match their digests, and the node reads each object itself.

A reader's word alone drops nothing: the node takes the digests of the object's spans
again (``Digests.intact``) and condemns it only when they differ. Reading costs the node's
loop about 40 µs per MiB, so what it reads for reports is bounded twice: node-wide by
``suspect_bytes_per_s`` (the loop's cost), and per session by a quarter of that (so one
client's flood cannot spend every other reader's budget). A key past either budget is
answered ``BUSY`` with nothing read; the budgets refill continuously, at most a second's
worth banked (an object larger than that is checked on a full budget, which it overdraws).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcr_node.buckets import TokenBucket
from kvcr_node.counters import Count, Counters
from kvcr_node.digests import Digests
from kvcr_node.objects import ObjectEntry, ObjectState
from kvcr_node.outbox import Outbox
from kvcr_node.records import Session
from kvcr_node.store import Store
from kvcr_protocol import Completion, ErrorCode, KeyResult, KeyStatus, Suspect

BANKED_S = 1.0
"""How many seconds of a budget may be saved up unused."""
SESSION_SHARE = 0.25
"""The share of ``suspect_bytes_per_s`` one session's reports may use."""


class Suspects:
    """Serves ``suspect``: checks the reported objects within the read budgets, condemns
    those that changed, and answers a result per key."""

    def __init__(self, store: Store, digests: Digests, outbox: Outbox, counters: Counters,
                 clock: Callable[[], float], bytes_per_s: int, slot_sizes: dict[str, int]) -> None:
        self.store = store
        self.digests = digests
        self.outbox = outbox
        self.counters = counters
        self.clock = clock
        self.slot_sizes = slot_sizes
        self.node = TokenBucket(bytes_per_s, bytes_per_s * BANKED_S, clock)
        self.session_rate = bytes_per_s * SESSION_SHARE

    def on_suspect(self, session: Session, msg: Suspect) -> None:
        mine = session.suspect_budget
        if mine is None:
            mine = session.suspect_budget = TokenBucket(self.session_rate, self.session_rate * BANKED_S, self.clock)
        answered: dict[bytes, KeyResult] = {}
        results = []
        for i, key in enumerate(msg.keys):
            result = answered.get(key)
            if result is None:
                result = answered[key] = self._check(key, f"keys[{i}]", mine)
            results.append(result)
        self.outbox.settled(session, "suspect", msg.id, results)
        self.outbox.reply(session, Completion(msg.id, tuple(results)))

    def _check(self, key: bytes, path: str, mine: TokenBucket) -> KeyResult:
        self.counters.inc(Count.SUSPECTS)
        entry = self.store.lookup(key)
        if entry is None or entry.state is not ObjectState.READY:
            return KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, f"{path} is not stored on this node")
        cost = self._bytes(entry)
        if not (mine.affords(cost) and self.node.affords(cost)):
            self.counters.inc(Count.SUSPECTS_REFUSED)
            return KeyResult(KeyStatus.FAILED, ErrorCode.BUSY,
                             f"{path}: the node's budget for checking reported objects is spent; report it again later")
        mine.spend(cost)
        self.node.spend(cost)
        if self.digests.intact(entry):
            self.counters.inc(Count.SUSPECTS_UNFOUNDED)
            return KeyResult(KeyStatus.OK)
        self.digests.condemn(entry, Count.SUSPECTS_CONFIRMED)
        return KeyResult(KeyStatus.FAILED, ErrorCode.DIGEST_MISMATCH,
                         f"{path}: its bytes no longer match their digests; the node dropped it")

    def _bytes(self, entry: ObjectEntry) -> int:
        sizes = self.slot_sizes
        return sum(count * sizes[pool] for pool, count in entry.info.need)
