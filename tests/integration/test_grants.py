"""Read grants against real ``kvcr-node`` processes (spec section 6.12), on one node.

A version-5 lease gives the client the slots of its keys; ``deliver`` then READs them with
the client's own agent, byte for byte, whole, as a subset and with a layer plan, and the
node posts nothing. The node-driven path stays for ``client_transfers = false`` and for
sessions below version 5. A read is never returned when its lease may not have held for
the whole read: a reader frozen past its lease fails ``LEASE_EXPIRED``, also when the slot
was reused meanwhile with other bytes; a reader late within the time to live is confirmed
with a ``renew``. Another session's lease gives nothing, and huge leases stay in limits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import pytest

from kvcr_client import (
    AsyncClient,
    Client,
    ClientClosed,
    ErrorCode,
    GroupState,
    KeyStatus,
    LeaseStatus,
    NodeError,
    Span,
    digest_checks,
)
from kvcr_client.grants import MARGIN_FRACTION, MARGIN_S
from kvcr_client.session_scope import PRUNE_SLACK
from kvcr_protocol import DEFAULT_LIMITS, RenewLease
from kvcr_testing.forge import forge
from kvcr_testing.health import assert_clean, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import NodeProcess, running_node, short_ipc_dir
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
SLOTS = 64
LAYERS = 8

pytestmark = pytest.mark.usefixtures("node_left_clean")


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    # FIFO, so that fresh deposits evict the oldest objects and reuse their slots.
    return ("--pool", f"kv:4KiB:{SLOTS}", "--policy", "fifo", "--lease-pool-fraction", "1")


@pytest.fixture
def hook(client: Client) -> Iterator[Callable[[Callable[[str], None]], None]]:
    """Install a gate the client's grant reads call at ``posting G`` and ``posted G`` (``kvcr_client.posted.Gate``)."""

    def install(fn: Callable[[str], None]) -> None:
        client._grants.gate = fn

    yield install
    client._grants.gate = None


def put(client: Client, register: Registrar, key: bytes, seed: int, layers: int = LAYERS) -> np.ndarray:
    src = pattern(layers * SLOT, seed)
    region = register(src)
    res = client.deposit({key: [Span(f"L{i}", region, i * SLOT, SLOT, "kv") for i in range(layers)]}).result(RESULT_TIMEOUT_S)
    assert res.all_ok, res
    return src


def posted(client: Client) -> int:
    """Transfers the node posted so far."""
    return int(stats(client)["transfers"]["posted"])


def test_a_read_lease_grants_slots_and_deliver_reads_them_without_the_node(client: Client, register: Registrar,
                                                                           key: Callable[[str], bytes]) -> None:
    k = key("obj")
    src = put(client, register, k, seed=1)
    lease = client.lease([k, key("absent")], ttl_ms=30_000).result(RESULT_TIMEOUT_S)
    assert lease.status(k) is LeaseStatus.LEASED and lease.status(key("absent")) is LeaseStatus.MISS
    assert stats(client)["leases"]["with_grants"] == 1
    before, reads = posted(client), client.counters()["grant_reads"]
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)

    # Whole object.
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
    assert res[k].ok, res
    assert np.array_equal(dst, src)

    # An ordered subset, into other places.
    dst[:] = 0
    res = client.deliver({k: [Span("L2", region, 0, SLOT), Span("L5", region, 3 * SLOT, SLOT)]}).result(RESULT_TIMEOUT_S)
    assert res[k].ok, res
    assert np.array_equal(dst[:SLOT], src[2 * SLOT:3 * SLOT]) and np.array_equal(dst[3 * SLOT:4 * SLOT], src[5 * SLOT:6 * SLOT])
    assert not dst[SLOT:3 * SLOT].any() and not dst[4 * SLOT:].any()

    # A layer plan: one group per layer, each reported delivered.
    dst[:] = 0
    plan = [[f"L{i}"] for i in range(LAYERS)]
    handle = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}, plan=plan)
    for g in range(LAYERS):
        handle.wait(g, RESULT_TIMEOUT_S)
    assert handle.result(RESULT_TIMEOUT_S)[k].ok
    assert np.array_equal(dst, src)

    assert client.counters()["grant_reads"] == reads + 3
    assert posted(client) == before, "the node posted a transfer for a granted deliver"
    lease.release().result(RESULT_TIMEOUT_S)
    assert stats(client)["leases"]["with_grants"] == 0

    # Released: the next deliver goes to the node again, and still lands byte for byte.
    dst[:] = 0
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
    assert res[k].ok and np.array_equal(dst, src)
    assert posted(client) == before + 1


