"""vLLM's own ``Scheduler`` driving ``KvcrConnector``'s scheduler side, with no model and no worker.

Run in the vLLM environment as ``python vllm_scheduler_driver.py MODE=ENDPOINT ...``: each
run in turn, in this one process (vLLM is imported once: most of a run's time), each against
its own node; prints one JSON line, each mode's report, for ``test_vllm_scheduler.py`` to
check. ``drive`` records what the scheduler did, step by step (``drive_run``); ``isolation``
drives the connector's scheduler side itself with vLLM's requests that differ only in what
vLLM folds into its block hashes (``isolation_run``); ``disk`` the scheduler with a prompt
whose blocks the node holds only in its disk tier (``disk_run``).

The configuration is what ``EngineArgs`` makes for the tiny Llama of
``examples/vllm_prefix.py`` (CPU platform, chunked prefill with a budget of 64 tokens a
step); the KV cache config is one full-attention group of four layers and ``NUM_BLOCKS``
blocks, as the engine core would hand the scheduler. Requests are hashed block by block as
the engine core hashes them (``request``: vLLM's default hash, ``Request.block_hashes``),
which the connector's keys derive from. The node already holds the first two blocks of the
``loaded`` request's prompt (deposited here under the connector's keys, ``prompt_keys``), so
the scheduler leases them; the ``chunked`` request's prompt is new. Model outputs are made
up (a sampled token per finished prefill) since no model runs: the scheduler only needs
their shape.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcr_client import Client, Span
from kvcr_client.integrations.blocks import Fingerprint
from kvcr_client.integrations.vllm import KvcrConnector, KvcrConnectorMetadata
from kvcr_client.integrations.vllm_common import fingerprint

BLOCK = 32
LAYERS = 4
NUM_BLOCKS = 64
BUDGET = 64
"""Tokens a step: two blocks."""
SLOT = 16384
"""One layer's block: 32 tokens x 2 KV heads x 32 x K and V x 4 bytes."""
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": LAYERS,
    "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
LOADED_PROMPT = [(7 * i + 3) % 500 + 10 for i in range(100)]
CHUNKED_PROMPT = [(11 * i + 5) % 500 + 10 for i in range(200)]


HASH_FN = get_hash_fn_by_name("sha256")
"""vLLM's default ``prefix_caching_hash_algo``: the chain is rooted as the engine core roots it."""
init_none_hash(HASH_FN)


def request(request_id: str, tokens: list[int], params: SamplingParams, **more: Any) -> Request:
    """A request as vLLM's engine core makes it: its block hashes computed (``Request.block_hashes``,
    over the tokens and whatever of ``more`` vLLM folds in: ``lora_request``, ``mm_features``,
    ``cache_salt``)."""
    return Request(request_id, tokens, params, None, block_hasher=get_request_block_hasher(BLOCK, HASH_FN), **more)


def prompt_keys(fp: Fingerprint, tokens: list[int], **more: Any) -> list[bytes]:
    """The connector's key of each full block of ``tokens`` in a request with ``more``: what
    another engine's connector saved them under."""
    return fp.engine_keys(request("keys", tokens, SamplingParams(max_tokens=1), **more).block_hashes)


PATIENT = {"lookup_timeout_s": 30.0, "lookup_wait_s": 30.0}
"""Lookups answered within the call that starts them, so that each step is the same on a loaded
machine (``vllm_sources_driver.py`` drives the "not yet" answers)."""


def scheduler(endpoint: str, extra: dict[str, Any] | None = None, tp: int = 1) -> Scheduler:
    """vLLM's ``Scheduler`` with the connector on node ``endpoint``; ``extra`` adds to (or
    replaces ``PATIENT`` in) its extra config; ``tp`` tensor-parallel ranks (the KV heads split
    among them, as vLLM's workers would describe their caches)."""
    folder = Path(tempfile.mkdtemp(prefix="kvcr-tiny-llama-"))
    atexit.register(shutil.rmtree, folder, True)  # the process's own files go with it
    (folder / "config.json").write_text(json.dumps(CONFIG))
    config = EngineArgs(
        model=str(folder), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        enable_prefix_caching=False, max_model_len=512, block_size=BLOCK, enable_chunked_prefill=True,
        max_num_batched_tokens=BUDGET, max_num_seqs=4,
        kv_transfer_config=KVTransferConfig(kv_connector="KvcrConnector",
                                            kv_connector_module_path="kvcr_client.integrations.vllm",
                                            kv_role="kv_both", kv_load_failure_policy="recompute",
                                            kv_connector_extra_config={"endpoint": endpoint,
                                                                       "model_id": "kvcr-tiny-llama-dummy",
                                                                       **(PATIENT if extra is None else extra)}),
    ).create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    config.parallel_config.tensor_parallel_size = tp
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2 // tp, head_size=32, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)])
    return Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK, log_stats=True)


