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
False), so layers overlap with compute.

Counts go through vLLM's own stats path: each connector instance (scheduler and workers)
counts in a ``KvcrConnectorStats`` that ``get_kv_connector_stats`` hands over (and starts
afresh) every step; vLLM aggregates them, logs them, and ``KvcrPromMetrics`` exports them
as ``vllm:kvcr_*_total`` counters.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvcr_client.client import Client, RegionHandle, Span
from kvcr_client.errors import GroupFailed, KvcrError
from kvcr_client.integrations.blocks import block_keys
from kvcr_client.integrations.sources import CauseLog, Refusal, SourcePolicy
from kvcr_client.leases import LeaseHandle
from kvcr_client.results import DeliverHandle, OpHandle
from kvcr_protocol import DEFAULT_LIMITS

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
LOOKUP_TIMEOUT_S = 0.2
"""Default ``extra_config["lookup_timeout_s"]``: the longest a request's lookup (its hint and
lease, through its source's dial) may take; past it the request is a miss. Meanwhile vLLM's
scheduler is answered "not yet" and schedules the others."""
LOOKUP_WAIT_S = 0.02
"""Default ``extra_config["lookup_wait_s"]``: the longest one scheduler call waits for a lookup
it has just started (a lease at the engine's own node is answered well within it)."""
LOOKUP_TIMEOUT_MAX_S = 60.0
"""The largest ``lookup_timeout_s`` accepted."""

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
    "sources_refused": "Requests whose kv_transfer_params named a source that is not allowed, or no endpoint: "
                       "looked up without it, nothing dialled (scheduler); loads naming one (worker).",
    "lookups_timed_out": "Lookups not answered within lookup_timeout_s: a miss (scheduler).",
    "lookup_errors": "Lookups that failed (the node refused or was lost, the request could not be looked up): "
                     "a miss (scheduler).",
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
    """The node that holds the blocks when it is not ours (the worker hints it in its own session):
    one the operator allowed, as the operator spelled it."""
    hint_id: str | None = None
    """The request id the hint goes under (``hint_id``: vLLM's, or a digest of one the protocol cannot carry)."""


@dataclass
class _Pending:
    """A request's deliver in this step, until its last layer."""

    handle: DeliverHandle
    blocks: dict[bytes, list[int]]
    """Key -> the vLLM block ids it fills."""
    request_id: str
    hint_id: str | None
    group_failed: bool = False


class _Stage(enum.Enum):
    """Where a request's lookup is."""

    IN_FLIGHT = "hint and lease sent, no answer yet"
    LEASED = "the lease answered"
    MISSED = "a miss for good: timed out, failed or held nothing new"
    ADMITTED = "vLLM allocated the request's blocks: a later call (a preempted request) looks afresh"


@dataclass
class _Lookup:
    """One request's lookup on the scheduler side: its hint and lease, sent without waiting."""

    keys: list[bytes]
    source: str | None
    hint_id: str | None
    lease: OpHandle[LeaseHandle] | None
    started: float
    stage: _Stage = _Stage.IN_FLIGHT
    held: LeaseHandle | None = None
    counted: bool = False


def hint_id(request_id: object) -> str:
    """The id a request's hint goes under: vLLM's request id where the protocol can carry it
    (printable, at most ``max_text`` bytes; an API server may take it from a request header),
    else a digest of it, so that no request id can make a hint fail."""
    text = str(request_id)
    if text and text.isprintable() and len(text) <= DEFAULT_LIMITS.max_text // 4:
        return text
    return "kvcr-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


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


