"""Leases in process (``kvcr_node.leases``), message by message, with a fake clock.

Objects are put in the node's store by the test (READY, or WRITING as during another
writer's fill), so what a lease answers for every state, its time to live and renewal,
its end with the session, the limits and the accounting it keeps are checked without
waiting. Lease requests a hint sends to a source are checked across real nodes in
tests/integration/test_remote_leases.py.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome, ObjectEntry
from kvcr_protocol import (
    Ack,
    Bye,
    Error,
    ErrorCode,
    Lease,
    LeaseEnded,
    LeaseReply,
    LeaseStatus,
    ReleaseLease,
    RenewLease,
    SubmitHint,
)
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/leases.sock", name="leases", pools=(PoolSpec("kv", SLOT, 16, "dram"),),
                      log_level="WARNING", client_grace_ms=600_000, heartbeat_ms=2_000, lease_ttl_ms=1_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("leases-client")
    yield a
    a.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[ClientAgent]:
    """An agent with memory announced (regions), as an engine's: its sessions share lease budgets."""
    a = ClientAgent("leases-engine", np.zeros(SLOT, dtype=np.uint8))
    yield a
    a.close()


def stored(d: NodeDriver, key: bytes, spans: int = 1, ready: bool = True) -> ObjectEntry:
    outcome, entry = d.node.store.begin_deposit(key, tuple((f"L{i}", "kv") for i in range(spans)))
    assert outcome is DepositOutcome.NEW and entry is not None
    if ready:
        d.node.store.commit(entry)
    return entry


def reply_of(replies: list[Any], request: int) -> LeaseReply:
    assert len(replies) == 1 and isinstance(replies[0], LeaseReply) and replies[0].id == request, replies
    reply: LeaseReply = replies[0]
    return reply


def statuses(reply: LeaseReply) -> list[LeaseStatus]:
    assert reply.columns is not None
    return list(reply.columns)


def refused(replies: list[Any], code: ErrorCode) -> Error:
    assert len(replies) == 1 and isinstance(replies[0], Error) and replies[0].code == code, replies
    error: Error = replies[0]
    return error


def at_rest(d: NodeDriver) -> dict[str, Any]:
    st = d.stats()
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0 and st["leases"]["held"] == 0, (st["claims"], st["leases"])
    assert st["leases"]["pinned_slots"] == {"kv": 0} and st["tables"]["lease_holders"] == 0
    return st


def test_each_state_answers_its_status_and_a_repeated_key_is_held_once(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        ready = stored(d, b"ready", spans=2)
        stored(d, b"writing", ready=False)
        reply = reply_of(d.receive(b"c", Lease(2, (b"ready", b"writing", b"absent", b"ready"))), 2)
        assert statuses(reply) == [LeaseStatus.LEASED, LeaseStatus.PENDING, LeaseStatus.MISS, LeaseStatus.LEASED]
        assert reply.columns is not None and reply.columns.tier_of(0) == "dram" and reply.columns.tier_of(2) == ""
        assert reply.lease != 0 and reply.ttl_ms == 1_000
        assert ready.claims == 1  # held once, however often it is named
        st = d.stats()
        assert st["leases"]["pinned_slots"] == {"kv": 2} and st["claims"]["leases"] == 1 and st["invariants"] == []
        assert d.receive(b"c", ReleaseLease(3, reply.lease)) == [Ack(3)]
        d.node.store.abandon(d.node.store.lookup(b"writing"))  # type: ignore[arg-type]
        at_rest(d)


def test_expiry_on_the_nodes_clock_and_renewal(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        entry = stored(d, b"k")
        lease = reply_of(d.receive(b"c", Lease(2, (b"k",), None, 500)), 2).lease
        d.tick(0.4)
        assert d.sent(b"c") == []
        renewed = reply_of(d.receive(b"c", RenewLease(3, lease, 2_000)), 3)
        assert (renewed.lease, renewed.ttl_ms, renewed.columns) == (lease, 2_000, None)
        d.tick(0.5)  # past the first time to live: renewed, still held
        assert d.sent(b"c") == [] and entry.claims == 1
        d.tick(1.6)  # past the renewal
        ended = d.sent(b"c")
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnded), ended
        assert (ended[0].lease, ended[0].code, ended[0].keys) == (lease, ErrorCode.LEASE_EXPIRED, ())
        assert entry.claims == 0 and d.stats()["leases"]["expired"] == 1
        # Ended: renewing or releasing it again is UNKNOWN_LEASE, and frees nothing twice.
        assert refused(d.receive(b"c", RenewLease(4, lease)), ErrorCode.UNKNOWN_LEASE).path == "lease"
        refused(d.receive(b"c", ReleaseLease(5, lease)), ErrorCode.UNKNOWN_LEASE)
        at_rest(d)


def test_renewal_is_capped_and_zero_means_the_leases_own_ttl(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, max_lease_ttl_ms=3_000)) as d:
        d.hello(b"c", agent)
        stored(d, b"k")
        reply = reply_of(d.receive(b"c", Lease(2, (b"k",), None, 10**9)), 2)
        assert reply.ttl_ms == 3_000
        assert reply_of(d.receive(b"c", RenewLease(3, reply.lease, 0)), 3).ttl_ms == 3_000
        assert d.receive(b"c", ReleaseLease(4, reply.lease)) == [Ack(4)]
        at_rest(d)


