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
from kvcr_protocol.holds import Extent, SpanHolds


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
    """Reserved spans by client agent, each write's under its id (``SpanHolds``)."""

    def __init__(self) -> None:
        self._by_agent: dict[str, SpanHolds] = {}

    def __len__(self) -> int:
        """Writes whose destination is reserved."""
        return sum(len(holds) for holds in self._by_agent.values())

    def holds(self, agent: str) -> bool:
        """Whether anything of ``agent``'s memory is reserved."""
        return agent in self._by_agent

    def reserve(self, agent: str, write: int, extents: Iterable[Extent]) -> None:
        """Reserve ``extents`` of ``agent``'s memory until ``end(agent, write)``."""
        holds = self._by_agent.get(agent) or SpanHolds()
        holds.add(write, extents)
        if holds:
            self._by_agent[agent] = holds

    def end(self, agent: str, write: int) -> None:
        """No transfer of ``write`` can reach ``agent``'s memory any more."""
        holds = self._by_agent.get(agent)
        if holds is not None:
            holds.drop(write)
            if not holds:
                del self._by_agent[agent]

    def overlap(self, agent: str, extents: Iterable[Extent]) -> int | None:
        """The index of the first of ``extents`` that overlaps a reserved span, or None."""
        holds = self._by_agent.get(agent)
        return None if holds is None else holds.overlap(extents)

    def reason(self, agent: str, extents: Sequence[Extent], path: str) -> str | None:
        """Why a key whose spans are ``extents`` (at field ``path``) cannot be served now, or None."""
        j = self.overlap(agent, extents)
        if j is None:
            return None
        region, offset, length = extents[j]
        return (f"{path}[{j}]: region {region} bytes {offset}..{offset + length} may still be written by an earlier "
                "transfer that failed DESTINATION_UNCERTAIN; reserved until that write is over (section 12)")
