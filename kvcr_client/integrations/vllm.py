"""vLLM: a KV connector (``KVConnectorBase_V1``) that loads and saves blocks through kvcr.

Load it without patching vLLM::

    KVTransferConfig(kv_connector="KvcrConnector", kv_connector_module_path="kvcr_client.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"endpoint": "ipc:///run/kvcr/node.sock"})

Each full block of a prompt is one kvcr object (``kvcr_client.integrations.blocks`` keys,
salted with the model), with one span per layer: the block's bytes in that layer's paged
KV tensor (two, ``.k`` and ``.v``, where a layer keeps K and V apart). The node's pool
``pool`` (default ``kv``) needs slots of one layer's block.

Scheduler side: ``get_num_new_matched_tokens`` leases the prompt's blocks and counts the
leading ones held (here, or at the node ``extra_config["source"]`` names, through a hint),
so an admitted request cannot lose them; ``update_state_after_alloc`` notes where they go,
``build_connector_meta`` tells the workers what to load and save; ``request_finished``
releases the lease and names this node in ``kv_transfer_params``; a request that arrives
with those params (a decode engine on another host) has its blocks looked for there. Worker side:
``register_kv_caches`` registers each layer's tensor once; ``start_load_kv`` sends one
deliver for the step with a layer plan (group i: layer i of every block);
``wait_for_layer_load(layer)`` waits for that layer's group only; ``wait_for_save``
deposits the full prompt blocks computed this step (every chunk of a chunked prefill: the
scheduler remembers per request how far it has saved); a block that failed to load is
reported by ``get_block_ids_with_load_errors``, never a hang, and vLLM recomputes it with
``kv_load_failure_policy="recompute"`` (and the connector saves it once recomputed). Loads are synchronous to the step (``load_async``
False), so layers overlap with compute.

Counts go through vLLM's own stats path: each connector instance (scheduler and workers)
counts in a ``KvcrConnectorStats`` that ``get_kv_connector_stats`` hands over (and starts
afresh) every step; vLLM aggregates them, logs them, and ``KvcrPromMetrics`` exports them
as ``vllm:kvcr_*_total`` counters.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvcr_client.client import Client, RegionHandle, Span
from kvcr_client.errors import GroupFailed, KvcrError
from kvcr_client.integrations.blocks import block_keys
from kvcr_client.leases import LeaseHandle
from kvcr_client.results import DeliverHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvcr.vllm")

SAVED_MEMORY = 65536
"""Block keys the scheduler remembers having saved (least recently saved forgotten first): it
skips saving them again; a forgotten one saved again is answered DUPLICATE by the node."""
WAIT_S = 30.0
"""How long a control call (hint, lease, deposit) may take."""
LOAD_TIMEOUT_S = 30.0
"""Default deadline of a step's load (``extra_config["load_timeout_s"]``): past it the node
fails the blocks not delivered, and vLLM recomputes them."""
REPLY_SLACK_S = 5.0
"""How much longer than the deadline a layer waits for the node to say it failed."""

COUNTERS: dict[str, str] = {
    "leases": "Leases that held at least one block beyond what vLLM had computed (scheduler).",
    "matched_tokens": "Prompt tokens the leases let vLLM skip computing (scheduler).",
    "loads": "Delivers started, one per request with blocks to load in a step (worker).",
    "layer_waits": "Waits for a layer's group of blocks before its attention (worker).",
    "blocks_loaded": "Blocks that landed in vLLM's KV cache, every layer (worker).",
    "load_errors": "Layer groups or delivers that failed (worker).",
    "blocks_failed": "Block ids reported to vLLM as failed to load, to be recomputed (worker).",
    "saves": "Deposits issued, one per step that computed blocks to save (worker).",
    "blocks_saved": "Blocks stored in the node (worker).",
    "save_errors": "Deposits that failed as a whole (worker).",
}
"""What a connector counts: name -> what it means."""
DIGESTS: dict[str, dict[str, str]] = {"saved": {}, "loaded": {}}
"""With ``extra_config["verify"]`` (a testing aid): block key (hex) -> SHA-256 of its bytes in
vLLM's cache as saved, and as loaded once every layer landed, so that a run can prove the
bytes the model read are the bytes another engine computed. Each table keeps the latest
``DIGESTS_KEPT`` blocks."""
DIGESTS_KEPT = 4096


@dataclass
class KvcrConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One connector's counts (``COUNTERS``) since it last handed them over: plain ints in
    ``data``, so that they cross from worker to scheduler to logger as they are."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        self.data[name] += n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum ``other`` into this one (workers, scheduler and intervals alike)."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(value) for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvcrPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The counts as Prometheus counters ``vllm:kvcr_<name>_total``, one child per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(self._counter_cls(name=f"vllm:kvcr_{name}", documentation=doc,
                                                             labelnames=labelnames), per_engine_labelvalues)
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                self.counters[name][engine_idx].inc(value)


@dataclass
class _Saving:
    """A request whose prompt blocks are being saved, step by step (chunked prefill)."""

    keys: list[bytes]
    """One key per full block of the prompt."""
    block_ids: list[int]
    prompt_tokens: int
    saved: int = 0
    """Blocks before this one are saved (or were loaded, or were cached already)."""


@dataclass
class _Load:
    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    source: str | None = None
    """The node that holds the blocks when it is not ours (the worker hints it in its own session)."""


@dataclass
class _Pending:
    """A request's deliver in this step, until its last layer."""

    handle: DeliverHandle
    blocks: dict[bytes, list[int]]
    """Key -> the vLLM block ids it fills."""
    request_id: str
    hinted: bool
    group_failed: bool = False


