"""A client's per-group completion (spec sections 6.8 and 6.10), as a pure state machine."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import kvcr_protocol as kp
from kvcr_protocol import (
    Completion,
    ErrorCode,
    GroupEvent,
    GroupState,
    KeyResult,
    KeyStatus,
    Notification,
    PlanProgress,
    Progress,
)
from kvcr_protocol.columns import U32, pack

TOKEN, REQUEST = 0x5EED0001, 34
OK = KeyResult(KeyStatus.OK)
DELIVERED, FAILED, PENDING = GroupState.DELIVERED, GroupState.FAILED, GroupState.PENDING


def note(key: int, group: int, count: int = 1, token: int = TOKEN, request: int = REQUEST) -> Notification:
    return Notification(token, request, key, group, count)


def progress(*pairs: tuple[int, int]) -> Progress:
    return Progress(REQUEST, pack([k for k, _ in pairs], U32), pack([d for _, d in pairs], U32))


def reply(*results: KeyResult, done: tuple[int, ...] = ()) -> Completion:
    return Completion(REQUEST, results, pack(done, U32) if done else b"")


def failed(code: ErrorCode) -> KeyResult:
    return KeyResult(KeyStatus.FAILED, code)


def test_groups_are_delivered_in_order_whatever_order_notifications_come_in() -> None:
    plan = PlanProgress(REQUEST, [4], TOKEN)
    assert plan.on_notification(note(0, 2)) == []  # group 2 landed, but 0 and 1 not yet
    assert plan.state(0, 2) is PENDING
    assert plan.on_notification(note(0, 0)) == [GroupEvent(0, 0, DELIVERED)]
    assert plan.on_notification(note(0, 1)) == [GroupEvent(0, 1, DELIVERED), GroupEvent(0, 2, DELIVERED)]
    assert plan.delivered(0) == 3
    assert plan.on_reply(reply(OK, done=(4,))) == [GroupEvent(0, 3, DELIVERED)]
    assert plan.finished and plan.disagreements == 0


def test_progress_alone_delivers_and_repeats_change_nothing() -> None:
    plan = PlanProgress(REQUEST, [3, 2])
    assert plan.on_progress(progress((0, 2), (1, 1))) == [
        GroupEvent(0, 0, DELIVERED), GroupEvent(0, 1, DELIVERED), GroupEvent(1, 0, DELIVERED),
    ]
    assert plan.on_progress(progress((0, 1), (1, 1))) == []
    assert plan.on_reply(reply(OK, OK, done=(3, 2))) == [GroupEvent(0, 2, DELIVERED), GroupEvent(1, 1, DELIVERED)]


def test_a_client_that_read_the_groups_itself_finishes_from_its_results_as_from_a_reply() -> None:
    """No message is forged for it: ``on_results`` is what ``on_reply`` does with a reply's fields."""
    results, done = (failed(ErrorCode.LEASE_LOST), OK), (1, 2)
    own, node = PlanProgress(REQUEST, [3, 2]), PlanProgress(REQUEST, [3, 2])
    own.ledger.advance(1, 1)  # what a read under grants moves itself (kvcr_client.reads)
    node.ledger.advance(1, 1)
    assert own.on_results(results, done) == node.on_reply(reply(*results, done=done))
    assert [own.state(0, g) for g in range(3)] == [DELIVERED, FAILED, FAILED] and own.finished
    assert own.on_results(results, done) == [] and own.ignored == 1  # once only
    assert node.on_reply(Completion(REQUEST + 1, results)) == [] and node.ignored == 1  # another request's


def test_a_failed_group_fails_the_later_ones_and_earlier_ones_stay_delivered() -> None:
    plan = PlanProgress(REQUEST, [4, 1], TOKEN)
    plan.on_notification(note(0, 0))
    events = plan.on_reply(reply(failed(ErrorCode.TRANSFER_FAILED), OK, done=(2, 1)))
    code = int(ErrorCode.TRANSFER_FAILED)
    assert events == [
        GroupEvent(0, 1, DELIVERED), GroupEvent(0, 2, FAILED, code), GroupEvent(0, 3, FAILED, code),
        GroupEvent(1, 0, DELIVERED),
    ]
    assert [plan.state(0, g) for g in range(4)] == [DELIVERED, DELIVERED, FAILED, FAILED]