def deposit_blocks(endpoint: str, keys: list[bytes]) -> None:
    """Put blocks under ``keys`` into the node, as another engine's connector would have."""
    with Client(endpoint, name="driver") as client:
        buf = np.arange(len(keys) * LAYERS * SLOT, dtype=np.uint32).astype(np.uint8)
        region = client.register(buf)
        objects = {key: [Span(f"model.layers.{layer}.self_attn.attn", region, (b * LAYERS + layer) * SLOT, SLOT, "kv")
                         for layer in range(LAYERS)] for b, key in enumerate(keys)}
        results = client.deposit(objects).result(30)
        assert all(r.ok for r in results.values()), results
        client.unregister(region)


def meta_of(out: Any) -> dict[str, Any]:
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvcrConnectorMetadata), type(meta)
    return {kind: [{"request": x.request_id, "keys": [k.hex() for k in x.keys], "block_ids": x.block_ids,
                    "source": x.source, "parents": [p.hex() for p in x.parents]}
                   for x in getattr(meta, kind)] for kind in ("loads", "saves")}


def step(sched: Scheduler, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """One schedule and its made-up model output; what the scheduler and connector did."""
    began = time.perf_counter()
    out = sched.schedule()
    record: dict[str, Any] = {
        "schedule_s": time.perf_counter() - began,
        "new": {r.req_id: {"num_computed_tokens": r.num_computed_tokens} for r in out.scheduled_new_reqs},
        "scheduled": dict(out.num_scheduled_tokens),
        "block_ids": {rid: list(sched.kv_cache_manager.get_block_ids(rid)[0]) for rid in out.num_scheduled_tokens},
        **meta_of(out),
    }
    ids = list(out.num_scheduled_tokens)
    # A token is sampled once a request's prompt is all computed (after this step).
    sampled = [[7] if sched.requests[rid].num_computed_tokens >= len(prompts[rid]) else [] for rid in ids]
    outputs = sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in
                                                                                               enumerate(ids)},
                                                              sampled_token_ids=sampled))
    finished = {}
    stats = None
    for eco in outputs.values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                finished[o.request_id] = o.kv_transfer_params
        if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
            stats = eco.scheduler_stats.kv_connector_stats
    record["finished"] = finished
    record["kv_connector_stats"] = stats
    return record


def image(identifier: str, offset: int, length: int = 20) -> MultiModalFeatureSpec:
    """An image in the prompt at ``offset`` as vLLM's input processor describes it to the
    engine core (its data already cached: only the hash it is identified by matters here)."""
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


IMAGE_TOKEN = 99
"""The placeholder an image's positions hold in the prompt: the same ids whatever the image."""
ISOLATION_PROMPT = [IMAGE_TOKEN if 40 <= i < 60 or i < 20 else (13 * i + 7) % 500 + 10 for i in range(100)]
"""Three full blocks of 32 (and 4 tokens); placeholders at 0-19 and 40-59, where the images go."""
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "salt_x": {"cache_salt": "x"},
    "salt_y": {"cache_salt": "y"},
    "lora_a": {"lora_request": LoRARequest("a", 1, "/adapters/a")},
    "lora_a_moved": {"lora_request": LoRARequest("a", 1, "/adapters/a-v2")},
    "lora_b": {"lora_request": LoRARequest("b", 2, "/adapters/b")},
    "image_1": {"mm_features": [image("image-1", 0)]},
    "image_2": {"mm_features": [image("image-2", 0)]},
    "image_1_late": {"mm_features": [image("image-1", 40)]},
    "image_2_late": {"mm_features": [image("image-2", 40)]},
}
"""One prompt, asked with what vLLM folds into its block hashes besides the tokens: a cache
salt, a LoRA adapter (its name and path), an image (its hash, at the prompt's start, or from
token 40: in the second block, so that the first block's KV does not depend on it)."""


