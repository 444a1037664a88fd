"""Descriptor checks: spans (records or columns) must lie inside announced regions and match slot sizes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kvcr_protocol.columns import SpanColumns
from kvcr_protocol.errors import ErrorCode, ProtocolError
from kvcr_protocol.records import MemoryKind, Region


@dataclass(frozen=True, slots=True)
class Extent:
    """An absolute address range resolved from (region, offset, length)."""

    address: int
    length: int
    device: int


def _refuse(reg: Region | None, region: int, offset: int, length: int, path: str) -> NoReturn:
    """Raise the ``BAD_DESCRIPTOR`` of a span that fails ``resolve_span``'s rules, naming the field."""
    if reg is None:
        raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"region {region} was not announced", f"{path}.region")
    if length == 0:
        raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, "a span has length 0", f"{path}.length")
    raise ProtocolError(
        ErrorCode.BAD_DESCRIPTOR,
        f"[{offset}, {offset + length}) lies outside region {region} of {reg.length} bytes",
        f"{path}.offset",
    )


def resolve_span(
    regions: Mapping[int, Region], region: int, offset: int, length: int, path: str
) -> tuple[Region, Extent]:
    """Resolve a span against announced regions; it must lie wholly inside its region."""
    reg = regions.get(region)
    # offset + length <= region length, written so that no sum can overflow the check.
    if reg is None or length == 0 or offset > reg.length or length > reg.length - offset:
        _refuse(reg, region, offset, length, path)
    return reg, Extent(reg.address + offset, length, reg.device)


def check_span_sizes(lengths: Sequence[int], slot_sizes: Sequence[int], path: str) -> None:
    """Each span length must equal the slot size of the stored span it maps to."""
    for i, (length, size) in enumerate(zip(lengths, slot_sizes, strict=True)):
        if length != size:
            raise ProtocolError(
                ErrorCode.SIZE_MISMATCH, f"span of {length} bytes, the slot holds {size}", f"{path}[{i}].length"
            )


def regions_overlap(a: Region, b: Region) -> bool:
    """Two regions of the same kind and device share at least one byte."""
    if a.kind != b.kind or a.device != b.device:
        return False
    return a.address < b.address + b.length and b.address < a.address + a.length


def resolve_spans(
    regions: Mapping[int, Region], spans: Sequence[tuple[int, int, int]], path: str
) -> list[tuple[int, int, Region]]:
    """Resolve many ``(region, offset, length)`` spans at once: ``(address, length, region)`` each.

    Same rules as ``resolve_span``, one loop, no per-span objects (hot path of large
    layouts); errors name ``{path}[j]``.
    """
    out: list[tuple[int, int, Region]] = []
    last_id = -1
    reg: Region | None = None
    for j, (region, offset, length) in enumerate(spans):
        if region != last_id:
            reg = regions.get(region)
            last_id = region
        if reg is None or length == 0 or offset > reg.length or length > reg.length - offset:
            _refuse(reg, region, offset, length, f"{path}[{j}]")
        out.append((reg.address + offset, length, reg))
    return out


@dataclass(frozen=True, slots=True)
class ColumnExtents:
    """A block of span columns resolved against announced regions (``resolve_columns``)."""

    addresses: list[int]
    """The absolute address of every entry, key-major (0 for the entries of a failed key)."""
    regions: list[Region]
    """The region of every entry, key-major."""
    failures: dict[int, ProtocolError]
    """Block-relative key index -> the error of its first bad span; the other keys go on."""


def resolve_columns(regions: Mapping[int, Region], block: SpanColumns, path: str) -> ColumnExtents:
    """Resolve every entry of a block by ``resolve_span``'s rules, keys failing alone.

    With one region for the block (the common case) the bounds are checked with one
    ``max`` over the offset column; other forms check entry by entry. Errors name the
    column: ``{path}.regions[i]``, ``{path}.lengths[j]`` or ``{path}.offsets[e]``.
    """
    n, k = block.span_count, block.key_count
    offsets = block.offset_column()
    lengths = block.length_column()
    failures: dict[int, ProtocolError] = {}
    if isinstance(block.regions, int) and isinstance(block.lengths, int):
        reg = regions.get(block.regions)
        length = block.lengths
        if reg is not None and 0 < length <= reg.length and max(offsets) <= reg.length - length:
            base = reg.address
            return ColumnExtents([base + o for o in offsets], [reg] * (n * k), failures)
    region_ids = block.region_column()
    per_span = isinstance(block.regions, bytes) and len(block.regions) == 4 * n
    addresses: list[int] = []
    entry_regions: list[Region] = []
    for e, (rid, offset) in enumerate(zip(region_ids, offsets, strict=True)):
        j = e % n
        length = lengths[j]
        reg = regions.get(rid)
        problem = None
        if reg is None:
            where = "" if isinstance(block.regions, int) else f"[{j if per_span else e}]"
            problem = ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"region {rid} was not announced", f"{path}.regions{where}")
        elif length == 0:
            where = "" if isinstance(block.lengths, int) else f"[{j}]"
            problem = ProtocolError(ErrorCode.BAD_DESCRIPTOR, "a span has length 0", f"{path}.lengths{where}")
        elif offset > reg.length or length > reg.length - offset:
            problem = ProtocolError(
                ErrorCode.BAD_DESCRIPTOR,
                f"[{offset}, {offset + length}) lies outside region {rid} of {reg.length} bytes",
                f"{path}.offsets[{e}]",
            )
        if problem is not None:
            failures.setdefault(e // n, problem)
        addresses.append(0 if reg is None else reg.address + offset)
        entry_regions.append(reg if reg is not None else _NO_REGION)
    for i in failures:
        addresses[i * n : (i + 1) * n] = [0] * n
    return ColumnExtents(addresses, entry_regions, failures)


_NO_REGION = Region(0, MemoryKind.DRAM, 0, 0, 0)
"""Stands for an unannounced region in ``ColumnExtents.regions`` (its key has failed)."""
