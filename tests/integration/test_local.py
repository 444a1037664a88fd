"""One real ``kvcr-node`` process and a client on the same host (architecture §2, spec section 8, architecture §3, spec section 7).

Most tests share one node (module scope) and leave it clean: after each test the node
reports no invariant breach, no claim, nothing pending or in flight, and consistent slot
accounting. Tests that need a small pool, another eviction policy or a watermark start a
node of their own. Every transfer is checked byte for byte against patterned data;
every refused delivery is checked to leave the destination's own pattern untouched.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvcr_client import (
    ArgumentError,
    AsyncClient,
    Client,
    ErrorCode,
    KeyStatus,
    NodeError,
    Presence,
    RegionHandle,
    Span,
)
from kvcr_protocol import Abort, Deliver, DeliverItem, Deposit, DepositItem, DstSpan, Error, SrcSpan, decode
from kvcr_testing.health import assert_clean, slot_accounting, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Layout, Registrar, deliver_and_check, hybrid_layout, plain_layout
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

# One node for the module: a plain pool, the three pools of a hybrid model, a small-slot pool.
POOLS = (
    "--pool",
    "kv:64KiB:256",
    "--pool",
    "full:64KiB:64",
    "--pool",
    "swa:16KiB:64",
    "--pool",
    "state:1536KiB:4",
    "--pool",
    "small:4KiB:128",
)
OK = KeyStatus.OK
FAILED = KeyStatus.FAILED
STORED = KeyStatus.STORED


pytestmark = pytest.mark.usefixtures("node_left_clean")


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return POOLS


def stored_object(
    client: Client,
    register: Callable[[np.ndarray], RegionHandle],
    key: bytes,
    layout: Layout,
    seed: int,
    no_evict: bool = False,
) -> tuple[np.ndarray, Any]:
    """Deposit patterned bytes under ``key``; returns (source bytes, outcome)."""
    src = pattern(layout.nbytes, seed)
    region = register(src)
    res = client.deposit({key: layout.source_spans(region)}, no_evict=no_evict).result(RESULT_TIMEOUT_S)
    assert res[key].status is STORED, res[key]
    return src, res[key]


# --------------------------------------------------------------------------- byte-exact delivery


def test_plain_layout_whole_and_subsets(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    layout = plain_layout(32)
    k = key("plain")
    src, _ = stored_object(client, register, k, layout, seed=1)
    assert client.query([k]).result(5)[k].presence is Presence.HIT

    deliver_and_check(client, register, k, layout, src, range(32), seed=100)
    subsets = {
        "first span": [0],
        "spans 0 and 2": [0, 2],
        "last span": [31],
        "every other span": list(range(0, 32, 2)),
        "all but the last": list(range(31)),
    }
    for seed, indices in enumerate(subsets.values(), start=101):
        deliver_and_check(client, register, k, layout, src, indices, seed=seed)
    # Destination spans anywhere in the buffer: gaps between them, placed back to front.
    deliver_and_check(client, register, k, layout, src, [1, 5, 30], seed=120, gap=4 * KiB + 7, reverse=True)
    deliver_and_check(client, register, k, layout, src, range(32), seed=121, gap=3, reverse=True)


def test_hybrid_layout_whole_and_subsets(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    layout = hybrid_layout(8)  # L0.full, L0.swa, ..., L7.full, L7.swa, state
    k = key("hybrid")
    src, _ = stored_object(client, register, k, layout, seed=2)
    state = layout.index("state")

    deliver_and_check(client, register, k, layout, src, range(len(layout.spans)), seed=200)
    subsets = [
        [0, 1],  # the first layer
        [0],
        [state],
        [1, state],
        list(range(0, state, 2)),  # every full span
        list(range(1, state, 2)),  # every swa span
        list(range(state)),  # everything but the state
        [layout.index("L3.full"), layout.index("L3.swa"), state],
    ]
    for seed, indices in enumerate(subsets, start=201):
        deliver_and_check(client, register, k, layout, src, indices, seed=seed)
    deliver_and_check(client, register, k, layout, src, [2, 3, state], seed=230, gap=4 * KiB + 1, reverse=True)


def test_repeated_and_empty_names_deliver_whole(
    client: Client, register: Registrar, key: Callable[[str], bytes]
) -> None:
    """spec section 8: same names in the same order is a full delivery, even with repeats or empty names."""
    for label, names in (("aab", ["a", "a", "b"]), ("empty", ["", "x", ""])):
        layout = Layout([(n, "small", 4 * KiB) for n in names])
        k = key(label)
        src, _ = stored_object(client, register, k, layout, seed=3)
        deliver_and_check(client, register, k, layout, src, range(len(names)), seed=300, gap=11)


# --------------------------------------------------------------------------- invalid subsets fail closed

INVALID_SUBSETS = [
    ("abc", ("c", "a")),
    ("abc", ("a", "a")),
    ("abc", ("d",)),
    ("abc", ("b", "c", "a")),
    ("abc", ("c", "a", "b")),
    ("abc", ("a", "c", "b")),
    ("abc", ("",)),
    ("abc", ("a", "b", "c", "d")),
    ("ab", ("b", "a")),
    ("aab", ("b",)),
    ("aab", ("a", "b")),
    ("xy_", ("x",)),  # "_" stands for an empty stored name: no subset of such a layout
]


def _names(text: str) -> list[str]:
    return ["" if c == "_" else c for c in text]


def _refused_delivery(
    client: Client,
    register: Registrar,
    k: bytes,
    dst_spans: Callable[[RegionHandle], list[Span]],
    size: int,
    code: ErrorCode,
) -> None:
    """Deliver into a sentinel buffer: the key fails with ``code`` and no byte moves."""
    dst = pattern(size, 999)
    before_bytes = dst.copy()
    region = register(dst)
    before = stats(client)
    res = client.deliver({k: dst_spans(region)}).result(RESULT_TIMEOUT_S)
    assert res[k].status is FAILED, res[k]
    assert res[k].code == code, res[k]
    assert res[k].reason
    assert_bytes_equal(dst, before_bytes, "refused destination")
    after = assert_clean(client, slots_before=slot_accounting(before))
    assert after["transfers"]["posted"] == before["transfers"]["posted"], "a refused delivery posted a transfer"
    assert after["transfers"]["bytes"] == before["transfers"]["bytes"]


@pytest.mark.parametrize(
    ("stored", "requested"), INVALID_SUBSETS, ids=[f"{s}-{'.'.join(r) or 'empty'}" for s, r in INVALID_SUBSETS]
)
def test_invalid_subset_fails_closed(
    client: Client,
    register: Registrar,
    key: Callable[[str], bytes],
    stored: str,
    requested: tuple[str, ...],
) -> None:
    slot = 4 * KiB
    layout = Layout([(n, "small", slot) for n in _names(stored)])
    k = key("obj")
    stored_object(client, register, k, layout, seed=4)

    def spans(region: RegionHandle) -> list[Span]:
        return [Span(name, region, j * slot, slot) for j, name in enumerate(requested)]

    _refused_delivery(client, register, k, spans, slot * len(requested), ErrorCode.LAYOUT_SUBSET_INVALID)


@pytest.mark.parametrize(
    ("requested", "lengths"),
    [(("b",), (8 * KiB,)), (("a", "c"), (4 * KiB, 2 * KiB)), (("a", "b", "c"), (4 * KiB, 4 * KiB, 4 * KiB - 1))],
    ids=["subset-longer", "subset-shorter", "whole-shorter"],
)
def test_wrong_span_length_is_size_mismatch(
    client: Client,
    register: Registrar,
    key: Callable[[str], bytes],
    requested: tuple[str, ...],
    lengths: tuple[int, ...],
) -> None:
    layout = Layout([(n, "small", 4 * KiB) for n in "abc"])
    k = key("obj")
    stored_object(client, register, k, layout, seed=5)
    offsets = np.cumsum((0, *lengths))

    def spans(region: RegionHandle) -> list[Span]:
        return [
            Span(n, region, int(o), n_bytes) for n, o, n_bytes in zip(requested, offsets[:-1], lengths, strict=True)
        ]

    _refused_delivery(client, register, k, spans, int(offsets[-1]), ErrorCode.SIZE_MISMATCH)


def test_empty_span_list_is_refused_client_side(
    client: Client, register: Registrar, key: Callable[[str], bytes]
) -> None:
    k = key("obj")
    stored_object(client, register, k, plain_layout(2, "small", 4 * KiB), seed=6)
    with pytest.raises(ArgumentError) as err:
        client.deliver({k: []})
    assert "spans" in err.value.field
    with pytest.raises(ArgumentError) as err:
        client.deliver({})
    assert err.value.field == "objects"


def test_bad_key_fails_while_other_keys_of_the_batch_deliver(
    client: Client,
    register: Registrar,
    key: Callable[[str], bytes],
) -> None:
    slot = 4 * KiB
    layout = plain_layout(3, "small", slot)
    good, bad, missing = key("good"), key("bad"), key("missing")
    src_good, _ = stored_object(client, register, good, layout, seed=7)
    stored_object(client, register, bad, layout, seed=8)
    dst = pattern(7 * slot, 70)
    expected = dst.copy()
    region = register(dst)
    # good: the whole object at [0, 3 slots); bad: a reordered subset at [3, 5); missing at [5, 6).
    good_spans = [Span(f"L{i}", region, i * slot, slot) for i in range(3)]
    bad_spans = [Span("L2", region, 3 * slot, slot), Span("L0", region, 4 * slot, slot)]
    missing_spans = [Span("L0", region, 5 * slot, slot)]
    expected[: 3 * slot] = src_good
    res = client.deliver({bad: bad_spans, good: good_spans, missing: missing_spans}).result(RESULT_TIMEOUT_S)
    assert list(res) == [bad, good, missing]
    assert (res[bad].status, res[bad].code) == (FAILED, ErrorCode.LAYOUT_SUBSET_INVALID)
    assert res[good].status is OK, res[good]
    assert (res[missing].status, res[missing].code) == (FAILED, ErrorCode.NOT_FOUND)
    assert not res.all_ok
    assert_bytes_equal(dst, expected, "batch destination")


# --------------------------------------------------------------------------- eviction


def _deposit_n(
    client: Client, region: RegionHandle, key: bytes, layout: Layout, base: int, no_evict: bool = False
) -> Any:
    res = client.deposit({key: layout.source_spans(region, base)}, no_evict=no_evict).result(RESULT_TIMEOUT_S)
    return res[key]


def _present(client: Client, keys: list[bytes]) -> dict[bytes, bool]:
    res = client.query(keys).result(5)
    return {k: res[k].presence is Presence.HIT for k in keys}


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_eviction_order_under_pressure(node_factory: Callable[..., Any], policy: str) -> None:
    """Four 4-slot objects fill a 16-slot pool; each new one evicts one in policy order."""
    slot = 4 * KiB
    n = node_factory("--pool", "e:4KiB:16", "--policy", policy)
    layout = plain_layout(4, "e", slot)
    with Client(n.endpoint) as c:
        reg = Registrar(c)
        src = pattern(8 * layout.nbytes, 11)
        region = reg(src)
        keys = [f"obj{i}".encode() for i in range(8)]
        base = {k: i * layout.nbytes for i, k in enumerate(keys)}
        a, b, cc, d, e, f, g, _ = keys

        # a is held at deposit and released after b, c, d: FIFO puts it at the back (it
        # became evictable last); LRU keeps it first (its last access is the oldest).
        handle = _deposit_n(c, region, a, layout, base[a], no_evict=True).handle
        assert handle is not None
        for k in (b, cc, d):
            assert _deposit_n(c, region, k, layout, base[k]).status is STORED
        assert c.release([handle]).result(5)[handle.to_bytes(8, "big")].status is OK
        st = stats(c)
        assert st["pools"]["e"]["free"] == 0 and st["pools"]["e"]["evictable"] == 16

        assert _deposit_n(c, region, e, layout, base[e]).status is STORED
        first_victim = b if policy == "fifo" else a
        assert _present(c, keys[:5]) == {k: k != first_victim for k in keys[:5]}
        assert stats(c)["evictions"]["e"] == 1

        # The oldest survivor is read. Under LRU the read is an access that protects it.
        # Under FIFO its claim ending makes it evictable anew, so it goes to the back too.
        oldest = cc if policy == "fifo" else b
        dst = pattern(layout.nbytes, 12)
        dregion = reg(dst)
        out = c.deliver({oldest: [Span(f"L{i}", dregion, i * slot, slot) for i in range(4)]}).result(RESULT_TIMEOUT_S)
        assert out[oldest].status is OK
        assert_bytes_equal(dst, src[base[oldest] : base[oldest] + layout.nbytes], "survivor")
        assert _deposit_n(c, region, f, layout, base[f]).status is STORED
        # LRU: c, d, e, b (b was just read). FIFO: d, a, e, c (c became evictable last).
        second_victim = cc if policy == "lru" else d
        expected = {k: k not in (first_victim, second_victim) for k in keys[:6]}
        assert _present(c, keys[:6]) == expected
        assert _deposit_n(c, region, g, layout, base[g]).status is STORED
        st = assert_clean(c)
        assert st["evictions"]["e"] == 3
        assert st["pools"]["e"]["objects"] == 4
        reg.close()


def test_capacity_when_everything_is_claimed(node_factory: Callable[..., Any]) -> None:
    slot = 4 * KiB
    n = node_factory("--pool", "e:4KiB:16")
    layout = plain_layout(4, "e", slot)
    with Client(n.endpoint) as c:
        reg = Registrar(c)
        src = pattern(8 * layout.nbytes, 21)
        region = reg(src)
        keys = [f"obj{i}".encode() for i in range(8)]
        handles = []
        for i, k in enumerate(keys[:4]):
            out = _deposit_n(c, region, k, layout, i * layout.nbytes, no_evict=True)
            assert out.status is STORED and out.handle is not None
            handles.append(out.handle)
        before = stats(c)
        assert before["claims"]["total"] == 4

        out = _deposit_n(c, region, keys[4], layout, 4 * layout.nbytes)
        assert (out.status, out.code) == (FAILED, ErrorCode.CAPACITY)
        big = plain_layout(17, "e", slot)  # more slots than the pool has
        res = c.deposit({keys[5]: big.source_spans(region)}).result(RESULT_TIMEOUT_S)
        assert (res[keys[5]].status, res[keys[5]].code) == (FAILED, ErrorCode.CAPACITY)
        after = stats(c)
        assert slot_accounting(after) == slot_accounting(before)
        assert after["evictions"] == before["evictions"]
        assert after["claims"]["total"] == 4 and after["invariants"] == []
        assert _present(c, keys[:6]) == {k: i < 4 for i, k in enumerate(keys[:6])}

        # Held objects are still delivered byte-exact.
        dst = pattern(layout.nbytes, 22)
        dregion = reg(dst)
        assert c.deliver({keys[3]: [Span(f"L{i}", dregion, i * slot, slot) for i in range(4)]}).result(10)[keys[3]].ok
        assert_bytes_equal(dst, src[3 * layout.nbytes : 4 * layout.nbytes], "held object")

        # All or nothing: one evictable object (4 slots) cannot cover an 8-slot deficit.
        assert c.release([handles[0]]).result(5)[handles[0].to_bytes(8, "big")].status is OK
        before = stats(c)
        res = c.deposit({keys[6]: plain_layout(8, "e", slot).source_spans(region)}).result(RESULT_TIMEOUT_S)
        assert (res[keys[6]].status, res[keys[6]].code) == (FAILED, ErrorCode.CAPACITY)
        after = stats(c)
        assert slot_accounting(after) == slot_accounting(before)
        assert after["evictions"] == before["evictions"]
        assert _present(c, [keys[0]]) == {keys[0]: True}

        rel = c.release(handles[1:]).result(5)
        assert [o.status for o in rel.values()] == [OK, OK, OK]
        assert_clean(c)
        # With everything evictable the 8-slot object now fits, evicting two objects.
        assert (
            c.deposit({keys[6]: plain_layout(8, "e", slot).source_spans(region)}).result(10)[keys[6]].status is STORED
        )
        st = assert_clean(c)
        assert st["evictions"]["e"] == 2
        reg.close()


def test_no_evict_handles_protect_until_released(node_factory: Callable[..., Any]) -> None:
    slot = 4 * KiB
    n = node_factory("--pool", "e:4KiB:8")
    layout = plain_layout(4, "e", slot)
    with Client(n.endpoint) as c:
        reg = Registrar(c)
        src = pattern(8 * layout.nbytes, 31)
        region = reg(src)
        keys = [f"obj{i}".encode() for i in range(8)]
        held = _deposit_n(c, region, keys[0], layout, 0, no_evict=True)
        assert held.status is STORED and isinstance(held.handle, int)
        # A batch: the stored key gets a handle, the duplicate none.
        res = c.deposit(
            {keys[0]: layout.source_spans(region, 0), keys[1]: layout.source_spans(region, layout.nbytes)},
            no_evict=True,
        ).result(10)
        assert res[keys[0]].status is KeyStatus.DUPLICATE and res[keys[0]].handle is None
        assert res[keys[1]].status is STORED and res[keys[1]].handle not in (None, held.handle)
        assert stats(c)["claims"] == {"total": 2, "handles": 2, "operations": 0, "leases": 0}
        assert c.release([res[keys[1]].handle]).result(5).all_ok

        # The pool holds two objects; three more deposits evict around the held one.
        for i in (2, 3, 4):
            assert _deposit_n(c, region, keys[i], layout, i * layout.nbytes).status is STORED
        assert _present(c, keys[:5]) == {keys[0]: True, keys[1]: False, keys[2]: False, keys[3]: False, keys[4]: True}
        assert stats(c)["evictions"]["e"] == 3
        dst = pattern(layout.nbytes, 32)
        dregion = reg(dst)
        assert c.deliver({keys[0]: [Span(f"L{i}", dregion, i * slot, slot) for i in range(4)]}).result(10).all_ok
        assert_bytes_equal(dst, src[: layout.nbytes], "held object")

        hb = held.handle.to_bytes(8, "big")
        assert c.release([held.handle]).result(5)[hb].status is OK
        again = c.release([held.handle, 987654321]).result(5)
        assert [(o.status, o.code) for o in again.values()] == [(FAILED, ErrorCode.UNKNOWN_HANDLE)] * 2
        assert_clean(c)
        # Released, it is evictable again: two more deposits replace both stored objects.
        for i in (5, 6):
            assert _deposit_n(c, region, keys[i], layout, i * layout.nbytes).status is STORED
        assert _present(c, [keys[0], keys[4]]) == {keys[0]: False, keys[4]: False}
        assert_clean(c)
        reg.close()


# --------------------------------------------------------------------------- deposit outcomes, fetch, query


def test_duplicate_and_layout_mismatch(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    slot = 4 * KiB
    layout = plain_layout(3, "small", slot)
    k = key("obj")
    src, _ = stored_object(client, register, k, layout, seed=41)
    region = register(pattern(layout.nbytes + 64 * KiB, 42))  # other bytes: a duplicate must not overwrite

    before = stats(client)
    res = client.deposit({k: layout.source_spans(region)}).result(10)
    assert res[k].status is KeyStatus.DUPLICATE
    for other in (
        plain_layout(2, "small", slot),  # fewer spans
        Layout([("M0", "small", slot), ("L1", "small", slot), ("L2", "small", slot)]),  # other names
        Layout([("L0", "small", slot), ("L1", "small", slot), ("L2", "kv", 64 * KiB)]),  # other pools
    ):
        res = client.deposit({k: other.source_spans(region)}).result(10)
        assert (res[k].status, res[k].code) == (FAILED, ErrorCode.LAYOUT_MISMATCH), res[k]
    after = assert_clean(client, slots_before=slot_accounting(before))
    assert after["transfers"]["posted"] == before["transfers"]["posted"]
    deliver_and_check(client, register, k, layout, src, range(3), seed=43)

    # The same key twice in one batch: the node refuses the second (sent raw: a dict cannot).
    k2 = key("twice")
    wire = tuple(SrcSpan(n, p, region.region, o, s) for (n, p, s), o in zip(layout.spans, layout.offsets, strict=True))
    items = (DepositItem(k2, wire), DepositItem(k2, wire))
    _, fut = client.core.request(lambda i: Deposit(i, items), lambda m: m, 10.0, True)
    completion = fut.result(15)
    assert [r.status for r in completion.results] == [STORED, FAILED]
    assert completion.results[1].code == ErrorCode.DUPLICATE_KEY
    # And the same for a deliver.
    dst = pattern(layout.nbytes, 44)
    dregion = register(dst)
    dwire = tuple(DstSpan(n, dregion.region, o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True))
    ditems = (DeliverItem(k2, dwire), DeliverItem(k2, dwire))
    _, fut = client.core.request(lambda i: Deliver(i, ditems), lambda m: m, 10.0, True)
    completion = fut.result(15)
    assert [r.status for r in completion.results] == [OK, FAILED]
    assert completion.results[1].code == ErrorCode.DUPLICATE_KEY
    assert_bytes_equal(dst, np.asarray(region.buffer)[: layout.nbytes], "delivered twice-named key")


def test_fetch_local(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    layout = hybrid_layout(2)
    k = key("obj")
    src, _ = stored_object(client, register, k, layout, seed=51)
    pairs = [(n, p) for n, p, _ in layout.spans]
    missing = key("missing")

    res = client.fetch({k: pairs, missing: pairs}).result(10)
    assert res[k].status is OK and isinstance(res[k].handle, int), res[k]
    assert (res[missing].status, res[missing].code) == (FAILED, ErrorCode.NOT_FOUND)
    st = stats(client)
    assert st["claims"] == {"total": 1, "handles": 1, "operations": 0, "leases": 0}

    for wrong in (pairs[:-1], pairs[1:], [*pairs[:-1], ("state", "kv")], [(n + "x", p) for n, p in pairs]):
        out = client.fetch({k: wrong}).result(10)[k]
        assert (out.status, out.code) == (FAILED, ErrorCode.LAYOUT_MISMATCH), (wrong, out)
    assert stats(client)["claims"]["total"] == 1
    # A fetched object is delivered byte-exact while held.
    deliver_and_check(client, register, k, layout, src, range(len(pairs)), seed=52)
    assert client.release([res[k].handle]).result(5).all_ok
    assert_clean(client)


def test_query_hit_miss_and_hints(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    k, remote, unknown = key("here"), key("remote"), key("unknown")
    stored_object(client, register, k, plain_layout(1, "small", 4 * KiB), seed=61)
    res = client.query([k, remote, unknown]).result(5)
    assert (res[k].presence, res[k].tier) == (Presence.HIT, "dram")
    assert res[remote].presence is Presence.MISS and res[unknown].presence is Presence.MISS

    rid = "req-61"
    assert client.submit_hint(rid, "tcp://127.0.0.1:1", [remote, k]).result(5) is None
    res = client.query([k, remote, unknown], request_id=rid).result(5)
    assert res[k].presence is Presence.HIT  # local first
    assert res[remote].presence is Presence.FETCHABLE
    assert res[unknown].presence is Presence.MISS
    assert client.query([remote]).result(5)[remote].presence is Presence.MISS  # no request id, no hint
    assert client.query([remote], request_id="other").result(5)[remote].presence is Presence.MISS
    assert client.discard_hint(rid).result(5) is None
    assert client.query([remote], request_id=rid).result(5)[remote].presence is Presence.MISS
    assert client.discard_hint(rid).result(5) is None  # discarding twice is harmless


def test_deliver_errors(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    slot = 4 * KiB
    dst = pattern(2 * slot, 71)
    region = register(dst)
    k = key("missing")
    before = slot_accounting(stats(client))
    res = client.deliver({k: [Span("L0", region, 0, slot)]}).result(10)
    assert (res[k].status, res[k].code) == (FAILED, ErrorCode.NOT_FOUND)
    assert_bytes_equal(dst, pattern(2 * slot, 71), "destination of a missing key")
    assert_clean(client, slots_before=before)

    with pytest.raises(ArgumentError) as err:
        client.deliver({k: [Span("L0", region, slot + 1, slot)]})
    assert err.value.field.endswith("spans[0].offset")
    with pytest.raises(ArgumentError) as err:
        client.deliver({k: [Span("L0", region, 0, slot), Span("L1", region, 0, 0)]})
    assert err.value.field.endswith("spans[1].length")
    with pytest.raises(ArgumentError) as err:
        client.deliver({k: [Span("L0", region, -1, slot)]})
    assert err.value.field.endswith("spans[0].offset")

    # A region this client never registered (or no longer has) is refused before sending.
    stranger = RegionHandle(region.region, region.kind, region.address, region.length, region.device, dst)
    with pytest.raises(ArgumentError) as err:
        client.deliver({k: [Span("L0", stranger, 0, slot)]})
    assert err.value.field.endswith("spans[0].region")
    gone = register(pattern(slot, 72))
    register.regions.remove(gone)
    client.unregister(gone)
    with pytest.raises(ArgumentError) as err:
        client.deposit({k: [Span("L0", gone, 0, slot, "small")]})
    assert err.value.field.endswith("spans[0].region")
    # Deposit-only checks: the pool must exist and the length match its slots.
    with pytest.raises(ArgumentError) as err:
        client.deposit({k: [Span("L0", region, 0, slot, "nope")]})
    assert err.value.field.endswith("spans[0].pool")
    with pytest.raises(ArgumentError) as err:
        client.deposit({k: [Span("L0", region, 0, slot - 1, "small")]})
    assert err.value.field.endswith("spans[0].length")
    with pytest.raises(ArgumentError) as err:
        client.deposit({"text": [Span("L0", region, 0, slot, "small")]})  # type: ignore[dict-item]
    assert err.value.field.startswith("objects")
    # One call carries at most max_spans spans over all its keys.
    many = [Span("L0", region, 0, slot)] * 40_000
    with pytest.raises(ArgumentError) as err:
        client.deliver({k: many, k + b"2": many})
    assert err.value.field == "objects" and "80000 spans" in str(err.value)
    with pytest.raises(ArgumentError) as err:
        client.destination(many * 2)
    assert err.value.field == "spans"
    with pytest.raises(ArgumentError) as err:
        client.fetch({k: [("L0", "small")] * 70_000})
    assert err.value.field == "expected_layouts"
    # Buffers that cannot be regions.
    with pytest.raises(ArgumentError) as err:
        client.register(np.arange(64, dtype=np.uint8)[::2])
    assert err.value.field == "buffer"
    with pytest.raises(ArgumentError) as err:
        client.register(b"bytes")
    assert err.value.field == "buffer"


def test_prepared_destination_is_reused_and_checked(
    client: Client, node: Any, register: Registrar, key: Callable[[str], bytes]
) -> None:
    """``Client.destination`` checks spans once; deliver reuses them and rechecks only the regions."""
    layout = plain_layout(16)
    k = key("prepared")
    src, _ = stored_object(client, register, k, layout, seed=5)
    k2 = key("prepared-2")
    src2, _ = stored_object(client, register, k2, layout, seed=6)
    span = 64 * KiB
    dst = pattern(16 * span, 501)
    region = register(dst)
    whole = client.destination([Span(f"L{i}", region, i * span, span) for i in range(16)])
    first = client.destination([Span("L0", region, 0, span)])
    assert len(whole) == 16
    before = slot_accounting(stats(client))
    for seed in (502, 503):
        dst[:] = pattern(dst.size, seed)
        res = client.deliver({k: whole}).result(RESULT_TIMEOUT_S)
        assert res[k].status is OK, res[k]
        assert_bytes_equal(dst, src, "deliver into a prepared destination")
    # The destination keeps its column block per plan; another key's bytes land through it.
    layers = [[f"L{i}"] for i in range(16)]
    for which, want in ((k2, src2), (k, src), (k2, src2)):
        dst[:] = 0
        handle = client.deliver({which: whole}, plan=layers)
        assert handle.result(RESULT_TIMEOUT_S)[which].status is OK
        assert_bytes_equal(dst, want, "a planned deliver into a prepared destination")
    dst[:] = pattern(dst.size, 504)
    expected = dst.copy()
    expected[:span] = src[:span]
    assert client.deliver({k: first}).result(RESULT_TIMEOUT_S)[k].status is OK
    assert_bytes_equal(dst, expected, "deliver of a prepared first layer")

    # Spans are checked when the destination is made, with the same field paths as deliver.
    with pytest.raises(ArgumentError) as err:
        client.destination([Span("L0", region, 0, span), Span("L1", region, 16 * span, span)])
    assert err.value.field == "spans[1].offset"
    with pytest.raises(ArgumentError):
        client.destination([])
    # Another client's destination, or one whose region is gone, is refused before sending.
    with Client(node.endpoint, name="itest-other") as other:
        mine = other.register(pattern(span, 505))
        foreign = other.destination([Span("L0", mine, 0, span)])
        with pytest.raises(ArgumentError) as err:
            client.deliver({k: foreign})
        assert "another client" in str(err.value)
        other.unregister(mine)
        with pytest.raises(ArgumentError) as err:
            other.deliver({k: foreign})
        assert err.value.field.endswith(".spans") and "no longer registered" in str(err.value)
    assert_clean(client, slots_before=before)


def test_capacity_events_are_edge_triggered(node_factory: Callable[..., Any]) -> None:
    """Reclaimable (free + evictable) under half the pool: one event for that pool, re-armed above."""
    n = node_factory("--pool", "cap:4KiB:16", "--pool", "other:4KiB:16", "--low-watermark", "0.5")
    slot = 4 * KiB
    with Client(n.endpoint) as c:
        reg = Registrar(c)
        src = pattern(40 * slot, 81)
        region = reg(src)
        events = c.core.capacity_events

        def count(pool: str) -> int:
            return sum(1 for e in list(events) if e.pool == pool)

        def hold(i: int) -> int:
            k = f"cap{i}".encode()
            out = c.deposit({k: [Span("L0", region, i * slot, slot, "cap")]}, no_evict=True).result(10)[k]
            assert out.status is STORED and out.handle is not None
            return out.handle

        # Other traffic on another pool never raises an event for "cap".
        for i in range(8):
            k = f"other{i}".encode()
            assert c.deposit({k: [Span("L0", region, i * slot, slot, "other")]}).result(10)[k].status is STORED
        handles = [hold(i) for i in range(8)]  # reclaimable 8 of 16: not under the watermark
        stats(c)  # a round trip: anything the node sent before this reply has been dispatched
        assert count("cap") == 0
        handles.append(hold(8))  # reclaimable 7 < 8
        assert wait_until(lambda: count("cap") >= 1, 5.0)
        event = next(e for e in events if e.pool == "cap")
        assert (event.reclaimable, event.total) == (7, 16)
        handles += [hold(i) for i in range(9, 14)]  # deeper under: no second event
        stats(c)
        assert count("cap") == 1 and count("other") == 0

        assert c.release(handles).result(5).all_ok  # back above: re-armed
        assert_clean(c)
        assert count("cap") == 1
        handles = [hold(i) for i in range(14, 23)]  # 9 more held (older objects are evicted)
        assert wait_until(lambda: count("cap") >= 2, 5.0)
        stats(c)
        assert count("cap") == 2 and count("other") == 0
        assert c.release(handles).result(5).all_ok
        st = assert_clean(c)
        assert st["counters"]["capacity_events"] == 2
        reg.close()


# --------------------------------------------------------------------------- completions


def test_poll_completed_returns_completed_handles(
    client: Client, register: Registrar, key: Callable[[str], bytes]
) -> None:
    client.poll_completed()  # forget earlier operations
    layout = plain_layout(2, "small", 4 * KiB)
    k = key("obj")
    src = pattern(layout.nbytes, 91)
    region = register(src)
    client.poll_completed()
    dep = client.deposit({k: layout.source_spans(region)})
    assert dep.result(10)[k].status is STORED
    dst = pattern(layout.nbytes, 92)
    dregion = register(dst)
    client.poll_completed()  # register's own requests are not op handles; dep may or may not be here
    dlv = client.deliver(
        {k: [Span(n, dregion, o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]}
    )
    qry = client.query([k])
    issued = {dlv, qry}
    seen: list[Any] = []
    # Done callbacks run on the I/O thread right after the result is set: poll, bounded.
    assert wait_until(lambda: seen.extend(client.poll_completed()) or issued <= set(seen), 10.0), seen
    assert all(h.done() for h in seen)
    assert dlv.result(0).all_ok and qry.result(0)[k].presence is Presence.HIT
    assert_bytes_equal(dst, src, "deliver")
    assert wait_until(lambda: seen.extend(client.poll_completed()) or True, 0.0)
    assert len(seen) == len(set(seen)), "a handle was returned twice"
    assert client.poll_completed() == []


def test_replies_nobody_drives_still_complete(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """A blocking client's background thread completes what no caller waits on, also right after a caller drove."""
    layout = plain_layout(2, "small", 4 * KiB)
    k = key("obj")
    src = pattern(layout.nbytes, 95)
    region = register(src)
    assert client.deposit({k: layout.source_spans(region)}).result(10)[k].status is STORED
    dst = pattern(layout.nbytes, 96)
    dregion = register(dst)
    spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]
    for _ in range(3):
        client.query([k]).result(5)  # a caller drove a moment ago: the background thread is parked
        left = [client.query([k]), client.deliver({k: spans})]
        # Only look (future.done() does not drive): the background thread must take these.
        assert wait_until(lambda left=left: all(h.future.done() for h in left), 5.0), left
        assert left[0].result(0)[k].presence is Presence.HIT and left[1].result(0).all_ok
        assert_bytes_equal(dst, src, "deliver nobody waited on")
    # A sync handle can be awaited from asyncio too.
    assert asyncio.run(_await(client.query([k])))[k].presence is Presence.HIT
    # A done-callback may look at other handles (done() does not read from inside a read).
    seen: list[bool] = []
    first, second = client.query([k]), client.query([k])
    first.future.add_done_callback(lambda _: seen.append(second.done()))
    assert first.result(5)[k].presence is Presence.HIT and second.result(5)[k].presence is Presence.HIT
    assert len(seen) == 1


