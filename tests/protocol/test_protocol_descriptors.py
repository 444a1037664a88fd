"""Descriptor checks: spans against announced regions, lengths against slot sizes."""

from __future__ import annotations

import pytest

from kvcr_protocol import ErrorCode, Extent, ProtocolError, check_span_sizes, resolve_span
from kvcr_protocol.descriptors import regions_overlap
from kvcr_protocol.messages import MemoryKind, Region

U64 = (1 << 64) - 1
BASE = 0x7F00_0000_0000
DRAM = Region(1, MemoryKind.DRAM, 0, BASE, 4096)
VRAM = Region(2, MemoryKind.VRAM, 3, 0x1000, 1 << 20)
REGIONS = {1: DRAM, 2: VRAM}


def test_span_inside_a_region() -> None:
    reg, extent = resolve_span(REGIONS, 1, 100, 200, "items[0].spans[0]")
    assert reg is DRAM
    assert extent == Extent(BASE + 100, 200, 0)


def test_device_comes_from_the_region() -> None:
    _, extent = resolve_span(REGIONS, 2, 0, 4096, "x")
    assert extent == Extent(0x1000, 4096, 3)


@pytest.mark.parametrize(("offset", "length"), [(0, 4096), (4095, 1), (0, 1), (2048, 2048)])
def test_span_at_the_edges(offset: int, length: int) -> None:
    _, extent = resolve_span(REGIONS, 1, offset, length, "s")
    assert extent.address == BASE + offset and extent.length == length


@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (0, 4097),  # one byte past the end
        (4096, 1),  # starts at the end
        (4095, 2),
        (4097, 1),  # starts past the end
        (U64, 1),  # offset + length overflows 64 bits
        (1, U64),
        (U64, U64),
        (0, U64),
    ],
)
def test_span_outside_a_region(offset: int, length: int) -> None:
    with pytest.raises(ProtocolError) as info:
        resolve_span(REGIONS, 1, offset, length, "items[3].spans[1]")
    assert info.value.code is ErrorCode.BAD_DESCRIPTOR
    assert info.value.path == "items[3].spans[1].offset"


def test_unknown_region() -> None:
    with pytest.raises(ProtocolError) as info:
        resolve_span(REGIONS, 9, 0, 1, "items[0].spans[0]")
    assert info.value.code is ErrorCode.BAD_DESCRIPTOR
    assert info.value.path == "items[0].spans[0].region"


def test_no_regions_at_all() -> None:
    with pytest.raises(ProtocolError):
        resolve_span({}, 1, 0, 1, "s")


@pytest.mark.parametrize("offset", [0, 4096, U64])
def test_zero_length(offset: int) -> None:
    with pytest.raises(ProtocolError) as info:
        resolve_span(REGIONS, 1, offset, 0, "s")
    assert info.value.code is ErrorCode.BAD_DESCRIPTOR
    assert info.value.path == "s.length"


def test_empty_region_holds_nothing() -> None:
    empty = {5: Region(5, MemoryKind.DRAM, 0, BASE, 0)}
    with pytest.raises(ProtocolError):
        resolve_span(empty, 5, 0, 1, "s")


def test_region_at_the_top_of_the_address_space() -> None:
    top = {6: Region(6, MemoryKind.DRAM, 0, U64 - 4095, 4096)}
    _, extent = resolve_span(top, 6, 4095, 1, "s")
    assert extent.address == U64


def test_span_sizes_match() -> None:
    check_span_sizes([65536, 16384], [65536, 16384], "items[0].spans")
    check_span_sizes([], [], "items[0].spans")


def test_span_size_mismatch_names_the_span() -> None:
    with pytest.raises(ProtocolError) as info:
        check_span_sizes([65536, 16000, 1], [65536, 16384, 2], "items[2].spans")
    assert info.value.code is ErrorCode.SIZE_MISMATCH
    assert info.value.path == "items[2].spans[1].length"


def test_span_sizes_need_one_size_per_span() -> None:
    with pytest.raises(ValueError):
        check_span_sizes([1, 2], [1], "s")


def test_regions_overlap() -> None:
    a = Region(1, MemoryKind.DRAM, 0, 1000, 100)
    assert regions_overlap(a, Region(2, MemoryKind.DRAM, 0, 1099, 10))
    assert not regions_overlap(a, Region(2, MemoryKind.DRAM, 0, 1100, 10))
    assert not regions_overlap(a, Region(2, MemoryKind.DRAM, 0, 990, 10))
    assert not regions_overlap(a, Region(2, MemoryKind.VRAM, 0, 1000, 100))
    assert not regions_overlap(a, Region(2, MemoryKind.DRAM, 1, 1000, 100))
