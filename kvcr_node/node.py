"""The node: one progress thread that owns the ROUTER socket, the NIXL agent and all state.

architecture §4: each turn drains a bounded batch of control messages, polls in-flight
transfers, completes finished operations and submits new transfers. Nothing here takes
a lock; other threads only call ``request_stop`` or read ``snapshot``. Idle, the loop
blocks in a ZeroMQ poll; with transfers in flight it polls NIXL at a short, bounded
interval.
"""

from __future__ import annotations

import collections
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import zmq

from kvcr_io.agent import Agent, TransferError
from kvcr_io.pacing import Pacer
from kvcr_io.wake import WakePipe
from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_io.zmq_flags import SNDMORE as _SNDMORE
from kvcr_node.agents import AgentUse, RemoteAgents
from kvcr_node.auth import CurveServer
from kvcr_node.config import NodeConfig
from kvcr_node.endpoint import BoundEndpoint
from kvcr_node.eviction import make_policy
from kvcr_node.links import LinkError, Links
from kvcr_node.memory import PoolMemory
from kvcr_node.peers import RemoteWrite, WriteStage
from kvcr_node.sessions import ClientSession, Operation, PeerSession, Withdrawal
from kvcr_node.store import DepositOutcome, ObjectEntry, ObjectState, Store
from kvcr_node.transfers import LocalLists, Move, Transfers, run_moves, uniform_columns
from kvcr_protocol import (
    Abort,
    Ack,
    Bye,
    CapacityEvent,
    Completion,
    DeliverItem,
    Deposit,
    DiscardHint,
    DstSpan,
    Error,
    ErrorCode,
    Fetch,
    FetchItem,
    Heartbeat,
    Hello,
    KeyResult,
    KeyStatus,
    Limits,
    Message,
    PeerClient,
    PeerHello,
    PeerWelcome,
    PoolInfo,
    Presence,
    Probe,
    ProbeReply,
    Projection,
    ProjectionCache,
    ProtocolError,
    Query,
    QueryReply,
    QueryResult,
    Refuse,
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
    WriteDone,
    WriteRequest,
    WriteState,
    decode,
    encode,
    endpoint_problem,
    negotiate,
    peek_id,
    supported_up_to,
)
from kvcr_protocol import Deliver as DeliverMsg
from kvcr_protocol.descriptors import resolve_spans
from kvcr_protocol.operations import allowed_refusal, allowed_result
from kvcr_protocol.versions import BASE_VERSION

_FULL = Projection((), True)
"""The whole layout (its indices are never read: full deliveries take every slot in order)."""

log = logging.getLogger("kvcr.node")

_IDLE_POLL_MS = 1000
_SHUTDOWN_DRAIN_S = 10.0
_FAILED_POLL_S = 0.05
"""After a failed poll the loop waits this long, so a failing poll cannot spin."""
_FAILURE_LOG_INTERVAL_S = 10.0
"""An internal failure of one kind is logged (with its traceback) at most this often; each is counted."""


def _from_source(result: KeyResult) -> KeyResult:
    """A source's per-key result as passed on: what a source does not send becomes a failed
    transfer (spec section 5.3), so no peer can give a client a status or code out of place."""
    if result.status is KeyStatus.OK and result.code == 0:
        return KeyResult(KeyStatus.OK)
    if result.status in (KeyStatus.FAILED, KeyStatus.ABORTED) and allowed_result("write", result.code) and result.code:
        return KeyResult(result.status, result.code, result.reason)
    return KeyResult(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED,
                     f"the source answered {result.status.value} with code {result.code}: {result.reason}"[:1024])


