"""Runs: spans contiguous on both sides of a transfer, merged into one descriptor each.

One kernel for every transfer kvcr plans: the node's moves between pool slots and a remote
region (``kvcr_node.transfers``), a client's READs under grants (``kvcr_client.readplans``)
and its WRITEs into granted slots (``kvcr_client.puts``). Small descriptors are slow, and
most objects lie in consecutive slots of consecutive memory, so a run goes on while the
next span begins where the last ended, locally and remotely, and belongs to the same group
(a layer plan's group, or whatever else must not share a descriptor: memory kinds,
devices). Pure functions of addresses and lengths: ``cut`` over columns (numpy), for the
long uniform lists engines send, and ``cut_rows`` span by span, for a few spans or spans
whose regions differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import numpy as np

K = TypeVar("K")


def cut(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray | int, groups: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Where each run starts (indices into the spans) and its bytes.

    ``local`` and ``remote`` are the spans' addresses (uint64, in transfer order);
    ``lengths`` their lengths (uint64), or one length for all; ``groups`` (any integers),
    when given, ends a run wherever the group changes.
    """
    n = len(local)
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    step = lengths[:-1] if isinstance(lengths, np.ndarray) else np.uint64(lengths)
    going_on = (local[1:] == local[:-1] + step) & (remote[1:] == remote[:-1] + step)
    if groups is not None:
        going_on &= groups[1:] == groups[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~going_on)))
    if isinstance(lengths, np.ndarray):
        sizes = np.add.reduceat(lengths, starts)
    else:
        sizes = np.diff(np.append(starts, n)).astype(np.uint64) * np.uint64(lengths)
    return starts, sizes


def cut_rows(rows: Iterable[tuple[K, int, int, int]]) -> list[tuple[K, int, int, int, int]]:
    """``cut`` span by span: per span its group (any value compared with ``==``), local
    and remote address and length, in order; per run its group, local and remote start,
    bytes and spans."""
    runs: list[tuple[K, int, int, int, int]] = []
    group: K | None = None
    l0 = r0 = size = count = l_end = r_end = -1
    for g, laddr, raddr, length in rows:
        if count > 0 and laddr == l_end and raddr == r_end and g == group:
            size += length
            count += 1
            l_end += length
            r_end += length
            continue
        if count > 0:
            runs.append((group, l0, r0, size, count))  # type: ignore[arg-type]
        group, l0, r0, size, count = g, laddr, raddr, length, 1
        l_end, r_end = laddr + length, raddr + length
    if count > 0:
        runs.append((group, l0, r0, size, count))  # type: ignore[arg-type]
    return runs


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values of an integer column, ascending, as ints. ``np.unique`` answers
    the same, but its first call in a process imports ``numpy.ma`` (35 ms here, holding the
    GIL): a client's first put or deliver would stall an engine's event loop that long."""
    return sorted(set(values.tolist()))
