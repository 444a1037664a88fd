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

Its state is a ``GroupLedger``, the one ledger of a deliver's groups: the node keeps its
plans in one too, and a client that READs the groups itself under grants moves its
handle's ledger directly (``kvcr_client.reads``), ending with ``on_results``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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


class GroupLedger:
    """Where the groups of one deliver stand, per item and per group number (spec section 6.8).

    Per item: how many groups from the first are delivered, the groups landed beyond them
    (a later group may land first), and the group from which it failed, with why. Per group
    number: how many items still owe it, and the first failure of it, so that a group is over
    for the whole request when every item that has it delivered it, or one failed it.

    Rules: counts only grow; nothing at or past an item's failure is ever delivered; the
    first failure of an item stands (a later one only moves it earlier). The one ledger of
    a deliver's groups: the node's ``Plan``, the client's ``PlanProgress`` (and the handle
    fed by it) and a read under grants keep theirs in it.
    """

    __slots__ = ("codes", "delivered", "failed_from", "group_codes", "groups", "landed", "owed")

    def __init__(self, groups: Sequence[int]) -> None:
        if any(count < 1 for count in groups):
            raise ValueError("groups: every item has at least one group")
        self.groups = list(groups)
        """Groups per item (1 for an item without a plan)."""
        self.delivered = [0] * len(self.groups)
        """Per item: groups delivered in a row, from the first."""
        self.landed: dict[int, set[int]] = {}
        """Item -> groups landed beyond ``delivered``."""
        self.failed_from: dict[int, int] = {}
        """Item -> the first group it will not deliver."""
        self.codes: dict[int, int] = {}
        """Item -> why it failed (its first failure's code)."""
        most = max(self.groups, default=0)
        self.owed: list[int] = [len(self.groups)] * most
        """Per group number: items that have it and have not delivered it."""
        if min(self.groups, default=most) != most:  # items of fewer groups: count them out
            ending = [0] * (most + 1)
            for count in self.groups:
                ending[count] += 1
            left = len(self.groups)
            for g in range(most):
                left -= ending[g]
                self.owed[g] = left
        self.group_codes: dict[int, int] = {}
        """Group number -> the code of the first item that failed it."""

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def group_count(self) -> int:
        """The most groups any item has."""
        return len(self.owed)

    def failed(self, item: int) -> bool:
        return item in self.failed_from

    def code(self, item: int) -> int:
        """Why ``item`` failed (0 while it has not)."""
        return self.codes.get(item, 0)

    def state(self, item: int, group: int) -> GroupState:
        if not 0 <= group < self.groups[item]:
            raise IndexError(f"group {group} of item {item}, which has {self.groups[item]}")
        if group < self.delivered[item]:
            return GroupState.DELIVERED
        if group >= self.failed_from.get(item, self.groups[item]):
            return GroupState.FAILED
        return GroupState.PENDING

    def group_state(self, group: int) -> GroupState:
        """Where group ``group`` stands for the whole request."""
        if group in self.group_codes:
            return GroupState.FAILED
        return GroupState.DELIVERED if self.owed[group] == 0 else GroupState.PENDING

    def land(self, item: int, group: int) -> range:
        """Group ``group`` of ``item`` landed (perhaps before earlier ones): the groups this
        delivered, in order (empty when it only waits for an earlier one)."""
        delivered = self.delivered[item]
        if group >= self.failed_from.get(item, self.groups[item]) or group < delivered:
            return range(0)
        if group > delivered:
            self.landed.setdefault(item, set()).add(group)
            return range(0)
        count = group + 1  # in order, the usual case: no set unless a later group came first
        landed = self.landed.get(item)
        if landed:
            while count in landed:
                landed.discard(count)
                count += 1
            if not landed:
                del self.landed[item]
        return self._deliver(item, count)

    def advance(self, item: int, count: int) -> range:
        """Groups 0 .. ``count`` - 1 of ``item`` are known delivered: the groups this delivered."""
        count = min(count, self.failed_from.get(item, self.groups[item]))
        landed = self.landed.get(item)
        if landed:
            while count in landed:
                count += 1
        return self._deliver(item, count)

    def fail(self, item: int, code: int, group: int | None = None) -> range:
        """``item`` fails from ``group`` on (None: from the first group not delivered), with
        ``code`` if it is its first failure: the groups this failed (none after the first)."""
        start = self.delivered[item] if group is None else max(group, self.delivered[item])
        earlier = self.failed_from.get(item)
        self.landed.pop(item, None)
        if earlier is not None:
            self.failed_from[item] = min(earlier, start)
            return range(0)
        self.failed_from[item] = start
        self.codes[item] = code
        for g in range(start, self.groups[item]):
            self.group_codes.setdefault(g, code)
        return range(start, self.groups[item])

    def _deliver(self, item: int, count: int) -> range:
        start = self.delivered[item]
        if count <= start:
            return range(0)
        self.delivered[item] = count
        owed = self.owed
        for g in range(start, count):
            owed[g] -= 1
        return range(start, count)


