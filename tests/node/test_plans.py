"""Version 3 in process: span columns, layer plans, progress and NIXL notifications (spec sections 6.7-6.10).

A ``NodeDriver`` hands the node one message at a time with a fake clock; bytes move by
real NIXL transfers between the node's agent and the test's, and every byte is compared.
A group's failure is made by refusing that group's transfer at submission.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvcr_io.agent import TransferError
from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import (
    CURRENT_VERSION,
    Completion,
    Deliver,
    DeliverItem,
    Deposit,
    DepositItem,
    DstSpan,
    Error,
    ErrorCode,
    KeyStatus,
    Message,
    Notification,
    Progress,
    SrcSpan,
    decode_notification,
    deliver_columns,
    deposit_columns,
    encode,
)
from kvcr_protocol.columns import U16, pack
from kvcr_testing.health import wait_until
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver
from kvcr_testing.patterns import assert_bytes_equal, pattern

SLOT = 4096
SPANS = 4
KEYS = 2
TOKEN = 0x5EED
SOURCE, DEST = 1, 2
"""Region ids: the test agent's source bytes, its destination."""


def config(ipc_dir: Path) -> NodeConfig:
    return NodeConfig(endpoint=f"ipc://{ipc_dir}/plans.sock", name="plans", pools=(PoolSpec("kv", SLOT, 32, "dram"),),
                      log_level="WARNING", client_grace_ms=600_000, heartbeat_ms=2_000).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("plans-client", pattern(KEYS * SPANS * SLOT, 21), np.zeros(KEYS * SPANS * SLOT, np.uint8))
    yield a
    a.close()


def deposit_items(keys: int = KEYS) -> tuple[DepositItem, ...]:
    return tuple(
        DepositItem(f"k{k}".encode(), tuple(SrcSpan(f"L{j}", "kv", SOURCE, (k * SPANS + j) * SLOT, SLOT) for j in range(SPANS)))
        for k in range(keys)
    )


def deliver_items(keys: int = KEYS, region: int = DEST, length: int = SLOT) -> tuple[DeliverItem, ...]:
    return tuple(
        DeliverItem(f"k{k}".encode(), tuple(DstSpan(f"L{j}", region, (k * SPANS + j) * SLOT, length) for j in range(SPANS)))
        for k in range(keys)
    )


def stored(d: NodeDriver, agent: ClientAgent) -> None:
    """Both keys stored through a deposit of columns."""
    d.receive(b"c", Deposit(1, (), columns=(deposit_columns(deposit_items()),)))
    d.finish_transfers(agent)
    (reply,) = d.sent(b"c")
    assert isinstance(reply, Completion) and [r.status for r in reply.results] == [KeyStatus.STORED] * KEYS


def collect(d: NodeDriver, agent: ClientAgent, first: list[Message]) -> tuple[list[Progress], Completion]:
    d.finish_transfers(agent)
    sent = first + d.sent(b"c")
    progress = [m for m in sent if isinstance(m, Progress)]
    (reply,) = [m for m in sent if isinstance(m, Completion)]
    return progress, reply


def notes(agent: ClientAgent, expected: int) -> list[Notification]:
    # A notification may reach the agent a moment after the initiator saw DONE.
    assert wait_until(lambda: bool(agent.notifications.extend(agent.agent.progress())) or len(agent.notifications) >= expected, 5.0)
    got = [decode_notification(p) for p in agent.notifications]
    agent.notifications.clear()
    return got


def assert_at_rest(d: NodeDriver) -> dict[str, Any]:
    st = d.stats()
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0 and st["operations_pending"] == 0, st
    assert st["transfers"]["in_flight"] == 0 and st["transfers"]["prepared"] == 0, st["transfers"]
    return st


def test_a_layer_plan_lands_group_by_group_with_notifications(ipc_dir: Path, agent: ClientAgent) -> None:
    source, dest = agent.buffers
    dest[:] = 0
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, agent)
        agent.notifications.clear()
        block = deliver_columns(deliver_items(), groups=range(SPANS))  # one span per group
        first = d.receive(b"c", Deliver(7, (), columns=(block,), notify=TOKEN))
        progress, reply = collect(d, agent, first)
        assert [r.status for r in reply.results] == [KeyStatus.OK] * KEYS
        assert list(reply.done_counts()) == [SPANS] * KEYS
        assert_bytes_equal(dest, source, "every group of both keys")
        # Notifications: one per group, covering both keys (consecutive items), group order.
        got = notes(agent, SPANS)
        assert sorted((n.group, n.key, n.count) for n in got) == [(g, 0, KEYS) for g in range(SPANS)]
        assert all((n.token, n.request) == (TOKEN, 7) for n in got)
        # Progress counts only grow, and never beyond the plan.
        for msg in progress:
            assert msg.id == 7 and all(0 < done <= SPANS for _, done in msg.pairs())
        assert_at_rest(d)


