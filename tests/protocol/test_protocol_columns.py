"""Span columns and layer plans (version 3): the same keys as records, checked as strictly."""

from __future__ import annotations

import dataclasses
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcr_protocol as kp
from kvcr_protocol import DeliverItem, DepositItem, DstSpan, ErrorCode, MemoryKind, Region, SrcSpan
from kvcr_protocol.columns import U16, U32, U64, pack, unpack
from kvcr_protocol.descriptors import resolve_columns
from kvcr_protocol.wire import NUL

SETTINGS = settings(max_examples=150, deadline=None)
REGIONS = {
    1: Region(1, MemoryKind.DRAM, 0, 0x10000, 1 << 20),
    2: Region(2, MemoryKind.VRAM, 3, 0x7F00_0000_0000, 1 << 24),
    3: Region(3, MemoryKind.VRAM, 3, 0x7E00_0000_0000, 4096),
}


def pack_map(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def refused(frame: bytes, max_version: int = 3) -> kp.RemoteProtocolError:
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(frame, max_version)
    return info.value


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[str], list[int]]:
    n = draw(st.integers(1, 6))
    names = draw(st.lists(st.text(max_size=5).filter(lambda s: NUL not in s), min_size=n, max_size=n))
    lengths = draw(st.sampled_from([[4096] * n, [draw(st.integers(0, 1 << 16)) for _ in range(n)]]))
    return names, lengths


@st.composite
def deliver_items(draw: st.DrawFn) -> list[DeliverItem]:
    """Keys sharing one layout, whose regions are uniform, per span or per entry."""
    names, lengths = draw(layouts())
    k = draw(st.integers(1, 4))
    form = draw(st.sampled_from(["uniform", "per-span", "per-entry"]))
    per_span = [draw(st.sampled_from([1, 2, 3, 9])) for _ in names]
    region_of = {
        "uniform": lambda i, j: per_span[0],
        "per-span": lambda i, j: per_span[j],
        "per-entry": lambda i, j: draw(st.sampled_from([1, 2, 3, 9])),
    }[form]
    items = []
    for i in range(k):
        spans = tuple(
            DstSpan(name, region_of(i, j), draw(st.integers(0, (1 << 20) + 8)), lengths[j]) for j, name in enumerate(names)
        )
        items.append(DeliverItem(draw(st.binary(min_size=1, max_size=8)), spans))
    return items


def plan_for(draw: st.DrawFn, n: int) -> list[int]:
    drawn = draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
    dense = {g: i for i, g in enumerate(sorted(set(drawn)))}
    return [dense[g] for g in drawn]


# ------------------------------------------------------------ columns and records


@SETTINGS
@given(deliver_items(), st.data())
def test_deliver_columns_equal_their_records(items: list[DeliverItem], data: st.DataObject) -> None:
    groups = plan_for(data.draw, len(items[0].spans)) if data.draw(st.booleans()) else []
    block = kp.deliver_columns(items, groups)
    assert block.to_items() == tuple(items)
    assert block.key_count == len(items) and block.span_count == len(items[0].spans)
    msg = kp.Deliver(7, (), "r", 100, columns=(block,))
    frame = kp.encode(msg, 3)
    assert kp.decode(frame, 3) == msg
    assert kp.record_items(kp.decode(frame, 3)) == tuple(items)
    assert kp.item_count(msg) == len(items)
    # Without the plan, the same keys travel as records to an older peer.
    assert kp.decode(kp.encode(kp.Deliver(7, tuple(items), "r", 100), 2), 2) == kp.Deliver(7, tuple(items), "r", 100)
    for i, item in enumerate(items):
        for j, span in enumerate(item.spans):
            assert block.entry(i, j) == (span.region, span.offset, span.length)