def isolation_run(endpoint: str) -> dict[str, Any]:
    """The connector's scheduler side with ``VARIANTS``' requests, made and hashed as vLLM's
    engine core makes them: the keys each request's blocks are saved under (its allocation
    and the step's metadata; the scheduler's output is a stand-in with the fields the
    connector reads), then the tokens a fresh request of each variant matches when the node
    holds the plain request's blocks only, and when it holds every variant's (with the keys it
    loads)."""
    sched = scheduler(endpoint)
    connector = sched.connector
    assert isinstance(connector, KvcrConnector), type(connector)
    side = connector.connector_scheduler
    fp = side.settings.fingerprint
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],))
    counter = iter(range(1_000_000))

    def fresh(name: str) -> Request:
        return request(f"{name}-{next(counter)}", ISOLATION_PROMPT, SamplingParams(max_tokens=1), **VARIANTS[name])

    def saved_keys(name: str) -> tuple[list[bytes], bool]:
        req = fresh(name)
        side.update_state_after_alloc(req, blocks, 0)
        new = SimpleNamespace(req_id=req.request_id, block_ids=([1, 2, 3, 4],), num_computed_tokens=0,
                              prompt_token_ids=ISOLATION_PROMPT)
        output = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={req.request_id: len(ISOLATION_PROMPT)},
                                 scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                       num_computed_tokens=[], resumed_req_ids=set()))
        meta = side.build_connector_meta(output)
        side.request_finished(req, [])
        keys = [k for save in meta.saves for k in save.keys]
        return keys, keys == fp.engine_keys(req.block_hashes)

    def lookups() -> dict[str, dict[str, Any]]:
        found = {}
        for name in VARIANTS:
            req = fresh(name)
            matched, _ = side.get_num_new_matched_tokens(req, 0)
            side.update_state_after_alloc(req, blocks, matched or 0)
            meta = side.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                             scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
            found[name] = {"matched": matched, "loads": [k.hex() for load in meta.loads for k in load.keys]}
            side.request_finished(req, [])
        return found

    keys, from_hashes = {}, {}
    for name in VARIANTS:
        keys[name], from_hashes[name] = saved_keys(name)
    report: dict[str, Any] = {"keys": {n: [k.hex() for k in ks] for n, ks in keys.items()},
                              "keys_from_vllm_hashes": from_hashes}
    deposit_blocks(endpoint, fp.all_slices(keys["plain"]))
    report["plain_held"] = lookups()
    others = dict.fromkeys(k for ks in keys.values() for k in ks if k not in keys["plain"])  # a key once
    deposit_blocks(endpoint, fp.all_slices(list(others)))
    report["all_held"] = lookups()
    report["settings"] = settings_run(sched)
    sched.shutdown()
    return report


