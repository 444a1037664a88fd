"""The client core: the DEALER socket, the NIXL agent and the pending requests.

Whoever holds the core's I/O lock owns the socket and the agent. A caller that sends a
request takes the lock and sends from its own thread; a caller that blocks on a result
drives the socket itself until its reply is in, so a round trip costs no thread hand-off.
A background thread takes the lock whenever no caller holds it: it delivers replies
that nobody is waiting on (asyncio awaiters, callbacks), and, while any operation that
may touch client memory is pending, progresses the NIXL agent at a short interval: both
ends of a NIXL transfer need progress (architecture §6). Idle, it blocks in ``select`` on the
socket's file descriptor and costs nothing. While callers drive (and for a few
milliseconds after, when they usually drive again) it parks off that descriptor, so a
reply wakes only the thread that waits for it; a request left with nobody driving it
resumes the background thread at once when its caller stops driving, and otherwise
within those few milliseconds. ``poll`` reads without blocking, for engines that look
at their operations once per step.

Rule for every lock holder: before releasing the lock, drain the socket until ZeroMQ
reports no more input, so the edge-triggered socket descriptor re-arms.

The pending table changes only with the lock held. The background thread looks at it
between turns without the lock, so it never walks it there: it reads a count of
memory-touching requests and the nearest deadline, both kept up to date where the table
changes.

A request that may touch client memory and gets no answer within its deadline (plus a
grace) fails for its waiter with ``OperationTimeout``, but the node may still be moving
its bytes: it is kept as a timed-out record, and its ``on_settled`` callback (which lets
go of the regions it names) runs only when the node's late answer arrives or the session
is over (spec section 5.1). The session is over for the client when it closes, or when
it declares the node lost (disconnected, or silent for three heartbeat intervals; spec
section 14 says what that leaves open).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcr_client.errors import ClientClosed, NodeError, NodeLostError, OperationTimeout
from kvcr_io.agent import Agent
from kvcr_io.pacing import Pacer
from kvcr_io.wake import WakePipe
from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_protocol import (
    CURRENT_VERSION,
    DEFAULT_LIMITS,
    Bye,
    CapacityEvent,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    LocalProtocolError,
    Message,
    Notification,
    Progress,
    ProtocolError,
    Region,
    RemoteProtocolError,
    Welcome,
    decode,
    decode_notification,
    encode,
    is_notification,
    supported_up_to,
)

log = logging.getLogger("kvcr.client")

_IDLE_S = 0.2
"""The longest the idle background thread blocks before it looks at deadlines again."""
_LATE_PROGRESS_S = 0.01
"""How often the agent is progressed while only timed-out memory-touching operations remain."""
_PARK_S = 0.005
"""How long the background thread stays off the socket after a caller stopped driving."""
_DRIVE_SLICE_S = 0.05
"""A waiting caller polls the socket at most this long per turn before it looks at its future again."""
_LOCK_WAIT_S = 0.0005
"""A caller waits this long for the I/O lock (held only for short turns) before it hands its
send to the driver that holds the lock, or looks at its future again."""
_BACKGROUND_LOCK_WAIT_S = 0.001
"""The background thread waits this long for the I/O lock before it looks again."""
_POLL_MIN_S = 0.001
"""Waits shorter than this use ``select`` on the descriptors (ZeroMQ's poll counts whole ms)."""
_CLOSE_TIMEOUT_S = 5.0
"""How long ``close`` waits for the node to acknowledge ``bye`` and for the thread to end."""
_GRACE_S = 2.0
"""How long after an operation's deadline the client still waits for the node's answer."""


def _agent_name(client: str) -> str:
    """A unique NIXL agent name within the protocol's name limit: the client's name cut to fit."""
    suffix = f".{os.getpid()}.{secrets.token_hex(4)}"
    room = DEFAULT_LIMITS.max_name - len(suffix)
    return client.encode()[:room].decode(errors="ignore") + suffix


@dataclass
class _Pending:
    future: Future[Any]
    deadline: float
    """When the client stops waiting (monotonic); infinite for a deadline left to the node."""
    touches_memory: bool
    convert: Callable[[Message], Any]
    on_settled: Callable[[], None] | None = None
    """Called once, lock held, when the node can no longer touch memory for this request."""
    observer: Callable[[Progress | Notification], None] | None = None
    """Called, lock held, with each ``progress`` event and each NIXL notification for this
    request while it is pending (spec sections 6.8 and 6.10)."""


class ClientCore:
    """Socket, agent and pending requests, shared by caller threads and one background thread."""

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
        self._io = threading.RLock()
        self._drivers = 0
        self._drivers_lock = threading.Lock()
        self._drive_end = 0.0
        """When the last caller stopped driving (monotonic)."""
        self._resume = threading.Event()
        """Wakes a parked background thread: requests are left with no caller driving them."""
        self._selecting = False
        """Whether the background thread is (about to be) in select on the socket's descriptor."""
        self._reading = 0
        """How deep the lock holder is in reading replies (read and written with the lock held)."""
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._fds: tuple[int, ...] = ()
        self._poller = zmq.Poller()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._touching = 0
        """Pending requests that may touch client memory (changed with the lock held, read without)."""
        self._nearest = math.inf
        """No pending deadline is earlier (monotonic; may be early, never late; changed with the lock held)."""
        self._timed_out: dict[int, _Pending] = {}
        self.lingering: set[int] = set()
        """Answered operations whose writes may still land with notifications (a key failed
        ``DESTINATION_UNCERTAIN``): a source's notifying WRITE completes only while our agent
        is progressed, so it is, at the late interval, until the client lets them go (lock held)."""
        """Memory-touching requests the client stopped waiting for, until the node answers (lock held)."""
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wakeup = WakePipe()
        self._closed = False
        self.connected = False
        self.lost = False
        self.version = 0
        self.welcome: Welcome | None = None
        self._last_sent = 0.0
        self._last_heard = 0.0
        self._heartbeats = 0
        self.notifications: collections.Counter[str] = collections.Counter()
        """NIXL notifications drained from our agent: matched to a pending request, ignored, dropped."""
        self.drop_notifications = False
        """Test hook: drop every notification unread, as if none had come (spec section 6.10:
        the control messages alone must then complete every group)."""
        self.capacity_events: collections.deque[CapacityEvent] = collections.deque(maxlen=1024)
        self.on_capacity: Callable[[CapacityEvent], None] | None = None
        self._thread = threading.Thread(target=self._background, name=f"kvcr-io-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` holding the I/O lock (it may use the socket and the agent)."""
        future: Future[Any] = Future()
        if self._closed:
            future.set_exception(ClientClosed("the client is closed"))
            return future
        with self._io:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
            finally:
                self._drain_socket()
        return future

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
            op_id = self.next_id()
        fut: Future[Any] = Future()
        if self._closed:
            fut.set_exception(ClientClosed("the client is closed"))
            if on_settled is not None:
                on_settled()
            return op_id, fut
        pending = _Pending(fut, math.inf, touches_memory, convert, on_settled, observer)
        oid = op_id

        def send() -> None:
            self._send_request(oid, build, timeout_s, pending)

        # The background thread holds the lock only for short turns: wait a moment for it.
        if self._io.acquire(timeout=_LOCK_WAIT_S):
            try:
                send()
                self._drain_socket()
            finally:
                self._io.release()
        else:
            # A driver holds the socket in a poll: hand it the send (it polls our wake pipe).
            self._commands.append(send)
            self._wake()
        return op_id, fut

    def next_id(self) -> int:
        """A fresh request id (unique in this client)."""
        return next(self._ids)

    def wait(self, future: Future[Any], timeout: float | None) -> Any:
        """Block until ``future`` is done, driving the socket and agent meanwhile."""
        if future.done():
            return future.result(0)
        with self._drivers_lock:
            self._drivers += 1
        if self._selecting:
            # Move the background thread off the socket's descriptor while we drive.
            self._wake()
        try:
            return self._drive(future, timeout)
        finally:
            with self._drivers_lock:
                self._drivers -= 1
                if not self._drivers:
                    self._drive_end = time.monotonic()
                    if self._pending:
                        self._resume.set()  # nobody drives what is left: the background thread does

    def poll(self) -> None:
        """Read what has arrived and progress the agent once, without blocking.

        For engines that look at their operations once per step (``poll_completed``,
        ``done``) rather than wait on them.
        """
        if self._closed or not self._io.acquire(blocking=False):
            return
        try:
            # Not from inside a read (a done-callback that looks at another handle): that
            # read goes on after the callback, and reading again there would nest dispatches.
            if not self._reading:
                self._turn(0)
        finally:
            self._io.release()

    def _drive(self, future: Future[Any], timeout: float | None) -> Any:
        end = None if timeout is None else time.monotonic() + timeout
        pacer = Pacer()
        while not future.done():
            remaining = _DRIVE_SLICE_S if end is None else end - time.monotonic()
            if remaining <= 0:
                raise FutureTimeout()
            if self._closed:
                return future.result(remaining)
            # The lock is held only for short turns (or by another driver, who may well
            # complete our future): wait for it briefly, then look at the future again.
            if not self._io.acquire(timeout=min(remaining, _LOCK_WAIT_S)):
                continue
            try:
                if future.done():
                    break
                if self._busy():
                    self._turn(min(remaining, pacer.next()))
                else:
                    pacer.reset()
                    self._turn(min(remaining, _DRIVE_SLICE_S))
            finally:
                self._io.release()
        return future.result(0)

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Say bye (best effort), stop the background thread and release the socket."""
        if self._closed:
            return
        if self.connected and not self.lost:
            _, fut = self.request(lambda i: Bye(i), lambda m: None, min(timeout, 2.0))
            try:
                self.wait(fut, timeout)
            except Exception:
                log.debug("bye was not acknowledged", exc_info=True)
        self._closed = True
        self._wake()
        self._resume.set()
        self._thread.join(timeout)
        with self._io:
            self._fail_all(ClientClosed("the client is closed"))
            while self._commands:
                self._commands.popleft()()
            self._close_socket()
        self._wakeup.close()
        if self._own_context:
            self.context.term()

    def _wake(self) -> None:
        self._wakeup.wake()

    # ------------------------------------------------------------------ socket (lock held)

    def open_socket(self) -> None:
        """A fresh DEALER connected to the node, with a disconnect monitor."""
        self._close_socket()
        sock: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            server, public, secret = self.curve
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        sock.connect(self.endpoint)
        self._sock = sock
        self._fds = (int(sock.getsockopt(zmq.FD)), int(self._monitor.getsockopt(zmq.FD)))
        self._poller = zmq.Poller()
        for item in (sock, self._monitor, self._wakeup.read_fd):
            self._poller.register(item, zmq.POLLIN)
        self.lost = False
        self._wake()  # the background thread must select on the new descriptors

    def _close_socket(self) -> None:
        self._fds = ()
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close(0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None

    def hello(self, regions: tuple[Region, ...], timeout_s: float) -> Future[Any]:
        """Open the session: version agreement, our metadata and regions."""
        future: Future[Any] = Future()

        def on_welcome(msg: Message) -> Welcome:
            if not isinstance(msg, Welcome):
                raise ValueError(f"expected welcome, got {msg.TAG}")
            self.version = msg.version
            self.welcome = msg
            self.connected = True
            self._last_heard = time.monotonic()
            return msg

        with self._io:
            self.open_socket()
            if not self._thread.is_alive() and not self._closed:
                self._thread = threading.Thread(target=self._background, name=f"kvcr-io-{self.name}", daemon=True)
                self._thread.start()
            op_id = self.next_id()
            hello = Hello(op_id, self.versions, self.name, self.agent.name, self.agent.metadata(), regions)
            self._send_request(op_id, lambda _: hello, timeout_s, _Pending(future, math.inf, False, on_welcome))
            self._drain_socket()
        return future

    def _send_request(self, op_id: int, build: Callable[[int], Message], timeout_s: float, pending: _Pending) -> None:
        """Lock held: encode and send; a request that is not sent settles at once."""
        fut = pending.future
        sock = self._sock
        error: Exception | None = None
        frame = b""
        if not fut.set_running_or_notify_cancel():
            self._settle(pending)
            return
        if self._closed:
            error = ClientClosed("the client is closed")
        elif sock is None or self.lost:
            error = NodeLostError(f"not connected to {self.endpoint}; call reconnect()")
        else:
            try:
                frame = encode(build(op_id), self.version or self.versions[0])
            except LocalProtocolError as exc:
                error = exc
        if error is not None or sock is None:
            fut.set_exception(error or NodeLostError(f"not connected to {self.endpoint}"))
            self._settle(pending)
            return
        pending.deadline = time.monotonic() + timeout_s + _GRACE_S
        self._add_pending(op_id, pending)
        try:
            sock.send(frame, _NOBLOCK)
            self._last_sent = time.monotonic()
        except zmq.Again:
            self._pop_pending(op_id)
            fut.set_exception(NodeLostError(f"the node at {self.endpoint} is not reachable"))
            self._settle(pending)

    @staticmethod
    def _settle(pending: _Pending) -> None:
        """The node can no longer touch memory for this request: run its callback, once."""
        callback, pending.on_settled = pending.on_settled, None
        if callback is not None:
            try:
                callback()
            except Exception:
                log.exception("a settle callback failed")

    def _add_pending(self, op_id: int, pending: _Pending) -> None:
        """Lock held: the one place requests enter the pending table."""
        self._pending[op_id] = pending
        if pending.touches_memory:
            self._touching += 1
        self._nearest = min(self._nearest, pending.deadline)

    def _pop_pending(self, op_id: int) -> _Pending | None:
        """Lock held: the one place a request leaves the pending table (``_fail_all`` empties it)."""
        pending = self._pending.pop(op_id, None)
        if pending is not None and pending.touches_memory:
            self._touching -= 1
        return pending

    def _busy(self) -> bool:
        """Whether requests that may touch client memory are pending (safe without the lock)."""
        return self._touching > 0

    def tables(self) -> dict[str, int]:
        """Sizes of the core's tables: requests pending, timed out awaiting the node, handed to a driver."""
        return {"pending": len(self._pending), "timed_out": len(self._timed_out), "commands": len(self._commands)}

    def timed_out_ids(self) -> frozenset[int]:
        """Ids of memory-touching requests the client stopped waiting for and the node has not answered."""
        return frozenset(list(self._timed_out))

    def _turn(self, timeout_s: float) -> None:
        """One turn with the lock held: commands, wait up to ``timeout_s``, drain, progress, expire."""
        while self._commands:
            self._commands.popleft()()
        if timeout_s > 0 and self._sock is not None:
            self._drain_socket()  # the descriptors below only signal new input once drained
            if timeout_s >= _POLL_MIN_S:
                ready = dict(self._poller.poll(int(timeout_s * 1000)))
                woken = self._wakeup.read_fd in ready
            else:
                readable, _, _ = select.select((*self._fds, self._wakeup.read_fd), (), (), timeout_s)
                woken = self._wakeup.read_fd in readable
            if woken:
                self._wakeup.drain()
            while self._commands:
                self._commands.popleft()()
        self._drain_monitor()
        self._drain_socket()
        if self._busy() or self._timed_out or self.lingering:
            # Progress our agent: the node's transfer into or out of our memory
            # completes only when both ends are progressed.
            self._drain_notifications()
        self._expire()
        self._heartbeat()

    def _drain_notifications(self) -> None:
        """Lock held: progress the agent and hand each kvcr notification that arrived to the
        pending request it names (spec section 6.10); others are counted and left alone."""
        for payload in self.agent.progress():
            if not is_notification(payload):
                continue
            if self.drop_notifications:
                self.notifications["dropped"] += 1
                continue
            try:
                note = decode_notification(payload)
            except RemoteProtocolError:
                self.notifications["malformed"] += 1
                continue
            pending = self._pending.get(note.request)
            if pending is None or pending.observer is None:
                self.notifications["ignored"] += 1
                continue
            self.notifications["matched"] += 1
            pending.observer(note)

    def _heartbeat_s(self) -> float:
        welcome = self.welcome
        return welcome.heartbeat_ms / 1000 if welcome is not None and welcome.heartbeat_ms else 0.0

    def _heartbeat(self) -> None:
        """Say we are alive when idle; a node silent for three intervals is lost."""
        interval = self._heartbeat_s()
        if not interval or not self.connected or self._sock is None:
            return
        now = time.monotonic()
        if now - self._last_heard > 3 * interval + 1.0:
            self.lost = True
            self.connected = False
            self._fail_all(NodeLostError(f"the node at {self.endpoint} has been silent for {now - self._last_heard:.1f} s"))
            return
        if now - self._last_sent >= interval:
            try:
                self._heartbeats += 1
                self._sock.send(encode(Heartbeat(self._heartbeats), self.version), _NOBLOCK)
            except zmq.Again:
                return
            self._last_sent = now

    def _background(self) -> None:
        pacer = Pacer()
        try:
            while not self._closed:
                self._resume.clear()
                if self._drivers or (not self._pending and time.monotonic() - self._drive_end < _PARK_S):
                    # Callers are driving the socket (or did a moment ago, and will
                    # again): park off its descriptor, so replies wake only the caller
                    # that waits for them; a second thread woken per reply costs a GIL
                    # hand-off on every round trip.
                    self._resume.wait(_PARK_S)
                    continue
                if self._busy():
                    timeout = pacer.next()
                else:
                    pacer.reset()
                    timeout = self._idle_timeout()
                fds = (*self._fds, self._wakeup.read_fd)
                self._selecting = True
                if self._drivers:  # a caller began driving meanwhile (see wait)
                    self._selecting = False
                    continue
                try:
                    readable, _, _ = select.select(fds, (), (), timeout)
                except (OSError, ValueError):  # a descriptor closed under us: re-read them
                    readable = []
                self._selecting = False
                if self._wakeup.read_fd in readable:
                    self._wakeup.drain()
                if self._closed:
                    break
                if self._drivers:
                    continue  # a caller is driving the socket (and the agent): park above
                if not self._io.acquire(timeout=_BACKGROUND_LOCK_WAIT_S):
                    continue
                try:
                    self._turn(0)
                finally:
                    self._io.release()
        except Exception as exc:  # the background thread must not die silently
            log.exception("kvcr client background thread failed; the session is lost until reconnect()")
            with self._io:
                # Nobody would read the replies of later requests: refuse them at once
                # (NodeLostError) until reconnect() starts a new thread with a new session.
                self.lost = True
                self.connected = False
                self._fail_all(NodeLostError(f"the client background thread failed: {exc!r}; call reconnect()"))

    def _idle_timeout(self) -> float:
        # Their transfers need our agent's progress.
        late = _LATE_PROGRESS_S if self._timed_out or self.lingering else math.inf
        interval = self._heartbeat_s()
        if interval and self.connected:
            return min(interval / 2, _IDLE_S, late) if self._pending else min(interval / 2, late)
        if not self._pending:
            return min(_IDLE_S, late)
        return max(0.0, min(_IDLE_S, late, self._nearest - time.monotonic()))

    def _drain_monitor(self) -> None:
        if self._monitor is None:
            return
        while cast(int, self._monitor.getsockopt(_EVENTS)) & _POLLIN:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost = True
                self.connected = False
                self._fail_all(NodeLostError(f"lost the node at {self.endpoint}"))
            elif event["event"] in (
                zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            ):
                # The node refused us (CurveZMQ keys, or a plain client at a CURVE node).
                self._fail_all(NodeError(ErrorCode.UNAUTHORIZED, f"the node at {self.endpoint} refused the connection handshake"))

    def _drain_socket(self) -> None:
        sock = self._sock
        if sock is None:
            return
        # Read until ZeroMQ reports no input: that re-arms the socket's descriptor.
        self._reading += 1
        try:
            while cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                frame = sock.recv(_NOBLOCK)
                self._last_heard = time.monotonic()
                try:
                    msg = decode(frame, self.version or self.versions[-1])
                except RemoteProtocolError as exc:
                    log.warning("undecodable frame from the node: %s", exc)
                    continue
                self._dispatch(msg)
        finally:
            self._reading -= 1

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, CapacityEvent):
            self.capacity_events.append(msg)
            if self.on_capacity is not None:
                try:
                    self.on_capacity(msg)
                except Exception:
                    log.exception("capacity callback failed")
            return
        if isinstance(msg, Heartbeat):
            return  # its id counts heartbeats, not requests
        if isinstance(msg, Progress):
            # Not a reply: the request goes on (spec section 5.1).
            observed = self._pending.get(msg.id)
            if observed is not None and observed.observer is not None:
                observed.observer(msg)
            return
        op_id = getattr(msg, "id", 0)
        pending = self._pop_pending(op_id)
        if pending is None:
            late = self._timed_out.pop(op_id, None)
            if late is not None:
                # The answer the client stopped waiting for: the node is done with our memory.
                log.debug("late %s for timed-out operation %d", msg.TAG, op_id)
                self._settle(late)
            else:
                log.debug("reply for no pending request: %s", msg.TAG)
            return
        self._settle(pending)
        if isinstance(msg, Error):
            pending.future.set_exception(NodeError(msg.code, msg.reason, msg.path))
            return
        try:
            result = pending.convert(msg)
        except Exception as exc:  # a reply of the wrong type or shape fails that request only
            pending.future.set_exception(
                exc if isinstance(exc, ProtocolError) else NodeError(ErrorCode.WRONG_TYPE, f"unexpected reply {msg.TAG}: {exc!r}")
            )
            return
        pending.future.set_result(result)

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._nearest:
            return
        for op_id in [i for i, p in self._pending.items() if p.deadline <= now]:
            pending = self._pop_pending(op_id)
            assert pending is not None
            if pending.touches_memory and pending.on_settled is not None:
                # The node may still move its bytes: keep holding its memory until it answers.
                self._timed_out[op_id] = pending
            else:
                self._settle(pending)
            pending.future.set_exception(
                OperationTimeout(f"operation {op_id}: no answer from {self.endpoint} within its deadline")
            )
        self._nearest = min((p.deadline for p in self._pending.values()), default=math.inf)

    def _fail_all(self, exc: Exception) -> None:
        """The session is over (closed, or the node lost): every request fails and settles."""
        pending, self._pending = self._pending, {}
        late, self._timed_out = self._timed_out, {}
        self.lingering.clear()
        self._touching = 0
        self._nearest = math.inf
        for p in late.values():
            self._settle(p)
        for p in pending.values():
            self._settle(p)
            if not p.future.done():
                p.future.set_exception(exc)