def test_a_prepared_destination_read_again_under_other_grants_gets_their_bytes(
    client: Client, register: Registrar, key: Callable[[str], bytes],
) -> None:
    """A destination's READs are planned once per grants and plan, their descriptor lists
    kept as NIXL took them (``kvcr_client.prepared_reads``): each repeat lands byte for byte,
    and the same destination read under another lease's grants (another object's slots, or
    the same object's anew) gets that object's bytes, never the kept plan's slots."""
    first, second = key("first"), key("second")
    sources = {first: put(client, register, first, seed=11), second: put(client, register, second, seed=12)}
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)
    dest = client.destination([Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)])
    plan = [[f"L{i}"] for i in range(LAYERS)]
    reads = client.counters()["grant_reads"]
    for k in (first, second, first):
        lease = client.lease([k], ttl_ms=30_000).result(RESULT_TIMEOUT_S)
        assert lease.status(k) is LeaseStatus.LEASED
        for _ in range(3):
            dst[:] = 0
            handle = client.deliver({k: dest}, plan=plan)
            handle.wait(0, RESULT_TIMEOUT_S)
            assert handle.result(RESULT_TIMEOUT_S)[k].ok
            assert np.array_equal(dst, sources[k])
        lease.release().result(RESULT_TIMEOUT_S)
    assert client.counters()["grant_reads"] == reads + 9, "a deliver went through the node"


def test_bad_destinations_fail_before_anything_is_read(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    k = key("obj")
    put(client, register, k, seed=2, layers=3)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    dst = pattern(3 * SLOT, 7)
    kept = dst.copy()
    region = register(dst)
    res = client.deliver({k: [Span("L2", region, 0, SLOT), Span("L0", region, SLOT, SLOT)]}).result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.LAYOUT_SUBSET_INVALID
    res = client.deliver({k: [Span(f"L{i}", region, i * 1024, 1024) for i in range(3)]}).result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.SIZE_MISMATCH
    assert np.array_equal(dst, kept)
    lease.release().result(RESULT_TIMEOUT_S)


def test_a_reader_frozen_past_its_lease_fails_lease_expired(client: Client, register: Registrar, key: Callable[[str], bytes],
                                                            hook: Callable[[Callable[[str], None]], None]) -> None:
    k = key("obj")
    put(client, register, k, seed=3)
    lease = client.lease([k], ttl_ms=300).result(RESULT_TIMEOUT_S)
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)
    hook(lambda stage: time.sleep(0.6) if stage == "posted 0" else None)  # frozen mid-read, past the ttl
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.LEASE_EXPIRED, res
    assert lease.ended is ErrorCode.LEASE_EXPIRED
    assert wait_until(lambda: stats(client)["leases"]["held"] == 0, RESULT_TIMEOUT_S), "the node did not expire the lease"


def test_a_slot_reused_after_expiry_is_detected_not_returned(client: Client, register: Registrar, key: Callable[[str], bytes],
                                                            hook: Callable[[Callable[[str], None]], None]) -> None:
    k = key("old")
    old = put(client, register, k, seed=4, layers=1)
    lease = client.lease([k], ttl_ms=300).result(RESULT_TIMEOUT_S)
    dst = np.zeros(SLOT, np.uint8)
    region = register(dst)
    fresh: list[np.ndarray] = []

    def reuse(stage: str) -> None:
        if stage != "posting 0":
            return
        # The reader stalls between its check of the grant and its READ; meanwhile the lease
        # expires, the object is evicted and its slot refilled with other bytes.
        assert wait_until(lambda: stats(client)["leases"]["held"] == 0, RESULT_TIMEOUT_S), "the node did not expire the lease"
        for i in range(SLOTS):
            fresh.append(put(client, register, key(f"new{i}"), seed=100 + i, layers=1))
        assert client.query([k]).result(RESULT_TIMEOUT_S)[k].presence.name == "MISS"

    hook(reuse)
    res = client.deliver({k: [Span("L0", region, 0, SLOT)]}).result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.LEASE_EXPIRED, res
    # The READ did land another object's bytes (the slot was reused): the client did not
    # report them as the key's.
    assert not np.array_equal(dst, old)
    assert any(np.array_equal(dst, f) for f in fresh)
    assert lease.ended is ErrorCode.LEASE_EXPIRED


