"""Per-group completion of one deliver, as a client sees it (spec sections 6.8 and 6.10).

A client learns that group g of item k landed from three sources: a NIXL notification
from the writer's agent, a ``progress`` event, or the final ``complete``. ``PlanProgress``
merges them by the spec's rules and says which groups changed state, so that a client can
wake whoever waits for a layer. It is a pure state machine: it takes decoded messages,
notifications and the time, and returns events; it reads no clock and touches no socket.

Rules it applies:

- a group is delivered once it and every earlier group of its item are known landed;
  counts only grow;
- a notification proves its group landed; notifications may come out of order;
- the final reply decides the rest: an ``OK`` item has every group delivered, any other
  status fails the groups from ``max(done, what was proved)`` on with the result's code
  (a reply that reports fewer groups than notifications proved is a disagreement: the
  proved groups stay delivered, and ``disagreements`` counts it);
- at the request's deadline, with no final reply, the groups not yet delivered fail
  ``TIMEOUT``; later messages change nothing for the caller (the memory stays
  registered until the reply, spec section 5.1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcr_protocol.errors import ErrorCode
from kvcr_protocol.messages import Completion, Progress
from kvcr_protocol.notify import Notification, NotifyKind
from kvcr_protocol.records import KeyResult, KeyStatus


class GroupState(enum.Enum):
    """Where one group of one item stands."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class GroupEvent:
    """Group ``group`` of item ``item`` reached ``state`` (``code`` says why it failed)."""

    item: int
    group: int
    state: GroupState
    code: int = 0


@dataclass(slots=True)
class _Item:
    groups: int
    delivered: int = 0
    failed_from: int | None = None
    code: int = 0
    proved: set[int] = field(default_factory=set)


