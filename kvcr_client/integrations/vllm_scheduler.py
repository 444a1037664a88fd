"""vLLM: the connector's scheduler side (``KvcrScheduler``), in vLLM's scheduler process.

``get_num_new_matched_tokens`` leases the prompt's blocks and counts the leading ones held
(here, or at the node ``extra_config["source"]`` names, through a hint), so an admitted
request cannot lose them; ``update_state_after_alloc`` notes where they go;
``build_connector_meta`` tells the workers what to load and save (``KvcrConnectorMetadata``,
all that reaches them); ``request_finished`` releases the lease and names this node in
``kv_transfer_params``. A request that arrives with those params has its blocks looked for
at the node they name only where the operator allowed it (``SourcePolicy``). The lookup never
holds the scheduler: its hint and lease are sent without waiting, the call waits
``lookup_wait_s`` at most, then answers "not yet" (None) until the lease is in, and a miss
past ``lookup_timeout_s``. A node that leaves the heartbeat sent with a lookup unanswered for
half that (``Settings.stall_s``; frozen: ``NodeLink.stalled``) costs the request that found it
that much and no other: later lookups
are misses at once, and the step's metadata tells the workers not to wait on it to save, until
it speaks again. No call raises into vLLM: the worst is a miss, counted and logged
once per cause (``CauseLog``). While the node is away (``NodeLink``: lost, reconnecting with
backoff) a lookup is a miss at once; once it is back, lookups lease again, and after a
restart (what the old incarnation held is gone) no block counts as pinned by a lease.

Block keys come from vLLM's own block hashes (``Request.block_hashes``), which fold in the
request's LoRA adapter, multimodal inputs and ``cache_salt`` under vLLM's configured hash,
salted with the fingerprint (``Fingerprint.engine_keys``): requests that differ in any of
them never share a block, and a block's key derives from the hash vLLM publishes for it in
its own KV events (docs/architecture.md section 5, "Engine block keys"). A request's keys are
taken as vLLM allocates its blocks (``update_state_after_alloc``), for the saves that
``build_connector_meta`` plans from what reaches it (which has no hashes).

Tensor parallelism: each worker rank stores and loads its slice of a block as an object of
its own (``Fingerprint.slice_key``). This side, one process for all ranks, leases every
rank's slice of each block, and a block is a hit only when all of them are held.

What is not saved again follows the node, not a memory of what this side saved: the blocks
the request's own lease holds (pinned until the request ends) are not deposited again; any
other the node holds is answered DUPLICATE, with no transfer (spec section 5.2), and a block
the node evicted is stored again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from kvcr_client.errors import KvcrError
from kvcr_client.integrations.nodelink import NodeLink
from kvcr_client.integrations.sources import CauseLog, Refusal
from kvcr_client.integrations.vllm_common import BlockLoad, Counts, KvcrConnectorMetadata, Settings, brief, hint_id, log
from kvcr_client.leases import LeaseHandle
from kvcr_client.results import OpHandle
from kvcr_protocol import DEFAULT_LIMITS, LeaseStatus


@dataclass
class _Saving:
    """A request whose prompt blocks are being saved, step by step (chunked prefill)."""

    keys: list[bytes]
    """One key per full block of the prompt."""
    block_ids: list[int]
    prompt_tokens: int
    saved: int = 0
    """Blocks before this one are saved (or were loaded, or were cached already)."""
    held: frozenset[bytes] = frozenset()
    """Blocks the request's lease holds in the node: not deposited again."""


COMING = frozenset({LeaseStatus.LEASED, LeaseStatus.LEASED_REMOTE, LeaseStatus.PENDING})
"""The statuses of a block's slices that make a lookup ask again: some on their way, none missing."""


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
    whole: frozenset[bytes] = frozenset()
    """The blocks (``keys``) this node holds whole, every rank's slice, under the request's lease
    (so it cannot evict them while the request runs): not saved again. Empty once released."""


