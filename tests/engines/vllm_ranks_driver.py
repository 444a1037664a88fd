"""Two tensor-parallel ranks' worker sides and vLLM's own ``Scheduler``, in one process.

Run in the vLLM environment as ``python vllm_ranks_driver.py ENDPOINT SMALL``; prints one
JSON line for ``test_vllm_ranks.py``. ENDPOINT's node has room; SMALL's pool holds the slices
of three blocks only.

The scheduler is configured for tensor parallel 2 (``vllm_scheduler_driver.scheduler``: each
rank's cache holds one of the two KV heads); the two ``KvcrWorker`` are ranks 0 and 1, each
with a cache of its own whose every block has bytes of its rank's (``fill``). Each step the
scheduler's metadata goes to both workers, as vLLM's executor hands it to every rank. A
prompt is saved, the caches are wiped, and the same prompt again is loaded: each rank's
blocks are digested as saved and as loaded. Then blocks of which the node holds only some
ranks' slices are looked up. Last, on SMALL: a prompt saved, another that evicts it, the
first again (saved again: the node no longer holds it), and the first once more (loaded).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm_scheduler_driver import BLOCK, LAYERS, NUM_BLOCKS, prompt_keys, request, scheduler

from kvcr_client import Client, Span
from kvcr_client.integrations.vllm import KvcrConnectorMetadata, KvcrWorker
from kvcr_client.integrations.vllm_common import Settings

TP = 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SLICE = 8192
"""One layer's block of one rank: 32 tokens x 1 KV head x 32 x K and V x 4 bytes (a pool slot)."""


def deposit(endpoint: str, keys: list[bytes]) -> None:
    """Store slices under ``keys`` as a rank's connector would (one span a layer)."""
    with Client(endpoint, name="ranks-driver") as client:
        buf = np.full(len(keys) * LAYERS * SLICE, 7, dtype=np.uint8)
        region = client.register(buf)
        objects = {
            key: [
                Span(name, region, (b * LAYERS + layer) * SLICE, SLICE, "kv") for layer, name in enumerate(LAYER_NAMES)
            ]
            for b, key in enumerate(keys)
        }
        results = client.deposit(objects).result(30)
        assert all(r.ok for r in results.values()), results
        client.unregister(region)


def prompt(i: int) -> list[int]:
    """100 tokens: three full blocks beyond the token that is always computed."""
    return [(13 * j + 5 + 29 * i) % 500 + 10 for j in range(100)]


def fill(caches: dict[str, torch.Tensor], rank: int, salt: int) -> None:
    """Every block of every layer gets bytes of its own, and of this rank's."""
    for layer, name in enumerate(LAYER_NAMES):
        flat = caches[name].view(torch.uint8).reshape(NUM_BLOCKS, -1).numpy()
        size = flat.shape[1]
        for block in range(NUM_BLOCKS):
            flat[block] = (
                (np.arange(size, dtype=np.uint32) * (3 + rank) + block * 31 + layer * 101 + rank * 57 + salt * 13) % 251
            ).astype(np.uint8)


