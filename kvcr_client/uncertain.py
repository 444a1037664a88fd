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
from kvcr_protocol.holds import Extent, SpanHolds

Hold = Callable[[Iterable[Extent]], Callable[[], None]]
"""Holds (region id, offset, length) spans; returns what lets go of them."""


class UncertainDestinations:
    """Spans held (``SpanHolds``) under a token until the transfer that may still write them
    is terminal; and, apart, the spans the node reported uncertain."""

    def __init__(self) -> None:
        self._held = SpanHolds()
        self._node = SpanHolds()
        """Spans the node reported ``DESTINATION_UNCERTAIN``, a token per key."""
        self._tokens = itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, spans: Iterable[Extent]) -> Callable[[], None]:
        """Hold ``spans`` until the returned function is called (once or more)."""
        token = next(self._tokens)
        self._held.add(token, spans)
        return lambda: self._held.drop(token)

    @property
    def node_held(self) -> int:
        """Keys whose destination the node reported uncertain, not yet served again."""
        return len(self._node)

    def node_reserved(self, items: Sequence[Any]) -> bool:
        """Whether a span of ``items`` overlaps one the node reported uncertain: such a
        deliver goes by the node, which knows when its reservation ends."""
        return bool(self._node) and any(self._node.overlap(extents((item,))) is not None for item in items)

    def node_answered(self, items: Sequence[Any], results: Sequence[KeyResult]) -> None:
        """The node answered a deliver of ``items`` (lock held): hold the spans of keys failed
        ``DESTINATION_UNCERTAIN``, and let go of whatever overlaps a key served ``OK`` (the
        node refuses memory it still reserves, so it reserves none there)."""
        if not self._node and all(r.code != ErrorCode.DESTINATION_UNCERTAIN for r in results):
            return  # the usual case
        for item, result in zip(items, results, strict=True):
            if result.status is KeyStatus.OK and self._node:
                for token in list(self._node.overlapping(extents((item,)))):
                    self._node.drop(token)
            elif result.code == ErrorCode.DESTINATION_UNCERTAIN:
                self._node.add(next(self._tokens), extents((item,)))

    def check(self, items: Sequence[Any], path: str = "objects") -> None:
        """Refuse ``items`` (wire items: a key and spans naming region id, offset and length
        as the last three fields) when a span overlaps a held one."""
        if not self._held:
            return
        for item in items:
            j = self._held.overlap(extents((item,)))
            if j is not None:
                raise ArgumentError(
                    f"{path}[{item.key!r}].spans[{j}]",
                    "overlaps a destination that a transfer past its deadline may still write "
                    "(DESTINATION_UNCERTAIN, or a deliver that timed out); use it again once that transfer ended",
                )


def extents(items: Iterable[Any]) -> list[Extent]:
    """Wire items' spans as (region id, offset, length): their last three fields."""
    return [(span[-3], span[-2], span[-1]) for item in items for span in item.spans]
