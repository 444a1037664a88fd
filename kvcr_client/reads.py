"""A deliver's READs under grants, run by the client core's turns (spec section 6.12).

``Grants.deliver`` posts group 0 in the caller's thread and hands the rest to a
``GrantRead``: whoever takes the core's turns (a waiting caller, an event loop's
background thread, ``poll``) posts the next groups in group order, as many as make
``TURN_READ_BYTES`` (at least one), and polls the READs posted so far from the client's
own agent, paced like memory-touching requests (architecture §4). So a caller computes on
group 0 while later groups are copied: NIXL's post releases the GIL, and on transports that
copy inside the post (CMA) a turn's groups are copied back to back. Each group that landed
and passed the lease check resolves on the handle; after the last, keys the clock cannot
vouch for wait for a ``renew``'s reply, sent with ``core.request``, which finishes the
deliver when it arrives: no turn ever blocks. The destination stays in use until every READ is terminal.

``Reads`` is the core's table of transfer jobs (I/O lock held throughout): these, and
puts (``kvcr_client.put_jobs.PutJob``), stepped by the same turns.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any, Protocol

from kvcr_client.counters import Count, Counters
from kvcr_client.errors import ClientClosed
from kvcr_client.leases import LeaseHandle
from kvcr_client.posted import CLOSE_DRAIN_S, Gate, Post, PostedTransfers
from kvcr_client.uncertain import Hold, extents
from kvcr_io.agent import Agent
from kvcr_protocol import DeliverItem, ErrorCode, GroupEvent, GroupLedger, GroupState, KeyResult, KeyStatus

TURN_READ_BYTES = 4 << 20
"""The bytes of groups one turn posts (at least one group, in order). Each turn costs its
reader a fixed price besides the copies (select, the lock, polls and reports: 100-150 us on
the 2-core development machine, against about 150 us to copy 1 MiB), so layers of 1 MiB
read one a turn took longer progressively than whole then computed on; four a turn halve
that gap (``bench/pipeline.py``, docs/performance.md). The bound keeps a turn short where
the copy runs inside the post (CMA): a group is reported, and the lock handed on, within
about 1 ms of copying. Where posts only start the transfer (RDMA), it is how far ahead of
the reports the READs run."""

Finished = Callable[[list[KeyResult] | BaseException, list[int]], None]
"""The deliver's outcome (lock held): per item its result and groups delivered in a row, or the error."""


class Granted(Protocol):
    """A key's grant (``GrantedKey``): the lease it is read under."""

    @property
    def lease(self) -> LeaseHandle: ...


class Validity(Protocol):
    """What a ``GrantRead`` asks of the grants (``Grants``, above the core: named by a
    protocol, so this part of the core never imports it): the lease checks."""

    counters: Counters

    def check(
        self, items: Sequence[DeliverItem], granted: Sequence[Any], members: list[int], now: float,
    ) -> dict[int, int | None]: ...
    def confirm(self, lease: LeaseHandle, now: float, then: Callable[[int], None]) -> None: ...
    def mismatch(self, granted: Any, key: bytes) -> None: ...


class Checks(Protocol):
    """The digests a deliver's groups are checked by once they landed
    (``kvcr_client.digest_checks.SpanChecks``, spec section 6.12, "Integrity")."""

    def count(self, k: int, g: int) -> int: ...
    def intact(self, k: int, g: int) -> bool: ...
    def failed(self, g: int, members: Sequence[int]) -> list[int]: ...


Ahead = Callable[[Callable[[], list[int]]], "Future[list[int]]"]
"""Runs a group's checks off the turn (the digest worker) while the next group is copied."""


class Phase(enum.Enum):
    READING = "reading"
    CONFIRMING = "confirming"
    """Every group is over; ``renew`` replies are awaited for keys the clock cannot vouch for."""
    OVER = "over"
    """The handle is resolved; READs past the deadline may still run (the destination stays in use)."""