@SETTINGS
@given(deliver_items(), st.data())
def test_select_cuts_rows_out_as_they_came(items: list[DeliverItem], data: st.DataObject) -> None:
    block = kp.deliver_columns(items)
    chosen = data.draw(st.lists(st.integers(0, len(items) - 1), min_size=1, max_size=len(items)))
    part = block.select(chosen)
    part.check(kp.DEFAULT_LIMITS)
    assert part.to_items() == tuple(items[i] for i in chosen)
    assert part.names is block.names and part.lengths == block.lengths


def test_deposit_columns_equal_their_records() -> None:
    layout = (("L0", "full", 65536), ("L1", "full", 65536), ("L2", "swa", 16384), ("S", "state", 1 << 20))
    items = [
        DepositItem(bytes([i + 1]) * 16, tuple(SrcSpan(n, p, 1, i * (2 << 20) + 65536 * j, size) for j, (n, p, size) in enumerate(layout)))
        for i in range(3)
    ]
    block = kp.deposit_columns(items)
    assert block.pool_names() == ("full", "full", "swa", "state")
    assert isinstance(block.regions, int) and isinstance(block.lengths, bytes)
    msg = kp.Deposit(4, (), no_evict=True, columns=(block,))
    assert kp.decode(kp.encode(msg, 3), 3) == msg
    assert kp.record_items(msg) == tuple(items)


def test_uniform_columns_are_integers_and_others_are_packed() -> None:
    items = [DeliverItem(b"k", (DstSpan("a", 2, 0, 8), DstSpan("b", 2, 8, 8)))]
    block = kp.deliver_columns(items)
    assert (block.regions, block.lengths) == (2, 8)
    mixed = kp.deliver_columns([DeliverItem(b"k", (DstSpan("a", 1, 0, 8), DstSpan("b", 2, 8, 16)))])
    assert unpack(mixed.regions, U32).tolist() == [1, 2]  # type: ignore[arg-type]
    assert unpack(mixed.lengths, U64).tolist() == [8, 16]  # type: ignore[arg-type]
    assert mixed.region_column().tolist() == [1, 2] and mixed.length_column().tolist() == [8, 16]


@pytest.mark.parametrize(
    ("items", "reason"),
    [
        ([], "at least one key"),
        ([DeliverItem(b"a", (DstSpan("x", 1, 0, 8),)), DeliverItem(b"b", (DstSpan("y", 1, 0, 8),))], "names differ"),
        ([DeliverItem(b"a", (DstSpan("x", 1, 0, 8),)), DeliverItem(b"b", (DstSpan("x", 1, 0, 16),))], "lengths differ"),
        ([DeliverItem(b"a", (DstSpan("x\0y", 1, 0, 8),))], "NUL"),
    ],
)
def test_items_that_cannot_share_a_block(items: list[DeliverItem], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        kp.deliver_columns(items)


def test_a_badly_built_block_is_a_local_error() -> None:
    block = kp.DeliverColumns((b"k",), "a\0b", 1, pack([0], U64), 8)
    with pytest.raises(kp.LocalProtocolError) as info:
        kp.encode(kp.Deliver(1, (), columns=(block,)), 3)
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, ".offsets")
    both = kp.Deliver(1, (DeliverItem(b"k", (DstSpan("a", 1, 0, 8),)),), columns=(kp.deliver_columns([DeliverItem(b"j", (DstSpan("a", 1, 0, 8),))]),))
    with pytest.raises(kp.LocalProtocolError) as info:
        kp.encode(both, 3)
    assert (info.value.code, info.value.path) == (ErrorCode.OUT_OF_RANGE, "columns")


# --------------------------------------------------------------------- layer plans


def test_plan_lists_each_groups_spans_in_layout_order() -> None:
    block = kp.DeliverColumns((b"k",), NUL.join("abcdef"), 1, pack(range(6), U64), 1, pack([1, 0, 1, 2, 0, 2], U16))
    block.check(kp.DEFAULT_LIMITS)
    assert block.plan() == ((1, 4), (0, 2), (3, 5))
    assert block.group_count == 3
    assert kp.DeliverColumns((b"k",), "a\0b", 1, pack([0, 1], U64), 1).plan() == ((0, 1),)


