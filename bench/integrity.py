"""What integrity costs a reader under a grant: a whole 64 MiB deliver, digests checked or not.

Two nodes in one run, alike but for ``--no-integrity``, each holding the same 64 MiB object
in 1,024 spans of 64 KiB; one client leases it at both (a read grant each) and delivers it
from each in turn, interleaved, into the same page-aligned destination. The anchor is the
deliver without digests: the same bytes from the same slots, so the ratio is the price of
checking (XXH3 over what landed; the checked deliver is read in parts of 4 MiB, each hashed
on the client's digest worker while the next is copied: ``kvcr_client.digest_checks``). Also the raw digest rate of this
machine (``digest_gbps``), and a planned 32-group deliver both ways (``integrity_cost_planned``),
where each group is checked as it lands.

The floor of checking on this machine is measured in the same run by raw NIXL alone: a bare
agent in this process READs the same 1,024 x 64 KiB from a bare NIXL process (``bench/local.py``'s
raw writer), once whole and once in the same 4 MiB parts with each landed part hashed on a
thread while the next is copied (the last on this thread), as the client does
(``integrity_floor``: parts hashed / whole). Two cores share their memory bandwidth, so the
copy and the hash slow each other: kvcr cannot check for less than that.

    uv run python bench/integrity.py [--runs 20] [--json]

``--json`` prints one object: ``integrity_cost`` (median with digests / median without; the
goal is <= 1.15), ``integrity_cost_planned``, ``deliver_ms`` and ``deliver_unchecked_ms``
(medians), their spreads ((p90 - p10) / median), ``digest_gbps``, ``integrity_floor`` (raw NIXL
READ in parts, hashed / raw NIXL READ whole, medians) and ``integrity_over_floor``
(``integrity_cost`` / ``integrity_floor``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import Peer
from buffers import aligned
from local import RawNixl, raw_writer
from procs import process_group, spawn
from stats import summary

from kvcr_client import Client, Span
from kvcr_client.digest_checks import PART_BYTES
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


class Floor:
    """The raw NIXL floor: the same READ by a bare agent, whole, or in parts checked as kvcr
    checks them (``PART_BYTES``, XXH3 per span against the writer's digests)."""

    def __init__(self, raw: RawNixl, expected: list[int]) -> None:
        self.raw = raw
        self.expected = expected
        self.view = raw.dst.data.cast("B")
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="floor-digests")
        self.per_part = PART_BYTES // SPAN

    def read(self, first: int, count: int) -> None:
        agent = self.raw.agent
        indices = list(range(first, first + count))
        handle = agent.make_prepped_xfer(
            "READ", self.raw.mine[self.raw.dst.ctypes.data], indices, self.raw.theirs, indices)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        assert state == "DONE", state

    def check(self, first: int, count: int) -> int:
        """How many spans of ``first``.. ``first + count - 1`` differ from their digests."""
        view, expected = self.view, self.expected
        return sum(span_digest(view[i * SPAN:(i + 1) * SPAN]) != expected[i] for i in range(first, first + count))

    def whole(self) -> float:
        start = time.perf_counter()
        self.read(0, SPANS)
        return time.perf_counter() - start

    def in_parts(self) -> float:
        start = time.perf_counter()
        checks: list[Future[int]] = []
        for first in range(0, SPANS, self.per_part):
            self.read(first, self.per_part)
            if first + self.per_part < SPANS:
                checks.append(self.hasher.submit(self.check, first, self.per_part))
            else:
                last = self.check(first, self.per_part)
        bad = last + sum(check.result() for check in checks)
        elapsed = time.perf_counter() - start
        assert bad == 0, f"{bad} spans differ"
        return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="timed delivers of each kind (interleaved)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    parser.add_argument("--raw-writer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_writer:
        raw_writer(args.raw_writer)
        return 0
    src = aligned(OBJECT)
    src[:] = (np.arange(OBJECT, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    dst = aligned(OBJECT)
    # The lease pins the whole object: leases may take the whole pool.
    pools = ["--pool", f"kv:64KiB:{SPANS + 8}", "--log-level", "WARNING", "--lease-pool-fraction", "1",
             "--lease-session-fraction", "1"]
    with process_group("integrity") as (run, procs):
        procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/on.sock", *pools))
        procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/off.sock", *pools, "--no-integrity"))
        procs.append(spawn(__file__, "--raw-writer", f"ipc://{run}/raw.sock"))
        peer = Peer(f"ipc://{run}/raw.sock")
        raw = RawNixl(peer, aligned(OBJECT), aligned(OBJECT))  # the writer's pool holds ``src``'s pattern
        floor = Floor(raw, [span_digest(src[i * SPAN:(i + 1) * SPAN]) for i in range(SPANS)])
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
            samples: dict[str, list[float]] = {"on": [], "off": [], "on_planned": [], "off_planned": [],
                                               "raw": [], "raw_parts": []}
            for name, client in (("on", on), ("off", off)):  # warm: connections, caches
                timed(client, items[name], None)
            floor.whole()
            floor.in_parts()
            for _ in range(args.runs):
                for name, client in (("on", on), ("off", off)):
                    samples[name].append(timed(client, items[name], None))
                    samples[f"{name}_planned"].append(timed(client, items[name], plan))
                samples["raw"].append(floor.whole())
                samples["raw_parts"].append(floor.in_parts())
            assert on.counters()["spans_checked"] >= SPANS and on.counters()["digest_mismatches"] == 0, "the digests were not checked"
            assert off.counters()["spans_checked"] == 0
            for lease in leases:
                lease.release().result(60)
        peer.close()
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
        "integrity_floor": s["raw_parts"]["median"] / s["raw"]["median"],
    }
    figures["integrity_over_floor"] = figures["integrity_cost"] / figures["integrity_floor"]
    print(f"64 MiB in {SPANS} spans, {args.runs} runs each, interleaved")
    print(f"  deliver under a grant, digests checked   median {figures['deliver_ms']:7.2f} ms  spread {s['on']['spread']:.2f}")
    print(f"  deliver under a grant, no digests         median {figures['deliver_unchecked_ms']:7.2f} ms  "
          f"spread {s['off']['spread']:.2f}")
    print(f"  integrity_cost {figures['integrity_cost']:.3f} (goal <= 1.15); planned, {GROUPS} groups: "
          f"{figures['integrity_cost_planned']:.3f}")
    print(f"  XXH3 over 64 MiB here: {figures['digest_gbps']:.1f} GB/s")
    print(f"  raw NIXL READ whole {s['raw']['median'] * 1e3:.2f} ms, in {OBJECT // PART_BYTES} parts hashed "
          f"{s['raw_parts']['median'] * 1e3:.2f} ms: integrity_floor {figures['integrity_floor']:.3f}; "
          f"kvcr over it {figures['integrity_over_floor']:.3f}")
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
