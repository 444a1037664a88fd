"""Objects' span layouts, buffers registered with a client, and byte-checked transfers through one node."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvcr_client import Client, KeyStatus, RegionHandle, Span
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern, sentinel_like

RESULT_TIMEOUT_S = 15.0
"""How long a test waits for the result of one operation."""


class Layout:
    """An object's spans: names, pools and sizes, packed back to back in a source buffer."""

    def __init__(self, spans: Sequence[tuple[str, str, int]]) -> None:
        self.spans = list(spans)
        self.offsets: list[int] = []
        at = 0
        for _, _, size in self.spans:
            self.offsets.append(at)
            at += size
        self.nbytes = at

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.spans]

    def index(self, name: str) -> int:
        return self.names.index(name)

    def source_spans(self, region: RegionHandle, base: int = 0) -> list[Span]:
        return [
            Span(name, region, base + off, size, pool)
            for (name, pool, size), off in zip(self.spans, self.offsets, strict=True)
        ]

    def src_bytes(self, src: np.ndarray, i: int, base: int = 0) -> np.ndarray:
        off = base + self.offsets[i]
        return src[off : off + self.spans[i][2]]


def plain_layout(n: int, pool: str = "kv", size: int = 64 * KiB) -> Layout:
    """``n`` spans ``L0``.. of ``size`` bytes in one pool."""
    return Layout([(f"L{i}", pool, size) for i in range(n)])


def hybrid_layout(layers: int) -> Layout:
    """A hybrid model's object: per layer a ``full`` and a ``swa`` span, then one ``state`` span."""
    spans: list[tuple[str, str, int]] = []
    for i in range(layers):
        spans += [(f"L{i}.full", "full", 64 * KiB), (f"L{i}.swa", "swa", 16 * KiB)]
    spans.append(("state", "state", 1536 * KiB))
    return Layout(spans)


def plan_destination(
    layout: Layout, indices: Sequence[int], gap: int = 0, reverse: bool = False
) -> tuple[int, list[int]]:
    """Destination offsets for the spans ``indices`` (stored order), ``gap`` bytes apart.

    ``reverse`` places them back to front in the buffer (names stay in stored order).
    Returns (buffer size, offset per requested span).
    """
    sizes = [layout.spans[i][2] for i in indices]
    order = list(range(len(indices)))
    if reverse:
        order.reverse()
    offsets = [0] * len(indices)
    at = gap
    for j in order:
        offsets[j] = at
        at += sizes[j] + gap
    return at, offsets


class Registrar:
    """Registers buffers with a client and unregisters all of them at ``close``."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.regions: list[RegionHandle] = []

    def __call__(self, buffer: np.ndarray) -> RegionHandle:
        region = self.client.register(buffer)
        self.regions.append(region)
        return region

    def close(self) -> None:
        for region in self.regions:
            self.client.unregister(region)
        self.regions.clear()


def deliver_and_check(
    client: Client,
    register: Callable[[np.ndarray], RegionHandle],
    key: bytes,
    layout: Layout,
    src: np.ndarray,
    indices: Sequence[int],
    seed: int,
    gap: int = 0,
    reverse: bool = False,
) -> None:
    """Deliver the spans ``indices`` of ``key`` into a fresh sentinel buffer; check every byte."""
    size, offsets = plan_destination(layout, indices, gap, reverse)
    dst = sentinel_like(size, seed)
    expected = dst.copy()
    region = register(dst)
    spans = []
    for i, off in zip(indices, offsets, strict=True):
        name, _, span_size = layout.spans[i]
        spans.append(Span(name, region, off, span_size))
        expected[off : off + span_size] = layout.src_bytes(src, i)
    res = client.deliver({key: spans}).result(RESULT_TIMEOUT_S)
    outcome = res[key]
    assert outcome.status.value == "OK", (indices, outcome)
    assert_bytes_equal(dst, expected, f"deliver of spans {list(indices)}")


def round_trip(client: Client, reg: Registrar, key: bytes, layout: Layout, seed: int) -> None:
    """Deposit patterned bytes, deliver them into a sentinel buffer, compare every byte."""
    src = pattern(layout.nbytes, seed)
    region = reg(src)
    assert client.deposit({key: layout.source_spans(region)}).result(RESULT_TIMEOUT_S)[key].status is KeyStatus.STORED
    dst = pattern(layout.nbytes + 64, seed + 1)
    expected = dst.copy()
    expected[32 : 32 + layout.nbytes] = src
    dregion = reg(dst)
    spans = [Span(n, dregion, 32 + o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]
    assert client.deliver({key: spans}).result(RESULT_TIMEOUT_S)[key].status is KeyStatus.OK
    assert_bytes_equal(dst, expected, "round trip")


class StoredObject:
    """An object deposited from a patterned source, and a destination of its whole layout
    in a buffer of its own, pre-filled with another pattern (``sentinel`` keeps a copy)."""

    def __init__(self, client: Client, reg: Registrar, key: bytes, layout: Layout, seed: int) -> None:
        self.key = key
        self.src = pattern(layout.nbytes, seed)
        self.src_region = reg(self.src)
        stored = client.deposit({key: layout.source_spans(self.src_region)}).result(RESULT_TIMEOUT_S)[key]
        assert stored.status is KeyStatus.STORED, stored
        self.dst = pattern(layout.nbytes, seed + 1)
        self.sentinel = self.dst.copy()
        self.dst_region = reg(self.dst)
        self.spans = [Span(n, self.dst_region, o, s) for (n, _, s), o in zip(layout.spans, layout.offsets, strict=True)]
