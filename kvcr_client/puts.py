"""Deposits under write grants (spec section 6.13): the client WRITEs new objects itself.

``Puts.put`` checks its arguments as ``deposit`` does, sends a ``put`` and returns its
handle at once; a ``PutJob`` (``kvcr_client.put_jobs``), stepped by the core's turns, WRITEs
every reserved span from the caller's registered memory into the slots the reply names,
then sends ``commit`` (or ``unput``). Keys another writer holds (``BUSY``) go by
``deposit``, which waits for that writer. A session below version 5, or a node that grants
no writes (``client_transfers`` off: it refuses ``put`` ``MUST_UNDERSTAND``), gets a plain
``deposit``: the node-driven path. Either way the handle is a ``StoreHandle``: ``written``
once the caller's memory is its own again, the results once the node answered.

``Puts`` plans the WRITEs (``_column_runs`` a block of columns at a time, ``_runs`` span by
span, both cut into runs by ``kvcr_io.runs``) and keeps what the session's resume token depends on: whether a WRITE of a put may
still land (``quiet``).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from kvcr_client import checks
from kvcr_client import spans as _spans
from kvcr_client.core import ClientCore
from kvcr_client.counters import Count, Counters
from kvcr_client.grants import Grants
from kvcr_client.posted import Gate
from kvcr_client.put_jobs import PutJob, PutSteps, Runs
from kvcr_client.regions import RegionHandle, RegionTable
from kvcr_client.requests import CONTROL_TIMEOUT_S
from kvcr_client.results import Completing, KeyOutcome, Results, StoreHandle, store_handle
from kvcr_client.session_scope import NodePool, SessionScope
from kvcr_client.spans import Span
from kvcr_io.runs import cut, cut_rows, distinct
from kvcr_protocol import (
    DEFAULT_LIMITS,
    GRANTS_VERSION,
    Ack,
    Commit,
    Completion,
    DepositColumns,
    DepositItem,
    KeyResult,
    LeaseGrant,
    MemoryKind,
    Message,
    Put,
    PutReply,
    Unput,
    deposit_blocks,
    message_keys,
)
from kvcr_protocol.records import U32_MAX


class Deposit(Protocol):
    """The client's ``deposit``, the path a put falls back to (``Operations.deposit``)."""

    def __call__(self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
                 deadline_ms: int = ..., parents: Mapping[bytes, bytes] | None = None) -> StoreHandle: ...

DEFAULT_WRITE_S = 30.0
"""How long the WRITEs of a put with deadline 0 may take."""