class GrantRead:
    """One deliver's READs under grants: posted group by group, polled, checked, resolved."""

    def __init__(
        self, grants: Validity, agent: Agent, items: Sequence[DeliverItem], granted: Sequence[Granted],
        counts: list[int], posts: list[Post], codes: list[int], deadline: float,
        report: Callable[[list[GroupEvent]], None] | None, finished: Finished, quiet: Callable[[], None],
        clock: Callable[[], float] = time.monotonic, checks: Checks | None = None, ahead: Ahead | None = None,
        gate: Gate | None = None, ledger: GroupLedger | None = None, hold: Hold | None = None,
    ) -> None:
        self.grants = grants
        self.hold = hold
        """Holds destination spans a READ past the deadline may still write
        (``kvcr_client.uncertain``) until this job's READs are terminal."""
        self._held: list[Callable[[], None]] = []
        self.gate = gate
        self.checks = checks
        """Checks each item's group against the grant's digests once it landed and its lease
        held (spec section 6.12, "Integrity"); None: nothing to check."""
        self.ahead = ahead
        """When given, a group's checks run there as soon as its READs are seen complete, and
        the group is reported once they are done, or at once when nothing is left to post
        (the parts of a whole deliver: ``kvcr_client.digest_checks``); else in the turn
        that reports it."""
        self.checking: dict[int, Future[list[int]]] = {}
        """Groups whose checks were handed to ``ahead``: the members each found changed."""
        self.clock = clock
        """Read after this job's READs were polled: the instant its lease checks use."""
        self.agent = agent
        self.items = items
        self.granted = granted
        self.ledger = ledger if ledger is not None else GroupLedger(counts)
        """Per item: groups delivered (landed and checked) in a row, and why it failed; the
        deliver's handle reads the same one (``ledger``, of ``counts``)."""
        self.group_count = self.ledger.group_count
        self.transfers = PostedTransfers(agent, "READ", posts, self.group_count)
        """The READs, posted group by group and polled."""
        self.report = report
        """Takes the group events of each turn (the handle's ``apply``); None: nobody waits
        for groups (a whole deliver)."""
        self._events: list[GroupEvent] = []
        """What moved in the ledger since the last report."""
        if any(codes):
            for k, code in enumerate(codes):
                if code:
                    self._fail(k, code)
        self.deadline = deadline
        self.finished = finished
        self.quiet = quiet
        self.phase = Phase.READING
        self.group = 0
        """The next group to report."""
        self.expired = False
        self.held = False
        """The gate held the next post back to a later turn."""
        self._confirming = 0

    @property
    def remotes(self) -> set[str]:
        """The remote agents this deliver reads from (the node's, sources')."""
        return self.transfers.remotes

    @property
    def live(self) -> bool:
        """Whether the deliver is unresolved (its READs are paced)."""
        return self.phase is not Phase.OVER

    @property
    def posting(self) -> bool:
        """Whether groups are left to post now: the next turn should come at once."""
        return self.phase is Phase.READING and not self.expired and not self.held and self.transfers.left

    def post(self) -> bool:
        """Post every READ of the next group (one per pair of memory kinds); a READ NIXL
        refuses fails the keys it carries. False when the gate held the group back."""
        transfers = self.transfers
        if not transfers.left:
            transfers.post_group()  # nothing left: every group counts as posted
            return True
        group = transfers.next_group
        gate = self.gate
        self.held = gate is not None and gate(f"posting {group}") is False
        if self.held:
            return False
        for k in set(transfers.post_group()):
            self._fail(k, ErrorCode.TRANSFER_FAILED)
        self._check_ahead(group)
        if gate is not None:
            gate(f"posted {group}")
        return True

    def _check_ahead(self, g: int) -> None:
        """Hand group ``g``'s checks to ``ahead`` once its READs are all seen complete."""
        if self.ahead is None or self.checks is None or g in self.checking:
            return
        if not self.transfers.landed(g):
            return
        members = self._members(g)
        if g == self.group_count - 1:
            # The last part: nothing left to copy while it is hashed, and its bytes are in
            # this core's cache (the copy was this thread's post): checked here.
            done: Future[list[int]] = Future()
            done.set_result(self.checks.failed(g, members))
            self.checking[g] = done
            return
        self.checking[g] = self.ahead(functools.partial(self.checks.failed, g, members))

    def step(self, now: float, post: bool = True) -> bool:
        """One turn (lock held): post the next group, poll the READs, report the groups that
        ended; True once the deliver is over and no READ runs (the table drops it).

        ``now`` (read before this turn's posts, shared by every job of the turn) decides only
        the deadline. A group's lease check uses the clock read after its READs were seen
        complete (spec section 6.12, Validity): a post may be the copy itself (CMA), and
        another job's copy or a stalled thread may come between ``now`` and the poll; a
        lease checked at ``now`` could have ended, and its slot been refilled, before the
        bytes were read."""
        if self.phase is Phase.READING:
            if now >= self.deadline:
                self.expired = True
            else:
                # Groups up to TURN_READ_BYTES a turn; the parts of a whole deliver all in one
                # (each part is hashed on the worker while the next is copied: nothing else
                # to wait for).
                budget = TURN_READ_BYTES
                while post and self.transfers.left:
                    if self.ahead is None:  # a whole deliver's parts go regardless of bytes
                        budget -= self.transfers.next_bytes()
                    if not self.post():
                        break
                    post = self.ahead is not None or budget > 0
        transfers = self.transfers
        if transfers.running:
            transfers.poll()
            for g in range(self.group, transfers.posted):
                self._check_ahead(g)
        running = bool(transfers.running)
        if self.phase is Phase.READING:
            seen = self.clock()
            while self.group < self.group_count and self._report(self.group, seen):
                self.group += 1
            if self.group >= self.group_count:
                self._confirm(seen)
        self._flush()
        if self.phase is Phase.OVER and not running:
            self._release()
            return True
        return False

    def _report(self, g: int, seen: float) -> bool:
        """Report group ``g`` if it is over (landed, failed, or past the deadline); its leases
        are checked at ``seen``, a time after its READs were seen terminal."""
        transfers = self.transfers
        over = transfers.over(g)
        if not over and not self.expired:
            return False
        ledger = self.ledger
        members = self._members(g)
        if not over:
            # Past the deadline: a READ still running may write the destination; a group
            # never posted writes nothing.
            code = ErrorCode.DESTINATION_UNCERTAIN if transfers.posted > g else ErrorCode.TIMEOUT
            if code == ErrorCode.DESTINATION_UNCERTAIN and self.hold is not None and members:
                items = self.items
                self._held.append(self.hold(extents(items[k] for k in members)))
            for k in members:
                self._fail(k, code)
            return True
        if not transfers.landed(g):
            for k in members:
                self._fail(k, ErrorCode.TRANSFER_FAILED)
            return True
        failed: list[int] | None = None
        if g in self.checking:
            future = self.checking[g]
            if not future.done() and self.posting:
                return False  # hashed on the worker while the next group is copied
            failed = future.result()
        verdicts = self.grants.check(self.items, self.granted, members, seen)
        for k in members:
            verdict = verdicts[k]
            if verdict is None:
                continue  # only a confirmation can tell: the check after the last group
            if verdict:
                self._fail(k, verdict)
                self.grants.counters.inc(Count.GRANT_REFUSED)
            elif not self._intact(k, g, g + 1, failed):
                continue
            elif ledger.delivered[k] == g:  # an earlier group only a confirmation can vouch for stops it
                self._advance(k, g + 1)
        return True

    def _advance(self, k: int, count: int) -> None:
        delivered = self.ledger.advance(k, count)
        if self.report is not None:
            self._events += [GroupEvent(k, g, GroupState.DELIVERED) for g in delivered]

    def _fail(self, k: int, code: int) -> None:
        failed = self.ledger.fail(k, code)
        if self.report is not None:
            self._events += [GroupEvent(k, g, GroupState.FAILED, code) for g in failed]

    def _flush(self) -> None:
        """Report what moved in the ledger (lock held)."""
        if self._events and self.report is not None:
            events, self._events = self._events, []
            self.report(events)

    def _members(self, g: int) -> list[int]:
        """The items that have group ``g`` and have not failed."""
        ledger = self.ledger
        return [k for k, count in enumerate(ledger.groups) if count > g and not ledger.failed(k)]

    def _confirm(self, seen: float) -> None:
        """Every group is over (seen so at ``seen``): keys whose READs all landed but whose lease
        the clock alone could not vouch for are confirmed with one ``renew`` per lease; the
        last reply finishes."""
        self.phase = Phase.CONFIRMING
        ledger = self.ledger
        unsure = [k for k in range(len(ledger)) if not ledger.failed(k) and ledger.delivered[k] < ledger.groups[k]]
        verdicts = self.grants.check(self.items, self.granted, unsure, seen)
        leases: dict[int, list[int]] = {}
        for k in unsure:
            verdict = verdicts[k]
            if verdict is None:
                leases.setdefault(id(self.granted[k].lease), []).append(k)
            else:
                self._verdict([k], verdict)
        self._confirming = len(leases)
        if not leases:
            self._finish()
        for members in leases.values():
            lease = self.granted[members[0]].lease
            self.grants.confirm(lease, seen, functools.partial(self._confirmed, members))

    def _confirmed(self, members: list[int], code: int) -> None:
        """A ``renew``'s reply (or its failure) for the lease of ``members`` (lock held)."""
        if self.phase is not Phase.CONFIRMING:
            return  # closed meanwhile
        self._verdict(members, code)
        self._confirming -= 1
        if not self._confirming:
            self._finish()

    def _verdict(self, members: list[int], code: int) -> None:
        for k in members:
            if code == 0 and self.granted[k].lease.lost_key(self.items[k].key):
                code = ErrorCode.LEASE_LOST
            if code:
                self._fail(k, code)
                self.grants.counters.inc(Count.GRANT_REFUSED)
            elif self._intact(k, self.ledger.delivered[k], self.ledger.groups[k]):
                self._advance(k, self.ledger.groups[k])

    def _intact(self, k: int, first: int, end: int, failed: list[int] | None = None) -> bool:
        """Whether groups ``first`` to ``end - 1`` of item ``k``, landed under a lease that
        held, match the grant's digests (``failed``: group ``first``'s members found changed
        on the worker); else the key fails ``DIGEST_MISMATCH``."""
        checks = self.checks
        if checks is None:
            return True
        self.grants.counters.inc(Count.SPANS_CHECKED, sum(checks.count(k, g) for g in range(first, end)))
        if k not in failed if failed is not None else all(checks.intact(k, g) for g in range(first, end)):
            return True
        self._fail(k, ErrorCode.DIGEST_MISMATCH)
        self.grants.mismatch(self.granted[k], self.items[k].key)
        return False

    def _finish(self) -> None:
        self.phase = Phase.OVER
        ledger = self.ledger
        results = [
            KeyResult(KeyStatus.OK) if not ledger.failed(k) and done == ledger.groups[k] else KeyResult(
                KeyStatus.FAILED, int(ledger.code(k) or ErrorCode.LEASE_LOST),
                REASONS.get(ledger.code(k), "the read under the grant failed"))
            for k, done in enumerate(ledger.delivered)
        ]
        self._flush()
        self.finished(results, ledger.delivered)

    def _release(self) -> None:
        if self.checking:  # a check still reading the destination holds it too
            wait(self.checking.values(), CLOSE_DRAIN_S)
            self.checking.clear()
        self.transfers.release()
        for let_go in self._held:  # no READ of this job runs: its destination is certain again
            let_go()
        self._held.clear()
        self.quiet()

    def close(self) -> None:
        """The client closes (lock held): nothing more is posted, READs still running are
        waited for (bounded), then let go; an unresolved deliver fails ``ClientClosed``."""
        resolved = self.phase is Phase.OVER
        self.phase = Phase.OVER
        self.transfers.drain()
        self._release()
        if not resolved:
            self.finished(ClientClosed("the client is closed"), self.ledger.delivered)


