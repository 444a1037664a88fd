"""The client core: the I/O around the client's session, its socket, NIXL agent, lock and threads.

Whoever holds the core's I/O lock owns the socket and the agent; the lock is held only for
short turns that never block (send, read what has arrived, progress the agent), never
while waiting. Waiting is done without it, in ``select`` on the socket's descriptor, by
exactly the threads that need the replies (architecture §4):

- A caller that blocks on a result (``wait``) drives the socket itself: the first such
  caller leads (selects, then takes a turn) until its own result is in; callers that wait
  meanwhile follow, asleep until their result is in or the leader leaves and wakes one of
  them to lead. A round trip with one caller costs no thread hand-off.
- An asyncio caller that awaits a result (``wait_async``) lets its event loop read: the
  loop watches the socket's descriptor while it has awaiters and takes a turn when it is
  readable, so the reply resolves the awaiter in the loop's own thread.
- The background thread reads only when nobody waits: replies for handles nobody waits on
  (callbacks, ``poll_completed``), heartbeats, deadlines, and the agent's progress while an
  operation that may touch client memory is pending and only event loops wait (both ends of
  a NIXL transfer need progress, architecture §6). While callers wait, and for a few
  milliseconds after they stop (they usually wait again), it stays off the socket and asleep,
  so a reply wakes only the thread that waits for it.
Idle, the background thread blocks in ``select`` on the socket and costs nothing. ``poll``
reads without blocking, for engines that look at their operations once per step.

Rule for every lock holder: before releasing the lock, drain the socket until ZeroMQ
reports no more input, so the edge-triggered socket descriptor re-arms. Then any input not
read yet makes the descriptor readable, and a waiter may select on it without the lock.

What the session knows lives in a sans-I/O ``ClientSession`` (``kvcr_client.session``): the
pending table, deadlines and their grace, timed-out memory holds, heartbeats, the node's
silence, notifications; the core feeds it the frames, notifications and the time, and
carries out the events it returns (send a frame, finish or fail a future, settle, call an
observer). The session changes only with the lock held. The background thread looks at it
between turns without the lock, so it never walks its tables there: it reads a count of
memory-touching requests and the nearest deadline, both kept up to date where the tables change.
The pieces of I/O are split by concern: ``requests`` (the futures), ``transport`` (the
socket and its monitor), ``driver`` (the lock, the wake pipes, select, the background
thread), ``waiters`` (leader and followers, and the background thread's loop), ``loops``
(event loop readers), ``actions`` (the session's events carried out). The readers are handed
the driver and a ``Schedule`` of the core's turn and timers, never the core.

A request that may touch client memory and gets no answer within its deadline (plus a
grace) fails for its waiter with ``OperationTimeout``, but the node may still be moving
its bytes: it is kept as a timed-out record, and its ``on_settled`` callback (which lets
go of the regions it names) runs only when the node's late answer arrives or the session
is over (spec section 5.1). The session is over for the client when it closes, or when
it declares the node lost (disconnected, or silent for three heartbeat intervals; spec
section 14 says what that leaves open).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from kvcr_client.actions import Actions, Hooks
from kvcr_client.driver import MONITOR_READY, SOCKET_READY, Driver, Schedule, weakly
from kvcr_client.errors import ClientClosed, NodeError, NodeLostError, translated
from kvcr_client.loops import LoopReaders
from kvcr_client.reads import Reads
from kvcr_client.requests import Request, settle
from kvcr_client.session import ClientSession
from kvcr_client.transport import Link, Transport
from kvcr_client.waiters import _CLOSE_TIMEOUT_S, _IDLE_S, _PARK_S, Waiters
from kvcr_io.agent import Agent
from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_protocol import (
    CURRENT_VERSION,
    DEFAULT_LIMITS,
    Bye,
    ErrorCode,
    Hello,
    LocalProtocolError,
    Message,
    Notification,
    Progress,
    Region,
    Welcome,
    is_notification,
    supported_up_to,
)

log = logging.getLogger("kvcr.client")

_LATE_PROGRESS_S = 0.01
"""How often the agent is progressed while only timed-out memory-touching operations (or
transfers under grants, or lingering writes) remain."""
R = TypeVar("R")


def _agent_name(client: str) -> str:
    """A unique NIXL agent name within the protocol's name limit: the client's name cut to fit."""
    suffix = f".{os.getpid()}.{secrets.token_hex(4)}"
    room = DEFAULT_LIMITS.max_name - len(suffix)
    return client.encode()[:room].decode(errors="ignore") + suffix


def _welcome(msg: Message) -> Welcome:
    if not isinstance(msg, Welcome):
        raise ValueError(f"expected welcome, got {msg.TAG}")
    return msg


class ClientCore:
    """Socket, agent and pending requests, shared by caller threads, event loops and one background thread."""

    def __init__(
        self,
        endpoint: str,
        name: str | None = None,
        max_version: int = CURRENT_VERSION,
        context: zmq.Context[Any] | None = None,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        """(server public key, our public key, our secret key), z85, for CurveZMQ nodes."""
        self.name = name or f"kvcr-client-{os.getpid()}"
        self.versions = supported_up_to(max_version)
        self.agent = Agent(_agent_name(self.name))
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.session: ClientSession[Request] = ClientSession(self.versions, endpoint)
        """What the session knows, sans I/O (changed with the I/O lock held)."""
        self.lingering = self.session.lingering
        """Answered operations whose writes may still land with notifications (a key failed
        ``DESTINATION_UNCERTAIN``): a source's notifying WRITE completes only while our agent
        is progressed, so it is, at the late interval, until the client lets them go (lock held)."""
        self.notifications = self.session.notifications
        """NIXL notifications drained from our agent: matched to a pending request, ignored, malformed."""
        self.capacity_events = self.session.capacity_events
        self.transport = Transport(endpoint, self.context, curve)
        self._refused: NodeError | None = None
        """The node refused this socket's handshake (the monitor said so): why its sends fail."""
        self.driver = Driver(self.transport)
        """The I/O lock, the wake pipes, select and the background thread."""
        self.io_lock = self.driver.io_lock
        schedule = Schedule.weak(self.turn, self.busy, self.posting, self.due, self.idle_timeout, self.has_pending)
        self.waiters = Waiters(self.driver, schedule)
        """Who waits: the leader, its followers, the event loops with awaiters."""
        self.loops = LoopReaders(self.driver, self.transport, self.waiters, schedule)
        self._ids = itertools.count(1)
        self.hooks = Hooks()
        """Where the node's capacity and ``lease_end`` events go (the client above sets them)."""
        self._apply = Actions(self.session, self.transport, self.waiters, self.hooks)
        """Carries out the session's events (lock held)."""
        self.reads = Reads(weakly(self.pacing_starts, None))  # the core owns its parts: no cycle back to it
        """Delivers under read grants whose READs the turns post and poll (lock held)."""
        self.driver.start(self._background, f"kvcr-io-{self.name}")

    # ------------------------------------------------------------------ the session's state, read through

    @property
    def closed(self) -> bool:
        return self.driver.closed

    @property
    def connected(self) -> bool:
        return self.session.connected

    @property
    def lost(self) -> bool:
        return self.session.lost

    @property
    def version(self) -> int:
        return self.session.version

    @property
    def welcome(self) -> Welcome | None:
        return self.session.welcome

    def unanswered_s(self) -> float:
        """How long the node has left a heartbeat unanswered (``ClientSession.unanswered_s``);
        read without the lock: a moment's staleness only moves the figure by that moment."""
        return self.session.unanswered_s(time.monotonic())

    def probe(self) -> None:
        """Send a heartbeat now unless one is unanswered (``ClientSession.probe``); never raises."""
        if not self.closed:
            self.call(lambda: self._apply(self.session.probe(time.monotonic())))

    # ------------------------------------------------------------------ caller side

    def call(self, fn: Callable[[], Any], closed: bool = False) -> Future[Any]:
        """Run ``fn`` holding the I/O lock (it may use the socket and the agent); ``closed``:
        even once the client is closed (to let go of what a caller still holds in the agent)."""
        future: Future[Any] = Future()
        if self.closed and not closed:
            future.set_exception(ClientClosed("the client is closed"))
            return future
        with self.io_lock:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
            finally:
                if not self.driver.reading:
                    self._drain_socket()
        return future

    def locked(self, fn: Callable[[], R]) -> R:
        """``fn``'s result, run now holding the I/O lock (``call`` without a future: for the
        caller's own path, where a future's cost shows, as posting a deliver's first group)."""
        if self.closed:
            raise ClientClosed("the client is closed")
        with self.io_lock:
            try:
                return fn()
            finally:
                if not self.driver.reading:
                    self._drain_socket()

    def request(
        self,
        build: Callable[[int], Message],
        convert: Callable[[Message], Any],
        timeout_s: float,
        touches_memory: bool = False,
        op_id: int | None = None,
        on_settled: Callable[[], None] | None = None,
        observer: Callable[[Progress | Notification], None] | None = None,
    ) -> tuple[int, Future[Any]]:
        """Send a request built for ``op_id`` (a fresh id by default); the reply passes through ``convert``.

        ``timeout_s`` is how long to wait for the answer (plus a grace); ``math.inf`` waits
        until the answer or the end of the session. ``on_settled`` runs exactly once
        (with the I/O lock held, so it must be quick and take no other lock than a leaf
        one) when the request can no longer touch client memory: answered, never sent,
        or the session over; for a memory-touching request, not when it merely timed out.
        ``observer`` sees the request's ``progress`` events and notifications (lock held).
        """
        if op_id is None:
            op_id = next(self._ids)
        fut = Request(convert, touches_memory, on_settled, observer)
        if self.closed:
            fut.set_exception(ClientClosed("the client is closed"))
            settle(fut)
            return op_id, fut
        # Every holder keeps the lock only for a short turn: wait for it.
        with self.io_lock:
            self._send_request(op_id, build, timeout_s, fut)
            if not self.driver.reading:  # from a callback inside a read: that read goes on after it
                self._drain_socket()
        waiters = self.waiters
        if waiters.parked and not (waiters.count or waiters.loop_waiting) and self.session.last_sent - waiters.waited_at > _PARK_S:
            # Nobody has waited for a while: this request may never be waited on (callbacks,
            # polling), so the background thread reads its reply.
            waiters.orphan()
        return op_id, fut

    def next_id(self) -> int:
        """A fresh request id (unique in this client)."""
        return next(self._ids)

    def wait(self, future: Future[Any], timeout: float | None) -> Any:
        """Block until ``future`` is done, driving the socket and agent meanwhile (see the module)."""
        if future.done():
            return future.result(0)
        return self.waiters.wait(future, timeout)

    async def wait_async(self, future: Future[Any]) -> Any:
        """Await ``future`` with this event loop reading the socket meanwhile (see the module)."""
        if future.done():
            return future.result(0)
        return await self.loops.wait(future)

    def poll(self) -> None:
        """Read what has arrived and progress the agent once, without blocking.

        For engines that look at their operations once per step (``poll_completed``,
        ``done``) rather than wait on them.
        """
        if self.closed or not self.io_lock.acquire(blocking=False):
            return
        try:
            # Not from inside a read (a done-callback that looks at another handle): that
            # read goes on after the callback, and reading again there would nest dispatches.
            if not self.driver.reading:
                self.turn(MONITOR_READY)
        finally:
            self.io_lock.release()

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Say bye (best effort), stop the background thread and release the socket."""
        if self.closed:
            return
        if self.connected and not self.lost:
            _, fut = self.request(lambda i: Bye(i), lambda m: None, min(timeout, 2.0))
            try:
                self.wait(fut, timeout)
            except Exception:
                log.debug("bye was not acknowledged", exc_info=True)
        self.driver.closed = True
        self.waiters.resume.set()
        self.driver.stop(timeout)
        with self.io_lock:
            self.reads.close()  # no READ left running into our memory
            self._apply(self.session.close())
            self._close_socket()
            self.loops.release_all()
        self.driver.close_pipes()
        # The callbacks name the client above: without them nothing the core holds leads
        # back to it, so a closed client and its NIXL agent go without the cyclic collector.
        self.hooks.on_capacity = self.hooks.on_lease_end = None
        if self._own_context:
            self.context.term()

    def wake(self) -> None:
        """Wake the background thread (and a leading caller) to look at the state again."""
        self.driver.wake()

    # ------------------------------------------------------------------ socket (lock held)

    def open_socket(self) -> None:
        """A fresh DEALER connected to the node, with a disconnect monitor."""
        self._close_socket()
        self._refused = None
        transport = self.transport
        transport.open()
        self.session.reopen()
        self._drain_monitor()  # its descriptor signals only once what is there was read
        self.driver.watch_socket()  # readers select on the new descriptors (woken to)
        self.loops.rewatch()

    def _close_socket(self) -> None:
        self.driver.unwatch_socket()
        self.transport.close()

    def hello(self, regions: tuple[Region, ...], timeout_s: float, resume: bool = False) -> Future[Any]:
        """Open the session: version agreement, our metadata and regions; with ``resume``, the
        previous session's resume token, so that the node ends it at once (spec section 5.2)."""
        with self.io_lock:
            self.open_socket()
            self.driver.start(self._background, f"kvcr-io-{self.name}")  # after a failure, anew
            op_id = self.next_id()
            token = self.session.resume if resume else b""
            hello = Hello(op_id, self.versions, self.name, self.agent.name, self.agent.metadata(), regions, token)
            future = Request(_welcome, False, None)
            self._send_request(op_id, lambda _: hello, timeout_s, future)
            self._drain_socket()
        return future

    def _send_request(self, op_id: int, build: Callable[[int], Message], timeout_s: float, pending: Request) -> None:
        """Lock held: encode and send; a request that is not sent settles at once."""
        session = self.session
        error: Exception | None = None
        frame = b""
        if self.closed:
            error = ClientClosed("the client is closed")
        elif self.transport.sock is None:
            error = NodeLostError(f"not connected to {self.endpoint}; call reconnect()")
        else:
            try:  # the session refuses what its state forbids, or what does not encode
                frame = session.send(
                    op_id, build(op_id), time.monotonic(), timeout_s, pending,
                    pending.touches_memory, pending.on_settled is not None, pending.observer is not None,
                )
            except LocalProtocolError as exc:
                error = translated(exc)
            except (NodeLostError, ClientClosed) as exc:
                error = exc
        if error is not None:
            pending.set_exception(error)
            settle(pending)
            return
        if pending.touches_memory and session.touching == 1:
            self.waiters.pacing_starts()
        if not self.transport.send(frame):
            session.unsent(op_id)
            # A handshake the node refused takes the socket's only pipe with it, so a request
            # sent after it (a hello, under load) finds no pipe: the monitor says why.
            self._drain_monitor()
            pending.set_exception(self._refused or NodeLostError(f"the node at {self.endpoint} is not reachable"))
            settle(pending)

    def has_pending(self) -> bool:
        """Whether requests await the node's answer (safe without the lock)."""
        return bool(self.session.pending)

    def posting(self) -> bool:
        """Whether a deliver under grants has a group to post at the next turn (safe without the lock)."""
        return self.reads.posting

    def busy(self) -> bool:
        """Whether requests that may touch client memory are pending, or a deliver under
        grants is unresolved: whoever reads paces the agent (safe without the lock)."""
        return self.session.touching > 0 or self.reads.live

    def pacing_starts(self) -> None:
        """Lock held: transfers started in a turn (a put's WRITEs): whoever reads paces the agent."""
        self.waiters.pacing_starts()

    def pace(self) -> None:
        """READs under grants were handed to the turns: wake whoever reads to pace from now
        (a parked background thread too, when no caller waits)."""
        self.waiters.pacing_starts()
        self.waiters.resume.set()

    def tables(self) -> dict[str, int]:
        """Sizes of the core's tables: requests pending, timed out awaiting the node, event loops reading."""
        session = self.session
        return {"pending": len(session.pending), "timed_out": len(session.timed_out), "loops": len(self.loops),
                "reads": len(self.reads)}

    def timed_out_ids(self) -> frozenset[int]:
        """Ids of memory-touching requests the client stopped waiting for and the node has not answered."""
        return frozenset(list(self.session.timed_out))

    def turn(self, ready: int = 0) -> None:
        """One turn with the lock held: read what arrived, progress the agent while needed, timers."""
        if ready & MONITOR_READY:
            self._drain_monitor()
        self._drain_socket(ready & SOCKET_READY)
        session = self.session
        if session.touching or session.timed_out or session.lingering:
            # Progress our agent: the node's transfer into or out of our memory
            # completes only when both ends are progressed.
            self._drain_notifications()
        now = time.monotonic()
        if now >= session.nearest or now >= session.next_heartbeat:
            self._apply(session.timeouts(now))
        if self.reads:
            self.reads.step(now)  # post the next group of each, poll the rest (architecture §4)

    def _drain_notifications(self) -> None:
        """Lock held: progress the agent and read each kvcr notification that arrived."""
        for payload in self.agent.progress():
            if is_notification(payload):
                self._notified(payload)

    def _notified(self, payload: bytes) -> None:
        """Lock held: hand a kvcr notification to the session, which names its pending request
        (spec section 6.10). Notifications are hints: a subclass that loses some (a test's)
        must change no outcome, the control messages complete every group."""
        self._apply(self.session.notified(payload))

    def _background(self) -> None:
        """The background thread: it reads while nobody waits (``Waiters.serve``); should it ever
        fail, the session is lost until ``reconnect``."""
        try:
            self.waiters.serve()
        except Exception as exc:  # the background thread must not die silently
            self.waiters.selecting = False
            log.exception("kvcr client background thread failed; the session is lost until reconnect()")
            with self.io_lock:
                # Nobody would read the replies of later requests: refuse them at once
                # (NodeLostError) until reconnect() starts a new thread with a new session.
                self._apply(self.session.lose(NodeLostError(f"the client background thread failed: {exc!r}; call reconnect()")))

    def due(self) -> float:
        """The next time (monotonic) a deadline or the heartbeat needs a turn."""
        session = self.session
        due = session.next_due()
        if session.timed_out or session.lingering or self.reads:
            due = min(due, time.monotonic() + _LATE_PROGRESS_S)  # their transfers need our agent's progress
        return due

    def idle_timeout(self) -> float | None:
        """How long a reader may block in select with nothing in flight (None: until woken)."""
        wait_s = self.due() - time.monotonic()
        if self.session.pending and wait_s > _IDLE_S:
            wait_s = _IDLE_S
        return None if wait_s == math.inf else max(0.0, wait_s)

    def _drain_monitor(self) -> None:
        """Apply what the socket's monitor reported (a refusal is kept for the socket's later sends)."""
        for link in self.transport.monitor_events():
            if link is Link.DISCONNECTED:
                self._apply(self.session.disconnected(f"lost the node at {self.endpoint}"))
            else:
                # The node refused us (CurveZMQ keys, or a plain client at a CURVE node).
                refused = NodeError(ErrorCode.UNAUTHORIZED, f"the node at {self.endpoint} refused the connection handshake")
                self._refused = refused
                self._apply(self.session.fail_all(refused))

    def _drain_socket(self, readable: int = 0) -> None:
        """Read until ZeroMQ reports no input: that re-arms the socket's descriptor.

        ``readable``: select saw the descriptor readable, so a frame is most likely in:
        receive at once (a receive looks at ZeroMQ's commands itself) and ask after it.
        """
        sock = self.transport.sock
        if sock is None:
            return
        driver = self.driver
        driver.reading += 1
        try:
            if readable:
                try:
                    frame = sock.recv(_NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    self._apply(self.session.receive(frame, time.monotonic()))
            while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                self._apply(self.session.receive(sock.recv(_NOBLOCK), time.monotonic()))
        finally:
            driver.reading -= 1

