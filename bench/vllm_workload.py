"""vLLM under a shared-prefix workload with a node too small for it: hit rate against LRU.

Two vLLM OpenAI servers (SmolLM2-135M-Instruct, real weights, vLLM's own prefix cache off,
as ``bench/vllm_ttft.py`` starts them) share one node whose pool holds ``--pool-blocks``
blocks, fewer than the workload's working set. The trace: ``--requests`` prompts, each a
shared prefix (``--prefixes`` of them, 8 blocks of 32 tokens, drawn with Zipf-like
popularity, exponent ``--zipf``) and a suffix of its own, sent one at a time to server A or
B at random (seeded). Each request starts with both servers idle (``vllm_ttft.Idle``).

Measured:

- ``hit_rate``: the blocks the connectors loaded (``blocks_loaded`` over both servers) over
  the blocks a lookup may ask for (a prompt's full blocks, its last token always computed);
- ``hit_rate_lru``: what an exact LRU of the pool's size gets on the same trace (a lookup
  touches the leading blocks it finds, stopping at the first missing one; the request's
  full prompt blocks are then saved, evicting the least recently used), and
  ``hit_rate_vs_lru``, the node's hits over the simulation's: how close the node's own
  policy, leases and saves come to the ideal of that size;
- ``hit_rate_unbounded``: the same simulation with no bound (every block seen before hits);
- ``ttft_p50_ms``, ``ttft_p99_ms`` with kvcr, and ``ttft_p50_ms_without``,
  ``ttft_p99_ms_without`` for the same trace on two servers without the connector (started
  after the first two stop);
- ``load_failures``: ``blocks_failed`` and ``load_errors`` over both servers (must be 0: a
  block evicted under pressure is a miss at lookup, never a failed load), and
  ``outputs_identical``: each request's text with kvcr equals its text without.

Run: ``python bench/vllm_workload.py [--requests 200] [--json]`` (about 13 minutes on two
cores: four servers start, each trace runs once, every request waits for both servers to
go idle first). ``--json`` prints one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import process_group, spawn
from vllm_ttft import BLOCK, PORTS, Idle, Server, prepared

SLOT = "48KiB"
"""One layer's block of SmolLM2-135M (``vllm_ttft.SLOT``)."""
LAYERS = 30
"""SmolLM2-135M's layers: a block is one object of 30 slots, one per layer."""
PREFIX_BLOCKS = 8
SUFFIX_TOKENS = (8, 56)
"""A request's own tokens after its prefix: between these, so some requests fill one block more."""
MAX_TOKENS = 1


def node_flags(endpoint: str, blocks: int) -> list[str]:
    return ["-m", "kvcr_node.cli", "--pool", f"kv:{SLOT}:{blocks * LAYERS}", "--endpoint", endpoint,
            "--log-level", "WARNING", "--policy", "lru", "--lease-pool-fraction", "1", "--lease-session-fraction", "1"]