class PlanProgress:
    """The groups of one deliver in flight: what landed, what failed, what still waits.

    ``groups`` is each item's group count (1 for an item without a plan), in the deliver's
    item order; ``token`` the deliver's ``!notify`` (0: none asked); ``deadline`` the time
    (in the caller's clock) after which the client stops waiting, or None.
    """

    def __init__(self, request: int, groups: Sequence[int], token: int = 0, deadline: float | None = None) -> None:
        if any(count < 1 for count in groups):
            raise ValueError("groups: every item has at least one group")
        self.request = request
        self.token = token
        self.deadline = deadline
        self._items = [_Item(count) for count in groups]
        self.finished = False
        """True once the final reply arrived or the deadline passed."""
        self.ignored = 0
        """Notifications and progress entries that matched nothing of this request."""
        self.disagreements = 0
        """Items whose final reply reported fewer groups than notifications proved."""

    def state(self, item: int, group: int) -> GroupState:
        entry = self._items[item]
        if not 0 <= group < entry.groups:
            raise IndexError(f"group {group} of item {item}, which has {entry.groups}")
        if group < entry.delivered:
            return GroupState.DELIVERED
        if entry.failed_from is not None and group >= entry.failed_from:
            return GroupState.FAILED
        return GroupState.PENDING

    def code(self, item: int) -> int:
        """Why ``item``'s groups from ``delivered(item)`` on failed (0 while none failed)."""
        return self._items[item].code

    def delivered(self, item: int) -> int:
        """How many groups of ``item``, from the first, are delivered."""
        return self._items[item].delivered

    def matches(self, note: Notification) -> bool:
        """Whether a notification belongs to this request (token and request id)."""
        return self.token != 0 and note.token == self.token and note.request == self.request

    def on_notification(self, note: Notification) -> list[GroupEvent]:
        """A decoded notification payload; events for the groups it delivered."""
        if self.finished or not self.matches(note) or note.kind is not NotifyKind.LANDED:
            self.ignored += 1
            return []
        if note.key + note.count > len(self._items) or any(note.group >= self._items[k].groups for k in note.keys):
            self.ignored += 1
            return []
        events: list[GroupEvent] = []
        for k in note.keys:
            entry = self._items[k]
            entry.proved.add(note.group)
            proved = entry.delivered
            while proved in entry.proved:
                proved += 1
            events += self._advance(k, proved)
        return events

    def on_progress(self, msg: Progress) -> list[GroupEvent]:
        """A ``progress`` event of this request; events for the groups it delivered."""
        if self.finished or msg.id != self.request:
            self.ignored += 1
            return []
        events: list[GroupEvent] = []
        for k, done in msg.pairs():
            if k >= len(self._items) or done > self._items[k].groups:
                self.ignored += 1
                continue
            events += self._advance(k, done)
        return events

    def on_landed(self, items: Sequence[int], count: int) -> list[GroupEvent]:
        """``items`` delivered their first ``count`` groups, learnt by the client itself (its
        own READs under a grant completed and passed the lease check: spec section 6.12);
        events for the groups this delivered."""
        if self.finished:
            self.ignored += 1
            return []
        events: list[GroupEvent] = []
        for k in items:
            if k >= len(self._items) or count > self._items[k].groups:
                self.ignored += 1
                continue
            events += self._advance(k, count)
        return events

    def on_reply(self, msg: Completion) -> list[GroupEvent]:
        """The request's ``complete``: every group's final state."""
        if msg.id != self.request:
            self.ignored += 1
            return []
        return self.on_results(msg.results, msg.done_counts() if len(msg.done) == 4 * len(msg.results) else ())

    def on_results(self, results: Sequence[KeyResult], done: Sequence[int] = ()) -> list[GroupEvent]:
        """The request is over, per item its result and (where given) how many groups it
        delivered in a row: every group's final state. The node's ``complete`` says it
        (``on_reply``); a client that READ the groups itself knows it (spec section 6.12)."""
        if self.finished:
            self.ignored += 1
            return []
        self.finished = True
        events: list[GroupEvent] = []
        for k, entry in enumerate(self._items):
            result = results[k] if k < len(results) else None
            if result is not None and result.status is KeyStatus.OK:
                events += self._advance(k, entry.groups)
                continue
            reported = done[k] if k < len(done) else 0
            if reported < entry.delivered:
                self.disagreements += 1
            events += self._advance(k, min(reported, entry.groups))
            code = result.code if result is not None and result.code else int(ErrorCode.TRANSFER_FAILED)
            events += self._fail(k, code)
        return events

    def expire(self, now: float) -> list[GroupEvent]:
        """At or past the deadline with no final reply: the waiting groups fail ``TIMEOUT``."""
        if self.finished or self.deadline is None or now < self.deadline:
            return []
        self.finished = True
        events: list[GroupEvent] = []
        for k in range(len(self._items)):
            events += self._fail(k, int(ErrorCode.TIMEOUT))
        return events

    def end(self, code: int) -> list[GroupEvent]:
        """The request ended without a reply the client will read (its own deadline passed,
        the session was lost, the request was refused): the groups not yet delivered fail
        with ``code``; those delivered stay delivered (their bytes are in place)."""
        if self.finished:
            return []
        self.finished = True
        events: list[GroupEvent] = []
        for k in range(len(self._items)):
            events += self._fail(k, code)
        return events

    def _advance(self, k: int, count: int) -> list[GroupEvent]:
        entry = self._items[k]
        start = entry.delivered
        if count <= start or entry.failed_from is not None:
            return []
        entry.delivered = count
        return [GroupEvent(k, g, GroupState.DELIVERED) for g in range(start, count)]

    def _fail(self, k: int, code: int) -> list[GroupEvent]:
        entry = self._items[k]
        if entry.failed_from is not None or entry.delivered >= entry.groups:
            return []
        entry.failed_from, entry.code = entry.delivered, code
        return [GroupEvent(k, g, GroupState.FAILED, code) for g in range(entry.delivered, entry.groups)]
