"""The rows of a read grant (spec section 6.12): per key of a lease, its slots, or none.

A grant names, for every key a lease holds in this node, its stored span names and each
span's pool (its index in ``welcome.pools``) and slot. ``Leases`` decides who gets one
(``client_transfers``, version 5, a client session); this module only lays the rows out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcr_node.store import ObjectEntry
from kvcr_protocol import DEFAULT_LIMITS, LeaseStatus

Row = tuple[tuple[str, ...], list[tuple[int, int]]] | None
"""A key's row: its stored span names and (pool index, slot) per span; None: no grant."""


def grant_rows(
    entries: Sequence[ObjectEntry], keys: Sequence[bytes], status: bytes | bytearray, pool_index: Mapping[str, int],
    max_spans: int = DEFAULT_LIMITS.max_spans,
) -> list[Row]:
    """One row per key of the lease, in its order. A key the lease holds here (``LEASED``)
    gets its slots while the grant's spans stay within ``max_spans``, the keys past that get
    none (they travel by ``deliver``); a repeated key gets its row at its first position
    only (the client reads by key), so that repeating a key cannot make the reply grow."""
    held = {entry.key: entry for entry in entries}
    budget = max_spans
    rows: list[Row] = []
    row: Row
    seen: set[bytes] = set()
    for i, key in enumerate(keys):
        if key in seen:
            rows.append(None)
            continue
        seen.add(key)
        entry = held.get(key) if status[i] == LeaseStatus.LEASED else None
        row = None
        if entry is not None and len(entry.info.layout) <= budget:
            layout = entry.info.layout
            budget -= len(layout)
            row = (tuple(name for name, _ in layout),
                   [(pool_index[pool], slot) for (_, pool), slot in zip(layout, entry.slot_view, strict=True)])
        rows.append(row)
    return rows
