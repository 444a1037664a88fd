"""Named-span projection (progressive layer delivery).

One function, used by local and remote delivery alike, maps a destination's span names
onto the stored layout's indices. A bounded cache keyed by the two name tuples holds the
indices only: never addresses, slots, claims or descriptors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvcr_protocol.errors import ErrorCode, ProtocolError

Names = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Projection:
    """Stored indices selected by a destination, and whether that is the whole layout."""

    indices: tuple[int, ...]
    full: bool


def compute_projection(stored: Names, requested: Names) -> Projection:
    """Apply the projection rules; raise ``ProtocolError(LAYOUT_SUBSET_INVALID)`` when they fail.

    Sizes are not checked here (they need the pools); see ``descriptors.check_span_sizes``.
    """
    # "Same names, same order: a full delivery (this also covers layouts whose names
    # repeat or are empty)."
    if requested == stored:
        return Projection(tuple(range(len(stored))), True)
    invalid = ErrorCode.LAYOUT_SUBSET_INVALID
    # "at least one name"
    if not requested:
        raise ProtocolError(invalid, "a subset names at least one span")
    # "fewer spans than stored"
    if len(requested) >= len(stored):
        raise ProtocolError(invalid, f"{len(requested)} names is not a subset of {len(stored)} stored spans")
    # "the stored layout's names are themselves unique and non-empty"
    if "" in stored or len(set(stored)) != len(stored):
        raise ProtocolError(invalid, "the stored layout's names are not unique and non-empty")
    position = {name: i for i, name in enumerate(stored)}
    indices: list[int] = []
    seen: set[str] = set()
    for name in requested:
        # "every name non-empty and unique in the request"
        if not name:
            raise ProtocolError(invalid, "a span name is empty")
        if name in seen:
            raise ProtocolError(invalid, f"span {name!r} is named twice")
        seen.add(name)
        # "every name present in the stored layout"
        index = position.get(name)
        if index is None:
            raise ProtocolError(invalid, f"span {name!r} is not in the stored layout")
        # "the names keep the stored order (strictly increasing stored indices)"
        if indices and index <= indices[-1]:
            raise ProtocolError(invalid, f"span {name!r} breaks the stored order")
        indices.append(index)
    return Projection(tuple(indices), False)


class ProjectionCache:
    """A bounded LRU cache of projections keyed by (stored names, requested names).

    Failures are cached too, as their error, so hostile repeats cost a dict lookup.
    """

    def __init__(self, size: int = 512) -> None:
        if size < 1:
            raise ValueError(f"size: must be at least 1, got {size}")
        self.size = size
        self._entries: OrderedDict[tuple[Names, Names], Projection | ProtocolError] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def project(self, stored: Names, requested: Names) -> Projection:
        """The projection of ``requested`` onto ``stored``; raises ``ProtocolError``."""
        key = (stored, requested)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            try:
                entry = compute_projection(stored, requested)
            except ProtocolError as exc:
                entry = exc
            self._entries[key] = entry
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        if isinstance(entry, ProtocolError):
            raise ProtocolError(entry.code, entry.reason)
        return entry