class Puts:
    """The puts of one client: they ride on its ``Operations`` (regions, grants, deposit)."""

    def __init__(self, core: ClientCore, deposit: Deposit, counters: Counters, regions: RegionTable, grants: Grants,
                 completions: Completing, scope: Callable[[], SessionScope],
                 certain: Callable[[Sequence[Any]], None] = lambda items: None) -> None:
        self.core = core
        self.certain = certain
        """Refuses items whose memory a READ past its deadline may still write (``kvcr_client.uncertain``)."""
        self.deposit = deposit
        """The client's ``deposit`` (held weakly by the client that hands it: no cycle keeps a
        closed client alive)."""
        self.counters = counters
        self.regions = regions
        self.grants = grants
        self.completions = completions
        self.scope = scope
        """The current session's scope: whether its node refused ``put`` (deposit there)."""
        self._busy = 0
        """Puts between their ``put`` and the end of their WRITEs."""
        self._let_go = False
        """A WRITE was let go of while running in this session: it may still land."""
        self._lock = threading.Lock()
        self.gate: Gate | None = None
        """Made into each put's ``PutJob`` (``kvcr_client.posted.Gate``; tests only)."""

    def quiet(self) -> bool:
        """Whether no WRITE of a put of this session runs or may still land, so that the next
        ``hello`` may present the resume token, which frees the session's puts (spec section
        5.2). Called as a new hello goes: a let-go WRITE is the old session's only."""
        with self._lock:
            quiet = not self._busy and not self._let_go
            self._let_go = False
            if not quiet:
                self.counters.inc(Count.RESUMES_HELD)
            return quiet

    def offered(self) -> bool:
        return self.core.version >= GRANTS_VERSION and not self.scope().puts_refused

    def put(
        self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
        ttl_ms: int = 0, deadline_ms: int = 30_000, parents: Mapping[bytes, bytes] | None = None,
    ) -> StoreHandle:
        """Store objects as ``deposit`` does, writing their bytes from this client's agent when
        the node grants writes; the results are a deposit's (``STORED``, ``DUPLICATE``, ...).
        Returns at once: the turns run the put (``PutJob``)."""
        no_evict = checks.flag(no_evict, "no_evict")
        optional = checks.flag(optional, "optional")
        ttl_ms = checks.uint(ttl_ms, "ttl_ms", U32_MAX)
        deadline_ms = checks.deadline(deadline_ms)
        core = self.core
        welcome = core.welcome
        pools = {p.name: p for p in welcome.pools} if welcome else {}
        frozen, keys, regions = _spans.span_items(objects, DepositItem, self, self.regions.by_id, pools)
        self.certain(frozen)
        if not self.offered() or not frozen:
            self.counters.inc(Count.PUT_FALLBACKS)
            return self.deposit(objects, no_evict, optional, deadline_ms, parents)
        columns = deposit_blocks(frozen)
        parent_column = checks.parents(parents, message_keys((), columns))
        named = dict(parents) if parents and parent_column else {}
        node_md = self.grants.wants_node()
        give_up = time.monotonic() + (deadline_ms / 1000 if deadline_ms else DEFAULT_WRITE_S)
        table = self.regions
        op_id = core.next_id()
        table.hold(op_id, "put", regions)
        with self._lock:
            self._busy += 1  # from the put on, a WRITE of it may be posted (``quiet``)
        settled = False

        def settle(clean: bool) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            table.settle(op_id, regions)
            with self._lock:
                self._busy -= 1
                self._let_go = self._let_go or not clean

        def deposit(indices: list[int]) -> tuple[Future[Results[KeyOutcome]], Future[None]]:
            some = {keys[i]: objects[keys[i]] for i in indices}
            handle = self.deposit(some, no_evict, optional, deadline_ms,
                                  {k: p for k, p in named.items() if k in some})
            return handle.future, handle.written.future

        scope = self.scope()

        def refused() -> None:
            scope.puts_refused = True
            self.counters.inc(Count.PUT_FALLBACKS)

        def send(what: str, put_id: int) -> Future[Any]:
            if what == "commit":
                return core.request(lambda i: Commit(i, put_id), _completion(len(keys)), CONTROL_TIMEOUT_S)[1]
            return core.request(lambda i: Unput(i, put_id), _ack, CONTROL_TIMEOUT_S)[1]

        # Tracked until answered (or the session ends), however long the caller waits: a
        # reservation that comes after the caller gave up is still handed back.
        _, asked = core.request(lambda i: Put(i, (), no_evict, optional, ttl_ms, columns, node_md, parent_column),
                                self._put_reply(len(keys)), math.inf, op_id=op_id)
        def wait(loading: Future[None], job: PutJob) -> None:
            # Resolved by the loader thread with the lock held: the job goes on there.
            loading.add_done_callback(lambda _: core.reads.nudge(job))

        steps = PutSteps(functools.partial(self._runs, scope, frozen, columns), send, deposit, refused, self._late,
                         settle, wait, core.loops.reading_here, self.gate)
        result: Future[Results[KeyOutcome]] = Future()
        written: Future[None] = Future()
        job = PutJob(steps, asked, core.agent, keys, give_up, result, written)
        try:
            core.locked(lambda: core.reads.take(job))
        except BaseException:  # closed meanwhile
            core.call(job.close, closed=True)
            raise
        # The reply is read in a turn (lock held), or was read already: the job takes it at
        # once, not at the next turn (an event loop takes one only when the socket speaks).
        asked.add_done_callback(lambda _: core.call(lambda: core.reads.nudge(job), closed=True))
        core.pace()
        return store_handle(core, self.completions, op_id, "put", result, written)

    def _put_reply(self, n: int) -> Callable[[Message], PutReply]:
        def convert(msg: Message) -> PutReply:
            if not isinstance(msg, PutReply) or len(msg.results) != n:
                raise ValueError(f"expected put_reply with {n} results, got {msg.TAG}")
            self.counters.inc(Count.PUTS)
            return msg
        return convert

    def _late(self, asked: Future[Any]) -> None:
        """A put's reply did not come within its deadline: a reservation it makes after all
        is freed (no WRITE of it was posted, so ``unput`` is safe, spec section 6.13)."""
        self.counters.inc(Count.PUTS_UNANSWERED)

        def hand_back(asked: Future[Any]) -> None:
            if asked.cancelled() or asked.exception() is not None:
                return
            reply: PutReply = asked.result()
            if reply.put:
                self.counters.inc(Count.PUTS_HANDED_BACK)
                self.core.request(lambda i: Unput(i, reply.put), _ack, CONTROL_TIMEOUT_S)

        asked.add_done_callback(hand_back)

    def _runs(self, scope: SessionScope, items: Sequence[DepositItem], columns: Sequence[DepositColumns],
              reply: PutReply, load: bool) -> tuple[Runs, str] | Future[None] | None:
        """The WRITEs of the reserved spans and the node's agent they go to; None when the
        grant does not fit, or the put's session (``scope``) is over; while the node's agent
        loads (the session's first grant; ``load``: a put waits for one load, not a second
        after NIXL refused the first), what to wait for before asking again."""
        if scope is not self.scope():
            return None
        grant = reply.grant
        if load and grant is not None and grant.node is not None and scope.node is None:
            loading = self.grants.load(scope, grant.node)
            if not loading.done():
                return loading
        node = scope.node
        if grant is None or node is None:
            return None
        by_id = self.regions.by_id
        runs = _column_runs(columns, grant, node.pools, by_id)
        if runs is None:  # blocks of several regions, pools or lengths: span by span
            runs = _runs(items, grant.keys(DEFAULT_LIMITS), node.pools, by_id)
        return None if runs is None else (runs, node.name)


