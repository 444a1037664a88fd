"""Read grants in process (``kvcr_node.leases``, ``kvcr_node.grants``), with a fake clock.

A version-5 lease that asks to read gets, per key held here, its span names and each
span's pool and slot, and the node's agent once when asked; a renew says whether the lease
held without a break. No grant without ``client_transfers``, below version 5, or past the
span limit; while grants are outstanding the node's idle wait stays at the grant pace.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.grant_progress import GRANT_PROGRESS_S
from kvcr_node.grants import grant_rows
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome, ObjectEntry
from kvcr_protocol import DEFAULT_LIMITS, Ack, Hello, Lease, LeaseReply, LeaseStatus, ReleaseLease, RenewLease, Welcome
from kvcr_protocol.columns import U32, pack
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/grants.sock", name="grants",
                      pools=(PoolSpec("a", SLOT, 8, "dram"), PoolSpec("b", 2 * SLOT, 8, "dram")),
                      log_level="WARNING", client_grace_ms=7_000, heartbeat_ms=2_000, lease_ttl_ms=1_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("grants-client")
    yield a
    a.close()


def stored(d: NodeDriver, key: bytes, layout: tuple[tuple[str, str], ...]) -> ObjectEntry:
    outcome, entry = d.node.store.begin_deposit(key, layout)
    assert outcome is DepositOutcome.NEW and entry is not None
    d.node.store.commit(entry)
    return entry


def one_reply(replies: list[Any], request: int) -> LeaseReply:
    assert len(replies) == 1 and isinstance(replies[0], LeaseReply) and replies[0].id == request, replies
    reply: LeaseReply = replies[0]
    return reply


def test_a_read_lease_gets_the_slots_of_every_key_held_here(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        x = stored(d, b"x", (("k", "a"), ("v", "b")))
        y = stored(d, b"y", (("k", "a"), ("v", "b")))
        reply = one_reply(d.receive(b"c", Lease(2, (b"x", b"absent", b"y", b"x"), read=True, node_md=True)), 2)
        assert reply.held and reply.grant is not None and len(reply.grant) == 4
        rows = list(reply.grant.keys(DEFAULT_LIMITS))
        assert [(i, names, list(pools)) for i, names, pools, _ in rows] == [
            (0, ("k", "v"), [0, 1]), (2, ("k", "v"), [0, 1])]  # the repeated x: its first row serves
        assert [slots for *_, slots in rows] == [list(x.slots), list(y.slots)]
        assert reply.grant.layouts == ("k\0v",)
        node = reply.grant.node
        assert node is not None and node.agent == d.node.agent.name and node.grace_ms == 7_000
        memories = [d.node.memories["a"], d.node.memories["b"]]
        assert [(p.region, p.address, p.length) for p in node.pools] == [
            (i, m.address, m.spec.size) for i, m in enumerate(memories)]
        assert d.node.leases.granted == 1 and d.stats()["leases"]["read_grants"] == 1
        assert d.node._idle_timeout_ms() <= GRANT_PROGRESS_S * 1000

        # A second read lease that does not ask for the node's agent gets none.
        again = one_reply(d.receive(b"c", Lease(3, (b"y",), read=True)), 3)
        assert again.grant is not None and again.grant.node is None
        # A renew says the lease held without a break.
        renewed = one_reply(d.receive(b"c", RenewLease(4, reply.lease)), 4)
        assert renewed.held and renewed.grant is None and renewed.columns is None
        assert d.receive(b"c", ReleaseLease(5, reply.lease)) == [Ack(5)]
        assert d.receive(b"c", ReleaseLease(6, again.lease)) == [Ack(6)]
        assert d.node.leases.granted == 0 and d.stats()["invariants"] == []


def test_an_expired_grant_stops_the_grant_pace(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, b"x", (("k", "a"),))
        reply = one_reply(d.receive(b"c", Lease(2, (b"x",), None, 500, read=True)), 2)
        assert reply.grant is not None and d.node.leases.granted == 1
        d.tick(0.6)
        assert d.node.leases.granted == 0 and d.stats()["invariants"] == []


@pytest.mark.parametrize("how", ["client_transfers off", "not asked", "version 4"])
def test_no_grant_without_client_transfers_below_version_5_or_unasked(ipc_dir: Path, agent: ClientAgent, how: str) -> None:
    with node_driver(config(ipc_dir, client_transfers=how != "client_transfers off")) as d:
        version = 4 if how == "version 4" else 5
        hello = Hello(1, tuple(range(1, version + 1)), agent.name, agent.name, agent.metadata, agent.regions)
        assert isinstance(d.receive(b"c", hello, version)[0], Welcome)
        stored(d, b"x", (("k", "a"),))
        read = how != "not asked" and version == 5
        reply = one_reply(d.receive(b"c", Lease(2, (b"x",), read=read, node_md=read), version), 2)
        assert reply.lease and reply.columns is not None and reply.columns.status_of(0) is LeaseStatus.LEASED
        assert reply.grant is None and d.node.leases.granted == 0
        assert reply.held is (version == 5)
        assert d.receive(b"c", ReleaseLease(3, reply.lease), version) == [Ack(3)]


def test_grant_rows_stop_at_the_span_limit_and_give_a_repeated_key_one_row(ipc_dir: Path) -> None:
    with node_driver(config(ipc_dir)) as d:
        x = stored(d, b"x", (("k", "a"), ("v", "a")))
        y = stored(d, b"y", (("k", "a"),))
        z = stored(d, b"z", (("k", "a"), ("v", "a")))
        keys = (b"x", b"y", b"x", b"x", b"z")
        status = bytes([LeaseStatus.LEASED] * 5)
        rows = grant_rows([x, y, z], keys, status, {"a": 0, "b": 1}, max_spans=4)
        assert rows[0] == (("k", "v"), bytes([0, 0]), pack(x.slots, U32))
        assert rows[1] == (("k",), bytes([0]), pack(y.slots, U32))
        # Repetitions get no row (the first serves, by key) and cost no spans: a lease that
        # repeats a key cannot make its reply grow. z would take 2 + 1 + 2 > 4 spans.
        assert rows[2] is None and rows[3] is None and rows[4] is None
        many = grant_rows([x], (b"x",) * 4096, bytes([LeaseStatus.LEASED] * 4096), {"a": 0})
        assert many[0] is not None and many[1:] == [None] * 4095
        assert grant_rows([x], (b"x",), bytes([LeaseStatus.PENDING]), {"a": 0}) == [None]
