"""Digests of stored spans (spec section 6.12, "Integrity"): one algorithm for node and client.

A span's digest is XXH3-64 of its bytes (the ``xxhash`` package, seed 0), as an unsigned
64-bit integer; a digest that comes out 0 is given 1, since 0 on the wire means "not
taken" (a span in GPU memory, a node with ``integrity`` off). The node takes them when an
object becomes ``READY``; a reader under a grant takes them again of what landed in its
own memory and compares. The check is not free: on the 2-core reference machine XXH3 over
64 MiB in 64 KiB spans takes about 2.5-3.5 ms against about 6 ms for the granted READ of
the same bytes (``bench/integrity.py`` measures it).
"""

from __future__ import annotations

import ctypes
import sys
from array import array
from typing import Any

import xxhash

UNCHECKED = 0
"""A digest the node did not take: that span is not checked."""


def span_digest(data: Any) -> int:
    """The digest of ``data`` (any object with the buffer protocol), never ``UNCHECKED``."""
    return xxhash.xxh3_64_intdigest(data) or 1


def digest_at(address: int, length: int) -> int:
    """The digest of ``length`` bytes of this process's memory at ``address`` (host memory,
    read in place: nothing is copied)."""
    return span_digest((ctypes.c_char * length).from_address(address))


def pack_digests(digests: array[int]) -> bytes:
    """Digests as they travel: u64 each, little-endian (``array("Q")`` in, as built)."""
    if sys.byteorder != "little":
        digests = array("Q", digests)
        digests.byteswap()
    return digests.tobytes()


def unpack_digests(data: bytes) -> array[int]:
    """The u64 digests of a ``digest`` column (``pack_digests``'s inverse)."""
    out = array("Q", data)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def host_view(buffer: Any, length: int) -> tuple[memoryview, int] | None:
    """A byte view of a registered host buffer and its address, so that spans of it are
    digested by slicing (no ctypes object per span); None when it has no such view (then
    ``digest_at`` reads by address)."""
    try:
        view = memoryview(buffer).cast("B")
    except (TypeError, ValueError):
        return None
    if view.nbytes < length or not view.c_contiguous:
        return None
    address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
    if address is None:
        return None
    return view, address