def test_another_sessions_lease_is_unknown(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        d.hello(b"intruder", agent)
        entry = stored(d, b"k")
        lease = reply_of(d.receive(b"c", Lease(2, (b"k",))), 2).lease
        refused(d.receive(b"intruder", ReleaseLease(2, lease)), ErrorCode.UNKNOWN_LEASE)
        refused(d.receive(b"intruder", RenewLease(3, lease)), ErrorCode.UNKNOWN_LEASE)
        assert entry.claims == 1
        assert d.receive(b"c", Bye(3)) == [Ack(3)]  # its session ends: so does its lease, silently
        assert entry.claims == 0 and d.sent(b"c") == []
        assert d.stats()["leases"]["ended_with_session"] == 1
        at_rest(d)


def test_limits(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, max_leases_per_session=2, max_leased_slots_per_session=5,
                            lease_pool_fraction=0.25, lease_session_fraction=1.0)) as d:
        d.hello(b"c", agent)
        for i in range(4):
            stored(d, b"k%d" % i, spans=2)
        # Four of sixteen slots may be pinned: two objects of two slots.
        first = reply_of(d.receive(b"c", Lease(2, (b"k0", b"k1", b"k2"))), 2)
        assert statuses(first) == [LeaseStatus.LEASED, LeaseStatus.LEASED, LeaseStatus.LEASE_LIMIT]
        # The session holds k0 already: a second lease of it (two requests sharing a prefix)
        # pins nothing more, neither the pool's budget nor the session's slots (4 of 5).
        second = reply_of(d.receive(b"c", Lease(3, (b"k0",))), 3)
        assert statuses(second) == [LeaseStatus.LEASED] and second.lease != 0
        st = d.stats()
        assert st["leases"]["keys_refused_limit"] == 1 and st["leases"]["held"] == 2
        assert d.receive(b"c", ReleaseLease(11, first.lease)) == [Ack(11)]
        # k0 is still held by the second lease: the session's charge for it stays, k1's went.
        session = d.node.sessions.get(b"c")
        assert session is not None and session.leased_slots == 2 and {e.key: n for e, n in session.held_objects.items()} == {b"k0": 1}
        first = second
        third = reply_of(d.receive(b"c", Lease(4, (b"absent",))), 4)
        assert third.lease == 0  # holds nothing: not kept, not counted
        d.hello(b"d", agent)
        held = reply_of(d.receive(b"d", Lease(5, (b"k0",))), 5)
        assert statuses(held) == [LeaseStatus.LEASED]
        again = reply_of(d.receive(b"d", Lease(6, (b"k1",))), 6)
        refused(d.receive(b"d", Lease(7, (b"k1",))), ErrorCode.LEASE_LIMIT)  # two leases per session
        for identity, lease, request in ((b"c", first.lease, 8), (b"d", held.lease, 9), (b"d", again.lease, 10)):
            assert d.receive(identity, ReleaseLease(request, lease)) == [Ack(request)]
        at_rest(d)


