"""A call's items as column blocks (spec section 6.7): one block per run of consecutive keys
that share a layout (and a deliver's plan), records when a name cannot travel in a column."""

from __future__ import annotations

import itertools
import random

import pytest

import kvcr_protocol as kp
from kvcr_protocol import DeliverItem, DepositItem, DstSpan, SrcSpan, deliver_blocks, deposit_blocks, layout_runs

SLOT = 4096


def deliver_item(n: int, names: tuple[str, ...], lengths: tuple[int, ...], region: int = 1) -> DeliverItem:
    """Key ``n``'s spans back to back from ``n`` MiB into ``region``."""
    offsets = [n << 20]
    for length in lengths[:-1]:
        offsets.append(offsets[-1] + length)
    return DeliverItem(
        f"key-{n}".encode(),
        tuple(DstSpan(name, region, offset, length) for name, offset, length in zip(names, offsets, lengths, strict=True)),
    )


def deposit_item(n: int, names: tuple[str, ...], pools: tuple[str, ...], region: int = 1) -> DepositItem:
    return DepositItem(
        f"key-{n}".encode(),
        tuple(SrcSpan(name, pool, region, (n << 20) + j * SLOT, SLOT) for j, (name, pool) in enumerate(zip(names, pools, strict=True))),
    )


KV = ("k", "v")
LAYERS = ("l0", "l1", "l2")


def patterned_delivers() -> list[DeliverItem]:
    """Keys 0-2 of one layout, 3-4 of the same names with other lengths, 5 back to the first
    layout (a new run: only neighbours share a block), 6-7 of three spans in region 2."""
    return [
        *(deliver_item(n, KV, (SLOT, SLOT)) for n in range(3)),
        *(deliver_item(n, KV, (SLOT, 2 * SLOT)) for n in range(3, 5)),
        deliver_item(5, KV, (SLOT, SLOT)),
        *(deliver_item(n, LAYERS, (SLOT,) * 3, region=2) for n in range(6, 8)),
    ]


def test_runs_are_neighbours_of_one_shape() -> None:
    assert layout_runs("aaabbaccc", lambda n, c: c) == [("a", 0, 3), ("b", 3, 5), ("a", 5, 6), ("c", 6, 9)]
    assert layout_runs([7], lambda n, x: x) == [(7, 0, 1)]
    assert layout_runs([], lambda n, x: x) == []
    assert layout_runs([0, 0, 0, 0], lambda n, x: n // 2) == [(0, 0, 2), (1, 2, 4)]


def test_deliver_blocks_follow_the_runs_and_travel_as_their_records() -> None:
    items = patterned_delivers()
    blocks = deliver_blocks(items)
    assert blocks == (
        kp.deliver_columns(items[0:3]), kp.deliver_columns(items[3:5]), kp.deliver_columns(items[5:6]),
        kp.deliver_columns(items[6:8]),
    )
    assert [block.keys for block in blocks] == [
        (b"key-0", b"key-1", b"key-2"), (b"key-3", b"key-4"), (b"key-5",), (b"key-6", b"key-7"),
    ]
    assert blocks[0].lengths == SLOT and blocks[1].lengths == kp.columns.pack([SLOT, 2 * SLOT], kp.columns.U64)
    assert blocks[3].regions == 2
    msg = kp.Deliver(9, (), "r", 100, columns=blocks)
    decoded = kp.decode(kp.encode(msg, 3), 3)
    assert decoded == msg
    assert kp.record_items(decoded) == tuple(items)


def test_a_plan_splits_a_run_where_the_keys_plans_differ() -> None:
    items = patterned_delivers()
    groups = [(0, 1)] * 2 + [(0, 0)] + [(1, 0)] * 2 + [(0, 1)] + [(0, 1, 2), (0, 1, 2)]
    blocks = deliver_blocks(items, groups)
    assert blocks == (
        kp.deliver_columns(items[0:2], (0, 1)), kp.deliver_columns(items[2:3], (0, 0)),
        kp.deliver_columns(items[3:5], (1, 0)), kp.deliver_columns(items[5:6], (0, 1)),
        kp.deliver_columns(items[6:8], (0, 1, 2)),
    )
    assert [block.plan() for block in blocks] == [((0,), (1,)), ((0, 1),), ((1,), (0,)), ((0,), (1,)), ((0,), (1,), (2,))]
    msg = kp.Deliver(9, (), None, 0, columns=blocks, notify=77)
    assert kp.decode(kp.encode(msg, 3), 3) == msg
    # Empty group numbers (one group) and no plan at all make the same blocks.
    assert deliver_blocks(items, [()] * len(items)) == deliver_blocks(items)


def test_a_name_holding_nul_sends_every_key_as_a_record() -> None:
    items = patterned_delivers()
    items[6] = deliver_item(6, ("l0", "l\0", "l2"), (SLOT,) * 3)
    assert deliver_blocks(items) == ()
    assert deposit_blocks([deposit_item(0, KV, ("p", "p")), deposit_item(1, KV, ("p", "q\0"))]) == ()
    assert deposit_blocks([deposit_item(0, KV, ("p", "p")), deposit_item(1, ("k", "\0"), ("p", "p"))]) == ()


def test_deposit_blocks_split_where_names_or_pools_change() -> None:
    items = [
        deposit_item(0, KV, ("kv", "kv")), deposit_item(1, KV, ("kv", "kv")),
        deposit_item(2, KV, ("kv", "cold")), deposit_item(3, ("k", "w"), ("kv", "cold")),
        deposit_item(4, ("k", "w"), ("kv", "cold"), region=3),
    ]
    blocks = deposit_blocks(items)
    assert blocks == (
        kp.deposit_columns(items[0:2]), kp.deposit_columns(items[2:3]), kp.deposit_columns(items[3:5]),
    )
    assert blocks[2].regions == kp.columns.pack([1, 1, 3, 3], kp.columns.U32)  # one region per entry
    msg = kp.Deposit(4, (), no_evict=True, columns=blocks)
    decoded = kp.decode(kp.encode(msg, 3), 3)
    assert decoded == msg
    assert kp.record_items(decoded) == tuple(items)


@pytest.mark.parametrize("seed", range(20))
def test_any_mix_of_layouts_round_trips(seed: int) -> None:
    rng = random.Random(seed)
    layouts = [(KV, (SLOT, SLOT)), (KV, (SLOT, 2 * SLOT)), (LAYERS, (SLOT,) * 3), (("x",), (64,))]
    items = [deliver_item(n, *rng.choice(layouts), region=rng.choice((1, 2))) for n in range(rng.randint(1, 60))]
    blocks = deliver_blocks(items)
    assert sum(len(block.keys) for block in blocks) == len(items)
    # Neighbouring blocks differ in layout: a run is as long as it can be.
    assert all((a.names, a.lengths) != (b.names, b.lengths) for a, b in itertools.pairwise(blocks))
    msg = kp.Deliver(1, (), columns=blocks)
    assert kp.record_items(kp.decode(kp.encode(msg, 3), 3)) == tuple(items)
