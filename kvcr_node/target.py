"""The target side of a remote deliver or fetch (spec section 12), above ``kvcr_node.links``.

Keys a session's hint sends to another node become writes on the link to that source:
a deliver's straight into the client's memory, a fetch's into WRITING slots of our own
pools. ``Links`` reports how each write ended (``LinkOwner``); here that becomes the
operation's results, the fill committed or abandoned, and handles. A client's
``unregions`` that a write not yet over may still reach is held here until no write can
(``DESTINATION_UNCERTAIN``, spec section 12).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcr_io.agent import TransferError
from kvcr_node.agents import RemoteAgents
from kvcr_node.counters import Count, Counters
from kvcr_node.lease_requests import LinkError
from kvcr_node.links import Links
from kvcr_node.memory import PoolMemory
from kvcr_node.operations import Failure, Operations
from kvcr_node.outbox import REASON_MAX, Outbox
from kvcr_node.peers import RemoteWrite, WriteStage
from kvcr_node.records import Operation, Plan, Session, Withdrawal
from kvcr_node.reservations import Reservations, write_extents
from kvcr_node.store import ObjectEntry, Store
from kvcr_node.wanted import Wanted
from kvcr_protocol import (
    Ack,
    DeliverItem,
    DstSpan,
    ErrorCode,
    KeyResult,
    KeyStatus,
    Progress,
    ProtocolError,
    Region,
    WriteNotify,
)
from kvcr_protocol.columns import U32, pack
from kvcr_protocol.operations import allowed_result
from kvcr_protocol.versions import COLUMNS_VERSION


def from_source(result: KeyResult) -> KeyResult:
    """A source's per-key result as passed on: what a source does not send becomes a failed
    transfer (spec section 5.3), so no peer can give a client a status or code out of place."""
    if result.status is KeyStatus.OK and result.code == 0:
        return KeyResult(KeyStatus.OK)
    if result.status in (KeyStatus.FAILED, KeyStatus.ABORTED) and allowed_result("write", result.code) and result.code:
        return KeyResult(result.status, result.code, result.reason)
    return KeyResult(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED,
                     f"the source answered {result.status.value} with code {result.code}: {result.reason}"[:REASON_MAX])


class Target:
    """Remote writes on behalf of our operations, and the ``unregions`` they hold (a ``LinkOwner``).

    ``links`` is handed in (the node makes it, and makes this its owner): all the socket
    work is there, so a test can drive this with a fake."""

    def __init__(
        self, links: Links, agents: RemoteAgents, store: Store, memories: dict[str, PoolMemory],
        operations: Operations, outbox: Outbox, counters: Counters, agent_name: str, failure: Failure,
        reservations: Reservations,
    ) -> None:
        self.reservations = reservations
        """Client memory an uncertain write may still reach, by agent: reserved here from the
        write's deadline to its end; ``deliver``, ``deposit`` and ``put`` refuse it."""
        self.store = store
        self.memories = memories
        self.pool_index = {name: i for i, name in enumerate(memories)}
        """Pool name -> its region id in our ``peer_hello`` (pools in welcome order)."""
        self.operations = operations
        self.outbox = outbox
        self.counters = counters
        self.agent_name = agent_name
        self.failure = failure
        self.agents = agents
        self.links = links
        self.withdrawing: dict[bytes, Session] = {}
        """Sessions with an ``unregions`` whose ack is held, by identity."""

    # ------------------------------------------------------------------ writes

    def remote_write(
        self, op: Operation, source: str, indices: list[int], wanted: Wanted, client: Session, partial: bool,
    ) -> None:
        """Ask ``source`` to write objects straight into the client's memory (spec section 12).

        Column blocks go on as the rows of the forwarded keys, with their plans, and with
        the client's notification token when it asked for one (spec section 6.10)."""
        for i in indices:
            problem = wanted.descriptor_problem(i, client.regions)
            if problem is not None:
                op.fail(i, problem.code, f"{problem.path}: {problem.reason}")
        keep = [i for i in indices if op.results[i] is None]
        if keep:
            try:
                link = self.links.open(source)
            except LinkError as exc:
                for i in keep:
                    op.fail(i, exc.code, exc.reason)
                keep = []
        if not keep:
            self.operations.settle(op)
            return
        items, columns = wanted.forward(keep)
        plan = op.plan
        notify = None
        if plan is not None and plan.notify is not None:
            token, request, _ = plan.notify
            notify = WriteNotify(token, request, pack((plan.client_index(i) for i in keep), U32))
        write = self.links.new_write(
            op, link, keep, items, client.agent, client, partial, columns=columns, notify=notify,
            regions=frozenset(rid for i in keep for rid in wanted.region_ids(i)))
        op.remote_sent()
        self.links.submit(write)

    def remote_fetch(self, op: Operation, source: str, fills: list[tuple[int, ObjectEntry]]) -> None:
        """Ask ``source`` to write whole objects into our WRITING slots.

        Until the write exists nothing can touch those slots: if the link cannot be opened
        (or anything fails before), they are freed and the keys fail.
        """
        try:
            link = self.links.open(source)
            items = []
            for _, entry in fills:
                spans = []
                for (name, pool), slot in zip(entry.layout, entry.slots, strict=True):
                    size = self.memories[pool].spec.slot_size
                    spans.append(DstSpan(name, self.pool_index[pool], slot * size, size))
                items.append(DeliverItem(entry.key, tuple(spans)))
        except LinkError as exc:
            self.operations.abandon_fills([entry for _, entry in fills])
            for i, _ in fills:
                op.fail(i, exc.code, exc.reason)
            return
        except BaseException:
            self.operations.abandon_fills([entry for _, entry in fills])
            raise
        write = self.links.new_write(op, link, [i for i, _ in fills], tuple(items), self.agent_name, None, False,
                                     fills=[entry for _, entry in fills])
        op.remote_sent()
        self.links.submit(write)

    # ------------------------------------------------------------------ what the links report (LinkOwner)

    def write_over(
        self, write: RemoteWrite, code: ErrorCode | None, reason: str, results: Sequence[KeyResult], was_uncertain: bool
    ) -> None:
        """A write is over: no transfer of it can touch the destination any more."""
        if self.withdrawing and write.client is not None:
            self.release_withdrawals()  # a held unregions may wait on this write (spec section 12)
        op = write.op
        operations = self.operations
        if was_uncertain:
            self.counters.inc(Count.UNCERTAIN_RESOLVED)
            if write.client is not None:
                self.reservations.end(write.agent, write.id)
            for entry in write.fills or ():
                self.store.abandon(entry)
                operations.wake(entry.key)
            return
        op.remote_answered()
        plan = op.plan
        for n, i in enumerate(write.indices):
            result = from_source(results[n]) if n < len(results) else None
            if plan is not None and result is not None:
                if result.status is KeyStatus.OK:
                    self._all_groups_landed(write, plan, i)
                elif n < len(write.done):
                    plan.advance(i, write.done[n])
            if write.fills is not None:
                entry = write.fills[n]
                if result is not None and result.status is KeyStatus.OK and not op.aborted:
                    self.store.commit(entry, claim=not op.session.closing)
                    if not op.session.closing:
                        op.set(i, KeyResult(KeyStatus.OK, handle=operations.new_handle(op.session, entry)))
                else:
                    self.store.abandon(entry)
                operations.wake(entry.key)
            if op.aborted:
                op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted"))
            elif result is not None:
                op.set(i, result)
            else:
                op.fail(i, code or ErrorCode.TRANSFER_FAILED, reason)
        operations.settle(op)

    def _all_groups_landed(self, write: RemoteWrite, plan: Plan, i: int) -> None:
        """A key's write ended OK: every group landed. A source below version 3 sent no
        notification, so this node sends the client the payloads itself (spec section 7)."""
        plan.advance(i, plan.groups[i])
        if plan.notify is not None and write.link.version < COLUMNS_VERSION and write.client is not None:
            for g in range(plan.groups[i]):
                for payload in plan.payloads(g, [i]):
                    try:
                        self.agents.agent.notify(write.client.agent, payload)
                    except TransferError:
                        self.counters.inc(Count.NOTIFY_FAILED)
                    else:
                        self.counters.inc(Count.NOTIFIED_FOR_SOURCE)

    def write_progress(self, write: RemoteWrite, msg: Progress) -> None:
        """A version-3 source reports groups delivered (spec section 6.8): pass them on under the client's item indices."""
        plan = write.op.plan
        if plan is None or write.state is WriteStage.DONE:
            return
        for n, done in msg.pairs():
            if n < len(write.indices):
                plan.advance(write.indices[n], done)
        self.operations.note_progress(write.op)

    def write_uncertain(self, write: RemoteWrite) -> None:
        """The deadline passed with the write unanswered: fail the items, keep the memory."""
        op = write.op
        if write.client is not None:
            self.reservations.reserve(write.agent, write.id, write_extents(write.items, write.columns))
        op.remote_answered()
        for i in write.indices:
            op.fail(i, ErrorCode.DESTINATION_UNCERTAIN,
                    f"the deadline passed; the source {write.link.endpoint} may still write the destination until it confirms")
        self.operations.settle(op)

    def internal_failure(self, what: str, exc: BaseException) -> None:
        self.failure(what, exc)

    # ------------------------------------------------------------------ withdrawals (spec section 12)

    def regions_reserved(self, session: Session, regions: Sequence[int]) -> bool:
        """Whether a remote write that is not over may still write into one of the client's ``regions``."""
        wanted = set(regions)
        for link in self.links:
            for write in (*link.writes.values(), *link.queued):
                if write.client is None or write.agent != session.agent or write.state is WriteStage.DONE:
                    continue
                if write.regions & wanted:
                    return True
        return False

    def hold(self, session: Session, request_id: int, regions: Sequence[int], records: dict[int, Region]) -> bool:
        """Hold the ack of an ``unregions`` while a write may still reach its regions; False if none can."""
        if not self.regions_reserved(session, regions):
            return False
        # The regions take no new work meanwhile (the caller withdrew them already).
        session.withdrawals[request_id] = Withdrawal(tuple(regions), records)
        self.withdrawing[session.identity] = session
        self.counters.inc(Count.UNREGIONS_HELD)
        return True

    def release_withdrawals(self) -> None:
        """Acknowledge every held ``unregions`` whose regions no write can reach any more."""
        for identity, session in list(self.withdrawing.items()):
            for request_id, withdrawal in list(session.withdrawals.items()):
                if not self.regions_reserved(session, withdrawal.regions):
                    del session.withdrawals[request_id]
                    self.outbox.reply(session, Ack(request_id))
            if not session.withdrawals:
                del self.withdrawing[identity]

    def cancel_withdrawal(self, session: Session, request_id: int) -> None:
        """The client aborted a held ``unregions``: its regions are announced again, and the
        request is refused whole (``error`` ABORTED: nothing of it was done)."""
        withdrawal = session.withdrawals.pop(request_id)
        if not session.withdrawals:
            self.withdrawing.pop(session.identity, None)
        for rid, region in withdrawal.records.items():
            session.regions.setdefault(rid, region)
        session.regions_version += 1
        self.outbox.refuse(session, request_id, ProtocolError(
            ErrorCode.ABORTED, "aborted: the regions stay announced; the client must keep them registered"), "unregions")

    def drop_withdrawals(self, session: Session) -> None:
        """The session ended: its held ``unregions`` end unanswered."""
        session.withdrawals.clear()
        if self.withdrawing.get(session.identity) is session:
            del self.withdrawing[session.identity]