def test_a_prefix_leased_twice_by_one_session_counts_once(ipc_dir: Path, agent: ClientAgent) -> None:
    """Two requests sharing a prefix lease the same objects: the session's share, full with
    the first lease, still admits the second, and the charge stays until the last ends."""
    with node_driver(config(ipc_dir, lease_pool_fraction=0.5, lease_session_fraction=1.0,
                            max_leased_slots_per_session=8)) as d:
        d.hello(b"c", agent)
        keys = tuple(b"p%d" % i for i in range(4))
        for k in keys:
            stored(d, k, spans=2)
        first = reply_of(d.receive(b"c", Lease(2, keys)), 2)
        assert statuses(first) == [LeaseStatus.LEASED] * 4  # 8 slots: the session's limit, and the budget
        second = reply_of(d.receive(b"c", Lease(3, keys[:3])), 3)
        assert statuses(second) == [LeaseStatus.LEASED] * 3
        session = d.node.sessions.get(b"c")
        assert session is not None and session.leased_slots == 8 and session.pool_slots["kv"] == 8
        assert d.stats()["invariants"] == []
        assert d.receive(b"c", ReleaseLease(4, first.lease)) == [Ack(4)]
        assert session.leased_slots == 6 and {e.key: n for e, n in session.held_objects.items()} == dict.fromkeys(keys[:3], 1)
        assert d.stats()["invariants"] == []
        assert d.receive(b"c", ReleaseLease(5, second.lease)) == [Ack(5)]
        assert session.leased_slots == 0 and not session.pool_slots and not session.held_objects
        at_rest(d)


def test_a_lease_keeps_its_objects_from_eviction_and_removal(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, lease_pool_fraction=1.0)) as d:
        d.hello(b"c", agent)
        for i in range(16):
            stored(d, b"k%d" % i)
        lease = reply_of(d.receive(b"c", Lease(2, tuple(b"k%d" % i for i in range(16)))), 2).lease
        outcome, _ = d.node.store.begin_deposit(b"new", (("L0", "kv"),))
        assert outcome is DepositOutcome.CAPACITY  # nothing may be evicted
        assert d.receive(b"c", ReleaseLease(3, lease)) == [Ack(3)]
        outcome, entry = d.node.store.begin_deposit(b"new", (("L0", "kv"),))
        assert outcome is DepositOutcome.NEW and entry is not None
        d.node.store.abandon(entry)
        at_rest(d)


def test_a_lease_is_an_access_for_lru_in_key_order(ipc_dir: Path, agent: ClientAgent) -> None:
    """A client that holds a lease reads what it holds, under a read grant without the node
    seeing it: the lease is LRU's only sign of that use. Without it the objects engines use
    most aged as if never read (bench/vllm_workload.py: 0.91 of an exact LRU's hits)."""
    with node_driver(config(ipc_dir, lease_pool_fraction=1.0, policy="lru")) as d:
        d.hello(b"c", agent)
        for i in range(16):
            stored(d, b"k%d" % i)  # k0 is the least recently used
        lease = reply_of(d.receive(b"c", Lease(2, (b"k1", b"k0"))), 2).lease
        assert d.receive(b"c", ReleaseLease(3, lease)) == [Ack(3)]
        evicted = []
        for i in range(15):
            outcome, entry = d.node.store.begin_deposit(b"new%d" % i, (("L0", "kv"),))
            assert outcome is DepositOutcome.NEW and entry is not None
            d.node.store.commit(entry)
            evicted = [k for k in (b"k0", b"k1", b"k2") if d.node.store.lookup(k) is None]
            if i == 0:
                assert evicted == [b"k2"], "the leased two are the most recently used now"
        assert d.node.store.lookup(b"k0") is not None and d.node.store.lookup(b"k1") is None, \
            "k1 was leased before k0: it goes first"
        at_rest(d)


def test_keys_a_lease_holds_past_a_gap_are_no_access(ipc_dir: Path, agent: ClientAgent) -> None:
    """An engine looks up a prefix: a block held after a missing one is no use to it, and its
    lease does not make it recent."""
    with node_driver(config(ipc_dir, lease_pool_fraction=1.0, policy="lru")) as d:
        d.hello(b"c", agent)
        for i in range(16):
            stored(d, b"k%d" % i)
        lease = reply_of(d.receive(b"c", Lease(2, (b"k1", b"absent", b"k0"))), 2).lease
        assert d.receive(b"c", ReleaseLease(3, lease)) == [Ack(3)]
        outcome, entry = d.node.store.begin_deposit(b"new", (("L0", "kv"),))
        assert outcome is DepositOutcome.NEW and entry is not None
        d.node.store.commit(entry)
        assert d.node.store.lookup(b"k0") is None, "k0, past the gap, is still the least recently used"
        assert d.node.store.lookup(b"k1") is not None
        at_rest(d)