def _brief(exc: BaseException) -> str:
    """An error for a log line, cut short (it may quote what a request carried)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 200 else text[:200] + "..."


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
        source = extra.get("source")
        self.source = None if source is None else str(source)
        """The endpoint of another node that may hold the blocks (a hint per request)."""
        self.sources = SourcePolicy(self.endpoint, self.source, extra.get("allowed_sources", ()),
                                    "KvcrConnector: kv_connector_extra_config")
        """What a request's ``kv_transfer_params`` may name: this node, ``source``, ``allowed_sources``."""
        self.pool = str(extra.get("pool", "kv"))
        self.verify = bool(extra.get("verify", False))
        self.load_timeout_s = _seconds(extra, "load_timeout_s", LOAD_TIMEOUT_S, 3600)
        self.lookup_timeout_s = _seconds(extra, "lookup_timeout_s", LOOKUP_TIMEOUT_S, LOOKUP_TIMEOUT_MAX_S)
        self.lookup_wait_s = _seconds(extra, "lookup_wait_s", min(LOOKUP_WAIT_S, self.lookup_timeout_s),
                                      self.lookup_timeout_s, zero=True)
        self._causes = CauseLog(log)
        """Refusals and failures a request can cause are logged once per cause and window, not per request."""
        self.block_size = int(vllm_config.cache_config.block_size)
        # Keys name the model (engines that share blocks must agree on it: its id, or its path).
        model_id = extra.get("model_id") or vllm_config.model_config.model
        self.salt = f"{model_id}|{vllm_config.model_config.dtype}|{self.block_size}".encode()
        self.client = Client(self.endpoint, name=f"vllm-{role.name.lower()}")
        self._lock = threading.Lock()
        # Scheduler side.
        layers = sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 0
        self.max_blocks = min(DEFAULT_LIMITS.max_keys, DEFAULT_LIMITS.max_spans // max(1, 2 * layers))
        """The most blocks a request leases and loads: what one message may carry (two spans a layer)."""
        self._lookups: dict[str, _Lookup] = {}
        self._abandoned: list[OpHandle[LeaseHandle]] = []
        """Leases given up on while in flight: released as they come in (``_sweep``)."""
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

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` a lease holds for the request; None ("not yet")
        while its lookup is in flight, for at most ``lookup_timeout_s``, then a miss. Never
        raises: whatever the request carries, the worst it gets is a miss."""
        try:
            return self._matched(request, num_computed_tokens), False
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._count("lookup_errors")
            self._causes.warn(f"lookup:{type(exc).__name__}", "kvcr: a request could not be looked up (%s): a miss",
                              _brief(exc))
            lookup = self._lookups.get(getattr(request, "request_id", None))  # type: ignore[arg-type]
            if lookup is not None:
                self._give_up(lookup)
            return 0, False

    def _matched(self, request: Any, num_computed_tokens: int) -> int | None:
        self._sweep()
        request_id = request.request_id
        lookup = self._lookups.get(request_id)
        wait = 0.0
        if lookup is None or lookup.stage is _Stage.ADMITTED:
            tokens = list(request.prompt_token_ids or [])
            keys = block_keys(tokens[:-1], self.block_size, self.salt)[: self.max_blocks]  # one token is always computed
            if not keys:
                return 0
            if lookup is not None and lookup.hint_id is not None:
                self.client.discard_hint(lookup.hint_id)
            lookup = self._start_lookup(request, keys)
            self._lookups[request_id] = lookup
            wait = self.lookup_wait_s
        if lookup.stage is _Stage.IN_FLIGHT:
            self._poll_lookup(lookup, wait)
        if lookup.stage is _Stage.IN_FLIGHT:
            return None
        if lookup.stage is not _Stage.LEASED or lookup.held is None:
            return 0
        lease = lookup.held
        held = lease.held_prefix() * self.block_size
        if held <= num_computed_tokens:
            if lease.id and lease.ended is None:
                lease.release()  # not waited for: the reply is read in the background
            lookup.stage, lookup.held = _Stage.MISSED, None
            return 0
        old = self._leases.get(request_id)
        if old is not None and old is not lease and old.ended is None and old.id:
            old.release()
        self._leases[request_id] = lease
        self._keys[request_id] = lookup.keys
        if not lookup.counted:
            lookup.counted = True
            self._count("leases")
            self._count("matched_tokens", held - num_computed_tokens)
        return held - num_computed_tokens

    def _start_lookup(self, request: Any, keys: list[bytes]) -> _Lookup:
        """Send the request's hint (where its source is an allowed one) and lease, waiting for neither:
        the node reads a session's messages in order, so the lease finds the hint."""
        verdict = self.sources.judge(getattr(request, "kv_transfer_params", None))
        if verdict.refused is not None:
            self._refused(verdict.refused)
        hinted = hint_id(request.request_id) if verdict.source is not None else None
        lookup = _Lookup(keys, verdict.source, hinted, None, time.monotonic())
        if verdict.source is not None and hinted is not None:
            self.client.submit_hint(hinted, verdict.source, keys)
        lookup.lease = self.client.lease(keys, request_id=hinted)
        return lookup

    def _refused(self, why: Refusal) -> None:
        self._count("sources_refused")
        self._causes.warn(f"source:{why.name}", "kvcr: a request named %s; looked up without it, nothing dialled "
                          "(allowed: this node, extra_config source and allowed_sources)", why.value)

    def _poll_lookup(self, lookup: _Lookup, wait: float) -> None:
        """Take the lease's answer if it is in (waiting up to ``wait`` for it); give up past the bound."""
        handle = lookup.lease
        assert handle is not None
        remaining = lookup.started + self.lookup_timeout_s - time.monotonic()
        if not handle.done() and wait > 0 and remaining > 0:
            try:
                handle.result(min(wait, remaining))
            except (TimeoutError, KvcrError):
                pass  # read below
        if handle.done():
            try:
                lookup.held = handle.result(0)
            except (KvcrError, TimeoutError) as exc:
                self._count("lookup_errors")
                self._causes.warn(f"lease:{type(exc).__name__}", "kvcr: a lease failed (%s): a miss", _brief(exc))
                lookup.stage = _Stage.MISSED
            else:
                lookup.stage = _Stage.LEASED
            return
        if time.monotonic() - lookup.started >= self.lookup_timeout_s:
            self._count("lookups_timed_out")
            self._causes.warn("lookup:timeout", "kvcr: a lookup%s took over lookup_timeout_s (%.3f s): a miss",
                              f" at {lookup.source}" if lookup.source else "", self.lookup_timeout_s)
            self._give_up(lookup)

    def _give_up(self, lookup: _Lookup) -> None:
        """A miss for good; a lease still in flight is released once it comes in."""
        if lookup.stage is _Stage.IN_FLIGHT and lookup.lease is not None:
            self._abandoned.append(lookup.lease)
        lookup.stage, lookup.held = _Stage.MISSED, None

    def _sweep(self) -> None:
        """Release the leases given up on that came in since (each is answered within the
        client's control deadline, so the list drains)."""
        if not self._abandoned:
            return
        waiting = []
        for handle in self._abandoned:
            if not handle.done():
                waiting.append(handle)
                continue
            try:
                lease = handle.result(0)
            except (KvcrError, TimeoutError):
                continue
            if lease.id and lease.ended is None:
                lease.release()
        self._abandoned = waiting

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        try:
            lookup = self._lookups.get(request.request_id)
            if lookup is not None:
                if lookup.stage is _Stage.IN_FLIGHT:  # admitted without it (vLLM skipped the prefix cache)
                    self._give_up(lookup)
                lookup.stage = _Stage.ADMITTED
            if num_external_tokens <= 0:
                return
            keys = self._keys.get(request.request_id, [])
            block_ids = list(blocks.get_block_ids()[0])
            first = request.num_computed_tokens // self.block_size
            count = num_external_tokens // self.block_size
            source, hinted = (lookup.source, lookup.hint_id) if lookup is not None else (None, None)
            self._loads.append(_Load(request.request_id, keys[first : first + count], block_ids[first : first + count],
                                     source, hinted))
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._causes.warn(f"alloc:{type(exc).__name__}", "kvcr: noting a request's blocks failed (%s)", _brief(exc))

    def build_connector_meta(self, scheduler_output: Any) -> KvcrConnectorMetadata:
        """What the workers load and save this step. Never raises: a request whose saves cannot
        be worked out is not saved (the loads stand, so vLLM is told of any that fail)."""
        meta = KvcrConnectorMetadata(loads=self._loads)
        self._loads = []
        try:
            self._sweep()
            self._plan_saves(meta, scheduler_output)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._causes.warn(f"meta:{type(exc).__name__}", "kvcr: saves of this step not planned (%s)", _brief(exc))
        return meta

    def _plan_saves(self, meta: KvcrConnectorMetadata, scheduler_output: Any) -> None:
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
        """Let go of the request's lease and hint (waiting for neither); name this node for a
        decode engine elsewhere (which may use it where its operator allowed this node)."""
        try:
            request_id = request.request_id
            lease = self._leases.pop(request_id, None)
            self._keys.pop(request_id, None)
            self._saving.pop(request_id, None)
            lookup = self._lookups.pop(request_id, None)
            if lookup is not None:
                held = lookup.held
                if held is not None and held is not lease and held.id and held.ended is None:
                    held.release()
                self._give_up(lookup)
                if lookup.hint_id is not None:
                    self.client.discard_hint(lookup.hint_id)
            if lease is not None and lease.ended is None and lease.id:
                lease.release()
            self._sweep()
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._causes.warn(f"finish:{type(exc).__name__}", "kvcr: ending a request failed (%s)", _brief(exc))
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
        hints that source in this worker's own session first (hints are per session). Never
        raises: a load that cannot start (a source not allowed here, an argument the node
        refuses) has its blocks reported failed, and vLLM recomputes them."""
        self._handles = []
        try:
            meta = self._get_connector_metadata()
            loads = list(meta.loads)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._causes.warn(f"load:{type(exc).__name__}", "kvcr: no loads this step (%s)", _brief(exc))
            return
        for load in loads:
            try:
                self._start_load(load)
            except Exception as exc:
                # The boundary with vLLM: an exception here would stop its engine (module docstring).
                self._count("load_errors")
                self._failed.update(int(b) for b in load.block_ids)
                self._causes.warn(f"load:{type(exc).__name__}", "kvcr: a load could not start (%s); its blocks "
                                  "are recomputed", _brief(exc))

    def _start_load(self, load: _Load) -> None:
        if not load.keys:
            return
        hinted = None
        if load.source is not None:
            if not self.sources.permits(load.source):
                self._count("sources_refused")
                raise ValueError("the load names a source that is not allowed here, nothing dialled")
            hinted = load.hint_id if load.hint_id is not None else hint_id(load.request_id)
            # Not waited for: the node reads the session's messages in order, so the deliver finds it.
            self.client.submit_hint(hinted, load.source, load.keys)
        try:
            objects = {key: self._spans(block_id) for key, block_id in zip(load.keys, load.block_ids, strict=True)}
            blocks = {key: [block_id] for key, block_id in zip(load.keys, load.block_ids, strict=True)}
            self._count("loads")
            handle = self.client.deliver(objects, request_id=hinted, plan=self._plan(),
                                         deadline_ms=int(self.load_timeout_s * 1000))
        except BaseException:
            if hinted is not None:
                self.client.discard_hint(hinted)
            raise
        self._handles.append(_Pending(handle, blocks, load.request_id, hinted))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's group of every load of the step; never raises (a layer that
        does not land fails its load, whose blocks vLLM then recomputes)."""
        if not self._handles or layer_name not in self._regions:
            return
        try:
            self._wait_layer(layer_name)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._causes.warn(f"layer:{type(exc).__name__}", "kvcr: waiting for a layer failed (%s)", _brief(exc))
            for pending in self._handles:
                self._failed.update(b for ids in pending.blocks.values() for b in ids)
            self._handles = []

    def _wait_layer(self, layer_name: str) -> None:
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
        except (KvcrError, TimeoutError) as exc:
            failed = set(blocks)
            self._count("load_errors")
            log.warning("kvcr: load for %s failed: %s", pending.request_id, exc)
        else:
            failed = {key for key in blocks if key not in results or not results[key].ok}
            for key in failed:
                log.warning("kvcr: block %s not loaded: %s", key.hex()[:12], results[key] if key in results else "no answer")
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
        if pending.hint_id is not None:
            self.client.discard_hint(pending.hint_id)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole once the step computed them (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        """Deposit the blocks this step computed; never raises (a save that fails is counted)."""
        try:
            self._save()
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine (module docstring).
            self._count("save_errors")
            self._causes.warn(f"save:{type(exc).__name__}", "kvcr: saving failed (%s)", _brief(exc))

    def _save(self) -> None:
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
        except (KvcrError, TimeoutError) as exc:
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
