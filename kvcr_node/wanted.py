"""What a deliver or a peer write asks for: its items as records or column blocks (spec section 6.7).

``Wanted`` gives the keys, each item's layer plan (spec section 6.8), the field path that
names an item, and what a target forwards to a source: the rows of a block cut out as
they came (``DeliverColumns.select``), never encoded again per span.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np

from kvcr_node.reservations import record_extents, row_extents
from kvcr_node.transfers import Move
from kvcr_protocol import DeliverColumns, DeliverItem, ProtocolError, Region, resolve_columns
from kvcr_protocol.descriptors import ColumnExtents, resolve_spans
from kvcr_protocol.holds import Extent

GroupMoves = list[list[Move]]
"""An item's moves, one list per group of its plan, in group order."""


class Block:
    """One column block of a request, with what is worked out once for all its keys."""

    __slots__ = ("_checked", "_extents", "_uniform", "block", "first", "lengths", "names", "path", "plan")

    def __init__(self, block: DeliverColumns, path: str, first: int) -> None:
        self.block = block
        self.path = path
        self.names = block.span_names()
        self.lengths = block.length_column()
        self.plan = block.plan()
        self.first = first
        """The request's item index of the block's first key."""
        self._extents: ColumnExtents | None = None
        self._uniform: tuple[Region, np.ndarray] | None = None
        self._checked = False

    def uniform(self, regions: Mapping[int, Region]) -> tuple[Region, np.ndarray] | None:
        """(region, uint64 offsets of every entry) when every entry lies in one region with
        one length (checked with one ``max``); None when the entries need ``extents``."""
        if not self._checked:
            self._checked = True
            block = self.block
            if isinstance(block.regions, int) and isinstance(block.lengths, int):
                reg = regions.get(block.regions)
                offsets = np.frombuffer(block.offsets, dtype="<u8").astype(np.uint64, copy=False)
                length = block.lengths
                if reg is not None and 0 < length <= reg.length and int(offsets.max()) <= reg.length - length:
                    self._uniform = (reg, offsets)
        return self._uniform

    def extents(self, regions: Mapping[int, Region]) -> ColumnExtents:
        """Every entry resolved against ``regions`` (once per block), keys failing alone."""
        if self._extents is None:
            self._extents = resolve_columns(regions, self.block, self.path)
        return self._extents


class Wanted:
    """The items of a deliver or a write as records or column blocks: keys, layer plans,
    and each READY key's moves. Column blocks are read a column at a time; no record is
    made per span."""

    def __init__(self, items: Sequence[DeliverItem], columns: Sequence[DeliverColumns] = ()) -> None:
        self.items = items
        self.blocks: list[Block] = []
        self.where: list[tuple[int, int]] = []
        """Per item of a column request: (block, row)."""
        if columns:
            first = 0
            for b, block in enumerate(columns):
                self.blocks.append(Block(block, f"columns[{b}]", first))
                self.where.extend((b, r) for r in range(len(block.keys)))
                first += len(block.keys)
            self.keys = [key for block in columns for key in block.keys]
        else:
            self.keys = [item.key for item in items]
        self.planned = any(block.block.groups for block in self.blocks)

    def __len__(self) -> int:
        return len(self.keys)

    def group_counts(self) -> list[int]:
        """Groups per item (1 for an item without a plan)."""
        if not self.blocks:
            return [1] * len(self.items)
        return [len(self.blocks[b].plan) for b, _ in self.where]

    def item_path(self, i: int) -> str:
        if not self.blocks:
            return f"items[{i}]"
        b, r = self.where[i]
        return f"{self.blocks[b].path}.keys[{r}]"

    def descriptor_problem(self, i: int, regions: Mapping[int, Region]) -> ProtocolError | None:
        """Why item ``i``'s destination breaks the descriptor rules (spec section 6.7), or None."""
        if not self.blocks:
            item = self.items[i]
            try:
                resolve_spans(regions, [(s.region, s.offset, s.length) for s in item.spans], f"items[{i}].spans")
            except ProtocolError as exc:
                return exc
            return None
        b, r = self.where[i]
        block = self.blocks[b]
        if block.uniform(regions) is not None:
            return None
        return block.extents(regions).failures.get(r)

    def forward(self, indices: Sequence[int]) -> tuple[tuple[DeliverItem, ...], tuple[DeliverColumns, ...]]:
        """The items ``indices`` (ascending) as a request of their own: records as they came,
        or each block's rows cut out of its columns."""
        if not self.blocks:
            return tuple(self.items[i] for i in indices), ()
        rows: dict[int, list[int]] = {}
        for i in indices:
            b, r = self.where[i]
            rows.setdefault(b, []).append(r)
        return (), tuple(cast(DeliverColumns, self.blocks[b].block.select(picked)) for b, picked in rows.items())

    def extents(self, i: int) -> list[Extent]:
        """Item ``i``'s destination as (region id, offset, length), span by span."""
        if not self.blocks:
            return record_extents(self.items[i].spans)
        b, r = self.where[i]
        return row_extents(self.blocks[b].block, r)

    def region_ids(self, i: int) -> set[int]:
        """The region ids item ``i``'s destination names."""
        if not self.blocks:
            return {span.region for span in self.items[i].spans}
        b, r = self.where[i]
        block = self.blocks[b].block
        if isinstance(block.regions, int):
            return {block.regions}
        n = block.span_count
        return set(block.region_column()[r * n : (r + 1) * n])


