"""The rows of a read grant (spec section 6.12): per key of a lease, its slots, or none.

A grant names, for every key a lease holds in this node, its stored span names and each
span's pool (its index in ``welcome.pools``) and slot. ``Leases`` decides who gets one
(``client_transfers``, version 5, a client session); this module only lays the rows out,
as packed columns (``PackedRow``): the names and pool indices once per layout, the slots
as the entry keeps them, so a key costs the same whatever its spans.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence

from kvcr_node.objects import ObjectEntry
from kvcr_protocol import DEFAULT_LIMITS, LeaseGrant, LeaseStatus, PackedRow
from kvcr_protocol.columns import U32, pack, unpack

Row = PackedRow | None
"""A key's row: its stored span names, a pool index byte and a u32 slot per span; None: no grant."""

_LITTLE = sys.byteorder == "little"


def grant_rows(
    entries: Sequence[ObjectEntry], keys: Sequence[bytes], status: bytes | bytearray, pool_index: Mapping[str, int],
    max_spans: int = DEFAULT_LIMITS.max_spans,
) -> list[Row]:
    """One row per key of the lease, in its order. A key the lease holds here (``LEASED``)
    gets its slots while the grant's spans stay within ``max_spans``, the keys past that get
    none (they travel by ``deliver``); a repeated key gets its row at its first position
    only (the client reads by key), so that repeating a key cannot make the reply grow."""
    held = {entry.key: entry for entry in entries}
    layouts: dict[int, tuple[tuple[str, ...], bytes]] = {}
    """Per layout (by ``id`` of its shared ``LayoutInfo``): its names and pool index bytes."""
    budget = max_spans
    rows: list[Row] = []
    seen: set[bytes] = set()
    for i, key in enumerate(keys):
        if key in seen:
            rows.append(None)
            continue
        seen.add(key)
        entry = held.get(key) if status[i] == LeaseStatus.LEASED else None
        if entry is None or len(entry.info.layout) > budget:
            rows.append(None)
            continue
        info = entry.info
        budget -= len(info.layout)
        shared = layouts.get(id(info))
        if shared is None:
            shared = layouts[id(info)] = (tuple(name for name, _ in info.layout),
                                          bytes(pool_index[pool] for _, pool in info.layout))
        slots = entry.slot_view
        rows.append((shared[0], shared[1], slots.tobytes() if _LITTLE else pack(slots, U32)))
    return rows


def with_digests(
    grant: LeaseGrant, entries: Sequence[ObjectEntry], keys: Sequence[bytes], remote: Mapping[int, bytes],
) -> LeaseGrant:
    """``grant`` with the digest of every span granted here (``entries``: the lease's objects,
    empty with ``integrity`` off), and of a source's rows (``remote``: by key position) those
    the source sent with them (spec section 6.12, "Integrity"); 0 for a span with none (not
    checked)."""
    if not entries and not any(remote.values()):
        return grant  # nothing to send: no pass over the grant's rows
    held = {entry.key: entry for entry in entries}
    spans_of = [joined.count("\0") + 1 for joined in grant.layouts]  # per layout: its spans
    column = bytearray()
    for i, index in enumerate(unpack(grant.layout, U32)):
        if not index:
            continue
        spans = spans_of[index - 1]
        if grant.source_of(i) is None:
            entry = held.get(keys[i])
            digests = entry.digests if entry is not None else b""
        else:
            digests = remote.get(i, b"")
        column += digests if len(digests) == 8 * spans else bytes(8 * spans)
    if not any(column):
        return grant
    return dataclasses.replace(grant, digest=bytes(column))