class KvcrScheduler:
    """The scheduler side of ``KvcrConnector``: lookups, leases, and what each step loads and saves."""

    def __init__(self, settings: Settings, kv_cache_config: Any) -> None:
        self.settings = settings
        self.counts = Counts()
        self._causes = CauseLog(log)
        """Refusals and failures a request can cause are logged once per cause and window, not per request."""
        self.link = NodeLink(settings.endpoint, "vllm-scheduler", self.counts.add, log, self._node_restarted)
        self.client = self.link.client
        layers = sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 0
        self.ranks = settings.fingerprint.tp_size
        self.max_blocks = min(DEFAULT_LIMITS.max_keys // self.ranks, DEFAULT_LIMITS.max_spans // max(1, 2 * layers))
        """The most blocks a request leases and loads: what one message may carry (a key per rank's
        slice in the lease, two spans a layer in a worker's deliver)."""
        self._lookups: dict[str, _Lookup] = {}
        self._abandoned: list[OpHandle[LeaseHandle]] = []
        """Leases given up on while in flight: released as they come in (``_sweep``)."""
        self._keys: dict[str, list[bytes]] = {}
        self._leases: dict[str, LeaseHandle] = {}
        self._loads: list[BlockLoad] = []
        self._saving: dict[str, _Saving] = {}
        self._prompts: dict[str, tuple[list[bytes], int]] = {}
        """Requests vLLM allocated blocks for, until their saves are planned (or they end): the
        keys of their prompt's full blocks, and the prompt's tokens."""
        log.info("kvcr: block keys from vLLM's block hashes (%s) under %s; servers share blocks when both agree",
                 settings.block_hashes or "as configured", settings.fingerprint)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` a lease holds for the request; None ("not yet")
        while its lookup is in flight, for at most ``lookup_timeout_s``, then a miss. Never
        raises: whatever the request carries, the worst it gets is a miss."""
        try:
            return self._matched(request, num_computed_tokens), False
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine.
            self.counts.add("lookup_errors")
            self._causes.warn(f"lookup:{type(exc).__name__}", "kvcr: a request could not be looked up (%s): a miss",
                              brief(exc))
            lookup = self._lookups.get(getattr(request, "request_id", None))  # type: ignore[arg-type]
            if lookup is not None:
                self._give_up(lookup)
            return 0, False

    def _matched(self, request: Any, num_computed_tokens: int) -> int | None:
        self._sweep()
        request_id = request.request_id
        lookup = self._lookups.get(request_id)
        if not self.link.ready(self.settings.lookup_wait_s):
            # The node is away: a miss now, without waiting for it (a reconnect is under way).
            if lookup is not None and lookup.stage is not _Stage.MISSED:
                self._give_up(lookup)
            self.counts.add("node_away")
            return 0
        if (lookup is None or lookup.stage is _Stage.ADMITTED) and self.link.stalled(self.settings.stall_s):
            # The node left a heartbeat unanswered past its bound (frozen): a miss now,
            # with no lease it would not answer; lookups lease again once it speaks.
            self.counts.add("node_stalled")
            return 0
        wait = 0.0
        if lookup is None or lookup.stage is _Stage.ADMITTED:
            # One token is always computed: the block that would end at the prompt's end is not looked up.
            keys = self._prompt_keys(request, request.num_prompt_tokens - 1)[: self.max_blocks]
            if not keys:
                return 0
            if lookup is not None and lookup.hint_id is not None:
                self.client.discard_hint(lookup.hint_id)
            lookup = self._start_lookup(request, keys)
            self._lookups[request_id] = lookup
            wait = self.settings.lookup_wait_s
        if lookup.stage is _Stage.IN_FLIGHT:
            self._poll_lookup(lookup, wait)
        if lookup.stage is _Stage.LEASED and self._coming(lookup):
            self._ask_again(lookup)
        if lookup.stage is _Stage.IN_FLIGHT:
            return None
        if lookup.stage is not _Stage.LEASED or lookup.held is None:
            return 0
        lease = lookup.held
        leading, _ = self.settings.fingerprint.whole_blocks(lookup.keys, lease.held)
        held = leading * self.settings.block_size
        if held <= num_computed_tokens:
            if lease.id and lease.ended is None:
                lease.release()  # not waited for: the reply is read in the background
            lookup.stage, lookup.held = _Stage.MISSED, None
            lookup.whole = frozenset()  # no longer pinned: the node may evict them before they would be saved
            return 0
        old = self._leases.get(request_id)
        if old is not None and old is not lease and old.ended is None and old.id:
            old.release()
        self._leases[request_id] = lease
        self._keys[request_id] = lookup.keys
        if not lookup.counted:
            lookup.counted = True
            self.counts.add("leases")
            self.counts.add("matched_tokens", held - num_computed_tokens)
        return held - num_computed_tokens

    def _prompt_keys(self, request: Any, tokens: int) -> list[bytes]:
        """The keys of the request's full blocks within its first ``tokens`` tokens, from the
        block hashes vLLM computed for it (as many as it has: none where vLLM hashes nothing)."""
        per = self.settings.hashes_per_block
        blocks = max(0, int(tokens)) // self.settings.block_size
        return self.settings.fingerprint.engine_keys(list(request.block_hashes[: blocks * per]), per)

    def _start_lookup(self, request: Any, keys: list[bytes]) -> _Lookup:
        """Send the request's hint (where its source is an allowed one) and lease, waiting for neither:
        the node reads a session's messages in order, so the lease finds the hint."""
        verdict = self.settings.sources.judge(getattr(request, "kv_transfer_params", None))
        if verdict.refused is not None:
            self._refused(verdict.refused)
        hinted = hint_id(request.request_id) if verdict.source is not None else None
        # A heartbeat first: the node's loop answers it at once whatever the lease waits for
        # (a source's dial), so a node that has not answered it by the lookup's bound, counted
        # from after it went, is stalled.
        self.link.probe()
        lookup = _Lookup(keys, verdict.source, hinted, None, time.monotonic())
        slices = self.settings.fingerprint.all_slices(keys)
        if verdict.source is not None and hinted is not None:
            self.client.submit_hint(hinted, verdict.source, slices)
        # No read grant: the workers deliver, each in a session of its own, which a grant of
        # this session's would not reach (spec section 6.12); each worker read-leases the
        # blocks it loads itself (docs/architecture.md section 5, "Engines under read grants").
        lookup.lease = self.client.lease(slices, request_id=hinted, read=False)
        return lookup

    def _coming(self, lookup: _Lookup) -> bool:
        """Whether the block after the lease's leading whole ones is on its way into the node:
        every rank's slice of it held or ``PENDING`` (read back from the node's disk tier, which
        the lease set going, or still being written), and the lookup's bound not yet reached."""
        lease = lookup.held
        if lease is None or time.monotonic() - lookup.started >= self.settings.lookup_timeout_s:
            return False
        fingerprint = self.settings.fingerprint
        leading, _ = fingerprint.whole_blocks(lookup.keys, lease.held)
        if leading >= len(lookup.keys):
            return False
        statuses = {lease.status(fingerprint.slice_key(lookup.keys[leading], rank)) for rank in range(self.ranks)}
        return LeaseStatus.PENDING in statuses and statuses <= COMING

    def _ask_again(self, lookup: _Lookup) -> None:
        """Lease the request's blocks again (the lookup goes on under its first bound): vLLM asks
        again next step, by when the node may have read them back. The partial lease goes."""
        lease = lookup.held
        if lease is not None and lease.id and lease.ended is None:
            lease.release()  # not waited for: the reply is read in the background
        lookup.held, lookup.whole, lookup.stage = None, frozenset(), _Stage.IN_FLIGHT
        lookup.lease = self.client.lease(self.settings.fingerprint.all_slices(lookup.keys), request_id=lookup.hint_id,
                                         read=False)
        self.counts.add("lookups_asked_again")

    def _refused(self, why: Refusal) -> None:
        self.counts.add("sources_refused")
        self._causes.warn(f"source:{why.name}", "kvcr: a request named %s; looked up without it, nothing dialled "
                          "(allowed: this node, extra_config source and allowed_sources)", why.value)

    def _poll_lookup(self, lookup: _Lookup, wait: float) -> None:
        """Take the lease's answer if it is in (waiting up to ``wait`` for it); give up past the bound."""
        handle = lookup.lease
        assert handle is not None
        remaining = lookup.started + self.settings.lookup_timeout_s - time.monotonic()
        if not handle.done() and wait > 0 and remaining > 0:
            try:
                handle.result(min(wait, remaining))
            except (TimeoutError, KvcrError):
                pass  # read below
        if handle.done():
            try:
                lookup.held = handle.result(0)
            except (KvcrError, TimeoutError) as exc:
                self.counts.add("lookup_errors")
                self._causes.warn(f"lease:{type(exc).__name__}", "kvcr: a lease failed (%s): a miss", brief(exc))
                lookup.stage = _Stage.MISSED
            else:
                lookup.stage = _Stage.LEASED
                lease = lookup.held
                local = frozenset(k for k in lease.held if lease.tier(k) != "remote")  # a source's blocks are saved here
                lookup.whole = frozenset(self.settings.fingerprint.whole_blocks(lookup.keys, local)[1])
            return
        if self.link.stalled(self.settings.stall_s):
            # The heartbeat sent with the lookup is unanswered past its bound: the node is
            # frozen, and the lease behind the heartbeat is not coming either.
            self.counts.add("lookups_timed_out")
            self._causes.warn("lookup:stalled", "kvcr: the node left a lookup's heartbeat unanswered for %.3f s "
                              "(frozen): a miss, and lookups miss until it answers", self.settings.stall_s)
            self._give_up(lookup)
        elif time.monotonic() - lookup.started >= self.settings.lookup_timeout_s:
            self.counts.add("lookups_timed_out")
            self._causes.warn("lookup:timeout", "kvcr: a lookup%s took over lookup_timeout_s (%.3f s): a miss",
                              f" at {lookup.source}" if lookup.source else "", self.settings.lookup_timeout_s)
            self._give_up(lookup)

    def _node_restarted(self) -> None:
        """The node came back as another incarnation: what it held is gone, the requests'
        leases with it, so no block is pinned any more and each is saved again."""
        for saving in self._saving.values():
            saving.held = frozenset()

    def _give_up(self, lookup: _Lookup) -> None:
        """A miss for good; a lease still in flight is released once it comes in."""
        if lookup.stage is _Stage.IN_FLIGHT and lookup.lease is not None:
            self._abandoned.append(lookup.lease)
        lookup.stage, lookup.held = _Stage.MISSED, None
        lookup.whole = frozenset()

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
            prompt_tokens = int(request.num_prompt_tokens)
            self._prompts[request.request_id] = self._prompt_keys(request, prompt_tokens), prompt_tokens
            lookup = self._lookups.get(request.request_id)
            if lookup is not None:
                if lookup.stage is _Stage.IN_FLIGHT:  # admitted without it (vLLM skipped the prefix cache)
                    self._give_up(lookup)
                lookup.stage = _Stage.ADMITTED
            if num_external_tokens <= 0:
                return
            keys = self._keys.get(request.request_id, [])
            block_ids = list(blocks.get_block_ids()[0])
            first = request.num_computed_tokens // self.settings.block_size
            count = num_external_tokens // self.settings.block_size
            source, hinted = (lookup.source, lookup.hint_id) if lookup is not None else (None, None)
            self._loads.append(BlockLoad(request.request_id, keys[first : first + count], block_ids[first : first + count],
                                     source, hinted))
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine.
            self._causes.warn(f"alloc:{type(exc).__name__}", "kvcr: noting a request's blocks failed (%s)", brief(exc))

    def build_connector_meta(self, scheduler_output: Any) -> KvcrConnectorMetadata:
        """What the workers load and save this step. Never raises: a request whose saves cannot
        be worked out is not saved (the loads stand, so vLLM is told of any that fail)."""
        meta = KvcrConnectorMetadata(loads=self._loads, node_stalled=self.link.stalled(self.settings.stall_s),
                                     node_away=not self.link.up)
        self._loads = []
        try:
            self._sweep()
            self._plan_saves(meta, scheduler_output)
        except Exception as exc:
            # The boundary with vLLM: an exception here would stop its engine.
            self._causes.warn(f"meta:{type(exc).__name__}", "kvcr: saves of this step not planned (%s)", brief(exc))
        return meta

    def _plan_saves(self, meta: KvcrConnectorMetadata, scheduler_output: Any) -> None:
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            # Keyed as vLLM allocated it (a request allocated otherwise is not saved).
            keys, prompt_tokens = self._prompts.pop(new.req_id, ([], 0))
            # Blocks vLLM counts computed (loaded from kvcr, or in its own cache) are not saved,
            # nor those the request's lookup found in the node.
            lookup = self._lookups.get(new.req_id)
            saving = _Saving(keys, list(new.block_ids[0]), prompt_tokens,
                             new.num_computed_tokens // self.settings.block_size,
                             lookup.whole if lookup is not None else frozenset())
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
                saving.saved = min(saving.saved, cached.num_computed_tokens[i] // self.settings.block_size)
            elif new_ids:
                saving.block_ids.extend(new_ids[0])
            self._save_computed(meta, req_id, saving, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))

    def _save_computed(self, meta: KvcrConnectorMetadata, request_id: str, saving: _Saving, computed: int) -> None:
        """Add to ``meta.saves`` the prompt blocks this step completes that are not saved yet
        (nor held by the request's lease: the node answers DUPLICATE, without a transfer, for
        any other it holds already)."""
        end = min(min(computed, saving.prompt_tokens) // self.settings.block_size, len(saving.keys), len(saving.block_ids))
        fresh = [b for b in range(saving.saved, end) if saving.keys[b] not in saving.held]
        saving.saved = max(saving.saved, end)
        if fresh:
            meta.saves.append(BlockLoad(request_id, [saving.keys[b] for b in fresh], [saving.block_ids[b] for b in fresh],
                                        parents=[saving.keys[b - 1] if b else b"" for b in fresh]))

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them once they are."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for saving in self._saving.values():
            first = next((b for b, block_id in enumerate(saving.block_ids[: saving.saved]) if block_id in invalid), None)
            if first is not None:
                saving.saved = first
                saving.held = saving.held - set(saving.keys[first:])  # what did not load is saved once recomputed

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Let go of the request's lease and hint (waiting for neither); name this node for a
        decode engine elsewhere (which may use it where its operator allowed this node)."""
        try:
            request_id = request.request_id
            lease = self._leases.pop(request_id, None)
            self._keys.pop(request_id, None)
            self._saving.pop(request_id, None)
            self._prompts.pop(request_id, None)
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
            # The boundary with vLLM: an exception here would stop its engine.
            self._causes.warn(f"finish:{type(exc).__name__}", "kvcr: ending a request failed (%s)", brief(exc))
        return False, {"kvcr_endpoint": self.settings.endpoint}

    def shutdown(self) -> None:
        for lease in list(self._leases.values()):
            if lease.ended is None and lease.id:
                lease.release()
        self.link.close()