def trace(requests: int, prefixes: int, zipf: float, seed: int) -> list[tuple[int, list[int]]]:
    """(server index, prompt tokens) per request: a Zipf-like choice of prefix, a suffix of its own."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** zipf for rank in range(prefixes)]
    heads = [[100 + (7919 * p + 31 * i + (i * i) % 101) % 48000 for i in range(PREFIX_BLOCKS * BLOCK)]
             for p in range(prefixes)]
    out = []
    for r in range(requests):
        head = heads[rng.choices(range(prefixes), weights)[0]]
        tail = [100 + (104729 * (r + 1) + 17 * i) % 48000 for i in range(rng.randint(*SUFFIX_TOKENS))]
        out.append((rng.randrange(2), head + tail))
    return out


def block_ids(tokens: list[int]) -> list[tuple[int, ...]]:
    """A prompt's full blocks as chain keys: each names every token up to its end (as vLLM's hashes do)."""
    return [tuple(tokens[: (b + 1) * BLOCK]) for b in range(len(tokens) // BLOCK)]


def simulate(prompts: list[list[int]], capacity: int | None) -> tuple[int, int]:
    """Hits and lookup-able blocks of an exact LRU of ``capacity`` blocks (None: unbounded)."""
    held: collections.OrderedDict[tuple[int, ...], None] = collections.OrderedDict()
    hits = asked = 0
    for tokens in prompts:
        keys = block_ids(tokens)
        looked = keys[: (len(tokens) - 1) // BLOCK]
        asked += len(looked)
        for key in looked:
            if key not in held:
                break
            hits += 1
            held.move_to_end(key)
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
            while capacity is not None and len(held) > capacity:
                held.popitem(last=False)
    return hits, asked


COUNTED = ("blocks_loaded", "blocks_failed", "load_errors", "blocks_saved")


def run(servers: list[Server], work: list[tuple[int, list[int]]], counted: bool) -> tuple[list[float], list[str],
                                                                                          dict[str, float]]:
    idle = Idle(servers)
    for server in servers:
        server.ready()
    before = {n: sum(s.counter(n) for s in servers) for n in COUNTED} if counted else {}
    times, texts = [], []
    for i, (which, tokens) in enumerate(work):
        idle()
        seconds, text = servers[which].ttft(tokens, MAX_TOKENS)
        times.append(seconds)
        texts.append(text)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1} requests", file=sys.stderr, flush=True)
    counts = {n: sum(s.counter(n) for s in servers) - before[n] for n in COUNTED} if counted else {}
    counts["idle_waits_over"] = idle.over
    return times, texts, counts


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prefixes", type=int, default=24)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool-blocks", type=int, default=64, help="the node's pool, in blocks (30 slots each)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, help="SmolLM2's folder (default: the engines environment's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    vllm_python, model_dir = prepared(args.model_dir)
    work = trace(args.requests, args.prefixes, args.zipf, args.seed)
    prompts = [tokens for _, tokens in work]

    def serve(node: str | None, logs: Path) -> tuple[list[float], list[str], dict[str, float]]:
        """The trace on two servers (with the connector at ``node``, or without one)."""
        servers = [Server(vllm_python, model_dir, port, node, logs.with_name(f"{logs.name}{i}.log"))
                   for i, port in enumerate(PORTS)]
        try:
            print(f"{'with' if node else 'without'} kvcr: {len(work)} requests", file=sys.stderr, flush=True)
            return run(servers, work, node is not None)
        finally:
            for server in servers:
                server.close()

    with process_group("vllm-workload") as (folder, procs):
        endpoint = f"ipc://{folder}/node.sock"
        procs.append(spawn(*node_flags(endpoint, args.pool_blocks)))
        with_kvcr, texts, counts = serve(endpoint, folder / "kvcr")
        without, plain_texts, plain_counts = serve(None, folder / "plain")
    lru_hits, asked = simulate(prompts, args.pool_blocks)
    all_hits, _ = simulate(prompts, None)
    loaded = counts["blocks_loaded"]
    figures: dict[str, Any] = {
        "hit_rate": loaded / asked,
        "hit_rate_lru": lru_hits / asked,
        "hit_rate_vs_lru": loaded / lru_hits if lru_hits else 0.0,
        "hit_rate_unbounded": all_hits / asked,
        "ttft_p50_ms": statistics.median(with_kvcr) * 1e3,
        "ttft_p99_ms": p99(with_kvcr) * 1e3,
        "ttft_p50_ms_without": statistics.median(without) * 1e3,
        "ttft_p99_ms_without": p99(without) * 1e3,
        "load_failures": counts["blocks_failed"] + counts["load_errors"],
        "blocks_saved": counts["blocks_saved"],
        "outputs_identical": texts == plain_texts,
        "idle_waits_over": counts["idle_waits_over"] + plain_counts["idle_waits_over"],
    }
    print(f"load average {os.getloadavg()[0]:.2f} (cores {os.cpu_count()}); {len(work)} requests over {args.prefixes} "
          f"prefixes of {PREFIX_BLOCKS} blocks (Zipf {args.zipf}), two servers, a pool of {args.pool_blocks} blocks")
    print(f"  blocks a lookup may ask for {asked}; loaded from kvcr {loaded:.0f}: hit rate {figures['hit_rate']:.3f}")
    print(f"  exact LRU of {args.pool_blocks} blocks {figures['hit_rate_lru']:.3f} (node / LRU "
          f"{figures['hit_rate_vs_lru']:.2f}); unbounded {figures['hit_rate_unbounded']:.3f}")
    print(f"  TTFT with kvcr p50 {figures['ttft_p50_ms']:.0f} ms p99 {figures['ttft_p99_ms']:.0f} ms; without p50 "
          f"{figures['ttft_p50_ms_without']:.0f} ms p99 {figures['ttft_p99_ms_without']:.0f} ms")
    print(f"  load failures {figures['load_failures']:.0f}; outputs identical {figures['outputs_identical']}; "
          f"requests begun with a server still busy {figures['idle_waits_over']}")
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0 if figures["load_failures"] == 0 and figures["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