async def _await(handle: Any) -> Any:
    return await handle


async def test_async_client_round_trip(node: Any) -> None:
    layout = plain_layout(4, "small", 4 * KiB)
    src = pattern(layout.nbytes, 101)
    dst = pattern(layout.nbytes, 102)
    async with await AsyncClient.connect(node.endpoint, name="itest-async") as c:
        region = await c.register(src)
        dregion = await c.register(dst)
        res = await c.deposit({b"async/obj": layout.source_spans(region)})
        assert res[b"async/obj"].status is STORED
        assert (await c.query([b"async/obj"]))[b"async/obj"].presence is Presence.HIT
        spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]
        handles = [c.deliver({b"async/obj": spans[:2]}), c.deliver({b"async/obj": spans[2:]})]
        # A subset per handle: awaited together (per-layer completions).
        results = await asyncio.wait_for(asyncio.gather(*handles), 15)
        assert [r[b"async/obj"].status for r in results] == [OK, OK]
        assert_bytes_equal(dst, src, "async deliver")
        st = await c.stats(audit=True)
        assert st["invariants"] == [] and st["claims"]["total"] == 0 and st["operations_pending"] == 0
        await c.unregister(region)
        await c.unregister(dregion)


# --------------------------------------------------------------------------- abort and malformed input