def test_a_reply_that_contradicts_notifications_keeps_what_was_proved() -> None:
    plan = PlanProgress(REQUEST, [3], TOKEN)
    plan.on_notification(note(0, 0))
    plan.on_notification(note(0, 1))
    events = plan.on_reply(reply(failed(ErrorCode.TRANSFER_FAILED), done=(0,)))
    assert events == [GroupEvent(0, 2, FAILED, int(ErrorCode.TRANSFER_FAILED))]
    assert plan.delivered(0) == 2 and plan.disagreements == 1


def test_no_notification_and_no_reply_by_the_deadline() -> None:
    plan = PlanProgress(REQUEST, [2, 2], TOKEN, deadline=10.0)
    plan.on_notification(note(1, 0))
    assert plan.expire(9.9) == []
    timeout = int(ErrorCode.TIMEOUT)
    assert plan.expire(10.0) == [
        GroupEvent(0, 0, FAILED, timeout), GroupEvent(0, 1, FAILED, timeout), GroupEvent(1, 1, FAILED, timeout),
    ]
    # Late messages change nothing for the caller: it already heard the failure.
    assert plan.on_notification(note(0, 0)) == [] and plan.on_reply(reply(OK, OK)) == []
    assert plan.state(1, 0) is DELIVERED


def test_one_notification_covers_a_run_of_items() -> None:
    plan = PlanProgress(REQUEST, [2, 2, 2], TOKEN)
    assert plan.on_notification(note(1, 0, count=2)) == [GroupEvent(1, 0, DELIVERED), GroupEvent(2, 0, DELIVERED)]


def test_notifications_that_match_nothing_are_counted_and_ignored() -> None:
    plan = PlanProgress(REQUEST, [2, 1], TOKEN)
    for stray in (note(0, 0, token=TOKEN + 1), note(0, 0, request=REQUEST + 1), note(1, 1), note(1, 0, count=2), note(5, 0)):
        assert plan.on_notification(stray) == []
    assert plan.ignored == 5
    assert PlanProgress(REQUEST, [1]).on_notification(note(0, 0)) == []  # no token asked: nothing matches
    assert plan.on_progress(Progress(REQUEST + 1, pack([0], U32), pack([1], U32))) == [] and plan.ignored == 6


