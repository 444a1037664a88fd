"""Layer plans across nodes (spec sections 6.8, 6.10 and 12), node A the target, B the source.

B writes each group straight into the client's memory with the NIXL notification for it;
A passes B's progress on under the client's item indices. With notifications lost the
control messages alone complete the groups; with B frozen past the deadline every group
not known landed fails ``DESTINATION_UNCERTAIN`` and A holds the destination until B
answers. Every byte is compared with the patterned source.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcr_client import ErrorCode, GroupFailed, GroupState
from kvcr_testing.health import counter
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.nodes import frozen
from kvcr_testing.notifications import LossyClient
from kvcr_testing.patterns import assert_bytes_equal
from kvcr_testing.remote import FAILED, OK, Dest, expect, poll_stats, warm_link

LAYOUT = plain_layout(8)
PLAN = [LAYOUT.names[i : i + 2] for i in range(0, 8, 2)]
DEADLINE_MS = 1500
SLACK_S = 3.0


@pytest.mark.parametrize("drop", [False, True], ids=["notified", "notifications-lost"])
def test_groups_land_in_order_across_nodes(sites: Any, drop: bool) -> None:
    a, b = sites.start(("a", {"client_class": LossyClient}), "b")
    src = b.deposit(b"k", LAYOUT, seed=1)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    assert isinstance(a.client, LossyClient)
    a.client.core.losing = drop
    for key_count in (1, 2):
        # Two keys: one block of two rows, cut out and forwarded as they came.
        keys = [b"k"] if key_count == 1 else [b"k", b"k2"]
        if key_count == 2:
            src2 = b.deposit(b"k2", LAYOUT, seed=2)
            a.client.submit_hint("r2", b.endpoint, keys).result(RESULT_TIMEOUT_S)
        dests = [Dest(a, LAYOUT, range(8), seed=10 + n) for n in range(key_count)]
        handle = a.client.deliver({k: d.spans for k, d in zip(keys, dests, strict=True)},
                                  request_id="r" if key_count == 1 else "r2", plan=PLAN)
        for g in range(len(PLAN)):
            handle.wait(g, RESULT_TIMEOUT_S)
            for d, s in zip(dests, [src, src2][:key_count] if key_count == 2 else [src], strict=True):
                expected = d.expected(s)
                lo, hi = d.offsets[2 * g], d.offsets[2 * g + 1] + LAYOUT.spans[0][2]
                assert_bytes_equal(d.buf[lo:hi], expected[lo:hi], f"group {g} once wait({g}) returned")
        out = handle.result(RESULT_TIMEOUT_S)
        assert out.all_ok, out
        for d, s in zip(dests, [src, src2][:key_count] if key_count == 2 else [src], strict=True):
            d.assert_delivered(s)
        assert handle.disagreements == 0
    assert b.stats()["transfers"]["notified"] >= len(PLAN), "B notifies the client's agent itself"
    if drop:
        assert a.client.core.notifications["matched"] == 0


def test_a_frozen_source_leaves_every_group_uncertain(sites: Any) -> None:
    """B frozen before it reads the write: no group is known landed, so every group fails
    ``DESTINATION_UNCERTAIN`` at A's deadline; B's late answer settles the destination."""
    a, b = sites.start(("a", {"args": ("--peer-dead-ms", "60000")}), "b")
    src = b.deposit(b"k", LAYOUT, seed=3)
    warm_link(a, b, b"k", LAYOUT, src, "r")
    with frozen(b.node):
        dst = Dest(a, LAYOUT, range(8), seed=30)
        handle = a.client.deliver({b"k": dst.spans}, request_id="r", deadline_ms=DEADLINE_MS, plan=PLAN)
        with pytest.raises(GroupFailed) as err:
            handle.wait(0, DEADLINE_MS / 1000 + SLACK_S)
        assert err.value.code == ErrorCode.DESTINATION_UNCERTAIN
        expect(handle.result(SLACK_S)[b"k"], FAILED, ErrorCode.DESTINATION_UNCERTAIN)
        assert [handle.state(g) for g in range(len(PLAN))] == [GroupState.FAILED] * len(PLAN)
        dst.assert_untouched()
    st = poll_stats(a, lambda st: counter(st, "uncertain_resolved") == 1, SLACK_S, "B's late answer resolved the write")
    assert st["peers"][b.endpoint]["writes_outstanding"] == 0, st["peers"]
    # Uncertain meant it: each group holds its own pattern or the source's bytes.
    if not (dst.buf == dst.before).all():
        dst.assert_delivered(src)
    expect(a.client.deliver({b"k": dst.spans}, request_id="r", plan=PLAN).result(RESULT_TIMEOUT_S)[b"k"], OK)
    dst.assert_delivered(src)