def test_a_later_group_read_after_expiry_is_not_ok_though_its_turn_began_before(
        node: NodeProcess, client: Client, register: Registrar, key: Callable[[str], bytes],
        hook: Callable[[Callable[[str], None]], None]) -> None:
    """Group 1 is posted in a turn of the client's I/O side whose clock was read before: the
    reader stalls there (lock held) past the lease, the node expires it and another client
    refills every slot. The READ lands the other object's bytes; the check, at a time read
    after the READ was seen complete, must not call them the key's (spec section 6.12)."""
    k = key("old")
    put(client, register, k, seed=12, layers=2)
    lease = client.lease([k], ttl_ms=300).result(RESULT_TIMEOUT_S)
    dst = np.zeros(2 * SLOT, np.uint8)
    region = register(dst)
    fresh: list[np.ndarray] = []
    with Client(node.endpoint, name="itest-grants-refill") as other:
        src = pattern(SLOT, 0)
        other_region = other.register(src)

        def stall(stage: str) -> None:
            if stage != "posting 1" or fresh:
                return
            assert wait_until(lambda: stats(other)["leases"]["held"] == 0, RESULT_TIMEOUT_S), "the lease did not expire"
            for i in range(SLOTS):
                src[:] = pattern(SLOT, 200 + i)
                fresh.append(src.copy())
                res = other.deposit({key(f"refill{i}"): [Span("L0", other_region, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S)
                assert res.all_ok, res

        hook(stall)
        plan = [["L0"], ["L1"]]
        res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(2)]}, plan=plan).result(RESULT_TIMEOUT_S)
        assert fresh, "the hook never stalled group 1's turn"
        assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.LEASE_EXPIRED, res
        assert any(np.array_equal(dst[SLOT:], f) for f in fresh), "group 1's READ did land another object's bytes"
        other.unregister(other_region)
    assert lease.ended is ErrorCode.LEASE_EXPIRED


def test_a_reader_dropped_for_silence_between_groups_is_not_ok(key: Callable[[str], bytes]) -> None:
    """The lease's time to live is long (the node's default), but the reader stalls between
    groups (lock held, so no heartbeat goes) past the node's ``client_grace_ms``: the node
    ends its session and its leases, another client refills the slots. The key must fail."""
    args = ("--pool", f"kv:4KiB:{SLOTS}", "--policy", "fifo", "--lease-pool-fraction", "1", "--client-grace-ms", "400")
    with short_ipc_dir("grace") as d, running_node(d, "n", *args) as node, \
            Client(node.endpoint, name="itest-grace-reader") as client, Client(node.endpoint, name="itest-grace-other") as other:
        k = key("old")
        src = pattern(2 * SLOT, 13)
        r = client.register(src)
        assert client.deposit({k: [Span(f"L{i}", r, i * SLOT, SLOT, "kv") for i in range(2)]}).result(RESULT_TIMEOUT_S).all_ok
        assert client.lease([k], ttl_ms=30_000).result(RESULT_TIMEOUT_S).grant
        dst = np.zeros(2 * SLOT, np.uint8)
        region = client.register(dst)
        refill = pattern(SLOT, 0)
        other_region = other.register(refill)
        fresh: list[np.ndarray] = []

        def stall(stage: str) -> None:
            if stage != "posting 1" or fresh:
                return
            assert wait_until(lambda: stats(other)["leases"]["held"] == 0, RESULT_TIMEOUT_S), "the session was not dropped"
            for i in range(SLOTS):
                refill[:] = pattern(SLOT, 300 + i)
                fresh.append(refill.copy())
                assert other.deposit({key(f"refill{i}"): [Span("L0", other_region, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok

        client._grants.gate = stall
        res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(2)]}, plan=[["L0"], ["L1"]])
        outcome = res.result(RESULT_TIMEOUT_S)[k]
        client._grants.gate = None
        assert fresh, "the hook never stalled group 1's turn"
        assert outcome.status is KeyStatus.FAILED and outcome.code in (ErrorCode.LEASE_LOST, ErrorCode.LEASE_EXPIRED), outcome
        assert any(np.array_equal(dst[SLOT:], f) for f in fresh), "group 1's READ did land another object's bytes"


def test_a_late_reader_within_the_lease_is_confirmed_by_a_renew(client: Client, register: Registrar, key: Callable[[str], bytes],
                                                                hook: Callable[[Callable[[str], None]], None]) -> None:
    k = key("obj")
    src = put(client, register, k, seed=5)
    ttl_ms = 1000
    lease = client.lease([k], ttl_ms=ttl_ms).result(RESULT_TIMEOUT_S)
    trusted = ttl_ms / 1000 - (MARGIN_S + ttl_ms / 1000 * MARGIN_FRACTION)  # the clock alone vouches this long
    asked = lease.expires_at - ttl_ms / 1000
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)
    confirmed = client.counters()["grant_confirms"]
    hook(lambda stage: time.sleep(max(0.0, asked + trusted + 0.02 - time.monotonic())) if stage == "posted 0" else None)
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
    assert res[k].ok, res
    assert np.array_equal(dst, src)
    assert client.counters()["grant_confirms"] == confirmed + 1
    assert lease.expires_at > asked + ttl_ms / 1000, "the confirmation renewed the lease"
    lease.release().result(RESULT_TIMEOUT_S)


