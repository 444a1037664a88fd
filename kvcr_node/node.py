"""The node: one progress thread that owns the ROUTER socket, the NIXL agent and all state.

DESIGN 6: each turn drains a bounded batch of control messages, polls in-flight
transfers, completes finished operations and submits new transfers. Nothing here takes
a lock; other threads only call ``request_stop`` or read ``snapshot``. Idle, the loop
blocks in a ZeroMQ poll; with transfers in flight it polls NIXL at a short, bounded
interval.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import zmq

from kvcr_client.agent import Agent, TransferError
from kvcr_node.config import NodeConfig
from kvcr_node.eviction import make_policy
from kvcr_node.memory import PoolMemory
from kvcr_node.sessions import ClientSession, Operation
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, Store
from kvcr_node.transfers import LocalLists, Move, Transfers
from kvcr_protocol import (
    Abort,
    Ack,
    Bye,
    CapacityEvent,
    Completion,
    DeliverItem,
    Deposit,
    DescriptorError,
    DiscardHint,
    Error,
    ErrorCode,
    Fetch,
    FetchItem,
    Heartbeat,
    Hello,
    KeyResult,
    KeyStatus,
    Message,
    PoolInfo,
    Presence,
    ProjectionCache,
    ProjectionError,
    ProtocolError,
    Query,
    QueryReply,
    QueryResult,
    Region,
    RegisterRegions,
    Release,
    RemoteProtocolError,
    SrcSpan,
    StatsReply,
    StatsRequest,
    SubmitHint,
    UnregisterRegions,
    Welcome,
    decode,
    encode,
    negotiate,
    peek_id,
    supported_up_to,
)
from kvcr_protocol import Deliver as DeliverMsg
from kvcr_protocol.descriptors import resolve_spans
from kvcr_protocol.versions import BASE_VERSION

# Plain ints: pyzmq's flag enums cost a Python call per operation on the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

log = logging.getLogger("kvcr.node")

_IDLE_POLL_MS = 1000
_MAX_INFLIGHT_SLEEP = 0.001
_SHUTDOWN_DRAIN_S = 10.0


def _bind_endpoint(sock: zmq.Socket[bytes], endpoint: str) -> str:
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://") :])
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.exists():
            path.unlink()  # a stale socket file from a node that did not exit cleanly
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


class Node:
    """A kvcr node. ``run()`` is the progress loop; ``request_stop()`` ends it cleanly."""

    def __init__(self, config: NodeConfig, context: zmq.Context[Any] | None = None) -> None:
        self.config = config.validated()
        self.versions = supported_up_to(config.protocol_version)
        self.incarnation = secrets.randbits(63) | 1
        self.store = Store(config.pools, make_policy(config.policy), config.low_watermark)
        self.memories: dict[str, PoolMemory] = {}
        self._regs: list[Any] = []
        self.agent = Agent(f"{config.name}.{self.incarnation:x}")
        try:
            for spec in config.pools:
                mem = PoolMemory(spec)
                self.memories[spec.name] = mem
                # Registered with NIXL once, at start (DESIGN 9).
                self._regs.append(self.agent.register(mem.kind, mem.address, spec.size, mem.nixl_device))
            self.local = LocalLists(self.agent, list(self.memories.values()))
        except Exception:
            self._release_memory()
            raise
        self.transfers = Transfers(self.agent, self.local)
        self.projections = ProjectionCache(config.projection_cache)

        self._own_context = context is None
        self.context = context or zmq.Context()
        self.sock: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.endpoint = _bind_endpoint(self.sock, config.endpoint)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

        self.sessions: dict[bytes, ClientSession] = {}
        self.handles: dict[int, tuple[ClientSession, ObjectEntry]] = {}
        self._next_handle = 1
        self.waiters: dict[bytes, list[Operation]] = {}
        self.hints: dict[str, tuple[str, frozenset[bytes]]] = {}
        self.op_claims = 0
        self._stop = False
        self.stopping = False
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.protocol_errors: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self._handlers: dict[type[Message], Callable[[ClientSession, Any], None]] = {
            RegisterRegions: self._on_regions,
            UnregisterRegions: self._on_unregions,
            Deposit: self._on_deposit,
            Query: self._on_query,
            DeliverMsg: self._on_deliver,
            Fetch: self._on_fetch,
            Release: self._on_release,
            Abort: self._on_abort,
            SubmitHint: self._on_hint,
            DiscardHint: self._on_unhint,
            StatsRequest: self._on_stats,
            Heartbeat: self._on_heartbeat,
            Bye: self._on_bye,
        }
        self.pool_info = tuple(
            PoolInfo(s.name, s.slot_size, s.slot_count, s.memory) for s in config.pools
        )

    # ------------------------------------------------------------------ the loop

    def request_stop(self) -> None:
        """Ask the loop to stop (thread- and signal-safe)."""
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def run(self) -> None:
        """Run the progress loop until ``request_stop``; then shut down cleanly."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        spins = 0
        try:
            while not self._stop:
                if self.transfers.inflight:
                    events = dict(poller.poll(0))
                    if not events:
                        # In flight: poll NIXL at a short interval that backs off to 1 ms.
                        time.sleep(min(_MAX_INFLIGHT_SLEEP, 10e-6 * (1 << min(spins, 7))))
                        spins += 1
                else:
                    spins = 0
                    events = dict(poller.poll(self._idle_timeout_ms()))
                if self._wake_r in events:
                    self._drain_wake()
                if self.sock in events:
                    self._drain_messages()
                self.transfers.poll()
                self._check_deadlines()
                self._flush_capacity_events()
        finally:
            self._shutdown()

    def _idle_timeout_ms(self) -> int:
        deadline = self._next_deadline()
        if deadline is None:
            return _IDLE_POLL_MS
        return max(0, min(_IDLE_POLL_MS, int((deadline - time.monotonic()) * 1000) + 1))

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _drain_messages(self) -> None:
        sock = self.sock
        for _ in range(self.config.batch):
            # Ask before reading: cheaper than the exception of an empty read.
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            self._handle_frames(sock.recv_multipart(zmq.NOBLOCK))

    def _handle_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._refuse(identity, 0, ProtocolError(ErrorCode.MALFORMED, f"expected 1 payload frame, got {len(frames) - 1}"))
            return
        payload = frames[1]
        session = self.sessions.get(identity)
        try:
            msg = decode(payload, session.version if session else self.versions[-1])
        except RemoteProtocolError as exc:
            self._refuse(identity, peek_id(payload), exc)
            return
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        if session is None:
            self._refuse(identity, getattr(msg, "id", 0), ProtocolError(ErrorCode.BAD_STATE, "say hello first"))
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._refuse(identity, getattr(msg, "id", 0), ProtocolError(ErrorCode.BAD_STATE, f"{msg.TAG} is not a client request"))
            return
        if self.stopping and not isinstance(msg, (Release, Bye, Heartbeat, StatsRequest)):
            self._refuse(identity, getattr(msg, "id", 0), ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping"))
            return
        handler(session, msg)

    def _refuse(self, identity: bytes, request_id: int, exc: ProtocolError) -> None:
        self.protocol_errors[exc.code.name] += 1
        session = self.sessions.get(identity)
        version = session.version if session else BASE_VERSION
        self._send(identity, Error(request_id, int(exc.code), exc.reason[:1024], exc.path[:256]), version)

    def _send(self, identity: bytes, msg: Message, version: int) -> None:
        try:
            self.sock.send(identity, zmq.NOBLOCK | zmq.SNDMORE)
            self.sock.send(encode(msg, version), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["send_dropped"] += 1

    def _reply(self, session: ClientSession, msg: Message) -> None:
        self._send(session.identity, msg, session.version)

    # ------------------------------------------------------------------ sessions

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        try:
            version = negotiate(self.versions, msg.versions)
        except ProtocolError as exc:
            self._refuse(identity, msg.id, exc)
            return
        old = self.sessions.get(identity)
        if old is not None:
            self._close_session(old)
        try:
            agent = self.agent.add_remote(msg.agent_md)
        except Exception as exc:
            self._refuse(identity, msg.id, ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"agent metadata refused by NIXL: {exc}", "agent_md"))
            return
        session = ClientSession(identity, msg.client, agent, version)
        try:
            self._add_regions(session, msg.regions)
        except ProtocolError as exc:
            self._refuse(identity, msg.id, exc)
            return
        self.sessions[identity] = session
        self.counters["hellos"] += 1
        log.info("client %s (agent %s) joined at version %d", msg.client, agent, version)
        self._reply(
            session,
            Welcome(msg.id, version, self.config.name, self.incarnation, self.agent.name, self.pool_info, self.config.heartbeat_ms),
        )

    def _add_regions(self, session: ClientSession, regions: Sequence[Region]) -> None:
        for i, region in enumerate(regions):
            if region.length == 0 or region.address == 0:
                raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, "a region needs an address and a length", f"regions[{i}]")
            if region.address + region.length > (1 << 64):
                raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, "the region wraps around the address space", f"regions[{i}].length")
        ids = [r.region for r in regions]
        if len(set(ids)) != len(ids):
            raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, "a region id is announced twice", "regions")
        for region in regions:
            session.regions[region.region] = region

    def _on_regions(self, session: ClientSession, msg: RegisterRegions) -> None:
        try:
            self.agent.add_remote(msg.agent_md)
            self._add_regions(session, msg.regions)
        except ProtocolError as exc:
            self._refuse(session.identity, msg.id, exc)
            return
        except Exception as exc:
            self._refuse(session.identity, msg.id, ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"agent metadata refused: {exc}", "agent_md"))
            return
        self._reply(session, Ack(msg.id))

    def _on_unregions(self, session: ClientSession, msg: UnregisterRegions) -> None:
        for region in msg.regions:
            session.regions.pop(region, None)
        self._reply(session, Ack(msg.id))

    def _on_bye(self, session: ClientSession, msg: Bye) -> None:
        self._reply(session, Ack(msg.id))
        self._close_session(session)

    def _on_heartbeat(self, session: ClientSession, msg: Heartbeat) -> None:
        self._reply(session, Heartbeat(msg.id))

    def _close_session(self, session: ClientSession) -> None:
        """Abort what can be aborted and release the session's handle claims.

        Operations with a transfer in flight keep their claims until it is terminal.
        """
        session.closing = True
        for op in list(session.ops.values()):
            self._abort_op(op)
        for handle in list(session.handles):
            self._release_handle(session, handle)
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        self._maybe_forget_agent(session)

    def _maybe_forget_agent(self, session: ClientSession) -> None:
        if session.ops or any(s.agent == session.agent for s in self.sessions.values()):
            return
        try:
            self.agent.remove_remote(session.agent)
        except Exception:
            log.debug("removing remote agent %s failed", session.agent, exc_info=True)

    # ------------------------------------------------------------------ operations

    def _new_op(self, session: ClientSession, msg_id: int, kind: str, n: int, deadline_ms: int) -> Operation | None:
        if msg_id in session.ops:
            self._refuse(session.identity, msg_id, ProtocolError(ErrorCode.BAD_STATE, f"operation {msg_id} is already in progress", "id"))
            return None
        ms = deadline_ms or self.config.deadline_ms
        op = Operation(session, msg_id, kind, time.monotonic() + ms / 1000, [None] * n)
        session.ops[msg_id] = op
        return op

    def _finish_if_settled(self, op: Operation) -> None:
        if not op.settled or op.session.ops.get(op.id) is not op:
            return
        del op.session.ops[op.id]
        results = tuple(r for r in op.results if r is not None)
        for r in results:
            self.outcomes[f"{op.kind}.{r.status.value}" + (f".{ErrorCode(r.code).name}" if r.code else "")] += 1
        if op.session.closing:
            self._maybe_forget_agent(op.session)
            # A closed session's handles from this op were never handed out: release them.
            for r in results:
                if r.handle is not None:
                    self._release_handle(op.session, r.handle)
            return
        self._reply(op.session, Completion(op.id, results))

    @staticmethod
    def _unique_keys(op: Operation, keys: Sequence[bytes]) -> list[bool]:
        seen: set[bytes] = set()
        ok = []
        for i, key in enumerate(keys):
            if key in seen:
                op.fail(i, ErrorCode.DUPLICATE_KEY, f"items[{i}].key appears twice in this batch")
                ok.append(False)
            else:
                seen.add(key)
                ok.append(True)
        return ok

    # ---- deposit

    def _on_deposit(self, session: ClientSession, msg: Deposit) -> None:
        op = self._new_op(session, msg.id, "deposit", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        unique = self._unique_keys(op, [item.key for item in msg.items])
        fills: list[tuple[int, ObjectEntry]] = []
        moves: list[Move] = []
        for i, item in enumerate(msg.items):
            if not unique[i]:
                continue
            try:
                item_moves = self._deposit_moves(session, item.spans, f"items[{i}].spans")
            except DescriptorError as exc:
                op.fail(i, exc.code, f"{exc.path}: {exc.reason}")
                continue
            layout = tuple((s.name, s.pool) for s in item.spans)
            outcome, entry = self.store.begin_deposit(item.key, layout, msg.optional)
            if outcome is DepositOutcome.NEW:
                assert entry is not None
                fills.append((i, entry))
                moves.extend(
                    (span.pool, slot, address, length, region)
                    for span, slot, (address, length, region) in zip(item.spans, entry.slots, item_moves, strict=True)
                )
            elif outcome is DepositOutcome.DUPLICATE:
                op.set(i, KeyResult(KeyStatus.DUPLICATE))
            elif outcome is DepositOutcome.DROPPED:
                op.set(i, KeyResult(KeyStatus.DROPPED))
            elif outcome is DepositOutcome.LAYOUT_MISMATCH:
                op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}]: the key is stored with another layout")
            elif outcome is DepositOutcome.CAPACITY:
                op.fail(i, ErrorCode.CAPACITY, f"items[{i}]: not enough free or evictable slots")
            else:
                op.fail(i, ErrorCode.UNKNOWN_POOL, f"items[{i}].spans: unknown pool")
        if fills:
            self._start(op, "READ", moves, lambda ok: self._deposit_done(op, fills, msg.no_evict, ok))
        self._finish_if_settled(op)

    def _deposit_moves(self, session: ClientSession, spans: Sequence[SrcSpan], path: str) -> list[tuple[int, int, Region]]:
        """Check a deposit's spans (pool, size, region) and resolve them to client addresses."""
        memories = self.memories
        for j, span in enumerate(spans):
            mem = memories.get(span.pool)
            if mem is None:
                raise DescriptorError(ErrorCode.UNKNOWN_POOL, f"pool {span.pool!r} does not exist", f"{path}[{j}].pool")
            if span.length != mem.spec.slot_size:
                raise DescriptorError(
                    ErrorCode.SIZE_MISMATCH, f"span of {span.length} bytes, pool {span.pool!r} slots hold {mem.spec.slot_size}", f"{path}[{j}].length"
                )
        return resolve_spans(session.regions, [(s.region, s.offset, s.length) for s in spans], path)

    def _deposit_done(self, op: Operation, fills: list[tuple[int, ObjectEntry]], no_evict: bool, ok: bool) -> None:
        for i, entry in fills:
            if ok and not op.aborted:
                keep = no_evict and not op.session.closing
                self.store.commit(entry, claim=keep)
                handle = self._new_handle(op.session, entry) if keep else None
                op.set(i, KeyResult(KeyStatus.STORED, handle=handle))
            else:
                self.store.abandon(entry)
                if op.aborted:
                    op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted"))
                else:
                    op.fail(i, ErrorCode.TRANSFER_FAILED, "reading the source bytes failed")
            self._wake(entry.key)
        self._finish_if_settled(op)

    # ---- deliver

    def _on_deliver(self, session: ClientSession, msg: DeliverMsg) -> None:
        op = self._new_op(session, msg.id, "deliver", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        unique = self._unique_keys(op, [item.key for item in msg.items])
        items = msg.items
        op.resume = lambda i: self._deliver_ready([i], op, items)
        ready: list[int] = []
        for i, item in enumerate(items):
            if not unique[i]:
                continue
            entry = self.store.lookup(item.key)
            if entry is None:
                op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
            elif entry.state is ObjectState.WRITING:
                self._wait(op, item.key, i)
            else:
                ready.append(i)
        self._deliver_ready(ready, op, items)

    def _deliver_ready(self, indices: list[int], op: Operation, items: Sequence[DeliverItem]) -> None:
        claimed: list[tuple[int, ObjectEntry]] = []
        moves: list[Move] = []
        for i in indices:
            item = items[i]
            entry = self.store.lookup(item.key)
            if entry is None or entry.state is not ObjectState.READY:
                op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
                continue
            try:
                item_moves = self._deliver_moves(op.session, entry, item, f"items[{i}]")
            except (DescriptorError, ProjectionError) as exc:
                where = f"{exc.path}: " if isinstance(exc, DescriptorError) else f"items[{i}].spans: "
                op.fail(i, exc.code, where + exc.reason)
                continue
            # DESIGN 4: "While any projected span is being delivered, the claim covers the
            # whole object."
            self.store.claim(entry)
            self.op_claims += 1
            claimed.append((i, entry))
            moves.extend(item_moves)
        if claimed:
            self._start(op, "WRITE", moves, lambda ok: self._deliver_done(op, claimed, ok))
        self._finish_if_settled(op)

    def _deliver_moves(self, session: ClientSession, entry: ObjectEntry, item: DeliverItem, path: str) -> list[Move]:
        """Project the destination onto the stored layout, check sizes and regions."""
        layout = entry.layout
        spans = item.spans
        projection = self.projections.project(tuple(name for name, _ in layout), tuple(s.name for s in spans))
        slots = entry.slots
        pools = [layout[index][1] for index in projection.indices]
        memories = self.memories
        for j, (span, pool) in enumerate(zip(spans, pools, strict=True)):
            size = memories[pool].spec.slot_size
            if span.length != size:
                raise DescriptorError(ErrorCode.SIZE_MISMATCH, f"span of {span.length} bytes, the stored span holds {size}", f"{path}.spans[{j}].length")
        resolved = resolve_spans(session.regions, [(s.region, s.offset, s.length) for s in spans], f"{path}.spans")
        return [
            (pool, slots[index], address, length, region)
            for pool, index, (address, length, region) in zip(pools, projection.indices, resolved, strict=True)
        ]

    def _deliver_done(self, op: Operation, claimed: list[tuple[int, ObjectEntry]], ok: bool) -> None:
        for i, entry in claimed:
            self.store.unclaim(entry, accessed=ok)
            self.op_claims -= 1
            if op.aborted:
                op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted; the destination may have been written"))
            elif ok:
                op.set(i, KeyResult(KeyStatus.OK))
            else:
                op.fail(i, ErrorCode.TRANSFER_FAILED, "writing the destination failed; it may be partly written")
        self._finish_if_settled(op)

    # ---- fetch (local keys; remote fetch pulls from a hinted peer)

    def _on_fetch(self, session: ClientSession, msg: Fetch) -> None:
        op = self._new_op(session, msg.id, "fetch", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        unique = self._unique_keys(op, [item.key for item in msg.items])
        items = msg.items
        op.resume = lambda i: self._fetch_ready(op, i, items[i])
        for i, item in enumerate(items):
            if not unique[i]:
                continue
            entry = self.store.lookup(item.key)
            if entry is None:
                op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
            elif entry.state is ObjectState.WRITING:
                self._wait(op, item.key, i)
            else:
                self._fetch_ready(op, i, item)
        self._finish_if_settled(op)

    def _fetch_ready(self, op: Operation, i: int, item: FetchItem) -> None:
        entry = self.store.lookup(item.key)
        if entry is None or entry.state is not ObjectState.READY:
            op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
        elif tuple((s.name, s.pool) for s in item.layout) != entry.layout:
            # "fetch never projects": the expected layout must be the stored one.
            op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}].layout differs from the stored layout")
        else:
            self.store.claim(entry, accessed=True)  # DESIGN 5: a fetch claim is an LRU access
            op.set(i, KeyResult(KeyStatus.OK, handle=self._new_handle(op.session, entry)))
        self._finish_if_settled(op)

    # ---- waiting on WRITING objects

    def _wait(self, op: Operation, key: bytes, index: int) -> None:
        op.waiting.setdefault(key, []).append(index)
        self.waiters.setdefault(key, []).append(op)

    def _wake(self, key: bytes) -> None:
        for op in self.waiters.pop(key, ()):
            indices = op.waiting.pop(key, [])
            if op.resume is not None:
                for i in indices:
                    op.resume(i)
            self._finish_if_settled(op)

    def _unwait(self, op: Operation, key: bytes) -> list[int]:
        ops = self.waiters.get(key)
        if ops is not None:
            if op in ops:
                ops.remove(op)
            if not ops:
                del self.waiters[key]
        return op.waiting.pop(key, [])

    # ---- handles, release, abort

    def _new_handle(self, session: ClientSession, entry: ObjectEntry) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = (session, entry)
        session.handles.add(handle)
        return handle

    def _release_handle(self, session: ClientSession, handle: int) -> bool:
        held = self.handles.get(handle)
        if held is None or held[0] is not session:
            return False
        del self.handles[handle]
        session.handles.discard(handle)
        self.store.unclaim(held[1], accessed=False)
        return True

    def _on_release(self, session: ClientSession, msg: Release) -> None:
        results = []
        for i, handle in enumerate(msg.handles):
            if self._release_handle(session, handle):
                results.append(KeyResult(KeyStatus.OK))
            else:
                results.append(KeyResult(KeyStatus.FAILED, ErrorCode.UNKNOWN_HANDLE, f"handles[{i}] is not held by this client"))
        self._reply(session, Completion(msg.id, tuple(results)))

    def _on_abort(self, session: ClientSession, msg: Abort) -> None:
        op = session.ops.get(msg.op)
        if op is None:
            self._refuse(session.identity, msg.id, ProtocolError(ErrorCode.UNKNOWN_OP, f"operation {msg.op} is not in progress", "op"))
            return
        self._reply(session, Ack(msg.id))
        self._abort_op(op)

    def _abort_op(self, op: Operation, code: ErrorCode = ErrorCode.ABORTED, reason: str = "aborted") -> None:
        """Best effort: items not yet moving end now; items in flight end when their transfer does."""
        op.aborted = code is ErrorCode.ABORTED or op.aborted
        for key in list(op.waiting):
            for i in self._unwait(op, key):
                if code is ErrorCode.ABORTED:
                    op.set(i, KeyResult(KeyStatus.ABORTED, code, reason))
                else:
                    op.fail(i, code, reason)
        self._finish_if_settled(op)

    # ---- query, hints, stats

    def _tier(self, entry: ObjectEntry) -> str:
        return self.memories[entry.layout[0][1]].spec.memory

    def _on_query(self, session: ClientSession, msg: Query) -> None:
        hint = self.hints.get(msg.request_id) if msg.request_id is not None else None
        results = []
        for key in msg.keys:
            entry = self.store.lookup(key)
            if entry is not None and entry.state is ObjectState.READY:
                results.append(QueryResult(Presence.HIT, self._tier(entry)))
            elif entry is not None:
                results.append(QueryResult(Presence.FETCHING, self._tier(entry)))
            elif hint is not None and key in hint[1]:
                results.append(QueryResult(Presence.FETCHABLE, "remote"))
            else:
                results.append(QueryResult(Presence.MISS))
        self._reply(session, QueryReply(msg.id, tuple(results)))

    def _on_hint(self, session: ClientSession, msg: SubmitHint) -> None:
        self.hints[msg.request_id] = (msg.endpoint, frozenset(msg.keys))
        self._reply(session, Ack(msg.id))

    def _on_unhint(self, session: ClientSession, msg: DiscardHint) -> None:
        self.hints.pop(msg.request_id, None)
        self._reply(session, Ack(msg.id))

    def _on_stats(self, session: ClientSession, msg: StatsRequest) -> None:
        self._reply(session, StatsReply(msg.id, self.snapshot()))

    def snapshot(self) -> dict[str, Any]:
        """Statistics and the result of the accounting check (O(objects))."""
        store = self.store.stats()
        return {
            "node": self.config.name,
            "incarnation": self.incarnation,
            "protocol_version": self.versions[-1],
            "pools": self.store.pool_stats(),
            "objects": store["objects"],
            "ready": store["ready"],
            "writing": store["writing"],
            "evictions": store["evictions"],
            "claims": {
                "total": store["claims"],
                "handles": len(self.handles),
                "operations": self.op_claims,
            },
            "clients": len(self.sessions),
            "operations_pending": sum(len(s.ops) for s in self.sessions.values()),
            "transfers": {
                "in_flight": len(self.transfers.inflight),
                "posted": self.transfers.posted,
                "failed": self.transfers.failed,
                "bytes": self.transfers.bytes,
            },
            "outcomes": dict(self.outcomes),
            "protocol_errors": dict(self.protocol_errors),
            "counters": dict(self.counters),
            "projection_cache": {"size": len(self.projections), "hits": self.projections.hits, "misses": self.projections.misses},
            "invariants": self.check_invariants(),
        }

    def check_invariants(self) -> list[str]:
        """The store's invariants plus the node's: claims match handles and live operations."""
        breaches = self.store.check_invariants()
        claims = self.store.stats()["claims"]
        if claims != len(self.handles) + self.op_claims:
            breaches.append(f"claims {claims} != handles {len(self.handles)} + operation claims {self.op_claims}")
        for handle, (session, _) in self.handles.items():
            if handle not in session.handles:
                breaches.append(f"handle {handle} is not in its session")
        return breaches

    # ---- capacity events and deadlines

    def _flush_capacity_events(self) -> None:
        for pool in self.store.take_capacity_events():
            stats = self.store.pool_stats()[pool]
            self.counters["capacity_events"] += 1
            for session in list(self.sessions.values()):
                self._reply(session, CapacityEvent(0, pool, stats["free"] + stats["evictable"], stats["total"]))

    def _next_deadline(self) -> float | None:
        deadlines = [op.deadline for ops in self.waiters.values() for op in ops]
        return min(deadlines) if deadlines else None

    def _check_deadlines(self) -> None:
        if not self.waiters:
            return
        now = time.monotonic()
        expired = {id(op): op for ops in self.waiters.values() for op in ops if op.deadline <= now}
        for op in expired.values():
            self._abort_op(op, ErrorCode.TIMEOUT, "the deadline passed while the object was still being written")

    # ---- transfers

    def _start(self, op: Operation, kind: str, moves: list[Move], on_done: Callable[[bool], None]) -> None:
        try:
            transfer = self.transfers.start(kind, op.session.agent, moves, on_done)
        except TransferError as exc:
            log.warning("transfer refused for %s %d: %s", op.kind, op.id, exc)
            on_done(False)
            return
        op.transfers.append(transfer)

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        """Stop accepting, let in-flight transfers finish (bounded), fail the rest, deregister."""
        self.stopping = True
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        end = time.monotonic() + _SHUTDOWN_DRAIN_S
        while self.transfers.inflight and time.monotonic() < end:
            if dict(poller.poll(1)):
                self._drain_messages()
            self.transfers.poll()
        for session in list(self.sessions.values()):
            for op in list(session.ops.values()):
                self._abort_op(op, ErrorCode.SHUTTING_DOWN, "the node is stopping")
        if self.transfers.inflight:
            log.error("%d transfers still in flight at exit; memory stays registered", len(self.transfers.inflight))
        else:
            self._release_memory()
        self.sock.close(0)
        if self.endpoint.startswith("ipc://"):
            Path(self.endpoint[len("ipc://") :]).unlink(missing_ok=True)
        if self._own_context:
            self.context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _release_memory(self) -> None:
        for reg in self._regs:
            try:
                self.agent.deregister(reg)
            except Exception:
                log.debug("deregistration failed", exc_info=True)
        self._regs.clear()
        for mem in self.memories.values():
            mem.close()
