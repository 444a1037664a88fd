"""vLLM: what the connector's scheduler side and worker side have in common.

The two sides run in different processes (vLLM's scheduler in the engine core, each
worker in its own), so they share no state: only the ``KvcrConnectorMetadata`` vLLM hands
from the scheduler to the workers every step, the ``KvcrConnectorStats`` each side counts
in (vLLM aggregates them), and the settings both read from the same
``kv_connector_extra_config`` (``Settings``, checked alike on either side).
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes, resolve_none_hash_seed
from vllm.v1.metrics.utils import create_metric_per_engine

from kvcr_client.integrations.blocks import Fingerprint
from kvcr_client.integrations.sources import SourcePolicy
from kvcr_protocol import DEFAULT_LIMITS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

LOGGER = "vllm.kvcr"
"""The connector's logger: under vLLM's own (``vllm``), so its lines have vLLM's format, handler
and level (INFO lines show), in every process vLLM runs the connector in."""
log = init_logger(LOGGER)

LOAD_TIMEOUT_S = 30.0
"""Default deadline of a step's load (``extra_config["load_timeout_s"]``): past it the node
fails the blocks not delivered, and vLLM recomputes them."""
LOAD_TIMEOUT_MAX_S = 3600.0
"""The largest ``load_timeout_s`` accepted."""
LOOKUP_TIMEOUT_S = 0.2
"""Default ``extra_config["lookup_timeout_s"]``: the longest a request's lookup (its hint and
lease, through its source's dial) may take; past it the request is a miss. Meanwhile vLLM's
scheduler is answered "not yet" and schedules the others."""
STALL_FRACTION = 0.5
"""The part of ``lookup_timeout_s`` after which a node that has left the heartbeat sent with a
lookup unanswered is taken as frozen (``Settings.stall_s``). The node's loop answers a
heartbeat in its next turn whatever the lease behind it waits for (a source's dial), so a
live node answers it in milliseconds: waiting the rest of the bound for the lease would only
delay the miss a frozen node makes certain."""
LOOKUP_WAIT_S = 0.02
"""Default ``extra_config["lookup_wait_s"]``: the longest one scheduler call waits for a lookup
it has just started (a lease at the engine's own node is answered well within it)."""
LOOKUP_TIMEOUT_MAX_S = 60.0
"""The largest ``lookup_timeout_s`` accepted."""
SAVE_TIMEOUT_S = 1.0
"""Default ``extra_config["save_timeout_s"]``: the longest a step's save waits for the node to
reserve its slots (a put, spec section 6.13); past it the blocks are not saved and saves pause
for ``SAVE_PAUSE_S``, so a stalled node costs the engine one bounded wait, not every step."""
SAVE_TIMEOUT_MAX_S = 60.0
"""The largest ``save_timeout_s`` accepted."""

COUNTERS: dict[str, str] = {
    "leases": "Leases that held at least one block beyond what vLLM had computed (scheduler).",
    "matched_tokens": "Prompt tokens the leases let vLLM skip computing (scheduler).",
    "loads": "Delivers started, one per request with blocks to load in a step (worker).",
    "grant_loads": "Loads that READ the node's pools under a read grant, the rest the node delivered (worker).",
    "layer_waits": "Waits for a layer's group of blocks before its attention (worker).",
    "blocks_loaded": "Blocks that landed in vLLM's KV cache, every layer (worker).",
    "load_errors": "Layer groups or delivers that failed (worker).",
    "blocks_failed": "Block ids reported to vLLM as failed to load, to be recomputed (worker).",
    "saves": "Deposits issued, one per step that computed blocks to save (worker).",
    "blocks_saved": "Blocks stored in the node (worker).",
    "save_errors": "Deposits that failed as a whole (worker).",
    "saves_timed_out": "Saves the node did not answer within save_timeout_s: blocks not saved (worker).",
    "saves_paused": "Saves passed over after a save timed out (SAVE_PAUSE_S): blocks not saved (worker).",
    "sources_refused": "Requests whose kv_transfer_params named a source that is not allowed, or no endpoint: "
                       "looked up without it, nothing dialled (scheduler); loads naming one (worker).",
    "lookups_timed_out": "Lookups not answered within lookup_timeout_s, or whose heartbeat the node left "
                         "unanswered for half of it (frozen): a miss (scheduler).",
    "lookups_asked_again": "Leases asked again because the block after the held ones was on its way into the node "
                           "(read back from its disk tier, or being written): vLLM asks again next step (scheduler).",
    "lookup_errors": "Lookups that failed (the node refused or was lost, the request could not be looked up): "
                     "a miss (scheduler).",
    "node_outages": "Times the side found its node lost (restarted, or silent past the heartbeats) (both).",
    "reconnects": "Sessions opened again with the node after an outage (both).",
    "node_away_ms": "Milliseconds the node was away, counted when the outage ends (both).",
    "node_away": "Lookups (scheduler), loads and saves (worker) passed over because the node was away: "
                 "a miss, blocks recomputed, blocks not saved.",
    "node_stalled": "Lookups (scheduler) and saves (worker) passed over because the node left the scheduler's "
                    "heartbeat unanswered for half of lookup_timeout_s (frozen): a miss, blocks not saved.",
}
"""What a connector counts: name -> what it means."""


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


class Counts:
    """A side's ``KvcrConnectorStats`` since vLLM last took them (vLLM may ask from another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KvcrConnectorStats()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats.add(name, n)

    def take(self) -> KvcrConnectorStats | None:
        """The counts since the last call (None if there are none), then afresh."""
        with self._lock:
            stats, self._stats = self._stats, KvcrConnectorStats()
        return None if stats.is_empty() else stats


@dataclass
class BlockLoad:
    """A request's blocks to load (or to save) in a step: keys and the vLLM block ids they fill."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    source: str | None = None
    """The node that holds the blocks when it is not ours (the worker hints it in its own session):
    one the operator allowed, as the operator spelled it."""
    hint_id: str | None = None
    """The request id the hint goes under (``hint_id``: vLLM's, or a digest of one the protocol cannot carry)."""
    parents: list[bytes] = field(default_factory=list)
    """A save's: each block's parent, the key of the block before it in the request (b"" for
    its first block), published with the block's ``stored`` event (spec section 6.4, "Parents")."""


@dataclass
class KvcrConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the workers do this step: blocks to load (before the forward) and to save (after)."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockLoad] = field(default_factory=list)
    node_stalled: bool = False
    """The scheduler side finds the node stalled (``NodeLink.stalled``): the workers save
    nothing this step rather than each wait ``save_timeout_s`` for it."""
    node_away: bool = False
    """The scheduler side finds the node away (its session lost, a reconnect under way): the
    workers save nothing this step and wait for nothing (a worker whose session still stands
    would wait ``save_timeout_s`` on a node that stopped answering, one whose session is lost
    ``CONNECT_WAIT_S`` for a welcome); their own reconnects go on."""


def hint_id(request_id: object) -> str:
    """The id a request's hint goes under: vLLM's request id where the protocol can carry it
    (printable, at most ``max_text`` bytes; an API server may take it from a request header),
    else a digest of it, so that no request id can make a hint fail."""
    text = str(request_id)
    if text and text.isprintable() and len(text) <= DEFAULT_LIMITS.max_text // 4:
        return text
    return "kvcr-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def brief(exc: BaseException) -> str:
    """An error for a log line, cut short (it may quote what a request carried)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 200 else text[:200] + "..."


def _seconds(extra: dict[str, Any], name: str, default: float, most: float, *, zero: bool = False) -> float:
    """``extra[name]``, a number of seconds in (0, ``most``] (or [0, ``most``] with ``zero``); a
    clear error naming the key otherwise."""
    value = extra.get(name, default)
    low = "[0" if zero else "(0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (0 <= value if zero else 0 < value) and value <= most):
        raise ValueError(f"KvcrConnector: kv_connector_extra_config[{name!r}] must be seconds in {low}, {most:g}], "
                         f"not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Settings:
    """The connector's settings, from ``kv_connector_extra_config`` and vLLM's config (``read``)."""

    extra: dict[str, Any]
    """The extra config itself (a side may read a key of its own, a subclass one of its own)."""
    endpoint: str
    source: str | None
    """The endpoint of another node that may hold the blocks (a hint per request)."""
    sources: SourcePolicy
    """What a request's ``kv_transfer_params`` may name: this node, ``source``, ``allowed_sources``."""
    pool: str
    load_timeout_s: float
    lookup_timeout_s: float
    lookup_wait_s: float
    save_timeout_s: float
    block_size: int
    fingerprint: Fingerprint
    """What block keys are salted with besides vLLM's block hashes (``fingerprint``): engines
    share blocks exactly when theirs are equal."""
    hashes_per_block: int = 1
    """vLLM's block hashes (``Request.block_hashes``) a block of ``block_size`` tokens spans:
    one, unless vLLM hashes finer than the blocks it allocates."""
    block_hashes: str = ""
    """How vLLM roots and computes its block hashes (``block_hash_scheme``), for the log."""

    @property
    def stall_s(self) -> float:
        """How long the heartbeat sent with a lookup may go unanswered before the node is taken
        as frozen: the lookup in flight is then a miss, and so is every lookup until the node
        speaks again (``STALL_FRACTION`` of ``lookup_timeout_s``)."""
        return self.lookup_timeout_s * STALL_FRACTION

    @classmethod
    def read(cls, vllm_config: VllmConfig, kv_cache_config: Any = None) -> Settings:
        """Check and read the settings; a clear error naming the key for a bad one."""
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        if "endpoint" not in extra:
            raise ValueError("KvcrConnector needs kv_connector_extra_config['endpoint'], the node's endpoint")
        endpoint = str(extra["endpoint"])
        source = None if extra.get("source") is None else str(extra["source"])
        sources = SourcePolicy(endpoint, source, extra.get("allowed_sources", ()), "KvcrConnector: kv_connector_extra_config")
        pool = str(extra.get("pool", "kv"))
        load_timeout_s = _seconds(extra, "load_timeout_s", LOAD_TIMEOUT_S, LOAD_TIMEOUT_MAX_S)
        lookup_timeout_s = _seconds(extra, "lookup_timeout_s", LOOKUP_TIMEOUT_S, LOOKUP_TIMEOUT_MAX_S)
        lookup_wait_s = _seconds(extra, "lookup_wait_s", min(LOOKUP_WAIT_S, lookup_timeout_s), lookup_timeout_s, zero=True)
        save_timeout_s = _seconds(extra, "save_timeout_s", SAVE_TIMEOUT_S, SAVE_TIMEOUT_MAX_S)
        block_size = int(vllm_config.cache_config.block_size)
        return cls(extra, endpoint, source, sources, pool, load_timeout_s, lookup_timeout_s, lookup_wait_s,
                   save_timeout_s, block_size, fingerprint(vllm_config, kv_cache_config),
                   hashes_per_block(vllm_config, kv_cache_config), block_hash_scheme(vllm_config))


def block_hash_scheme(vllm_config: VllmConfig) -> str:
    """How vLLM computes the block hashes keys are made from, checked to be the same in every
    process that shares the settings: its ``prefix_caching_hash_algo``, and the seed it roots
    the chain at (``PYTHONHASHSEED`` where set, else vLLM's fixed default for a cryptographic
    hash). Where vLLM draws a random seed per process instead (a non-cryptographic hash
    without ``PYTHONHASHSEED``), no other server, and not this one once restarted, could ever
    find a block this one saves: refused, naming both settings (docs/architecture.md section
    5, "Engine block keys")."""
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    hash_fn = get_hash_fn_by_name(algo)
    # vLLM resolves the seed here exactly as it roots its own chain (init_none_hash): a random
    # seed is drawn afresh on every call, a shareable one is the same each time.
    if resolve_none_hash_seed(hash_fn) != resolve_none_hash_seed(hash_fn):
        raise ValueError(
            f"KvcrConnector: block keys come from vLLM's block hashes, which with prefix_caching_hash_algo={algo!r} "
            "start from a random seed per process unless PYTHONHASHSEED is set: no other server (nor this one after "
            "a restart) could find the blocks saved. Set PYTHONHASHSEED to the same value on every server that "
            "shares a node, or use prefix_caching_hash_algo 'sha256' or 'sha256_cbor'")
    seed = "PYTHONHASHSEED" if os.environ.get("PYTHONHASHSEED") is not None else "vLLM's default seed"
    return f"{algo}, {seed}"


def hashes_per_block(vllm_config: VllmConfig, kv_cache_config: Any) -> int:
    """How many of vLLM's block hashes (``Request.block_hashes``, one per ``hash_block_size``
    tokens) a block of ``cache_config.block_size`` tokens spans: one, unless vLLM hashes finer
    (several KV cache groups); a block size that is not a multiple of vLLM's hash size is
    refused, as no hash would end where a block does."""
    block_size = int(vllm_config.cache_config.block_size)
    if kv_cache_config is None:
        return 1
    hash_block_size = int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    if hash_block_size < 1 or block_size % hash_block_size:
        raise ValueError(f"KvcrConnector: cache_config.block_size {block_size} is not a multiple of the size vLLM "
                         f"hashes blocks at ({hash_block_size})")
    return block_size // hash_block_size


def kv_layout(kv_cache_config: Any) -> str:
    """The KV cache's shape as vLLM's ``KVCacheConfig`` describes it to every side alike (the
    scheduler's and each worker's are built from the same specs): per group, the spec's kind,
    its layers, KV heads (per rank), head size, dtype and block size. Not the block count, which
    differs between engines that can share blocks."""
    if kv_cache_config is None:
        return ""
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        fields = ",".join(f"{name}={getattr(spec, name)}" for name in ("num_kv_heads", "head_size", "dtype",
                                                                       "block_size", "sliding_window")
                          if getattr(spec, name, None) is not None)
        groups.append(f"{type(spec).__name__}[{len(group.layer_names)}]({fields})")
    return ";".join(groups)


def fingerprint(vllm_config: VllmConfig, kv_cache_config: Any) -> Fingerprint:
    """The compatibility fingerprint of this engine's blocks (docs/architecture.md section 5,
    "Engine block keys"): the model (``extra_config["model_id"]``, else vLLM's model), its dtype,
    the block size, the KV layout (``kv_layout``), the tensor-parallel size (each rank's slice
    its own object, ``Fingerprint.slice_key``), the weights' quantization, the model's
    revision and the connector's layout version. The one place keys are salted: a block
    another fingerprint saved is a miss, never a load. What differs between requests (LoRA
    adapter, multimodal inputs, cache salt) is in vLLM's block hashes, not here.
    Pipeline and decode-context parallelism split a block's KV in ways keys do not name yet:
    refused, by name."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) != 1:
            raise ValueError(f"KvcrConnector: parallel_config.{name} must be 1, not {getattr(parallel, name)!r}")
    model = vllm_config.model_config
    return Fingerprint(model=str(extra.get("model_id") or model.model), dtype=str(model.dtype),
                       block_size=int(vllm_config.cache_config.block_size), kv_layout=kv_layout(kv_cache_config),
                       tp_size=int(parallel.tensor_parallel_size), quantization=str(model.quantization or ""),
                       revision=str(model.revision or ""))
