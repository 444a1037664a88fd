"""vLLM's engine (in this process) with ``KvcrConnector``: requests that differ only in what
else decides their KV (a ``cache_salt``, a LoRA adapter) never load each other's blocks.

Run in the vLLM environment as ``python vllm_isolation_driver.py ENDPOINT [CONNECTOR]``
(``module.Class``, ``KvcrConnector`` by default; ``vllm_faults.ExtrasBlind`` keys by tokens
alone); prints one JSON line for ``test_vllm_isolation.py``. The tiny Llama of ``examples/vllm_prefix.py`` with LoRA
on, and two rank-8 adapters of its K and V projections with seeded random weights
(``adapter``), so that each adapter's KV differs from the base model's and from the other's.
One prompt, five ways: plain, ``cache_salt`` "alpha", ``cache_salt`` "beta", adapter 1,
adapter 2. A first pass generates each once: every one finds nothing to load (the others'
blocks are in the node under other keys) and saves its own three blocks. A second pass
generates each again: every one loads its own three blocks, and the tokens and logprobs
are its first pass's. The keys each saved and loaded (the worker's block observer,
``vllm_digests.BlockDigests``) are reported per generation.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1] / "examples"), str(HERE.parent)]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
import vllm_prefix  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm_digests import BlockDigests  # noqa: E402

RANK = 8
EXTRA = {"lookup_timeout_s": 30.0}
"""A lookup answered in time on a loaded machine."""


def adapter(seed: int) -> Path:
    """A PEFT LoRA adapter of the tiny Llama's K and V projections in every layer, its weights
    random but seeded (both A and B, so that it changes the KV from the first layer on)."""
    config = vllm_prefix.CONFIG
    hidden, head_dim = int(config["hidden_size"]), int(config["head_dim"])
    kv_out = int(config["num_key_value_heads"]) * head_dim
    folder = Path(tempfile.mkdtemp(prefix=f"kvcr-tiny-lora-{seed}-"))
    atexit.register(shutil.rmtree, folder, True)  # the process's own files go with it
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv_out, RANK, generator=generator) * 0.2
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["k_proj", "v_proj"], "fan_in_fan_out": False,
        "base_model_name_or_path": "kvcr-tiny-llama-seeded"}))
    return folder


def main() -> int:
    endpoint = sys.argv[1]
    connector = sys.argv[2] if len(sys.argv) > 2 else "kvcr_client.integrations.vllm.KvcrConnector"
    llm = vllm_prefix.engine(endpoint, None, int(vllm_prefix.CONFIG["num_hidden_layers"]), 512, connector, EXTRA,
                             enable_lora=True, max_loras=2, max_lora_rank=RANK)
    loras = {i: LoRARequest(f"tiny-{i}", i, str(adapter(i))) for i in (1, 2)}
    variants: dict[str, tuple[dict[str, Any], LoRARequest | None]] = {
        "plain": ({}, None),
        "salt_alpha": ({"cache_salt": "alpha"}, None),
        "salt_beta": ({"cache_salt": "beta"}, None),
        "lora_1": ({}, loras[1]),
        "lora_2": ({}, loras[2]),
    }
    tokens = vllm_prefix.prompt(vllm_prefix.PROMPT_TOKENS)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    report: dict[str, Any] = {"passes": []}
    for _ in range(2):
        generations = {}
        for name, (options, lora) in variants.items():
            before = vllm_prefix.counts(llm)
            saved = set(BlockDigests.saved_digests)
            BlockDigests.loaded_digests.clear()
            prompt = TokensPrompt(prompt_token_ids=tokens, **options)  # type: ignore[typeddict-item]
            out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0].outputs[0]
            counts = {k: v - before[k] for k, v in vllm_prefix.counts(llm).items() if v != before[k]}
            generations[name] = {
                "tokens": list(out.token_ids),
                "logprobs": [{str(t): float(lp.logprob) for t, lp in sorted(step.items())}
                             for step in (out.logprobs or [])],
                "counts": counts,
                "saved_keys": sorted(set(BlockDigests.saved_digests) - saved),
                "loaded_keys": sorted(BlockDigests.loaded_digests),
                "loaded_match_saved": all(BlockDigests.saved_digests.get(k) == v
                                          for k, v in BlockDigests.loaded_digests.items()),
            }
        report["passes"].append(generations)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
