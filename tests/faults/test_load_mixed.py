"""A bounded load test: 16 clients (4 processes x 4 clients) against one node.

Mixed deposits, queries, deliveries and releases for ``KVCR_LOAD_SECONDS`` (default 10,
at most 30 is the intended range) against a pool small enough that deposits evict. No
operation may fail except in the expected ways: a deposit refused ``CAPACITY``, and the
delivery of an object that was evicted since it was stored (``NOT_FOUND``; never for an
object the client holds with a ``no_evict`` handle). A quarter of the deliveries are
checked byte for byte. Latencies (p50/p99 per operation kind) are printed (``-s``) and
recorded as the test's properties (``--junitxml``).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from kvcr_client import Client
from kvcr_testing.health import assert_clean
from kvcr_testing.hostile import Worker, percentile

PROCESSES = 4
CLIENTS_PER_PROCESS = 4
SECONDS = float(os.environ.get("KVCR_LOAD_SECONDS", "10"))
SLOT = 64 << 10
SLOTS = 256
"""16 MiB: 16 clients with objects of up to 4 slots fill it within a second or two."""


@pytest.mark.timeout(int(SECONDS) + 180)
def test_mixed_load(node_factory: Callable[..., Any], record_property: Callable[[str, Any], None]) -> None:
    node = node_factory("--pool", f"kv:64KiB:{SLOTS}")
    workers = [
        Worker("load", node.endpoint, "--clients", str(CLIENTS_PER_PROCESS), "--seconds", str(SECONDS),
               "--slot", str(SLOT), "--spans", "4", "--seed", str(p + 1), "--check-fraction", "0.25")
        for p in range(PROCESSES)
    ]
    try:
        for w in workers:
            w.expect("ready", 120)
        t0 = time.monotonic()
        for w in workers:
            w.say("go")
        summaries = [w.expect("summary", SECONDS + 150) for w in workers]
        wall = time.monotonic() - t0
        for w in workers:
            assert w.wait(30) == 0
    finally:
        for w in workers:
            w.close()

    latencies: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    failures: list[str] = []
    checked = 0
    for s in summaries:
        for kind, values in s["latencies"].items():
            latencies[kind].extend(values)
        for kind, n in s["counts"].items():
            counts[kind] += n
        failures.extend(s["failures"])
        checked += s["checked"]

    lines = [f"load: {PROCESSES * CLIENTS_PER_PROCESS} clients, {SECONDS:.0f} s ({wall:.1f} s wall), pool {SLOTS} x 64 KiB"]
    for kind in sorted(latencies):
        values = latencies[kind]
        p50, p99 = percentile(values, 50) * 1000, percentile(values, 99) * 1000
        lines.append(f"  {kind:8s} n={len(values):6d}  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  ({len(values) / SECONDS:.0f}/s)")
        record_property(f"{kind}_count", len(values))
        record_property(f"{kind}_p50_ms", round(p50, 3))
        record_property(f"{kind}_p99_ms", round(p99, 3))
    lines.append(f"  outcomes {dict(sorted(counts.items()))}; {checked} deliveries checked byte for byte")
    report = "\n".join(lines)
    print("\n" + report)

    with Client(node.endpoint, name="load-observer") as observer:
        st = assert_clean(observer)
    lines.append(f"  node: evictions {st['evictions']}, objects {st['objects']}, outcomes {st['outcomes']}")
    report = "\n".join(lines)
    evictions = sum(st["evictions"].values())  # per pool
    record_property("evictions", evictions)

    assert failures == [], report + "\nfailures:\n" + "\n".join(failures[:50])
    assert st["invariants"] == [] and st["clients"] == 1, report
    assert counts["deposit.STORED"] > 0 and counts["deliver.OK"] > 0 and latencies["query"], report
    assert checked > 0, report
    assert evictions > 0, "the pool was meant to be small enough to evict\n" + report
    # Every delivery that found its object gone is explained by an eviction.
    assert counts.get("deliver.NOT_FOUND.evicted", 0) <= evictions, report
