"""Descriptor checks: spans must lie inside announced regions and match slot sizes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kvcr_protocol.errors import ErrorCode, ProtocolError
from kvcr_protocol.messages import Region


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
