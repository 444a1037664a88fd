"""A ``KvcrConnector`` that kills the node holding a request's blocks once it has leased them.

Loaded by vLLM in the engine of ``examples/vllm_prefix.py`` (``--connector
vllm_faults.SourceKilledAfterLease``, with this folder on ``PYTHONPATH``) for
``test_vllm.py``: the scheduler side leases the prompt's blocks at the node
``extra_config["source"]`` names, then SIGKILLs that node (``extra_config["kill_pid"]``)
before the worker side's deliver runs in the same step, so the load fails for real, at
the point a serving engineer fears most: after admission, before the bytes moved.
``TimedLookups`` times the scheduler side's lookups (``vllm_reconnect_driver.py``),
``LayoutBlind`` shares keys across KV layouts, so that a load fails at the node, and
``ExtrasBlind`` keys blocks by their tokens alone (``vllm_isolation_driver.py``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens

from kvcr_client.integrations.vllm import KvcrConnector


class SourceKilledAfterLease(KvcrConnector):
    """``KvcrConnector`` whose first lease that matched tokens is followed by the source's death."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.kill_pid = int(extra["kill_pid"])
        self.killed = False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        matched, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if matched and not self.killed:
            os.kill(self.kill_pid, signal.SIGKILL)
            self.killed = True
        return matched, load_async


class TimedLookups(KvcrConnector):
    """``KvcrConnector`` that times each scheduler-side ``get_num_new_matched_tokens`` (for
    ``vllm_reconnect_driver.py``: the scheduler must never wait on a frozen node), and each
worker-side ``wait_for_save`` (a save waits at most ``save_timeout_s`` for it). The
    scheduler-side instance is kept in ``scheduler``, so that the driver reads its link."""

    calls: list[tuple[float, int | None]] = []
    """(seconds the call took, what it answered), in call order."""
    saves: list[float] = []
    """Seconds each worker-side ``wait_for_save`` took, in call order."""
    scheduler: TimedLookups | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.connector_scheduler is not None:
            type(self).scheduler = self

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        began = time.perf_counter()
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        type(self).calls.append((time.perf_counter() - began, answer[0]))
        return answer

    def wait_for_save(self) -> None:
        began = time.perf_counter()
        super().wait_for_save()
        type(self).saves.append(time.perf_counter() - began)


class LayoutBlind(KvcrConnector):
    """``KvcrConnector`` whose fingerprint leaves the KV layout out (``--connector
    vllm_faults.LayoutBlind``): engines of different depths under one model id share keys, as
    no real engine can, so that a load of a block another layout stored fails at the node
    (its spans are not the engine's) and ``test_vllm.py`` sees vLLM recompute it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.settings = replace(side.settings, fingerprint=replace(side.settings.fingerprint, kv_layout=""))


class SwappedLoads(KvcrConnector):
    """``KvcrConnector`` whose worker swaps the bytes of a load's first two blocks in each layer
    once that layer landed (``--connector vllm_faults.SwappedLoads``), as a store that returned
    another block's bytes would: ``test_vllm.py`` proves that the model, with real weights,
    then generates something else, so that a comparison with the reference can fail."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self.connector_worker
        ids = [] if worker is None else [ids[0] for p in worker._handles for ids in p.blocks.values()]
        super().wait_for_layer_load(layer_name)
        if worker is None or len(ids) < 2:
            return
        tensor = worker._tensors[layer_name]
        for a, b in zip(worker._spans(ids[0]), worker._spans(ids[1]), strict=True):
            if a.name.removesuffix(".k").removesuffix(".v") == layer_name:
                first = tensor[a.offset:a.offset + a.length].copy()
                tensor[a.offset:a.offset + a.length] = tensor[b.offset:b.offset + b.length]
                tensor[b.offset:b.offset + b.length] = first


class ExtrasBlind(KvcrConnector):
    """``KvcrConnector`` whose keys see a request's tokens only (``--connector
    vllm_faults.ExtrasBlind``): vLLM's hash chain over each block's tokens with none of what
    vLLM folds in besides (LoRA adapter, multimodal inputs, ``cache_salt``), as keys chained
    over token ids were. Requests that differ only in those then load each other's blocks:
    ``test_vllm_isolation.py`` proves that the isolation it checks can fail, and that such a
    load changes what an adapter generates."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        side = self.connector_scheduler
        if side is None:
            return
        hash_fn = get_hash_fn_by_name(self._vllm_config.cache_config.prefix_caching_hash_algo)
        size = side.settings.block_size

        def tokens_only(request: Any, tokens: int) -> list[bytes]:
            ids, hashes, parent = list(request.all_token_ids), [], None
            for b in range(max(0, tokens) // size):
                parent = hash_block_tokens(hash_fn, parent, ids[b * size : (b + 1) * size], None)
                hashes.append(parent)
            return side.settings.fingerprint.engine_keys(hashes)

        side._prompt_keys = tokens_only  # type: ignore[method-assign]
