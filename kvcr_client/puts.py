"""Deposits under write grants (spec section 6.13): the client WRITEs new objects itself.

``Puts.put`` checks its arguments as ``deposit`` does, sends a ``put``, WRITEs every
reserved span from the caller's registered memory into the slots the reply names (one
transfer per pair of memory kinds, spans contiguous on both sides merged), waits for its
own agent to report the WRITE terminal, and then sends ``commit`` (or, when the WRITE
failed, ``unput``). Keys another writer holds (``BUSY``) go by ``deposit``, which waits
for that writer. A session below version 5, or a node that grants no writes
(``client_transfers`` off: it refuses ``put`` ``MUST_UNDERSTAND``), gets a plain
``deposit``: the node-driven path.

The caller's thread does the work (the WRITE over CMA is a copy inside the post), and
``put`` returns once no WRITE of it runs any more: the caller's memory is its own again.
The ``commit`` is sent then and not waited for: the handle resolves with its reply. The
``deadline_ms`` bounds the wait for the ``put_reply`` too, so a stalled node costs a caller
the deadline, not the control timeout: the keys fail ``TIMEOUT``, and a reservation that
answers later is handed back with ``unput`` (nothing was written into it).
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import numpy as np

from kvcr_client import checks
from kvcr_client import spans as _spans
from kvcr_client.core import ClientCore
from kvcr_client.errors import NodeError
from kvcr_client.grants import Grants, NodePool
from kvcr_client.regions import RegionHandle, RegionTable
from kvcr_client.results import KeyOutcome, OpHandle, Results
from kvcr_client.spans import Span
from kvcr_io.agent import Desc, TransferError, XferStatus
from kvcr_protocol import (
    DEFAULT_LIMITS,
    GRANTS_VERSION,
    Ack,
    Commit,
    Completion,
    DepositColumns,
    DepositItem,
    ErrorCode,
    KeyResult,
    KeyStatus,
    LeaseGrant,
    MemoryKind,
    Message,
    PoolInfo,
    Put,
    PutReply,
    Unput,
    Welcome,
    code_of,
    deposit_blocks,
)
from kvcr_protocol.records import U32_MAX


class Owner(Protocol):
    """What a put needs of the client's ``Operations`` (which owns ``Puts``)."""

    core: ClientCore
    _regions: RegionTable
    _grants: Grants

    @property
    def pools(self) -> dict[str, PoolInfo]: ...

    def deposit(self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
                deadline_ms: int = ...) -> OpHandle[Results[KeyOutcome]]: ...

    def _handle(self, op_id: int, kind: str, fut: Future[Any], abort: Any = None) -> OpHandle[Any]: ...

CONTROL_TIMEOUT_S = 10.0
"""How long a ``put``, ``commit`` or ``unput`` waits for its answer (the node answers at once)."""
DEFAULT_WRITE_S = 30.0
"""How long the WRITEs of a put with deadline 0 may take."""
WRITE_POLL_S = 0.0002
"""Between two looks at a WRITE still running (over CMA it is done when posted)."""

Runs = dict[tuple[MemoryKind, MemoryKind], tuple[list[Desc], list[Desc]]]
"""Per (local kind, remote kind): the local and remote descriptors of one WRITE."""


