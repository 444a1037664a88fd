"""``Client`` (blocking) and ``AsyncClient`` (asyncio) over one ``ClientCore``.

Every operation checks its arguments before anything is sent (``ArgumentError`` names the
field) and returns an ``OpHandle`` that resolves to per-key results.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import operator
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast, overload

from kvcr_client.buffers import BufferError, describe
from kvcr_client.core import ClientCore
from kvcr_client.errors import ArgumentError, ClientClosed, KvcrError, NodeError, NodeLostError, OperationTimeout
from kvcr_client.leases import LeaseHandle
from kvcr_client.results import DeliverHandle, GroupDone, KeyOutcome, OpHandle, Presences, Results
from kvcr_protocol import (
    COLUMNS_VERSION,
    CURRENT_VERSION,
    DEFAULT_LIMITS,
    LEASES_VERSION,
    PRESENCE_CODE,
    Abort,
    Ack,
    Completion,
    DeliverColumns,
    DeliverItem,
    Deposit,
    DepositColumns,
    DepositItem,
    DiscardHint,
    DstSpan,
    ErrorCode,
    Fetch,
    FetchItem,
    LayoutSpan,
    Lease,
    LeaseEnded,
    LeaseReply,
    Message,
    PoolInfo,
    Presence,
    Query,
    QueryColumns,
    QueryReply,
    Region,
    RegisterRegions,
    Release,
    ReleaseLease,
    RenewLease,
    SrcSpan,
    StatsReply,
    StatsRequest,
    SubmitHint,
    UnregisterRegions,
    Welcome,
    code_of,
    deliver_columns,
    deposit_columns,
    endpoint_problem,
    prefix_mask,
    supported_up_to,
)
from kvcr_protocol import Deliver as DeliverMsg
from kvcr_protocol.columns import MAX_GROUPS
from kvcr_protocol.wire import NUL

log = logging.getLogger("kvcr.client")

DEFAULT_DEADLINE_MS = 30_000
DEFAULT_MAX_COMPLETED = 8192
"""Completed operations kept for ``poll_completed`` at most; older ones are dropped and counted."""
CONTROL_TIMEOUT_S = 10.0
"""How long a request the node answers at once waits (query, hints, stats, region announcements)."""
CONNECT_TIMEOUT_S = 10.0
"""The default wait for the node's welcome."""
ABORT_TIMEOUT_S = 5.0
"""How long an abort request waits for its acknowledgement (the operation completes on its own)."""
RELEASE_DEADLINE_MS = 10_000
"""The deadline of a release (the node answers it at once)."""
LOCAL_CALL_TIMEOUT_S = 30.0
"""How long registering or deregistering a buffer with our own NIXL agent may take."""
ANNOUNCE_TIMEOUT_S = 15.0
"""How long ``register`` waits for the node to accept the new region."""
CANCEL_UNREGISTER_S = 10.0
"""How long ``unregister`` waits for the node to answer the cancellation of a timed-out withdrawal."""


@dataclass(eq=False)
class RegionHandle:
    """A registered buffer: its region id on the wire and the memory behind it."""

    region: int
    kind: Any
    address: int
    length: int
    device: int
    buffer: Any = field(repr=False)
    registration: Any = field(repr=False, default=None)
    users: dict[int, str] = field(repr=False, default_factory=dict)
    """Operations the node may still run on this memory: op id -> kind (changed under the client's use lock)."""

    @property
    def in_use(self) -> int:
        """How many operations the node may still run on this memory (answered ones and timed-out ones)."""
        return len(self.users)

    def wire(self) -> Region:
        return Region(self.region, self.kind, self.device, self.address, self.length)


@dataclass(frozen=True, slots=True)
class Span:
    """Where one named span's bytes are (or go) in a registered buffer.

    ``pool`` is needed by ``deposit`` only: it names the node pool that stores the span.
    """

    name: str
    region: RegionHandle
    offset: int
    length: int
    pool: str = ""


@dataclass(frozen=True, eq=False)
class Destination:
    """Destination spans a client checked once (``Client.destination``); reuse it across delivers."""

    client: Any = field(repr=False)
    wire: tuple[DstSpan, ...] = field(repr=False)
    regions: frozenset[RegionHandle] = field(repr=False)

    def __len__(self) -> int:
        return len(self.wire)


_new_tuple = tuple.__new__


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ keys (z85 text, 40 characters) for a node that requires authentication."""

    server_public: str | bytes
    """The node's public key."""
    public: str | bytes
    secret: str | bytes


def _z85(key: str | bytes, path: str) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    if not isinstance(raw, bytes) or len(raw.strip()) != 40:
        raise ArgumentError(path, "expected a 40-character z85 CurveZMQ key")
    return raw.strip()


_U32_MAX = (1 << 32) - 1
"""Largest ``deadline_ms`` the protocol carries (uint32, spec section 6.4)."""
_U64_MAX = (1 << 64) - 1
"""Largest release handle the protocol carries (uint64, spec section 6.4)."""


def _uint(value: Any, path: str, maximum: int, minimum: int = 0) -> int:
    """An integer (not a bool) in ``minimum..maximum``, as a plain int."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentError(path, f"expected an int in {minimum}..{maximum}, got {type(value).__name__}")
    number = operator.index(value)
    if not minimum <= number <= maximum:
        raise ArgumentError(path, f"{number} is outside {minimum}..{maximum}")
    return number


def _deadline(value: Any) -> int:
    """Milliseconds the node may spend, counted from receipt; 0: the node's default (spec section 5.1)."""
    return _uint(value, "deadline_ms", _U32_MAX)


def _flag(value: Any, path: str) -> bool:
    if type(value) is not bool:
        raise ArgumentError(path, f"expected a bool, got {type(value).__name__}")
    return value