class Node:
    """A kvcr node. ``run()`` is the progress loop; ``request_stop()`` ends it cleanly."""

    def __init__(
        self, config: NodeConfig, context: zmq.Context[Any] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config.validated()
        self.clock = clock
        """Protocol time (deadlines, liveness, links); tests pass a fake one. Shutdown waits in real time."""
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
                # Registered with NIXL once, at start (architecture §6).
                self._regs.append(self.agent.register(mem.kind, mem.address, spec.size, mem.nixl_device))
            self.local = LocalLists(self.agent, list(self.memories.values()))
        except Exception:
            self._release_memory()
            raise
        self.transfers = Transfers(self.agent, self.local)
        self.projections = ProjectionCache(config.projection_cache)

        self.protocol_errors: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.limits = Limits(max_frame=config.max_frame)
        self.sock: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Frames far over the limit are cut off by ZeroMQ; those a little over get TOO_LARGE.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_frame)
        self.curve = CurveServer(self.context, self.sock, config, self.counters) if config.curve_secret_key else None
        try:
            self.bound = BoundEndpoint(self.sock, config.endpoint)
        except Exception:
            self._close_sockets()
            self._release_memory()
            raise
        self.endpoint = self.bound.endpoint
        self._wakeup = WakePipe()

        self.sessions: dict[bytes, ClientSession] = {}
        self.handles: dict[int, tuple[ClientSession, ObjectEntry]] = {}
        self._next_handle = 1
        self.waiters: dict[bytes, list[Operation]] = {}
        self.op_claims = 0
        self._stop = False
        self.stopping = False
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.undeclared_codes: collections.Counter[str] = collections.Counter()
        """Codes sent that spec section 10.1 does not list for their request (a breach)."""
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
        self._peer_handlers: dict[type[Message], Callable[[Any, Any], None]] = {
            PeerClient: self._on_peer_client,
            WriteRequest: self._on_write,
            Probe: self._on_probe,
            StatsRequest: self._on_stats,
            Heartbeat: self._on_heartbeat,
            Bye: self._on_bye,
        }
        self.pool_info = tuple(
            PoolInfo(s.name, s.slot_size, s.slot_count, s.memory) for s in config.pools
        )
        # Our pools as regions, announced to sources so they can write into them (fetch):
        # region id = pool index in welcome order.
        self.pool_regions = tuple(
            Region(i, mem.kind, mem.nixl_device, mem.address, mem.spec.size) for i, mem in enumerate(self.memories.values())
        )
        self.pool_index = {name: i for i, name in enumerate(self.memories)}
        self.slot_sizes = {name: mem.spec.slot_size for name, mem in self.memories.items()}
        self.withdrawing: dict[bytes, ClientSession] = {}
        """Sessions with an ``unregions`` whose ack is held, by identity."""
        self.retired: list[ClientSession] = []
        """Closed peer sessions whose writes are still running."""
        self._deferred: list[Callable[[], None]] = []
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)
        for extra in self.curve.sockets if self.curve is not None else ():
            self._poller.register(extra, zmq.POLLIN)
        self._next_liveness = 0.0
        self.remote_agents = RemoteAgents(self.agent, self._agent_use, self.clock)
        self.links = Links(
            self, self.config, self.context, self._poller, self.remote_agents, self._peer_hello_msg, self.versions,
            self.counters, self.protocol_errors, self.clock, self.curve.peer_keys if self.curve is not None else None,
        )
        self._failure_logged: dict[str, float] = {}
        """Failure kind -> when it may be logged (with a traceback) again."""
        self._request: tuple[bytes, int, str] | None = None
        """(identity, id, type tag) of the request being handled, once decoded; ``_answered``
        says whether it got a reply (the guard answers one that did not)."""
        self._answered = False

    # ------------------------------------------------------------------ the loop

    def request_stop(self) -> None:
        """Ask the loop to stop (thread- and signal-safe)."""
        self._stop = True
        self._wakeup.wake()

    def run(self) -> None:
        """Run the progress loop until ``request_stop``; then shut down cleanly.

        No exception of one step (or of one message, see ``_handle_frames``) ends the
        loop: it is logged and counted (``internal_errors``) and the next step runs.
        """
        pacer = Pacer()
        events: dict[Any, int] = {}
        try:
            while not self._stop:
                filling = False
                try:
                    filling = self.links.filling
                    events = self._wait_events(pacer, filling)
                except Exception as exc:
                    self.internal_failure("poll", exc)
                    events = {}
                    time.sleep(_FAILED_POLL_S)
                if self._wakeup.read_fd in events:
                    self._guarded("wake", self._wakeup.drain)
                if self.curve is not None:
                    self._guarded("authentication", functools.partial(self.curve.serve, events))
                if self.sock in events:
                    self._guarded("receive", self._drain_messages)
                if self.links.socks:
                    for sock in [s for s in events if s in self.links.socks]:
                        link = self.links.socks.get(sock)
                        if link is not None:  # an earlier step may have closed it
                            self._guarded("peer link", functools.partial(self.links.drain, link))
                if self._deferred:
                    deferred, self._deferred = self._deferred, []
                    for submit in deferred:
                        self._guarded("deferred write", submit)
                if filling:
                    # A source is writing into our pools (a fetch): our agent is the
                    # target of that transfer and needs progress too (architecture §6).
                    self._guarded("agent progress", self.agent.progress)
                if not self.transfers.inflight:  # polling transfers progresses the agent
                    self._guarded("agent progress", self.remote_agents.progress_idle)
                self._guarded("transfer completion", self.transfers.poll)
                self._guarded("deadlines", self._check_deadlines)
                self._guarded("liveness", self._check_liveness)
                self._guarded("capacity events", self._flush_capacity_events)
        finally:
            self._shutdown()

    def _wait_events(self, pacer: Pacer, filling: bool) -> dict[Any, int]:
        """Poll the sockets: at once while transfers run, else until the next timer."""
        if self.transfers.inflight or self._deferred or filling:
            events = dict(self._poller.poll(0))
            if not events:
                # In flight: spin briefly, then poll NIXL at a short, bounded interval.
                delay = pacer.next()
                if delay:
                    time.sleep(delay)
            return events
        pacer.reset()
        return dict(self._poller.poll(self._idle_timeout_ms()))

    def _guarded(self, step: str, fn: Callable[[], object]) -> None:
        """Run one loop step; an exception is logged and counted, and the loop goes on."""
        try:
            fn()
        except Exception as exc:
            self.internal_failure(step, exc)

    def internal_failure(self, what: str, exc: BaseException) -> None:
        """Count an unexpected failure; log it with its traceback (at most every few seconds per kind)."""
        self.counters["internal_errors"] += 1
        now = self.clock()
        if now >= self._failure_logged.get(what, 0.0):
            self._failure_logged[what] = now + _FAILURE_LOG_INTERVAL_S
            log.error("internal failure in %s (counted; the node goes on): %s: %s", what, type(exc).__name__, exc,
                      exc_info=exc)
        else:
            log.debug("internal failure in %s: %r", what, exc)

    def _check_liveness(self) -> None:
        """Drop clients silent for longer than the grace period (spec section 12: no leaks)."""
        if not self.config.heartbeat_ms:
            return  # heartbeats off: clients send none, so silence means nothing (spec section 5.2)
        now = self.clock()
        if now < self._next_liveness:
            return
        self._next_liveness = now + min(self.config.heartbeat_ms, self.config.client_grace_ms) / 1000
        if self.remote_agents.pending:
            self.remote_agents.release_pending()
        grace = self.config.client_grace_ms / 1000
        for session in [s for s in self.sessions.values() if now - s.last_seen > grace]:
            self.counters["clients_expired" if not isinstance(session, PeerSession) else "peers_expired"] += 1
            log.warning("%s %s silent for %.1f s: dropping its session", "peer" if isinstance(session, PeerSession) else "client",
                        session.name, now - session.last_seen)
            self._close_session(session)
            if session.ops and isinstance(session, PeerSession):
                # Only peer sessions retire (probes look there); a client's ops hold their session.
                self.retired.append(session)

    def _idle_timeout_ms(self) -> int:
        deadline = self._next_deadline()
        if self.sessions and self.config.heartbeat_ms:
            deadline = min(deadline or float("inf"), self._next_liveness)
        links = self.links.next_wakeup(self.clock())
        if links is not None:
            deadline = min(deadline or float("inf"), links)
        if deadline is None:
            return _IDLE_POLL_MS
        return max(0, min(_IDLE_POLL_MS, int((deadline - self.clock()) * 1000) + 1))

    def _drain_messages(self) -> None:
        sock = self.sock
        for _ in range(self.config.batch):
            # Ask before reading: cheaper than the exception of an empty read.
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            frames = sock.recv_multipart(_NOBLOCK)
            self._answered = False
            try:
                self._handle_frames(frames)
            except Exception as exc:
                # Hello, decoding or the guard itself failed: the sender still gets an answer.
                self._message_failed(frames, exc)
            finally:
                self._request = None
            if self.transfers.inflight:
                # Complete what finished before reading on: a first layer's completion must
                # not wait behind the next request's submission.
                self.transfers.poll()

    def _handle_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._refuse(identity, 0, ProtocolError(ErrorCode.MALFORMED, f"expected 1 payload frame, got {len(frames) - 1}"))
            return
        payload = frames[1]
        session = self.sessions.get(identity)
        if session is not None:
            session.last_seen = self.clock()
        try:
            msg = decode(payload, session.version if session else self.versions[-1], self.limits)
        except RemoteProtocolError as exc:
            self._refuse(identity, peek_id(payload), exc)
            return
        msg_id: int = getattr(msg, "id", 0)
        self._request = (identity, msg_id, msg.TAG)
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        if isinstance(msg, PeerHello):
            self._on_peer_hello(identity, msg)
            return
        if session is None:
            self._refuse(identity, getattr(msg, "id", 0), ProtocolError(ErrorCode.BAD_STATE, "say hello first"))
            return
        is_peer = isinstance(session, PeerSession)
        handler = (self._peer_handlers if is_peer else self._handlers).get(type(msg))
        if handler is None:
            what = "a peer" if is_peer else "a client"
            self._refuse(identity, getattr(msg, "id", 0), ProtocolError(ErrorCode.BAD_STATE, f"{msg.TAG} is not {what} request"))
            return
        if self.stopping and not isinstance(msg, (Release, Bye, Heartbeat, StatsRequest)):
            self._refuse(identity, getattr(msg, "id", 0), ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping"))
            return
        before = session.ops.get(msg_id)
        try:
            handler(session, msg)
        except Exception as exc:
            self._handler_failed(session, msg, before, exc)

    def _handler_failed(self, session: ClientSession, msg: Message, before: Operation | None, exc: Exception) -> None:
        """One message's handler raised: fail that message ``INTERNAL``, release what it set aside.

        An operation it registered is broken: its items that no transfer or remote write
        covers fail ``INTERNAL`` once nothing of it runs (spec section 5.1); without one, the
        request gets an ``error`` reply with its id unless it was answered already.
        """
        self.internal_failure(msg.TAG, exc)
        msg_id: int = getattr(msg, "id", 0)
        reason = f"the node failed while handling {msg.TAG}: {type(exc).__name__}: {exc}"
        op = session.ops.get(msg_id)
        if op is not None and op is not before:
            self._break_op(op, reason)
        elif not self._answered:
            self._refuse(session.identity, msg_id, ProtocolError(ErrorCode.INTERNAL, reason))

    def _message_failed(self, frames: list[bytes], exc: Exception) -> None:
        self.internal_failure("message", exc)
        if not self._answered and frames:
            request_id = peek_id(frames[-1]) if len(frames) == 2 else 0
            reason = f"the node failed while handling the message: {type(exc).__name__}: {exc}"
            try:
                self._refuse(frames[0], request_id, ProtocolError(ErrorCode.INTERNAL, reason))
            except Exception as again:
                self.internal_failure("error reply", again)

    def _break_op(self, op: Operation, reason: str) -> None:
        """Fail an operation whose handling failed: stop its waits, finish it once nothing of it runs."""
        op.broken = reason[:1024]
        for key in list(op.waiting):
            self._unwait(op, key)
        self._finish_if_settled(op)

    def _refuse(self, identity: bytes, request_id: int, exc: ProtocolError, request: str | None = None) -> None:
        """Answer a request with ``error``; ``request`` names its type when it is not the
        message being handled (the codes a node may send per request: spec section 10.1)."""
        self._check_refusal(request or (self._request[2] if self._request is not None else None), exc.code)
        self.protocol_errors[exc.code.name] += 1
        session = self.sessions.get(identity)
        version = session.version if session else BASE_VERSION
        self._send(identity, Error(request_id, int(exc.code), exc.reason[:1024], exc.path[:256]), version)

    def _send(self, identity: bytes, msg: Message, version: int) -> None:
        current = self._request
        if current is not None and current[0] == identity and getattr(msg, "id", None) == current[1]:
            self._answered = True
        try:
            self.sock.send(identity, _NOBLOCK | _SNDMORE)
            self.sock.send(encode(msg, version), _NOBLOCK)
        except zmq.Again:
            self.counters["send_dropped"] += 1

    def _reply(self, session: ClientSession, msg: Message) -> None:
        self._send(session.identity, msg, session.version)

    # ------------------------------------------------------------------ sessions

    def _open_session(
        self, identity: bytes, request_id: int, agent_md: bytes, regions: Sequence[Region],
        make: Callable[[str], ClientSession],
    ) -> ClientSession | None:
        """Load the sender's NIXL metadata, make its session and take its regions; None after a refusal."""
        try:
            agent = self.remote_agents.add(agent_md)
        except Exception as exc:
            self._refuse(identity, request_id, ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"agent metadata refused by NIXL: {exc}", "agent_md"))
            return None
        session = make(agent)
        session.last_seen = self.clock()
        try:
            self._add_regions(session, regions)
        except ProtocolError as exc:
            self.remote_agents.release(agent)
            self._refuse(identity, request_id, exc)
            return None
        self.sessions[identity] = session
        return session

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        if self.stopping:
            self._refuse(identity, msg.id, ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping"))
            return
        try:
            version = negotiate(self.versions, msg.versions)
        except ProtocolError as exc:
            self._refuse(identity, msg.id, exc)
            return
        old = self.sessions.get(identity)
        if old is not None:
            self._close_session(old)
        clients = sum(1 for s in self.sessions.values() if not isinstance(s, PeerSession))
        if clients >= self.config.max_clients:
            self._refuse(identity, msg.id, ProtocolError(ErrorCode.TOO_MANY_CLIENTS, f"this node serves at most {self.config.max_clients} clients"))
            return
        session = self._open_session(
            identity, msg.id, msg.agent_md, msg.regions,
            lambda agent: ClientSession(identity, msg.client, agent, version, msg.agent_md),
        )
        if session is None:
            return
        self.counters["hellos"] += 1
        log.info("client %s (agent %s) joined at version %d", msg.client, session.agent, version)
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
            agent = self.remote_agents.add(msg.agent_md)
            if agent != session.agent:
                # Another agent's metadata: nothing may ever write through it; do not keep it.
                self.remote_agents.release(agent)
                raise ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"the metadata is agent {agent!r}'s, the session's agent is "
                                    f"{session.agent!r}", "agent_md")
            self._add_regions(session, msg.regions)
            session.agent_md = msg.agent_md
            session.regions_version += 1
        except ProtocolError as exc:
            self._refuse(session.identity, msg.id, exc)
            return
        except Exception as exc:
            self._refuse(session.identity, msg.id, ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"agent metadata refused: {exc}", "agent_md"))
            return
        self._reply(session, Ack(msg.id))

    def _on_unregions(self, session: ClientSession, msg: UnregisterRegions) -> None:
        records = {rid: region for rid in msg.regions if (region := session.regions.pop(rid, None)) is not None}
        session.regions_version += 1
        if self._regions_reserved(session, msg.regions):
            # Spec section 12: a source may still write there (DESTINATION_UNCERTAIN); the
            # ack waits until it cannot. The regions take no new work meanwhile.
            session.withdrawals[msg.id] = Withdrawal(tuple(msg.regions), records)
            self.withdrawing[session.identity] = session
            self.counters["unregions_held"] += 1
            return
        self._reply(session, Ack(msg.id))

    def _regions_reserved(self, session: ClientSession, regions: Sequence[int]) -> bool:
        """Whether a remote write that is not over may still write into one of the client's ``regions``."""
        wanted = set(regions)
        for link in self.links:
            for write in (*link.writes.values(), *link.queued):
                if write.client is None or write.agent != session.agent or write.state is WriteStage.DONE:
                    continue
                if any(span[1] in wanted for item in write.items for span in item.spans):
                    return True
        return False

    def _release_withdrawals(self) -> None:
        """Acknowledge every held ``unregions`` whose regions no write can reach any more."""
        for identity, session in list(self.withdrawing.items()):
            for request_id, withdrawal in list(session.withdrawals.items()):
                if not self._regions_reserved(session, withdrawal.regions):
                    del session.withdrawals[request_id]
                    self._reply(session, Ack(request_id))
            if not session.withdrawals:
                del self.withdrawing[identity]

    def _cancel_withdrawal(self, session: ClientSession, request_id: int) -> None:
        """The client aborted a held ``unregions``: its regions are announced again, and the
        request is refused whole (``error`` ABORTED: nothing of it was done)."""
        withdrawal = session.withdrawals.pop(request_id)
        if not session.withdrawals:
            self.withdrawing.pop(session.identity, None)
        for rid, region in withdrawal.records.items():
            session.regions.setdefault(rid, region)
        session.regions_version += 1
        self._refuse(session.identity, request_id, ProtocolError(
            ErrorCode.ABORTED, "aborted: the regions stay announced; the client must keep them registered"), "unregions")

    def _on_bye(self, session: ClientSession, msg: Bye) -> None:
        self._reply(session, Ack(msg.id))
        self._close_session(session)
        if session.ops and isinstance(session, PeerSession):
            self.retired.append(session)  # its running writes stay answerable to probes

    def _on_heartbeat(self, session: ClientSession, msg: Heartbeat) -> None:
        self._reply(session, Heartbeat(msg.id))

    def _close_session(self, session: ClientSession) -> None:
        """Abort what can be aborted and release the session's handle claims.

        Operations with a transfer in flight keep their claims until it is terminal.
        """
        session.closing = True
        session.forget_hints()  # spec section 5.2: hints end with their session
        session.withdrawals.clear()  # held unregions end unanswered with the session
        if self.withdrawing.get(session.identity) is session:
            del self.withdrawing[session.identity]
        for op in list(session.ops.values()):
            self._abort_op(op)
        for handle in list(session.handles):
            self._release_handle(session, handle)
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        self.remote_agents.release(session.agent)
        if not isinstance(session, PeerSession):
            # Sources forget it too in time (max_peer_clients); announce it afresh if it returns.
            self.links.forget_client(session.agent)
        else:
            # The agents its target announced go with it (spec section 5.3, bye).
            announced = list(session.clients)
            session.clients.clear()
            for agent in announced:
                self.remote_agents.release(agent)

    # ------------------------------------------------------------------ remote agents

    def _agent_use(self, name: str) -> AgentUse | None:
        """Who still needs the remote agent ``name`` (``RemoteAgents`` asks before letting go)."""
        running = False
        for session in self.sessions.values():
            if session.agent == name:
                return AgentUse.HELD
            if isinstance(session, PeerSession):
                if name in session.clients:
                    return AgentUse.HELD
                running = running or any(op.agent == name for op in session.ops.values())
        if any(link.agent == name for link in self.links):
            return AgentUse.HELD
        if running or any(t.agent == name for t in self.transfers.inflight):
            return AgentUse.RUNNING
        return None

    # ------------------------------------------------------------------ operations

    def _new_op(self, session: ClientSession, msg_id: int, kind: str, n: int, deadline_ms: int) -> Operation | None:
        if msg_id in session.ops:
            self._refuse(session.identity, msg_id, ProtocolError(ErrorCode.BAD_STATE, f"operation {msg_id} is already in progress", "id"))
            return None
        if len(session.ops) >= self.config.max_pending:
            # Back-pressure: refuse rather than queue without bound.
            self._refuse(session.identity, msg_id, ProtocolError(ErrorCode.BUSY, f"{len(session.ops)} operations in progress; retry later"))
            return None
        ms = deadline_ms or self.config.deadline_ms
        op = Operation(session, msg_id, kind, self.clock() + ms / 1000, [None] * n)
        session.ops[msg_id] = op
        return op

    def _finish_if_settled(self, op: Operation) -> None:
        if not op.settled or op.session.ops.get(op.id) is not op:
            return
        del op.session.ops[op.id]
        if self.remote_agents.pending:
            self.remote_agents.release_pending()
        if op.broken is not None:
            op.fail_unresolved(ErrorCode.INTERNAL)
        results = tuple(r for r in op.results if r is not None)
        self._check_results(op.kind, results)
        for r in results:
            self.outcomes[f"{op.kind}.{r.status.value}" + (f".{ErrorCode(r.code).name}" if r.code else "")] += 1
        if isinstance(op.session, PeerSession) and op.kind == "write":
            op.session.remember_done(op.id)
            if not op.session.closing:
                self._reply(op.session, WriteDone(op.id, results))
            elif not op.session.ops and op.session in self.retired:
                self.retired.remove(op.session)
            return
        if op.session.closing:
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

    def _sort_items(
        self, op: Operation, keys: Sequence[bytes], request_id: str | None
    ) -> tuple[list[int], dict[str, list[int]]]:
        """Split a batch: keys READY here, and keys a hint sends to another node.

        The operation waits on keys still WRITING here; keys neither here nor hinted
        fail NOT_FOUND, repeated keys DUPLICATE_KEY.
        """
        unique = self._unique_keys(op, keys)
        ready: list[int] = []
        remote: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            if not unique[i]:
                continue
            entry = self.store.lookup(key)
            if entry is None:
                source = self._hinted_source(op.session, request_id, key)
                if source is None:
                    op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node"
                            + (" and no hint names a source" if request_id is not None else ""))
                else:
                    remote.setdefault(source, []).append(i)
            elif entry.state is ObjectState.WRITING:
                self._wait(op, key, i)
            else:
                ready.append(i)
        return ready, remote

    # ---- deposit

    def _on_deposit(self, session: ClientSession, msg: Deposit) -> None:
        op = self._new_op(session, msg.id, "deposit", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        # An item whose key another writer holds WRITING waits for that writer's outcome
        # and is then tried again from the start (spec section 9: DUPLICATE means stored).
        op.resume = lambda i: self._deposit_items(op, msg, [i])
        unique = self._unique_keys(op, [item.key for item in msg.items])
        self._deposit_items(op, msg, [i for i in range(len(msg.items)) if unique[i]])

    def _deposit_items(self, op: Operation, msg: Deposit, indices: Sequence[int]) -> None:
        """Begin storing the items ``indices`` of a deposit: check, place, and read the source."""
        fills: list[tuple[int, ObjectEntry]] = []
        try:
            self._begin_deposit_items(op, msg, indices, fills)
        except BaseException:
            # Slots set aside that no transfer took over are freed (the guard fails the items).
            if not any(t.running for t in op.transfers):
                self._abandon_fills([e for _, e in fills if self.store.lookup(e.key) is e and e.state is ObjectState.WRITING])
            raise

    def _abandon_fills(self, entries: Sequence[ObjectEntry]) -> None:
        """Free WRITING entries that no transfer fills after all, and wake their waiters."""
        for entry in entries:
            self.store.abandon(entry)
            self._wake(entry.key)

    def _begin_deposit_items(
        self, op: Operation, msg: Deposit, indices: Sequence[int], fills: list[tuple[int, ObjectEntry]]
    ) -> None:
        session = op.session
        moves: list[Move] = []
        for i in indices:
            item = msg.items[i]
            # Columns of the spans (names, pools, regions, offsets, lengths): one C-level transpose.
            columns = tuple(zip(*item.spans, strict=True))
            uniform = self._uniform_source(session, columns)
            item_moves: list[tuple[int, int, Region]] = []
            if uniform is None:
                try:
                    item_moves = self._deposit_moves(session, item.spans, f"items[{i}].spans")
                except ProtocolError as exc:
                    op.fail(i, exc.code, f"{exc.path}: {exc.reason}")
                    continue
            layout = tuple(zip(columns[0], columns[1], strict=True))
            outcome, entry = self.store.begin_deposit(item.key, layout, msg.optional)
            if outcome is DepositOutcome.NEW:
                assert entry is not None
                fills.append((i, entry))
                if uniform is not None:
                    pool, size, region, offsets = uniform
                    slots = np.frombuffer(entry.slot_view, dtype=np.uint32)
                    moves.extend(run_moves(pool, size, region, offsets, slots))
                else:
                    moves.extend(
                        (span.pool, slot, address, length, region, 1)
                        for span, slot, (address, length, region) in zip(item.spans, entry.slots, item_moves, strict=True)
                    )
            elif outcome is DepositOutcome.DUPLICATE:
                assert entry is not None
                if entry.state is ObjectState.WRITING:
                    # Another deposit or a fetch is filling the key and may still fail: wait
                    # for it (spec section 9); at our deadline, TIMEOUT.
                    self._wait(op, item.key, i)
                else:
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

    def _uniform_source(
        self, session: ClientSession, columns: tuple[tuple[Any, ...], ...]
    ) -> tuple[str, int, Region, np.ndarray] | None:
        """(pool, slot size, region, offsets) for deposit spans of one pool and one region whose
        lengths are the slot size and which lie inside the region; else None (checked per span).
        """
        _, pools, ids, offsets, lengths = columns
        mem = self.memories.get(pools[0])
        if mem is None or len(set(pools)) != 1:
            return None
        uniform = uniform_columns(session.regions, ids, offsets, lengths, mem.spec.slot_size)
        return None if uniform is None else (pools[0], mem.spec.slot_size, *uniform)

    def _deposit_moves(self, session: ClientSession, spans: Sequence[SrcSpan], path: str) -> list[tuple[int, int, Region]]:
        """Check a deposit's spans (pool, size, region) and resolve them to client addresses."""
        memories = self.memories
        for j, span in enumerate(spans):
            mem = memories.get(span.pool)
            if mem is None:
                raise ProtocolError(ErrorCode.UNKNOWN_POOL, f"pool {span.pool!r} does not exist", f"{path}[{j}].pool")
            if span.length != mem.spec.slot_size:
                raise ProtocolError(
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
        op.agent, op.regions = session.agent, session.regions
        items = msg.items
        op.resume = lambda i: self._deliver_ready([i], op, items)
        ready, remote = self._sort_items(op, [item.key for item in items], msg.request_id)
        self._deliver_ready(ready, op, items)
        for source, indices in remote.items():
            self._remote_write(op, source, indices, tuple(items[i] for i in indices), session.agent, session, msg.partial)

    def _deliver_ready(self, indices: list[int], op: Operation, items: Sequence[DeliverItem]) -> None:
        claimed: list[tuple[int, ObjectEntry]] = []
        moves: list[Move] = []
        for i in indices:
            item = items[i]
            entry = self.store.lookup(item.key)
            if entry is not None and entry.state is ObjectState.WRITING:
                # Written again since the wait began (a waiting deposit took over a failed
                # writer's key): wait for that writer too.
                self._wait(op, item.key, i)
                continue
            if entry is None or entry.state is not ObjectState.READY:
                op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
                continue
            try:
                item_moves = self._deliver_moves(op, entry, item, f"items[{i}]")
            except ProtocolError as exc:
                where = f"{exc.path or f'items[{i}].spans'}: "
                op.fail(i, exc.code, where + exc.reason)
                continue
            except Exception as exc:
                # Before the claim: this item fails alone, the claims of the others stay owned.
                self.internal_failure(f"{op.kind} item", exc)
                op.fail(i, ErrorCode.INTERNAL, f"items[{i}]: the node failed: {type(exc).__name__}: {exc}")
                continue
            # Spec section 8: "While any projected span is being delivered, the claim covers the
            # whole object."
            self.store.claim(entry)
            self.op_claims += 1
            claimed.append((i, entry))
            moves.extend(item_moves)
        if claimed:
            self._start(op, "WRITE", moves, lambda ok: self._deliver_done(op, claimed, ok))
        self._finish_if_settled(op)

    def _deliver_moves(self, op: Operation, entry: ObjectEntry, item: DeliverItem, path: str) -> list[Move]:
        """Project the destination onto the stored layout, check sizes and regions.

        Spans of one pool and one region are checked a column at a time; others, and
        every refusal, span by span, so that an error names its span.
        """
        spans = item.spans
        stored = tuple([name for name, _ in entry.layout])
        # Columns of the spans (names, regions, offsets, lengths): one C-level transpose.
        columns = tuple(zip(*spans, strict=True))
        requested: tuple[str, ...] = columns[0]
        if op.exact and requested != stored:
            # A peer write without the partial-layout flag names the whole layout, exactly.
            raise ProtocolError(
                ErrorCode.LAYOUT_SUBSET_INVALID, "without the partial-layout flag the names must be the stored layout"
            )
        # Projection rule: "same names, same order: a full delivery" (no cache lookup, which
        # would hash both name tuples).
        projection = _FULL if requested == stored else self.projections.project(stored, requested)
        need = entry.info.need
        sizes = self.slot_sizes
        size = sizes[need[0][0]] if len(need) == 1 else -1
        if size > 0:
            # One pool, one region, every length right (the common case): checked and
            # merged a column at a time.
            uniform = uniform_columns(op.regions, columns[1], columns[2], columns[3], size)
            if uniform is not None:
                region, offsets = uniform
                slots_array = np.frombuffer(entry.slot_view, dtype=np.uint32)
                if not projection.full:
                    slots_array = slots_array[np.array(projection.indices, dtype=np.intp)]
                return run_moves(need[0][0], size, region, offsets, slots_array)
        slots: Sequence[int] = entry.slots
        pools: Sequence[str] = entry.info.signature
        if not projection.full:  # a subset: only the selected stored spans
            slots = [slots[i] for i in projection.indices]
            pools = [pools[i] for i in projection.indices]
        # Projection rule: "each destination length equals the stored span's size".
        for j, (span, pool) in enumerate(zip(spans, pools, strict=True)):
            if span[3] != sizes[pool]:
                raise ProtocolError(
                    ErrorCode.SIZE_MISMATCH, f"span of {span[3]} bytes, the stored span holds {sizes[pool]}",
                    f"{path}.spans[{j}].length",
                )
        # Span rule: inside a region the client announced (errors name the span).
        resolved = resolve_spans(op.regions, [(s[1], s[2], s[3]) for s in spans], f"{path}.spans")
        return [
            (pool, slot, address, length, region, 1)
            for pool, slot, (address, length, region) in zip(pools, slots, resolved, strict=True)
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
        items = msg.items
        op.resume = lambda i: self._fetch_ready(op, i, items[i])
        ready, remote = self._sort_items(op, [item.key for item in items], msg.request_id)
        for i in ready:
            self._fetch_ready(op, i, items[i])
        for source, indices in remote.items():
            fills = [(i, fill) for i in indices if (fill := self._begin_fill(op, i, items[i])) is not None]
            if fills:
                self._remote_fetch(op, source, fills)
        self._finish_if_settled(op)

    def _fetch_ready(self, op: Operation, i: int, item: FetchItem) -> None:
        entry = self.store.lookup(item.key)
        if entry is not None and entry.state is ObjectState.WRITING:
            self._wait(op, item.key, i)  # written again since the wait began: wait for that writer
        elif entry is None or entry.state is not ObjectState.READY:
            op.fail(i, ErrorCode.NOT_FOUND, f"items[{i}].key is not stored on this node")
        elif tuple((s.name, s.pool) for s in item.layout) != entry.layout:
            # "fetch never projects": the expected layout must be the stored one.
            op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}].layout differs from the stored layout")
        else:
            self.store.claim(entry, accessed=True)  # architecture §3: a fetch claim is an LRU access
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
        self._check_results("release", results)
        self._reply(session, Completion(msg.id, tuple(results)))

    def _on_abort(self, session: ClientSession, msg: Abort) -> None:
        op = session.ops.get(msg.op)
        if op is None and msg.op in session.withdrawals:
            self._reply(session, Ack(msg.id))
            self._cancel_withdrawal(session, msg.op)
            return
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
        hint = session.hints.get(msg.request_id) if msg.request_id is not None else None
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
        problem = endpoint_problem(msg.endpoint)
        if problem is not None:
            # Spec section 5.2: only endpoints this node can dial are kept, so that no
            # deliver or fetch ever hands a socket an address it cannot connect to.
            self._refuse(session.identity, msg.id, ProtocolError(ErrorCode.BAD_ENDPOINT, problem, "endpoint"))
            return
        keys = frozenset(msg.keys)
        old = session.hints.get(msg.request_id)
        limit = self.config.max_hints_per_session
        if old is None and len(session.hints) >= limit:
            # Spec section 5.2: hints are bounded per session; a replacement is not one more.
            self._refuse(session.identity, msg.id, ProtocolError(
                ErrorCode.HINT_LIMIT,
                f"this session holds {len(session.hints)} hints, the most the node allows (max_hints_per_session); "
                "discard some first", "request_id"))
            return
        total = session.hinted_keys - (len(old[1]) if old is not None else 0) + len(keys)
        if total > self.config.max_hinted_keys_per_session:
            self._refuse(session.identity, msg.id, ProtocolError(
                ErrorCode.HINT_LIMIT,
                f"this hint would bring the session's hinted keys to {total}, over the "
                f"{self.config.max_hinted_keys_per_session} the node allows (max_hinted_keys_per_session); "
                "discard some first", "keys"))
            return
        session.hints[msg.request_id] = (msg.endpoint, keys)
        session.hinted_keys = total
        self._reply(session, Ack(msg.id))

    def _on_unhint(self, session: ClientSession, msg: DiscardHint) -> None:
        old = session.hints.pop(msg.request_id, None)
        if old is not None:
            session.hinted_keys -= len(old[1])
        self._reply(session, Ack(msg.id))

    def _on_stats(self, session: ClientSession, msg: StatsRequest) -> None:
        self._reply(session, StatsReply(msg.id, self.snapshot()))

    def snapshot(self) -> dict[str, Any]:
        """Statistics and the result of the accounting check (O(objects))."""
        store = self.store.stats()
        policy = self.store.policy
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
            "clients": sum(1 for s in self.sessions.values() if not isinstance(s, PeerSession)),
            "operations_pending": sum(len(s.ops) for s in self.sessions.values()),
            "transfers": self.transfers.stats(),
            "peers": self.links.stats(),
            "peer_sessions": sum(1 for s in self.sessions.values() if isinstance(s, PeerSession)),
            "outcomes": dict(self.outcomes),
            "protocol_errors": dict(self.protocol_errors),
            "counters": dict(self.counters),
            "projection_cache": {"size": len(self.projections), "hits": self.projections.hits, "misses": self.projections.misses},
            "policy": {"name": policy.name, "failures": getattr(policy, "failures", 0)},
            "tables": self._table_sizes(),
            "invariants": self.check_invariants(),
        }

    def _check_refusal(self, request: str | None, code: int) -> None:
        """Count a refusal code the spec does not list for the request (section 10.1)."""
        if not allowed_refusal(request, code):
            self.undeclared_codes[f"{request or 'undecoded frame'}: error {code}"] += 1

    def _check_results(self, request: str, results: Sequence[KeyResult]) -> None:
        """Count per-key codes the spec does not list for the request (section 10.1)."""
        for r in results:
            if not allowed_result(request, r.code):
                self.undeclared_codes[f"{request}: result {r.code}"] += 1

    def _table_sizes(self) -> dict[str, int]:
        """Entries in the node's per-session and per-peer tables, for soaks and operators."""
        peers = [s for s in (*self.sessions.values(), *self.retired) if isinstance(s, PeerSession)]
        return {
            "sessions": len(self.sessions),
            "retired_sessions": len(self.retired),
            "handles": len(self.handles),
            "waiters": len(self.waiters),
            **self.links.sizes(),
            "peer_clients": sum(len(s.clients) for s in peers),
            **self.remote_agents.sizes(),
            "hints": sum(len(s.hints) for s in self.sessions.values() if not isinstance(s, PeerSession)),
            "hinted_keys": sum(s.hinted_keys for s in self.sessions.values() if not isinstance(s, PeerSession)),
            "withdrawals": sum(len(s.withdrawals) for s in self.sessions.values() if not isinstance(s, PeerSession)),
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
        for what, n in self.undeclared_codes.items():
            breaches.append(f"sent a code spec section 10.1 does not list ({what}) {n} times")
        return breaches

    # ---- capacity events and deadlines

    def _flush_capacity_events(self) -> None:
        for pool in self.store.take_capacity_events():
            stats = self.store.pool_stats()[pool]
            self.counters["capacity_events"] += 1
            for session in list(self.sessions.values()):
                if isinstance(session, PeerSession):
                    continue
                session.events += 1
                self._reply(session, CapacityEvent(session.events, pool, stats["free"] + stats["evictable"], stats["total"]))

    def _next_deadline(self) -> float | None:
        deadlines = [op.deadline for ops in self.waiters.values() for op in ops]
        return min(deadlines) if deadlines else None

    def _check_deadlines(self) -> None:
        if self.links:
            self.links.check(self.clock())
        if not self.waiters:
            return
        now = self.clock()
        expired = {id(op): op for ops in self.waiters.values() for op in ops if op.deadline <= now}
        for op in expired.values():
            self._abort_op(op, ErrorCode.TIMEOUT, "the deadline passed while the object was still being written")

    # ---- transfers

    def _start(self, op: Operation, kind: str, moves: list[Move], on_done: Callable[[bool], None]) -> None:
        def done(ok: bool) -> None:
            # A completion that raises breaks its operation only, never the loop.
            try:
                on_done(ok)
            except Exception as exc:
                self.internal_failure(f"{op.kind} completion", exc)
                self._break_op(op, f"the node failed while completing {op.kind}: {type(exc).__name__}: {exc}")

        try:
            transfer = self.transfers.start(kind, op.agent or op.session.agent, moves, done)
        except TransferError as exc:
            log.warning("transfer refused for %s %d: %s", op.kind, op.id, exc)
            done(False)
            return
        except Exception as exc:
            self.internal_failure(f"{op.kind} transfer", exc)
            done(False)
            return
        op.transfers.append(transfer)

    # ------------------------------------------------------------------ cross-node: target side

    def _hinted_source(self, session: ClientSession, request_id: str | None, key: bytes) -> str | None:
        """The endpoint ``session``'s hint for a request names for ``key`` (never this node itself).

        Only the session's own hints count (spec section 5.2): another client's hint under
        the same request id can neither be seen nor steer this request.
        """
        if request_id is None:
            return None
        hint = session.hints.get(request_id)
        if hint is None or key not in hint[1] or hint[0] == self.endpoint:
            return None
        return hint[0]

    def _begin_fill(self, op: Operation, i: int, item: FetchItem) -> ObjectEntry | None:
        """A WRITING entry for a fetch from a peer (whole layouts only: fetch never projects)."""
        layout = tuple((s.name, s.pool) for s in item.layout)
        for j, (_, pool) in enumerate(layout):
            if pool not in self.memories:
                op.fail(i, ErrorCode.UNKNOWN_POOL, f"items[{i}].layout[{j}].pool: pool {pool!r} does not exist")
                return None
        outcome, entry = self.store.begin_deposit(item.key, layout)
        if outcome is DepositOutcome.NEW:
            return entry
        if outcome is DepositOutcome.CAPACITY:
            op.fail(i, ErrorCode.CAPACITY, f"items[{i}]: not enough free or evictable slots to fetch into")
        else:
            op.fail(i, ErrorCode.LAYOUT_MISMATCH, f"items[{i}]: cannot place the layout ({outcome.value})")
        return None

    def _remote_fetch(self, op: Operation, source: str, fills: list[tuple[int, ObjectEntry]]) -> None:
        """Ask ``source`` to write whole objects into our WRITING slots.

        Until the write exists nothing can touch those slots: if the link cannot be opened
        (or anything fails before), they are freed and the keys fail.
        """
        try:
            link = self.links.open(source)
            items = []
            for _, entry in fills:
                spans = []
                for (name, pool), slot in zip(entry.layout, entry.slots, strict=True):
                    size = self.memories[pool].spec.slot_size
                    spans.append(DstSpan(name, self.pool_index[pool], slot * size, size))
                items.append(DeliverItem(entry.key, tuple(spans)))
        except LinkError as exc:
            self._abandon_fills([entry for _, entry in fills])
            for i, _ in fills:
                op.fail(i, exc.code, exc.reason)
            return
        except BaseException:
            self._abandon_fills([entry for _, entry in fills])
            raise
        write = self.links.new_write(op, link, [i for i, _ in fills], tuple(items), self.agent.name, None, False)
        write.fills = [entry for _, entry in fills]
        op.remote += 1
        self.links.submit(write)

    def _remote_write(
        self, op: Operation, source: str, indices: list[int], items: tuple[DeliverItem, ...],
        agent: str, client: ClientSession, partial: bool,
    ) -> None:
        """Ask ``source`` to write objects straight into the client's memory (spec section 12)."""
        for i, item in zip(indices, items, strict=True):
            _, ids, offsets, lengths = zip(*item.spans, strict=True)
            if uniform_columns(client.regions, ids, offsets, lengths) is not None:
                continue
            try:
                resolve_spans(client.regions, [(s.region, s.offset, s.length) for s in item.spans], f"items[{i}].spans")
            except ProtocolError as exc:
                op.fail(i, exc.code, f"{exc.path}: {exc.reason}")
        keep = [(i, item) for i, item in zip(indices, items, strict=True) if op.results[i] is None]
        if keep:
            try:
                link = self.links.open(source)
            except LinkError as exc:
                for i, _ in keep:
                    op.fail(i, exc.code, exc.reason)
                keep = []
        if not keep:
            self._finish_if_settled(op)
            return
        write = self.links.new_write(op, link, [i for i, _ in keep], tuple(item for _, item in keep), agent, client, partial)
        op.remote += 1
        self.links.submit(write)

    # ---- what the links report (LinkOwner)

    def _peer_hello_msg(self, hello_id: int) -> PeerHello:
        """Our ``peer_hello`` (spec section 5.3): versions, identity, agent metadata, our pools as regions."""
        return PeerHello(hello_id, self.versions, self.config.name, self.incarnation, self.agent.name,
                         self.agent.metadata(), self.pool_regions)

    def write_over(
        self, write: RemoteWrite, code: ErrorCode | None, reason: str, results: Sequence[KeyResult], was_uncertain: bool
    ) -> None:
        """A write is over: no transfer of it can touch the destination any more."""
        if self.withdrawing and write.client is not None:
            self._release_withdrawals()  # a held unregions may wait on this write (spec section 12)
        op = write.op
        if was_uncertain:
            self.counters["uncertain_resolved"] += 1
            for entry in write.fills or ():
                self.store.abandon(entry)
                self._wake(entry.key)
            return
        op.remote -= 1
        for n, i in enumerate(write.indices):
            result = _from_source(results[n]) if n < len(results) else None
            if write.fills is not None:
                entry = write.fills[n]
                if result is not None and result.status is KeyStatus.OK and not op.aborted:
                    self.store.commit(entry, claim=not op.session.closing)
                    if not op.session.closing:
                        op.set(i, KeyResult(KeyStatus.OK, handle=self._new_handle(op.session, entry)))
                else:
                    self.store.abandon(entry)
                self._wake(entry.key)
            if op.aborted:
                op.set(i, KeyResult(KeyStatus.ABORTED, ErrorCode.ABORTED, "aborted"))
            elif result is not None:
                op.set(i, result)
            else:
                op.fail(i, code or ErrorCode.TRANSFER_FAILED, reason)
        self._finish_if_settled(op)

    def write_uncertain(self, write: RemoteWrite) -> None:
        """The deadline passed with the write unanswered: fail the items, keep the memory."""
        op = write.op
        op.remote -= 1
        for i in write.indices:
            op.fail(i, ErrorCode.DESTINATION_UNCERTAIN,
                    f"the deadline passed; the source {write.link.endpoint} may still write the destination until it confirms")
        self._finish_if_settled(op)

    # ------------------------------------------------------------------ cross-node: source side

    def _on_peer_hello(self, identity: bytes, msg: PeerHello) -> None:
        if self.stopping:
            self._refuse(identity, msg.id, ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping"))
            return
        try:
            version = negotiate(self.versions, msg.versions)
        except ProtocolError as exc:
            self._refuse(identity, msg.id, exc)
            return
        # A reconnecting target opens a new session (a new identity); its old sessions
        # retire: their writes run to the end and stay answerable to probes.
        for old in [s for s in self.sessions.values()
                    if s.identity == identity or (isinstance(s, PeerSession) and s.incarnation == msg.incarnation)]:
            self._close_session(old)
            if old.ops:
                self.retired.append(old)
        session = self._open_session(
            identity, msg.id, msg.agent_md, msg.regions,
            lambda agent: PeerSession(identity, msg.node, agent, version, msg.agent_md, incarnation=msg.incarnation),
        )
        if session is None:
            return
        self.counters["peer_hellos"] += 1
        log.info("peer %s (incarnation %x) joined at version %d", msg.node, msg.incarnation, version)
        self._reply(session, PeerWelcome(msg.id, version, self.config.name, self.incarnation, self.agent.name, self.agent.metadata()))

    def _on_peer_client(self, peer: PeerSession, msg: PeerClient) -> None:
        try:
            agent = self.remote_agents.add(msg.agent_md)
        except Exception as exc:
            self._refuse(peer.identity, msg.id, ProtocolError(ErrorCode.BAD_DESCRIPTOR, f"agent metadata refused: {exc}", "agent_md"))
            return
        try:
            holder = ClientSession(b"", msg.agent, agent, peer.version)
            self._add_regions(holder, msg.regions)
        except ProtocolError as exc:
            self.remote_agents.release(agent)  # unless the peer announced it before
            self._refuse(peer.identity, msg.id, exc)
            return
        peer.clients[agent] = holder.regions
        peer.clients.move_to_end(agent)
        self._bound_peer_clients(peer)
        self._reply(peer, Ack(msg.id))

    def _bound_peer_clients(self, peer: PeerSession) -> None:
        """Forget the least recently used announced clients beyond ``max_peer_clients`` (spec
        section 5.3), except those a running write of this peer names: that table is then
        over the bound by at most the peer's operations in progress (``max_pending``)."""
        excess = len(peer.clients) - self.config.max_peer_clients
        if excess <= 0:
            return
        running = {op.agent for op in peer.ops.values()}
        for agent in [a for a in peer.clients if a not in running][:excess]:
            del peer.clients[agent]
            self.counters["peer_clients_evicted"] += 1
            self.remote_agents.release(agent)

    def _on_write(self, peer: PeerSession, msg: WriteRequest) -> None:
        regions = peer.regions if msg.agent == peer.agent else peer.clients.get(msg.agent)
        if regions is not None and msg.agent != peer.agent:
            peer.clients.move_to_end(msg.agent)
        if regions is None:
            self.protocol_errors[ErrorCode.BAD_STATE.name] += 1
            self._reply(peer, Refuse(msg.id, ErrorCode.BAD_STATE, f"agent {msg.agent!r} was not announced (peer_client first)"))
            return
        op = self._new_op(peer, msg.id, "write", len(msg.items), msg.deadline_ms)
        if op is None:
            return
        op.agent, op.regions, op.exact = msg.agent, regions, not msg.partial
        items = msg.items

        def resume(i: int) -> None:
            self.counters["writes_deferred"] += 1
            self._deliver_ready([i], op, items)

        op.resume = resume
        # A source never forwards: request_id None names no hint.
        ready, _ = self._sort_items(op, [item.key for item in items], None)
        if ready and self.config.defer_writes:
            # Measuring switch only: submit on a later turn, as a second queue would.
            self.counters["writes_deferred"] += 1
            self._deferred.append(lambda: self._deliver_ready(ready, op, items))
            return
        if ready:
            # architecture §4: claims taken and the WRITE submitted in the turn that decoded the request.
            self.counters["writes_inline"] += 1
        self._deliver_ready(ready, op, items)

    def _on_probe(self, peer: PeerSession, msg: Probe) -> None:
        # Write ids are unique per target incarnation: look through every session of it,
        # retired ones included (a write from before a reconnect may still be running).
        state = WriteState.UNKNOWN
        for session in [*self.sessions.values(), *self.retired]:
            if not isinstance(session, PeerSession) or session.incarnation != peer.incarnation:
                continue
            op = session.ops.get(msg.op)
            if op is not None and op.kind == "write":
                state = WriteState.IN_FLIGHT if any(t.running for t in op.transfers) else WriteState.WAITING
                break
            if msg.op in session.done:
                state = WriteState.DONE
                break
        self._reply(peer, ProbeReply(msg.id, msg.op, state, self.incarnation))

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
        self.links.close_all()
        self._close_sockets()
        self.bound.close()
        self._wakeup.close()

    def _close_sockets(self) -> None:
        if self.curve is not None:
            self.curve.close()
        self.sock.close(0)
        if self._own_context:
            self.context.term()

    def _release_memory(self) -> None:
        for reg in self._regs:
            try:
                self.agent.deregister(reg)
            except Exception:
                log.debug("deregistration failed", exc_info=True)
        self._regs.clear()
        for mem in self.memories.values():
            mem.close()