class PlanProgress:
    """The groups of one deliver in flight: what landed, what failed, what still waits.

    ``groups`` is each item's group count (1 for an item without a plan), in the deliver's
    item order; ``token`` the deliver's ``!notify`` (0: none asked); ``deadline`` the time
    (in the caller's clock) after which the client stops waiting, or None. The state is a
    ``GroupLedger`` (``ledger``); this class applies the spec's rules of what moves it.
    """

    def __init__(self, request: int, groups: Sequence[int], token: int = 0, deadline: float | None = None) -> None:
        self.ledger = GroupLedger(groups)
        self.request = request
        self.token = token
        self.deadline = deadline
        self.finished = False
        """True once the final reply arrived or the deadline passed."""
        self.ignored = 0
        """Notifications and progress entries that matched nothing of this request."""
        self.disagreements = 0
        """Items whose final reply reported fewer groups than notifications proved."""

    def state(self, item: int, group: int) -> GroupState:
        return self.ledger.state(item, group)

    def code(self, item: int) -> int:
        """Why ``item``'s groups from ``delivered(item)`` on failed (0 while none failed)."""
        return self.ledger.code(item)

    def delivered(self, item: int) -> int:
        """How many groups of ``item``, from the first, are delivered."""
        return self.ledger.delivered[item]

    def matches(self, note: Notification) -> bool:
        """Whether a notification belongs to this request (token and request id)."""
        return self.token != 0 and note.token == self.token and note.request == self.request

    def on_notification(self, note: Notification) -> list[GroupEvent]:
        """A decoded notification payload; events for the groups it delivered."""
        ledger = self.ledger
        if self.finished or not self.matches(note) or note.kind is not NotifyKind.LANDED:
            self.ignored += 1
            return []
        if note.key + note.count > len(ledger) or any(note.group >= ledger.groups[k] for k in note.keys):
            self.ignored += 1
            return []
        events: list[GroupEvent] = []
        for k in note.keys:
            events += _delivered(k, ledger.land(k, note.group))
        return events

    def on_progress(self, msg: Progress) -> list[GroupEvent]:
        """A ``progress`` event of this request; events for the groups it delivered."""
        if self.finished or msg.id != self.request:
            self.ignored += 1
            return []
        return self._advance_all(msg.pairs())

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
        ledger = self.ledger
        events: list[GroupEvent] = []
        for k, count in enumerate(ledger.groups):
            result = results[k] if k < len(results) else None
            if result is not None and result.status is KeyStatus.OK:
                events += _delivered(k, ledger.advance(k, count))
                continue
            reported = done[k] if k < len(done) else 0
            if reported < ledger.delivered[k]:
                self.disagreements += 1
            events += _delivered(k, ledger.advance(k, min(reported, count)))
            code = result.code if result is not None and result.code else int(ErrorCode.TRANSFER_FAILED)
            events += _failed(k, ledger.fail(k, code), code)
        return events

    def expire(self, now: float) -> list[GroupEvent]:
        """At or past the deadline with no final reply: the waiting groups fail ``TIMEOUT``."""
        if self.finished or self.deadline is None or now < self.deadline:
            return []
        return self.end(int(ErrorCode.TIMEOUT))

    def end(self, code: int) -> list[GroupEvent]:
        """The request ended without a reply the client will read (its own deadline passed,
        the session was lost, the request was refused): the groups not yet delivered fail
        with ``code``; those delivered stay delivered (their bytes are in place)."""
        if self.finished:
            return []
        self.finished = True
        ledger = self.ledger
        events: list[GroupEvent] = []
        for k in range(len(ledger)):
            events += _failed(k, ledger.fail(k, code), code)
        return events

    def _advance_all(self, pairs: Iterable[tuple[int, int]]) -> list[GroupEvent]:
        ledger = self.ledger
        events: list[GroupEvent] = []
        for k, count in pairs:
            if k >= len(ledger) or count > ledger.groups[k]:
                self.ignored += 1
                continue
            events += _delivered(k, ledger.advance(k, count))
        return events


def _delivered(item: int, groups: range) -> list[GroupEvent]:
    return [GroupEvent(item, g, GroupState.DELIVERED) for g in groups]


def _failed(item: int, groups: range, code: int) -> list[GroupEvent]:
    return [GroupEvent(item, g, GroupState.FAILED, code) for g in groups]
