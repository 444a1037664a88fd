"""The operations both clients send, and what they leave behind.

``Operations`` owns a client's session core (``ClientCore``), its ``RegionTable``, the
completion queue ``poll_completed`` drains, the live leases and the session's notification
token. Every operation checks its arguments before anything is sent (``checks``, ``spans``:
an ``ArgumentError`` names the field) and returns an ``OpHandle`` that resolves to
per-key results; a deliver with a layer plan returns a ``DeliverHandle`` fed group by group.
``Client`` and ``AsyncClient`` add the calls that block or await.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, overload

from kvcr_client import checks
from kvcr_client import spans as _spans
from kvcr_client.completions import Completions
from kvcr_client.core import ClientCore
from kvcr_client.counters import Count, Counters
from kvcr_client.errors import ArgumentError
from kvcr_client.grants import Grants
from kvcr_client.lease_requests import LeaseRequests
from kvcr_client.puts import Puts
from kvcr_client.regions import RegionHandle, RegionTable
from kvcr_client.requests import CONTROL_TIMEOUT_S
from kvcr_client.results import (
    DeliverHandle,
    GroupDone,
    KeyOutcome,
    OpHandle,
    Presences,
    Results,
    StoreHandle,
    store_handle,
)
from kvcr_client.session_scope import CurrentScope, GrantedKey
from kvcr_client.spans import Destination, LayerPlan, Span
from kvcr_protocol import (
    COLUMNS_VERSION,
    DEFAULT_LIMITS,
    PRESENCE_CODE,
    Abort,
    Completion,
    DeliverColumns,
    DeliverItem,
    Deposit,
    DepositItem,
    DiscardHint,
    ErrorCode,
    Fetch,
    FetchItem,
    KeyResult,
    LayoutSpan,
    Message,
    PoolInfo,
    Presence,
    Query,
    QueryColumns,
    QueryReply,
    Release,
    StatsReply,
    StatsRequest,
    SubmitHint,
    Welcome,
    code_of,
    deliver_blocks,
    deposit_blocks,
    endpoint_problem,
)
from kvcr_protocol import Deliver as DeliverMsg

log = logging.getLogger("kvcr.client")

DEFAULT_DEADLINE_MS = 30_000
DEFAULT_MAX_COMPLETED = 8192
"""Completed operations kept for ``poll_completed`` at most; older ones are dropped and counted."""
ABORT_TIMEOUT_S = 5.0
"""How long an abort request waits for its acknowledgement (the operation completes on its own)."""
RELEASE_DEADLINE_MS = 10_000
"""The deadline of a release (the node answers it at once)."""


class Operations(LeaseRequests):
    """What both clients share: request building, the handles operations return, their results."""

    core: ClientCore
    core_class: ClassVar[type[ClientCore]] = ClientCore
    """The session core a client runs on; a subclass may name a subclass of it (tests do, to lose notifications)."""

    def __init__(self, core: ClientCore, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        self.core = core
        self._regions = RegionTable(core)
        self._completions = Completions(max_completed)
        self._scope = CurrentScope()
        """What the session owns (``kvcr_client.session_scope``): its notification token (spec
        section 6.10), its live leases by id (so that the node's ``lease_end`` reaches their
        handles), its grants; replaced whole at each hello and at close."""
        self._counters = Counters()
        self._grants = Grants(core, self._counters, self._scope)
        """The slots leases granted this session, read by ``deliver`` (spec section 6.12)."""
        self.core.on_lease_end = self._lease_ended
        self._puts = Puts(self, self._counters, self._regions, self._grants, self._completions, self._scope)

    def _handle(self, op_id: int, kind: str, fut: Future[Any], abort: Any = None) -> OpHandle[Any]:
        handle: OpHandle[Any] = OpHandle(op_id, kind, fut, abort, self.core.wait, self.core.poll, self.core.wait_async)
        self._completions.when_done(fut, handle)
        return handle

    def _store_handle(self, op_id: int, kind: str, fut: Future[Any], written: Future[None],
                      abort: Any = None) -> StoreHandle:
        """A deposit's handle: ``written`` once the memory is free, then the results."""
        return store_handle(self.core, self._completions, op_id, kind, fut, written, abort)

    def poll_completed(self) -> list[OpHandle[Any] | GroupDone]:
        """The operations that completed since the last call, for engines that poll once per step.

        A deliver with a layer plan also reports each group as it ends for every key
        (``GroupDone``: delivered or failed), in group order, before its handle.

        The first call says that the engine polls: completions are queued from then on,
        only for handles nobody waited on (``result``) or awaited, and at most
        ``max_completed`` of them (the oldest are dropped beyond, counted in
        ``completed_dropped``). An engine that waits on or awaits its handles, and never
        calls this, keeps no queue at all.
        """
        self._completions.polling = True
        self.core.poll()
        return self._completions.drain()

    @property
    def completed_dropped(self) -> int:
        """Completions dropped from the full ``poll_completed`` queue (``max_completed``)."""
        return self._completions.dropped

    def tables(self) -> dict[str, int]:
        """Sizes of the client's tables (for monitoring, and churn tests that check nothing grows)."""
        return {**self.core.tables(), "completed": len(self._completions), "regions": len(self._regions),
                "leases": len(self._scope().leases), "granted_keys": len(self._grants)}

    def counters(self) -> dict[str, int]:
        """What this client counted, every counter by name (``kvcr_client.counters.Count``):
        delivers read under grants, spans checked against digests, mismatches, puts and
        their fallbacks."""
        return {count.value: self._counters[count] for count in Count}

    @property
    def grant_reads(self) -> int:
        """Delivers this client served by READs under read grants (spec section 6.12)."""
        return self._counters[Count.GRANT_READS]

    @property
    def pools(self) -> dict[str, PoolInfo]:
        welcome = self.core.welcome
        return {p.name: p for p in welcome.pools} if welcome else {}

    @property
    def node(self) -> Welcome | None:
        """The node's welcome: its name, incarnation, version and pools."""
        return self.core.welcome

    def destination(self, spans: Sequence[Span]) -> Destination:
        """Destination spans checked once, for delivering into the same memory again and again.

        ``deliver`` takes a ``Destination`` wherever it takes a sequence of ``Span``, and
        then does no per-span work. It stays valid while its regions stay registered.
        """
        return _spans.destination(spans, self, self._regions.by_id)

    # -- operations

    def _op(self, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool, regions: set[RegionHandle]) -> OpHandle[Any]:
        """Send one operation; its handle resolves to per-key results (``_send_op``)."""
        op_id = self.core.next_id()
        fut = self._send_op(op_id, kind, keys, build, deadline_ms, touches, regions)
        return self._handle(op_id, kind, fut, self._abort)

    def _send_op(
        self, op_id: int, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool,
        regions: set[RegionHandle], on_reply: Callable[[Message], None] | None = None,
        observer: Callable[[Any], None] | None = None, written: Future[None] | None = None,
    ) -> Future[Any]:
        """Send one operation. Its regions stay in use until the node can no longer touch them.

        That is when the node answered, or the session is over (closed, or the node lost);
        not when the client merely stopped waiting (spec section 5.1). ``deadline_ms`` 0
        is the node's default, which the client does not know: it waits for the answer.
        ``on_reply`` sees the reply first, ``observer`` the request's events (lock held);
        ``written`` resolves when the regions are free.
        """
        table = self._regions
        if regions:
            table.hold(op_id, kind, regions)
        elif written is not None:
            written.set_result(None)

        def settled() -> None:
            table.settle(op_id, regions)
            if written is not None and not written.done():
                written.set_result(None)

        def convert(msg: Message) -> Results[Any]:
            assert isinstance(msg, Completion)
            if len(msg.results) != len(keys):
                raise ValueError(f"{len(msg.results)} results for {len(keys)} keys")
            if on_reply is not None:
                on_reply(msg)
            return Results([
                (k, KeyOutcome(r.status, code_of(r.code), r.reason, r.handle))
                for k, r in zip(keys, msg.results, strict=True)
            ])

        timeout_s = deadline_ms / 1000 if deadline_ms else math.inf
        _, fut = self.core.request(build, convert, timeout_s, touches, op_id, settled if regions else None, observer)
        return fut

    def _abort(self, op_id: int) -> None:
        self.core.request(lambda i: Abort(i, op_id), lambda m: None, ABORT_TIMEOUT_S)

    def deposit(
        self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
        deadline_ms: int = DEFAULT_DEADLINE_MS,
    ) -> StoreHandle:
        """Store objects; each key maps to its layout's spans in order (with pools).

        ``deadline_ms``: milliseconds the node may spend, counted from its receipt of the
        request (0..2**32-1); 0 means the node's default (its ``deadline_ms`` setting,
        spec section 5.1). The client waits for the answer until that deadline plus a
        grace of 2 s, or, for 0, until the answer or the end of the session; then the
        handle fails with ``OperationTimeout``, but the regions the spans name stay in use
        (``unregister`` refuses them) until the node's late answer or the session's end.
        """
        no_evict = checks.flag(no_evict, "no_evict")
        optional = checks.flag(optional, "optional")
        deadline_ms = checks.deadline(deadline_ms)
        frozen, keys, regions = _spans.span_items(objects, DepositItem, self, self._regions.by_id, self.pools)
        columns = deposit_blocks(frozen) if self.core.version >= COLUMNS_VERSION else ()
        records = () if columns else frozen
        op_id = self.core.next_id()
        written: Future[None] = Future()
        fut = self._send_op(op_id, "deposit", keys, lambda i: Deposit(i, records, no_evict, optional, deadline_ms, columns),
                            deadline_ms, True, regions, written=written)
        return self._store_handle(op_id, "deposit", fut, written, self._abort)

    def put(self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
            ttl_ms: int = 0, deadline_ms: int = DEFAULT_DEADLINE_MS) -> StoreHandle:
        """``deposit``, this client WRITEing the bytes under a write grant when the node offers
        one. Returns at once; the handle's ``written`` says when the spans' memory is free."""
        return self._puts.put(objects, no_evict, optional, ttl_ms, deadline_ms)

    @overload
    def deliver(
        self, objects: Mapping[bytes, Sequence[Span] | Destination], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS, partial: bool = False, plan: None = None,
    ) -> OpHandle[Results[KeyOutcome]]: ...

    @overload
    def deliver(
        self, objects: Mapping[bytes, Sequence[Span] | Destination], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS, partial: bool = False, *, plan: LayerPlan,
    ) -> DeliverHandle: ...

    def deliver(
        self, objects: Mapping[bytes, Sequence[Span] | Destination], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS, partial: bool = False, plan: LayerPlan | None = None,
    ) -> OpHandle[Results[KeyOutcome]] | DeliverHandle:
        """Put objects' bytes into registered memory: the whole layout or an ordered subset of its spans.

        A node projects objects it holds whatever ``partial`` says. For an object it must
        get from the peer a hint for ``request_id`` names, only a ``partial`` deliver may
        name a subset (the source must speak protocol version 2). ``deadline_ms`` as for
        ``deposit``.

        ``plan`` (a layer plan, spec section 6.8): an ordered list of groups, each a list of
        span names, that every key follows (or a mapping of key -> such a list; a key left
        out is one group). Every span of a key is in exactly one group. The node starts the
        groups in order and each completes on its own: the returned ``DeliverHandle`` says
        when group g has landed (``wait(g)``, ``group(g)`` to await, ``poll_completed``),
        learnt from a NIXL notification to this client's agent, a ``progress`` event or the
        reply, whichever comes first. In a session below version 3 the plan stays here:
        every group of a key is delivered when the key's result is ``OK``.
        """
        request_id = checks.optional_request_id(request_id)
        deadline_ms = checks.deadline(deadline_ms)
        partial = checks.flag(partial, "partial")
        frozen, keys, regions = _spans.span_items(objects, DeliverItem, self, self._regions.by_id, None)
        groups = None if plan is None else _spans.plan_groups(frozen, plan)
        granted = self._grants.cover(frozen)
        if granted is not None:
            # Every key is leased with a read grant: READ it ourselves, no node turn (spec section 6.12).
            return self._read_granted(frozen, keys, granted, groups, deadline_ms, regions)
        # Version 1 sessions cannot carry the flag; their remote deliveries name whole layouts.
        flag = partial and self.core.version >= 2
        columns: tuple[DeliverColumns, ...] = ()
        if self.core.version >= COLUMNS_VERSION:
            columns = deliver_blocks(frozen, groups)
        token = self._scope().token if columns and groups is not None else 0
        records = () if columns else frozen
        build = lambda i: DeliverMsg(i, records, request_id, deadline_ms, flag, columns, token)  # noqa: E731
        if groups is None:
            return self._op("deliver", keys, build, deadline_ms, True, regions)
        return self._planned(keys, build, deadline_ms, regions, [max(g, default=0) + 1 for g in groups], token)

    def _planned(
        self, keys: list[bytes], build: Any, deadline_ms: int, regions: set[RegionHandle], counts: list[int], token: int,
    ) -> DeliverHandle:
        """Send a deliver with layer plans: a ``DeliverHandle`` fed by notifications, progress
        and the reply (``PlanProgress``), whose groups fail when the request ends without a
        reply (spec section 6.10)."""
        op_id = self.core.next_id()
        handle = DeliverHandle(op_id, Future(), keys, counts, token, self._abort, self.core.wait, self.core.poll)
        handle.on_group = self._completions.add

        def reply(msg: Message) -> None:
            assert isinstance(msg, Completion)
            handle.apply(handle.progress.on_reply(msg))
            if token and regions and any(r.code == ErrorCode.DESTINATION_UNCERTAIN for r in msg.results):
                self._regions.linger(op_id, regions)

        fut = self._send_op(op_id, "deliver", keys, build, deadline_ms, True, regions, reply, handle.observe)
        handle.future = fut
        self._completions.when_done(fut, handle, planned=True)
        return handle

    def _read_granted(
        self, items: tuple[DeliverItem, ...], keys: list[bytes], granted: list[GrantedKey],
        groups: list[tuple[int, ...]] | None, deadline_ms: int, regions: set[RegionHandle],
    ) -> OpHandle[Results[KeyOutcome]] | DeliverHandle:
        """A deliver served by READs under grants (``Grants.deliver``): its handle returns once
        group 0 is posted; the core's turns post the rest, report each group as it lands and
        passes the lease check, and resolve the handle after the last."""
        op_id = self.core.next_id()
        fut: Future[Results[KeyOutcome]] = Future()
        handle: OpHandle[Results[KeyOutcome]] | DeliverHandle
        if groups is None:
            handle = self._handle(op_id, "deliver", fut)
        else:
            planned = DeliverHandle(op_id, fut, keys, [max(g, default=0) + 1 for g in groups], 0, None, self.core.wait,
                                    self.core.poll)
            planned.on_group = self._completions.add
            self._completions.when_done(fut, planned, planned=True)
            handle = planned

        def landed(members: list[int], group: int) -> None:  # lock held
            if isinstance(handle, DeliverHandle):
                handle.apply(handle.progress.on_landed(members, group + 1))

        def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:  # lock held
            if isinstance(results, BaseException):
                fut.set_exception(results)
                return
            if isinstance(handle, DeliverHandle):
                handle.apply(handle.progress.on_results(results, done))
            fut.set_result(Results([
                (k, KeyOutcome(r.status, code_of(r.code), r.reason, None)) for k, r in zip(keys, results, strict=True)
            ]))

        table = self._regions
        table.hold(op_id, "deliver", regions)
        try:
            self._grants.deliver(items, granted, groups, table.by_id, deadline_ms, landed, finished,
                                 lambda: table.settle(op_id, regions))
        except BaseException as exc:
            table.settle(op_id, regions)
            if not fut.done():
                fut.set_exception(exc)
            raise
        return handle

    def fetch(
        self, expected_layouts: Mapping[bytes, Sequence[tuple[str, str]]], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Make objects resident in the node (whole layouts); each OK result carries a release handle.

        ``deadline_ms`` as for ``deposit``.
        """
        request_id = checks.optional_request_id(request_id)
        deadline_ms = checks.deadline(deadline_ms)
        items, keys = [], []
        for key, layout in checks.batch(expected_layouts, "expected_layouts", mapping=True):
            path = f"expected_layouts[{key!r}]"
            checks.key(key, path)
            if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence) or not layout:
                raise ArgumentError(path, "expected a non-empty sequence of (span name, pool) pairs")
            for j, s in enumerate(layout):
                if not (isinstance(s, tuple) and len(s) == 2):
                    raise ArgumentError(f"{path}[{j}]", "expected a (span name, pool) pair")
                checks.text(s[0], f"{path}[{j}]", DEFAULT_LIMITS.max_name)
                checks.text(s[1], f"{path}[{j}]", DEFAULT_LIMITS.max_name)
            items.append(FetchItem(key, tuple(LayoutSpan(n, p) for n, p in layout)))
            keys.append(key)
        checks.span_total(items, "layout", "expected_layouts")
        frozen = tuple(items)
        return self._op("fetch", keys, lambda i: Fetch(i, frozen, request_id, deadline_ms), deadline_ms, False, set())

    def release(self, handles: Iterable[int]) -> OpHandle[Results[KeyOutcome]]:
        """Drop handle claims; results are keyed by the handle as 8 big-endian bytes."""
        hs = checks.handles(handles)
        keys = [h.to_bytes(8, "big") for h in hs]
        frozen = tuple(hs)
        return self._op("release", keys, lambda i: Release(i, frozen), RELEASE_DEADLINE_MS, False, set())

    def query(self, keys: Iterable[bytes], request_id: str | None = None) -> OpHandle[Presences]:
        """Where are these keys? Advisory: a HIT may be evicted before the next call.

        The answers (``Presences``) map each key to its ``KeyPresence``, decoded when read.
        """
        request_id = checks.optional_request_id(request_id)
        ks = checks.keys(keys, "keys")

        def convert(msg: Message) -> Presences:
            if not isinstance(msg, QueryReply):
                raise ValueError(f"expected query_reply, got {msg.TAG}")
            return Presences(ks, msg.columns if msg.columns is not None else msg.results)

        op_id, fut = self.core.request(lambda i: Query(i, ks, request_id), convert, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "query", fut)

    def query_prefix(
        self, keys: Iterable[bytes], request_id: str | None = None, presences: Iterable[Presence] = (Presence.HIT,),
    ) -> OpHandle[int]:
        """How many keys in a row, from the first, have one of ``presences`` (HIT by default).

        What an engine asks of its next request's blocks: the node stops looking at the
        first key that does not count (a prefix query, spec section 6.9). A session below
        version 3 asks a whole query and counts the same prefix here.
        """
        request_id = checks.optional_request_id(request_id)
        ks = checks.keys(keys, "keys")
        mask = checks.prefix_mask(presences)
        core = self.core

        def build(i: int) -> Query:
            return Query(i, ks, request_id, mask if core.version >= COLUMNS_VERSION else 0)

        def convert(msg: Message) -> int:
            if not isinstance(msg, QueryReply):
                raise ValueError(f"expected query_reply, got {msg.TAG}")
            answers = msg.columns if msg.columns is not None else msg.results
            if len(answers) > len(ks):
                raise ValueError(f"{len(answers)} answers for {len(ks)} keys")
            if isinstance(answers, QueryColumns):
                return answers.prefix_length(mask)
            count = 0  # the record form of a whole query: count here, up to the first that does not count
            while count < len(answers) and mask >> PRESENCE_CODE[answers[count].presence] & 1:
                count += 1
            return count

        op_id, fut = self.core.request(build, convert, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "query_prefix", fut)

    def submit_hint(self, request_id: str, source_endpoint: str, keys: Iterable[bytes]) -> OpHandle[None]:
        """Tell the node that, for ``request_id``, ``keys`` may be held by the node at ``source_endpoint``."""
        request_id = checks.request_id(request_id)
        checks.text(source_endpoint, "source_endpoint", DEFAULT_LIMITS.max_text)
        problem = endpoint_problem(source_endpoint)  # the node's own check (spec section 5.2)
        if problem is not None:
            raise ArgumentError("source_endpoint", problem)
        ks = checks.keys(keys, "keys")
        op_id, fut = self.core.request(lambda i: SubmitHint(i, request_id, source_endpoint, ks), checks.ack, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "hint", fut)

    def discard_hint(self, request_id: str) -> OpHandle[None]:
        """The request is over: the node forgets its hints."""
        request_id = checks.request_id(request_id)
        op_id, fut = self.core.request(lambda i: DiscardHint(i, request_id), checks.ack, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "unhint", fut)

    def abort(self, handle: OpHandle[Any]) -> None:
        """Best effort; the operation then completes, ABORTED where it had not finished."""
        if not isinstance(handle, OpHandle):
            raise ArgumentError("handle", f"expected an OpHandle of this client, got {type(handle).__name__}")
        handle.abort()

    def stats(self) -> OpHandle[dict[str, Any]]:
        def convert(msg: Message) -> dict[str, Any]:
            assert isinstance(msg, StatsReply)
            return msg.stats

        op_id, fut = self.core.request(lambda i: StatsRequest(i), convert, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "stats", fut)

    def _hello(self, timeout_s: float) -> Future[Any]:
        """Open a session (again), announcing every registered region."""
        self._end_session()
        # The previous session ends at once, its puts freed, unless a WRITE of a put may
        # still land (spec section 5.2): then it ends as the node finds it gone.
        return self.core.hello(self._regions.wires(), timeout_s, resume=self._puts.quiet())

    def _end_session(self) -> None:
        """The session's scope goes whole: a new token (a late notification of the old session
        matches nothing), its leases (their handles say NODE_LOST), its grants."""
        self._grants.retire(self._scope.renew())