def test_a_reply_without_done_fails_every_group_of_a_failed_key() -> None:
    plan = PlanProgress(REQUEST, [2])
    assert plan.on_reply(reply(failed(ErrorCode.NOT_FOUND))) == [
        GroupEvent(0, 0, FAILED, int(ErrorCode.NOT_FOUND)), GroupEvent(0, 1, FAILED, int(ErrorCode.NOT_FOUND)),
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_every_group_ends_delivered_or_failed_and_delivered_ones_form_a_prefix(groups: list[int], data: st.DataObject) -> None:
    plan = PlanProgress(REQUEST, groups, TOKEN)
    landed = [data.draw(st.integers(0, g)) for g in groups]  # what really landed, per item
    seen: dict[tuple[int, int], GroupState] = {}
    notes = [note(k, g) for k, n in enumerate(landed) for g in range(n)]
    for n in data.draw(st.permutations(notes)):
        if data.draw(st.booleans()):
            for event in plan.on_notification(n):
                seen[event.item, event.group] = event.state
    ok = [n == g for n, g in zip(landed, groups, strict=True)]
    results = [OK if good else failed(ErrorCode.TRANSFER_FAILED) for good in ok]
    for event in plan.on_reply(reply(*results, done=tuple(landed))):
        assert (event.item, event.group) not in seen
        seen[event.item, event.group] = event.state
    for k, g in enumerate(groups):
        states = [plan.state(k, i) for i in range(g)]
        assert states == [DELIVERED] * landed[k] + [FAILED] * (g - landed[k])
        assert all(seen[k, i] is states[i] for i in range(g))
    assert plan.disagreements == 0 and kp.PlanProgress is PlanProgress


def test_a_request_that_ends_without_a_reply_fails_what_was_not_delivered() -> None:
    plan = PlanProgress(REQUEST, [3], TOKEN)
    plan.on_notification(note(0, 0))
    lost = int(ErrorCode.NODE_LOST)
    assert plan.end(lost) == [GroupEvent(0, 1, FAILED, lost), GroupEvent(0, 2, FAILED, lost)]
    assert plan.end(lost) == [] and plan.finished and plan.state(0, 0) is DELIVERED


# -- the ledger under every deliver's groups (GroupLedger)


def test_the_ledger_delivers_in_order_whatever_order_groups_land_in() -> None:
    ledger = kp.GroupLedger([3, 1])
    assert ledger.land(0, 2) == range(0), "group 2 waits for 0 and 1"
    assert ledger.land(0, 0) == range(0, 1)
    assert ledger.land(0, 1) == range(1, 3), "group 1 delivers 1 and the waiting 2"
    assert ledger.delivered == [3, 0] and ledger.landed == {}
    assert [ledger.group_state(g) for g in range(3)] == [PENDING, DELIVERED, DELIVERED], "item 1 still owes group 0"
    assert ledger.land(1, 0) == range(0, 1) and ledger.group_state(0) is DELIVERED
    assert ledger.land(1, 0) == range(0), "a group lands once"


def test_an_advance_takes_the_groups_that_landed_beyond_it() -> None:
    ledger = kp.GroupLedger([4])
    ledger.land(0, 2)
    assert ledger.advance(0, 2) == range(0, 3), "0 and 1 by the count, 2 already landed"
    assert ledger.advance(0, 1) == range(0), "counts only grow"
    assert ledger.advance(0, 9) == range(3, 4), "never past the item's groups"


def test_a_failure_stands_and_nothing_past_it_is_ever_delivered() -> None:
    ledger = kp.GroupLedger([4, 2])
    ledger.land(0, 0)
    ledger.land(0, 2)
    assert ledger.fail(0, int(ErrorCode.TRANSFER_FAILED), 1) == range(1, 4)
    assert ledger.landed == {}, "what landed beyond the failure is forgotten"
    assert ledger.land(0, 1) == range(0) and ledger.advance(0, 4) == range(0)
    assert ledger.fail(0, int(ErrorCode.TIMEOUT)) == range(0), "the first failure stands"
    assert ledger.code(0) == ErrorCode.TRANSFER_FAILED and ledger.failed(0) and not ledger.failed(1)
    assert [ledger.state(0, g) for g in range(4)] == [DELIVERED, FAILED, FAILED, FAILED]
    assert ledger.group_state(1) is FAILED and ledger.group_codes[1] == ErrorCode.TRANSFER_FAILED
    assert ledger.advance(1, 2) == range(0, 2)
    assert ledger.group_state(0) is DELIVERED, "every item delivered group 0"
    assert ledger.group_state(1) is FAILED, "item 0 failed it, whatever item 1 did"


def test_a_failure_never_takes_back_what_was_delivered() -> None:
    ledger = kp.GroupLedger([3])
    ledger.advance(0, 2)
    assert ledger.fail(0, int(ErrorCode.TRANSFER_FAILED), 0) == range(2, 3)
    assert ledger.delivered == [2] and ledger.state(0, 1) is DELIVERED


@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.lists(st.tuples(
    st.sampled_from(["land", "advance", "fail"]), st.integers(0, 4), st.integers(0, 6)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_the_ledger_per_group_counts_agree_with_its_items(groups: list[int], steps: list[tuple[str, int, int]]) -> None:
    ledger = kp.GroupLedger(groups)
    delivered: list[set[int]] = [set() for _ in groups]
    for what, item, n in steps:
        k = item % len(groups)
        if what == "land":
            got = ledger.land(k, n % groups[k])
        elif what == "advance":
            got = ledger.advance(k, n)
        else:
            ledger.fail(k, 1, n % groups[k])
            continue
        assert not delivered[k] & set(got), "a group is delivered once"
        delivered[k] |= set(got)
    for k, count in enumerate(groups):
        assert delivered[k] == set(range(ledger.delivered[k]))
        assert ledger.delivered[k] <= ledger.failed_from.get(k, count)
    for g in range(ledger.group_count):
        assert ledger.owed[g] == sum(1 for k, count in enumerate(groups) if count > g and ledger.delivered[k] <= g)
