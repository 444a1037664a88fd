"""The operations both clients send: deposit, put, deliver, fetch, release, query, hints, stats.

``Operations`` builds each request, on the client's state (``kvcr_client.client_state``) and
its lease requests (``kvcr_client.lease_requests``). Every operation checks its arguments
before anything is sent (``checks``, ``spans``: an ``ArgumentError`` names the field) and
hands the request to the ``Sender`` (``kvcr_client.sender``), which returns an ``OpHandle``
that resolves to per-key results, or a ``DeliverHandle`` fed group by group for a deliver
with a layer plan. ``Client`` and ``AsyncClient`` add the calls that block or await.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, overload

from kvcr_client import checks
from kvcr_client import spans as _spans
from kvcr_client.client_state import DEFAULT_MAX_COMPLETED
from kvcr_client.core import ClientCore
from kvcr_client.errors import ArgumentError, ClientClosed
from kvcr_client.lease_requests import LeaseRequests
from kvcr_client.puts import Puts
from kvcr_client.requests import CONTROL_TIMEOUT_S
from kvcr_client.results import (
    DeliverHandle,
    KeyOutcome,
    OpHandle,
    Presences,
    Results,
    StoreHandle,
)
from kvcr_client.spans import Destination, LayerPlan, Span
from kvcr_client.uncertain import extents
from kvcr_protocol import (
    AUDIT_VERSION,
    COLUMNS_VERSION,
    DEFAULT_LIMITS,
    PRESENCE_CODE,
    Completion,
    DeliverColumns,
    DeliverItem,
    Deposit,
    DepositItem,
    DiscardHint,
    Fetch,
    FetchItem,
    LayoutSpan,
    Message,
    Presence,
    Query,
    QueryColumns,
    QueryReply,
    Release,
    StatsReply,
    StatsRequest,
    SubmitHint,
    deposit_blocks,
    endpoint_problem,
    message_keys,
)
from kvcr_protocol import Deliver as DeliverMsg

DEFAULT_DEADLINE_MS = 30_000
RELEASE_DEADLINE_MS = 10_000
"""The deadline of a release (the node answers it at once)."""


class Operations(LeaseRequests):
    """What both clients share: request building, the handles operations return, their results."""

    def __init__(self, core: ClientCore, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        super().__init__(core, max_completed)
        self._puts = Puts(core, _weakly(self.deposit), self._counters, self._regions, self._grants, self._completions,
                          self._scope, self._uncertain.check)

    def deposit(
        self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
        deadline_ms: int = DEFAULT_DEADLINE_MS, parents: Mapping[bytes, bytes] | None = None,
    ) -> StoreHandle:
        """Store objects; each key maps to its layout's spans in order (with pools).

        ``parents``: key -> the key of its parent (an engine's block i-1 for block i), for the
        keys that have one. The node keeps it only to publish it with the key's ``stored``
        event, so that a router can build a tree of prefixes (spec section 15).

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
        self._uncertain.check(frozen)
        columns = deposit_blocks(frozen) if self.core.version >= COLUMNS_VERSION else ()
        records = () if columns else frozen
        parent_column = checks.parents(parents, message_keys(records, columns))
        op_id = self.core.next_id()
        written: Future[None] = Future()
        fut = self._send.send(
            op_id, "deposit", keys, lambda i: Deposit(i, records, no_evict, optional, deadline_ms, columns, parent_column),
            deadline_ms, True, regions, written=written)
        return self._send.store_handle(op_id, "deposit", fut, written, self._send.abort)

    def put(self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
            ttl_ms: int = 0, deadline_ms: int = DEFAULT_DEADLINE_MS,
            parents: Mapping[bytes, bytes] | None = None) -> StoreHandle:
        """``deposit``, this client WRITEing the bytes under a write grant when the node offers
        one. Returns at once; the handle's ``written`` says when the spans' memory is free."""
        return self._puts.put(objects, no_evict, optional, ttl_ms, deadline_ms, parents)

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
        self._uncertain.check(frozen)
        groups = None if plan is None else _spans.plan_groups(frozen, plan)
        # Memory the node reported uncertain goes by the node, which knows when it is free (spec section 12).
        granted = None if self._uncertain.node_reserved(frozen) else self._grants.cover(frozen)
        if granted is not None:
            # Every key is leased with a read grant: READ it ourselves, no node turn (spec section 6.12).
            return self._send.read_granted(frozen, keys, granted, groups, deadline_ms, regions)
        # Version 1 sessions cannot carry the flag; their remote deliveries name whole layouts.
        flag = partial and self.core.version >= 2
        columns: tuple[DeliverColumns, ...] = ()
        if self.core.version >= COLUMNS_VERSION:
            columns = _spans.deliver_columns(objects, frozen, groups)
        token = self._scope().token if columns and groups is not None else 0
        records = () if columns else frozen
        build = lambda i: DeliverMsg(i, records, request_id, deadline_ms, flag, columns, token)  # noqa: E731
        uncertain = self._uncertain

        def answered(msg: Message) -> None:
            assert isinstance(msg, Completion)
            uncertain.node_answered(frozen, msg.results)

        def hold() -> Callable[[], None]:
            # The caller stopped waiting; the node may still write there until it answers.
            return uncertain.hold(extents(frozen))

        if groups is None:
            return self._send.op("deliver", keys, build, deadline_ms, True, regions, answered, hold)
        return self._send.planned(keys, build, deadline_ms, regions, [max(g, default=0) + 1 for g in groups], token,
                                  answered, hold)

    def fetch(
        self, expected_layouts: Mapping[bytes, Sequence[tuple[str, str]]], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS, parents: Mapping[bytes, bytes] | None = None,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Make objects resident in the node (whole layouts); each OK result carries a release handle.

        ``deadline_ms`` and ``parents`` as for ``deposit``.
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
        parent_column = checks.parents(parents, keys)
        return self._send.op("fetch", keys, lambda i: Fetch(i, frozen, request_id, deadline_ms, parent_column),
                             deadline_ms, False, set())

    def release(self, handles: Iterable[int]) -> OpHandle[Results[KeyOutcome]]:
        """Drop handle claims; results are keyed by the handle as 8 big-endian bytes."""
        hs = checks.handles(handles)
        keys = [h.to_bytes(8, "big") for h in hs]
        frozen = tuple(hs)
        return self._send.op("release", keys, lambda i: Release(i, frozen), RELEASE_DEADLINE_MS, False, set())

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
        return self._send.handle(op_id, "query", fut)

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
        return self._send.handle(op_id, "query_prefix", fut)

    def submit_hint(self, request_id: str, source_endpoint: str, keys: Iterable[bytes]) -> OpHandle[None]:
        """Tell the node that, for ``request_id``, ``keys`` may be held by the node at ``source_endpoint``."""
        request_id = checks.request_id(request_id)
        checks.text(source_endpoint, "source_endpoint", DEFAULT_LIMITS.max_text)
        problem = endpoint_problem(source_endpoint)  # the node's own check (spec section 5.2)
        if problem is not None:
            raise ArgumentError("source_endpoint", problem)
        ks = checks.keys(keys, "keys")
        op_id, fut = self.core.request(lambda i: SubmitHint(i, request_id, source_endpoint, ks), checks.ack, CONTROL_TIMEOUT_S)
        return self._send.handle(op_id, "hint", fut)

    def discard_hint(self, request_id: str) -> OpHandle[None]:
        """The request is over: the node forgets its hints."""
        request_id = checks.request_id(request_id)
        op_id, fut = self.core.request(lambda i: DiscardHint(i, request_id), checks.ack, CONTROL_TIMEOUT_S)
        return self._send.handle(op_id, "unhint", fut)

    def abort(self, handle: OpHandle[Any]) -> None:
        """Best effort; the operation then completes, ABORTED where it had not finished."""
        if not isinstance(handle, OpHandle):
            raise ArgumentError("handle", f"expected an OpHandle of this client, got {type(handle).__name__}")
        handle.abort()

    def stats(self, *, audit: bool = False) -> OpHandle[dict[str, Any]]:
        """The node's statistics. ``audit``: the node also checks its accounting, O(objects) on
        its loop, and answers the breaches under ``invariants`` (empty when healthy); without it
        ``invariants`` is absent. A node below protocol 5 checks on every ``stats``."""
        def convert(msg: Message) -> dict[str, Any]:
            assert isinstance(msg, StatsReply)
            return msg.stats

        core = self.core
        op_id, fut = self.core.request(
            lambda i: StatsRequest(i, audit and core.version >= AUDIT_VERSION), convert, CONTROL_TIMEOUT_S)
        return self._send.handle(op_id, "stats", fut)


def _weakly(method: Callable[..., StoreHandle]) -> Callable[..., StoreHandle]:
    """``method`` of a client, held weakly: a part the client owns calls it without keeping the
    client alive (a closed client goes without the cyclic collector)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> StoreHandle:
        bound = ref()
        if bound is None:
            raise ClientClosed("the client is gone")
        return bound(*args, **kwargs)
    return call