def test_a_failed_group_fails_the_later_ones_and_keeps_the_earlier(
    ipc_dir: Path, agent: ClientAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, dest = agent.buffers
    dest[:] = 0
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, agent)
        agent.notifications.clear()
        real = d.node.transfers.start_prepared  # a plan's groups post from lists prepared once
        calls = []

        def start(*args: Any, **kwargs: Any) -> Any:
            calls.append(args[2])
            if len(calls) == 3:  # group 2's WRITE
                raise TransferError("refused for the test")
            return real(*args, **kwargs)

        monkeypatch.setattr(d.node.transfers, "start_prepared", start)
        block = deliver_columns(deliver_items(), groups=range(SPANS))
        first = d.receive(b"c", Deliver(8, (), columns=(block,), notify=TOKEN))
        _, reply = collect(d, agent, first)
        assert len(calls) == 3, "no group after the failed one is submitted"
        assert [(r.status, r.code) for r in reply.results] == [(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED)] * KEYS
        assert list(reply.done_counts()) == [2] * KEYS
        for k in range(KEYS):
            base = k * SPANS * SLOT
            assert_bytes_equal(dest[base : base + 2 * SLOT], source[base : base + 2 * SLOT], f"key {k}, groups 0-1")
            assert not dest[base + 2 * SLOT : base + SPANS * SLOT].any(), f"key {k}: groups 2-3 were never written"
        assert sorted(n.group for n in notes(agent, 2)) == [0, 1]
        assert_at_rest(d)


def test_a_plan_of_two_layer_groups_over_a_subset(ipc_dir: Path, agent: ClientAgent) -> None:
    """Groups of several spans, over an ordered subset of the stored layout (spec section 8)."""
    source, dest = agent.buffers
    dest[:] = 0
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, agent)
        names = (0, 2, 3)
        item = DeliverItem(b"k1", tuple(DstSpan(f"L{j}", DEST, n * SLOT, SLOT) for n, j in enumerate(names)))
        block = deliver_columns((item,), groups=(0, 1, 1))
        _, reply = collect(d, agent, d.receive(b"c", Deliver(9, (), columns=(block,))))
        assert reply.results[0].status is KeyStatus.OK and list(reply.done_counts()) == [2]
        for n, j in enumerate(names):
            src = (SPANS + j) * SLOT
            assert_bytes_equal(dest[n * SLOT : (n + 1) * SLOT], source[src : src + SLOT], f"span L{j}")
        assert_at_rest(d)


def test_hostile_columns_fail_their_keys_and_leave_the_node_clean(ipc_dir: Path, agent: ClientAgent) -> None:
    _, dest = agent.buffers
    dest[:] = 0
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, agent)
        bad_region = deliver_columns(deliver_items(region=9), groups=range(SPANS))
        wrong_size = deliver_columns(deliver_items(length=SLOT // 2))
        for op, block, code, path in (
            (10, bad_region, ErrorCode.BAD_DESCRIPTOR, "columns[0].regions"),
            (11, wrong_size, ErrorCode.SIZE_MISMATCH, "columns[0].lengths"),
        ):
            _, reply = collect(d, agent, d.receive(b"c", Deliver(op, (), columns=(block,))))
            assert [(r.status, r.code) for r in reply.results] == [(KeyStatus.FAILED, code)] * KEYS
            assert reply.results[0].reason.startswith(path), reply.results[0].reason
        # A deposit whose block names an unknown pool or a region never announced.
        items = tuple(DepositItem(b"n" + i.key, tuple(s._replace(pool="nope") for s in i.spans)) for i in deposit_items())
        (reply,) = d.receive(b"c", Deposit(12, (), columns=(deposit_columns(items),)))
        assert isinstance(reply, Completion)
        assert [(r.status, r.code) for r in reply.results] == [(KeyStatus.FAILED, ErrorCode.UNKNOWN_POOL)] * KEYS
        items = tuple(DepositItem(b"m" + i.key, tuple(s._replace(region=9) for s in i.spans)) for i in deposit_items())
        (reply,) = d.receive(b"c", Deposit(13, (), columns=(deposit_columns(items),)))
        assert isinstance(reply, Completion)
        assert [(r.status, r.code) for r in reply.results] == [(KeyStatus.FAILED, ErrorCode.BAD_DESCRIPTOR)] * KEYS
        assert not dest.any(), "nothing was written"
        st = assert_at_rest(d)
        assert st["objects"] == KEYS


def test_a_plan_naming_group_65535_is_refused_whole_and_the_node_goes_on(ipc_dir: Path, agent: ClientAgent) -> None:
    """A well-formed deliver whose plan's largest group is 65,535 for 4 spans: refused as a
    message (``OUT_OF_RANGE`` at the groups column, spec section 6.8), nothing claimed, and the
    same session's plain deliver is served after it."""
    _, dest = agent.buffers
    dest[:] = 0
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, agent)
        obj = msgpack.unpackb(encode(Deliver(20, (), columns=(deliver_columns(deliver_items(), groups=range(SPANS)),)), CURRENT_VERSION))
        obj["!columns"][0][5] = pack([0, 1, 2, 65535], U16)
        d.receive_frames([b"c", msgpack.packb(obj, use_bin_type=True)])
        (error,) = d.sent(b"c")
        assert isinstance(error, Error) and error.id == 20
        assert (error.code, error.path) == (ErrorCode.OUT_OF_RANGE, "columns[0].groups"), error
        assert "group 3 of 65536 has no span" in error.reason
        assert not dest.any(), "nothing was written"
        assert_at_rest(d)
        _, reply = collect(d, agent, d.receive(b"c", Deliver(21, (), columns=(deliver_columns(deliver_items()),))))
        assert [r.status for r in reply.results] == [KeyStatus.OK] * KEYS
        source, _ = agent.buffers
        assert_bytes_equal(dest, source)
        assert assert_at_rest(d)["objects"] == KEYS
