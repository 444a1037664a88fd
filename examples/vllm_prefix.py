"""vLLM with the kvcr connector: the second run of a prompt loads its prefix's KV from kvcr.

A tiny Llama with seeded random weights (``tiny_llama``: safetensors, float32, eager) generates greedily
for a prompt, saving its full blocks into the node through ``KvcrConnector``; a second
generation of the same prompt (prefix caching off, so vLLM itself remembers nothing)
leases the blocks, loads them layer by layer (``wait_for_layer_load`` per layer), computes
only the last token and must produce the same tokens and logprobs. With ``--source``, the
engine asks its own node for blocks another node holds: run ``save`` against node B in
one process, then ``load`` against node A with ``--source`` B in another.

    .venv-vllm/bin/python examples/vllm_prefix.py both --node ipc:///tmp/b.sock
    .venv-vllm/bin/python examples/vllm_prefix.py save --node ipc:///tmp/b.sock --out /tmp/ref.json
    .venv-vllm/bin/python examples/vllm_prefix.py load --node ipc:///tmp/a.sock --source ipc:///tmp/b.sock \\
        --reference /tmp/ref.json

``--prompt-tokens`` longer than ``--max-batched-tokens`` makes vLLM prefill in chunks: every
full block of every chunk is saved. ``--layers`` changes the model's depth under the same
model id: an engine whose layout differs from the saver's fails to load the blocks it
leased, and vLLM recomputes them (``kv_load_failure_policy="recompute"``).

``--connector module.Class`` loads a subclass of the connector instead (the tests load one
that kills the source node after its lease), ``--extra JSON`` adds to its extra config.

Each block's bytes in vLLM's cache are hashed as saved and as loaded by the connector's
block observer, ``vllm_digests.BlockDigests`` (beside this file), named in its extra config.

The counts reported are vLLM's own: the connectors' ``KvcrConnectorStats``, aggregated by
vLLM each step and read back from its Prometheus counters (``LLM.get_metrics``).

The node needs a pool whose slot is one layer's block: 32 tokens x 2 KV heads x 32 x K
and V x 4 bytes = 16 KiB here (``--pool kv:16KiB:2048``). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its connector's counts are ours
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm.v1.metrics.reader import Counter
from vllm_digests import BlockDigests

from kvcr_client.integrations import vllm as kvcr_vllm

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4, "vocab_size": 512,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False,
}
WEIGHT_SEED = 0
INIT_STD = 0.2
"""The weights' spread: wide enough that each next token wins by a clear margin."""
PROMPT_TOKENS = 100
"""By default three full blocks of 32 go through kvcr, the rest is computed."""


def prompt(tokens: int) -> list[int]:
    return [(7 * i + 3) % 500 + 10 for i in range(tokens)]


def tiny_llama(layers: int) -> Path:
    """A folder with the tiny Llama of ``CONFIG`` at depth ``layers``, its weights random but
    seeded (``WEIGHT_SEED``) and saved as safetensors: every process that makes it gets the same
    weights, so engines share blocks, and the KV it reads decides what it generates (a wrong
    byte changes the logprobs: ``tests/engines/test_vllm.py`` shows it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="kvcr-tiny-llama-"))
    atexit.register(shutil.rmtree, folder, True)  # the process's own files go with it
    fields = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(WEIGHT_SEED)
    model = LlamaForCausalLM(LlamaConfig(**{**fields, "num_hidden_layers": layers}, initializer_range=INIT_STD))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def engine(node: str, source: str | None, layers: int, max_batched_tokens: int, connector: str,
           more: dict[str, Any], **engine_args: Any) -> LLM:
    """The tiny Llama in vLLM with the connector; ``engine_args`` add to vLLM's (LoRA, say)."""
    folder = tiny_llama(layers)
    # The model's folder differs per process: both engines name the model the same way.
    extra: dict[str, Any] = {"endpoint": node, "pool": "kv", "block_observer": "vllm_digests:BlockDigests",
                             "model_id": "kvcr-tiny-llama-seeded", **more}
    module, _, name = connector.rpartition(".")
    if source:
        extra["source"] = source
    return LLM(
        model=str(folder), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        enable_prefix_caching=False, max_model_len=512, block_size=32, seed=0, disable_log_stats=False,
        enable_chunked_prefill=True, max_num_batched_tokens=max_batched_tokens, max_num_seqs=8,
        kv_transfer_config=KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                            kv_role="kv_both", kv_connector_extra_config=extra,
                                            kv_load_failure_policy="recompute"),
        **engine_args,
    )


def counts(llm: LLM) -> dict[str, int]:
    """The connectors' counts so far, as vLLM exports them (``vllm:kvcr_<name>_total``)."""
    got = {name: 0 for name in kvcr_vllm.COUNTERS}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name.startswith("vllm:kvcr_"):
            got[metric.name.removeprefix("vllm:kvcr_")] += int(metric.value)
    return got


def generate(llm: LLM, tokens: list[int], transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, extra_args={"kv_transfer_params": transfer}
                            if transfer else None)
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0].outputs[0]
    logprobs = [{str(t): float(lp.logprob) for t, lp in sorted(step.items())} for step in (out.logprobs or [])]
    return {"tokens": list(out.token_ids), "logprobs": logprobs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("both", "save", "load"))
    parser.add_argument("--node", required=True)
    parser.add_argument("--source", help="the node that holds the blocks, configured for the engine")
    parser.add_argument("--params-source", help="the node that holds the blocks, named per request in kv_transfer_params")
    parser.add_argument("--out", default="/tmp/kvcr-vllm-reference.json")
    parser.add_argument("--reference", default="/tmp/kvcr-vllm-reference.json")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="the model's depth")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="vLLM's token budget per step")
    parser.add_argument("--connector", default="kvcr_client.integrations.vllm.KvcrConnector",
                        help="the connector class (module.Class), KvcrConnector or a subclass")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    args = parser.parse_args()
    llm = engine(args.node, args.source, args.layers, args.max_batched_tokens, args.connector, json.loads(args.extra))
    tokens = prompt(args.prompt_tokens)
    report: dict[str, Any] = {"role": args.role, "layers": args.layers}
    if args.role in ("both", "save"):
        first = generate(llm, tokens)
        report["first"] = first
        report["saved"] = counts(llm)
        first["digests"] = dict(BlockDigests.saved_digests)
        Path(args.out).write_text(json.dumps(first))
    if args.role in ("both", "load"):
        before = counts(llm)
        second = generate(llm, tokens, {"kvcr_endpoint": args.params_source} if args.params_source else None)
        reference = report.get("first") or json.loads(Path(args.reference).read_text())
        report["second"] = second
        report["same_tokens"] = second["tokens"] == reference["tokens"]
        report["same_logprobs"] = second["logprobs"] == reference["logprobs"]
        loaded = BlockDigests.loaded_digests
        report["blocks_verified"] = sorted(loaded) == sorted(reference["digests"]) and all(
            loaded[k] == reference["digests"][k] for k in loaded)
        # Loaded blocks whose bytes are those the reference computed (some may have failed).
        report["blocks_matching"] = sum(1 for k in loaded if loaded[k] == reference["digests"].get(k))
        report["loaded"] = {k: v - before[k] for k, v in counts(llm).items()}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
