"""transformers: a prefix's KV cache deposited into kvcr, and delivered back layer by layer.

A prefix is stored as one kvcr object per block of ``block_tokens`` tokens, keyed by a hash
chain over the token ids (``kvcr_client.integrations.blocks``). Each block has two spans per layer,
``L{i}.k`` and ``L{i}.v``, token-major (``[tokens, kv heads, head dim]``) so that a block
of one layer is one contiguous span; a node serving them needs a pool whose slot size is
``block_bytes(config, block_tokens)``.

``deposit_prefix`` stores the full blocks of a ``DynamicCache`` after prefill, with a ``put``
(the client WRITEs them under a write grant, spec section 6.13; a node that grants none
reads them, a plain deposit).
``KvcrCache`` is a ``DynamicCache`` whose first tokens come from kvcr: it starts one
deliver with a layer plan (group i: layer i of every block), and each layer waits for its
own group only when the model first uses it, so layer 0 computes while later layers are
still arriving. The bytes are the deposited ones, so the model computes exactly what it
computed on the original cache.

Read grants (spec section 6.12): lease the keys with the same ``client`` first
(``client.lease(keys)``, which asks a read grant by default) and hold the lease until
``close()``. Where the node grants them, the deliver READs the node's pools with the
client's own agent, layer by layer (``KvcrCache.granted``); where it does not
(``client_transfers = false``, a node below version 5, keys held at a source through a
hint) the node delivers, as before. A layer whose read the lease may not have covered
fails (``LEASE_EXPIRED``, ``LEASE_LOST``): the model's forward raises ``GroupFailed``
rather than read bytes that may be another object's, and the caller computes the prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvcr_client.client import Client, Span
from kvcr_client.integrations.blocks import DEFAULT_BLOCK_TOKENS, block_keys
from kvcr_client.results import DeliverHandle

__all__ = ["DEFAULT_BLOCK_TOKENS", "KvcrCache", "block_bytes", "block_keys", "deposit_prefix"]
WAIT_S = 30.0
"""How long a layer waits for its group by default before its failure is raised."""


def _shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model's text decoder."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim


def block_bytes(config: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one span: one layer's keys (or values) of one block."""
    _, kv_heads, head_dim = _shape(config)
    return int(block_tokens * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size())


def _spans(region: Any, layers: int, blocks: int, block_tokens: int, span: int, pool: str) -> list[list[Span]]:
    """Per block, its spans in a ``[layers, 2, tokens, kv heads, head dim]`` buffer."""
    tokens = blocks * block_tokens
    per_token = span // block_tokens
    out: list[list[Span]] = []
    for b in range(blocks):
        spans = []
        for i in range(layers):
            for j, part in enumerate(("k", "v")):
                offset = ((i * 2 + j) * tokens + b * block_tokens) * per_token
                spans.append(Span(f"L{i}.{part}", region, offset, span, pool))
        out.append(spans)
    return out


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a flat numpy array sharing its memory."""
    return tensor.view(torch.uint8).reshape(-1).numpy()


def deposit_prefix(
    client: Client, cache: DynamicCache, token_ids: Sequence[int], config: Any, *, pool: str,
    block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: bytes = b"", timeout: float = WAIT_S,
) -> list[bytes]:
    """Store the full blocks of ``cache`` (the KV of ``token_ids`` after prefill) in the node
    of ``client``; returns their keys, in order. A block the node holds already is fine."""
    layers, _, _ = _shape(config)
    keys = block_keys(token_ids, block_tokens, salt)
    if not keys:
        return keys
    tokens = len(keys) * block_tokens
    stacked = torch.stack([
        torch.stack([layer.keys[0, :, :tokens].permute(1, 0, 2), layer.values[0, :, :tokens].permute(1, 0, 2)])
        for layer in cache.layers[:layers]
    ]).contiguous()
    span = block_bytes(config, block_tokens, stacked.dtype)
    region = client.register(_bytes_of(stacked))
    try:
        spans = _spans(region, layers, len(keys), block_tokens, span, pool)
        # Block b's parent is block b-1 (spec section 6.4, "Parents"): a router builds the prefix tree from it.
        parents = {keys[b]: keys[b - 1] for b in range(1, len(keys))}
        results = client.put(dict(zip(keys, spans, strict=True)), parents=parents).result(timeout)
        failed = [(k.hex()[:12], r) for k, r in results.items() if not r.ok]
        if failed:
            raise RuntimeError(f"kvcr refused {len(failed)} blocks, the first {failed[0]}")
    finally:
        client.unregister(region)
    return keys


class _DeliveredLayer(DynamicLayer):  # type: ignore[misc]
    """A layer whose first ``prefix_tokens`` arrive from kvcr; it waits for them on first use."""

    def __init__(self, owner: KvcrCache, index: int, prefix_tokens: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.prefix_tokens = prefix_tokens
        self.arrived = False

    def _arrive(self, like: torch.Tensor) -> None:
        self.owner.handle.wait(self.index, self.owner.timeout)  # GroupFailed if it cannot land
        self.owner.layer_waits += 1
        part = self.owner.buffer[self.index]
        self.device = like.device
        self.keys = part[0].permute(1, 0, 2).unsqueeze(0).contiguous().to(like.device)
        self.values = part[1].permute(1, 0, 2).unsqueeze(0).contiguous().to(like.device)
        self.is_initialized = True
        self.arrived = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.arrived:
            self._arrive(key_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.prefix_tokens if not self.arrived else int(super().get_seq_length())


class KvcrCache(DynamicCache):  # type: ignore[misc]
    """A ``DynamicCache`` whose first ``len(keys) * block_tokens`` tokens are delivered from kvcr.

    Construction starts the deliver (one request, a layer plan of one group per layer);
    ``prefix_tokens`` says how many tokens the model must not compute again. Call
    ``close()`` when done (it waits for the deliver and unregisters the buffer).
    """

    def __init__(
        self, client: Client, keys: Sequence[bytes], config: Any, *, request_id: str | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: torch.dtype = torch.float32, timeout: float = WAIT_S,
    ) -> None:
        layers, kv_heads, head_dim = _shape(config)
        self.client = client
        self.timeout = timeout
        self.prefix_tokens = len(keys) * block_tokens
        self.layer_waits = 0
        """Layers that waited for their group (one per layer the model used)."""
        self.buffer = torch.empty((layers, 2, self.prefix_tokens, kv_heads, head_dim), dtype=dtype)
        self.region = client.register(_bytes_of(self.buffer))
        span = block_bytes(config, block_tokens, dtype)
        spans = _spans(self.region, layers, len(keys), block_tokens, span, "")
        plan = [[f"L{i}.k", f"L{i}.v"] for i in range(layers)]
        reads = client.grant_reads
        self.handle: DeliverHandle = client.deliver(dict(zip(keys, spans, strict=True)), request_id=request_id,
                                                    plan=plan)
        self.granted = client.grant_reads > reads
        """Whether the deliver READs under read grants (else the node delivers)."""
        Cache.__init__(self, layers=[_DeliveredLayer(self, i, self.prefix_tokens) for i in range(layers)])

    def close(self) -> None:
        """Wait until the node can no longer write the buffer, then unregister it."""
        try:
            self.handle.result(self.timeout)
        finally:
            self.client.unregister(self.region)