def test_leases_and_saves_over_shared_prefixes_get_an_exact_lrus_hits(ipc_dir: Path, agent: ClientAgent) -> None:
    """An engine's pattern under pressure: lease the leading blocks a request finds, read
    them, release, save the request's blocks. The node's LRU gets exactly the hits an exact
    LRU of its size gets on the same trace (bench/vllm_workload.py measures it under vLLM)."""
    rng = random.Random(5)
    prefixes = [[b"p%d/%d" % (p, b) for b in range(4)] for p in range(8)]
    requests = [rng.choices(prefixes, [1 / (r + 1) for r in range(8)])[0] + [b"own%d" % n] for n in range(80)]
    lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    expected = 0
    for blocks in requests:
        for key in blocks:
            if key not in lru:
                break
            expected += 1
            lru.move_to_end(key)
        for key in blocks:
            lru[key] = None
            lru.move_to_end(key)
            while len(lru) > 16:
                lru.popitem(last=False)
    with node_driver(config(ipc_dir, lease_pool_fraction=1.0, policy="lru")) as d:
        d.hello(b"c", agent)
        hits = 0
        for n, blocks in enumerate(requests):
            reply = reply_of(d.receive(b"c", Lease(2 * n + 2, tuple(blocks))), 2 * n + 2)
            found = statuses(reply)
            leading = next((i for i, status in enumerate(found) if status is not LeaseStatus.LEASED), len(found))
            hits += leading
            if reply.lease:
                assert d.receive(b"c", ReleaseLease(2 * n + 3, reply.lease)) == [Ack(2 * n + 3)]
            for key in blocks:
                if d.node.store.lookup(key) is None:
                    stored(d, key)
        assert 0 < hits == expected
        at_rest(d)


