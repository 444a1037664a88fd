"""A reader's integrity report (``suspect``, spec section 6.12) in process, with a fake clock.

The node reads a reported object itself and condemns it only when its bytes no longer
match the digests it took when the object became READY: a report of an intact object drops
nothing, whoever sends it. An object held by a lease leaves the store at once but keeps
its slots until the lease ends. What the node reads for reports is bounded node-wide and
per session; past it, keys are answered BUSY with nothing read. Every slot comes back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_node.suspects import SESSION_SHARE
from kvcr_protocol import (
    Ack,
    Commit,
    Completion,
    DepositItem,
    ErrorCode,
    KeyStatus,
    Lease,
    Put,
    PutReply,
    ReleaseLease,
    SrcSpan,
    Suspect,
)
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096
SLOTS = 8


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/suspects.sock", name="suspects",
                      pools=(PoolSpec("a", SLOT, SLOTS, "dram"),), log_level="ERROR", heartbeat_ms=0)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("suspects-client", np.zeros(4 * SLOT, np.uint8))
    yield a
    a.close()


def store(d: NodeDriver, request: int, key: bytes) -> None:
    """``key`` stored READY in two slots (a put and its commit; its bytes are what the slots held)."""
    items = (DepositItem(key, tuple(SrcSpan(f"L{j}", "a", 1, j * SLOT, SLOT) for j in range(2))),)
    reply = d.receive(b"c", Put(request, items))
    assert len(reply) == 1 and isinstance(reply[0], PutReply) and reply[0].put, reply
    done = d.receive(b"c", Commit(request + 1, reply[0].put))
    assert isinstance(done[0], Completion) and done[0].results[0].status is KeyStatus.STORED, done


def overwrite(d: NodeDriver, key: bytes, span: int) -> None:
    """What a grant holder can do (spec section 14): change a stored span's bytes in place."""
    entry = d.node.store.lookup(key)
    assert entry is not None
    slot = entry.slots[span]
    d.node.memories["a"].array[slot * SLOT:(slot + 1) * SLOT] = 0xA5


def report(d: NodeDriver, identity: bytes, request: int, *keys: bytes) -> list[tuple[KeyStatus, int]]:
    replies = d.receive(identity, Suspect(request, keys))
    assert len(replies) == 1 and isinstance(replies[0], Completion) and replies[0].id == request, replies
    return [(r.status, r.code) for r in replies[0].results]


def counters(d: NodeDriver) -> dict[str, int]:
    return dict(d.stats()["counters"])


OK = (KeyStatus.OK, 0)
CHANGED = (KeyStatus.FAILED, ErrorCode.DIGEST_MISMATCH)
ABSENT = (KeyStatus.FAILED, ErrorCode.NOT_FOUND)
BUSY = (KeyStatus.FAILED, ErrorCode.BUSY)


def test_a_report_of_an_intact_object_drops_nothing(ipc_dir: Path, agent: ClientAgent) -> None:
    """A client's word alone drops nothing: another session reporting a key it never read
    gets OK, and the object stays."""
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        d.hello(b"other", agent)
        store(d, 2, b"x")
        assert report(d, b"other", 4, b"x", b"absent", b"x") == [OK, ABSENT, OK]
        assert d.node.store.lookup(b"x") is not None
        c = counters(d)
        assert c["suspects"] == 2 and c["suspects_unfounded"] == 1 and "objects_condemned" not in c
        assert d.stats()["invariants"] == []


