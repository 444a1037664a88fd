"""Client memory a source may still write after ``DESTINATION_UNCERTAIN`` (spec section 12).

A remote write whose deadline passed unanswered fails its keys ``DESTINATION_UNCERTAIN``
and may still land, until the source confirms it over or is known gone. Its destination
spans are reserved here, by the client agent whose memory they are, from that moment to
that end. While they are, this node refuses to write into them (a ``deliver`` key whose
destination overlaps one) or to read from them (a ``deposit`` or ``put`` key whose
source does), each key failing ``DESTINATION_UNCERTAIN`` with nothing moved: otherwise a
later deliver into the same memory could end first, be reported ``OK``, and then be
overwritten, or a deposit could store bytes the late write changed. The check costs one
dictionary lookup while nothing of the agent is reserved, the usual case.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcr_protocol import DeliverItem, DstSpan, SpanColumns, SrcSpan

Extent = tuple[int, int, int]
"""(region id, offset, length) of a span of client memory."""


def record_extents(spans: Sequence[DstSpan] | Sequence[SrcSpan]) -> list[Extent]:
    """The extents of a record item's spans."""
    return [(s.region, s.offset, s.length) for s in spans]


def row_extents(block: SpanColumns, row: int) -> list[Extent]:
    """The extents of key ``row`` of a column block."""
    return [block.entry(row, j) for j in range(block.span_count)]


def write_extents(items: Sequence[DeliverItem], columns: Sequence[SpanColumns]) -> list[Extent]:
    """Every destination extent of a write's items (records, or column blocks)."""
    extents = [extent for item in items for extent in record_extents(item.spans)]
    for block in columns:
        for row in range(len(block.keys)):
            extents.extend(row_extents(block, row))
    return extents


class Reservations:
    """Reserved spans by client agent and region, each under the id of the write that may land."""

    def __init__(self) -> None:
        self._by_agent: dict[str, dict[int, dict[int, list[tuple[int, int]]]]] = {}
        """Agent -> write id -> region id -> (start, end) ranges."""

    def __len__(self) -> int:
        """Writes whose destination is reserved."""
        return sum(len(writes) for writes in self._by_agent.values())

    def holds(self, agent: str) -> bool:
        """Whether anything of ``agent``'s memory is reserved."""
        return agent in self._by_agent

    def reserve(self, agent: str, write: int, extents: Iterable[Extent]) -> None:
        """Reserve ``extents`` of ``agent``'s memory until ``end(agent, write)``."""
        by_region: dict[int, list[tuple[int, int]]] = {}
        for region, offset, length in extents:
            by_region.setdefault(region, []).append((offset, offset + length))
        if by_region:
            self._by_agent.setdefault(agent, {})[write] = by_region

    def end(self, agent: str, write: int) -> None:
        """No transfer of ``write`` can reach ``agent``'s memory any more."""
        writes = self._by_agent.get(agent)
        if writes is not None:
            writes.pop(write, None)
            if not writes:
                del self._by_agent[agent]

    def overlap(self, agent: str, extents: Iterable[Extent]) -> int | None:
        """The index of the first of ``extents`` that overlaps a reserved span, or None."""
        writes = self._by_agent.get(agent)
        if not writes:
            return None
        for j, (region, offset, length) in enumerate(extents):
            end = offset + length
            for by_region in writes.values():
                ranges = by_region.get(region)
                if ranges and any(start < end and offset < stop for start, stop in ranges):
                    return j
        return None

    def reason(self, agent: str, extents: Sequence[Extent], path: str) -> str | None:
        """Why a key whose spans are ``extents`` (at field ``path``) cannot be served now, or None."""
        j = self.overlap(agent, extents)
        if j is None:
            return None
        region, offset, length = extents[j]
        return (f"{path}[{j}]: region {region} bytes {offset}..{offset + length} may still be written by an earlier "
                "transfer that failed DESTINATION_UNCERTAIN; reserved until that write is over (section 12)")