def digest(caches: dict[str, torch.Tensor], block: int) -> str:
    h = hashlib.sha256()
    for name in LAYER_NAMES:
        h.update(caches[name][block].view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()


class Ranks:
    """A TP=2 scheduler and its two ranks' worker sides."""

    def __init__(self, endpoint: str) -> None:
        self.sched: Scheduler = scheduler(endpoint, tp=TP)
        settings = Settings.read(self.sched.vllm_config, self.sched.kv_cache_config)
        self.fingerprint = settings.fingerprint
        self.workers = [KvcrWorker(settings, self.sched.kv_cache_config, rank=r) for r in range(TP)]
        self.caches = [
            {name: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2 // TP, 32, dtype=torch.float32) for name in LAYER_NAMES}
            for _ in range(TP)
        ]
        for worker, caches in zip(self.workers, self.caches, strict=True):
            worker.register_kv_caches(caches)
        self.count = 0

    def serve(self, tokens: list[int]) -> dict[str, Any]:
        """One request to its end: tokens matched, and per rank the digests of blocks saved and loaded."""
        self.count += 1
        rid = f"r{self.count}"
        self.sched.add_request(request(rid, tokens, SamplingParams(max_tokens=1, temperature=0.0)))
        out: dict[str, Any] = {
            "matched": 0,
            "saved": [{} for _ in range(TP)],
            "loaded": [{} for _ in range(TP)],
            "failed": [[] for _ in range(TP)],
        }
        for _ in range(20):
            if not self.sched.has_unfinished_requests():
                break
            so = self.sched.schedule()
            for new in so.scheduled_new_reqs:
                out["matched"] = new.num_computed_tokens
            meta = so.kv_connector_metadata
            assert isinstance(meta, KvcrConnectorMetadata), type(meta)
            for r, worker in enumerate(self.workers):
                worker.start_load_kv(meta)
                for name in LAYER_NAMES:
                    worker.wait_for_layer_load(name)
                out["failed"][r] += sorted(worker.get_block_ids_with_load_errors())
                for load in meta.loads:
                    for key, block in zip(load.keys, load.block_ids, strict=True):
                        out["loaded"][r][key.hex()] = digest(self.caches[r], block)
                worker.wait_for_save(meta)
                assert worker.settle_saves(30.0)  # committed before the next step looks the blocks up
                for save in meta.saves:
                    for key, block in zip(save.keys, save.block_ids, strict=True):
                        out["saved"][r][key.hex()] = digest(self.caches[r], block)
            ids = list(so.num_scheduled_tokens)
            # A token is sampled once a request's prompt is all computed (after this step).
            sampled = [[7] if self.sched.requests[i].num_computed_tokens >= len(tokens) else [] for i in ids]
            self.sched.update_from_output(
                so,
                ModelRunnerOutput(
                    req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
                ),
            )
        out["unfinished"] = self.sched.has_unfinished_requests()
        return out

    def stats(self) -> list[dict[str, int]]:
        assert all(w.settle_saves(30.0) for w in self.workers)  # the last saves' commits, counted
        taken = [w.counts.take() for w in self.workers]
        return [s.data if s is not None else {} for s in taken]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.sched.shutdown()


def ranks_run(endpoint: str) -> dict[str, Any]:
    ranks = Ranks(endpoint)
    fp = ranks.fingerprint
    report: dict[str, Any] = {"tp_size": fp.tp_size, "kv_layout": fp.kv_layout}
    for r, caches in enumerate(ranks.caches):
        fill(caches, r, 0)
    report["save"] = ranks.serve(prompt(0))
    for r, caches in enumerate(ranks.caches):
        fill(caches, r, 1)  # the cache is reused: nothing of the saved bytes is left in it
    report["load"] = ranks.serve(prompt(0))
    # Block 0 of prompt 1: both ranks' slices; block 1: rank 0's only; block 2: both.
    keys = prompt_keys(fp, prompt(1)[:-1])
    deposit(
        endpoint,
        [
            fp.slice_key(keys[0], 0),
            fp.slice_key(keys[0], 1),
            fp.slice_key(keys[1], 0),
            fp.slice_key(keys[2], 0),
            fp.slice_key(keys[2], 1),
        ],
    )
    report["partial"] = ranks.serve(prompt(1))["matched"]
    # Prompt 2: rank 1's slices only.
    deposit(endpoint, [fp.slice_key(k, 1) for k in prompt_keys(fp, prompt(2)[:-1])])
    report["rank1_only"] = ranks.serve(prompt(2))["matched"]
    report["stats"] = ranks.stats()
    ranks.close()
    return report


def evict_run(small: str) -> dict[str, Any]:
    ranks = Ranks(small)
    runs = []
    for i in (10, 11, 10, 10):
        for r, caches in enumerate(ranks.caches):
            fill(caches, r, len(runs))
        runs.append(ranks.serve(prompt(i)))
    report = {"runs": runs, "stats": ranks.stats()}
    ranks.close()
    return report


def main() -> int:
    endpoint, small = sys.argv[1:3]
    report = {"ranks": ranks_run(endpoint), "evict": evict_run(small)}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
