"""Admission cost against unrelated evictable objects, and index memory per object.

architecture §3's cost goal: admitting an object that evicts k victims costs O(k log n),
whatever the number of evictable objects in unrelated pools. This fills pool A with
``n_unrelated`` evictable objects and pool B to the brim, then times admissions into B,
each of which evicts one object of B. The time per admission should not grow with
``n_unrelated`` (ratio near 1) and the index should look at one candidate per admission.

Run: ``python bench/admission.py``.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc

from kvcr_node.eviction import Layout, make_policy
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome, Store

KiB = 1024


def _key(i: int) -> bytes:
    """A 32-byte key, the size of a typical prefix hash."""
    return i.to_bytes(32, "big")


def _fill(store: Store, first: int, count: int, layout: Layout) -> None:
    for i in range(first, first + count):
        outcome, entry = store.begin_deposit(_key(i), layout)
        if outcome is not DepositOutcome.NEW or entry is None:
            raise RuntimeError(f"fill failed: {outcome}")
        store.commit(entry)


def measure_admission(n_unrelated: int, n_admit: int = 64) -> dict[str, float]:
    """Median seconds per admission into a full pool B beside ``n_unrelated`` in pool A."""
    pools = [PoolSpec("A", 64 * KiB, max(n_unrelated, 1)), PoolSpec("B", 64 * KiB, n_admit)]
    store = Store(pools, make_policy("fifo"))
    layout_a: Layout = (("L0", "A"),)
    layout_b: Layout = (("L0", "B"),)
    _fill(store, 0, n_unrelated, layout_a)
    _fill(store, n_unrelated, n_admit, layout_b)
    visits_before = store.index.visits
    times: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for i in range(n_unrelated + n_admit, n_unrelated + 2 * n_admit):
            key = _key(i)
            start = time.perf_counter()
            outcome, entry = store.begin_deposit(key, layout_b)
            assert entry is not None
            store.commit(entry)
            times.append(time.perf_counter() - start)
            if outcome is not DepositOutcome.NEW:
                raise RuntimeError(f"admission failed: {outcome}")
    finally:
        gc.enable()
    if store.stats()["evictions"] != {"A": 0, "B": n_admit}:
        raise RuntimeError(f"unexpected evictions: {store.stats()['evictions']}")
    return {
        "n_unrelated": n_unrelated,
        "n_admit": n_admit,
        "median_s": statistics.median(times),
        "visits": store.index.visits - visits_before,
    }


def index_bytes_per_object(n: int = 100_000, spans: int = 1) -> float:
    """Bytes the store holds per READY object (tracemalloc, everything counted).

    Counts the store itself, its slot allocators (a few bytes per slot), the keys (32
    bytes each), entries, packed slots, the key table and both eviction structures.
    """
    layout: Layout = tuple((f"L{i}", "A") for i in range(spans))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = Store([PoolSpec("A", 64 * KiB, n * spans)], make_policy("lru"))
        _fill(store, 0, n, layout)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    if len(store) != n:
        raise RuntimeError("fill incomplete")
    return held / n


def main() -> None:
    sizes = (1_000, 10_000, 100_000)
    rows = {n: measure_admission(n) for n in sizes}
    print("admission into a full pool B, n_unrelated evictable objects in pool A (FIFO)")
    print(f"{'n_unrelated':>12} {'median us/admit':>16} {'visits':>7}")
    for n, row in rows.items():
        print(f"{n:>12,} {row['median_s'] * 1e6:>16.2f} {int(row['visits']):>7} (of {int(row['n_admit'])} admits)")
    ratio = rows[100_000]["median_s"] / rows[1_000]["median_s"]
    print(f"ratio 100k/1k: {ratio:.2f}")
    print()
    print("index memory per READY object (tracemalloc, 100,000 objects, 32-byte keys)")
    for spans in (1, 8, 64):
        print(f"{spans:>3} span(s): {index_bytes_per_object(100_000, spans):8.0f} bytes/object")


if __name__ == "__main__":
    main()
