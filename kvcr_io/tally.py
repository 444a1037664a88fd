"""Counts keyed by the members of one enum: the node's and the client's counters alike.

Parts count members of an enum, never strings, so a misspelt counter is a type error;
names are written out only at the edge (``snapshot``: a ``stats`` reply, the client's
``counters()``). A tally lists only what was counted.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K", bound=enum.Enum)


class Tally(Generic[K]):
    """Counts keyed by the members of one enum; ``snapshot`` writes them out by name."""

    __slots__ = ("_counts", "_name")

    def __init__(self, name: Callable[[K], str]) -> None:
        self._counts: collections.Counter[K] = collections.Counter()
        self._name = name

    def inc(self, key: K, n: int = 1) -> None:
        self._counts[key] += n

    def __getitem__(self, key: K) -> int:
        return self._counts[key]

    def snapshot(self) -> dict[str, int]:
        """Name -> count, for what was counted (in the order first counted)."""
        name = self._name
        return {name(key): n for key, n in self._counts.items()}