@pytest.mark.parametrize(
    ("groups", "reason"),
    [([0, 0, 1], "group numbers for 2 spans"), ([0], "group numbers for 2 spans"), ([0, 2], "group 1 of 3 has no span"), ([1, 1], "group 0 of 2")],
)
def test_plans_that_leave_a_span_out_or_name_a_missing_one(groups: list[int], reason: str) -> None:
    frame = pack_map({"v": 3, "t": "deliver", "id": 1, "items": [], "!columns": [[[b"k"], "a\0b", 1, pack([0, 8], U64), 8, pack(groups, U16)]]})
    error = refused(frame)
    assert (error.code, error.path) == (ErrorCode.OUT_OF_RANGE, "columns[0].groups")
    assert reason in error.reason


def test_a_plan_naming_a_huge_group_is_refused_before_anything_is_built_for_it() -> None:
    """Two spans whose plan names group 65,535: the same refusal as any gap, and the check's
    memory stays that of a plain refusal (tracemalloc peak), not 65,536 lists (spec section 6.8)."""

    def frame(groups: list[int]) -> bytes:
        return pack_map({"v": 3, "t": "deliver", "id": 1, "items": [], "!columns": [[[b"k"], "a\0b", 1, pack([0, 8], U64), 8, pack(groups, U16)]]})

    def peak(data: bytes) -> tuple[int, kp.RemoteProtocolError]:
        refused(data)  # warm: codec memos and imports are not the check's
        tracemalloc.start()
        try:
            error = refused(data)
            return tracemalloc.get_traced_memory()[1], error
        finally:
            tracemalloc.stop()

    hostile, plain = frame([0, 65535]), frame([0, 2])
    assert len(hostile) < 100
    hostile_peak, error = peak(hostile)
    assert (error.code, error.path) == (ErrorCode.OUT_OF_RANGE, "columns[0].groups")
    assert "group 1 of 65536 has no span" in error.reason
    plain_peak, _ = peak(plain)
    # 65,536 empty lists alone would be over 3.5 MiB; a refusal of a 2-span plan is a few kB.
    assert hostile_peak < plain_peak + 4096, (hostile_peak, plain_peak)
    assert hostile_peak < 64 << 10, hostile_peak
    # The first missing group is the one named, whatever the largest.
    assert "group 2 of 65536 has no span" in refused(pack_map({
        "v": 3, "t": "deliver", "id": 1, "items": [],
        "!columns": [[[b"k"], "a\0b\0c", 1, pack([0, 8, 16], U64), 8, pack([1, 0, 65535], U16)]]})).reason


def test_done_and_progress_columns() -> None:
    done = kp.Completion(1, (kp.KeyResult(kp.KeyStatus.OK), kp.KeyResult(kp.KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED)), pack([4, 1], U32))
    assert kp.decode(kp.encode(done, 3), 3).done_counts().tolist() == [4, 1]  # type: ignore[attr-defined]
    progress = kp.Progress(1, pack([0, 3], U32), pack([2, 1], U32))
    assert list(kp.decode(kp.encode(progress, 3), 3).pairs()) == [(0, 2), (3, 1)]  # type: ignore[attr-defined]


# ------------------------------------------------------------------ invalid columns

BASE = [[b"k1", b"k2"], "L0\0L1", 2, pack(range(4), U64), 65536, b""]


