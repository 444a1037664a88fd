"""Operations in process (``kvcr_node.operations`` and ``kvcr_node.ops``), with a fake clock.

The node's loop never runs: each test hands its router one message at a time and reads what
the node sent (``kvcr_testing.nodes.NodeDriver``). A key still being written is made by
the test through the node's store, so admission, waits on WRITING keys, deadlines, abort,
settling and handles are checked without a second writer and without waiting. Where bytes
move, real NIXL transfers run between the node's agent and the test's, and every byte is
compared.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome, ObjectEntry
from kvcr_protocol import (
    Abort,
    Ack,
    Completion,
    Deliver,
    DeliverItem,
    Deposit,
    DepositItem,
    DstSpan,
    Error,
    ErrorCode,
    Fetch,
    FetchItem,
    KeyResult,
    KeyStatus,
    LayoutSpan,
    Release,
    SrcSpan,
)
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver
from kvcr_testing.patterns import assert_bytes_equal, pattern

SLOT = 4096
SPANS = 4
LAYOUT = tuple((f"L{i}", "kv") for i in range(SPANS))


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/ops.sock", name="ops", pools=(PoolSpec("kv", SLOT, 16, "dram"),),
                      log_level="WARNING", client_grace_ms=600_000, heartbeat_ms=2_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    """The test's NIXL agent: region 1 holds the source bytes, region 2 is a destination."""
    a = ClientAgent("ops-client", pattern(SPANS * SLOT, 11), np.zeros(SPANS * SLOT, np.uint8))
    yield a
    a.close()


def deliver_item(key: bytes, names: range = range(SPANS)) -> DeliverItem:
    return DeliverItem(key, tuple(DstSpan(f"L{i}", 2, i * SLOT, SLOT) for i in names))


def fetch_item(key: bytes) -> FetchItem:
    return FetchItem(key, tuple(LayoutSpan(name, pool) for name, pool in LAYOUT))


def writing(d: NodeDriver, key: bytes) -> ObjectEntry:
    """A key another writer is filling: WRITING in the node's store, as during a deposit's READ."""
    outcome, entry = d.node.store.begin_deposit(key, LAYOUT)
    assert outcome is DepositOutcome.NEW and entry is not None
    return entry


def writer_done(d: NodeDriver, entry: ObjectEntry, ok: bool) -> None:
    """That writer ends: the object is READY (or gone) and what waited on it goes on."""
    if ok:
        d.node.store.commit(entry)
    else:
        d.node.store.abandon(entry)
    d.node.operations.wake(entry.key)


def completion(replies: list[Any], op: int) -> tuple[KeyResult, ...]:
    assert len(replies) == 1 and isinstance(replies[0], Completion) and replies[0].id == op, replies
    results: tuple[KeyResult, ...] = replies[0].results
    return results


def assert_at_rest(d: NodeDriver) -> dict[str, Any]:
    st = d.stats()
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0 and st["operations_pending"] == 0, st
    assert st["tables"]["waiters"] == 0 and st["tables"]["handles"] == 0, st["tables"]
    assert st["transfers"]["in_flight"] == 0 and st["transfers"]["prepared"] == 0, st["transfers"]
    return st


def test_admission_refuses_a_repeated_id_and_work_past_max_pending(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, max_pending=1)) as d:
        d.hello(b"c", agent)
        entry = writing(d, b"k")
        assert d.receive(b"c", Deliver(5, (deliver_item(b"k"),))) == []  # waits on the writer
        replies = d.receive(b"c", Deliver(5, (deliver_item(b"k"),)))
        assert isinstance(replies[0], Error) and (replies[0].code, replies[0].path) == (ErrorCode.BAD_STATE, "id")
        replies = d.receive(b"c", Fetch(6, (fetch_item(b"k"),)))
        assert isinstance(replies[0], Error) and replies[0].code == ErrorCode.BUSY
        writer_done(d, entry, ok=False)
        (result,) = completion(d.sent(b"c"), 5)
        assert (result.status, result.code) == (KeyStatus.FAILED, ErrorCode.NOT_FOUND)
        assert_at_rest(d)