def test_a_lease_released_mid_read_fails_lease_lost(client: Client, register: Registrar, key: Callable[[str], bytes],
                                                    hook: Callable[[Callable[[str], None]], None]) -> None:
    k = key("obj")
    put(client, register, k, seed=9)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)
    # Released from the turn that posted group 0 (the release ends the lease here at once;
    # its ack is waited for below, outside the turn).
    released = []
    hook(lambda stage: released.append(lease.release()) if stage == "posted 0" else None)
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.LEASE_LOST, res
    released[0].result(RESULT_TIMEOUT_S)


def test_the_async_client_reads_under_grants_too(node: NodeProcess, key: Callable[[str], bytes]) -> None:
    k = key("obj")

    async def run() -> None:
        async with await AsyncClient.connect(node.endpoint, name="itest-grants-async") as c:
            src = pattern(LAYERS * SLOT, 10)
            dst = np.zeros(LAYERS * SLOT, np.uint8)
            rs, rd = await c.register(src), await c.register(dst)
            assert (await c.deposit({k: [Span(f"L{i}", rs, i * SLOT, SLOT, "kv") for i in range(LAYERS)]})).all_ok
            lease = await c.lease([k], ttl_ms=1000)
            # Late enough that the clock alone cannot vouch: the confirmation runs in the loop.
            c._grants.gate = lambda stage: time.sleep(0.9) if stage == "posted 0" else None
            res = await c.deliver({k: [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(LAYERS)]})
            assert res[k].ok and np.array_equal(dst, src) and c.counters()["grant_reads"] == 1 and c.counters()["grant_confirms"] == 1
            await lease.release()
            await c.unregister(rs)
            await c.unregister(rd)

    asyncio.run(run())


def test_another_sessions_lease_gives_no_grant(node: NodeProcess, client: Client, register: Registrar,
                                               key: Callable[[str], bytes]) -> None:
    k = key("obj")
    src = put(client, register, k, seed=6)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    with Client(node.endpoint, name="itest-grants-other") as other:
        dst = np.zeros(LAYERS * SLOT, np.uint8)
        region = other.register(dst)
        # Its deliver of keys another session leased goes to the node: it holds no grant.
        before = posted(client)
        res = other.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
        assert res[k].ok and np.array_equal(dst, src)
        assert posted(client) == before + 1 and other.tables()["granted_keys"] == 0
        # Confirming a read under another session's lease id is refused: such a read would fail.
        forged: Future[int] = Future()
        other._grants.confirm(lease, time.monotonic(), forged.set_result)
        assert other.core.wait(forged, 6.0) == ErrorCode.LEASE_LOST
        with pytest.raises(NodeError) as info:
            other.core.wait(other.core.request(lambda i: RenewLease(i, lease.id, 0), lambda m: m, 5.0)[1], 6.0)
        assert info.value.code is ErrorCode.UNKNOWN_LEASE
        other.unregister(region)
    lease.release().result(RESULT_TIMEOUT_S)