def test_a_changed_object_is_condemned_and_its_slots_come_back(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        store(d, 2, b"x")
        store(d, 4, b"y")
        overwrite(d, b"x", 1)
        assert report(d, b"c", 6, b"x", b"y") == [CHANGED, OK]
        assert d.node.store.lookup(b"x") is None and d.node.store.lookup(b"y") is not None
        st = d.stats()
        assert st["pools"]["a"]["free"] == SLOTS - 2 and st["invariants"] == []
        assert st["counters"]["suspects_confirmed"] == 1 and st["counters"]["objects_condemned"] == 1
        assert report(d, b"c", 7, b"x") == [ABSENT]  # gone: a second report finds nothing
        store(d, 8, b"x")  # and the key may be stored again
        assert report(d, b"c", 10, b"x") == [OK]


def test_a_leased_object_leaves_at_once_and_its_slots_with_the_lease(ipc_dir: Path, agent: ClientAgent) -> None:
    """A reader may still be READing the slots of a leased object: they are not reused until
    the lease ends, while the key is gone from lookups and leases at once."""
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        store(d, 2, b"x")
        lease = d.receive(b"c", Lease(4, (b"x",), read=True))[0]
        overwrite(d, b"x", 0)
        assert report(d, b"c", 5, b"x") == [CHANGED]
        st = d.stats()
        assert d.node.store.lookup(b"x") is None and st["pools"]["a"]["free"] == SLOTS - 2
        assert st["condemned"] == 1 and st["invariants"] == []
        assert d.receive(b"c", ReleaseLease(6, lease.lease)) == [Ack(6)]
        st = d.stats()
        assert st["pools"]["a"]["free"] == SLOTS and st["condemned"] == 0 and st["invariants"] == []


def test_reading_for_reports_is_bounded_per_session_and_node_wide(ipc_dir: Path, agent: ClientAgent) -> None:
    """A flood of reports costs the node at most ``suspect_bytes_per_s`` of reading a second,
    one session at most its share; past it, keys are BUSY and nothing is read. The budgets
    refill with time."""
    rate = 4 * 2 * SLOT  # four two-slot objects a second, one of them per session
    assert rate * SESSION_SHARE == 2 * SLOT
    with node_driver(config(ipc_dir, suspect_bytes_per_s=rate)) as d:
        for who in (b"c", b"d", b"e", b"f", b"g"):
            d.hello(who, agent)
        store(d, 2, b"x")
        assert report(d, b"c", 4, *[b"x"] * 3) == [OK] * 3  # one key, read once
        assert report(d, b"c", 5, b"x") == [BUSY]
        for request in range(6, 206):  # the flood
            assert report(d, b"c", request, b"x") == [BUSY]
        assert [report(d, who, 300, b"x") for who in (b"d", b"e", b"f", b"g")] == [[OK], [OK], [OK], [BUSY]]
        c = counters(d)
        assert c["suspects_unfounded"] == 4 and c["suspects_refused"] == 202
        d.tick(1.0)
        assert report(d, b"c", 400, b"x") == [OK]
        assert d.stats()["invariants"] == []



def test_a_key_stored_again_while_its_condemned_object_is_leased(ipc_dir: Path, agent: ClientAgent) -> None:
    """The key of a condemned object may be stored again, with another layout, and leased,
    while a lease still holds the condemned one: both are accounted apart, and every slot
    comes back when the leases end."""
    with node_driver(config(ipc_dir, lease_pool_fraction=1.0, lease_session_fraction=1.0)) as d:
        d.hello(b"c", agent)
        d.hello(b"other", agent)
        store(d, 2, b"x")
        old = d.receive(b"c", Lease(4, (b"x",), read=True))[0]
        overwrite(d, b"x", 0)
        assert report(d, b"c", 5, b"x") == [CHANGED]
        items = (DepositItem(b"x", tuple(SrcSpan(f"M{j}", "a", 1, j * SLOT, SLOT) for j in range(3))),)
        reply = d.receive(b"c", Put(6, items))[0]
        assert isinstance(d.receive(b"c", Commit(7, reply.put))[0], Completion)
        new = d.receive(b"other", Lease(8, (b"x",), read=True))[0]
        mine = d.receive(b"c", Lease(9, (b"x",), read=True))[0]
        assert new.lease and mine.lease and d.stats()["leases"]["objects"] == 2  # the condemned one and the new
        assert d.stats()["invariants"] == []
        for who, request, lease in ((b"c", 10, old), (b"other", 11, new), (b"c", 12, mine)):
            assert d.receive(who, ReleaseLease(request, lease.lease)) == [Ack(request)]
            assert d.stats()["invariants"] == []
        st = d.stats()
        assert st["pools"]["a"]["free"] == SLOTS - 3 and st["leases"]["held"] == 0 and st["condemned"] == 0
