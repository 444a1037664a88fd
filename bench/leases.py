"""Leases: what holding keys costs against looking them up, and what leases do to admission.

Measured in one run against one node (a few seconds):

1. lease cost per key: for 1, 64 and 1,000 held keys, the p50 of ``lease`` then ``release``
   (two round trips) against the p50 of one ``query`` of the same keys, the calls taking
   turns so that both see the same machine; ``lease_cost_per_key_us`` is the 1,000-key
   difference per key, ``lease_1000_ratio`` lease + release over the query;
2. a wide read lease: 4,096 keys of 16 spans each, leased with a read grant (65,536 granted
   slots, their digests) and released, against one ``query`` of the same keys;
   ``read_lease_wide_ratio`` (round trips), and the node's own CPU per call of each,
   ``read_lease_wide_node_cpu_ratio`` (what holding and granting costs the node, where a
   query is a batch lookup);
3. admission into a full pool with part of it leased: the p50 of depositing one new
   object (which evicts one unleased object) with 0 %, 25 % and 50 % of the pool's objects
   leased; ``admission_leased_ratio`` is 50 % over 0 % (leased objects leave the eviction
   index, so admission should not slow down: near 1).

Run: ``python bench/leases.py [--json]``; ``--json`` prints the report on stderr and one
JSON object on stdout. Ratios matter more than absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lookups import interleaved
from procs import process_group, spawn
from stats import fmt_us, summary

from kvcr_client import Client, LeaseStatus, Span

SLOT = 4 << 10
POOL_SLOTS = 2048
SIZES = (1, 64, 1000)
ROUNDS = 200
WARMUP = 20
ADMISSIONS = 200
RESULT_TIMEOUT_S = 30.0


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(31, "big")


def lease_then_release(client: Client, keys: list[bytes]) -> None:
    lease = client.lease(keys).result(RESULT_TIMEOUT_S)
    assert lease.held_prefix() == len(keys), lease
    lease.release().result(RESULT_TIMEOUT_S)


def bench_cost(client: Client, region: Any) -> dict[str, Any]:
    keys = [key(i) for i in range(max(SIZES))]
    assert client.deposit({k: [Span("L0", region, 0, SLOT, "kv")] for k in keys}).result(RESULT_TIMEOUT_S).all_ok
    out: dict[str, Any] = {}
    for n in SIZES:
        subset = keys[:n]
        out[n] = interleaved({
            "query": lambda s=subset: client.query(s).result(RESULT_TIMEOUT_S),
            "lease": lambda s=subset: lease_then_release(client, s),
        }, ROUNDS, WARMUP)
    return out


WIDE_KEYS = 4096
WIDE_SPANS = 16
WIDE_SLOT = 1 << 10
WIDE_ROUNDS = 20
WIDE_CPU_QUERIES = 200


def bench_wide(client: Client, node_pid: int) -> dict[str, Any]:
    """A read lease of ``WIDE_KEYS`` keys of ``WIDE_SPANS`` spans each, then its release,
    against one query of the same keys (both one round trip or two, taking turns)."""
    buf = (np.arange(WIDE_SPANS * WIDE_SLOT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    region = client.register(buf)
    keys = [key(1_000_000 + i) for i in range(WIDE_KEYS)]
    spans = [Span(f"L{j}", region, j * WIDE_SLOT, WIDE_SLOT, "kv") for j in range(WIDE_SPANS)]
    for start in range(0, WIDE_KEYS, 256):
        assert client.deposit({k: spans for k in keys[start:start + 256]}).result(RESULT_TIMEOUT_S).all_ok

    def read_lease() -> None:
        lease = client.lease(keys, read=True).result(RESULT_TIMEOUT_S)
        assert lease.held_prefix() == WIDE_KEYS, lease
        lease.release().result(RESULT_TIMEOUT_S)

    def query() -> None:
        client.query(keys).result(RESULT_TIMEOUT_S)

    out: dict[str, Any] = interleaved({"query": query, "lease": read_lease}, WIDE_ROUNDS, 3)
    # The node's own CPU per call (what item 10 of the integrity issue measured), apart from
    # the client's: each call alone, many times, its CPU read from /proc before and after.
    out["node_cpu_ms"] = {name: node_cpu_per_call(node_pid, fn, rounds)
                          for name, fn, rounds in (("query", query, WIDE_CPU_QUERIES), ("lease", read_lease, WIDE_ROUNDS))}
    return out


def node_cpu_per_call(pid: int, fn: Any, rounds: int) -> float:
    """Milliseconds of process ``pid``'s CPU (user + system) per call of ``fn``."""
    before = cpu_s(pid)
    for _ in range(rounds):
        fn()
    return (cpu_s(pid) - before) / rounds * 1e3