class Puts:
    """The puts of one client: they ride on its ``Operations`` (regions, grants, deposit)."""

    def __init__(self, ops: Owner) -> None:
        self.ops: Owner = weakref.proxy(ops)  # the client owns its puts: no cycle keeps a closed client alive
        self.refused: Welcome | None = None
        """The session whose node refused ``put`` (it grants no writes): deposit there."""
        self.puts = 0
        """Deposits that travelled as puts (the client wrote the bytes)."""
        self.fallbacks = 0
        """Puts sent as deposits (the node below version 5, or refusing puts)."""
        self.unanswered = 0
        """Puts whose ``put_reply`` did not come within their deadline (keys ``TIMEOUT``)."""
        self.handed_back = 0
        """Late reservations of those freed by ``unput``."""
        self.resumes_held = 0
        """Reconnects that presented no resume token: a WRITE of a put could still land."""
        self._busy = 0
        """Puts between their ``put`` and the end of their WRITEs (caller threads)."""
        self._let_go = False
        """A WRITE was let go of while running in this session: it may still land."""
        self._lock = threading.Lock()
        self.hook: Any = None
        """Called with ``"written"`` once the WRITE is terminal, before ``commit`` (tests stop
        a client there). Not a setting of the product."""

    def quiet(self) -> bool:
        """Whether no WRITE of a put of this session runs or may still land, so that the next
        ``hello`` may present the resume token, which frees the session's puts (spec section
        5.2). Called as a new hello goes: a let-go WRITE is the old session's only."""
        with self._lock:
            quiet = not self._busy and not self._let_go
            self._let_go = False
            if not quiet:
                self.resumes_held += 1
            return quiet

    def offered(self) -> bool:
        core = self.ops.core
        return core.version >= GRANTS_VERSION and (self.refused is None or self.refused is not core.welcome)

    def put(
        self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
        ttl_ms: int = 0, deadline_ms: int = 30_000,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Store objects as ``deposit`` does, writing their bytes from this client's agent when
        the node grants writes; the results are a deposit's (``STORED``, ``DUPLICATE``, ...)."""
        ops = self.ops
        no_evict = checks.flag(no_evict, "no_evict")
        optional = checks.flag(optional, "optional")
        ttl_ms = checks.uint(ttl_ms, "ttl_ms", U32_MAX)
        deadline_ms = checks.deadline(deadline_ms)
        frozen, keys, regions = _spans.span_items(objects, DepositItem, ops, ops._regions.by_id, ops.pools)
        if not self.offered() or not frozen:
            self.fallbacks += 1
            return ops.deposit(objects, no_evict, optional, deadline_ms)
        columns = deposit_blocks(frozen)
        node_md = ops._grants.wants_node()
        give_up = time.monotonic() + (deadline_ms / 1000 if deadline_ms else DEFAULT_WRITE_S)
        with self._lock:
            self._busy += 1  # from the put on, a WRITE of it may be posted (``quiet``)
        try:
            return self._put(objects, frozen, keys, regions, columns, node_md, give_up, no_evict, optional, ttl_ms,
                             deadline_ms)
        finally:
            with self._lock:
                self._busy -= 1

    def _put(
        self, objects: Mapping[bytes, Sequence[Span]], frozen: tuple[DepositItem, ...], keys: list[bytes],
        regions: set[RegionHandle], columns: tuple[DepositColumns, ...], node_md: bool, give_up: float, no_evict: bool, optional: bool, ttl_ms: int, deadline_ms: int,
    ) -> OpHandle[Results[KeyOutcome]]:
        """``put`` once its arguments are checked: the request, its WRITEs, its commit."""
        ops = self.ops
        core = ops.core
        # Tracked until answered (or the session ends), however long the caller waits: a
        # reservation that comes after the caller gave up is still handed back.
        op_id, asked = core.request(lambda i: Put(i, (), no_evict, optional, ttl_ms, columns, node_md),
                                    _put_reply(len(keys)), math.inf)
        try:
            reply: PutReply = core.wait(asked, min(CONTROL_TIMEOUT_S + 2, max(0.0, give_up - time.monotonic())))
        except FutureTimeout:
            # Nothing was written: a reservation the node makes after all is handed back.
            self.unanswered += 1
            asked.add_done_callback(self._hand_back)
            return ops._handle(op_id, "put", _resolved(keys, [_NO_REPLY] * len(keys)))
        except NodeError as exc:
            if exc.code is not ErrorCode.MUST_UNDERSTAND:
                raise
            self.refused = core.welcome
            self.fallbacks += 1
            return ops.deposit(objects, no_evict, optional, deadline_ms)
        self.puts += 1
        results: list[KeyResult] = list(reply.results)
        busy = [i for i, r in enumerate(results) if r.code == ErrorCode.BUSY]
        committed: Future[Any] | None = None
        if reply.put:
            written = self._write(reply, frozen, columns, results, regions, give_up)
            if isinstance(written, Future):
                committed = written
            else:
                results = written
        if busy:
            # Another writer holds these keys: a deposit waits for it (spec section 9).
            later = ops.deposit({keys[i]: objects[keys[i]] for i in busy}, no_evict, optional, deadline_ms)
            waited = core.wait(later.future, None)
            for i in busy:
                outcome = waited[keys[i]]
                results[i] = KeyResult(outcome.status, outcome.code, outcome.reason, outcome.handle)
        if committed is None:
            return ops._handle(reply.id, "put", _resolved(keys, results))
        # The commit answers for the reserved keys; the others keep what was found above.
        kept = {i: results[i] for i in busy}
        return ops._handle(reply.id, "put", _then(committed, lambda answered: Results(
            [(k, _outcome(kept.get(i, r))) for i, (k, r) in enumerate(zip(keys, answered, strict=True))])))

    def _hand_back(self, asked: Future[Any]) -> None:
        """A ``put_reply`` that came after the caller gave up: free what it reserved (no WRITE
        of it was posted, so ``unput`` is safe, spec section 6.13)."""
        if asked.cancelled() or asked.exception() is not None:
            return
        reply: PutReply = asked.result()
        if reply.put:
            self.handed_back += 1
            self.ops.core.request(lambda i: Unput(i, reply.put), _ack, CONTROL_TIMEOUT_S)

    def _write(
        self, reply: PutReply, items: Sequence[DepositItem], columns: Sequence[DepositColumns], results: list[KeyResult],
        regions: set[RegionHandle], give_up: float,
    ) -> list[KeyResult] | Future[Any]:
        """WRITE the reserved spans, then ``commit`` (or ``unput`` when a WRITE failed): the
        commit's reply to come, or every reserved key failed ``TRANSFER_FAILED``. A WRITE still
        running at ``give_up`` is let go of and nothing is sent: it may still land, so the
        put is left to expire into quarantine (spec section 6.13), its keys ``TIMEOUT``."""
        ops, core = self.ops, self.ops.core
        grants = ops._grants
        grant = reply.grant
        if grant is not None and grant.node is not None:
            grants.load(grant.node)
        node = grants.node
        ok: bool | None = grant is not None and node is not None and node.welcome is core.welcome
        table = ops._regions
        table.hold(reply.id, "put", regions)
        try:
            if ok:
                assert grant is not None and node is not None
                runs = _column_runs(columns, grant, node.pools, table.by_id)
                if runs is None:  # blocks of several regions, pools or lengths: span by span
                    runs = _runs(items, grant.keys(DEFAULT_LIMITS), node.pools, table.by_id)
                ok = runs is not None and self._transfer(runs, node.name, give_up)
        finally:
            # No WRITE of it runs any more: the memory is the caller's again.
            table.settle(reply.id, regions)
        if self.hook is not None:
            self.hook("written")
        if ok is None:
            with self._lock:
                self._let_go = True
            return [KeyResult(KeyStatus.FAILED, ErrorCode.TIMEOUT, "the WRITE outlived the deadline; left to expire")
                    if r.status is KeyStatus.OK else r for r in results]
        if not ok:
            _, gone = core.request(lambda i: Unput(i, reply.put), _ack, CONTROL_TIMEOUT_S)
            core.wait(gone, CONTROL_TIMEOUT_S + 2)
            return [KeyResult(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED, "writing the reserved slots failed")
                    if r.status is KeyStatus.OK else r for r in results]
        _, committed = core.request(lambda i: Commit(i, reply.put), _completion(len(results)), CONTROL_TIMEOUT_S)
        return committed

    def _transfer(self, runs: Runs, node: str, give_up: float) -> bool | None:
        """Post one WRITE per pair of memory kinds and wait until each is terminal: whether all
        succeeded; None when one still ran at ``give_up`` (it may land later)."""
        core = self.ops.core
        agent = core.agent
        posted: list[tuple[Any, XferStatus]] = []
        ok = True
        for (local_kind, remote_kind), (local, remote) in runs.items():
            try:
                posted.append(core.call(functools.partial(
                    agent.start_listed, "WRITE", local_kind, local, remote_kind, remote, node)).result())
            except TransferError:
                ok = False
        uncertain = False
        for handle, state in posted:
            while state is XferStatus.RUNNING and time.monotonic() < give_up:
                time.sleep(WRITE_POLL_S)
                state = core.call(functools.partial(agent.state, handle), closed=True).result()
            core.call(functools.partial(agent.release, handle), closed=True)
            uncertain = uncertain or state is XferStatus.RUNNING
            ok = ok and state is XferStatus.DONE
        return None if uncertain else ok


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
        if any(grant.layouts[int(i) - 1] != block.names for i in np.unique(layout[key - rows:key][reserved])):
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
    step = np.uint64(length)
    breaks = np.flatnonzero((laddr[1:] != laddr[:-1] + step) | (raddr[1:] != raddr[:-1] + step)) + 1
    starts = np.concatenate(([0], breaks))
    sizes = (np.diff(np.concatenate((starts, [len(laddr)]))) * length).tolist()
    return {kinds: (list(zip(laddr[starts].tolist(), sizes, [devices[0]] * len(sizes), strict=True)),
                    list(zip(raddr[starts].tolist(), sizes, [devices[1]] * len(sizes), strict=True)))}


def _runs(
    items: Sequence[DepositItem], granted: Any, pools: Sequence[NodePool], regions: Mapping[int, RegionHandle],
) -> Runs | None:
    """The descriptor pairs of the WRITEs: each reserved span from where the put said its
    bytes lie into its slot, spans contiguous on both sides merged. None when the grant
    does not fit the put (a pool the node's agent lacks, or a span's size)."""
    runs: Runs = {}
    for i, names, granted_pools, slots in granted:
        item = items[i]
        if len(names) != len(item.spans):
            return None
        for span, p, slot in zip(item.spans, granted_pools, slots, strict=True):
            if p >= len(pools) or span.length != pools[p].slot_size:
                return None
            pool, region = pools[p], regions[span.region]
            local, remote = runs.setdefault((region.kind, pool.kind), ([], []))
            laddr, raddr = region.address + span.offset, pool.address + slot * pool.slot_size
            if local and local[-1][0] + local[-1][1] == laddr and remote[-1][0] + remote[-1][1] == raddr \
                    and local[-1][2] == region.device and remote[-1][2] == pool.device:
                local[-1] = (local[-1][0], local[-1][1] + span.length, region.device)
                remote[-1] = (remote[-1][0], remote[-1][1] + span.length, pool.device)
            else:
                local.append((laddr, span.length, region.device))
                remote.append((raddr, span.length, pool.device))
    return runs


_NO_REPLY = KeyResult(KeyStatus.FAILED, ErrorCode.TIMEOUT, "the node did not answer the put within its deadline")


def _outcome(r: KeyResult) -> KeyOutcome:
    return KeyOutcome(r.status, code_of(r.code), r.reason, r.handle)


def _resolved(keys: Sequence[bytes], results: Sequence[KeyResult]) -> Future[Any]:
    done: Future[Any] = Future()
    done.set_result(Results([(k, _outcome(r)) for k, r in zip(keys, results, strict=True)]))
    return done


def _then(source: Future[Any], make: Any) -> Future[Any]:
    """A future of ``make(source's result)``, or of its exception."""
    out: Future[Any] = Future()

    def settle(done: Future[Any]) -> None:
        try:
            out.set_result(make(done.result(0)))
        except BaseException as exc:  # the caller's result() raises it
            out.set_exception(exc)

    source.add_done_callback(settle)
    return out


def _put_reply(n: int) -> Any:
    def convert(msg: Message) -> PutReply:
        if not isinstance(msg, PutReply) or len(msg.results) != n:
            raise ValueError(f"expected put_reply with {n} results, got {msg.TAG}")
        return msg
    return convert


def _completion(n: int) -> Any:
    def convert(msg: Message) -> tuple[KeyResult, ...]:
        if not isinstance(msg, Completion) or len(msg.results) != n:
            raise ValueError(f"expected complete with {n} results, got {msg.TAG}")
        return msg.results
    return convert


def _ack(msg: Message) -> None:
    if not isinstance(msg, Ack):
        raise ValueError(f"expected ack, got {msg.TAG}")
