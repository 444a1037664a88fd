"""Leases against real ``kvcr-node`` processes (spec section 6.11), on one node.

A leased object survives eviction pressure while others go in policy order, is delivered
byte for byte under the lease, and becomes evictable again, exactly, when the lease is
released, expires or its session ends. Limits answer LEASE_LIMIT; a second release and
another client's lease id are clean errors. After each test the node holds no lease,
claim or pinned slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from kvcr_client import ArgumentError, AsyncClient, Client, ErrorCode, LeaseHandle, LeaseStatus, NodeError, Span
from kvcr_protocol import PROTOCOL_VERSIONS, Hello, Lease, LeaseReply, ReleaseLease, Welcome, decode, encode
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import ClientAgent, NodeProcess
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
SLOTS = 16
RAW_TIMEOUT_MS = 5000

pytestmark = pytest.mark.usefixtures("node_left_clean")


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return ("--pool", f"kv:4KiB:{SLOTS}", "--policy", "fifo", "--lease-pool-fraction", "0.5")


def put(client: Client, register: Registrar, keys: list[bytes], seed: int) -> np.ndarray:
    """Deposit one-slot objects ``keys`` (patterned bytes); returns their source buffer."""
    src = pattern(len(keys) * SLOT, seed)
    region = register(src)
    res = client.deposit({k: [Span("L0", region, i * SLOT, SLOT, "kv")] for i, k in enumerate(keys)}).result(RESULT_TIMEOUT_S)
    assert res.all_ok, res
    return src


def delivered(client: Client, register: Registrar, key: bytes) -> np.ndarray | None:
    """The bytes of ``key`` delivered into fresh memory, or None when the node has it not."""
    dst = pattern(SLOT, 99)
    region = register(dst)
    res = client.deliver({key: [Span("L0", region, 0, SLOT)]}).result(RESULT_TIMEOUT_S)
    return dst if res[key].ok else None


def present(client: Client, keys: list[bytes]) -> list[bool]:
    return [p.presence.name == "HIT" for p in client.query(keys).result(RESULT_TIMEOUT_S).values()]


def test_lease_answers_per_key_and_holds_against_eviction(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    keys = [key(f"k{i}") for i in range(SLOTS)]
    src = put(client, register, keys, seed=1)
    leased = keys[:4]  # the oldest: FIFO would evict them first
    lease = client.lease([*leased, key("absent"), leased[0]], ttl_ms=60_000).result(RESULT_TIMEOUT_S)
    assert lease.id != 0 and lease.ended is None
    assert [lease.status(k) for k in leased] == [LeaseStatus.LEASED] * 4
    assert lease.status(key("absent")) is LeaseStatus.MISS
    assert lease.tier(leased[0]) == "dram" and lease.tier(key("absent")) == ""
    assert lease.held == frozenset(leased) and lease.held_prefix() == 4
    st = stats(client)
    assert st["leases"]["held"] == 1 and st["leases"]["pinned_slots"] == {"kv": 4} and st["claims"]["leases"] == 4
    assert st["pools"]["kv"]["evictable"] == SLOTS - 4

    # Pressure: six new objects evict six others in FIFO order, never a leased one.
    newer = [key(f"n{i}") for i in range(6)]
    put(client, register, newer, seed=2)
    assert present(client, leased) == [True] * 4
    assert present(client, keys[4:10]) == [False] * 6
    assert present(client, keys[10:]) == [True] * 6
    for i, k in enumerate(leased):
        got = delivered(client, register, k)
        assert got is not None and np.array_equal(got, src[i * SLOT : (i + 1) * SLOT])

    lease.release().result(RESULT_TIMEOUT_S)
    assert lease.ended is ErrorCode.OK and lease.held == frozenset()
    st = stats(client)
    assert st["leases"]["held"] == 0 and st["leases"]["pinned_slots"] == {"kv": 0}
    assert st["pools"]["kv"]["evictable"] == st["pools"]["kv"]["allocated"]
    # Released, they are evictable again: FIFO counts them from their release, so the other
    # twelve go first, then they do.
    put(client, register, [key(f"m{i}") for i in range(12)], seed=3)
    assert present(client, leased) == [True] * 4
    put(client, register, [key(f"o{i}") for i in range(4)], seed=3)
    assert present(client, leased) == [False] * 4


def test_a_lease_after_the_eviction_finds_nothing(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    old = key("old")
    put(client, register, [old], seed=4)
    put(client, register, [key(f"f{i}") for i in range(SLOTS)], seed=5)  # evicts ``old``
    lease = client.lease([old]).result(RESULT_TIMEOUT_S)
    assert lease.id == 0 and lease.status(old) is LeaseStatus.MISS and lease.ended is ErrorCode.OK
    with pytest.raises(ArgumentError, match="lease"):
        lease.release()


def test_expiry_returns_exactly_the_leased_slots(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    keys = [key(f"e{i}") for i in range(3)]
    put(client, register, keys, seed=6)
    before = stats(client)["pools"]["kv"]["evictable"]
    lease = client.lease(keys, ttl_ms=300).result(RESULT_TIMEOUT_S)
    assert stats(client)["pools"]["kv"]["evictable"] == before - 3
    assert wait_until(lambda: client.stats().result(RESULT_TIMEOUT_S) is not None and lease.ended is not None, 5.0)
    assert lease.ended is ErrorCode.LEASE_EXPIRED and lease.held == frozenset()
    st = stats(client)
    assert st["pools"]["kv"]["evictable"] == before and st["leases"]["expired"] >= 1
    assert st["leases"]["pinned_slots"] == {"kv": 0}
    with pytest.raises(ArgumentError, match="not held"):
        lease.renew()


def test_renew_keeps_a_lease_past_its_first_ttl(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    k = key("r")
    put(client, register, [k], seed=7)
    lease = client.lease([k], ttl_ms=400).result(RESULT_TIMEOUT_S)
    assert lease.renew(5_000).result(RESULT_TIMEOUT_S) == 5_000
    assert lease.ttl_ms == 5_000
    time.sleep(0.6)  # past the first time to live (bounded: the node's own expiry runs on its clock)
    client.stats().result(RESULT_TIMEOUT_S)  # reads any lease_end that came
    assert lease.ended is None and lease.held == frozenset([k])
    lease.release().result(RESULT_TIMEOUT_S)


def test_ttl_is_capped(node_factory: Callable[..., NodeProcess], ipc_dir: Any) -> None:
    n = node_factory("--pool", "kv:4KiB:8", "--lease-ttl-ms", "1000", "--max-lease-ttl-ms", "2000")
    with Client(n.endpoint) as c:
        reg = Registrar(c)
        put(c, reg, [b"a"], seed=8)
        first = c.lease([b"a"]).result(RESULT_TIMEOUT_S)
        assert first.ttl_ms == 1000
        lease = c.lease([b"a"], ttl_ms=10**9).result(RESULT_TIMEOUT_S)
        assert lease.ttl_ms == 2000
        assert lease.renew(10**6).result(RESULT_TIMEOUT_S) == 2000
        first.release().result(RESULT_TIMEOUT_S)
        lease.release().result(RESULT_TIMEOUT_S)
        assert c.tables()["leases"] == 0
        reg.close()
        assert_clean(c)


def test_double_release_and_foreign_leases_are_clean_errors(
    client: Client, node: NodeProcess, register: Registrar, key: Callable[[str], bytes],
) -> None:
    k = key("d")
    put(client, register, [k], seed=9)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    # Another client names our lease id: unknown to it, and ours stays held.
    with Client(node.endpoint, name="intruder") as other:
        for call in (lambda: other.core.request(lambda i: ReleaseLease(i, lease.id), lambda m: m, 5)[1],):
            with pytest.raises(NodeError) as info:
                call().result(5)
            assert info.value.code is ErrorCode.UNKNOWN_LEASE and info.value.path == "lease"
    assert lease.ended is None and stats(client)["leases"]["held"] == 1
    lease.release().result(RESULT_TIMEOUT_S)
    with pytest.raises(ArgumentError, match="released already"):
        lease.release()
    # The node itself frees nothing twice: the same id again is UNKNOWN_LEASE.
    _, fut = client.core.request(lambda i: ReleaseLease(i, lease.id), lambda m: m, 5)
    with pytest.raises(NodeError) as info:
        client.core.wait(fut, 5)
    assert info.value.code is ErrorCode.UNKNOWN_LEASE
    st = stats(client)
    assert st["claims"]["total"] == 0 and st["leases"]["unknown_lease"] >= 2


def test_one_client_cannot_take_the_whole_lease_budget(node_factory: Callable[..., NodeProcess]) -> None:
    """Audit row 8: a client leased a pool's whole budget for the longest ttl, and a victim's
    lease of other keys got 16 of 16 LEASE_LIMIT. Each of two clients may hold half now."""
    n = node_factory("--pool", "kv:4KiB:64", "--lease-pool-fraction", "0.5")
    with Client(n.endpoint, name="greedy") as greedy, Client(n.endpoint, name="victim") as victim:
        reg = Registrar(greedy)
        victim_reg = Registrar(victim)
        victim_reg(pattern(SLOT, 12))  # an engine announces its memory: it shares the budgets from then on
        keys = [b"g%d" % i for i in range(32)]
        others = [b"v%d" % i for i in range(16)]
        put(greedy, reg, keys + others, seed=11)
        grab = greedy.lease(keys, ttl_ms=600_000).result(RESULT_TIMEOUT_S)
        assert [grab.status(k) for k in keys] == [LeaseStatus.LEASED] * 16 + [LeaseStatus.LEASE_LIMIT] * 16
        assert greedy.lease(keys[16:]).result(RESULT_TIMEOUT_S).id == 0  # beyond its share: nothing
        mine = victim.lease(others).result(RESULT_TIMEOUT_S)
        assert mine.held == frozenset(others)
        st = stats(victim)
        assert st["leases"]["pinned_slots"] == {"kv": 32} and st["invariants"] == []
        for lease in (grab, mine):
            lease.release().result(RESULT_TIMEOUT_S)
        reg.close()
        victim_reg.close()
        assert_clean(greedy)


def test_limits_answer_lease_limit(node_factory: Callable[..., NodeProcess]) -> None:
    n = node_factory("--pool", "kv:4KiB:8", "--max-leased-slots-per-session", "3", "--max-leases-per-session", "2",
                     "--lease-pool-fraction", "0.5", "--lease-session-fraction", "1")
    with Client(n.endpoint, name="a") as a, Client(n.endpoint, name="b") as b:
        reg = Registrar(a)
        keys = [b"k%d" % i for i in range(6)]
        put(a, reg, keys, seed=10)
        first = a.lease(keys[:5]).result(RESULT_TIMEOUT_S)
        # Three slots per session.
        assert [first.status(k) for k in keys[:5]] == [LeaseStatus.LEASED] * 3 + [LeaseStatus.LEASE_LIMIT] * 2
        # Four of the pool's eight slots may be pinned: b gets one more, then LEASE_LIMIT.
        other = b.lease(keys[3:6]).result(RESULT_TIMEOUT_S)
        assert [other.status(k) for k in keys[3:6]] == [LeaseStatus.LEASED, LeaseStatus.LEASE_LIMIT, LeaseStatus.LEASE_LIMIT]
        # An object already pinned costs the pool nothing more.
        again = b.lease(keys[:1]).result(RESULT_TIMEOUT_S)
        assert again.status(keys[0]) is LeaseStatus.LEASED
        st = stats(a)
        assert st["leases"]["pinned_slots"] == {"kv": 4} and st["leases"]["keys_refused_limit"] == 4
        # Two leases per session: a third is refused whole.
        with pytest.raises(NodeError) as info:
            b.lease(keys[:1]).result(RESULT_TIMEOUT_S)
        assert info.value.code is ErrorCode.LEASE_LIMIT
        for lease in (first, other, again):
            lease.release().result(RESULT_TIMEOUT_S)
        reg.close()
        assert_clean(a)


def test_session_end_releases_its_leases(client: Client, node: NodeProcess, register: Registrar, key: Callable[[str], bytes]) -> None:
    keys = [key(f"s{i}") for i in range(3)]
    put(client, register, keys, seed=11)
    with Client(node.endpoint, name="leaving") as leaving:
        lease = leaving.lease(keys).result(RESULT_TIMEOUT_S)
        assert lease.held == frozenset(keys) and stats(client)["leases"]["held"] == 1
    assert lease.ended is ErrorCode.NODE_LOST  # the session is over, and the lease with it
    st = stats(client)
    assert st["leases"]["held"] == 0 and st["leases"]["pinned_slots"] == {"kv": 0}


def test_a_silent_client_loses_its_leases(node_factory: Callable[..., NodeProcess]) -> None:
    """A client that stops talking (killed) holds nothing once the node drops its session."""
    n = node_factory("--pool", "kv:4KiB:8", "--heartbeat-ms", "100", "--client-grace-ms", "400")
    with Client(n.endpoint, name="owner") as owner:
        reg = Registrar(owner)
        put(owner, reg, [b"x", b"y"], seed=12)
        agent = ClientAgent("silent")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(n.endpoint)
        try:
            sock.send(encode(Hello(1, PROTOCOL_VERSIONS, "silent", agent.name, agent.metadata), 1))
            assert sock.poll(RAW_TIMEOUT_MS)
            welcome = decode(sock.recv(), max(PROTOCOL_VERSIONS))
            assert isinstance(welcome, Welcome), welcome
            version = welcome.version
            sock.send(encode(Lease(2, (b"x", b"y"), None, 60_000), version))
            assert sock.poll(RAW_TIMEOUT_MS)
            reply = decode(sock.recv(), version)
            assert isinstance(reply, LeaseReply) and reply.columns is not None and reply.columns.held_count() == 2
            assert stats(owner)["leases"]["held"] == 1
            # Silence: no heartbeat, no bye. The node drops the session after its grace.
            assert wait_until(lambda: stats(owner)["leases"]["held"] == 0, 5.0)
        finally:
            sock.close(0)
            ctx.term()
            agent.close()
        st = stats(owner)
        assert st["leases"]["pinned_slots"] == {"kv": 0} and st["leases"]["ended_with_session"] >= 1
        reg.close()
        assert_clean(owner)


def test_hostile_lease_requests(client: Client, node: NodeProcess, key: Callable[[str], bytes]) -> None:
    """Well-formed requests with hostile content: unknown and huge lease ids, zero, a
    lease id of u64 max, a lease of thousands of absent keys; the node stays clean."""
    for lease_id in (0, 1, 2**63, 2**64 - 1):
        _, fut = client.core.request(lambda i, lid=lease_id: ReleaseLease(i, lid), lambda m: m, 5)
        with pytest.raises(NodeError) as info:
            client.core.wait(fut, 5)
        assert info.value.code is ErrorCode.UNKNOWN_LEASE
    many = [key(f"absent-{i}") for i in range(4000)]
    lease = client.lease(many, ttl_ms=2**32 - 1).result(RESULT_TIMEOUT_S)
    assert lease.id == 0 and lease.held_prefix() == 0 and len(lease) == 4000
    with pytest.raises(ArgumentError, match="ttl_ms"):
        client.lease([key("x")], ttl_ms=2**32)
    with pytest.raises(ArgumentError, match="keys"):
        client.lease([])


def test_leases_at_version_3_are_refused_locally(node: NodeProcess) -> None:
    with Client(node.endpoint, name="old", max_version=3) as old:
        with pytest.raises(NodeError) as info:
            old.lease([b"k"])
        assert info.value.code is ErrorCode.PEER_UNSUPPORTED


def test_lease_handles_after_close_report_node_lost(node: NodeProcess) -> None:
    c = Client(node.endpoint, name="closing")
    try:
        lease = c.lease([b"nothing"]).result(RESULT_TIMEOUT_S)
        assert isinstance(lease, LeaseHandle)
    finally:
        c.close()
    assert lease.ended is ErrorCode.OK  # it held nothing: it was over from the start


async def test_async_client_leases(client: Client, node: NodeProcess, register: Registrar, key: Callable[[str], bytes]) -> None:
    k = key("async")
    put(client, register, [k], seed=13)
    async with await AsyncClient.connect(node.endpoint, name="async-leases") as ac:
        lease = await ac.lease([k], ttl_ms=5_000)
        assert lease.status(k) is LeaseStatus.LEASED and stats(client)["leases"]["held"] == 1
        assert await lease.renew(10_000) == 10_000
        await lease.release()
        assert lease.ended is ErrorCode.OK and ac.tables()["leases"] == 0
    assert stats(client)["leases"]["held"] == 0