def _text(value: Any, path: str, limit: int, *, empty: bool = True) -> str:
    """A str of at most ``limit`` UTF-8 bytes (the protocol's limits, spec section 11)."""
    if not isinstance(value, str):
        raise ArgumentError(path, f"expected a str, got {type(value).__name__}")
    if not value and not empty:
        raise ArgumentError(path, "must not be empty")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ArgumentError(path, f"not encodable as UTF-8: {exc.reason}") from None
    if size > limit:
        raise ArgumentError(path, f"{size} bytes in UTF-8, at most {limit}")
    return value


def _request_id(value: Any) -> str:
    """A request id: a non-empty str of at most ``max_text`` bytes."""
    return _text(value, "request_id", DEFAULT_LIMITS.max_text, empty=False)


def _optional_request_id(value: Any) -> str | None:
    """A request id, or ``None`` for none."""
    return None if value is None else _request_id(value)


def _timeout(value: Any, path: str = "timeout") -> float:
    """A wait in seconds: a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ArgumentError(path, f"expected a positive number of seconds, got {value!r}")
    return float(value)


def _key(key: Any, path: str) -> bytes:
    if not isinstance(key, bytes):
        raise ArgumentError(path, f"keys are bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= DEFAULT_LIMITS.max_key:
        raise ArgumentError(path, f"a key has 1..{DEFAULT_LIMITS.max_key} bytes, got {len(key)}")
    return key


def _keys(items: Iterable[bytes], what: str) -> tuple[bytes, ...]:
    """A batch of keys (``_batch``), each checked as ``_key`` checks it: in a few C-level
    passes when all are good, key by key (naming the bad one) otherwise."""
    seq = _batch(items, what)
    if set(map(type, seq)) == {bytes}:
        sizes = set(map(len, seq))
        if min(sizes) >= 1 and max(sizes) <= DEFAULT_LIMITS.max_key:
            return tuple(seq)
    return tuple(_key(k, f"{what}[{i}]") for i, k in enumerate(seq))


def _prefix_mask(presences: Any) -> int:
    """The prefix mask (spec section 6.9) of the presences a prefix query counts."""
    if isinstance(presences, (str, bytes, Presence)) or not isinstance(presences, Iterable):
        raise ArgumentError("presences", f"expected an iterable of Presence, got {type(presences).__name__}")
    counted = list(presences)
    for i, presence in enumerate(counted):
        if not isinstance(presence, Presence):
            raise ArgumentError(f"presences[{i}]", f"expected a Presence, got {type(presence).__name__}")
        if presence is Presence.MISS:
            raise ArgumentError(f"presences[{i}]", "a prefix counts HIT, FETCHING or FETCHABLE keys, never MISS")
    if not counted:
        raise ArgumentError("presences", "count at least one of HIT, FETCHING and FETCHABLE")
    return prefix_mask(*counted)


def _span_total(items: Sequence[Any], attr: str, what: str) -> None:
    """One message carries at most ``max_spans`` spans over all its keys: refuse more before sending."""
    total = sum(len(getattr(item, attr)) for item in items)
    if total > DEFAULT_LIMITS.max_spans:
        raise ArgumentError(what, f"{total} spans in one call, at most {DEFAULT_LIMITS.max_spans}")


def _batch(items: Mapping[bytes, Any] | Iterable[bytes], what: str, mapping: bool = False) -> list[Any]:
    """The items of a call's batch: a mapping of key -> value where ``mapping``, else an iterable of keys."""
    if mapping:
        if not isinstance(items, Mapping):
            raise ArgumentError(what, f"expected a mapping of bytes keys, got {type(items).__name__}")
        seq = list(items.items())
    else:
        if isinstance(items, (str, bytes, bytearray, memoryview)) or not isinstance(items, Iterable):
            raise ArgumentError(what, f"expected an iterable of bytes keys, got {type(items).__name__}")
        seq = list(cast(Iterable[Any], items))
    if not seq:
        raise ArgumentError(what, "the batch is empty")
    if len(seq) > DEFAULT_LIMITS.max_keys:
        raise ArgumentError(what, f"{len(seq)} keys, at most {DEFAULT_LIMITS.max_keys} per call")
    return seq