def test_a_huge_lease_stays_within_the_span_limit(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    k = key("obj")
    layers = 32
    src = put(client, register, k, seed=7, layers=layers)
    count = DEFAULT_LIMITS.max_keys
    lease = client.lease([k] * count, ttl_ms=30_000).result(RESULT_TIMEOUT_S)
    assert lease.held_prefix() == count
    # 4096 repetitions of 32 spans are twice max_spans: the grant stops at the limit, and
    # the key it covers reads byte for byte.
    dst = np.zeros(layers * SLOT, np.uint8)
    region = register(dst)
    before = posted(client)
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(layers)]}).result(RESULT_TIMEOUT_S)
    assert res[k].ok and np.array_equal(dst, src)
    assert posted(client) == before
    lease.release().result(RESULT_TIMEOUT_S)


def test_granted_keys_of_ended_leases_do_not_pile_up(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    keys = [key(f"o{i}") for i in range(8)]
    for i, k in enumerate(keys):
        put(client, register, k, seed=20 + i, layers=1)
    for _ in range(3 * PRUNE_SLACK // len(keys)):
        for k in keys:
            client.lease([k]).result(RESULT_TIMEOUT_S).release().result(RESULT_TIMEOUT_S)
    # A released lease's grants go with it: none of these keys is left in the table.
    assert not set(keys) & set(client.grants().keys) and client.tables()["granted_keys"] <= 2 * PRUNE_SLACK


@pytest.mark.parametrize("how", ["client_transfers off", "version 4"])
def test_without_grants_leased_keys_travel_by_the_node(how: str) -> None:
    args = ("--pool", "kv:4KiB:16", *(("--no-client-transfers",) if how == "client_transfers off" else ()))
    with short_ipc_dir("nog") as d, running_node(d, "n", *args) as node, Client(
        node.endpoint, name="itest-grants-none", max_version=4 if how == "version 4" else 5,
    ) as c:
        src = pattern(2 * SLOT, 8)
        r = c.register(src)
        assert c.deposit({b"k": [Span("a", r, 0, SLOT, "kv"), Span("b", r, SLOT, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
        lease = c.lease([b"k"]).result(RESULT_TIMEOUT_S)
        assert lease.status(b"k") is LeaseStatus.LEASED and c.tables()["granted_keys"] == 0
        assert stats(c)["leases"]["with_grants"] == 0
        dst = np.zeros(2 * SLOT, np.uint8)
        rd = c.register(dst)
        res = c.deliver({b"k": [Span("a", rd, 0, SLOT), Span("b", rd, SLOT, SLOT)]}).result(RESULT_TIMEOUT_S)
        assert res[b"k"].ok and np.array_equal(dst, src)
        assert c.counters()["grant_reads"] == 0 and stats(c)["transfers"]["posted"] == 2
        lease.release().result(RESULT_TIMEOUT_S)
        assert_clean(c)


def hold_back(group: int, until: Callable[[], bool], stages: list[str]) -> Callable[[str], bool | None]:
    """A hook that records every stage and defers the post of ``group`` while ``until()`` is false."""

    def hook(stage: str) -> bool | None:
        stages.append(stage)
        return False if stage == f"posting {group}" and not until() else None

    return hook


def test_group_0_is_usable_before_the_last_group_is_posted(client: Client, register: Registrar, key: Callable[[str], bytes],
                                                           hook: Callable[[Callable[[str], None]], None]) -> None:
    k = key("obj")
    src = put(client, register, k, seed=11)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)
    seen = threading.Event()
    stages: list[str] = []
    hook(hold_back(LAYERS - 1, seen.is_set, stages))
    plan = [[f"L{i}"] for i in range(LAYERS)]
    handle = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}, plan=plan)
    handle.wait(0, RESULT_TIMEOUT_S)
    # Group 0 is delivered and its bytes usable while the last group is not even posted.
    assert np.array_equal(dst[:SLOT], src[:SLOT])
    assert handle.state(LAYERS - 1) is GroupState.PENDING and not handle.done()
    assert f"posted {LAYERS - 1}" not in stages and not dst[(LAYERS - 1) * SLOT:].any()
    seen.set()
    res = handle.result(RESULT_TIMEOUT_S)
    assert res[k].ok and np.array_equal(dst, src)
    assert all(handle.state(g) is GroupState.DELIVERED for g in range(LAYERS))
    # Group 0 in the caller's call, the others one per turn, in group order.
    posts = [s for s in stages if s.startswith("posting ")]
    assert stages[:2] == ["posting 0", "posted 0"]
    assert [int(s.split()[1]) for s in dict.fromkeys(posts)] == list(range(LAYERS))
    assert wait_until(lambda: client.tables()["reads"] == 0, RESULT_TIMEOUT_S)
    lease.release().result(RESULT_TIMEOUT_S)


def test_an_async_deliver_under_grants_leaves_the_loop_running(node: NodeProcess, key: Callable[[str], bytes]) -> None:
    k = key("obj")
    ticks = 0
    TICKS = 50

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def run() -> None:
        async with await AsyncClient.connect(node.endpoint, name="itest-grants-loop") as c:
            src = pattern(LAYERS * SLOT, 12)
            dst = np.zeros(LAYERS * SLOT, np.uint8)
            rs, rd = await c.register(src), await c.register(dst)
            assert (await c.deposit({k: [Span(f"L{i}", rs, i * SLOT, SLOT, "kv") for i in range(LAYERS)]})).all_ok
            lease = await c.lease([k])
            stages: list[str] = []
            released: list[int] = []

            def until() -> bool:
                # The last group is posted only once the loop ran the other task TICKS more
                # times: a deliver that blocked the loop would hold it back for good.
                if ticks - start >= TICKS:
                    released.append(ticks - start)
                    return True
                return False

            c._grants.gate = hold_back(LAYERS - 1, until, stages)
            task = asyncio.create_task(other())
            await asyncio.sleep(0)
            start = ticks
            handle = c.deliver({k: [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(LAYERS)]},
                               plan=[[f"L{i}"] for i in range(LAYERS)])
            await handle.group(0)
            res = await asyncio.wait_for(handle, RESULT_TIMEOUT_S)
            task.cancel()
            assert res[k].ok and np.array_equal(dst, src)
            assert released and released[0] >= TICKS, "the loop did not run while the deliver was outstanding"
            c._grants.gate = None
            await lease.release()
            await c.unregister(rs)
            await c.unregister(rd)

    asyncio.run(run())


def test_a_deadline_passing_mid_deliver_fails_what_was_not_read(client: Client, register: Registrar, key: Callable[[str], bytes],
                                                                hook: Callable[[Callable[[str], None]], None]) -> None:
    k = key("obj")
    src = put(client, register, k, seed=13)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    region = register(dst)
    hook(hold_back(LAYERS - 1, lambda: False, []))  # the last group is never posted
    plan = [[f"L{i}"] for i in range(LAYERS)]
    handle = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(LAYERS)]}, plan=plan, deadline_ms=200)
    res = handle.result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.TIMEOUT, res
    assert all(handle.state(g) is GroupState.DELIVERED for g in range(LAYERS - 1))
    assert handle.state(LAYERS - 1) is GroupState.FAILED
    assert np.array_equal(dst[:(LAYERS - 1) * SLOT], src[:(LAYERS - 1) * SLOT]) and not dst[(LAYERS - 1) * SLOT:].any()
    assert wait_until(lambda: client.tables()["reads"] == 0, RESULT_TIMEOUT_S)
    assert not region.users, "the destination is still in use"
    lease.release().result(RESULT_TIMEOUT_S)


