"""Helpers shared by the integration tests: node start/stop, byte checks, node health checks.

Imported by the test modules of this folder as ``integration_helpers`` (pytest's default
``prepend`` import mode puts this folder on ``sys.path``; the unusual name keeps it from
colliding with another folder's ``helpers``). ``start_node`` and ``pattern`` come from
``tests/conftest.py``, loaded by path: with several non-package conftests, the module
named ``conftest`` in ``sys.modules`` is whichever pytest imported last.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvcr_client import Client, RegionHandle, Span


def _root_conftest() -> ModuleType:
    name = "kvcr_tests_root_conftest"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


_conftest = _root_conftest()
start_node: Callable[..., Any] = _conftest.start_node
pattern: Callable[[int, int], np.ndarray] = _conftest.pattern
NodeProcess = _conftest.NodeProcess

KiB = 1024
STATS_TIMEOUT_S = 5.0
RESULT_TIMEOUT_S = 15.0


@contextmanager
def short_ipc_dir(tag: str) -> Iterator[Path]:
    """A short private directory for ipc socket files (ipc paths are limited to ~107 bytes)."""
    path = Path(f"/tmp/kvcr-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        for p in path.iterdir():
            p.unlink(missing_ok=True)
        path.rmdir()


@contextmanager
def running_node(ipc_dir: Path, name: str, *args: str) -> Iterator[Any]:
    """A node on ``ipc://<ipc_dir>/<name>.sock``; stopped (SIGTERM, bounded) on exit."""
    node = start_node(f"ipc://{ipc_dir}/{name}.sock", *args)
    try:
        yield node
    finally:
        node.stop()


# --------------------------------------------------------------------------- node health


def stats(client: Client) -> dict[str, Any]:
    result: dict[str, Any] = client.stats().result(STATS_TIMEOUT_S)
    return result


def slot_accounting(st: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per pool ``(free, allocated)`` from a stats snapshot."""
    return {name: (p["free"], p["allocated"]) for name, p in st["pools"].items()}


def assert_clean(client: Client, *, slots_before: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The node is at rest and consistent: no breach, no claim, nothing pending or in flight.

    With ``slots_before`` (from ``slot_accounting``), also that no slot was taken or freed.
    Returns the stats snapshot it checked.
    """
    st = stats(client)
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0, st["claims"]
    assert st["claims"]["handles"] == 0, st["claims"]
    assert st["claims"]["operations"] == 0, st["claims"]
    assert st["operations_pending"] == 0, st
    assert st["transfers"]["in_flight"] == 0, st["transfers"]
    assert st["writing"] == 0, st
    for name, pool in st["pools"].items():
        assert pool["free"] + pool["allocated"] == pool["total"], (name, pool)
    if slots_before is not None:
        assert slot_accounting(st) == slots_before, (slot_accounting(st), slots_before)
    return st


# --------------------------------------------------------------------------- byte checks


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what: str = "buffer") -> None:
    """Every byte equal; on failure say how many differ and where the first one is."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    diff = np.flatnonzero(actual != expected)
    if diff.size:
        first = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.size} of {actual.size} bytes differ; first at {first}: "
            f"got {int(actual[first])}, expected {int(expected[first])}"
        )


def sentinel_like(n: int, seed: int) -> np.ndarray:
    """A destination pre-filled with a pattern of its own, so untouched bytes are checkable."""
    return pattern(n, seed)


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


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


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
