"""Operations in progress and the handles they hand out.

An operation is one batch request with a result slot per item (spec section 5.1):
``admit`` makes it (or refuses the request: a repeated id, ``max_pending``), ``sort_items``
splits its keys into those READY here, those still WRITING here (the operation waits on
them, ``wait``/``wake``, bounded by its deadline) and those a hint sends to another node.
Its transfers start through ``start``; it settles once every item has a result and
nothing of it can touch memory any more, and ``settle`` then sends its results once.
Operation claims (counted here) and handle claims (the ``handles`` table) are the two
kinds of claims architecture §2 names.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence

from kvcr_io.agent import TransferError
from kvcr_node.agents import RemoteAgents
from kvcr_node.config import NodeConfig
from kvcr_node.metrics import Metrics
from kvcr_node.outbox import REASON_MAX, Outbox
from kvcr_node.records import Operation, OpKind, Outcomes, Plan, Report, Resume, Session
from kvcr_node.store import ObjectEntry, ObjectState, Store
from kvcr_node.transfers import Move, Prepared, Transfer, Transfers
from kvcr_protocol import (
    Completion,
    ErrorCode,
    KeyResult,
    KeyStatus,
    Progress,
    ProtocolError,
    Region,
    Release,
    session_rules,
)
from kvcr_protocol.columns import U32, pack
from kvcr_protocol.versions import COLUMNS_VERSION

log = logging.getLogger("kvcr.node")

Failure = Callable[[str, BaseException], None]
"""Counts and logs an unexpected failure (the node's ``internal_failure``)."""

Outcome = tuple[OpKind, KeyStatus, ErrorCode | None]
"""One kind of per-key result sent: the operation, the status, the code (None for 0)."""


def outcome_name(outcome: Outcome) -> str:
    """How ``stats`` names an outcome: ``deliver.OK``, ``fetch.FAILED.TIMEOUT``."""
    kind, status, code = outcome
    return f"{kind.value}.{status.value}" + (f".{code.name}" if code is not None else "")


class Operations:
    """Every operation in progress: admission, waits, deadlines, abort, settling; and handles."""

    def __init__(
        self, config: NodeConfig, store: Store, transfers: Transfers, agents: RemoteAgents, outbox: Outbox,
        clock: Callable[[], float], endpoint: str, failure: Failure, metrics: Metrics,
    ) -> None:
        self.config = config
        self.store = store
        self.transfers = transfers
        self.agents = agents
        self.outbox = outbox
        self.clock = clock
        self.endpoint = endpoint
        """This node's own endpoint: a hint naming it sends nothing anywhere."""
        self.failure = failure
        self.metrics = metrics
        """What the request path counts for the metrics exporter (latencies, bytes)."""
        self.waiters: dict[bytes, list[Operation]] = {}
        """WRITING key -> the operations waiting on it."""
        self.handles: dict[int, tuple[Session, ObjectEntry]] = {}
        self._next_handle = 1
        self.claims = 0
        """Claims held by operations in progress (the others are ``handles``)."""
        self.outcomes: collections.Counter[Outcome] = collections.Counter()
        """Per-key results sent, by operation, status and code (named at the edge: ``outcome_name``)."""
        self.progressing: dict[int, Operation] = {}
        """Operations whose groups advanced since the last ``progress`` went out (by ``id()``)."""
        self.promote: Callable[[bytes], bool] | None = None
        """Reads a key missing from the memory pools back from the disk tier, if it is there
        (``kvcr_node.tiering.Tiering.promote``): True when it is coming (``wake`` follows)."""

    # ------------------------------------------------------------------ admission

    def admit(
        self, session: Session, msg_id: int, kind: OpKind, n: int, deadline_ms: int, *, agent: str = "",
        regions: dict[int, Region] | None = None, exact: bool = False, plan: Plan | None = None,
        resume: Resume | None = None, report: Report | None = None,
    ) -> Operation | None:
        """A new operation of ``n`` items, whole (the fields ``Operation`` documents), or None
        after refusing the request. ``agent`` empty: the session's own."""
        conflict = session_rules.request_id_conflict(msg_id, session.ops)
        if conflict is not None:
            self.outbox.refuse(session, msg_id, conflict)
            return None
        if len(session.ops) >= self.config.max_pending:
            # Back-pressure: refuse rather than queue without bound.
            self.outbox.refuse(session, msg_id, ProtocolError(ErrorCode.BUSY, f"{len(session.ops)} operations in progress; retry later"))
            return None
        ms = deadline_ms or self.config.deadline_ms
        now = self.clock()
        op = Operation(
            session, msg_id, kind, now + ms / 1000, [None] * n, resume=resume, report=report, agent=agent,
            regions={} if regions is None else regions, exact=exact, plan=plan, received=now,
        )
        session.ops[msg_id] = op
        return op

    def outcome_counts(self) -> dict[str, int]:
        """``stats`` ``outcomes``: name -> keys, for each outcome sent."""
        return {outcome_name(outcome): n for outcome, n in self.outcomes.items()}

    @staticmethod
    def unique_keys(op: Outcomes, keys: Sequence[bytes]) -> list[bool]:
        """Which items carry a key not seen earlier in the batch (the others fail DUPLICATE_KEY)."""
        seen: set[bytes] = set()
        ok = []
        for i, key in enumerate(keys):
            if key in seen:
                op.fail(i, ErrorCode.DUPLICATE_KEY, f"items[{i}].key appears twice in this batch")
                ok.append(False)
            else:
                seen.add(key)
                ok.append(True)
        return ok

    def sort_items(
        self, op: Operation, keys: Sequence[bytes], request_id: str | None
    ) -> tuple[list[int], dict[str, list[int]]]:
        """Split a batch: keys READY here, and keys a hint sends to another node.

        The operation waits on keys still WRITING here, and on keys being read back from
        the disk tier (``promote``); keys neither here nor hinted
        fail NOT_FOUND, repeated keys DUPLICATE_KEY; keys that already failed stay out.
        A read back makes room by eviction, never of this batch's READY keys: they are held
        (claimed) while the read backs are placed, and the caller claims them for its transfer.
        """
        unique = self.unique_keys(op, keys)
        ready: list[int] = []
        held: list[ObjectEntry] = []
        missing: list[int] = []
        results = op.results
        for i, key in enumerate(keys):
            if not unique[i] or results[i] is not None:
                continue
            entry = self.store.lookup(key)
            if entry is None:
                missing.append(i)
            elif entry.state is ObjectState.WRITING:
                self.wait(op, key, i)
            else:
                ready.append(i)
                held.append(entry)
        remote: dict[str, list[int]] = {}
        if not missing:
            return ready, remote
        self.store.claim_all(held)
        try:
            for i in missing:
                key = keys[i]
                if self.promote is not None and self.promote(key):
                    self.wait(op, key, i)  # read back from the disk tier (architecture §9)
                    continue
                source = self.hinted_source(op.session, request_id, key)
                if source is None:
                    op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node"
                            + (" and no hint names a source" if request_id is not None else ""))
                else:
                    remote.setdefault(source, []).append(i)
        finally:
            self.store.unclaim_all(held, held_only=True)
        return ready, remote

    def hinted_source(self, session: Session, request_id: str | None, key: bytes) -> str | None:
        """The endpoint ``session``'s hint for a request names for ``key`` (never this node itself).

        Only the session's own hints count (spec section 5.2): another client's hint under
        the same request id can neither be seen nor steer this request.
        """
        if request_id is None:
            return None
        hint = session.hints.get(request_id)
        if hint is None or key not in hint[1] or hint[0] == self.endpoint:
            return None
        return hint[0]

    # ------------------------------------------------------------------ waiting on WRITING objects

    def wait(self, op: Operation, key: bytes, index: int) -> None:
        """Item ``index`` of ``op`` waits for the writer of ``key`` (architecture §2)."""
        op.waiting.setdefault(key, []).append(index)
        self.waiters.setdefault(key, []).append(op)

    def wake(self, key: bytes) -> None:
        """The writer of ``key`` is done (READY or gone): the items waiting on it go on."""
        self.wake_all((key,))

    def wake_all(self, keys: Sequence[bytes]) -> None:
        """The writers of ``keys`` are done: the items waiting on them go on, each operation's
        together (a deliver of many keys read back at once sends them as one)."""
        resumed: dict[int, tuple[Operation, list[int]]] = {}
        for key in keys:
            for op in self.waiters.pop(key, ()):
                resumed.setdefault(id(op), (op, []))[1].extend(op.waiting.pop(key, []))
        for op, indices in resumed.values():
            if op.resume is not None and indices:
                op.resume(op, indices)
            self.settle(op)

    def unwait(self, op: Operation, key: bytes) -> list[int]:
        """Stop ``op`` waiting on ``key``; returns the items that waited."""
        ops = self.waiters.get(key)
        if ops is not None:
            if op in ops:
                ops.remove(op)
            if not ops:
                del self.waiters[key]
        return op.waiting.pop(key, [])

    def abandon_fills(self, entries: Sequence[ObjectEntry]) -> None:
        """Free WRITING entries that no transfer fills after all, and wake their waiters."""
        for entry in entries:
            self.store.abandon(entry)
            self.wake(entry.key)

    # ------------------------------------------------------------------ deadlines, abort, settling

    def next_deadline(self) -> float | None:
        """The earliest deadline of an operation that waits (the others end with their transfers)."""
        deadlines = [op.deadline for ops in self.waiters.values() for op in ops]
        return min(deadlines) if deadlines else None

    def check_deadlines(self, now: float) -> None:
        """Fail the waits of operations whose deadline passed (TIMEOUT)."""
        if not self.waiters:
            return
        expired = {id(op): op for ops in self.waiters.values() for op in ops if op.deadline <= now}
        for op in expired.values():
            self.abort(op, ErrorCode.TIMEOUT, "the deadline passed while the object was still being written")

    def abort(self, op: Operation, code: ErrorCode = ErrorCode.ABORTED, reason: str = "aborted") -> None:
        """Best effort: items not yet moving end now; items in flight end when their transfer does."""
        op.aborted = code is ErrorCode.ABORTED or op.aborted
        for key in list(op.waiting):
            for i in self.unwait(op, key):
                if code is ErrorCode.ABORTED:
                    op.set(i, KeyResult(KeyStatus.ABORTED, code, reason))
                else:
                    op.fail(i, code, reason)
        self.settle(op)

    def break_op(self, op: Operation, reason: str) -> None:
        """Fail an operation whose handling failed: stop its waits, finish it once nothing of it runs."""
        op.broken = reason[:REASON_MAX]
        for key in list(op.waiting):
            self.unwait(op, key)
        self.settle(op)

    def count_outcomes(self, kind: OpKind, results: Sequence[KeyResult]) -> None:
        """Per-key results sent, in the outcome counts ``stats`` and the metrics show."""
        outcomes = self.outcomes
        for r in results:
            outcomes[(kind, r.status, ErrorCode(r.code) if r.code else None)] += 1

    def settle(self, op: Operation) -> None:
        """Once ``op`` is settled: forget it and send its results (once)."""
        if not op.settled or op.session.ops.get(op.id) is not op:
            return
        del op.session.ops[op.id]
        if self.agents.pending:
            self.agents.release_pending()
        if op.broken is not None:
            op.fail_unresolved(ErrorCode.INTERNAL)
        results = tuple(r for r in op.results if r is not None)
        self.outbox.settled(op.session, op.kind, op.id, results)
        self.count_outcomes(op.kind, results)
        self.metrics.request_done(op.kind, op.received)
        self.progressing.pop(id(op), None)  # the reply's done column says it all
        if op.report is not None:
            op.report(op, results)
        elif op.session.closing:
            # A closed session's handles from this op were never handed out: release them.
            for r in results:
                if r.handle is not None:
                    self.release_handle(op.session, r.handle)
        else:
            self.outbox.reply(op.session, Completion(op.id, results, op.done_column()))

    # ------------------------------------------------------------------ progress (spec section 6.8)

    def note_progress(self, op: Operation) -> None:
        """``op``'s groups advanced: a ``progress`` goes out at the end of the turn (one per turn).

        Not when the requester asked for notifications: each group's notification already
        told its agent, and the reply's ``done`` settles what a lost one left open (spec
        section 6.8 makes ``progress`` optional then). A control message per group would
        cost every hop a turn while the layers are still moving."""
        plan = op.plan
        if plan is not None and plan.progressed and plan.planned and plan.notify is None \
                and op.session.version >= COLUMNS_VERSION:
            self.progressing[id(op)] = op

    def flush_progress(self) -> None:
        """Send one ``progress`` per operation whose groups advanced this turn and that still runs."""
        if not self.progressing:
            return
        ops, self.progressing = self.progressing, {}
        for op in ops.values():
            plan = op.plan
            if plan is None or op.session.ops.get(op.id) is not op or op.session.closing:
                continue
            items = sorted(plan.progressed)
            plan.progressed.clear()
            self.outbox.reply(op.session, Progress(op.id, pack(items, U32), pack((plan.delivered[i] for i in items), U32)))

    def end_session(self, session: Session) -> None:
        """The session closed: abort what can be aborted, release its handle claims.

        Operations with a transfer in flight keep their claims until it is terminal.
        """
        for op in list(session.ops.values()):
            self.abort(op)
        for handle in list(session.handles):
            self.release_handle(session, handle)

    # ------------------------------------------------------------------ transfers and claims

    def prepare(self, op: Operation, entries: Sequence[Sequence[Move]]) -> Prepared | None:
        """Descriptor lists for transfers of ``op`` made of ``entries`` (``Transfers.prepare``),
        or None when NIXL refuses them (each transfer then prepares its own)."""
        try:
            return self.transfers.prepare(op.agent or op.session.agent, entries)
        except TransferError as exc:
            log.warning("descriptor lists refused for %s %d: %s", op.kind, op.id, exc)
            return None

    def start(
        self, op: Operation, kind: str, moves: list[Move], on_done: Callable[[bool], None], notifs: Sequence[bytes] = (),
        prepared: tuple[Prepared, Sequence[int]] | None = None,
    ) -> None:
        """Submit one NIXL transfer for ``op``; ``on_done`` runs when it is terminal (or refused).

        ``notifs`` reach the remote agent once the bytes are in place (spec section 6.10).
        ``prepared``: the moves are those entries of lists prepared for ``op`` (``prepare``)."""
        started: list[Transfer] = []

        def done(ok: bool) -> None:
            # A completion that raises breaks its operation only, never the loop.
            for transfer in started:
                op.transfers.pop(id(transfer), None)
            try:
                on_done(ok)
            except Exception as exc:
                self.failure(f"{op.kind} completion", exc)
                self.break_op(op, f"the node failed while completing {op.kind}: {type(exc).__name__}: {exc}")

        try:
            if prepared is None:
                transfer = self.transfers.start(kind, op.agent or op.session.agent, moves, done, notifs)
            else:
                transfer = self.transfers.start_prepared(kind, prepared[0], prepared[1], done, notifs)
        except TransferError as exc:
            log.warning("transfer refused for %s %d: %s", op.kind, op.id, exc)
            done(False)
            return
        except Exception as exc:
            self.failure(f"{op.kind} transfer", exc)
            done(False)
            return
        if transfer.running:
            started.append(transfer)
            op.transfers[id(transfer)] = transfer

    def claim(self, entry: ObjectEntry) -> None:
        """An operation claim: the object stays until the transfer that reads it is terminal."""
        self.store.claim(entry)
        self.claims += 1

    def unclaim(self, entry: ObjectEntry, accessed: bool) -> None:
        self.store.unclaim(entry, accessed=accessed)
        self.claims -= 1

    # ------------------------------------------------------------------ handles

    def new_handle(self, session: Session, entry: ObjectEntry) -> int:
        """A handle claim on ``entry`` for ``session`` (a fetch, a ``no_evict`` deposit)."""
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = (session, entry)
        session.handles.add(handle)
        return handle

    def release_handle(self, session: Session, handle: int) -> bool:
        held = self.handles.get(handle)
        if held is None or held[0] is not session:
            return False
        del self.handles[handle]
        session.handles.discard(handle)
        self.store.unclaim(held[1], accessed=False)
        return True

    def on_release(self, session: Session, msg: Release) -> None:
        results = []
        for i, handle in enumerate(msg.handles):
            if self.release_handle(session, handle):
                results.append(KeyResult(KeyStatus.OK))
            else:
                results.append(KeyResult(KeyStatus.FAILED, ErrorCode.UNKNOWN_HANDLE, f"handles[{i}] is not held by this client"))
        self.outbox.settled(session, "release", msg.id, results)
        self.outbox.reply(session, Completion(msg.id, tuple(results)))

    def check_invariants(self, lease_claims: int = 0) -> list[str]:
        """Claims match handles plus operation claims (plus ``lease_claims``, those leases
        hold); every handle is in its session."""
        breaches = []
        claims = self.store.stats()["claims"]
        if claims != len(self.handles) + self.claims + lease_claims:
            breaches.append(f"claims {claims} != handles {len(self.handles)} + operation claims {self.claims} "
                            f"+ lease claims {lease_claims}")
        for handle, (session, _) in self.handles.items():
            if handle not in session.handles:
                breaches.append(f"handle {handle} is not in its session")
        return breaches
