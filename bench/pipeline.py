"""Pipeline benchmark: an engine loop that computes on layer i as soon as it has landed.

An object of 32 layers of 1 MiB is delivered with a layer plan (one group per layer), and
the engine runs a fixed CPU-bound kernel per layer, calibrated to cost about one layer's
transfer time. Progressive: ``handle.wait(i)`` then the kernel on layer i, for each i.
Whole then compute: wait for the whole object, then the 32 kernels. ``overlap_speedup`` =
whole-then-compute time / progressive time (2.0 is the ideal when compute equals
transfer), across nodes (client on node A, object on node B) and locally (client on B).

Run: ``python bench/pipeline.py`` (under a minute); ``--json`` adds one line with
``overlap_speedup`` (across nodes). Ratios matter, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group, spawn
from remote import LAYER, LAYER_PLAN, LAYERS, node_flags
from stats import fmt_us, summary

from kvcr_client import Client, Span


def kernel(layer: np.ndarray, words: int) -> int:
    """A fixed CPU-bound kernel: passes over the layer's first ``words`` 32-bit words, wrapping
    round (numpy, so the client's I/O thread can run). Its cost grows in steps of a few
    microseconds, so it can be matched to one layer's transfer time."""
    view = layer.view(np.uint32)
    acc = 0
    while words > 0:
        part = view[: min(words, view.size)]
        acc ^= int(np.add.reduce(part ^ 0x5A5A5A5A, dtype=np.uint64))
        words -= part.size
    return acc


def calibrate(target_s: float) -> int:
    """Kernel words that cost about ``target_s`` on this machine now (the median of a few
    timings, refined once at the estimate)."""
    layer = np.ones(LAYER, dtype=np.uint8)
    words = LAYER // 4

    def cost(n: int) -> float:
        kernel(layer, n)  # warm
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            kernel(layer, n)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for _ in range(2):
        words = max(1024, round(words * target_s / cost(words)))
    return words


def measure(client: Client, dst: np.ndarray, layers: Any, request_id: str | None, runs: int) -> dict[str, Any]:
    def transfer_only() -> float:
        t0 = time.perf_counter()
        assert client.deliver({b"layers": layers}, request_id=request_id).result(10).all_ok
        return time.perf_counter() - t0

    for _ in range(3):
        transfer_only()
    t_transfer = statistics.median(transfer_only() for _ in range(runs))
    kwords = calibrate(t_transfer / LAYERS)
    views = [dst[i * LAYER : (i + 1) * LAYER] for i in range(LAYERS)]

    def progressive() -> float:
        t0 = time.perf_counter()
        handle = client.deliver({b"layers": layers}, request_id=request_id, plan=LAYER_PLAN)
        for i in range(LAYERS):
            handle.wait(i, 10)
            kernel(views[i], kwords)
        assert handle.result(10).all_ok
        return time.perf_counter() - t0

    def whole_then_compute() -> float:
        t0 = time.perf_counter()
        assert client.deliver({b"layers": layers}, request_id=request_id).result(10).all_ok
        for i in range(LAYERS):
            kernel(views[i], kwords)
        return time.perf_counter() - t0

    compute = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(LAYERS):
            kernel(views[i], kwords)
        compute.append(time.perf_counter() - t0)
    prog, whole = [], []
    for _ in range(runs):  # interleaved: both see the same machine load
        prog.append(progressive())
        whole.append(whole_then_compute())
    return {"transfer": t_transfer, "compute": statistics.median(compute), "kernel_words": kwords,
            "progressive": summary(prog), "whole": summary(whole),
            "speedup": statistics.median(whole) / statistics.median(prog)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="also print one JSON object with overlap_speedup")
    args = parser.parse_args()
    src = (np.arange(LAYERS * LAYER, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    with process_group("pbench") as (run, procs):
        for name in ("a", "b"):
            procs.append(spawn("-m", "kvcr_node.cli", *node_flags(), "--endpoint", f"ipc://{run}/{name}.sock"))
        a, b = f"ipc://{run}/a.sock", f"ipc://{run}/b.sock"
        with Client(b, name="owner") as owner, Client(a, name="engine") as eng:
            region = owner.register(src)
            spans = [Span(f"L{i}", region, i * LAYER, LAYER, "layer") for i in range(LAYERS)]
            assert owner.deposit({b"layers": spans}).result(30).all_ok
            eng.submit_hint("pipe", b, [b"layers"]).result(5)
            results = {}
            for where, client, rid in (("across nodes", eng, "pipe"), ("local", owner, None)):
                dst = np.zeros(LAYERS * LAYER, dtype=np.uint8)
                rd = client.register(dst)
                layers = client.destination([Span(f"L{i}", rd, i * LAYER, LAYER) for i in range(LAYERS)])
                results[where] = measure(client, dst, layers, rid, args.runs)
                if not np.array_equal(dst, src):
                    raise AssertionError(f"delivered bytes differ ({where})")
    print(f"load average {os.getloadavg()[0]:.2f} (cores {os.cpu_count()})")
    for where, r in results.items():
        print(f"{where}: {LAYERS} layers of {LAYER >> 20} MiB, transfer {r['transfer'] * 1e3:.2f} ms, "
              f"compute {r['compute'] * 1e3:.2f} ms (kernel over {r['kernel_words'] * 4 / LAYER:.2f} layers' bytes per layer)")
        print(f"  progressive (compute on layer i once it landed)  {fmt_us(r['progressive'])}")
        print(f"  whole object, then compute                       {fmt_us(r['whole'])}")
        print(f"  overlap_speedup {r['speedup']:.2f}")
    if args.json:
        print(json.dumps({"overlap_speedup": round(results["across nodes"]["speedup"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