class Job(Protocol):
    """A transfer the core's turns run: a deliver under grants (``GrantRead``) or a put
    (``kvcr_client.put_jobs.PutJob``)."""

    @property
    def posting(self) -> bool: ...
    @property
    def live(self) -> bool: ...
    @property
    def remotes(self) -> set[str]: ...
    def step(self, now: float) -> bool: ...
    def close(self) -> None: ...


class Reads:
    """The core's transfers in progress, delivers under grants and puts (I/O lock held).

    ``paced`` is called when a job's transfers start to run outside the caller's own turn
    (a put's WRITEs posted where its reply was read): whoever reads must progress the agent
    at the pacing interval from then on."""

    def __init__(self, paced: Callable[[], None] = lambda: None) -> None:
        self.running: list[Job] = []
        self.paced = paced

    def __len__(self) -> int:
        return len(self.running)

    @property
    def posting(self) -> bool:
        return any(job.posting for job in self.running)

    def remotes(self) -> set[str]:
        """The remote agents that a job's transfers still use (not to be removed yet)."""
        return {remote for job in self.running for remote in job.remotes}

    @property
    def live(self) -> bool:
        """Whether a deliver is unresolved (its READs are paced); READs left running past a
        deadline are only looked at at the late interval."""
        return any(job.live for job in self.running)

    def take(self, job: Job) -> None:
        """Take ``job``: step it once now (a reply may already be in)."""
        if not job.step(time.monotonic()):
            self.running.append(job)
            if job.live:
                self.paced()

    def nudge(self, job: Job) -> None:
        """Step ``job`` now, outside the turns' order (its reply just came in)."""
        if job not in self.running:
            return
        live = job.live
        if job.step(time.monotonic()):
            self.running.remove(job)
        elif job.live and not live:
            self.paced()

    def start(self, job: GrantRead) -> bool:
        """Post ``job``'s group 0 and take it, looking at it once without posting more (one
        turn: group 0, landed, is reported at once); whether it still runs."""
        job.post()
        if job.step(job.clock(), post=False):
            return False
        self.running.append(job)
        return True

    def step(self, now: float) -> None:
        paced = False
        for job in list(self.running):
            live = job.live
            if job.step(now):
                self.running.remove(job)
            elif job.live and not live:
                paced = True
        if paced:
            self.paced()

    def close(self) -> None:
        running, self.running = self.running, []
        for job in running:
            job.close()


REASONS: dict[int, str] = {
    ErrorCode.LEASE_EXPIRED: "the lease may have expired during the read: its bytes are not the key's",
    ErrorCode.LEASE_LOST: "the lease may have ended during the read: its bytes are not the key's",
    ErrorCode.LAYOUT_SUBSET_INVALID: "the span names are neither the stored layout nor a valid ordered subset",
    ErrorCode.SIZE_MISMATCH: "a span length differs from the slot size of its pool",
    ErrorCode.TRANSFER_FAILED: "NIXL failed the READ",
    ErrorCode.DESTINATION_UNCERTAIN: "the READ did not complete in time; it may still write the destination",
    ErrorCode.TIMEOUT: "the deadline passed before the READ was posted",
    ErrorCode.DIGEST_MISMATCH: "the bytes read differ from the digest the node took when the object was stored: "
                               "its slot was overwritten, they are not the key's",
}
