"""Destination spans a READ that missed its deadline may still write (spec section 6.12).

A deliver under grants whose deadline passes while one of its READs still runs fails those
keys ``DESTINATION_UNCERTAIN``: the READ may land later, over whatever is in the
destination by then. Until it is terminal, its spans are held here, and a deliver into
memory that overlaps them is refused at once (``ArgumentError`` naming the span), and so is
a deposit or put from it (the node or this client would read bytes that may still change):
otherwise a deliver that ended first would be reported ``OK`` and then overwritten. The
check costs nothing while nothing is held, the usual case. Holds are made and let go of in
the core's turns (lock held); the check runs in the caller's thread on a snapshot.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcr_client.errors import ArgumentError

Hold = Callable[[Iterable[tuple[int, int, int]]], Callable[[], None]]
"""Holds (region id, offset, length) spans; returns what lets go of them."""


class UncertainDestinations:
    """Held spans by region id, each hold under a token until its READ is terminal."""

    def __init__(self) -> None:
        self._held: dict[int, dict[int, list[tuple[int, int]]]] = {}
        """Token -> region id -> (start, end) ranges."""
        self._tokens = itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, spans: Iterable[tuple[int, int, int]]) -> Callable[[], None]:
        """Hold ``spans`` until the returned function is called (once or more)."""
        by_region: dict[int, list[tuple[int, int]]] = {}
        for region, offset, length in spans:
            by_region.setdefault(region, []).append((offset, offset + length))
        token = next(self._tokens)
        self._held[token] = by_region

        def let_go() -> None:
            self._held.pop(token, None)

        return let_go

    def check(self, items: Sequence[Any], path: str = "objects") -> None:
        """Refuse ``items`` (wire items: a key and spans naming region id, offset and length
        as the last three fields) when a span overlaps a held one."""
        if not self._held:
            return
        held: dict[int, list[tuple[int, int]]] = {}
        for by_region in list(self._held.values()):  # one step: a turn may let go meanwhile
            for region, spans in by_region.items():
                held.setdefault(region, []).extend(spans)
        for item in items:
            for j, span in enumerate(item.spans):
                region, offset, length = span[-3], span[-2], span[-1]
                ranges = held.get(region)
                if ranges and any(start < offset + length and offset < end for start, end in ranges):
                    raise ArgumentError(
                        f"{path}[{item.key!r}].spans[{j}]",
                        "overlaps a destination that a READ past its deadline may still write "
                        "(DESTINATION_UNCERTAIN); use it again once that READ ended",
                    )