@dataclass
class KvcrConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the workers do this step: blocks to load (before the forward) and to save (after)."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Load] = field(default_factory=list)


class KvcrConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector over a kvcr node (see the module)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "endpoint" not in extra:
            raise ValueError("KvcrConnector needs kv_connector_extra_config['endpoint'], the node's endpoint")
        self.endpoint = str(extra["endpoint"])
        self.source = extra.get("source")
        """The endpoint of another node that may hold the blocks (a hint per request)."""
        self.pool = str(extra.get("pool", "kv"))
        self.verify = bool(extra.get("verify", False))
        self.load_timeout_s = float(extra.get("load_timeout_s", LOAD_TIMEOUT_S))
        if not 0 < self.load_timeout_s <= 3600:
            raise ValueError(f"KvcrConnector: kv_connector_extra_config['load_timeout_s'] must be in (0, 3600] s, "
                             f"not {self.load_timeout_s}")
        self.block_size = int(vllm_config.cache_config.block_size)
        # Keys name the model (engines that share blocks must agree on it: its id, or its path).
        model_id = extra.get("model_id") or vllm_config.model_config.model
        self.salt = f"{model_id}|{vllm_config.model_config.dtype}|{self.block_size}".encode()
        self.client = Client(self.endpoint, name=f"vllm-{role.name.lower()}")
        self._lock = threading.Lock()
        # Scheduler side.
        self._keys: dict[str, list[bytes]] = {}
        self._leases: dict[str, LeaseHandle] = {}
        self._loads: list[_Load] = []
        self._saving: dict[str, _Saving] = {}
        self._saved: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._stats = KvcrConnectorStats()
        # Worker side.
        self._layers: list[str] = []
        self._regions: dict[str, RegionHandle] = {}
        self._tensors: dict[str, Any] = {}
        """Layer -> its paged KV tensor's bytes (for ``verify``)."""
        self._block_bytes: dict[str, int] = {}
        self._split: dict[str, int] = {}
        """Layer -> the byte offset of its V half (0: K and V of a block are one span)."""
        self._handles: list[_Pending] = []
        self._failed: set[int] = set()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = list(request.prompt_token_ids or [])
        keys = block_keys(tokens[:-1], self.block_size, self.salt)  # one token is always computed
        if not keys:
            return 0, False
        request_id = None
        source = self._source_of(request)
        if source:
            request_id = str(request.request_id)
            self.client.submit_hint(request_id, source, keys).result(WAIT_S)
        try:
            lease = self.client.lease(keys, request_id=request_id).result(WAIT_S)
        except KvcrError as exc:
            log.warning("kvcr lease failed for %s: %s", request.request_id, exc)
            return 0, False
        held = lease.held_prefix() * self.block_size
        if held <= num_computed_tokens:
            if lease.id:
                lease.release().result(WAIT_S)
            return 0, False
        old = self._leases.pop(request.request_id, None)
        if old is not None and old.ended is None and old.id:
            old.release()
        self._leases[request.request_id] = lease
        self._keys[request.request_id] = keys
        self._count("leases")
        self._count("matched_tokens", held - num_computed_tokens)
        return held - num_computed_tokens, False

    def _source_of(self, request: Any) -> str | None:
        """Where a request's blocks may be: the node its ``kv_transfer_params`` name (what
        ``request_finished`` of the engine that computed them returned), else the configured one."""
        params = getattr(request, "kv_transfer_params", None) or {}
        source = params.get("kvcr_endpoint") if isinstance(params, dict) else None
        if source and source != self.endpoint:
            return str(source)
        return str(self.source) if self.source else None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        keys = self._keys.get(request.request_id, [])
        block_ids = list(blocks.get_block_ids()[0])
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        self._loads.append(_Load(request.request_id, keys[first : first + count], block_ids[first : first + count],
                                 self._source_of(request)))

    def build_connector_meta(self, scheduler_output: Any) -> KvcrConnectorMetadata:
        meta = KvcrConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            # Blocks vLLM counts computed (loaded from kvcr, or in its own cache) are not saved.
            saving = _Saving(block_keys(tokens, self.block_size, self.salt), list(new.block_ids[0]), len(tokens),
                             new.num_computed_tokens // self.block_size)
            self._saving[new.req_id] = saving
            self._save_computed(meta, new.req_id, saving, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._saving.get(req_id)
            if tracked is None:
                continue
            saving, new_ids = tracked, cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and resumed: its blocks start afresh
                saving.block_ids = list(new_ids[0]) if new_ids else []
                saving.saved = min(saving.saved, cached.num_computed_tokens[i] // self.block_size)
            elif new_ids:
                saving.block_ids.extend(new_ids[0])
            self._save_computed(meta, req_id, saving, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _save_computed(self, meta: KvcrConnectorMetadata, request_id: str, saving: _Saving, computed: int) -> None:
        """Add to ``meta.saves`` the prompt blocks this step completes that are not saved yet."""
        end = min(min(computed, saving.prompt_tokens) // self.block_size, len(saving.keys), len(saving.block_ids))
        fresh = [(saving.keys[b], saving.block_ids[b]) for b in range(saving.saved, end)
                 if saving.keys[b] not in self._saved]
        saving.saved = max(saving.saved, end)
        if not fresh:
            return
        meta.saves.append(_Load(request_id, [k for k, _ in fresh], [b for _, b in fresh]))
        for k, _ in fresh:
            self._saved[k] = None
        while len(self._saved) > SAVED_MEMORY:
            self._saved.popitem(last=False)

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them once they are."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for saving in self._saving.values():
            first = next((b for b, block_id in enumerate(saving.block_ids[: saving.saved]) if block_id in invalid), None)
            if first is not None:
                saving.saved = first

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        lease = self._leases.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        self._saving.pop(request.request_id, None)
        if lease is not None and lease.ended is None and lease.id:
            lease.release()
        if self._source_of(request):
            self.client.discard_hint(str(request.request_id))
        # A decode engine elsewhere that gets these params asks its own node for the blocks here.
        return False, {"kvcr_endpoint": self.endpoint}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        for name, tensor in kv_caches.items():
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"KvcrConnector: layer {name} is not a contiguous CPU tensor")
            if tensor.shape[0] == 2 and (num_blocks is None or tensor.shape[1] == num_blocks):
                self._split[name] = tensor[1].data_ptr() - tensor[0].data_ptr()  # [2, blocks, ...]: K then V
                self._block_bytes[name] = tensor[0, 0].numel() * tensor.element_size()
            else:
                self._split[name] = 0  # [blocks, ...]: a block's K and V together
                self._block_bytes[name] = tensor[0].numel() * tensor.element_size()
            self._tensors[name] = tensor.view(torch.uint8).reshape(-1).numpy()
            self._regions[name] = self.client.register(self._tensors[name])
            self._layers.append(name)
        log.info("kvcr: %d layers registered (shape %s), %d bytes per layer block", len(self._layers),
                 tuple(next(iter(kv_caches.values())).shape) if kv_caches else (),
                 next(iter(self._block_bytes.values()), 0))

    def _spans(self, block_id: int, pool: str = "") -> list[Span]:
        spans = []
        for name in self._layers:
            size, split, region = self._block_bytes[name], self._split[name], self._regions[name]
            if split:
                spans.append(Span(f"{name}.k", region, block_id * size, size, pool))
                spans.append(Span(f"{name}.v", region, split + block_id * size, size, pool))
            else:
                spans.append(Span(name, region, block_id * size, size, pool))
        return spans

    @staticmethod
    def _remember(table: str, key: bytes, digest: str) -> None:
        kept = DIGESTS[table]
        kept[key.hex()] = digest
        while len(kept) > DIGESTS_KEPT:
            del kept[next(iter(kept))]

    def _digest(self, block_id: int) -> str:
        """SHA-256 of one block's bytes over every layer, in span order."""
        h = hashlib.sha256()
        for span in self._spans(block_id):
            h.update(self._tensors[span.name.removesuffix(".k").removesuffix(".v")][span.offset : span.offset + span.length])
        return h.hexdigest()

    def _plan(self) -> list[list[str]]:
        return [[f"{n}.k", f"{n}.v"] if self._split[n] else [n] for n in self._layers]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """One deliver per request with a layer plan; a request whose blocks a source holds
        hints that source in this worker's own session first (hints are per session)."""
        meta = self._get_connector_metadata()
        self._handles = []
        for load in meta.loads:
            if not load.keys:
                continue
            request_id = None
            if load.source:
                request_id = load.request_id
                self.client.submit_hint(request_id, load.source, load.keys).result(WAIT_S)
            objects = {key: self._spans(block_id) for key, block_id in zip(load.keys, load.block_ids, strict=True)}
            blocks = {key: [block_id] for key, block_id in zip(load.keys, load.block_ids, strict=True)}
            self._count("loads")
            handle = self.client.deliver(objects, request_id=request_id, plan=self._plan(),
                                         deadline_ms=int(self.load_timeout_s * 1000))
            self._handles.append(_Pending(handle, blocks, load.request_id, request_id is not None))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._handles or layer_name not in self._regions:
            return
        group = self._layers.index(layer_name)
        self._count("layer_waits")
        for pending in self._handles:
            try:
                pending.handle.wait(group, self.load_timeout_s + REPLY_SLACK_S)
            except (GroupFailed, KvcrError, TimeoutError) as exc:
                log.warning("kvcr: layer %s failed to load for %s (%s)", layer_name, pending.request_id, exc)
                pending.group_failed = True
                self._count("load_errors")
        if group == len(self._layers) - 1:
            for pending in self._handles:
                self._settle(pending)
            self._handles = []

    def _settle(self, pending: _Pending) -> None:
        """After the last layer: which of a request's blocks vLLM must recompute.

        The blocks whose key did not load, when the node says which; vLLM recomputes from
        the first of them and keeps the blocks before it, which did land. A layer that
        failed while every key loaded in the end (a lost notification, a timeout) leaves no
        telling which layer the forward read early: then every block is reported."""
        blocks = pending.blocks
        try:
            results = pending.handle.result(self.load_timeout_s + REPLY_SLACK_S)
        except KvcrError as exc:
            failed = set(blocks)
            self._count("load_errors")
            log.warning("kvcr: load for %s failed: %s", pending.request_id, exc)
        else:
            failed = {key for key in blocks if not results[key].ok}
            for key in failed:
                log.warning("kvcr: block %s not loaded: %s", key.hex()[:12], results[key])
            if pending.group_failed and not failed:
                failed = set(blocks)
            self._count("blocks_loaded", sum(1 for key in blocks if key not in failed))
            if self.verify:
                for key, ids in blocks.items():
                    if key not in failed:
                        self._remember("loaded", key, self._digest(ids[0]))
        for key in failed:
            self._failed.update(blocks[key])
        if failed:
            log.warning("kvcr: %d of %d blocks of %s to be recomputed", len(failed), len(blocks), pending.request_id)
        if pending.hinted:
            self.client.discard_hint(pending.request_id)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole once the step computed them (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        objects = {key: self._spans(block_id, self.pool) for save in meta.saves
                   for key, block_id in zip(save.keys, save.block_ids, strict=True)}
        if not objects:
            return
        try:
            # Synchronous: the blocks may be reused once this step is over.
            self._count("saves")
            results = self.client.deposit(objects, optional=True).result(WAIT_S)
            self._count("blocks_saved", sum(1 for r in results.values() if r.ok))
            if self.verify:
                for save in meta.saves:
                    for key, block_id in zip(save.keys, save.block_ids, strict=True):
                        self._remember("saved", key, self._digest(block_id))
        except KvcrError as exc:
            self._count("save_errors")
            log.warning("kvcr: saving %d blocks failed: %s", len(objects), exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        self._count("blocks_failed", len(failed))
        return failed

    # ------------------------------------------------------------------ stats

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats.add(name, n)

    def get_kv_connector_stats(self) -> KvcrConnectorStats | None:
        """This instance's counts since the last call (vLLM asks once a step), then afresh."""
        with self._lock:
            stats, self._stats = self._stats, KvcrConnectorStats()
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcrConnectorStats:
        """Counts rebuilt from what crossed processes (``to_dict``), for vLLM's logger."""
        return KvcrConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvcrPromMetrics:
        return KvcrPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def shutdown(self) -> None:
        for lease in list(self._leases.values()):
            if lease.ended is None and lease.id:
                lease.release()
        self.client.close()