def settings_run(sched: Scheduler) -> dict[str, Any]:
    """What the connector makes of vLLM's settings that decide keys: the hash algorithm and its
    seed (a connector made with each; the error where refused), quantization and revision (the
    fingerprint's salt)."""

    def changed(cache: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> Any:
        config = copy.deepcopy(sched.vllm_config)
        for name, value in (cache or {}).items():
            setattr(config.cache_config, name, value)
        for name, value in (model or {}).items():
            setattr(config.model_config, name, value)
        return config

    def made(config: Any, seed: str | None) -> str:
        original = os.environ.pop("PYTHONHASHSEED", None)
        if seed is not None:
            os.environ["PYTHONHASHSEED"] = seed
        try:
            connector = KvcrConnector(config, KVConnectorRole.SCHEDULER, sched.kv_cache_config)
        except ValueError as exc:
            return f"refused: {exc}"
        finally:
            os.environ.pop("PYTHONHASHSEED", None)
            if original is not None:
                os.environ["PYTHONHASHSEED"] = original
        scheme = connector.connector_scheduler.settings.block_hashes
        connector.shutdown()
        return scheme

    salt = fingerprint(sched.vllm_config, sched.kv_cache_config).salt
    return {
        "schemes": {f"{algo}/{seed or 'unset'}": made(changed({"prefix_caching_hash_algo": algo}), seed)
                    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor") for seed in (None, "7")},
        "salt_changes": {name: fingerprint(changed(model={name: value}), sched.kv_cache_config).salt != salt
                         for name, value in (("quantization", "fp8"), ("revision", "0123abc"))},
    }


DISK_WAIT_S = 60.0
"""How long the node may take to copy blocks to its disk tier, or the driver to evict them from memory."""
FILLER_BLOCKS = 4
"""Blocks deposited over the loaded ones, one at a time: as many slots as the test's memory pool has."""


def until(done: Any, what: str) -> None:
    """Wait, bounded, until ``done()``."""
    deadline = time.monotonic() + DISK_WAIT_S
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def disk_run(endpoint: str) -> dict[str, Any]:
    """The ``loaded`` request's first two blocks held only in the node's disk tier, as a node
    restarted on its disk pools holds them: deposited, copied to the tier, then evicted from
    the memory pool by other blocks. The lookup's lease finds them ``PENDING`` (the node reads
    them back), the scheduler answers "not yet" and leases again next step, and vLLM schedules
    the request with both blocks matched. Every step until then is recorded."""
    sched = scheduler(endpoint, {"lookup_timeout_s": 30.0, "lookup_wait_s": 0.05})
    connector = sched.connector
    assert isinstance(connector, KvcrConnector), type(connector)
    fp = connector.connector_scheduler.settings.fingerprint
    loaded_keys = prompt_keys(fp, LOADED_PROMPT)
    slices = fp.all_slices(loaded_keys[:2])
    deposit_blocks(endpoint, slices)
    with Client(endpoint, name="driver-disk") as client:
        def copied() -> bool:
            tier = client.stats().result(30)["disk_tier"]
            return bool(tier["copies"] >= len(slices) and tier["demoting"] == 0)

        until(copied, "the node did not copy the blocks to its disk tier")
        for i in range(FILLER_BLOCKS):
            deposit_blocks(endpoint, [b"filler-%d" % i])
        until(lambda: all(a.tier == "disk" for a in client.query(slices).result(30).values()),
              "the blocks did not leave the memory pool")
    prompts = {"loaded": LOADED_PROMPT}
    sched.add_request(request("loaded", LOADED_PROMPT, SamplingParams(max_tokens=1, temperature=0.0)))
    steps: list[dict[str, Any]] = []
    deadline = time.monotonic() + DISK_WAIT_S
    while sched.has_unfinished_requests() and time.monotonic() < deadline:
        steps.append(step(sched, prompts))
    report = {"loaded_keys": [k.hex() for k in loaded_keys], "unfinished": sched.has_unfinished_requests(),
              "not_yet_steps": next((i for i, s in enumerate(steps) if s["new"]), None),
              "new": next((s["new"] for s in steps if s["new"]), None),
              "loads": next((s["loads"] for s in steps if s["loads"]), None),
              "stats": [s["kv_connector_stats"] for s in steps if s["kv_connector_stats"]]}
    sched.shutdown()
    return report


def drive_run(endpoint: str) -> dict[str, Any]:
    """The ``loaded`` request, whose first two blocks the node holds, then the ``chunked`` one:
    every step's schedule, loads, saves and stats; vLLM's connector-stats logger's lines."""
    sched = scheduler(endpoint)
    connector = sched.connector
    assert isinstance(connector, KvcrConnector), type(connector)
    fp = connector.connector_scheduler.settings.fingerprint
    loaded_keys = prompt_keys(fp, LOADED_PROMPT)
    chunked_keys = prompt_keys(fp, CHUNKED_PROMPT)
    deposit_blocks(endpoint, fp.all_slices(loaded_keys[:2]))  # one rank: a block's one slice
    prompts = {"loaded": LOADED_PROMPT, "chunked": CHUNKED_PROMPT}
    report: dict[str, Any] = {"loaded_keys": [k.hex() for k in loaded_keys],
                              "chunked_keys": [k.hex() for k in chunked_keys], "steps": []}
    sched.add_request(request("loaded", LOADED_PROMPT, SamplingParams(max_tokens=2, temperature=0.0)))
    steps = report["steps"]
    while sched.has_unfinished_requests() and len(steps) < 8:
        steps.append(step(sched, prompts))
    sched.add_request(request("chunked", CHUNKED_PROMPT, SamplingParams(max_tokens=1, temperature=0.0)))
    while sched.has_unfinished_requests() and len(steps) < 16:
        steps.append(step(sched, prompts))
    report["unfinished"] = sched.has_unfinished_requests()
    # vLLM's logger for connector stats, fed what SchedulerStats carried (twice: two steps'
    # worth), rebuilds them with build_kv_connector_stats, aggregates and reduces them.
    logging = KVConnectorLogging(sched.vllm_config.kv_transfer_config)
    carried = [s["kv_connector_stats"] for s in steps if s["kv_connector_stats"]]
    for stats in carried * 2:
        logging.observe(stats)
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    report["logged"] = lines
    sched.shutdown()
    return report


RUNS = {"drive": drive_run, "isolation": isolation_run, "disk": disk_run}


def main() -> int:
    runs = [arg.split("=", 1) for arg in sys.argv[1:]]
    if not runs or any(len(run) != 2 or run[0] not in RUNS for run in runs):
        raise SystemExit(f"usage: vllm_scheduler_driver.py MODE=ENDPOINT ... (MODE: {', '.join(RUNS)})")
    print(json.dumps({mode: RUNS[mode](endpoint) for mode, endpoint in runs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
