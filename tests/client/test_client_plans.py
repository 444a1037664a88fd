"""Layer plans from the client (spec sections 6.8 and 6.10): per-group completion, by NIXL
notification or by the control messages, against nodes of every version.

Every test compares the delivered bytes with the patterned source: after ``wait(g)`` the
spans of groups 0..g are in place, and at the end the whole destination is.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

import kvcr_client.session
from kvcr_client import (
    ArgumentError,
    AsyncClient,
    Client,
    DeliverHandle,
    ErrorCode,
    GroupDone,
    GroupFailed,
    GroupState,
    KeyStatus,
    Span,
)
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, StoredObject
from kvcr_testing.nodes import frozen
from kvcr_testing.notifications import LossyClient
from kvcr_testing.patterns import KiB, assert_bytes_equal

SLOT = 16 * KiB
SPANS = 8
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(SPANS)])
NODE_ARGS = ("--pool", "kv:16KiB:64", "--heartbeat-ms", "20000")
PLAN = [["L0", "L1"], ["L2", "L3"], ["L4", "L5"], ["L6", "L7"]]
"""Four layer groups of two spans each."""
SHORT_DEADLINE_MS = 200
SHORT_GRACE_S = 0.05
SETTLE_S = 10.0


def group_bytes(s: StoredObject, group: int) -> tuple[Any, Any]:
    """The destination bytes of a group of ``PLAN`` and the source bytes they must equal."""
    first = LAYOUT.index(PLAN[group][0])
    lo, hi = LAYOUT.offsets[first], LAYOUT.offsets[first] + 2 * SLOT
    return s.dst[lo:hi], s.src[lo:hi]


def check_groups_in_order(s: StoredObject, handle: DeliverHandle) -> None:
    for g in range(len(PLAN)):
        handle.wait(g, RESULT_TIMEOUT_S)
        assert handle.state(g) is GroupState.DELIVERED
        got, want = group_bytes(s, g)
        assert_bytes_equal(got, want, f"group {g} once wait({g}) returned")
    assert handle.result(RESULT_TIMEOUT_S)[s.key].status is KeyStatus.OK
    assert_bytes_equal(s.dst, s.src, "the whole object")


@pytest.mark.parametrize("drop", [False, True], ids=["notified", "notifications-lost"])
def test_groups_complete_in_order_locally(node_factory: Callable[..., Any], drop: bool) -> None:
    node = node_factory(*NODE_ARGS)
    with LossyClient(node.endpoint, name="plans") as client:
        assert client.core.version >= 3  # plans and notifications
        client.core.losing = drop
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/obj", LAYOUT, 31)
        before = slot_accounting(stats(client))
        handle = client.deliver({s.key: s.spans}, plan=PLAN)
        assert isinstance(handle, DeliverHandle) and handle.group_count == len(PLAN)
        check_groups_in_order(s, handle)
        counts = client.core.notifications
        if drop:
            # Lost notifications change nothing: progress and the reply complete every group.
            assert counts["matched"] == 0
        else:
            assert wait_until(lambda: counts["matched"] >= 1, 5.0), counts
        assert handle.disagreements == 0 and handle.progress.ignored == 0
        assert_clean(client, slots_before=before)
        reg.close()


def test_poll_completed_reports_each_group_then_the_handle(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="poller") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/poll", LAYOUT, 33)
        assert client.poll_completed() == []
        handle = client.deliver({s.key: s.spans}, plan=PLAN)
        seen: list[Any] = []
        assert wait_until(lambda: bool(seen.extend(client.poll_completed())) or handle in seen, RESULT_TIMEOUT_S)
        groups = [e for e in seen if isinstance(e, GroupDone)]
        assert [(e.handle, e.group, e.state) for e in groups] == [(handle, g, GroupState.DELIVERED) for g in range(len(PLAN))]
        assert seen[-1] is handle and handle.result(0)[s.key].status is KeyStatus.OK
        assert_bytes_equal(s.dst, s.src, "polled deliver")
        reg.close()


def test_a_plan_per_key_and_keys_without_one(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="per-key") as client:
        reg = Registrar(client)
        a = StoredObject(client, reg, b"plan/a", LAYOUT, 35)
        b = StoredObject(client, reg, b"plan/b", LAYOUT, 37)
        handle = client.deliver({a.key: a.spans, b.key: b.spans}, plan={a.key: PLAN})
        assert handle.groups == (len(PLAN), 1)
        handle.wait(0, RESULT_TIMEOUT_S, key=a.key)
        assert_bytes_equal(*group_bytes(a, 0), "group 0 of the planned key")
        handle.wait(0, RESULT_TIMEOUT_S, key=b.key)
        assert_bytes_equal(b.dst, b.src, "the key without a plan is one group")
        assert handle.result(RESULT_TIMEOUT_S).all_ok
        assert_bytes_equal(a.dst, a.src, "the planned key")
        reg.close()


def test_a_bad_plan_is_refused_naming_its_part(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="bad-plan") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/bad", LAYOUT, 39)
        cases: list[tuple[Any, str]] = [
            ([["L0"], ["nope"]], "plan[1][0]"),
            ([["L0", "L1"], ["L1"]], "plan[1][0]"),
            ([["L0"]], "plan"),
            ([[]], "plan[0]"),
            ("L0", "plan"),
            ({b"other": PLAN}, "plan[b'other']"),
        ]
        for plan, field in cases:
            with pytest.raises(ArgumentError) as err:
                client.deliver({s.key: s.spans}, plan=plan)
            assert err.value.field == field, (plan, err.value)
        assert_clean(client)
        reg.close()


def test_a_plan_changed_in_place_between_delivers_is_read_again(node_factory: Callable[..., Any]) -> None:
    """The client keeps a plan it checked (an engine passes the same one every time): the
    same list, changed in place, must be checked and applied as it is now."""
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="plan-in-place") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/in-place", LAYOUT, 41)
        plan = [list(group) for group in PLAN]
        first = client.deliver({s.key: s.spans}, plan=plan)
        assert first.groups == (4,) and first.result(RESULT_TIMEOUT_S).all_ok
        plan[1].append("L0")  # L0 now in two groups
        with pytest.raises(ArgumentError) as err:
            client.deliver({s.key: s.spans}, plan=plan)
        assert err.value.field == "plan[1][2]"
        plan[:] = [["L0", "L1", "L2", "L3"], ["L4", "L5", "L6", "L7"]]
        handle = client.deliver({s.key: s.spans}, plan=plan)
        assert handle.groups == (2,)
        assert handle.result(RESULT_TIMEOUT_S).all_ok
        assert_bytes_equal(s.dst, s.src, "the object under the changed plan")
        assert_clean(client)
        reg.close()


MATRIX = list(itertools.product((1, 2, 3), repeat=2))


@pytest.mark.parametrize(("node_version", "client_version"), MATRIX, ids=[f"node{n}-client{c}" for n, c in MATRIX])
def test_every_client_and_node_version_delivers_a_plan(
    node_factory: Callable[..., Any], node_version: int, client_version: int
) -> None:
    """A session that agreed on 1 or 2 keeps the plan on the client: every group lands with
    the key's OK and no notification is asked for (spec section 7); at 3 the node reports
    each group."""
    node = node_factory(*NODE_ARGS, "--protocol-version", str(node_version))
    with Client(node.endpoint, name="matrix", max_version=client_version) as client:
        agreed = min(node_version, client_version)
        assert client.core.version == agreed
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/matrix", LAYOUT, 41)
        handle = client.deliver({s.key: s.spans}, plan=PLAN)
        check_groups_in_order(s, handle)
        notified = stats(client)["transfers"]["notified"]
        assert notified == (len(PLAN) if agreed >= 3 else 0), notified
        assert_clean(client)
        reg.close()


def test_a_failed_key_fails_every_group_it_did_not_deliver(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="fails") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/fail", LAYOUT, 43)
        spans = [Span(span.name, span.region, span.offset, span.length // 2) for span in s.spans]
        handle = client.deliver({s.key: spans}, plan=PLAN)
        for g in range(len(PLAN)):
            with pytest.raises(GroupFailed) as err:
                handle.wait(g, RESULT_TIMEOUT_S)
            assert err.value.code == ErrorCode.SIZE_MISMATCH
        assert handle.result(0)[s.key].code == ErrorCode.SIZE_MISMATCH
        assert_bytes_equal(s.dst, s.sentinel, "nothing written")
        assert_clean(client)
        reg.close()


def test_no_reply_by_the_deadline_fails_the_waiting_groups_and_keeps_the_memory(
    node_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spec section 6.10: with neither notification nor reply, the groups fail TIMEOUT at the
    client's deadline and the destination stays registered until the late reply."""
    node = node_factory(*NODE_ARGS)
    monkeypatch.setattr(kvcr_client.session, "_GRACE_S", SHORT_GRACE_S)
    with Client(node.endpoint, name="late") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"plan/late", LAYOUT, 45)
        with frozen(node):
            handle = client.deliver({s.key: s.spans}, deadline_ms=SHORT_DEADLINE_MS, plan=PLAN)
            with pytest.raises(GroupFailed) as err:
                handle.wait(0, SETTLE_S)
            assert err.value.code == ErrorCode.TIMEOUT
            assert all(handle.state(g) is GroupState.FAILED for g in range(len(PLAN)))
            with pytest.raises(ArgumentError):
                client.unregister(s.dst_region)
        # The node answers late; its answer settles the memory, the groups stay as reported.
        assert wait_until(lambda: s.dst_region.in_use == 0, SETTLE_S)
        assert handle.state(0) is GroupState.FAILED
        assert_clean(client)
        reg.close()


