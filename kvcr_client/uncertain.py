"""Destination spans a transfer that missed its deadline may still write (spec sections 5.1, 6.12, 12).

A deliver under grants whose deadline passes while one of its READs still runs fails those
keys ``DESTINATION_UNCERTAIN``: the READ may land later, over whatever is in the
destination by then. Until it is terminal, its spans are held here, and a deliver into
memory that overlaps them is refused at once (``ArgumentError`` naming the span), and so is
a deposit or put from it (the node or this client would read bytes that may still change):
otherwise a deliver that ended first would be reported ``OK`` and then overwritten. The
check costs nothing while nothing is held, the usual case. Holds are made and let go of in
the core's turns (lock held); the check runs in the caller's thread on a snapshot.

A deliver the node wrote (or had a source write) fails ``DESTINATION_UNCERTAIN`` the same
way; there the node keeps the spans reserved and refuses a deliver into them, or a deposit
or put from them, itself (spec section 12), but a READ of our own under a grant would not
ask it. Those spans are held here too, as the node's: a deliver that overlaps them goes
by the node, never by grants, and once the node served one into them (``OK``) they are free.

A deliver the caller stopped waiting for (``OperationTimeout``: no answer by its deadline
and a grace) may still be written by the node until it answers (spec section 5.1): its
destination is held here from the timeout to that answer, or to the end of the session.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcr_client.errors import ArgumentError
from kvcr_protocol import ErrorCode, KeyResult, KeyStatus

Hold = Callable[[Iterable[tuple[int, int, int]]], Callable[[], None]]
"""Holds (region id, offset, length) spans; returns what lets go of them."""


class UncertainDestinations:
    """Held spans by region id, each hold under a token until the transfer that may still
    write them is terminal; and, apart, the spans the node reported uncertain."""

    def __init__(self) -> None:
        self._held: dict[int, dict[int, list[tuple[int, int]]]] = {}
        """Token -> region id -> (start, end) ranges."""
        self._tokens = itertools.count(1)
        self._node: dict[int, dict[int, list[tuple[int, int]]]] = {}
        """Spans the node reported ``DESTINATION_UNCERTAIN``: token -> region id -> ranges."""

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, spans: Iterable[tuple[int, int, int]]) -> Callable[[], None]:
        """Hold ``spans`` until the returned function is called (once or more)."""
        token = next(self._tokens)
        self._held[token] = _by_region(spans)

        def let_go() -> None:
            self._held.pop(token, None)

        return let_go

    @property
    def node_held(self) -> int:
        """Keys whose destination the node reported uncertain, not yet served again."""
        return len(self._node)

    def node_reserved(self, items: Sequence[Any]) -> bool:
        """Whether a span of ``items`` overlaps one the node reported uncertain: such a
        deliver goes by the node, which knows when its reservation ends."""
        if not self._node:
            return False
        held = list(self._node.values())  # one step: a turn may change it meanwhile
        return any(_overlaps(by_region, span) for item in items for span in item.spans for by_region in held)

    def node_answered(self, items: Sequence[Any], results: Sequence[KeyResult]) -> None:
        """The node answered a deliver of ``items`` (lock held): hold the spans of keys failed
        ``DESTINATION_UNCERTAIN``, and let go of whatever overlaps a key served ``OK`` (the
        node refuses memory it still reserves, so it reserves none there)."""
        if not self._node and all(r.code != ErrorCode.DESTINATION_UNCERTAIN for r in results):
            return  # the usual case
        for item, result in zip(items, results, strict=True):
            if result.status is KeyStatus.OK and self._node:
                for token, by_region in list(self._node.items()):
                    if any(_overlaps(by_region, span) for span in item.spans):
                        del self._node[token]
            elif result.code == ErrorCode.DESTINATION_UNCERTAIN:
                self._node[next(self._tokens)] = _by_region((s[-3], s[-2], s[-1]) for s in item.spans)

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
                if _overlaps(held, span):
                    raise ArgumentError(
                        f"{path}[{item.key!r}].spans[{j}]",
                        "overlaps a destination that a transfer past its deadline may still write "
                        "(DESTINATION_UNCERTAIN, or a deliver that timed out); use it again once that transfer ended",
                    )


def _by_region(spans: Iterable[tuple[int, int, int]]) -> dict[int, list[tuple[int, int]]]:
    by_region: dict[int, list[tuple[int, int]]] = {}
    for region, offset, length in spans:
        by_region.setdefault(region, []).append((offset, offset + length))
    return by_region


def _overlaps(by_region: dict[int, list[tuple[int, int]]], span: Any) -> bool:
    """Whether a wire span (region id, offset, length last) overlaps a range in ``by_region``."""
    ranges = by_region.get(span[-3])
    if not ranges:
        return False
    offset, end = span[-2], span[-2] + span[-1]
    return any(start < end and offset < stop for start, stop in ranges)