class _Base:
    """What both clients share: argument checks, request building, result conversion."""

    core: ClientCore
    _regions: dict[int, RegionHandle]
    core_class: ClassVar[type[ClientCore]] = ClientCore
    """The session core a client runs on; a subclass may name a subclass of it (tests do, to lose notifications)."""

    def _init(
        self, endpoint: str, name: str | None, max_version: int, curve: CurveKeys | None = None,
        max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> None:
        _text(endpoint, "endpoint", DEFAULT_LIMITS.max_text, empty=False)
        max_completed = _uint(max_completed, "max_completed", 1 << 31, minimum=1)
        if name is not None:
            _text(name, "name", DEFAULT_LIMITS.max_name)
        if max_version not in supported_up_to(CURRENT_VERSION):
            raise ArgumentError("max_version", f"{max_version!r} is not one of {list(supported_up_to(CURRENT_VERSION))}")
        keys = None
        if curve is not None:
            keys = (_z85(curve.server_public, "curve.server_public"), _z85(curve.public, "curve.public"),
                    _z85(curve.secret, "curve.secret"))
        self.core = self.core_class(endpoint, name, max_version, curve=keys)
        self._regions = {}
        self._use_lock = threading.Lock()
        """Guards ``RegionHandle.users`` (a leaf lock: taken with or without the core's I/O lock)."""
        self._next_region = 1
        self._completed: collections.deque[OpHandle[Any] | GroupDone] = collections.deque(maxlen=max_completed)
        self._token = _new_token()
        """This session's notification token (spec section 6.10): a new one per session."""
        self._lingering: dict[int, set[RegionHandle]] = {}
        """Planned delivers answered ``DESTINATION_UNCERTAIN`` -> their regions not yet unregistered (lock held)."""
        self._polling = False
        """Whether the engine polls (it called ``poll_completed``): only then are completions queued."""
        self.completed_dropped = 0
        """Completions dropped from the full ``poll_completed`` queue (``max_completed``)."""
        self._leases: dict[int, LeaseHandle] = {}
        """Live leases by id, so that the node's ``lease_end`` reaches their handles (lock held)."""
        self.core.on_lease_end = self._lease_ended

    def _handle(self, op_id: int, kind: str, fut: Future[Any], abort: Any = None) -> OpHandle[Any]:
        handle: OpHandle[Any] = OpHandle(op_id, kind, fut, abort, self.core.wait, self.core.poll, self.core.wait_async)
        fut.add_done_callback(lambda _: self._queue_completed(handle))
        return handle

    def _queue_completed(self, handle: OpHandle[Any] | GroupDone) -> None:
        """Queue a completion (or a layer group's end) for ``poll_completed``: only for a
        polling engine, only if nobody waited on the operation."""
        if not self._polling or (handle.handle if isinstance(handle, GroupDone) else handle).waited:
            return
        queue = self._completed
        if len(queue) == queue.maxlen:
            self.completed_dropped += 1
            if self.completed_dropped == 1:
                log.warning("poll_completed queue full (%d): dropping the oldest completions", queue.maxlen)
        queue.append(handle)  # a full deque drops its oldest entry

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
        self._polling = True
        self.core.poll()
        out = []
        while self._completed:
            out.append(self._completed.popleft())
        return out

    def tables(self) -> dict[str, int]:
        """Sizes of the client's tables (for monitoring, and churn tests that check nothing grows)."""
        return {**self.core.tables(), "completed": len(self._completed), "regions": len(self._regions),
                "leases": len(self._leases)}

    @property
    def pools(self) -> dict[str, PoolInfo]:
        welcome = self.core.welcome
        return {p.name: p for p in welcome.pools} if welcome else {}

    @property
    def node(self) -> Welcome | None:
        """The node's welcome: its name, incarnation, version and pools."""
        return self.core.welcome

    # -- regions

    def _describe(self, buffer: Any) -> RegionHandle:
        try:
            info = describe(buffer)
        except BufferError as exc:
            raise ArgumentError("buffer", str(exc).removeprefix("buffer: ")) from exc
        handle = RegionHandle(self._next_region, info.kind, info.address, info.length, info.device, buffer)
        self._next_region += 1
        return handle

    def _register_on_io(self, handle: RegionHandle, announce: bool) -> Any:
        handle.registration = self.core.agent.register(handle.kind, handle.address, handle.length, handle.device)
        self._regions[handle.region] = handle
        return handle

    def _announce(self, handle: RegionHandle) -> tuple[int, Future[Any]]:
        return self.core.request(
            lambda i: RegisterRegions(i, self.core.agent.metadata(), (handle.wire(),)), _ack, CONTROL_TIMEOUT_S
        )

    def _check_span(self, span: Any, path: str, deposit: bool) -> RegionHandle:
        if not isinstance(span, Span):
            raise ArgumentError(path, f"expected a kvcr_client.Span, got {type(span).__name__}")
        if not isinstance(span.name, str) or len(span.name.encode()) > DEFAULT_LIMITS.max_name:
            raise ArgumentError(f"{path}.name", f"a span name is a str of at most {DEFAULT_LIMITS.max_name} bytes")
        region = span.region
        if not isinstance(region, RegionHandle) or self._regions.get(region.region) is not region:
            raise ArgumentError(f"{path}.region", "not a region registered with this client")
        if isinstance(span.offset, bool) or not isinstance(span.offset, int) or span.offset < 0:
            raise ArgumentError(f"{path}.offset", f"expected a non-negative int, got {span.offset!r}")
        if isinstance(span.length, bool) or not isinstance(span.length, int) or span.length <= 0:
            raise ArgumentError(f"{path}.length", f"expected a positive int, got {span.length!r}")
        if span.offset + span.length > region.length:
            raise ArgumentError(
                f"{path}.offset",
                f"[{span.offset}, {span.offset + span.length}) lies outside the region of {region.length} bytes",
            )
        if deposit:
            pool = self.pools.get(span.pool)
            if pool is None:
                raise ArgumentError(f"{path}.pool", f"the node has no pool {span.pool!r} (pools: {sorted(self.pools)})")
            if span.length != pool.slot_size:
                raise ArgumentError(f"{path}.length", f"pool {span.pool!r} holds spans of {pool.slot_size} bytes, got {span.length}")
        return region

    def _spans(self, key: bytes, spans: Any, path: str, deposit: bool) -> tuple[tuple[Any, ...], set[RegionHandle]]:
        """Check spans and turn them into wire records; the regions they use."""
        if isinstance(spans, Span) or not isinstance(spans, Sequence) or not spans:
            raise ArgumentError(path, "expected a non-empty sequence of Span")
        out: list[Any] = []
        append = out.append
        used: set[RegionHandle] = set()
        regions: dict[Any, Any] = self._regions
        pools = self.pools if deposit else {}
        max_name = DEFAULT_LIMITS.max_name // 4  # a str this short is within the byte limit in any encoding
        checked: RegionHandle | None = None
        for j, span in enumerate(spans):
            # Fast path for well-formed spans; anything unusual gets the detailed check,
            # which names the field.
            if type(span) is not Span:
                self._check_span(span, f"{path}[{j}]", deposit)
            name, region, offset, length = span.name, span.region, span.offset, span.length
            if region is not checked:
                if regions.get(getattr(region, "region", None)) is not region:
                    self._check_span(span, f"{path}[{j}]", deposit)
                used.add(region)
                checked = region
            if (
                type(name) is not str or len(name) > max_name
                or type(offset) is not int or type(length) is not int
                or offset < 0 or length <= 0
                or offset + length > region.length
                or (deposit and ((pool := pools.get(span.pool)) is None or length != pool.slot_size))
            ):
                self._check_span(span, f"{path}[{j}]", deposit)
            # Spans are tuples on the wire: build them as tuples (what NamedTuple._make does).
            if deposit:
                append(_new_tuple(SrcSpan, (name, span.pool, region.region, offset, length)))
            else:
                append(_new_tuple(DstSpan, (name, region.region, offset, length)))
        return tuple(out), used

    def destination(self, spans: Sequence[Span]) -> Destination:
        """Destination spans checked once, for delivering into the same memory again and again.

        ``deliver`` takes a ``Destination`` wherever it takes a sequence of ``Span``, and
        then does no per-span work. It stays valid while its regions stay registered.
        """
        if isinstance(spans, Sequence) and len(spans) > DEFAULT_LIMITS.max_spans:
            raise ArgumentError("spans", f"{len(spans)} spans, at most {DEFAULT_LIMITS.max_spans}")
        wire, used = self._spans(b"", spans, "spans", deposit=False)
        return Destination(self, wire, frozenset(used))

    def _destination(self, dest: Destination, path: str) -> tuple[tuple[Any, ...], set[RegionHandle]]:
        if dest.client is not self:
            raise ArgumentError(path, "a Destination made by another client")
        for region in dest.regions:
            if self._regions.get(region.region) is not region:
                raise ArgumentError(path, f"region {region.region} of this Destination is no longer registered")
        return dest.wire, set(dest.regions)

    def _span_items(
        self, objects: Mapping[bytes, Any], item: Callable[[bytes, tuple[Any, ...]], Any], deposit: bool
    ) -> tuple[tuple[Any, ...], list[bytes], set[RegionHandle]]:
        """A deposit's or deliver's wire items (each key's checked spans; a deliver may name a
        prepared ``Destination``), their keys, and the regions they use."""
        items, keys, regions = [], [], set()
        for key, spans in _batch(objects, "objects", mapping=True):
            path = f"objects[{key!r}]"
            _key(key, path)
            if not deposit and type(spans) is Destination:
                wire, used = self._destination(spans, f"{path}.spans")
            else:
                wire, used = self._spans(key, spans, f"{path}.spans", deposit=deposit)
            items.append(item(key, wire))
            keys.append(key)
            regions |= used
        _span_total(items, "spans", "objects")
        return tuple(items), keys, regions

    # -- operations

    def _op(self, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool, regions: set[RegionHandle]) -> OpHandle[Any]:
        """Send one operation; its handle resolves to per-key results (``_send_op``)."""
        op_id = self.core.next_id()
        fut = self._send_op(op_id, kind, keys, build, deadline_ms, touches, regions)
        return self._handle(op_id, kind, fut, self._abort)

    def _send_op(
        self, op_id: int, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool,
        regions: set[RegionHandle], on_reply: Callable[[Message], None] | None = None,
        observer: Callable[[Any], None] | None = None,
    ) -> Future[Any]:
        """Send one operation. Its regions stay in use until the node can no longer touch them.

        That is when the node answered, or the session is over (closed, or the node lost);
        not when the client merely stopped waiting (spec section 5.1). ``deadline_ms`` 0
        is the node's default, which the client does not know: it waits for the answer.
        ``on_reply`` sees the reply first, ``observer`` the request's events (lock held).
        """
        if regions:
            with self._use_lock:
                for region in regions:
                    region.users[op_id] = kind

        def settled() -> None:
            with self._use_lock:
                for region in regions:
                    region.users.pop(op_id, None)

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
    ) -> OpHandle[Results[KeyOutcome]]:
        """Store objects; each key maps to its layout's spans in order (with pools).

        ``deadline_ms``: milliseconds the node may spend, counted from its receipt of the
        request (0..2**32-1); 0 means the node's default (its ``deadline_ms`` setting,
        spec section 5.1). The client waits for the answer until that deadline plus a
        grace of 2 s, or, for 0, until the answer or the end of the session; then the
        handle fails with ``OperationTimeout``, but the regions the spans name stay in use
        (``unregister`` refuses them) until the node's late answer or the session's end.
        """
        no_evict = _flag(no_evict, "no_evict")
        optional = _flag(optional, "optional")
        deadline_ms = _deadline(deadline_ms)
        frozen, keys, regions = self._span_items(objects, DepositItem, deposit=True)
        columns = _deposit_blocks(frozen) if self.core.version >= COLUMNS_VERSION else ()
        records = () if columns else frozen
        return self._op(
            "deposit", keys, lambda i: Deposit(i, records, no_evict, optional, deadline_ms, columns), deadline_ms, True, regions)

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
        request_id = _optional_request_id(request_id)
        deadline_ms = _deadline(deadline_ms)
        partial = _flag(partial, "partial")
        frozen, keys, regions = self._span_items(objects, DeliverItem, deposit=False)
        groups = None if plan is None else _plan_groups(frozen, plan)
        # Version 1 sessions cannot carry the flag; their remote deliveries name whole layouts.
        flag = partial and self.core.version >= 2
        columns: tuple[DeliverColumns, ...] = ()
        if self.core.version >= COLUMNS_VERSION:
            columns = _deliver_blocks(frozen, groups)
        token = self._token if columns and groups is not None else 0
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
        handle.on_group = self._queue_completed

        def reply(msg: Message) -> None:
            assert isinstance(msg, Completion)
            handle.apply(handle.progress.on_reply(msg))
            if token and regions and any(r.code == ErrorCode.DESTINATION_UNCERTAIN for r in msg.results):
                # A source may still write (and notify) into these regions: keep our agent
                # progressed until they are unregistered (spec section 12).
                self._lingering[op_id] = set(regions)
                self.core.lingering.add(op_id)

        fut = self._send_op(op_id, "deliver", keys, build, deadline_ms, True, regions, reply, handle.observe)
        handle.future = fut
        fut.add_done_callback(lambda f: _end_groups(handle, f))
        fut.add_done_callback(lambda _: self._queue_completed(handle))
        return handle

    def fetch(
        self, expected_layouts: Mapping[bytes, Sequence[tuple[str, str]]], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Make objects resident in the node (whole layouts); each OK result carries a release handle.

        ``deadline_ms`` as for ``deposit``.
        """
        request_id = _optional_request_id(request_id)
        deadline_ms = _deadline(deadline_ms)
        items, keys = [], []
        for key, layout in _batch(expected_layouts, "expected_layouts", mapping=True):
            path = f"expected_layouts[{key!r}]"
            _key(key, path)
            if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence) or not layout:
                raise ArgumentError(path, "expected a non-empty sequence of (span name, pool) pairs")
            for j, s in enumerate(layout):
                if not (isinstance(s, tuple) and len(s) == 2):
                    raise ArgumentError(f"{path}[{j}]", "expected a (span name, pool) pair")
                _text(s[0], f"{path}[{j}]", DEFAULT_LIMITS.max_name)
                _text(s[1], f"{path}[{j}]", DEFAULT_LIMITS.max_name)
            items.append(FetchItem(key, tuple(LayoutSpan(n, p) for n, p in layout)))
            keys.append(key)
        _span_total(items, "layout", "expected_layouts")
        frozen = tuple(items)
        return self._op("fetch", keys, lambda i: Fetch(i, frozen, request_id, deadline_ms), deadline_ms, False, set())

    def release(self, handles: Iterable[int]) -> OpHandle[Results[KeyOutcome]]:
        """Drop handle claims; results are keyed by the handle as 8 big-endian bytes."""
        if isinstance(handles, (str, bytes, bytearray, memoryview)) or not isinstance(handles, Iterable):
            raise ArgumentError("handles", f"expected an iterable of int handles, got {type(handles).__name__}")
        hs = [_uint(h, f"handles[{i}]", _U64_MAX, minimum=1) for i, h in enumerate(handles)]
        if not hs:
            raise ArgumentError("handles", "the batch is empty")
        if len(hs) > DEFAULT_LIMITS.max_keys:
            raise ArgumentError("handles", f"{len(hs)} handles, at most {DEFAULT_LIMITS.max_keys} per call")
        keys = [h.to_bytes(8, "big") for h in hs]
        frozen = tuple(hs)
        return self._op("release", keys, lambda i: Release(i, frozen), RELEASE_DEADLINE_MS, False, set())

    def query(self, keys: Iterable[bytes], request_id: str | None = None) -> OpHandle[Presences]:
        """Where are these keys? Advisory: a HIT may be evicted before the next call.

        The answers (``Presences``) map each key to its ``KeyPresence``, decoded when read.
        """
        request_id = _optional_request_id(request_id)
        ks = _keys(keys, "keys")

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
        request_id = _optional_request_id(request_id)
        ks = _keys(keys, "keys")
        mask = _prefix_mask(presences)
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
        request_id = _request_id(request_id)
        _text(source_endpoint, "source_endpoint", DEFAULT_LIMITS.max_text)
        problem = endpoint_problem(source_endpoint)  # the node's own check (spec section 5.2)
        if problem is not None:
            raise ArgumentError("source_endpoint", problem)
        ks = _keys(keys, "keys")
        op_id, fut = self.core.request(lambda i: SubmitHint(i, request_id, source_endpoint, ks), _ack, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "hint", fut)

    def discard_hint(self, request_id: str) -> OpHandle[None]:
        """The request is over: the node forgets its hints."""
        request_id = _request_id(request_id)
        op_id, fut = self.core.request(lambda i: DiscardHint(i, request_id), _ack, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "unhint", fut)

    def abort(self, handle: OpHandle[Any]) -> None:
        """Best effort; the operation then completes, ABORTED where it had not finished."""
        if not isinstance(handle, OpHandle):
            raise ArgumentError("handle", f"expected an OpHandle of this client, got {type(handle).__name__}")
        handle.abort()

    # ------------------------------------------------------------------ leases

    def lease(self, keys: Iterable[bytes], request_id: str | None = None, ttl_ms: int = 0) -> OpHandle[LeaseHandle]:
        """Hold ``keys`` from now through every delivery of them (spec section 6.11).

        The handle resolves to a ``LeaseHandle`` that says per key what is held: here
        (``LEASED``), at the source the hint for ``request_id`` names (``LEASED_REMOTE``), or
        not (``MISS``, ``PENDING``, ``LEASE_LIMIT``, ``ADVISORY``, ``UNREACHABLE``: treat as a
        miss). Held keys cannot be evicted until the lease is released, expires (``ttl_ms``,
        0: the node's default) or its session ends. Needs a node speaking version 4.
        """
        request_id = _optional_request_id(request_id)
        ks = _keys(keys, "keys")
        ttl = _uint(ttl_ms, "ttl_ms", 0xFFFFFFFF)
        self._need_leases()
        core = self.core
        asked_at = time.monotonic()
        welcome = core.welcome

        def live() -> bool:
            return not core._closed and not core.lost and core.welcome is welcome

        def convert(msg: Message) -> LeaseHandle:
            if not isinstance(msg, LeaseReply) or msg.columns is None:
                raise ValueError(f"expected lease_reply with columns, got {msg.TAG}")
            if len(msg.columns) != len(ks):
                raise ValueError(f"{len(msg.columns)} answers for {len(ks)} keys")
            handle = LeaseHandle(msg.lease, msg.ttl_ms, ks, msg.columns, asked_at, self.renew_lease, self.release_lease, live)
            if msg.lease:
                self._leases[msg.lease] = handle
            return handle

        op_id, fut = core.request(lambda i: Lease(i, ks, request_id, ttl), convert, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "lease", fut)

    def renew_lease(self, lease: LeaseHandle, ttl_ms: int = 0) -> OpHandle[int]:
        """Keep ``lease`` ``ttl_ms`` more from now (0: its own time to live); resolves to the
        granted time to live. A lease the node no longer holds fails ``NodeError(UNKNOWN_LEASE)``."""
        self._live_lease(lease)
        ttl = _uint(ttl_ms, "ttl_ms", 0xFFFFFFFF)
        asked_at = time.monotonic()

        def convert(msg: Message) -> int:
            if not isinstance(msg, LeaseReply):
                raise ValueError(f"expected lease_reply, got {msg.TAG}")
            lease.renewed(msg.ttl_ms, asked_at)
            return msg.ttl_ms

        op_id, fut = self.core.request(lambda i: RenewLease(i, lease.id, ttl), convert, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "renew", fut)

    def release_lease(self, lease: LeaseHandle) -> OpHandle[None]:
        """End ``lease`` now: what it held may be evicted again. A second release (or one of
        a lease that ended) is an ``ArgumentError``; the node frees nothing twice either."""
        self._live_lease(lease)
        lease.released = True
        lease.end(ErrorCode.OK, "released")
        self._leases.pop(lease.id, None)
        op_id, fut = self.core.request(lambda i: ReleaseLease(i, lease.id), _ack, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "unlease", fut)

    def _live_lease(self, lease: Any) -> None:
        if not isinstance(lease, LeaseHandle):
            raise ArgumentError("lease", f"expected a LeaseHandle, got {type(lease).__name__}")
        if lease.released:
            raise ArgumentError("lease", f"lease {lease.id} was released already")
        if lease.ended is not None or self._leases.get(lease.id) is not lease:
            raise ArgumentError("lease", f"lease {lease.id} is not held (ended: {lease.ended!r} {lease.end_reason})".rstrip())

    def _need_leases(self) -> None:
        version = self.core.version
        if version and version < LEASES_VERSION:
            raise NodeError(ErrorCode.PEER_UNSUPPORTED, f"the session agreed on version {version}; leases need {LEASES_VERSION}")

    def _lease_ended(self, msg: LeaseEnded) -> None:
        """The node's ``lease_end`` (lock held): the handle learns what it no longer holds."""
        handle = self._leases.get(msg.lease)
        if handle is None:
            return
        handle.end(msg.code, msg.reason, msg.keys)
        if handle.ended is not None:
            del self._leases[msg.lease]

    def stats(self) -> OpHandle[dict[str, Any]]:
        def convert(msg: Message) -> dict[str, Any]:
            assert isinstance(msg, StatsReply)
            return msg.stats

        op_id, fut = self.core.request(lambda i: StatsRequest(i), convert, CONTROL_TIMEOUT_S)
        return self._handle(op_id, "stats", fut)

    def _unregister_check(self, region: RegionHandle) -> None:
        if not isinstance(region, RegionHandle) or self._regions.get(region.region) is not region:
            raise ArgumentError("region", "not a region registered with this client")
        with self._use_lock:
            users = sorted(region.users.items())
        if users:
            late = self.core.timed_out_ids()
            ops = ", ".join(
                f"{kind} #{op_id}" + (" (timed out here, the node has not answered)" if op_id in late else "")
                for op_id, kind in users
            )
            raise ArgumentError("region", f"operations the node may still run on it: {ops}")

    @staticmethod
    def _unregister_timeout(timeout: float | None) -> None:
        if timeout is None:
            return
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0 or math.isinf(timeout):
            raise ArgumentError("timeout", f"expected None or a finite number of seconds >= 0, got {timeout!r}")

    def _withdraw(self, region: RegionHandle) -> tuple[int, Future[Any]]:
        """Send ``unregions`` for ``region``; its ack may take as long as a source may still write there."""
        return self.core.request(lambda i: UnregisterRegions(i, (region.region,)), _ack, math.inf)

    def _cancel_withdrawal(self, region: RegionHandle, op_id: int, fut: Future[Any], timeout: float | None) -> bool:
        """The ack did not come within ``timeout``: ask the node to keep the region (abort the
        ``unregions``). True if the ack came meanwhile after all; else raises, the region
        staying registered here and announced at the node (spec section 5.2)."""
        self.core.request(lambda i: Abort(i, op_id), lambda m: None, CANCEL_UNREGISTER_S)
        try:
            self.core.wait(fut, CANCEL_UNREGISTER_S)
        except NodeError as exc:
            if exc.code != ErrorCode.ABORTED:
                raise
        except FutureTimeout:
            pass
        else:
            return True
        raise OperationTimeout(
            f"region {region.region}: the node did not release it within {timeout} s (a source may still write "
            "into it after a DESTINATION_UNCERTAIN delivery); it stays registered and announced: call unregister again later"
        )

    def _unregister_on_io(self, region: RegionHandle) -> None:
        for op_id, held in list(self._lingering.items()):
            held.discard(region)
            if not held:
                del self._lingering[op_id]
                self.core.lingering.discard(op_id)
        self._regions.pop(region.region, None)
        if region.registration is not None:
            self.core.agent.deregister(region.registration)
            region.registration = None

    def _hello(self, timeout_s: float) -> Future[Any]:
        self._token = _new_token()  # a late notification of the old session matches nothing
        self._leases.clear()  # leases end with their session: their handles say NODE_LOST
        regions = list(self._regions.values())  # one step: another thread may register meanwhile
        return self.core.hello(tuple(r.wire() for r in regions), timeout_s)


LayerPlan = Sequence[Sequence[str]] | Mapping[bytes, Sequence[Sequence[str]]]
"""A deliver's layer plan: groups of span names that every key follows, or one per key."""


def _new_token() -> int:
    return secrets.randbits(32) or 1


def _plan_groups(items: Sequence[DeliverItem], plan: Any) -> list[tuple[int, ...]]:
    """Each key's group number per span (empty: one group) from a layer plan; ``ArgumentError``
    naming the part of the plan that is wrong.

    A plan shared by every key is read once; each key then costs one lookup per span. Only
    a plan that does not fit is walked again, to name what is wrong."""
    per_key = isinstance(plan, Mapping)
    if not per_key and (isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence)):
        raise ArgumentError("plan", "expected a sequence of groups of span names, or a mapping of key -> such a sequence")
    if per_key:
        unknown = [k for k in plan if k not in {item.key for item in items}]
        if unknown:
            raise ArgumentError(f"plan[{unknown[0]!r}]", "not a key of this deliver")
    shared = None if per_key else _group_index(plan)
    out: list[tuple[int, ...]] = []
    for item in items:
        groups = plan.get(item.key) if per_key else plan
        if groups is None:
            out.append(())
            continue
        index = shared if shared is not None else _group_index(groups)
        names = [span[0] for span in item.spans]
        # Fits when the plan names exactly the key's spans, each once.
        if index is None or len(index) != len(names) or index.keys() != set(names):
            out.append(_plan_numbers(item, groups, f"plan[{item.key!r}]" if per_key else "plan"))
            continue
        out.append(tuple([index[name] for name in names]))
    return out


def _group_index(groups: Any) -> dict[str, int] | None:
    """Span name -> group number of a plan for one key made of lists or tuples, each name
    once; None for anything else (``_plan_numbers`` then walks it and names any fault)."""
    if type(groups) not in (list, tuple) or not groups or len(groups) > MAX_GROUPS:
        return None
    index: dict[str, int] = {}
    named = 0
    for g, names in enumerate(groups):
        if type(names) not in (list, tuple) or not names:
            return None
        named += len(names)
        for name in names:
            index[name] = g
    return index if len(index) == named else None


def _plan_numbers(item: DeliverItem, groups: Any, path: str) -> tuple[int, ...]:
    """``item``'s group number per span from ``groups``, checked name by name; an
    ``ArgumentError`` naming the first thing that is wrong."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ArgumentError(path, "expected a non-empty sequence of groups of span names")
    if len(groups) > MAX_GROUPS:
        raise ArgumentError(path, f"{len(groups)} groups, at most {MAX_GROUPS}")
    index = {span[0]: j for j, span in enumerate(item.spans)}
    if len(index) != len(item.spans):
        raise ArgumentError(path, f"key {item.key!r} names a span twice: a plan names spans by name")
    numbers = [-1] * len(item.spans)
    for g, names in enumerate(groups):
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not names:
            raise ArgumentError(f"{path}[{g}]", "expected a non-empty sequence of span names")
        for n, name in enumerate(names):
            j = index.get(name)
            if j is None:
                raise ArgumentError(f"{path}[{g}][{n}]", f"{name!r} is not a span of key {item.key!r}")
            if numbers[j] != -1:
                raise ArgumentError(f"{path}[{g}][{n}]", f"span {name!r} is already in group {numbers[j]}")
            numbers[j] = g
    if -1 in numbers:
        missing = item.spans[numbers.index(-1)][0]
        raise ArgumentError(path, f"span {missing!r} of key {item.key!r} is in no group")
    return tuple(numbers)


def _deliver_blocks(items: Sequence[DeliverItem], groups: Sequence[tuple[int, ...]] | None) -> tuple[DeliverColumns, ...]:
    """The items as column blocks of consecutive keys with one layout and plan (spec section
    6.7); none (send records) when a span name holds NUL."""
    blocks: list[DeliverColumns] = []
    run: list[DeliverItem] = []
    shape: tuple[Any, ...] | None = None
    for n, item in enumerate(items):
        names, _, _, lengths = zip(*item.spans, strict=True)
        plan = groups[n] if groups is not None else ()
        this = (names, lengths, plan)
        if this != shape:
            if run:
                blocks.append(deliver_columns(run, shape[2] if shape is not None else ()))
            run, shape = [], this
            if any(NUL in name for name in names):
                return ()
        run.append(item)
    if run and shape is not None:
        blocks.append(deliver_columns(run, shape[2]))
    return tuple(blocks)


def _deposit_blocks(items: Sequence[DepositItem]) -> tuple[DepositColumns, ...]:
    """Deposit items as column blocks of consecutive keys of one layout; none when a name or pool holds NUL."""
    blocks: list[DepositColumns] = []
    run: list[DepositItem] = []
    shape: tuple[Any, ...] | None = None
    for item in items:
        names, pools, _, _, lengths = zip(*item.spans, strict=True)
        this = (names, pools, lengths)
        if this != shape:
            if run:
                blocks.append(deposit_columns(run))
            run, shape = [], this
            if any(NUL in name for name in names + pools):
                return ()
        run.append(item)
    if run:
        blocks.append(deposit_columns(run))
    return tuple(blocks)


def _end_groups(handle: DeliverHandle, future: Future[Any]) -> None:
    """A planned deliver ended without a reply to read (spec section 6.10): its groups not yet
    delivered fail with the reason (the client's deadline, the session's loss, a refusal)."""
    exc = future.exception()
    if exc is None:
        return
    if isinstance(exc, OperationTimeout):
        code = int(ErrorCode.TIMEOUT)
    elif isinstance(exc, (NodeLostError, ClientClosed)):
        code = int(ErrorCode.NODE_LOST)
    elif isinstance(exc, NodeError):
        code = int(exc.code)
    else:
        code = int(ErrorCode.INTERNAL)
    handle.apply(handle.progress.end(code))


def _ack(msg: Message) -> None:
    if not isinstance(msg, Ack):
        raise ValueError(f"expected ack, got {msg.TAG}")


class Client(_Base):
    """The blocking client. ``with Client(endpoint) as c: ...``"""

    def __init__(
        self, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = CONNECT_TIMEOUT_S,
        curve: CurveKeys | None = None, max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> None:
        timeout = _timeout(timeout)
        self._init(endpoint, name, max_version, curve, max_completed)
        try:
            self.core.wait(self._hello(timeout), timeout + 5)
        except BaseException:
            self.core.close()
            raise

    @classmethod
    def connect(
        cls, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = CONNECT_TIMEOUT_S,
        curve: CurveKeys | None = None, max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> Client:
        """Open a session with the node at ``endpoint`` (the same as the constructor)."""
        return cls(endpoint, name, max_version, timeout, curve, max_completed)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, buffer: Any) -> RegionHandle:
        """Register a numpy/CuPy/torch buffer with NIXL and announce it to the node."""
        handle = self._describe(buffer)
        self.core.call(lambda: self._register_on_io(handle, True)).result(LOCAL_CALL_TIMEOUT_S)
        try:
            self.core.wait(self._announce(handle)[1], ANNOUNCE_TIMEOUT_S)
        except BaseException:
            self.core.call(lambda: self._unregister_on_io(handle)).result(LOCAL_CALL_TIMEOUT_S)
            raise
        return handle

    def unregister(self, region: RegionHandle, timeout: float | None = None) -> None:
        """Stop using a buffer: the node forgets the region, then NIXL deregisters it.

        The node acknowledges only once nothing may write the region any more; after a
        ``DESTINATION_UNCERTAIN`` delivery into it, that is when the source confirms or is
        known gone. ``timeout`` (seconds; None: as long as that takes) bounds the wait: past
        it, ``OperationTimeout`` is raised and the region stays registered and announced.
        """
        self._unregister_check(region)
        self._unregister_timeout(timeout)
        op_id, fut = self._withdraw(region)
        try:
            self.core.wait(fut, timeout)
        except FutureTimeout:
            self._cancel_withdrawal(region, op_id, fut, timeout)
        self.core.call(lambda: self._unregister_on_io(region)).result(LOCAL_CALL_TIMEOUT_S)

    def reconnect(self, timeout: float = CONNECT_TIMEOUT_S) -> Welcome:
        """Open a new session (after node loss or restart), announcing every registered region."""
        timeout = _timeout(timeout)
        result: Welcome = self.core.wait(self._hello(timeout), timeout + 5)
        return result

    def close(self) -> None:
        """Bye to the node, deregister every buffer, stop the I/O thread."""
        core = self.core
        if core._closed:
            return
        try:
            core.close()
        finally:
            for region in list(self._regions.values()):
                if region.registration is not None:
                    core.agent.deregister(region.registration)
                    region.registration = None
            self._regions.clear()


class AsyncClient(_Base):
    """The asyncio client. ``async with await AsyncClient.connect(endpoint) as c: ...``"""

    def __init__(
        self, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, curve: CurveKeys | None = None,
        max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> None:
        self._init(endpoint, name, max_version, curve, max_completed)

    @classmethod
    async def connect(
        cls, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = CONNECT_TIMEOUT_S,
        curve: CurveKeys | None = None, max_completed: int = DEFAULT_MAX_COMPLETED,
    ) -> AsyncClient:
        timeout = _timeout(timeout)
        client = cls(endpoint, name, max_version, curve, max_completed)
        try:
            await client.core.wait_async(client._hello(timeout))
        except BaseException:
            await asyncio.to_thread(client.core.close)
            raise
        return client

    async def __aenter__(self) -> AsyncClient:
        if self.core.welcome is None:
            await self.core.wait_async(self._hello(CONNECT_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(self, buffer: Any) -> RegionHandle:
        handle = self._describe(buffer)
        await asyncio.wrap_future(self.core.call(lambda: self._register_on_io(handle, True)))
        try:
            await self.core.wait_async(self._announce(handle)[1])
        except BaseException:
            await asyncio.wrap_future(self.core.call(lambda: self._unregister_on_io(handle)))
            raise
        return handle

    async def unregister(self, region: RegionHandle, timeout: float | None = None) -> None:
        """As ``Client.unregister``: waits (up to ``timeout`` s) until the node releases the region."""
        self._unregister_check(region)
        self._unregister_timeout(timeout)
        op_id, fut = self._withdraw(region)
        done, _ = await asyncio.wait({asyncio.wrap_future(fut)}, timeout=timeout)
        if done:
            done.pop().result()
        else:
            await asyncio.to_thread(self._cancel_withdrawal, region, op_id, fut, timeout)
        await asyncio.wrap_future(self.core.call(lambda: self._unregister_on_io(region)))

    async def reconnect(self, timeout: float = CONNECT_TIMEOUT_S) -> Welcome:
        timeout = _timeout(timeout)
        result: Welcome = await self.core.wait_async(self._hello(timeout))
        return result

    async def close(self) -> None:
        await asyncio.to_thread(Client.close, self)  # type: ignore[arg-type]


__all__ = ["AsyncClient", "Client", "CurveKeys", "KvcrError", "NodeLostError", "RegionHandle", "Span"]