def cpu_s(pid: int) -> float:
    """Process ``pid``'s CPU seconds so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_admission(client: Client, region: Any, leased_fraction: float, base: int) -> dict[str, float]:
    """Fill the pool, lease ``leased_fraction`` of it, then time admissions that each evict one object."""
    keys = [key(base + i) for i in range(POOL_SLOTS)]
    for start in range(0, POOL_SLOTS, 512):
        chunk = keys[start : start + 512]
        assert client.deposit({k: [Span("L0", region, 0, SLOT, "kv")] for k in chunk}).result(RESULT_TIMEOUT_S).all_ok
    held = keys[: int(leased_fraction * POOL_SLOTS)]
    lease = client.lease(held, ttl_ms=600_000).result(RESULT_TIMEOUT_S) if held else None
    if lease is not None:
        assert all(lease.status(k) is LeaseStatus.LEASED for k in held), lease
    times = []
    for i in range(ADMISSIONS):
        new = key(base + POOL_SLOTS + i)
        t0 = time.perf_counter()
        res = client.deposit({new: [Span("L0", region, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S)
        times.append(time.perf_counter() - t0)
        assert res[new].ok, res
    if lease is not None:
        present = client.query(held).result(RESULT_TIMEOUT_S)
        assert all(present[k].presence.name == "HIT" for k in held), "a leased object was evicted"
        lease.release().result(RESULT_TIMEOUT_S)
    return summary(times[20:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="the report to stderr, one JSON object to stdout")
    args = parser.parse_args()
    out: TextIO = sys.stderr if args.json else sys.stdout
    with process_group("lbench") as (run, procs):
        endpoint = f"ipc://{run}/node.sock"
        procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", endpoint, "--pool", f"kv:4KiB:{POOL_SLOTS}",
                           "--lease-pool-fraction", "0.9", "--log-level", "WARNING"))
        buf = (np.arange(SLOT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
        with Client(endpoint, name="bench-leases") as client:
            region = client.register(buf)
            cost = bench_cost(client, region)
            admission = {f: bench_admission(client, region, f, 10_000 * (1 + i)) for i, f in enumerate((0.0, 0.25, 0.5))}
            st = client.stats(audit=True).result(RESULT_TIMEOUT_S)
            assert st["invariants"] == [] and st["leases"]["held"] == 0, st["leases"]
        wide_endpoint = f"ipc://{run}/wide.sock"
        wide_node = spawn("-m", "kvcr_node.cli", "--endpoint", wide_endpoint, "--pool",
                          f"kv:{WIDE_SLOT}:{WIDE_KEYS * WIDE_SPANS}", "--lease-pool-fraction", "1",
                          "--lease-session-fraction", "1", "--log-level", "WARNING")
        procs.append(wide_node)
        with Client(wide_endpoint, name="bench-leases-wide") as client:
            wide = bench_wide(client, wide_node.pid)
    print(f"load average {os.getloadavg()[0]:.2f} (cores {os.cpu_count()})", file=out)
    print("lease + release (two round trips) against one query of the same held keys", file=out)
    for n, r in cost.items():
        ratio = r["lease"]["median"] / r["query"]["median"]
        print(f"  {n:5d} keys  query        {fmt_us(r['query'])}", file=out)
        print(f"  {n:5d} keys  lease+release {fmt_us(r['lease'])}  ratio {ratio:.2f}", file=out)
    big = cost[max(SIZES)]
    per_key = (big["lease"]["median"] - big["query"]["median"]) / max(SIZES) * 1e6
    print(f"  lease cost per key beyond the query (1000 keys): {per_key:.2f} us", file=out)
    wide_ratio = wide["lease"]["median"] / wide["query"]["median"]
    print(f"read lease of {WIDE_KEYS} keys x {WIDE_SPANS} spans + release against one query of them", file=out)
    print(f"  query         {fmt_us(wide['query'])}", file=out)
    print(f"  lease+release {fmt_us(wide['lease'])}  ratio {wide_ratio:.2f}", file=out)
    cpu = wide["node_cpu_ms"]
    node_ratio = cpu["lease"] / cpu["query"]
    print(f"  the node's CPU per call: query {cpu['query']:.2f} ms, lease+release {cpu['lease']:.2f} ms, "
          f"ratio {node_ratio:.1f}", file=out)
    print(f"admission into a full pool of {POOL_SLOTS} slots, one eviction each", file=out)
    for f, s in admission.items():
        print(f"  {f:4.0%} leased  {fmt_us(s)}", file=out)
    adm_ratio = admission[0.5]["median"] / admission[0.0]["median"]
    print(f"  ratio 50 % leased / none: {adm_ratio:.2f}", file=out)
    if args.json:
        print(json.dumps({
            "lease_1_ratio": round(cost[1]["lease"]["median"] / cost[1]["query"]["median"], 3),
            "lease_1000_ratio": round(big["lease"]["median"] / big["query"]["median"], 3),
            "lease_cost_per_key_us": round(per_key, 3),
            "read_lease_wide_ratio": round(wide_ratio, 3),
            "read_lease_wide_node_cpu_ratio": round(node_ratio, 2),
            "read_lease_wide_node_cpu_ms": round(cpu["lease"], 2),
            "admission_leased_ratio": round(adm_ratio, 3),
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