def _column_runs(
    columns: Sequence[DepositColumns], grant: LeaseGrant, pools: Sequence[NodePool], regions: Mapping[int, RegionHandle],
) -> Runs | None:
    """``_runs`` a block of columns at a time: for blocks of one region, one pool and one
    span length (an engine's usual layout), whole columns of addresses in numpy. None when a
    block is not such a one (or the grant does not fit it): the caller goes span by span."""
    layout = np.frombuffer(grant.layout, "<u4")
    slots = np.frombuffer(grant.slot, "<u4").astype(np.uint64)
    granted_pools = np.frombuffer(grant.pool, np.uint8)
    local: list[np.ndarray] = []
    remote: list[np.ndarray] = []
    kinds: tuple[MemoryKind, MemoryKind] | None = None
    devices: tuple[int, int] | None = None
    length = 0
    key = at = 0
    for block in columns:
        rows, n = len(block.keys), block.span_count
        reserved = layout[key:key + rows] != 0
        key += rows
        m = int(reserved.sum())
        if not m:
            continue
        if not isinstance(block.regions, int) or not isinstance(block.lengths, int) or length not in (0, block.lengths):
            return None
        if any(grant.layouts[int(i) - 1] != block.names for i in distinct(layout[key - rows:key][reserved])):
            return None
        p = granted_pools[at:at + m * n]
        if not len(p) or int(p.min()) != int(p.max()) or int(p[0]) >= len(pools):
            return None
        pool, region = pools[int(p[0])], regions[block.regions]
        if block.lengths != pool.slot_size or kinds not in (None, (region.kind, pool.kind)) \
                or devices not in (None, (region.device, pool.device)):
            return None
        kinds, devices, length = (region.kind, pool.kind), (region.device, pool.device), block.lengths
        offsets = np.frombuffer(block.offsets, "<u8").reshape(rows, n)[reserved].ravel()
        local.append(np.uint64(region.address) + offsets)
        remote.append(np.uint64(pool.address) + slots[at:at + m * n] * np.uint64(pool.slot_size))
        at += m * n
    if kinds is None or devices is None:
        return None
    laddr, raddr = np.concatenate(local), np.concatenate(remote)
    starts, run_sizes = cut(laddr, raddr, length)
    sizes = run_sizes.tolist()
    return {kinds: (list(zip(laddr[starts].tolist(), sizes, [devices[0]] * len(sizes), strict=True)),
                    list(zip(raddr[starts].tolist(), sizes, [devices[1]] * len(sizes), strict=True)))}


def _runs(
    items: Sequence[DepositItem], granted: Any, pools: Sequence[NodePool], regions: Mapping[int, RegionHandle],
) -> Runs | None:
    """The descriptor pairs of the WRITEs: each reserved span from where the put said its
    bytes lie into its slot, spans contiguous on both sides merged. None when the grant
    does not fit the put (a pool the node's agent lacks, or a span's size)."""
    rows = []
    for i, names, granted_pools, slots in granted:
        item = items[i]
        if len(names) != len(item.spans):
            return None
        for span, p, slot in zip(item.spans, granted_pools, slots, strict=True):
            if p >= len(pools) or span.length != pools[p].slot_size:
                return None
            pool, region = pools[p], regions[span.region]
            # One WRITE per pair of memory kinds; a run never spans two devices.
            rows.append(((region.kind, pool.kind, region.device, pool.device), region.address + span.offset,
                         pool.address + slot * pool.slot_size, span.length))
    runs: Runs = {}
    for (lkind, pkind, ldev, pdev), laddr, raddr, size, _ in cut_rows(rows):
        local, remote = runs.setdefault((lkind, pkind), ([], []))
        local.append((laddr, size, ldev))
        remote.append((raddr, size, pdev))
    return runs


def _completion(n: int) -> Any:
    def convert(msg: Message) -> tuple[KeyResult, ...]:
        if not isinstance(msg, Completion) or len(msg.results) != n:
            raise ValueError(f"expected complete with {n} results, got {msg.TAG}")
        return msg.results
    return convert


def _ack(msg: Message) -> None:
    if not isinstance(msg, Ack):
        raise ValueError(f"expected ack, got {msg.TAG}")