def test_a_wait_on_a_writing_key_ends_at_the_deadline_in_node_time(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        entry = writing(d, b"k")
        assert d.receive(b"c", Fetch(2, (fetch_item(b"k"), fetch_item(b"k")), deadline_ms=1_000)) == []
        assert d.stats()["tables"]["waiters"] == 1
        d.tick(0.9)
        assert d.sent(b"c") == []
        d.tick(0.2)
        first, second = completion(d.sent(b"c"), 2)
        assert (first.status, first.code) == (KeyStatus.FAILED, ErrorCode.TIMEOUT)
        assert (second.status, second.code) == (KeyStatus.FAILED, ErrorCode.DUPLICATE_KEY)
        assert d.stats()["outcomes"] == {"fetch.FAILED.TIMEOUT": 1, "fetch.FAILED.DUPLICATE_KEY": 1}
        writer_done(d, entry, ok=False)
        assert d.sent(b"c") == []
        assert_at_rest(d)


def test_abort_ends_the_items_that_wait_and_nothing_else(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        entry = writing(d, b"k")
        assert d.receive(b"c", Deliver(2, (deliver_item(b"k"), deliver_item(b"nothing")))) == []
        replies = d.receive(b"c", Abort(3, 2))
        assert replies[0] == Ack(3), replies
        waited, missing = completion(replies[1:], 2)
        assert (waited.status, waited.code) == (KeyStatus.ABORTED, ErrorCode.ABORTED)
        assert (missing.status, missing.code) == (KeyStatus.FAILED, ErrorCode.NOT_FOUND)
        replies = d.receive(b"c", Abort(4, 2))
        assert isinstance(replies[0], Error) and (replies[0].code, replies[0].path) == (ErrorCode.UNKNOWN_OP, "op")
        writer_done(d, entry, ok=True)
        assert d.sent(b"c") == []
        d.node.store.remove(b"k")
        assert_at_rest(d)


def test_a_fetch_that_waited_gets_a_handle_and_release_returns_it_once(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        entry = writing(d, b"k")
        assert d.receive(b"c", Fetch(2, (fetch_item(b"k"),))) == []
        writer_done(d, entry, ok=True)
        (result,) = completion(d.sent(b"c"), 2)
        assert result.status is KeyStatus.OK and result.handle is not None
        st = d.stats()
        assert st["claims"] == {"total": 1, "handles": 1, "operations": 0, "leases": 0} and st["invariants"] == []
        (released,) = completion(d.receive(b"c", Release(3, (result.handle,))), 3)
        assert released.status is KeyStatus.OK
        (again,) = completion(d.receive(b"c", Release(4, (result.handle,))), 4)
        assert (again.status, again.code) == (KeyStatus.FAILED, ErrorCode.UNKNOWN_HANDLE)
        d.node.store.remove(b"k")
        assert_at_rest(d)


def test_a_deposit_waits_for_the_writer_of_its_key_and_then_finds_it_stored(ipc_dir: Path, agent: ClientAgent) -> None:
    """Spec section 9: DUPLICATE means stored, so a deposit meeting a WRITING key waits."""
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        entry = writing(d, b"k")
        spans = tuple(SrcSpan(name, pool, 1, i * SLOT, SLOT) for i, (name, pool) in enumerate(LAYOUT))
        assert d.receive(b"c", Deposit(2, (DepositItem(b"k", spans),))) == []
        writer_done(d, entry, ok=True)
        (result,) = completion(d.sent(b"c"), 2)
        assert result.status is KeyStatus.DUPLICATE
        d.node.store.remove(b"k")
        assert_at_rest(d)


def test_a_closing_session_releases_its_handles_and_aborts_its_waits(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        entry = writing(d, b"k")
        d.node.store.commit(entry)
        (held,) = completion(d.receive(b"c", Fetch(2, (fetch_item(b"k"),))), 2)
        assert held.handle is not None
        other = writing(d, b"w")
        grace_s = d.node.config.client_grace_ms / 1000
        assert d.receive(b"c", Deliver(3, (deliver_item(b"w"),), deadline_ms=int(2_000 * grace_s))) == []
        d.tick(grace_s + 1)  # silent past its grace, well before the deliver's deadline
        assert len(d.node.sessions) == 0 and d.sent(b"c") == []
        writer_done(d, other, ok=False)
        d.node.store.remove(b"k")
        assert_at_rest(d)


def test_deposit_then_deliver_moves_every_byte_in_process(ipc_dir: Path, agent: ClientAgent) -> None:
    """Real NIXL transfers between the node's agent and the test's: a deposit READs region 1,
    a partial deliver WRITEs two spans into region 2, byte-exact, claims back to zero."""
    src, dst = agent.buffers
    dst[:] = 0
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        spans = tuple(SrcSpan(name, pool, 1, i * SLOT, SLOT) for i, (name, pool) in enumerate(LAYOUT))
        replies = d.receive(b"c", Deposit(2, (DepositItem(b"k", spans),)))
        d.finish_transfers(agent)  # a transfer may also end as it is posted
        (stored,) = completion(replies + d.sent(b"c"), 2)
        assert stored.status is KeyStatus.STORED
        replies = d.receive(b"c", Deliver(3, (deliver_item(b"k", range(1, 3)),), partial=True))
        d.finish_transfers(agent)
        (delivered,) = completion(replies + d.sent(b"c"), 3)
        assert delivered.status is KeyStatus.OK
        expected = np.zeros_like(dst)
        expected[SLOT : 3 * SLOT] = src[SLOT : 3 * SLOT]
        assert_bytes_equal(dst, expected, "the delivered spans")
        d.node.store.remove(b"k")
        assert_at_rest(d)
