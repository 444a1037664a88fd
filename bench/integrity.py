"""What integrity costs a reader under a grant: a whole 64 MiB deliver, digests checked or not.

Two nodes in one run, alike but for ``--no-integrity``, each holding the same 64 MiB object
in 1,024 spans of 64 KiB; one client leases it at both (a read grant each) and delivers it
from each in turn, interleaved, into the same page-aligned destination. The anchor is the
deliver without digests: the same bytes from the same slots, so the ratio is the price of
checking (XXH3 over what landed; the checked deliver is read in parts of 4 MiB, each hashed
on the client's digest worker while the next is copied: ``kvcr_client.digest_checks``). Also the raw digest rate of this
machine (``digest_gbps``), and a planned 32-group deliver both ways (``integrity_cost_planned``),
where each group is checked as it lands.

    uv run python bench/integrity.py [--runs 20] [--json]

``--json`` prints one object: ``integrity_cost`` (median with digests / median without; the
goal is <= 1.15), ``integrity_cost_planned``, ``deliver_ms`` and ``deliver_unchecked_ms``
(medians), their spreads ((p90 - p10) / median), and ``digest_gbps``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from buffers import aligned
from procs import process_group, spawn
from stats import summary

from kvcr_client import Client, Span
from kvcr_io.digests import span_digest

SPAN = 64 * 1024
SPANS = 1024
OBJECT = SPAN * SPANS
GROUPS = 32
KEY = b"integrity-bench"


def spans(region: object) -> list[Span]:
    return [Span(f"L{i}", region, i * SPAN, SPAN, "kv") for i in range(SPANS)]  # type: ignore[arg-type]


def timed(client: Client, items: dict[bytes, list[Span]], plan: list[list[str]] | None) -> float:
    start = time.perf_counter()
    res = client.deliver(items, plan=plan).result(60)
    elapsed = time.perf_counter() - start
    assert res[KEY].ok, res
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="timed delivers of each kind (interleaved)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    args = parser.parse_args()
    src = aligned(OBJECT)
    src[:] = (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    dst = aligned(OBJECT)
    # The lease pins the whole object: leases may take the whole pool.
    pools = ["--pool", f"kv:64KiB:{SPANS + 8}", "--log-level", "WARNING", "--lease-pool-fraction", "1",
             "--lease-session-fraction", "1"]
    with process_group("integrity") as (run, procs):
        procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/on.sock", *pools))
        procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/off.sock", *pools, "--no-integrity"))
        with Client(f"ipc://{run}/on.sock", name="bench-on") as on, Client(f"ipc://{run}/off.sock", name="bench-off") as off:
            items: dict[str, dict[bytes, list[Span]]] = {}
            leases = []
            for name, client in (("on", on), ("off", off)):
                source = client.register(src)
                assert client.deposit({KEY: spans(source)}).result(60).all_ok
                client.unregister(source)
                lease = client.lease([KEY], ttl_ms=600_000).result(60)
                assert KEY in lease.granted, "no read grant: the deliver would go through the node"
                leases.append(lease)
                items[name] = {KEY: spans(client.register(dst))}
            plan = [[f"L{i}" for i in range(g * SPANS // GROUPS, (g + 1) * SPANS // GROUPS)] for g in range(GROUPS)]
            samples: dict[str, list[float]] = {"on": [], "off": [], "on_planned": [], "off_planned": []}
            for name, client in (("on", on), ("off", off)):  # warm: connections, caches
                timed(client, items[name], None)
            for _ in range(args.runs):
                for name, client in (("on", on), ("off", off)):
                    samples[name].append(timed(client, items[name], None))
                    samples[f"{name}_planned"].append(timed(client, items[name], plan))
            assert on._grants.checked >= SPANS and on._grants.mismatched == 0, "the digests were not checked"
            assert off._grants.checked == 0
            for lease in leases:
                lease.release().result(60)
    digest_s = summary([_digest_time(src) for _ in range(args.runs)])
    s = {name: summary(values) for name, values in samples.items()}
    figures = {
        "integrity_cost": s["on"]["median"] / s["off"]["median"],
        "integrity_cost_planned": s["on_planned"]["median"] / s["off_planned"]["median"],
        "deliver_ms": s["on"]["median"] * 1e3,
        "deliver_unchecked_ms": s["off"]["median"] * 1e3,
        "deliver_spread": s["on"]["spread"],
        "deliver_unchecked_spread": s["off"]["spread"],
        "digest_gbps": OBJECT / digest_s["median"] / 1e9,
    }
    print(f"64 MiB in {SPANS} spans, {args.runs} runs each, interleaved")
    print(f"  deliver under a grant, digests checked   median {figures['deliver_ms']:7.2f} ms  spread {s['on']['spread']:.2f}")
    print(f"  deliver under a grant, no digests         median {figures['deliver_unchecked_ms']:7.2f} ms  "
          f"spread {s['off']['spread']:.2f}")
    print(f"  integrity_cost {figures['integrity_cost']:.3f} (goal <= 1.15); planned, {GROUPS} groups: "
          f"{figures['integrity_cost_planned']:.3f}")
    print(f"  XXH3 over 64 MiB here: {figures['digest_gbps']:.1f} GB/s")
    if args.json:
        print(json.dumps(figures))
    return 0


def _digest_time(buf: np.ndarray) -> float:
    start = time.perf_counter()
    for i in range(SPANS):
        span_digest(buf[i * SPAN:(i + 1) * SPAN])
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
