"""The node: one progress thread that owns the ROUTER socket, the NIXL agent and all state.

architecture §4: each turn drains a bounded batch of control messages, polls in-flight
transfers, completes finished operations and submits new transfers. Nothing here takes
a lock; other threads only call ``request_stop`` or read ``snapshot``. Idle, the loop
blocks in a ZeroMQ poll; with transfers in flight it polls NIXL at a short, bounded
interval.

``Node`` owns the sockets, the poller, the memory and the loop, and wires the parts that
own the state (architecture §1): ``Router`` (requests in), ``Sessions``, ``Operations``
and the operation families in ``kvcr_node.ops``, ``Target`` (remote writes we ask for,
over the ``Links`` made here and handed to it), ``Source`` (what peers ask of us) and
``Stats``. Those parts never touch the ROUTER socket: they put what to send in the
``Outbox``, and the loop sends it.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from kvcr_io.agent import Agent
from kvcr_io.pacing import Pacer
from kvcr_io.wake import WakePipe
from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_io.zmq_flags import SNDMORE as _SNDMORE
from kvcr_node.agents import RemoteAgents
from kvcr_node.auth import CurveServer
from kvcr_node.config import NodeConfig
from kvcr_node.counters import Count, Counters, ProtocolErrors
from kvcr_node.digests import Digests
from kvcr_node.disk_pools import DiskPools
from kvcr_node.disk_tier import DiskTier, MemoryListener
from kvcr_node.endpoint import BoundEndpoint
from kvcr_node.event_publisher import EventPublisher
from kvcr_node.eviction import make_policy
from kvcr_node.exporter import MetricsExporter
from kvcr_node.grant_progress import GrantProgress
from kvcr_node.introductions import Introductions
from kvcr_node.inventory import Inventory
from kvcr_node.journal import Journal, close_stopping, failure_log
from kvcr_node.leases import Leases
from kvcr_node.links import Links
from kvcr_node.logs import left_out_note
from kvcr_node.memory import PoolMemory, available_bytes
from kvcr_node.metrics import Metrics
from kvcr_node.metrics_publisher import MetricsPublisher
from kvcr_node.objects import Listeners
from kvcr_node.operations import Operations
from kvcr_node.ops.deliver import Deliveries
from kvcr_node.ops.deposit import Deposits
from kvcr_node.ops.fetch import Fetches
from kvcr_node.ops.query import Queries
from kvcr_node.outbox import Outbox
from kvcr_node.puts import Puts
from kvcr_node.recovery import take_back
from kvcr_node.reservations import Reservations
from kvcr_node.router import Router
from kvcr_node.sessions import Sessions
from kvcr_node.source import Source, SubmitWrite
from kvcr_node.state_dir import StateDir
from kvcr_node.stats import Stats
from kvcr_node.store import Store
from kvcr_node.suspects import Suspects
from kvcr_node.target import Target
from kvcr_node.tiering import Tiering
from kvcr_node.transfers import LocalLists, Transfers
from kvcr_protocol import (
    ErrorCode,
    Limits,
    PoolInfo,
    ProjectionCache,
    Role,
    supported_up_to,
)

log = logging.getLogger("kvcr.node")

_IDLE_POLL_MS = 1000
_SHUTDOWN_DRAIN_S = 10.0
_FAILED_POLL_S = 0.05
"""After a failed poll the loop waits this long, so a failing poll cannot spin."""
_FAILURE_LOG_INTERVAL_S = 10.0
"""An internal failure of one kind is logged (with its traceback) at most this often; each is counted."""


class Node:
    """A kvcr node. ``run()`` is the progress loop; ``request_stop()`` ends it cleanly."""

    def __init__(
        self, config: NodeConfig, context: zmq.Context[Any] | None = None, clock: Callable[[], float] = time.monotonic,
        *, source_submit: SubmitWrite | None = None,
    ) -> None:
        self.config = config.validated()
        self.clock = clock
        """Protocol time (deadlines, liveness, links); tests pass a fake one. Shutdown waits in real time."""
        self._source_submit = source_submit
        """Where the source side's READY writes are submitted when not at once (measurement only: ``Source``)."""
        self.versions = supported_up_to(config.protocol_version)
        self.incarnation = secrets.randbits(63) | 1
        self.store = Store(config.pools, make_policy(config.policy), config.low_watermark)
        self.memories: dict[str, PoolMemory] = {}
        self._regs: list[Any] = []
        self.state: StateDir | None = None
        """The state directory, when the node keeps its cache across restarts (architecture §8)."""
        self.journal: Journal | None = None
        self.recovery: dict[str, Any] | None = None
        """What this node took back at its start (``stats`` ``recovery``)."""
        if config.state_dir:
            self.state = StateDir(config.state_dir, config.pools, config.pool_dir, self.incarnation)
        self.agent = Agent(f"{config.name}.{self.incarnation:x}", files=bool(config.disk_pools))
        self.disk_pools: DiskPools | None = None  # open and registered for the node's life (architecture §9)
        available = available_bytes()
        try:
            for spec in config.pools:
                mem = PoolMemory(spec, available, self.state.files.get(spec.name) if self.state is not None else None)
                if available is not None and mem.device is None:
                    available -= spec.size
                self.memories[spec.name] = mem
                # Registered with NIXL once, at start (architecture §6).
                self._regs.append(self.agent.register(mem.kind, mem.address, spec.size, mem.nixl_device))
            self.local = LocalLists(self.agent, list(self.memories.values()))
            if config.disk_pools:
                self.disk_pools = DiskPools(config.disk_pools, self.agent, self.incarnation)
        except Exception:
            self._release_memory()
            raise
        self.transfers = Transfers(self.agent, self.local)

        self.protocol_errors = ProtocolErrors()
        self.counters = Counters()
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.events: EventPublisher | None = None
        """The inventory event stream, when ``events_endpoint`` is set (spec section 15)."""
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
        if config.events_endpoint:
            try:
                self.events = self._start_events()
            except Exception:
                self.bound.close()
                self._close_sockets()
                self._release_memory()
                raise
        self._wakeup = WakePipe()
        self._stop = False
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)
        for extra in self.curve.sockets if self.curve is not None else ():
            self._poller.register(extra, zmq.POLLIN)
        if self.events is not None:
            self._poller.register(self.events.replay, zmq.POLLIN)
            self._poller.register(self.events.monitor, zmq.POLLIN)
        self._failure_logged: dict[str, float] = {}
        """Failure kind -> when it may be logged (with a traceback) again."""
        self.metrics = Metrics(clock)
        self._wire()
        if self.events is not None:
            self.stats.inventory = self.events.inventory
            self.stats.replays = self.events.replays
        self.publisher: MetricsPublisher | None = None
        """Publishes the snapshots the exporter serves (only with a metrics port)."""
        self.exporter: MetricsExporter | None = None
        self.metrics_port: int | None = None
        """The port ``/metrics`` is served on (the one bound when configured as 0)."""
        try:
            self._recover()
        except BaseException:
            self._abandon_start()
            raise
        if self.config.metrics_port is not None:
            self._start_exporter()

    def _recover(self) -> None:
        """Take back what the last node on the state directory and on the disk pools held
        (``kvcr_node.recovery``), then journal both."""
        inventory = self.events.inventory if self.events is not None else None
        if self.state is not None:
            taken = take_back(self.state, self.store, self.memories, self.incarnation,
                              self.config.journal_compact_bytes, self._journal_failed, inventory)
            self.journal = self.stats.journal = taken.journal
            self.recovery = self.stats.recovery = taken.figures
            self.sessions.kept = taken.figures["kept"]
        if self.tiering is not None and self.disk_pools is not None:
            self.tiering.take_back(self.disk_pools.state, self.incarnation, self.config.journal_compact_bytes, inventory)
            # After the journal and the events: they hear of a key stored anew first.
            listener = MemoryListener(self.tiering.tier)
            self.store.listener = listener if self.store.listener is None else Listeners(self.store.listener, listener)
            self.stats.tiering = self.tiering

    def _journal_failed(self, exc: BaseException) -> None:
        if (left_out := failure_log.admit("memory")) is not None:
            log.error("journal: a write failed (%s): the journal starts again from what is held; "
                      "until then a restart would start empty%s", exc, left_out_note(left_out))

    def _start_exporter(self) -> None:
        """Publish a first snapshot and serve ``/metrics`` (a port that cannot be bound fails the start)."""
        config = self.config
        assert config.metrics_port is not None
        publisher = self.publisher = MetricsPublisher(
            config, self.incarnation, self.versions[-1], self.metrics, self.store, self.operations, self.sessions,
            self.leases, self.links, self.transfers, self.counters, self.protocol_errors)
        publisher.tiering = self.tiering
        publisher.publish()
        try:
            self.exporter = MetricsExporter(config.metrics_address, config.metrics_port, lambda: publisher.latest,
                                            config.metrics_max_connections)
        except BaseException:
            self._abandon_start()
            raise
        self.metrics_port = self.exporter.port

    def _abandon_start(self) -> None:
        """A start that failed once the sockets were bound: let go of everything made so far."""
        self._close_sockets()
        self.bound.close()
        self._wakeup.close()
        self._release_memory()

    def _wire(self) -> None:
        """Make the parts that own the node's state, each handed what it reports to (architecture §1)."""
        config, failure = self.config, self.internal_failure
        intro = Introductions(self.agent, config.pools, self.memories, config.name, self.incarnation, self.versions,
                              config.client_grace_ms if config.heartbeat_ms else 0)
        self.outbox = Outbox(self.protocol_errors)
        self.remote_agents = RemoteAgents(self.agent, lambda name: self.sessions.agent_use(name), self.clock)
        self.operations = Operations(
            config, self.store, self.transfers, self.remote_agents, self.outbox, self.clock, self.endpoint, failure,
            self.metrics)
        self.links = Links(
            config, self.context, self._poller, self.remote_agents, intro.peer_hello, self.versions, self.counters,
            self.protocol_errors, self.clock, self.curve.peer_keys if self.curve is not None else None,
        )
        self.reservations = Reservations()
        self.target = Target(
            self.links, self.remote_agents, self.store, self.memories, self.operations, self.outbox, self.counters,
            self.agent.name, failure, self.reservations,
        )
        self.links.owner = self.target
        self.leases = Leases(config, self.store, self.outbox, self.links, self.clock, self.endpoint)
        self.links.lease_owner = self.leases
        self.leases.grant_node = intro.grant_node
        self.leases.pool_index = {spec.name: i for i, spec in enumerate(config.pools)}
        self.grant_progress = GrantProgress(lambda: self.agent.progress(),
                                            lambda: max(self.leases.granted_at, self.puts.granted_at))
        self.leases.session_count = lambda: sum(1 for s in self.sessions.table.values() if s.regions or s.leases)
        pool_info = tuple(PoolInfo(s.name, s.slot_size, s.slot_count, s.memory) for s in config.pools)
        self.sessions = Sessions(
            config, self.store, self.operations, self.target, self.leases, self.remote_agents, self.transfers, self.outbox,
            self.counters, self.clock, self.versions, self.incarnation, self.agent.name, pool_info,
        )
        slot_sizes = {name: mem.spec.slot_size for name, mem in self.memories.items()}
        projections = ProjectionCache(config.projection_cache)
        self.digests = Digests(self.memories, self.store, self.counters)
        if config.integrity:
            self.store.on_ready = self.digests.take  # before anyone can read the object (spec 6.12)
        self.tiering: Tiering | None = None  # the disk tier at work, with disk pools (architecture §9)
        if self.disk_pools is not None:
            tier = DiskTier(self.store, config.disk_pools, {f.spec.name: f.region for f in self.disk_pools.files},
                            make_policy(config.policy), config.disk_demote_mark, promote=config.disk_promote)
            io = self.agent.files_io or "aio"
            self.tiering = Tiering(tier, self.transfers, self.agent.name, self.digests, self.operations.wake_all, io)
            log.info("disk tier: %d disk pools, NIXL's POSIX backend on %s", len(config.disk_pools),
                     "io_uring" if io == "uring" else "Linux AIO (no io_uring here)")
            self.operations.promote = self.leases.promote = self.tiering.promote
            self.leases.on_disk = self.tiering.on_disk
        # Spec 6.12: the node checks what it sends itself where a grant could have changed it.
        exposed = config.integrity and (config.client_transfers or config.peer_grants)
        self.deliveries = Deliveries(self.store, slot_sizes, projections, self.operations, self.target, failure,
                                     self.digests if exposed else None)
        self.source = Source(
            config, self.sessions, self.operations, self.deliveries, self.remote_agents, self.outbox, self.counters,
            self.protocol_errors, self.versions, self.incarnation, self.agent.name, self.agent.metadata,
            submit_write=self._source_submit,
        )
        self.stats = Stats(
            config, self.incarnation, self.versions, self.store, self.sessions, self.operations, self.target, self.leases,
            self.transfers, self.remote_agents, projections, self.outbox, self.counters, self.protocol_errors,
            self.metrics,
        )
        deposits = Deposits(self.store, self.memories, self.operations, self.reservations)
        self.puts = Puts(config, self.store, deposits, self.operations, self.remote_agents, self.outbox, self.clock,
                         self.leases.pool_index, intro.grant_node)
        self.sessions.puts = self.puts
        self.puts.end_session = self.sessions.end
        self.puts.session_count = lambda: sum(1 for s in self.sessions.table.values() if s.role is not Role.PEER)
        self.stats.puts = self.puts
        suspects = Suspects(self.store, self.digests, self.outbox, self.counters, self.clock, config.suspect_bytes_per_s,
                            slot_sizes, self.leases.granted_at_sources, self.links.ask)
        self.router = Router(
            self.sessions, self.operations, deposits, self.deliveries,
            Fetches(self.store, self.memories, self.operations, self.target),
            Queries(self.store, self.outbox, self.metrics,
                    self.tiering.tier.on_disk_only if self.tiering is not None else None), self.leases, self.source, self.stats, self.outbox, self.versions,
            Limits(max_frame=config.max_frame), self.clock, failure, self.puts, suspects,
        )

    def _start_events(self) -> EventPublisher:
        """Bind the event stream's sockets and have the store report to its inventory."""
        tiers = {**{spec.name: spec.memory for spec in self.config.pools}, **dict.fromkeys(
            (spec.name for spec in self.config.disk_pools), "disk")}
        inventory = Inventory(self.config.name, self.incarnation, tiers)
        events = EventPublisher(self.context, self.config.events_endpoint, self.config.events_replay_endpoint,
                                inventory, self.counters, self.clock, self.config.events_replay_bytes,
                                self.config.events_replay_requesters)
        self.store.listener = inventory
        return events

    def snapshot(self, *, audit: bool = False) -> dict[str, Any]:
        """Statistics (``stats``); with ``audit``, the accounting check too (O(objects))."""
        return self.stats.snapshot(audit=audit)

    def check_invariants(self) -> list[str]:
        return self.stats.check_invariants()

    # ------------------------------------------------------------------ the loop

    def request_stop(self) -> None:
        """Ask the loop to stop (thread- and signal-safe)."""
        self._stop = True
        self._wakeup.wake()

    def run(self) -> None:
        """Run the progress loop until ``request_stop``; then shut down cleanly.

        No exception of one step (or of one message, see ``Router.receive``) ends the
        loop: it is logged and counted (``internal_errors``) and the next step runs.
        """
        pacer = Pacer()
        events: dict[Any, int] = {}
        posted = self.transfers.posted
        try:
            while not self._stop:
                if self.transfers.posted != posted:
                    # A new transfer (the next group of a plan): look at it at the spin rate
                    # again, as at the start of a transfer (architecture §4).
                    posted = self.transfers.posted
                    pacer.reset()
                filling = False
                try:
                    filling = self.links.filling
                    events = self._wait_events(pacer, filling)
                except Exception as exc:
                    self.internal_failure("poll", exc)
                    events = {}
                    time.sleep(_FAILED_POLL_S)
                self._turn(events, filling)
        finally:
            self._shutdown()

    def _turn(self, events: dict[Any, int], filling: bool) -> None:
        """One turn of the loop over what the poll reported; each step guarded on its own."""
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
        if filling:
            # A source is writing into our pools (a fetch): our agent is the
            # target of that transfer and needs progress too (architecture §6).
            self._guarded("agent progress", self.agent.progress)
        if not self.transfers.inflight:  # polling transfers progresses the agent
            self._guarded("agent progress", self.remote_agents.progress_idle)
            if self.leases.granted or self.puts.table:
                self._guarded("agent progress", self.grant_progress.step, self.clock())
        self._guarded("transfer completion", self.transfers.poll)
        if self.tiering is not None:
            self._guarded("disk tier", self.tiering.step)
        if self.operations.progressing:
            self._guarded("progress", self.operations.flush_progress)
        now = self.clock()
        if self.links:
            # Heartbeats to sources, write deadlines and probes, idle links closed.
            self._guarded("peer links", self.links.check, now)
        self._guarded("deadlines", self.operations.check_deadlines, now)
        if self.leases.table:
            self._guarded("leases", self.leases.check, now)
        if self.puts.table:
            self._guarded("puts", self.puts.check_puts, now)
        self._guarded("liveness", self.sessions.check_liveness, now)
        self._guarded("capacity events", self.sessions.flush_capacity_events)
        if self.publisher is not None:
            self._guarded("metrics", self.publisher.maybe_publish)
        if self.events is not None:
            if self.events.monitor in events or self.events.replay in events:
                # Disconnections before requests: a request may come on a reused descriptor.
                self._guarded("event replay", self.events.watch)
            if self.events.replay in events:
                self._guarded("event replay", self.events.serve)
            if self.events.replays.active:
                self._guarded("event replay", self.events.pump)
            if self.events.inventory.pending:
                self._guarded("inventory events", self._publish_events)

    def _publish_events(self) -> None:
        """Publish the turn's inventory events, once the journal holds them."""
        assert self.events is not None
        if self.journal is not None:
            self.journal.flush()
        self.events.publish()

    def _wait_events(self, pacer: Pacer, filling: bool) -> dict[Any, int]:
        """Poll the sockets: at once while transfers run, else until the next timer."""
        if self.transfers.inflight or filling:
            events = dict(self._poller.poll(0))
            if not events:
                # In flight: spin briefly, then poll NIXL at a short, bounded interval.
                delay = pacer.next()
                if delay:
                    time.sleep(delay)
            return events
        pacer.reset()
        return dict(self._poller.poll(self._idle_timeout_ms()))

    def _guarded(self, step: str, fn: Callable[..., object], *args: object) -> None:
        """Run one loop step, then send what it put in the outbox; an exception is logged and
        counted, and the loop goes on."""
        try:
            fn(*args)
        except Exception as exc:
            self.internal_failure(step, exc)
        self._send_out()

    def internal_failure(self, what: str, exc: BaseException) -> None:
        """Count an unexpected failure; log it with its traceback (at most every few seconds per kind)."""
        self.counters.inc(Count.INTERNAL_ERRORS)
        now = self.clock()
        if now >= self._failure_logged.get(what, 0.0):
            self._failure_logged[what] = now + _FAILURE_LOG_INTERVAL_S
            log.error("internal failure in %s (counted; the node goes on): %s: %s", what, type(exc).__name__, exc,
                      exc_info=exc)
        else:
            log.debug("internal failure in %s: %r", what, exc)

    def _idle_timeout_ms(self) -> int:
        now = self.clock()
        wakeups = [t for t in (self.operations.next_deadline(), self.sessions.next_wakeup(), self.links.next_wakeup(now),
                               self.leases.next_expiry() if self.leases.table else None, self.puts.next_put_event())
                   if t is not None]
        longest = _IDLE_POLL_MS
        if self.leases.granted or self.puts.table:
            # Reads and writes the grants allow need our agent's progress (``GrantProgress``).
            longest = max(0, min(longest, int((self.grant_progress.next_at - now) * 1000) + 1))
        if self.publisher is not None:
            # Idle or not, the next snapshot goes out on time (in real time).
            longest = min(longest, int(self.publisher.due_in() * 1000) + 1)
        retry = self.events.replays.next_retry() if self.events is not None else None
        if retry is not None:  # no event says a requester's queue has room: try again then
            longest = min(longest, max(0, int((retry - now) * 1000) + 1))
        if not wakeups:
            return longest
        return max(0, min(longest, int((min(wakeups) - now) * 1000) + 1))

    def _drain_messages(self) -> None:
        """Handle what has arrived, at most ``batch`` messages, then send their replies together.

        Many small requests in flight from one client are answered in a batch of replies
        (one wake-up of each side's I/O for many frames); a lone request is answered as
        soon as it is handled, since nothing more is there to read (architecture §4).
        """
        sock = self.sock
        for _ in range(self.config.batch):
            # Ask before reading: cheaper than the exception of an empty read.
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                break
            self.router.receive(sock.recv_multipart(_NOBLOCK))
            if self.transfers.inflight:
                # Complete what finished before reading on: a first layer's completion must
                # not wait behind the next request's submission.
                self.transfers.poll()
                self.operations.flush_progress()
                self._send_out()
        self._send_out()

    def _send_out(self) -> None:
        """Send what the parts put in the outbox, in order (a full peer queue drops, counted);
        the journal's records go first (architecture §8: recorded before told)."""
        if self.journal is not None and self.journal.pending:
            self.journal.flush()
        if not self.outbox.frames:
            return
        sock = self.sock
        for identity, payload in self.outbox.take():
            try:
                sock.send(identity, _NOBLOCK | _SNDMORE)
                sock.send(payload, _NOBLOCK)
            except zmq.Again:
                self.counters.inc(Count.SEND_DROPPED)

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        """Stop accepting, let in-flight transfers finish (bounded), fail the rest, deregister."""
        self.router.stopping = True
        if self.exporter is not None:
            # A stopping node reports nothing more: the port closes first.
            self.exporter.close()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        end = time.monotonic() + _SHUTDOWN_DRAIN_S
        while self.transfers.inflight and time.monotonic() < end:
            if dict(poller.poll(1)):
                self._drain_messages()
            self.transfers.poll()
            self._send_out()
        for session in list(self.sessions):
            for op in list(session.ops.values()):
                self.operations.abort(op, ErrorCode.SHUTTING_DOWN, "the node is stopping")
        self.leases.end_all(ErrorCode.SHUTTING_DOWN, "the node is stopping")
        self._send_out()
        if self.tiering is not None:
            self.tiering.close()
        if self.transfers.inflight:
            log.error("%d transfers still in flight at exit; memory stays registered", len(self.transfers.inflight))
        else:
            self._release_memory()
        self.links.close_all()
        if self.events is not None:
            self.events.stop()
        self._close_sockets()
        self.bound.close()
        self._wakeup.close()
        self._close_state()

    def _close_state(self) -> None:
        """Write the journal's last records and give the state directory up."""
        if self.journal is not None:
            close_stopping(self.journal, "state directory")
            self.journal = None
        if self.state is not None:
            self.state.close()
            self.state = None

    def _close_sockets(self) -> None:
        if self.curve is not None:
            self.curve.close()
        if self.events is not None:
            self.events.close()
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
        if self.disk_pools is not None:
            self.disk_pools.close()
            self.disk_pools = None
        if self.journal is None and self.state is not None:  # a start that failed
            self.state.close()