@pytest.mark.parametrize(
    ("index", "value", "code", "path"),
    [
        (0, [], ErrorCode.OUT_OF_RANGE, "columns[0].keys"),
        (0, [b"k"] * 4097, ErrorCode.TOO_MANY, "columns[0].keys"),
        (1, "L0\0" + "é" * 65, ErrorCode.TOO_LARGE, "columns[0].names[1]"),
        (1, 7, ErrorCode.WRONG_TYPE, "columns[0].names"),
        (2, pack([1, 2, 3], U32), ErrorCode.OUT_OF_RANGE, "columns[0].regions"),
        (2, b"\x01\x00\x00", ErrorCode.OUT_OF_RANGE, "columns[0].regions"),
        (2, True, ErrorCode.WRONG_TYPE, "columns[0].regions"),
        (3, pack(range(3), U64), ErrorCode.OUT_OF_RANGE, "columns[0].offsets"),
        (3, "", ErrorCode.WRONG_TYPE, "columns[0].offsets"),
        (4, pack([1, 2, 3], U64), ErrorCode.OUT_OF_RANGE, "columns[0].lengths"),
        (4, -1, ErrorCode.OUT_OF_RANGE, "columns[0].lengths"),
        (5, b"\x00", ErrorCode.OUT_OF_RANGE, "columns[0].groups"),
        (5, [0, 1], ErrorCode.WRONG_TYPE, "columns[0].groups"),
    ],
)
def test_invalid_columns_name_the_column(index: int, value: Any, code: ErrorCode, path: str) -> None:
    block = list(BASE)
    block[index] = value
    error = refused(pack_map({"v": 3, "t": "deliver", "id": 1, "items": [], "!columns": [block]}))
    assert (error.code, error.path) == (code, path)


def test_spans_summed_over_blocks_are_limited() -> None:
    limits = dataclasses.replace(kp.DEFAULT_LIMITS, max_spans=6)
    frame = kp.encode(kp.Deliver(1, (), columns=(kp.DeliverColumns((b"a", b"b"), "x\0y", 1, pack(range(4), U64), 1),) * 2), 3)
    with pytest.raises(kp.RemoteProtocolError) as info:
        kp.decode(frame, 3, limits)
    assert (info.value.code, info.value.path) == (ErrorCode.TOO_MANY, "columns")


def test_a_repeated_layout_is_split_once() -> None:
    names = NUL.join(f"layer.{i}" for i in range(1024))
    block = kp.DeliverColumns((b"k",), names, 2, pack(range(1024), U64), 1)
    first = block.span_names()
    assert block.span_names() is first and len(first) == 1024


# ----------------------------------------------------------------- descriptor checks


@SETTINGS
@given(deliver_items())
def test_resolve_columns_agrees_with_resolve_span(items: list[DeliverItem]) -> None:
    block = kp.deliver_columns(items)
    extents = resolve_columns(REGIONS, block, "columns[0]")
    n = block.span_count
    suffix = {".region": "regions", ".length": "lengths", ".offset": "offsets"}
    for i, item in enumerate(items):
        resolved = []
        try:
            for span in item.spans:
                resolved.append(kp.resolve_span(REGIONS, span.region, span.offset, span.length, ""))
        except kp.ProtocolError as exc:
            got = extents.failures[i]
            assert got.code is ErrorCode.BAD_DESCRIPTOR
            assert got.path.startswith(f"columns[0].{suffix[exc.path]}")
            assert extents.addresses[i * n : (i + 1) * n] == [0] * n
            continue
        assert i not in extents.failures
        for j, (reg, extent) in enumerate(resolved):
            assert extents.addresses[i * n + j] == extent.address and extents.regions[i * n + j] is reg


def test_resolve_columns_fast_path_names_the_bad_entry() -> None:
    block = kp.DeliverColumns((b"a", b"b"), "x\0y", 3, pack([0, 1024, 2048, 4000], U64), 1024)
    extents = resolve_columns(REGIONS, block, "columns[0]")
    assert list(extents.failures) == [1]
    assert extents.failures[1].path == "columns[0].offsets[3]"
    assert extents.addresses[:2] == [REGIONS[3].address, REGIONS[3].address + 1024]
    unknown = resolve_columns(REGIONS, dataclasses.replace(block, regions=9), "c")
    assert set(unknown.failures) == {0, 1} and unknown.failures[0].path == "c.regions"
