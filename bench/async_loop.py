"""How long an event loop running an ``AsyncClient`` stalls: puts and delivers, awaited.

An engine's event loop serves requests while it stores and loads KV cache; a call that
blocks the loop (waiting for a reply, or a transfer) delays every request it serves. A
ticker task sleeps ``TICK_S`` at a time and records how late each wake-up is; meanwhile the
loop puts 1 MiB objects (16 spans of 64 KiB, under a write grant) and delivers each back,
awaiting each. The anchor, in the same run: the same ticker while the loop awaits a plain
``asyncio.sleep`` for as long (what the loop and the machine cost by themselves).

Once connected, the process freezes its heap for the cyclic collector, as a serving engine
does after start-up (vLLM's engine core calls ``gc.freeze()`` there): a full collection then
looks only at what serving made, not at every object the imports made. Without that (``--no-freeze``)
one full collection of this process costs 5-14 ms here, whatever the loop does, and shows
up as the longest stall; ``async_loop_gc_ms_max`` reports the longest collection either way.

    uv run python bench/async_loop.py [--rounds 1000] [--spans 16] [--no-freeze] [--json]

``--spans`` sets the object's size in 64 KiB spans (16: 1 MiB, the figure's goal is for that;
256: 16 MiB, where a copy run on the loop's thread shows, as a put's WRITE posted there did).

``--json`` prints one object: ``async_loop_stall_ms_max`` (the latest wake-up during the
puts and delivers; the goal is <= 2), ``async_loop_stall_ms_p99``, the anchor's
``async_loop_stall_ms_max_idle`` and ``async_loop_stall_ms_p99_idle``, ``async_loop_gc_ms_max``,
``gc_frozen``, ``rounds_per_s`` and ``object_mib``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from buffers import aligned
from procs import process_group, spawn

from kvcr_client import AsyncClient, Span

SPAN = 64 * 1024
SPANS = 16
TICK_S = 0.0005


class Collections:
    """The cyclic collector's pauses while it is attached (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._started)

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def ticking(work: Callable[[], Awaitable[None]]) -> list[float]:
    """Run ``work`` with the ticker alongside: how late (s) each of its wake-ups was."""
    late: list[float] = []
    done = False

    async def ticker() -> None:
        clock = time.perf_counter
        while not done:
            t0 = clock()
            await asyncio.sleep(TICK_S)
            late.append(clock() - t0 - TICK_S)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        await work()
    finally:
        done = True
        await task
    return late


async def measure(endpoint: str, rounds: int, spans: int, freeze: bool) -> dict[str, float]:
    size = SPAN * spans
    src = aligned(size)
    src[:] = (np.arange(size, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) | 1
    dst = aligned(size)
    async with await AsyncClient.connect(endpoint, name="bench-loop") as client:
        rs, rd = await client.register(src), await client.register(dst)
        sources = [Span(f"L{i}", rs, i * SPAN, SPAN, "kv") for i in range(spans)]
        dests = [Span(f"L{i}", rd, i * SPAN, SPAN) for i in range(spans)]
        puts_before = client.counters()["puts"]
        if freeze:  # started up: what serving makes is what the collector looks at
            gc.collect()
            gc.freeze()

        async def store_and_load() -> None:
            for i in range(rounds):
                key = b"loop%d" % i
                res = await client.put({key: sources})
                assert res[key].ok, res
                got = await client.deliver({key: dests})
                assert got[key].ok, got

        t0 = time.perf_counter()
        with Collections() as collections:
            busy = await ticking(store_and_load)
        elapsed = time.perf_counter() - t0
        if client.counters()["puts"] != puts_before + rounds:
            raise AssertionError("a put went to the node as a deposit (client_transfers off?)")
        if not np.array_equal(src, dst):
            raise AssertionError("the bytes delivered back differ from those put")

        async def idle() -> None:
            await asyncio.sleep(elapsed)

        quiet = await ticking(idle)
    gc.unfreeze()
    return {
        "async_loop_stall_ms_max": max(busy) * 1e3,
        "async_loop_stall_ms_p99": float(np.percentile(busy, 99)) * 1e3,
        "async_loop_stall_ms_max_idle": max(quiet) * 1e3,
        "async_loop_stall_ms_p99_idle": float(np.percentile(quiet, 99)) * 1e3,
        "async_loop_gc_ms_max": collections.longest * 1e3,
        "gc_frozen": float(freeze),
        "rounds_per_s": rounds / elapsed,
        "object_mib": size / (1 << 20),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1000, help="puts, each delivered back")
    parser.add_argument("--spans", type=int, default=SPANS, help="the object's 64 KiB spans (16: 1 MiB)")
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave the start-up heap to the cyclic collector (no gc.freeze())")
    parser.add_argument("--json", action="store_true", help="also print one JSON object of the figures")
    args = parser.parse_args()
    pools = ["--pool", f"kv:64KiB:{max(4096, 8 * args.spans)}", "--log-level", "WARNING", "--policy", "fifo"]
    with process_group("loop") as (run, procs):
        procs.append(spawn("-m", "kvcr_node.cli", "--endpoint", f"ipc://{run}/node.sock", *pools))
        figures = asyncio.run(measure(f"ipc://{run}/node.sock", args.rounds, args.spans, not args.no_freeze))
    print(f"{args.rounds} puts of {figures['object_mib']:g} MiB, each delivered back, awaited on one event loop "
          f"({figures['rounds_per_s']:.0f} rounds/s)")
    print(f"  loop wake-ups late by: max {figures['async_loop_stall_ms_max']:.2f} ms (goal <= 2), "
          f"p99 {figures['async_loop_stall_ms_p99']:.2f} ms")
    print(f"  the same loop idle:    max {figures['async_loop_stall_ms_max_idle']:.2f} ms, "
          f"p99 {figures['async_loop_stall_ms_p99_idle']:.2f} ms")
    print(f"  longest collection:    {figures['async_loop_gc_ms_max']:.2f} ms "
          f"({'heap frozen after start-up' if args.no_freeze is False else 'start-up heap not frozen'})")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