def test_close_during_a_grant_deliver_leaves_no_read_running(node: NodeProcess, client: Client, key: Callable[[str], bytes]) -> None:
    k = key("obj")
    src = pattern(LAYERS * SLOT, 14)
    dst = np.zeros(LAYERS * SLOT, np.uint8)
    c = Client(node.endpoint, name="itest-grants-close")
    baseline = c.tables()
    try:
        rs, rd = c.register(src), c.register(dst)
        assert c.deposit({k: [Span(f"L{i}", rs, i * SLOT, SLOT, "kv") for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S).all_ok
        lease = c.lease([k]).result(RESULT_TIMEOUT_S)
        c._grants.gate = hold_back(LAYERS - 1, lambda: False, [])
        handle = c.deliver({k: [Span(f"L{i}", rd, i * SLOT, SLOT) for i in range(LAYERS)]},
                           plan=[[f"L{i}"] for i in range(LAYERS)])
        handle.wait(LAYERS - 2, RESULT_TIMEOUT_S)
        assert c.tables()["reads"] == 1 and rd.users
    finally:
        c.close()
    with pytest.raises(ClientClosed):
        handle.result(RESULT_TIMEOUT_S)
    assert handle.state(LAYERS - 1) is GroupState.FAILED
    assert c.core.reads.running == [] and not rd.users and not rs.users
    # Every table is back where it was: the session's lease and its grant ended with it.
    after = c.tables()
    assert after == baseline and lease.ended is ErrorCode.NODE_LOST, (after, baseline, lease)
    assert not dst[(LAYERS - 1) * SLOT:].any() and np.array_equal(dst[:SLOT], src[:SLOT])
    assert wait_until(lambda: stats(client)["leases"]["held"] == 0, RESULT_TIMEOUT_S), "the node kept the closed session's lease"


def test_a_slot_overwritten_under_a_grant_fails_digest_mismatch_not_ok(
        node: NodeProcess, client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """Issue: with only a read grant a client overwrote another client's READY object, whose
    next deliver returned OK with the forged bytes. The node's digests travel with the
    grant, and the reader checks what landed (spec section 6.12, "Integrity")."""
    k = key("victim")
    src = put(client, register, k, seed=30, layers=2)
    forged = pattern(SLOT, 99)
    forge(node.endpoint, k, 1, forged)
    lease = client.lease([k]).result(RESULT_TIMEOUT_S)
    dst = np.zeros(2 * SLOT, np.uint8)
    region = register(dst)
    mismatched = client.counters()["digest_mismatches"]
    before = stats(client)["counters"]
    res = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(2)]}).result(RESULT_TIMEOUT_S)
    assert res[k].status is KeyStatus.FAILED and res[k].code is ErrorCode.DIGEST_MISMATCH, res
    assert np.array_equal(dst[SLOT:], forged) and np.array_equal(dst[:SLOT], src[:SLOT]), "the forged bytes did land"
    assert client.counters()["digest_mismatches"] == mismatched + 1
    # The reader told the node (``suspect``), which read the object itself and dropped it:
    # no later lease takes it, while this lease still holds its slots.
    confirmed = before.get("suspects_confirmed", 0)
    assert wait_until(lambda: stats(client)["counters"].get("suspects_confirmed", 0) == confirmed + 1,
                      RESULT_TIMEOUT_S), "the node did not drop it"
    assert client.query([k]).result(RESULT_TIMEOUT_S)[k].presence.name == "MISS"
    assert stats(client)["condemned"] == 1
    # Planned, layer by layer: group 0 (intact) is delivered, group 1 fails.
    handle = client.deliver({k: [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(2)]}, plan=[["L0"], ["L1"]])
    assert handle.result(RESULT_TIMEOUT_S)[k].code is ErrorCode.DIGEST_MISMATCH
    assert handle.state(0) is GroupState.DELIVERED and handle.state(1) is not GroupState.DELIVERED
    lease.release().result(RESULT_TIMEOUT_S)
    assert wait_until(lambda: stats(client)["condemned"] == 0, RESULT_TIMEOUT_S), "the lease's end freed the slots"


