"""vLLM: the connector's worker side (``KvcrWorker``), in each of vLLM's worker processes.

``register_kv_caches`` registers each layer's tensor once; ``start_load_kv`` sends one
deliver per request of the step's metadata (``KvcrConnectorMetadata``, from the scheduler
side: all this side knows of it) with a layer plan (group i: layer i of every block);
``wait_for_layer_load(layer)`` waits for that layer's group only; ``wait_for_save``
stores the full prompt blocks the step computed with a ``put`` (spec section 6.13): the worker
WRITEs them into slots the node reserved and the step goes on once they are written, the
commit answering a later step (a node that grants no writes reads them instead, and the step
waits for that). A save the node does not answer within ``save_timeout_s`` is given up (no
byte of it was written) and saves pause for ``SAVE_PAUSE_S``: a stalled node costs the engine
one bounded wait, not every step; where the scheduler side already finds the node stalled
(the step's metadata says so) the step does not wait on it at all. A block that failed to load is reported
by ``get_block_ids_with_load_errors``, never a hang, and vLLM recomputes it with
``kv_load_failure_policy="recompute"``. No call raises into vLLM. While the node is away
(``NodeLink``: lost, reconnecting with backoff) a step's loads are reported failed at once and
its saves skipped; the reconnecting hello announces the registered KV cache again, so loads
and saves resume with the node, a restarted one included.

Read grants (spec section 6.12): the scheduler's lease lives in the scheduler's session, and
a grant serves only the session that holds the lease, so the worker takes a read lease of
its own for the blocks of each local load (``ReadLeases``), all of a step's sent before the
first is waited for, and releases it after the load's last layer. Where the node grants
them the deliver READs the node's pools with this worker's agent (``grant_loads`` counts
it); where it does not (``client_transfers = false``, a node below version 5, blocks a
source holds), the node delivers, as before. A block whose read the lease may not have
covered fails (``LEASE_EXPIRED``, ``LEASE_LOST``) like any block that did not load: it is
reported, never shown to vLLM with bytes that may be another block's.

Tensor parallelism: each rank's worker holds its own slice of every layer's KV (its KV
heads), and stores and loads it as an object of its own: the metadata names blocks by their
chain key, and the worker turns each into its rank's slice key (``Fingerprint.slice_key``),
so a rank only ever loads the bytes the same rank saved. A pool slot holds one layer's block
of one rank's slice (K or V, where a layer keeps them apart).

``extra_config["block_observer"]`` (a verification aid, ``"module:Class"``) names a
``BlockObserver`` subclass each worker makes without arguments and shows every block's bytes
in vLLM's cache as saved, and as loaded once every layer landed: a test proves with it that
the bytes the model read are the bytes another engine computed. In vLLM's in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the observer lives in the caller's process.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvcr_client.client import RegionHandle, Span
from kvcr_client.errors import GroupFailed, KvcrError
from kvcr_client.integrations.nodelink import NodeLink
from kvcr_client.integrations.readleases import LEASE_WAIT_S, ReadLeases
from kvcr_client.integrations.sources import CauseLog
from kvcr_client.integrations.vllm_common import BlockLoad, Counts, KvcrConnectorMetadata, Settings, brief, hint_id, log
from kvcr_client.leases import LeaseHandle
from kvcr_client.results import DeliverHandle, KeyOutcome, OpHandle, Results
from kvcr_io.plugins import load_class
from kvcr_protocol import ErrorCode

WAIT_S = 30.0
"""How long a deposit (the node reading the blocks) may take."""
SAVE_PAUSE_S = 5.0
"""How long saves pause after one the node did not answer within ``save_timeout_s``."""
SHUTDOWN_SETTLE_S = 2.0
"""How long shutdown waits for the commits of the last saves (so that they are counted)."""
COMMITS_KEPT = 1024
"""Saves whose commit is still to answer, kept to be counted (the oldest let go beyond)."""
REPLY_SLACK_S = 5.0
"""How much longer than the deadline a layer waits for the node to say it failed."""
CONNECT_WAIT_S = 0.2
"""How long a step waits for the welcome of a reconnecting hello it sent (the hello announces
the KV cache again). Not while the scheduler side finds the node away too
(``KvcrConnectorMetadata.node_away``): then the hello goes, nothing waits for it, and the
step saves nothing."""


class BlockObserver:
    """Shown blocks' bytes in vLLM's cache (``extra_config["block_observer"]``): ``parts`` are the
    block's bytes in each layer, in span order, valid during the call only."""

    def saved(self, key: bytes, parts: list[memoryview]) -> None:
        """Block ``key`` as deposited."""

    def loaded(self, key: bytes, parts: list[memoryview]) -> None:
        """Block ``key`` once every layer of it landed."""


