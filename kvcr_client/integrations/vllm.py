"""vLLM: a KV connector (``KVConnectorBase_V1``) that loads and saves blocks through kvcr.

Load it without patching vLLM::

    KVTransferConfig(kv_connector="KvcrConnector", kv_connector_module_path="kvcr_client.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"endpoint": "ipc:///run/kvcr/node.sock"})

Each full block of a prompt is one kvcr object per tensor-parallel rank, keyed by vLLM's own
block hash of it (``Request.block_hashes``: the tokens up to the block's end, and the
request's LoRA adapter, multimodal inputs and ``cache_salt``), salted with the compatibility
fingerprint ``vllm_common.fingerprint`` (model, dtype, block size, KV layout, TP size,
quantization, revision, layout version; ``kvcr_client.integrations.blocks``); the object key
names the rank. vLLM's hashes must start from the same seed on every server that shares a
node: its default with ``sha256`` (the default hash) or ``sha256_cbor``, else the same
``PYTHONHASHSEED`` everywhere (the connector refuses a random one). Each object has one
span per layer: the rank's slice of the block's bytes in that layer's paged KV tensor (two,
``.k`` and ``.v``, where a layer keeps K and V apart). The node's pool ``pool`` (default
``kv``) needs slots of one layer's block of one rank. A block is a hit only when every
rank's slice is held (the scheduler leases them all).

Scheduler side: ``get_num_new_matched_tokens`` leases the prompt's blocks and counts the
leading ones held (here, or at the node ``extra_config["source"]`` names, through a hint),
so an admitted request cannot lose them; ``update_state_after_alloc`` notes where they go,
``build_connector_meta`` tells the workers what to load and save; ``request_finished``
releases the lease and names this node in ``kv_transfer_params``; a request that arrives
with those params (a decode engine on another host) has its blocks looked for there, when
that node is this one, ``source`` or in ``extra_config["allowed_sources"]``: the params are
the request's own content (a request body field in vLLM's API server), so they choose among
the operator's sources, never a node of their own (``kvcr_client.integrations.sources``).
The lookup never holds the scheduler: its hint and lease are sent without waiting, the call
waits ``lookup_wait_s`` at most, then answers "not yet" (None, which vLLM's scheduler asks
again next step) until the lease is in, and a miss past ``lookup_timeout_s``. No call from
vLLM raises from a request's content or a source's state: the worst is a miss, counted and
logged once per cause (``CauseLog``), or blocks reported failed for vLLM to recompute. Worker side:
``register_kv_caches`` registers each layer's tensor once; ``start_load_kv`` sends one
deliver for the step with a layer plan (group i: layer i of every block);
``wait_for_layer_load(layer)`` waits for that layer's group only; ``wait_for_save``
deposits the full prompt blocks computed this step (every chunk of a chunked prefill: the
scheduler remembers per request how far it has saved); a block that failed to load is
reported by ``get_block_ids_with_load_errors``, never a hang, and vLLM recomputes it with
``kv_load_failure_policy="recompute"`` (and the connector saves it once recomputed). Loads are synchronous to the step (``load_async``
False), so layers overlap with compute. Where the node offers read grants, each worker
read-leases the blocks of a local load in its own session (the scheduler's lease, in
another process, could not serve it) and READs them from the node's pools itself
(``grant_loads``); otherwise the node delivers them (docs/architecture.md section 5).

The connector is a facade, as vLLM's own NixlConnector: vLLM builds it once in its
scheduler process (``KVConnectorRole.SCHEDULER``) and once in each worker process
(``WORKER``), and the role decides which side it is, ``KvcrScheduler``
(``kvcr_client.integrations.vllm_scheduler``) or ``KvcrWorker`` (``.vllm_worker``); it
forwards each call to that side. The two share no state, only what vLLM passes between them
(``KvcrConnectorMetadata``) and the stats type (``kvcr_client.integrations.vllm_common``).
What a test needs of a worker (each block's bytes, to prove them equal) it gets through a
``BlockObserver`` that ``extra_config["block_observer"]`` names (``.vllm_worker``).

A node that restarts or stalls is ridden out: each side's ``NodeLink``
(``kvcr_client.integrations.nodelink``) answers at once while the node is away (lookups
miss, loads are recomputed, saves skipped) and reconnects with backoff; the hello registers
the worker's KV cache again, and a new incarnation has the scheduler forget what it saved.
The connector logs through vLLM's logger (``vllm.kvcr``), in vLLM's format.

Counts go through vLLM's own stats path: each connector instance (scheduler and workers)
counts in a ``KvcrConnectorStats`` that ``get_kv_connector_stats`` hands over (and starts
afresh) every step; vLLM aggregates them, logs them, and ``KvcrPromMetrics`` exports them
as ``vllm:kvcr_*_total`` counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvcr_client.integrations.vllm_common import (
    COUNTERS,
    BlockLoad,
    KvcrConnectorMetadata,
    KvcrConnectorStats,
    KvcrPromMetrics,
    Settings,
    hint_id,
)
from kvcr_client.integrations.vllm_scheduler import KvcrScheduler
from kvcr_client.integrations.vllm_worker import BlockObserver, KvcrWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["COUNTERS", "BlockLoad", "BlockObserver", "KvcrConnector", "KvcrConnectorMetadata", "KvcrConnectorStats",
           "KvcrPromMetrics", "KvcrScheduler", "KvcrWorker", "hint_id"]


class KvcrConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector over a kvcr node (see the module): the side its role names, to which
    every call is forwarded."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = Settings.read(vllm_config, kv_cache_config)
        self.connector_scheduler = KvcrScheduler(settings, kv_cache_config) if role is KVConnectorRole.SCHEDULER else None
        self.connector_worker = KvcrWorker(settings, kv_cache_config) if role is KVConnectorRole.WORKER else None

    def _scheduler(self) -> KvcrScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError(f"KvcrConnector: a scheduler-side call on the {self.role.name.lower()} side")
        return self.connector_scheduler

    def _worker(self) -> KvcrWorker:
        if self.connector_worker is None:
            raise RuntimeError(f"KvcrConnector: a worker-side call on the {self.role.name.lower()} side")
        return self.connector_worker

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvcrConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole once the step computed them (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    # ------------------------------------------------------------------ both sides

    def get_kv_connector_stats(self) -> KvcrConnectorStats | None:
        """This side's counts since the last call (vLLM asks once a step), then afresh."""
        if self.connector_worker is not None:
            self.connector_worker.harvest()  # saves whose commit answered since
        side = self.connector_scheduler or self.connector_worker
        return side.counts.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcrConnectorStats:
        """Counts rebuilt from what crossed processes (``to_dict``), for vLLM's logger."""
        return KvcrConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvcrPromMetrics:
        return KvcrPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()