def test_a_whole_deliver_read_in_parts_fails_only_the_key_whose_middle_part_changed(
        node: NodeProcess, client: Client, register: Registrar, key: Callable[[str], bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole deliver larger than a part is read part by part, each part's digests checked
    on the digest worker while the next is copied (``kvcr_client.digest_checks``). A slot
    forged in a middle part fails its key; the other key of the same deliver is ``OK`` with
    every byte, and nothing is left holding the destination."""
    monkeypatch.setattr(digest_checks, "PART_BYTES", 2 * SLOT)  # 8 layers: 4 parts a key
    victim, intact = key("victim"), key("intact")
    put(client, register, victim, seed=34)
    src = put(client, register, intact, seed=35)
    forge(node.endpoint, victim, LAYERS // 2, pattern(SLOT, 94))
    lease = client.lease([victim, intact]).result(RESULT_TIMEOUT_S)
    dst_v, dst_i = np.zeros(LAYERS * SLOT, np.uint8), np.zeros(LAYERS * SLOT, np.uint8)
    rv, ri = register(dst_v), register(dst_i)
    checked = client.counters()["spans_checked"]
    res = client.deliver({victim: [Span(f"L{i}", rv, i * SLOT, SLOT) for i in range(LAYERS)],
                          intact: [Span(f"L{i}", ri, i * SLOT, SLOT) for i in range(LAYERS)]}).result(RESULT_TIMEOUT_S)
    assert res[victim].code is ErrorCode.DIGEST_MISMATCH, res
    assert res[intact].ok and np.array_equal(dst_i, src), res
    assert client.counters()["spans_checked"] >= checked + LAYERS + LAYERS // 2, "parts went unchecked"
    assert wait_until(lambda: client.tables()["reads"] == 0, RESULT_TIMEOUT_S)
    assert not rv.users and not ri.users, "the destination is still in use"
    lease.release().result(RESULT_TIMEOUT_S)


def test_with_integrity_off_an_overwritten_slot_is_read_as_the_objects(key: Callable[[str], bytes]) -> None:
    """What spec section 6.12 says goes wrong silently with ``integrity = false``: shown, so
    that the default stays on for a reason."""
    with short_ipc_dir("noint") as d, running_node(d, "n", "--pool", f"kv:4KiB:{SLOTS}", "--no-integrity") as node, \
            Client(node.endpoint, name="itest-noint") as client:
        k = key("victim")
        src = pattern(SLOT, 31)
        r = client.register(src)
        assert client.deposit({k: [Span("L0", r, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
        forged = pattern(SLOT, 98)
        forge(node.endpoint, k, 0, forged)
        lease = client.lease([k]).result(RESULT_TIMEOUT_S)
        dst = np.zeros(SLOT, np.uint8)
        region = client.register(dst)
        res = client.deliver({k: [Span("L0", region, 0, SLOT)]}).result(RESULT_TIMEOUT_S)
        assert res[k].ok and np.array_equal(dst, forged), "integrity off: the forged bytes come back as OK"
        assert client.counters()["spans_checked"] == 0 and client.counters()["spans_unchecked"] >= 1
        lease.release().result(RESULT_TIMEOUT_S)


def test_a_node_driven_deliver_of_an_overwritten_object_fails_and_the_node_drops_it(
        node: NodeProcess, client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """Issue: an object a grant holder overwrote was delivered by the node itself (no lease,
    so no digest reached the reader) as ``OK`` with the forged bytes. The node checks what
    it sent once the WRITE is complete and condemns the object (spec section 6.12)."""
    whole, planned = key("whole"), key("planned")
    src = put(client, register, whole, seed=32, layers=2)
    put(client, register, planned, seed=33, layers=2)
    before = stats(client)["counters"]
    forge(node.endpoint, whole, 1, pattern(SLOT, 97))
    forge(node.endpoint, planned, 1, pattern(SLOT, 96))
    dst = np.zeros(2 * SLOT, np.uint8)
    region = register(dst)
    spans = [Span(f"L{i}", region, i * SLOT, SLOT) for i in range(2)]
    res = client.deliver({whole: spans}).result(RESULT_TIMEOUT_S)
    assert res[whole].code is ErrorCode.DIGEST_MISMATCH, res
    # Planned, layer by layer: group 0 (intact) is delivered, group 1 is not.
    handle = client.deliver({planned: spans}, plan=[["L0"], ["L1"]])
    assert handle.result(RESULT_TIMEOUT_S)[planned].code is ErrorCode.DIGEST_MISMATCH
    assert handle.state(0) is GroupState.DELIVERED and handle.state(1) is not GroupState.DELIVERED
    after = stats(client)["counters"]
    assert after.get("deliver_mismatches", 0) == before.get("deliver_mismatches", 0) + 2
    assert after.get("objects_condemned", 0) == before.get("objects_condemned", 0) + 2
    # Condemned: the keys are gone, their slots free again, and a writer may store them anew.
    for k in (whole, planned):
        assert client.query([k]).result(RESULT_TIMEOUT_S)[k].presence.name == "MISS"
    assert client.deposit({whole: [Span(f"L{i}", register(src), i * SLOT, SLOT, "kv") for i in range(2)]}).result(
        RESULT_TIMEOUT_S).all_ok
    dst[:] = 0
    assert client.deliver({whole: spans}).result(RESULT_TIMEOUT_S)[whole].ok and np.array_equal(dst, src)
    assert_clean(client)