def test_a_hint_naming_this_node_asks_no_source(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        assert d.receive(b"c", SubmitHint(2, "r", d.node.endpoint, (b"k",))) == [Ack(2)]
        reply = reply_of(d.receive(b"c", Lease(3, (b"k",), "r")), 3)
        assert statuses(reply) == [LeaseStatus.MISS] and d.stats()["tables"]["links"] == 0
        at_rest(d)


def test_shutdown_ends_every_lease_and_tells_its_client(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        stored(d, b"k")
        lease = reply_of(d.receive(b"c", Lease(2, (b"k",))), 2).lease
        d.node.leases.end_all(ErrorCode.SHUTTING_DOWN, "stopping")
        ended = d.sent(b"c")
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnded) and ended[0].code == ErrorCode.SHUTTING_DOWN
        assert ended[0].lease == lease
        at_rest(d)


def test_a_session_holds_at_most_its_share_of_a_pools_lease_budget(
    ipc_dir: Path, agent: ClientAgent, engine: ClientAgent,
) -> None:
    """Audit row 8: one client leased a pool's whole budget and every other got LEASE_LIMIT.
    A session now holds at most ceil(max(lease_session_fraction, 1/sessions) * budget)."""
    with node_driver(config(ipc_dir, lease_pool_fraction=1.0, lease_session_fraction=0.25)) as d:
        keys = [b"k%d" % i for i in range(16)]
        for k in keys:
            stored(d, k)
        d.hello(b"alone", engine)
        for n in range(3):
            d.hello(b"tool%d" % n, agent)  # sessions without memory or leases (tools) share nothing
        # A lone engine may take the whole budget (1/sessions = 1): what a single engine expects.
        alone = reply_of(d.receive(b"alone", Lease(2, tuple(keys))), 2)
        assert statuses(alone) == [LeaseStatus.LEASED] * 16
        assert d.receive(b"alone", ReleaseLease(3, alone.lease)) == [Ack(3)]
        # Two engines: each may hold half of the 16 slots; the greedy one is refused beyond.
        d.hello(b"greedy", engine)
        greedy = reply_of(d.receive(b"greedy", Lease(2, tuple(keys), None, 600_000)), 2)
        assert statuses(greedy) == [LeaseStatus.LEASED] * 8 + [LeaseStatus.LEASE_LIMIT] * 8
        more = reply_of(d.receive(b"greedy", Lease(3, tuple(keys[8:]))), 3)
        assert statuses(more) == [LeaseStatus.LEASE_LIMIT] * 8 and more.lease == 0
        assert d.stats()["leases"]["keys_refused_limit"] == 16
        # The other session still gets its leases, of the keys left and of one the greedy holds
        # (which counts against its own share: it holds it too).
        victim = reply_of(d.receive(b"alone", Lease(4, tuple(keys[8:]))), 4)
        assert statuses(victim) == [LeaseStatus.LEASED] * 8
        shared = reply_of(d.receive(b"alone", Lease(5, (keys[0],))), 5)
        assert statuses(shared) == [LeaseStatus.LEASE_LIMIT]  # its share (8) is full
        st = d.stats()
        assert st["leases"]["pinned_slots"] == {"kv": 16} and st["invariants"] == []
        assert d.receive(b"alone", ReleaseLease(6, victim.lease)) == [Ack(6)]
        # Eight sessions: the share is the floor, a quarter (4 slots), not an eighth.
        for n in range(6):
            d.hello(b"idle%d" % n, engine)
        fourth = reply_of(d.receive(b"alone", Lease(7, tuple(keys[8:]))), 7)
        assert statuses(fourth) == [LeaseStatus.LEASED] * 4 + [LeaseStatus.LEASE_LIMIT] * 4
        # A renewal pins nothing more and is never refused for the share.
        assert reply_of(d.receive(b"greedy", RenewLease(8, greedy.lease)), 8).lease == greedy.lease
        for identity, lease, request in ((b"greedy", greedy.lease, 9), (b"alone", fourth.lease, 10)):
            assert d.receive(identity, ReleaseLease(request, lease)) == [Ack(request)]
        at_rest(d)


def test_a_first_comer_gives_back_what_later_sessions_shares_need(
    ipc_dir: Path, agent: ClientAgent, engine: ClientAgent,
) -> None:
    """Issue: the first client to lease took the whole budget (its share was 1/1 then) for
    its leases' time to live, and a second got 0 of its keys. Now the holder over its share
    gives back its oldest leases, told with lease_end LEASE_LIMIT, as the second needs."""
    with node_driver(config(ipc_dir, lease_pool_fraction=0.75, lease_session_fraction=0.25)) as d:
        keys = [b"k%d" % i for i in range(12)]
        for k in keys:
            stored(d, k)
        d.hello(b"first", engine)
        older = reply_of(d.receive(b"first", Lease(2, tuple(keys[:6]), None, 600_000)), 2)
        newer = reply_of(d.receive(b"first", Lease(3, tuple(keys[6:]), None, 600_000)), 3)
        assert statuses(older) == statuses(newer) == [LeaseStatus.LEASED] * 6  # alone: the whole budget (12)
        d.hello(b"second", engine)
        d.sent(b"first")
        # Two sessions: shares of 6. The budget is full with the first's leases.
        fresh = [b"f%d" % i for i in range(4)]
        for k in fresh:
            stored(d, k)
        second = reply_of(d.receive(b"second", Lease(2, tuple(fresh))), 2)
        assert statuses(second) == [LeaseStatus.LEASED] * 4
        ended = d.sent(b"first")
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnded), ended
        assert (ended[0].lease, ended[0].code, ended[0].keys) == (older.lease, ErrorCode.LEASE_LIMIT, ())
        st = d.stats()
        assert st["leases"]["taken_back"] == 1 and st["invariants"] == []
        # The first keeps its share (6 slots, its newer lease); asking for more is refused,
        # and takes nothing back from the second, which is within its share.
        more = reply_of(d.receive(b"first", Lease(4, tuple(keys[:4]))), 4)
        assert statuses(more) == [LeaseStatus.LEASE_LIMIT] * 4 and d.stats()["leases"]["taken_back"] == 1
        assert refused(d.receive(b"first", RenewLease(5, older.lease)), ErrorCode.UNKNOWN_LEASE).path == "lease"
        for identity, lease, request in ((b"first", newer.lease, 6), (b"second", second.lease, 7)):
            assert d.receive(identity, ReleaseLease(request, lease)) == [Ack(request)]
        at_rest(d)


def test_a_share_of_one_lets_a_session_take_the_whole_budget(ipc_dir: Path, engine: ClientAgent) -> None:
    with node_driver(config(ipc_dir, lease_pool_fraction=0.5, lease_session_fraction=1.0)) as d:
        keys = [b"k%d" % i for i in range(16)]
        for k in keys:
            stored(d, k)
        d.hello(b"c", engine)
        d.hello(b"other", engine)
        reply = reply_of(d.receive(b"c", Lease(2, tuple(keys))), 2)
        assert statuses(reply) == [LeaseStatus.LEASED] * 8 + [LeaseStatus.LEASE_LIMIT] * 8  # the pool's budget
        assert d.receive(b"c", ReleaseLease(3, reply.lease)) == [Ack(3)]
        at_rest(d)
