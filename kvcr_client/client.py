"""``Client`` (blocking) and ``AsyncClient`` (asyncio) over one ``ClientCore``.

Every operation checks its arguments before anything is sent (``ArgumentError`` names the
field) and returns an ``OpHandle`` that resolves to per-key results.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kvcr_client.buffers import BufferError, describe
from kvcr_client.core import ClientCore
from kvcr_client.errors import ArgumentError, KvcrError, NodeError, NodeLostError, OperationTimeout
from kvcr_client.results import KeyOutcome, KeyPresence, OpHandle, Results
from kvcr_protocol import (
    CURRENT_VERSION,
    DEFAULT_LIMITS,
    Abort,
    Ack,
    Completion,
    DeliverItem,
    Deposit,
    DepositItem,
    DiscardHint,
    DstSpan,
    ErrorCode,
    Fetch,
    FetchItem,
    LayoutSpan,
    Message,
    PoolInfo,
    Query,
    QueryReply,
    Region,
    RegisterRegions,
    Release,
    SrcSpan,
    StatsReply,
    StatsRequest,
    SubmitHint,
    UnregisterRegions,
    Welcome,
    endpoint_problem,
)
from kvcr_protocol import Deliver as DeliverMsg

DEFAULT_DEADLINE_MS = 30_000
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
    in_use: int = 0

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


def _key(key: Any, path: str) -> bytes:
    if not isinstance(key, bytes):
        raise ArgumentError(path, f"keys are bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= DEFAULT_LIMITS.max_key:
        raise ArgumentError(path, f"a key has 1..{DEFAULT_LIMITS.max_key} bytes, got {len(key)}")
    return key


def _span_total(items: Sequence[Any], attr: str, what: str) -> None:
    """One message carries at most ``max_spans`` spans over all its keys: refuse more before sending."""
    total = sum(len(getattr(item, attr)) for item in items)
    if total > DEFAULT_LIMITS.max_spans:
        raise ArgumentError(what, f"{total} spans in one call, at most {DEFAULT_LIMITS.max_spans}")


def _batch(items: Mapping[bytes, Any] | Iterable[bytes], what: str) -> list[Any]:
    seq = list(items.items()) if isinstance(items, Mapping) else list(items)
    if not seq:
        raise ArgumentError(what, "the batch is empty")
    if len(seq) > DEFAULT_LIMITS.max_keys:
        raise ArgumentError(what, f"{len(seq)} keys, at most {DEFAULT_LIMITS.max_keys} per call")
    return seq


class _Base:
    """What both clients share: argument checks, request building, result conversion."""

    core: ClientCore
    _regions: dict[int, RegionHandle]

    def _init(self, endpoint: str, name: str | None, max_version: int, curve: CurveKeys | None = None) -> None:
        keys = None
        if curve is not None:
            keys = (_z85(curve.server_public, "curve.server_public"), _z85(curve.public, "curve.public"),
                    _z85(curve.secret, "curve.secret"))
        self.core = ClientCore(endpoint, name, max_version, curve=keys)
        self._regions = {}
        self._next_region = 1
        self._completed: collections.deque[OpHandle[Any]] = collections.deque()

    def _handle(self, op_id: int, kind: str, fut: Future[Any], abort: Any = None) -> OpHandle[Any]:
        handle: OpHandle[Any] = OpHandle(op_id, kind, fut, abort, self.core.wait, self.core.poll)
        fut.add_done_callback(lambda _: self._completed.append(handle))
        return handle

    def poll_completed(self) -> list[OpHandle[Any]]:
        """Every operation that completed since the last call, for engines that poll once per step."""
        self.core.poll()
        out = []
        while self._completed:
            out.append(self._completed.popleft())
        return out

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
            lambda i: RegisterRegions(i, self.core.agent.metadata(), (handle.wire(),)), _ack, 10.0
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

    # -- operations

    def _op(self, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool, regions: set[RegionHandle]) -> OpHandle[Any]:
        for region in regions:
            region.in_use += 1

        def convert(msg: Message) -> Results[Any]:
            assert isinstance(msg, Completion)
            if len(msg.results) != len(keys):
                raise ValueError(f"{len(msg.results)} results for {len(keys)} keys")
            return Results([
                (k, KeyOutcome(r.status, ErrorCode(r.code) if r.code in ErrorCode._value2member_map_ else r.code, r.reason, r.handle))
                for k, r in zip(keys, msg.results, strict=True)
            ])

        op_id, fut = self.core.request(build, convert, deadline_ms / 1000, touches)

        def unuse(_: Future[Any]) -> None:
            for region in regions:
                region.in_use -= 1

        fut.add_done_callback(unuse)
        return self._handle(op_id, kind, fut, self._abort)

    def _abort(self, op_id: int) -> None:
        self.core.request(lambda i: Abort(i, op_id), lambda m: None, 5.0)

    def deposit(
        self, objects: Mapping[bytes, Sequence[Span]], no_evict: bool = False, optional: bool = False,
        deadline_ms: int = DEFAULT_DEADLINE_MS,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Store objects; each key maps to its layout's spans in order (with pools)."""
        items, keys, regions = [], [], set()
        for key, spans in _batch(objects, "objects"):
            path = f"objects[{key!r}]"
            _key(key, path)
            wire, used = self._spans(key, spans, f"{path}.spans", deposit=True)
            items.append(DepositItem(key, wire))
            keys.append(key)
            regions |= used
        _span_total(items, "spans", "objects")
        frozen = tuple(items)
        return self._op("deposit", keys, lambda i: Deposit(i, frozen, no_evict, optional, deadline_ms), deadline_ms, True, regions)

    def deliver(
        self, objects: Mapping[bytes, Sequence[Span] | Destination], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS, partial: bool = False,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Put objects' bytes into registered memory: the whole layout or an ordered subset of its spans.

        A node projects objects it holds whatever ``partial`` says. For an object it must
        get from the peer a hint for ``request_id`` names, only a ``partial`` deliver may
        name a subset (the source must speak protocol version 2).
        """
        items, keys, regions = [], [], set()
        for key, spans in _batch(objects, "objects"):
            path = f"objects[{key!r}]"
            _key(key, path)
            if type(spans) is Destination:
                wire, used = self._destination(spans, f"{path}.spans")
            else:
                wire, used = self._spans(key, spans, f"{path}.spans", deposit=False)
            items.append(DeliverItem(key, wire))
            keys.append(key)
            regions |= used
        _span_total(items, "spans", "objects")
        frozen = tuple(items)
        # Version 1 sessions cannot carry the flag; their remote deliveries name whole layouts.
        flag = partial and self.core.version >= 2
        return self._op(
            "deliver", keys, lambda i: DeliverMsg(i, frozen, request_id, deadline_ms, flag), deadline_ms, True, regions
        )

    def fetch(
        self, expected_layouts: Mapping[bytes, Sequence[tuple[str, str]]], request_id: str | None = None,
        deadline_ms: int = DEFAULT_DEADLINE_MS,
    ) -> OpHandle[Results[KeyOutcome]]:
        """Make objects resident in the node (whole layouts); each OK result carries a release handle."""
        items, keys = [], []
        for key, layout in _batch(expected_layouts, "expected_layouts"):
            path = f"expected_layouts[{key!r}]"
            _key(key, path)
            if not layout or any(not (isinstance(s, tuple) and len(s) == 2) for s in layout):
                raise ArgumentError(path, "expected a non-empty sequence of (span name, pool) pairs")
            items.append(FetchItem(key, tuple(LayoutSpan(n, p) for n, p in layout)))
            keys.append(key)
        _span_total(items, "layout", "expected_layouts")
        frozen = tuple(items)
        return self._op("fetch", keys, lambda i: Fetch(i, frozen, request_id, deadline_ms), deadline_ms, False, set())

    def release(self, handles: Iterable[int]) -> OpHandle[Results[KeyOutcome]]:
        """Drop handle claims; results are keyed by the handle as 8 big-endian bytes."""
        hs = list(handles)
        if not hs:
            raise ArgumentError("handles", "the batch is empty")
        for i, h in enumerate(hs):
            if isinstance(h, bool) or not isinstance(h, int) or h <= 0:
                raise ArgumentError(f"handles[{i}]", f"expected a positive int handle, got {h!r}")
        keys = [h.to_bytes(8, "big") for h in hs]
        frozen = tuple(hs)
        return self._op("release", keys, lambda i: Release(i, frozen), 10_000, False, set())

    def query(self, keys: Iterable[bytes], request_id: str | None = None) -> OpHandle[Results[KeyPresence]]:
        """Where are these keys? Advisory: a HIT may be evicted before the next call."""
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(_batch(keys, "keys"))]
        frozen = tuple(ks)

        def convert(msg: Message) -> Results[KeyPresence]:
            assert isinstance(msg, QueryReply)
            return Results([(k, KeyPresence(r.presence, r.tier)) for k, r in zip(ks, msg.results, strict=True)])

        op_id, fut = self.core.request(lambda i: Query(i, frozen, request_id), convert, 10.0)
        return self._handle(op_id, "query", fut)

    def submit_hint(self, request_id: str, source_endpoint: str, keys: Iterable[bytes]) -> OpHandle[None]:
        """Tell the node that, for ``request_id``, ``keys`` may be held by the node at ``source_endpoint``."""
        if not request_id:
            raise ArgumentError("request_id", "must not be empty")
        problem = endpoint_problem(source_endpoint)  # the node's own check (spec section 5.2)
        if problem is not None:
            raise ArgumentError("source_endpoint", problem)
        ks = tuple(_key(k, f"keys[{i}]") for i, k in enumerate(_batch(keys, "keys")))
        op_id, fut = self.core.request(lambda i: SubmitHint(i, request_id, source_endpoint, ks), _ack, 10.0)
        return self._handle(op_id, "hint", fut)

    def discard_hint(self, request_id: str) -> OpHandle[None]:
        op_id, fut = self.core.request(lambda i: DiscardHint(i, request_id), _ack, 10.0)
        return self._handle(op_id, "unhint", fut)

    def abort(self, handle: OpHandle[Any]) -> None:
        """Best effort; the operation then completes, ABORTED where it had not finished."""
        handle.abort()

    def stats(self) -> OpHandle[dict[str, Any]]:
        def convert(msg: Message) -> dict[str, Any]:
            assert isinstance(msg, StatsReply)
            return msg.stats

        op_id, fut = self.core.request(lambda i: StatsRequest(i), convert, 10.0)
        return self._handle(op_id, "stats", fut)

    def _unregister_check(self, region: RegionHandle) -> None:
        if self._regions.get(region.region) is not region:
            raise ArgumentError("region", "not a region registered with this client")
        if region.in_use:
            raise ArgumentError("region", f"{region.in_use} pending operation(s) still use it")

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
        self._regions.pop(region.region, None)
        if region.registration is not None:
            self.core.agent.deregister(region.registration)
            region.registration = None

    def _hello(self, timeout_s: float) -> Future[Any]:
        return self.core.hello(tuple(r.wire() for r in self._regions.values()), timeout_s)


def _ack(msg: Message) -> None:
    if not isinstance(msg, Ack):
        raise ValueError(f"expected ack, got {msg.TAG}")


class Client(_Base):
    """The blocking client. ``with Client(endpoint) as c: ...``"""

    def __init__(
        self, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = 10.0,
        curve: CurveKeys | None = None,
    ) -> None:
        self._init(endpoint, name, max_version, curve)
        try:
            self.core.wait(self._hello(timeout), timeout + 5)
        except BaseException:
            self.core.close()
            raise

    @classmethod
    def connect(
        cls, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = 10.0,
        curve: CurveKeys | None = None,
    ) -> Client:
        """Open a session with the node at ``endpoint`` (the same as the constructor)."""
        return cls(endpoint, name, max_version, timeout, curve)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, buffer: Any) -> RegionHandle:
        """Register a numpy/CuPy/torch buffer with NIXL and announce it to the node."""
        handle = self._describe(buffer)
        self.core.call(lambda: self._register_on_io(handle, True)).result(30)
        try:
            self.core.wait(self._announce(handle)[1], 15)
        except BaseException:
            self.core.call(lambda: self._unregister_on_io(handle)).result(30)
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
        self.core.call(lambda: self._unregister_on_io(region)).result(30)

    def reconnect(self, timeout: float = 10.0) -> Welcome:
        """Open a new session (after node loss or restart), announcing every registered region."""
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
        self, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, curve: CurveKeys | None = None
    ) -> None:
        self._init(endpoint, name, max_version, curve)

    @classmethod
    async def connect(
        cls, endpoint: str, name: str | None = None, max_version: int = CURRENT_VERSION, timeout: float = 10.0,
        curve: CurveKeys | None = None,
    ) -> AsyncClient:
        client = cls(endpoint, name, max_version, curve)
        try:
            await asyncio.wrap_future(client._hello(timeout))
        except BaseException:
            await asyncio.to_thread(client.core.close)
            raise
        return client

    async def __aenter__(self) -> AsyncClient:
        if self.core.welcome is None:
            await asyncio.wrap_future(self._hello(10.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(self, buffer: Any) -> RegionHandle:
        handle = self._describe(buffer)
        await asyncio.wrap_future(self.core.call(lambda: self._register_on_io(handle, True)))
        try:
            await asyncio.wrap_future(self._announce(handle)[1])
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

    async def reconnect(self, timeout: float = 10.0) -> Welcome:
        result: Welcome = await asyncio.wrap_future(self._hello(timeout))
        return result

    async def close(self) -> None:
        await asyncio.to_thread(Client.close, self)  # type: ignore[arg-type]


__all__ = ["AsyncClient", "Client", "CurveKeys", "KvcrError", "NodeLostError", "RegionHandle", "Span"]