async def test_async_groups_are_awaitable(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    async with await AsyncClient.connect(node.endpoint, name="async-plans") as client:
        src_client = Client(node.endpoint, name="async-depositor")
        try:
            reg = Registrar(src_client)
            s = StoredObject(src_client, reg, b"plan/async", LAYOUT, 47)
            dst_region = await client.register(s.dst)
            spans = [Span(span.name, dst_region, span.offset, span.length) for span in s.spans]
            handle = client.deliver({s.key: spans}, plan=PLAN)
            for g in range(len(PLAN)):
                await asyncio.wait_for(handle.group(g), RESULT_TIMEOUT_S)
                assert_bytes_equal(*group_bytes(s, g), f"group {g} once awaited")
            assert (await handle)[s.key].status is KeyStatus.OK
            await client.unregister(dst_region)
            reg.close()
        finally:
            src_client.close()


def test_waiting_on_a_delivered_group_returns_at_once_and_on_any_other_waits() -> None:
    """``DeliverHandle.wait`` on a group its ledger says delivered returns without driving
    the client (the caller's first layer costs no waiter); a pending or failed group, or a
    group the plan does not have, goes the usual way."""
    driven: list[float | None] = []

    def waiter(future: Future[Any], timeout: float | None) -> None:
        driven.append(timeout)
        raise TimeoutError

    handle = DeliverHandle(1, Future(), [b"a", b"b"], [3, 2], 0, None, waiter)
    ledger = handle.progress.ledger
    ledger.land(0, 0)
    with pytest.raises(TimeoutError):
        handle.wait(0, 0.5)  # key b has not delivered group 0 yet
    ledger.land(1, 0)
    handle.wait(0, 0.5)
    handle.wait(0, 0.5, key=b"a")
    assert driven == [0.5]
    ledger.fail(0, 7)
    with pytest.raises(GroupFailed):
        handle.wait(1, 0.5)
    with pytest.raises(IndexError):
        handle.wait(2, 0.5, key=b"b")
    assert driven == [0.5]