def load_observer(name: object) -> BlockObserver | None:
    """The ``BlockObserver`` that ``"module:Class"`` names, made without arguments (None for
    None); a clear error naming the key otherwise. A class that is not a ``BlockObserver``
    subclass is refused unrun."""
    if name is None:
        return None
    what = f"KvcrConnector: kv_connector_extra_config['block_observer'] {name!r}"
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{what} must be 'module:Class'")
    cls = load_class(name, BlockObserver, what)
    try:
        return cls()
    except Exception as exc:
        raise ValueError(f"{what} cannot be made without arguments: {exc}") from exc


@dataclass
class _Pending:
    """A request's deliver in this step, until its last layer."""

    handle: DeliverHandle
    blocks: dict[bytes, list[int]]
    """Key -> the vLLM block ids it fills."""
    request_id: str
    hint_id: str | None
    lease: LeaseHandle | None = None
    """This worker's read lease of the blocks, released after the last layer."""
    group_failed: bool = False


@dataclass
class _Prepared:
    """A load whose objects are laid out, its read lease asked for (None: the node delivers)."""

    load: BlockLoad
    objects: dict[bytes, list[Span]]
    asked: OpHandle[LeaseHandle] | None


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank, as vLLM's parallel state has it (0 where it has none:
    an engine in one process)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())