def test_abort_unknown_and_completed_ops(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    with pytest.raises(NodeError) as err:
        client.core.request(lambda i: Abort(i, 10**12), lambda m: m, 5.0)[1].result(10)
    assert err.value.code == ErrorCode.UNKNOWN_OP
    assert err.value.path == "op"

    layout = plain_layout(2, "small", 4 * KiB)
    k = key("obj")
    src, _ = stored_object(client, register, k, layout, seed=111)
    dst = pattern(layout.nbytes, 112)
    dregion = register(dst)
    dlv = client.deliver(
        {k: [Span(n, dregion, o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]}
    )
    assert dlv.result(10)[k].status is OK
    before = stats(client)
    dlv.abort()  # done: nothing is sent
    client.abort(dlv)
    with pytest.raises(NodeError) as err:  # sent anyway: the node no longer knows the op
        client.core.request(lambda i: Abort(i, dlv.op_id), lambda m: m, 5.0)[1].result(10)
    assert err.value.code == ErrorCode.UNKNOWN_OP
    assert dlv.result(0)[k].status is OK
    assert_bytes_equal(dst, src, "delivered before the abort")
    after = assert_clean(client, slots_before=slot_accounting(before))
    assert after["outcomes"] == before["outcomes"]
    deliver_and_check(client, register, k, layout, src, [1], seed=113)


def test_malformed_input_does_not_disturb_the_node(
    node: Any,
    client: Client,
    register: Registrar,
    key: Callable[[str], bytes],
) -> None:
    before = stats(client)["protocol_errors"]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(node.endpoint)
    rng = np.random.default_rng(121)
    cases: list[tuple[list[bytes], ErrorCode, int]] = [
        ([b"\xc1" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes()], ErrorCode.MALFORMED, 0),
        ([msgpack.packb({"v": 1, "t": "query", "id": 5}) + b"\x00"], ErrorCode.MALFORMED, 0),  # trailing bytes
        ([msgpack.packb([1, 2, 3])], ErrorCode.NOT_A_MAP, 0),
        ([msgpack.packb("a string")], ErrorCode.NOT_A_MAP, 0),
        ([msgpack.packb({"v": 1, "t": "no-such-type", "id": 7})], ErrorCode.UNKNOWN_TYPE, 7),
        ([msgpack.packb({"t": "query", "id": 8})], ErrorCode.MISSING_FIELD, 8),
        ([msgpack.packb({"v": 1, "t": "deposit", "id": 9})], ErrorCode.MISSING_FIELD, 9),
        ([msgpack.packb({"v": 1, "t": "query", "id": 10, "keys": "not a list"})], ErrorCode.WRONG_TYPE, 10),
        ([msgpack.packb({"v": 1, "t": "query", "id": 11, "keys": [b"k"]})], ErrorCode.BAD_STATE, 11),  # no hello
        ([b"\x80", b"\x80"], ErrorCode.MALFORMED, 0),  # two payload frames
        ([b"\xa0" + bytes(9 << 20)], ErrorCode.TOO_LARGE, 0),
    ]
    try:
        for frames, code, rid in cases:
            raw.send_multipart(frames)
            reply = decode(raw.recv())
            assert isinstance(reply, Error), reply
            assert (reply.code, reply.id) == (code, rid), (frames[0][:40], reply)
    finally:
        raw.close(0)
        ctx.term()
    st = stats(client)
    expected: dict[str, int] = dict(before)
    for _, code, _ in cases:
        expected[code.name] = expected.get(code.name, 0) + 1
    assert st["protocol_errors"] == expected
    assert st["clients"] == 1

    # The client's session is untouched: a deposit and deliver round trip still works.
    layout = plain_layout(3, "small", 4 * KiB)
    k = key("after")
    src, _ = stored_object(client, register, k, layout, seed=122)
    deliver_and_check(client, register, k, layout, src, range(3), seed=123)
    deliver_and_check(client, register, k, layout, src, [0, 2], seed=124)


def test_sigterm_with_a_connected_client(node_factory: Callable[..., Any]) -> None:
    """The node stops cleanly (exit 0) while a client is connected; the client notices."""
    n = node_factory("--pool", "e:4KiB:8")
    with Client(n.endpoint) as c:
        assert_clean(c)
        n.proc.send_signal(signal.SIGTERM)
        assert n.proc.wait(15) == 0
        assert wait_until(lambda: c.core.lost, 5.0)


def test_lru_counts_a_fetch_as_an_access(node_factory: Callable[..., Any]) -> None:
    """architecture §3: LRU's last access includes the fetch claim; the oldest object, fetched, survives."""
    slot = 4 * KiB
    n = node_factory("--pool", "e:4KiB:16", "--policy", "lru")
    layout = plain_layout(4, "e", slot)
    with Client(n.endpoint) as c:
        reg = Registrar(c)
        src = pattern(5 * layout.nbytes, 131)
        region = reg(src)
        keys = [f"obj{i}".encode() for i in range(5)]
        for i, k in enumerate(keys[:4]):
            assert _deposit_n(c, region, k, layout, i * layout.nbytes).status is STORED
        res = c.fetch({keys[0]: [(n_, p) for n_, p, _ in layout.spans]}).result(10)
        assert res[keys[0]].status is OK
        assert c.release([res[keys[0]].handle]).result(5).all_ok
        assert _deposit_n(c, region, keys[4], layout, 4 * layout.nbytes).status is STORED
        assert _present(c, keys) == {k: k != keys[1] for k in keys}
        assert_clean(c)
        reg.close()


def test_node_rechecks_many_span_destinations(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """Destinations of many spans (checked a column at a time by the node): every refusal names its span."""
    slot = 4 * KiB
    n = 24
    layout = plain_layout(n, "small", slot)
    k = key("obj")
    src, _ = stored_object(client, register, k, layout, seed=151)
    dst = pattern((n + 1) * slot, 152)
    region = register(dst)
    other = register(pattern(n * slot, 153))
    before = stats(client)

    def raw(spans: list[DstSpan]) -> Any:
        build = lambda i: Deliver(i, (DeliverItem(k, tuple(spans)),))  # noqa: E731
        return client.core.request(build, lambda m: m, 10.0, True)[1].result(15).results[0]

    good = [DstSpan(f"L{i}", region.region, i * slot, slot) for i in range(n)]
    cases = {
        "last span past the region's end": (
            [*good[:-1], DstSpan(f"L{n - 1}", region.region, (n + 1) * slot - slot + 1, slot)], ErrorCode.BAD_DESCRIPTOR,
            f"spans[{n - 1}].offset",
        ),
        "an offset beyond any address": (
            [*good[:5], DstSpan("L5", region.region, (1 << 64) - 1, slot), *good[6:]], ErrorCode.BAD_DESCRIPTOR, "spans[5].offset",
        ),
        "one span in a region never announced": (
            [*good[:7], DstSpan("L7", 424242, 0, slot), *good[8:]], ErrorCode.BAD_DESCRIPTOR, "spans[7].region",
        ),
        "one length off": ([*good[:3], DstSpan("L3", region.region, 3 * slot, slot - 1), *good[4:]], ErrorCode.SIZE_MISMATCH, "spans[3].length"),
    }
    for label, (spans, code, where) in cases.items():
        out = raw(spans)
        assert (out.status, out.code) == (FAILED, code), (label, out)
        assert where in out.reason, (label, out.reason)
    assert_bytes_equal(dst, pattern((n + 1) * slot, 152), "refused destination")
    assert_clean(client, slots_before=slot_accounting(before))

    # Accepted shapes: back to front (no run merges), spans split over two regions, a subset.
    expected = dst.copy()
    backwards = [DstSpan(f"L{i}", region.region, (n - 1 - i) * slot, slot) for i in range(n)]
    for i in range(n):
        expected[(n - 1 - i) * slot : (n - i) * slot] = layout.src_bytes(src, i)
    assert raw(backwards).status is OK
    assert_bytes_equal(dst, expected, "back-to-front destination")
    split = [DstSpan(f"L{i}", (region if i % 2 else other).region, i * slot, slot) for i in range(n)]
    assert raw(split).status is OK
    for i in range(1, n, 2):
        assert_bytes_equal(dst[i * slot : (i + 1) * slot], layout.src_bytes(src, i), f"span {i} in the first region")
    subset = [DstSpan(f"L{i}", region.region, (i // 2) * slot, slot) for i in range(0, n, 2) if i != 4]
    dst[:] = pattern(dst.size, 154)
    assert raw(subset).status is OK
    for j, i in enumerate([i for i in range(0, n, 2) if i != 4]):
        assert_bytes_equal(dst[(i // 2) * slot : (i // 2 + 1) * slot], layout.src_bytes(src, i), f"subset span {j}")
    assert_clean(client, slots_before=slot_accounting(before))


def test_node_rechecks_many_span_deposits(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """Deposits of many spans (checked a column at a time by the node): refusals name the span, nothing leaks."""
    slot = 4 * KiB
    n = 24
    layout = plain_layout(n, "small", slot)
    src = pattern((n + 1) * slot, 161)
    region = register(src)
    other = register(pattern(n * slot, 162))
    before = stats(client)

    def raw(k: bytes, spans: list[SrcSpan]) -> Any:
        build = lambda i: Deposit(i, (DepositItem(k, tuple(spans)),))  # noqa: E731
        return client.core.request(build, lambda m: m, 10.0, True)[1].result(15).results[0]

    good = [SrcSpan(f"L{i}", "small", region.region, i * slot, slot) for i in range(n)]
    cases = {
        "last span past the region's end": (
            [*good[:-1], SrcSpan(f"L{n - 1}", "small", region.region, n * slot + 1, slot)], ErrorCode.BAD_DESCRIPTOR,
            f"spans[{n - 1}].offset",
        ),
        "an offset beyond any address": (
            [*good[:5], SrcSpan("L5", "small", region.region, (1 << 64) - 1, slot), *good[6:]],
            ErrorCode.BAD_DESCRIPTOR, "spans[5].offset",
        ),
        "one span in a region never announced": (
            [*good[:7], SrcSpan("L7", "small", 424242, 0, slot), *good[8:]], ErrorCode.BAD_DESCRIPTOR, "spans[7].region",
        ),
        "one length off": (
            [*good[:3], SrcSpan("L3", "small", region.region, 3 * slot, slot - 1), *good[4:]],
            ErrorCode.SIZE_MISMATCH, "spans[3].length",
        ),
        "one pool unknown": ([*good[:9], SrcSpan("L9", "nope", region.region, 0, slot), *good[10:]], ErrorCode.UNKNOWN_POOL, "spans[9].pool"),
    }
    for label, (spans, code, where) in cases.items():
        out = raw(key(label), spans)
        assert (out.status, out.code) == (FAILED, code), (label, out)
        assert where in out.reason, (label, out.reason)
        assert client.query([key(label)]).result(5)[key(label)].presence is Presence.MISS
    assert_clean(client, slots_before=slot_accounting(before))

    # Accepted shapes, each delivered back byte for byte: offset by one span, back to
    # front, and split over two regions.
    shapes = {
        "shifted": [SrcSpan(f"L{i}", "small", region.region, (i + 1) * slot, slot) for i in range(n)],
        "backwards": [SrcSpan(f"L{i}", "small", region.region, (n - 1 - i) * slot, slot) for i in range(n)],
        "split": [SrcSpan(f"L{i}", "small", (region if i % 2 else other).region, i * slot, slot) for i in range(n)],
    }
    buffers = {region.region: src, other.region: other.buffer}
    for label, spans in shapes.items():
        k = key(label)
        assert raw(k, spans).status is STORED, label
        expected = np.concatenate([buffers[s.region][s.offset : s.offset + slot] for s in spans])
        deliver_and_check(client, register, k, layout, expected, range(n), seed=170)


def test_region_over_memory_registered_before(node: NodeProcess, key: Callable[[str], bytes]) -> None:
    """A region over memory part of which is or was another region: the node still finds it.

    NIXL keeps every registration a client's metadata ever carried until the whole agent is
    removed, and looks a descriptor up next to its neighbours only, so a smaller region inside
    a larger one (live, or withdrawn and its memory reused) hid the larger one from transfers
    starting past it (architecture §6). A client of its own: only its regions are in that view.
    """
    slot = 4 * KiB
    n = 8
    layout = plain_layout(n, "small", slot)
    past = 5 * slot
    with Client(node.endpoint, name="itest-reregistered") as c:
        reg = Registrar(c)
        try:
            k = key("obj")
            src, _ = stored_object(c, reg, k, layout, seed=181)
            buf = pattern(past + n * slot, 182)
            inner = c.register(buf[2 * slot : 4 * slot])
            region = reg(buf)
            forward = [Span(f"L{i}", region, past + i * slot, slot) for i in range(n)]
            backwards = [Span(f"L{i}", region, past + (n - 1 - i) * slot, slot) for i in range(n)]
            for state in ("live", "withdrawn"):
                if state == "withdrawn":
                    c.unregister(inner)
                for label, spans in (("forward", forward), ("backwards", backwards)):
                    buf[:] = pattern(buf.size, 183)
                    expected = buf.copy()
                    for i, span in enumerate(spans):
                        expected[span.offset : span.offset + slot] = layout.src_bytes(src, i)
                    out = c.deliver({k: spans}).result(RESULT_TIMEOUT_S)[k]
                    assert out.status is OK, (label, state, out)
                    assert_bytes_equal(buf, expected, f"{label} delivery, inner region {state}")
            # Deposits read such a region: store it in either order, deliver it back.
            for label, spans in (("forward", forward), ("backwards", backwards)):
                stored = key(f"deposit {label}")
                sources = [Span(span.name, region, span.offset, slot, "small") for span in spans]
                assert c.deposit({stored: sources}).result(RESULT_TIMEOUT_S)[stored].status is STORED, label
                expected = np.concatenate([buf[span.offset : span.offset + slot] for span in spans])
                deliver_and_check(c, reg, stored, layout, expected, range(n), seed=184)
            assert_clean(c)
        finally:
            reg.close()


def test_node_rechecks_what_the_client_checks(client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    """Requests built past the client's checks (raw messages): the node refuses each key on its own."""
    slot = 4 * KiB
    layout = plain_layout(2, "small", slot)
    k = key("obj")
    src, _ = stored_object(client, register, k, layout, seed=141)
    dst = pattern(2 * slot, 142)
    dregion = register(dst)
    before = stats(client)

    def raw(build: Callable[[int], Any]) -> Any:
        return client.core.request(build, lambda m: m, 10.0, True)[1].result(15)

    bad_dst = [
        (DstSpan("L0", dregion.region, slot + 1, slot), ErrorCode.BAD_DESCRIPTOR),  # past the region's end
        (DstSpan("L0", 424242, 0, slot), ErrorCode.BAD_DESCRIPTOR),  # a region never announced
    ]
    for span, code in bad_dst:
        out = raw(lambda i, span=span: Deliver(i, (DeliverItem(k, (span,)),))).results[0]
        assert (out.status, out.code) == (FAILED, code), out
    new = key("new")
    bad_src = [
        (SrcSpan("L0", "nope", dregion.region, 0, slot), ErrorCode.UNKNOWN_POOL),
        (SrcSpan("L0", "small", dregion.region, 0, slot - 1), ErrorCode.SIZE_MISMATCH),
        (SrcSpan("L0", "small", dregion.region, slot + 1, slot), ErrorCode.BAD_DESCRIPTOR),
        (SrcSpan("L0", "small", 424242, 0, slot), ErrorCode.BAD_DESCRIPTOR),
    ]
    for span, code in bad_src:
        out = raw(lambda i, span=span: Deposit(i, (DepositItem(new, (span,)),))).results[0]
        assert (out.status, out.code) == (FAILED, code), out
    assert_bytes_equal(dst, pattern(2 * slot, 142), "refused destination")
    after = assert_clean(client, slots_before=slot_accounting(before))
    assert after["transfers"]["posted"] == before["transfers"]["posted"]
    assert client.query([new]).result(5)[new].presence is Presence.MISS
    deliver_and_check(client, register, k, layout, src, [0, 1], seed=143)
