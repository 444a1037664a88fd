"""Deadlines and the memory an operation may still touch (issue #10, defect 10).

``deadline_ms=0`` means the node's default on both sides (spec section 5.1): the client
does not give up on its own after a couple of seconds while the node goes on. A client
that stops waiting (its deadline plus a grace passed with no answer) raises to the
waiter, but the regions the operation names stay in use until the node's answer or the
end of the session: ``unregister`` refuses them, naming the operation.

The node is frozen (SIGSTOP) so that it answers late for sure; once it runs again it
reads the request, moves the bytes, and answers.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

import kvcr_client.session
from kvcr_client import ArgumentError, Client, KeyStatus, NodeLostError, OperationTimeout, Span
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.layouts import Layout, Registrar, StoredObject
from kvcr_testing.nodes import frozen
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

SLOT = 4 * KiB
LAYOUT = Layout([(f"L{i}", "kv", SLOT) for i in range(4)])
# Heartbeats far apart: a node frozen for a few seconds is late, not lost.
NODE_ARGS = ("--pool", "kv:4KiB:64", "--heartbeat-ms", "20000")
SHORT_DEADLINE_MS = 200
SHORT_GRACE_S = 0.05
"""The client's grace after a deadline, shortened so a frozen node is late within moments."""
OLD_ZERO_WAIT_S = 3.0
"""Longer than the 2 s a deadline of 0 used to mean in the client."""
SETTLE_S = 10.0


def test_zero_deadline_waits_for_the_nodes_default(node_factory: Callable[..., Any]) -> None:
    node = node_factory(*NODE_ARGS)
    with Client(node.endpoint, name="zero") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"zero/obj", LAYOUT, 11)
        before = slot_accounting(stats(client))
        with frozen(node):
            handle = client.deliver({s.key: s.spans}, deadline_ms=0)
            # 0 is the node's default (30 s here), not a client deadline of its own.
            assert not wait_until(lambda: handle.future.done(), OLD_ZERO_WAIT_S), handle.future
            assert_bytes_equal(s.dst, s.sentinel, "destination while the node is frozen")
        assert handle.result(SETTLE_S)[s.key].status is KeyStatus.OK
        assert_bytes_equal(s.dst, s.src, "deliver with the node's default deadline")
        assert_clean(client, slots_before=before)
        reg.close()


def test_timed_out_operations_keep_their_regions_until_the_node_answers(
    node_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    node = node_factory(*NODE_ARGS)
    monkeypatch.setattr(kvcr_client.session, "_GRACE_S", SHORT_GRACE_S)
    with Client(node.endpoint, name="late") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"late/obj", LAYOUT, 11)
        src2 = pattern(LAYOUT.nbytes, 13)
        src2_region = reg(src2)
        before = slot_accounting(stats(client))
        with frozen(node):
            deliver = client.deliver({s.key: s.spans}, deadline_ms=SHORT_DEADLINE_MS)
            deposit = client.deposit({b"late/obj2": LAYOUT.source_spans(src2_region)}, deadline_ms=SHORT_DEADLINE_MS)
            for handle in (deliver, deposit):
                with pytest.raises(OperationTimeout):
                    handle.result(SETTLE_S)
            # The node may still write the destination and read the source: neither may go.
            with pytest.raises(ArgumentError) as err:
                client.unregister(s.dst_region)
            assert err.value.field == "region" and f"#{deliver.op_id}" in err.value.reason, err.value
            assert "timed out" in err.value.reason, err.value
            with pytest.raises(ArgumentError) as err:
                client.unregister(src2_region)
            assert f"#{deposit.op_id}" in err.value.reason, err.value
            assert client.tables()["timed_out"] == 2
            assert_bytes_equal(s.dst, s.sentinel, "destination while the node is frozen")
        # The node runs the requests after all: the late answers release the regions.
        assert wait_until(lambda: client.tables()["timed_out"] == 0, SETTLE_S), client.tables()
        assert s.dst_region.in_use == 0 and src2_region.in_use == 0
        assert_bytes_equal(s.dst, s.src, "destination written after the client stopped waiting")
        assert client.query([b"late/obj2"]).result(5)[b"late/obj2"].presence.value == "HIT"
        check = pattern(LAYOUT.nbytes, 14)
        check_spans = [Span(n, reg(check), o, sz) for (n, _, sz), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        assert client.deliver({b"late/obj2": check_spans}).result(10)[b"late/obj2"].status is KeyStatus.OK
        assert_bytes_equal(check, src2, "object deposited after the client stopped waiting")
        client.unregister(s.dst_region)  # allowed now
        reg.regions.remove(s.dst_region)
        st = assert_clean(client)
        assert slot_accounting(st)["kv"][1] == before["kv"][1] + 4  # the late deposit's 4 slots
        reg.close()


def test_node_lost_ends_the_session_and_releases_its_regions(
    node_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that dies ends the session: pending and timed-out operations let go of their regions."""
    node = node_factory(*NODE_ARGS)
    monkeypatch.setattr(kvcr_client.session, "_GRACE_S", SHORT_GRACE_S)
    with Client(node.endpoint, name="lost") as client:
        reg = Registrar(client)
        s = StoredObject(client, reg, b"lost/obj", LAYOUT, 11)
        with frozen(node):
            late = client.deliver({s.key: s.spans}, deadline_ms=SHORT_DEADLINE_MS)
            with pytest.raises(OperationTimeout):
                late.result(SETTLE_S)
            # The frozen node may still write there: the same spans take no deliver (kvcr_client.uncertain).
            with pytest.raises(ArgumentError):
                client.deliver({s.key: s.spans})
            elsewhere = [Span(span.name, s.src_region, span.offset, span.length) for span in s.spans]
            pending = client.deliver({s.key: elsewhere})
            assert s.dst_region.in_use == 1 and s.src_region.in_use == 1 and client.tables()["uncertain_held"] == 1
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(SETTLE_S)
        with pytest.raises(NodeLostError):
            pending.result(SETTLE_S)
        assert wait_until(lambda: client.core.lost, SETTLE_S)
        assert s.dst_region.in_use == 0 and s.src_region.in_use == 0 and client.tables()["timed_out"] == 0
        assert client.tables()["uncertain_held"] == 0, "the session is over: nothing of it can write any more"
        assert_bytes_equal(s.dst, s.sentinel, "destination of a node killed while frozen")
        assert not s.dst_region.users, "no operation holds it any more"