class KvcrWorker:
    """The worker side of ``KvcrConnector``: the KV cache registered, each step's loads and saves
    of this rank's slice (``rank``: vLLM's, unless given)."""

    def __init__(self, settings: Settings, kv_cache_config: Any, rank: int | None = None) -> None:
        self.settings = settings
        self.rank = tensor_parallel_rank() if rank is None else rank
        settings.fingerprint.slice_key(b"", self.rank)  # a rank outside tp_size is refused here, by name
        self.kv_cache_config = kv_cache_config
        self.observer = load_observer(settings.extra.get("block_observer"))
        self.counts = Counts()
        self._causes = CauseLog(log)
        self.link = NodeLink(settings.endpoint, "vllm-worker", self.counts.add, log)
        self.client = self.link.client
        self.reads = ReadLeases(self.client, min(LEASE_WAIT_S, settings.load_timeout_s))
        self._layers: list[str] = []
        self._regions: dict[str, RegionHandle] = {}
        self._committing: collections.deque[OpHandle[Results[KeyOutcome]]] = collections.deque(maxlen=COMMITS_KEPT)
        """Saves written under a write grant whose commit is still to answer, oldest first."""
        self._paused_until = 0.0
        """Saves are passed over until then (monotonic seconds): one timed out."""
        self._tensors: dict[str, Any] = {}
        """Layer -> its paged KV tensor's bytes."""
        self._block_bytes: dict[str, int] = {}
        self._split: dict[str, int] = {}
        """Layer -> the byte offset of its V half (0: K and V of a block are one span)."""
        self._handles: list[_Pending] = []
        self._failed: set[int] = set()

    def _slices(self, load: BlockLoad) -> BlockLoad:
        """``load`` with each block's chain key (and parent) turned into this rank's slice key."""
        fingerprint = self.settings.fingerprint
        return replace(load, keys=[fingerprint.slice_key(key, self.rank) for key in load.keys],
                       parents=[fingerprint.slice_key(p, self.rank) if p else b"" for p in load.parents])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks if self.kv_cache_config is not None else None
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

    def _parts(self, block_id: int) -> list[memoryview]:
        """One block's bytes in vLLM's cache, every layer, in span order (for the observer)."""
        parts = []
        for span in self._spans(block_id):
            tensor = self._tensors[span.name.removesuffix(".k").removesuffix(".v")]
            parts.append(memoryview(tensor[span.offset : span.offset + span.length]))
        return parts

    def _observe(self, saved: bool, key: bytes, block_id: int) -> None:
        """Show the observer a block; one that fails is logged, and changes no outcome."""
        assert self.observer is not None
        try:
            (self.observer.saved if saved else self.observer.loaded)(key, self._parts(block_id))
        except Exception as exc:
            self._causes.warn(f"observer:{type(exc).__name__}", "kvcr: the block observer failed (%s)", brief(exc))

    def _plan(self) -> list[list[str]]:
        return [[f"{n}.k", f"{n}.v"] if self._split[n] else [n] for n in self._layers]

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """One deliver per request of the step's ``meta`` with a layer plan; a request whose blocks
        a source holds hints that source in this worker's own session first (hints are per
        session), one whose blocks this node holds is read-leased first (every lease of the
        step sent before the first is waited for). Never raises: a load that cannot start (a
        source not allowed here, an argument the node refuses) has its blocks reported failed,
        and vLLM recomputes them."""
        for stale in self._handles:  # a step whose last layer vLLM never waited for
            self.reads.release(stale.lease)
        self._handles = []
        try:
            if not isinstance(meta, KvcrConnectorMetadata):
                raise TypeError(f"the step's metadata is {type(meta).__name__}, not KvcrConnectorMetadata")
            loads = list(meta.loads)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine.
            self._causes.warn(f"load:{type(exc).__name__}", "kvcr: no loads this step (%s)", brief(exc))
            return
        if loads and not self.link.ready(0.0 if meta.node_away else CONNECT_WAIT_S):
            # The node is away: recomputed, without waiting for it (a reconnect is under way).
            for load in loads:
                self.counts.add("node_away")
                self._failed.update(int(b) for b in load.block_ids)
            return
        prepared = []
        for load in loads:
            try:
                ready = self._prepare(load)
            except Exception as exc:
                # The boundary with vLLM: an exception here would stop its engine.
                self._load_failed(load, exc)
                continue
            if ready is not None:
                prepared.append(ready)
        for ready in prepared:
            try:
                self._start_load(ready)
            except Exception as exc:
                # The boundary with vLLM: an exception here would stop its engine.
                self._load_failed(ready.load, exc)

    def _load_failed(self, load: BlockLoad, exc: Exception) -> None:
        self.counts.add("load_errors")
        self._failed.update(int(b) for b in load.block_ids)
        self._causes.warn(f"load:{type(exc).__name__}", "kvcr: a load could not start (%s); its blocks "
                          "are recomputed", brief(exc))

    def _prepare(self, load: BlockLoad) -> _Prepared | None:
        """Lay a load's objects out and ask its read lease (blocks a source holds get no
        grant in this version: the node delivers those)."""
        if not load.keys:
            return None
        load = self._slices(load)
        if load.source is not None and not self.settings.sources.permits(load.source):
            self.counts.add("sources_refused")
            raise ValueError("the load names a source that is not allowed here, nothing dialled")
        objects = {key: self._spans(block_id) for key, block_id in zip(load.keys, load.block_ids, strict=True)}
        asked = self.reads.ask(load.keys) if load.source is None else None
        return _Prepared(load, objects, asked)

    def _start_load(self, ready: _Prepared) -> None:
        load = ready.load
        hinted = None
        if load.source is not None:
            hinted = load.hint_id if load.hint_id is not None else hint_id(load.request_id)
            # Not waited for: the node reads the session's messages in order, so the deliver finds it.
            self.client.submit_hint(hinted, load.source, load.keys)
        lease = self.reads.take(ready.asked)
        try:
            blocks = {key: [block_id] for key, block_id in zip(load.keys, load.block_ids, strict=True)}
            self.counts.add("loads")
            handle, granted = self.reads.deliver(lambda: self.client.deliver(
                ready.objects, request_id=hinted, plan=self._plan(), deadline_ms=int(self.settings.load_timeout_s * 1000)))
        except BaseException:
            self.reads.release(lease)
            if hinted is not None:
                self.client.discard_hint(hinted)
            raise
        if granted:
            self.counts.add("grant_loads")
        self._handles.append(_Pending(handle, blocks, load.request_id, hinted, lease))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's group of every load of the step; never raises (a layer that
        does not land fails its load, whose blocks vLLM then recomputes)."""
        if not self._handles or layer_name not in self._regions:
            return
        try:
            self._wait_layer(layer_name)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine.
            self._causes.warn(f"layer:{type(exc).__name__}", "kvcr: waiting for a layer failed (%s)", brief(exc))
            for pending in self._handles:
                self._failed.update(b for ids in pending.blocks.values() for b in ids)
                self.reads.release(pending.lease)
            self._handles = []

    def _wait_layer(self, layer_name: str) -> None:
        group = self._layers.index(layer_name)
        self.counts.add("layer_waits")
        for pending in self._handles:
            try:
                pending.handle.wait(group, self.settings.load_timeout_s + REPLY_SLACK_S)
            except (GroupFailed, KvcrError, TimeoutError) as exc:
                log.warning("kvcr: layer %s failed to load for %s (%s)", layer_name, pending.request_id, exc)
                pending.group_failed = True
                self.counts.add("load_errors")
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
            results = pending.handle.result(self.settings.load_timeout_s + REPLY_SLACK_S)
        except (KvcrError, TimeoutError) as exc:
            failed = set(blocks)
            self.counts.add("load_errors")
            log.warning("kvcr: load for %s failed: %s", pending.request_id, exc)
        else:
            failed = {key for key in blocks if key not in results or not results[key].ok}
            for key in failed:
                log.warning("kvcr: block %s not loaded: %s", key.hex()[:12], results[key] if key in results else "no answer")
            if pending.group_failed and not failed:
                failed = set(blocks)
            self.counts.add("blocks_loaded", sum(1 for key in blocks if key not in failed))
            if self.observer is not None:
                for key, ids in blocks.items():
                    if key not in failed:
                        self._observe(False, key, ids[0])
        for key in failed:
            self._failed.update(blocks[key])
        if failed:
            log.warning("kvcr: %d of %d blocks of %s to be recomputed", len(failed), len(blocks), pending.request_id)
        self.reads.release(pending.lease)
        if pending.hint_id is not None:
            self.client.discard_hint(pending.hint_id)

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """Deposit the blocks the step's ``meta`` says it computed; never raises (a save that fails is counted)."""
        try:
            self._save(meta)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine.
            self.counts.add("save_errors")
            self._causes.warn(f"save:{type(exc).__name__}", "kvcr: saving failed (%s)", brief(exc))

    def _save(self, meta: KVConnectorMetadata | None) -> None:
        self.harvest()
        if meta is None:
            return
        if not isinstance(meta, KvcrConnectorMetadata):
            raise TypeError(f"the step's metadata is {type(meta).__name__}, not KvcrConnectorMetadata")
        saves = [self._slices(save) for save in meta.saves]
        objects = {key: self._spans(block_id, self.settings.pool) for save in saves
                   for key, block_id in zip(save.keys, save.block_ids, strict=True)}
        parents = {key: parent for save in saves for key, parent in zip(save.keys, save.parents, strict=False) if parent}
        if not objects:
            return
        if meta.node_stalled:
            self.counts.add("node_stalled")  # the scheduler side finds the node frozen: not saved, not waited on
            return
        if meta.node_away:
            # The scheduler side lost the node: not saved, not waited on (a save into a node
            # that stopped answering waits save_timeout_s); this side's own reconnect goes on.
            self.link.ready(0.0)
            self.counts.add("node_away")
            return
        if not self.link.ready(CONNECT_WAIT_S):
            self.counts.add("node_away")  # not saved: the node is away (a reconnect is under way)
            return
        if time.monotonic() < self._paused_until:
            self.counts.add("saves_paused")  # a save timed out a moment ago: the node is stalled
            return
        try:
            self.counts.add("saves")
            handle = self.client.put(objects, optional=True, deadline_ms=max(1, round(self.settings.save_timeout_s * 1e3)),
                                     parents=parents)
            # The blocks may be reused once this step is over: the step waits until they
            # are written (by this worker's WRITEs, or read by the node), not until stored.
            handle.written.result(WAIT_S)
            if handle.done() and _timed_out(handle.result(0)):
                self.counts.add("saves_timed_out")
                self._paused_until = time.monotonic() + SAVE_PAUSE_S
                log.warning("kvcr: the node did not take %d blocks within save_timeout_s (%gs): "
                            "saves pause for %gs", len(objects), self.settings.save_timeout_s, SAVE_PAUSE_S)
                return
            else:
                # Written: the blocks are vLLM's again; the commit answers a later step.
                self._committing.append(handle)
            if self.observer is not None:
                for save in saves:
                    for key, block_id in zip(save.keys, save.block_ids, strict=True):
                        self._observe(True, key, block_id)
        except (KvcrError, TimeoutError) as exc:
            self.counts.add("save_errors")
            log.warning("kvcr: saving %d blocks failed: %s", len(objects), exc)

    def harvest(self) -> None:
        """Count the saves whose commit has answered (vLLM asks for the counts once a step)."""
        while self._committing and self._committing[0].done():
            handle = self._committing.popleft()
            try:
                self._count_saved(handle.result(0))
            except (KvcrError, TimeoutError) as exc:
                self.counts.add("save_errors")
                log.warning("kvcr: committing saved blocks failed: %s", exc)

    def settle_saves(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every save's commit to answer, and count them: whether
        none is left (for a caller that reads the counts at once, and for shutdown)."""
        end = time.monotonic() + timeout_s
        while self._committing:
            try:
                self._committing[0].result(max(0.0, end - time.monotonic()))
            except TimeoutError:
                break
            except KvcrError:
                pass  # counted by harvest
            self.harvest()
        self.harvest()
        return not self._committing

    def _count_saved(self, results: Results[KeyOutcome]) -> None:
        self.counts.add("blocks_saved", sum(1 for r in results.values() if r.ok))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        self.counts.add("blocks_failed", len(failed))
        return failed

    def shutdown(self) -> None:
        self.settle_saves(SHUTDOWN_SETTLE_S)
        self.reads.close()
        self.link.close()


def _timed_out(results: Results[KeyOutcome]) -> bool:
    """Whether every block of a save failed ``TIMEOUT`` (the node did not answer the put in time)."""
    return bool(results) and all(not r.ok and r.code is ErrorCode.TIMEOUT for r in results.values())
