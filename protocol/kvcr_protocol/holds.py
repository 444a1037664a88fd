"""Spans of memory held under tokens, and which of some spans overlaps one held.

A destination that a transfer past its deadline may still write takes no new work until
that transfer is over (spec sections 5.1, 6.12 and 12): the node keeps the spans of each
such write of a client (``kvcr_node.reservations``), the client those of its own READs and
of delivers it stopped waiting for (``kvcr_client.uncertain``). Both keep them here: spans
as (region id, offset, length), grouped by region, each group of spans under the token of
what may still write it. Two spans overlap when they share a byte of one region; touching
ends do not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

Extent = tuple[int, int, int]
"""(region id, offset, length)."""


class SpanHolds:
    """Held spans by token, each token's by region id as (start, end) ranges."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, dict[int, list[tuple[int, int]]]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        """Tokens holding spans."""
        return len(self._held)

    def add(self, token: int, extents: Iterable[Extent]) -> None:
        """Hold ``extents`` under ``token`` (nothing is kept for none)."""
        by_region: dict[int, list[tuple[int, int]]] = {}
        for region, offset, length in extents:
            by_region.setdefault(region, []).append((offset, offset + length))
        if by_region:
            self._held[token] = by_region

    def drop(self, token: int) -> None:
        """Let go of ``token``'s spans (once or more)."""
        self._held.pop(token, None)

    def overlap(self, extents: Iterable[Extent]) -> int | None:
        """The index of the first of ``extents`` that overlaps a held span, or None."""
        held = list(self._held.values())  # one step: another thread may let go meanwhile
        for j, extent in enumerate(extents):
            if any(_overlaps(by_region, extent) for by_region in held):
                return j
        return None

    def overlapping(self, extents: Sequence[Extent]) -> Iterator[int]:
        """The tokens any of whose spans overlaps one of ``extents``."""
        for token, by_region in list(self._held.items()):
            if any(_overlaps(by_region, extent) for extent in extents):
                yield token


def _overlaps(by_region: dict[int, list[tuple[int, int]]], extent: Extent) -> bool:
    region, offset, length = extent
    ranges = by_region.get(region)
    if not ranges:
        return False
    end = offset + length
    return any(start < end and offset < stop for start, stop in ranges)
