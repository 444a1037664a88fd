"""The client core: the DEALER socket, the NIXL agent and the pending requests.

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

import asyncio
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
    LeaseEnded,
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
"""While requests are pending, the longest a waiter or the background thread blocks before it
looks at deadlines and heartbeats again."""
_LATE_PROGRESS_S = 0.01
"""How often the agent is progressed while only timed-out memory-touching operations remain."""
_PARK_S = 0.005
"""How long the background thread stays off the socket after callers stopped waiting (and an
event loop keeps watching it after its last awaiter)."""
_PARK_MAX_S = 0.02
"""Its longest park while callers keep waiting: each park that finds them still at it doubles. A
request sent within ``_PARK_S`` of a caller's wait that nobody waits on is read within this."""
_CLOSE_TIMEOUT_S = 5.0
"""How long ``close`` waits for the node to acknowledge ``bye`` and for the thread to end."""
_GRACE_S = 2.0
"""How long after an operation's deadline the client still waits for the node's answer."""
_QUEUE_MESSAGES = 1 << 17
"""Frames ZeroMQ may queue each way between the client and its node (its high-water marks):
thousands of small requests in flight must queue here, not fail, while the node reads them
a batch at a time, and their replies must find room even when the caller reads them late."""
_SILENCE_SLACK_S = 1.0
"""Beyond three heartbeat intervals of silence, how much longer before the node counts as lost."""
_SOCKET_READY = 1
_MONITOR_READY = 2
"""What ``select`` found readable: the socket's descriptor, the monitor's."""
_RUNNING = "RUNNING"
_FINISHED = "FINISHED"
_SETTLED = frozenset({"CANCELLED", "CANCELLED_AND_NOTIFIED", _FINISHED})
"""``concurrent.futures.Future``'s state names."""


def _agent_name(client: str) -> str:
    """A unique NIXL agent name within the protocol's name limit: the client's name cut to fit."""
    suffix = f".{os.getpid()}.{secrets.token_hex(4)}"
    room = DEFAULT_LIMITS.max_name - len(suffix)
    return client.encode()[:room].decode(errors="ignore") + suffix


class _Request(Future[Any]):
    """A request's future, carrying what the pending table keeps for it.

    It runs from the moment it is made (``cancel`` refuses it: abort the operation instead).
    ``done`` and the result of a finished request are read without the future's lock: its
    state only moves forward, and a finished future never changes again.
    """

    def __init__(
        self,
        convert: Callable[[Message], Any],
        touches_memory: bool,
        on_settled: Callable[[], None] | None,
        observer: Callable[[Progress | Notification], None] | None = None,
    ) -> None:
        super().__init__()
        self._state = _RUNNING  # nobody else holds it yet: no lock needed
        self.convert = convert
        self.touches_memory = touches_memory
        self.on_settled = on_settled
        """Called once, lock held, when the node can no longer touch memory for this request."""
        self.deadline = math.inf
        """When the client stops waiting (monotonic); infinite for a deadline left to the node."""
        self.observer = observer
        """Called, lock held, with each ``progress`` event and each NIXL notification for this
        request while it is pending (spec sections 6.8 and 6.10)."""

    def done(self) -> bool:
        return self._state in _SETTLED

    def result(self, timeout: float | None = None) -> Any:
        if self._state == _FINISHED and self._exception is None:
            return self._result
        return super().result(timeout)


class _Follower:
    """A caller that waits while another leads: asleep until its result is in or it may lead."""

    __slots__ = ("event", "future")

    def __init__(self, future: Future[Any]) -> None:
        self.future = future
        self.event = threading.Event()

    def wake(self, _: object = None) -> None:
        self.event.set()


class _LoopReader:
    """An event loop that reads the socket for its awaiters.

    It watches duplicates of the socket's and the monitor's descriptors: they stay ours until
    the loop lets go of them, so a socket closed or reopened meanwhile never leaves the loop
    watching a number that now names something else.
    """

    __slots__ = ("awaiters", "fds", "generation", "idle_since", "loop", "release_due", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, generation: int, fds: tuple[int, ...]) -> None:
        self.loop = loop
        self.thread = threading.get_ident()
        self.generation = generation
        self.fds = fds
        self.awaiters = 0
        self.idle_since = 0.0
        """When its last awaiter ended (monotonic)."""
        self.release_due = False
        """Whether a timer will look whether the loop may let go of the socket."""


def _copy_outcome(source: Future[Any], target: asyncio.Future[Any]) -> None:
    """Resolve an asyncio future like a finished concurrent one (in the loop's thread)."""
    if target.done():
        return  # the awaiter was cancelled
    if source.cancelled():
        target.cancel()
        return
    exc = source.exception(0)
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result(0))


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
        self._io = threading.RLock()
        self._state = threading.Lock()
        """Guards who waits: the leader, the followers, the counts below (a leaf lock)."""
        self._waiters = 0
        """Callers blocked in ``wait`` (the leader and its followers)."""
        self._leading = False
        self._leader_future: Future[Any] | None = None
        self._leader_thread = 0
        self._followers: collections.deque[_Follower] = collections.deque()
        self._loops: dict[asyncio.AbstractEventLoop, _LoopReader] = {}
        self._loop_waiting = 0
        """Event loops with awaiters (they read the socket themselves)."""
        self._waited_at = 0.0
        """When the last caller stopped waiting (monotonic)."""
        self._resume = threading.Event()
        """Wakes a parked background thread: requests are left with nobody waiting for them."""
        self._orphaned = False
        """Requests are pending that nobody waits for: the background thread reads them now."""
        self._parked = False
        self._selecting = False
        """Whether the background thread is (about to be) in select on the socket's descriptor."""
        self._reading = 0
        """How deep the lock holder is in reading replies (read and written with the lock held)."""
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._fds: tuple[int, ...] = ()
        self._generation = 0
        """Counts the sockets opened: an event loop's descriptors belong to one of them."""
        self._wakeup = WakePipe()
        """Wakes a leading caller (its result came in on another thread, pacing starts, close)."""
        self._bg_wakeup = WakePipe()
        """Wakes the background thread (callers began waiting, a new socket, close)."""
        self._monitor_fd = -1
        self._watch: tuple[int, ...] = (self._wakeup.read_fd,)
        self._bg_watch: tuple[int, ...] = (self._bg_wakeup.read_fd,)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Request] = {}
        self._touching = 0
        """Pending requests that may touch client memory (changed with the lock held, read without)."""
        self._nearest = math.inf
        """No pending deadline is earlier (monotonic; may be early, never late; changed with the lock held)."""
        self._timed_out: dict[int, _Request] = {}
        """Memory-touching requests the client stopped waiting for, until the node answers (lock held)."""
        self.lingering: set[int] = set()
        """Answered operations whose writes may still land with notifications (a key failed
        ``DESTINATION_UNCERTAIN``): a source's notifying WRITE completes only while our agent
        is progressed, so it is, at the late interval, until the client lets them go (lock held)."""
        self._closed = False
        self.connected = False
        self.lost = False
        self.version = 0
        self.welcome: Welcome | None = None
        self._last_sent = 0.0
        self._last_heard = 0.0
        self._next_heartbeat = math.inf
        """When the heartbeat and the node's silence are next looked at (monotonic)."""
        self._heartbeats = 0
        self.notifications: collections.Counter[str] = collections.Counter()
        """NIXL notifications drained from our agent: matched to a pending request, ignored, malformed."""
        self.capacity_events: collections.deque[CapacityEvent] = collections.deque(maxlen=1024)
        self.on_capacity: Callable[[CapacityEvent], None] | None = None
        self.on_lease_end: Callable[[LeaseEnded], None] | None = None
        """Takes the node's ``lease_end`` events (lock held)."""
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
                if not self._reading:
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
            op_id = next(self._ids)
        fut = _Request(convert, touches_memory, on_settled, observer)
        if self._closed:
            fut.set_exception(ClientClosed("the client is closed"))
            self._settle(fut)
            return op_id, fut
        # Every holder keeps the lock only for a short turn: wait for it.
        with self._io:
            self._send_request(op_id, build, timeout_s, fut)
            if not self._reading:  # from a callback inside a read: that read goes on after it
                self._drain_socket()
        if self._parked and not (self._waiters or self._loop_waiting) and self._last_sent - self._waited_at > _PARK_S:
            # Nobody has waited for a while: this request may never be waited on (callbacks,
            # polling), so the background thread reads its reply.
            self._orphan()
        return op_id, fut

    def next_id(self) -> int:
        """A fresh request id (unique in this client)."""
        return next(self._ids)

    def wait(self, future: Future[Any], timeout: float | None) -> Any:
        """Block until ``future`` is done, driving the socket and agent meanwhile (see the module)."""
        if future.done():
            return future.result(0)
        end = None if timeout is None else time.monotonic() + timeout
        if self._reading and self._io._is_owned():  # type: ignore[attr-defined]
            return self._drive_nested(future, end)  # from a callback inside our own read
        follower = None
        with self._state:
            self._waiters += 1
            self._orphaned = False
            if self._leading:
                follower = _Follower(future)
                self._followers.append(follower)
            else:
                self._leading = True
                self._leader_future = future
                self._leader_thread = threading.get_ident()
            selecting = self._selecting
        if selecting:
            self._bg_wakeup.wake()  # move the background thread off the socket's descriptor
        leading = follower is None
        try:
            if follower is not None:
                leading = self._follow(follower, end)
            if leading:
                self._lead(future, end)
            return future.result(0)
        finally:
            self._stop_waiting(follower, leading)

    def _lead_as(self, future: Future[Any]) -> None:
        """State lock held: the calling thread leads until ``future`` is done."""
        self._leading = True
        self._leader_future = future
        self._leader_thread = threading.get_ident()

    def _follow(self, follower: _Follower, end: float | None) -> bool:
        """Sleep until our result is in (False) or nobody leads and we do (True)."""
        future, event = follower.future, follower.event
        future.add_done_callback(follower.wake)
        while not future.done():
            with self._state:
                if not self._leading:
                    self._followers.remove(follower)
                    self._lead_as(future)
                    return True
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise FutureTimeout()
            event.wait(remaining)
            event.clear()  # whatever woke us is looked at again above
        return False

    def _stop_waiting(self, follower: _Follower | None, leading: bool) -> None:
        """A caller stops waiting: a leader hands over to a follower; the last one leaves the rest to the background."""
        with self._state:
            self._waiters -= 1
            if leading:
                self._leading = False
                self._leader_future = None
            elif follower is not None and follower in self._followers:
                self._followers.remove(follower)
            successor = self._followers[0] if self._followers and not self._leading else None
            alone = not self._waiters and not self._loop_waiting
            if alone:
                self._waited_at = time.monotonic()
        if successor is not None:
            successor.wake()
        if alone and self._pending:
            self._orphan()  # nobody waits for what is left: the background thread reads it

    def _orphan(self) -> None:
        """Requests are left that nobody waits for: the background thread reads them from now on."""
        self._orphaned = True
        self._resume.set()

    def _lead(self, future: Future[Any], end: float | None) -> None:
        """Select on the socket without the lock, then take a turn with it, until ``future`` is done."""
        pacer: Pacer | None = None
        while not future.done():
            if self._closed:
                # close() fails every pending request once the background thread has ended.
                future.exception(_CLOSE_TIMEOUT_S if end is None else max(0.0, end - time.monotonic()))
                return
            now = time.monotonic()
            if end is not None and now >= end:
                raise FutureTimeout()
            wait_s: float | None
            if self._touching:
                pacer = pacer or Pacer()
                wait_s = pacer.next()
            else:
                if pacer is not None:
                    pacer.reset()
                # Until the next deadline or heartbeat (``_idle_timeout``, inline: once per reply).
                due = self._nearest if self._nearest < self._next_heartbeat else self._next_heartbeat
                if self._timed_out:
                    due = min(due, now + _LATE_PROGRESS_S)
                wait_s = None if due == math.inf else min(max(0.0, due - now), _IDLE_S if self._pending else math.inf)
            if end is not None and (wait_s is None or end - now < wait_s):
                wait_s = end - now
            ready = self._select(self._watch, wait_s, self._wakeup)
            with self._io:
                self._turn(ready)

    def _drive_nested(self, future: Future[Any], end: float | None) -> Any:
        """Wait from a callback that runs inside this thread's read (lock held): read on, nested."""
        while not future.done():
            now = time.monotonic()
            if end is not None and now >= end:
                raise FutureTimeout()
            wait_s = _IDLE_S if end is None else min(_IDLE_S, end - now)
            self._turn(self._select(self._watch, wait_s, self._wakeup))
        return future.result(0)

    async def wait_async(self, future: Future[Any]) -> Any:
        """Await ``future`` with this event loop reading the socket meanwhile (see the module)."""
        if future.done():
            return future.result(0)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        thread = threading.get_ident()

        def resolved(done: Future[Any]) -> None:
            if threading.get_ident() == thread:
                _copy_outcome(done, waiter)  # read by this loop: no hand-off
                return
            try:
                loop.call_soon_threadsafe(_copy_outcome, done, waiter)
            except RuntimeError:
                pass  # the loop is closed: nobody awaits any more

        future.add_done_callback(resolved)
        reader = self._attach_loop(loop)
        try:
            return await waiter
        finally:
            if reader is not None:
                self._detach_loop(reader)

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
                self._turn(_MONITOR_READY)
        finally:
            self._io.release()

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
        self._wakeup.wake()
        self._bg_wakeup.wake()
        self._resume.set()
        self._thread.join(timeout)
        with self._io:
            self._fail_all(ClientClosed("the client is closed"))
            self._close_socket()
            for reader in list(self._loops.values()):
                self._release_reader(reader)
        self._wakeup.close()
        self._bg_wakeup.close()
        if self._own_context:
            self.context.term()

    def _wake(self) -> None:
        """Wake the background thread (and a leading caller) to look at the state again."""
        self._bg_wakeup.wake()
        self._wakeup.wake()

    # ------------------------------------------------------------------ event loops

    def _attach_loop(self, loop: asyncio.AbstractEventLoop) -> _LoopReader | None:
        """An awaiter of ``loop`` begins: the loop watches the current socket (None: no socket)."""
        reader = self._loops.get(loop)
        if reader is None or reader.generation != self._generation:
            with self._io:
                reader = self._watch_from(loop, reader)
            if reader is None:
                return None
        reader.awaiters += 1
        if reader.awaiters == 1:
            with self._state:
                self._loop_waiting += 1
                self._orphaned = False
            if self._touching:
                self._resume.set()  # the loop cannot pace the agent: the background thread does
            elif self._selecting:
                self._bg_wakeup.wake()  # move the background thread off the socket: the loop reads
        return reader

    def _watch_from(self, loop: asyncio.AbstractEventLoop, reader: _LoopReader | None) -> _LoopReader | None:
        """I/O lock held, in the loop's thread: make the loop watch the current socket."""
        if reader is not None:
            self._unwatch(reader)
        if not self._fds:
            return None
        fds = tuple(os.dup(fd) for fd in self._fds)
        loop.add_reader(fds[0], self._loop_turn, False)
        loop.add_reader(fds[1], self._loop_turn, True)
        fresh = _LoopReader(loop, self._generation, fds)
        if reader is not None:
            fresh.awaiters = reader.awaiters
        self._loops[loop] = fresh
        return fresh

    def _detach_loop(self, reader: _LoopReader) -> None:
        """An awaiter of ``reader``'s loop ends; the loop lets go of the socket soon after its last."""
        reader.awaiters -= 1
        if reader.awaiters:
            return
        now = time.monotonic()
        with self._state:
            self._loop_waiting -= 1
            alone = not self._waiters and not self._loop_waiting
            if alone:
                self._waited_at = now
        if alone and self._pending:
            self._orphan()
        # Not at once: an awaiter usually follows soon (the next request's). One timer looks
        # after a while, however many awaiters come and go meanwhile.
        reader.idle_since = now
        if not reader.release_due:
            reader.release_due = True
            reader.loop.call_later(_PARK_S, self._release_idle_reader, reader)

    def _release_idle_reader(self, reader: _LoopReader) -> None:
        """In the loop's thread: let go of the socket once the loop has had no awaiter for a while."""
        reader.release_due = False
        if reader.awaiters:
            return  # the next detach looks again
        later = reader.idle_since + _PARK_S - time.monotonic()
        if later > 0:
            reader.release_due = True
            reader.loop.call_later(later, self._release_idle_reader, reader)
            return
        with self._io:
            self._release_reader(reader)

    def _release_reader(self, reader: _LoopReader) -> None:
        """I/O lock held: the loop stops watching; from another thread, in the loop's thread soon."""
        if self._loops.get(reader.loop) is reader:
            del self._loops[reader.loop]
        if not reader.fds:
            return
        if reader.loop.is_closed() or reader.thread == threading.get_ident():
            self._unwatch(reader)
            return
        try:
            reader.loop.call_soon_threadsafe(self._release_reader_later, reader)
        except RuntimeError:  # closed meanwhile
            self._unwatch(reader)

    def _release_reader_later(self, reader: _LoopReader) -> None:
        with self._io:
            self._unwatch(reader)

    def _unwatch(self, reader: _LoopReader) -> None:
        """In the loop's thread (or with the loop closed): stop watching and close the duplicates."""
        fds, reader.fds = reader.fds, ()
        for fd in fds:
            if not reader.loop.is_closed():
                reader.loop.remove_reader(fd)
            os.close(fd)

    def _loop_turn(self, monitor: bool) -> None:
        """The socket (or its monitor) is readable in a loop with awaiters: read, in the loop's thread."""
        with self._io:
            if not self._reading and self._sock is not None:
                self._turn(_MONITOR_READY if monitor else _SOCKET_READY)

    def _rewatch_loops(self) -> None:
        """I/O lock held, a new socket: each loop that reads watches it from now on."""
        for loop, reader in list(self._loops.items()):
            if reader.thread == threading.get_ident():
                self._watch_from(loop, reader)
                continue
            try:
                loop.call_soon_threadsafe(self._rewatch_later, loop)
            except RuntimeError:  # closed
                del self._loops[loop]
                self._unwatch(reader)

    def _rewatch_later(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._io:
            reader = self._loops.get(loop)
            if reader is not None and reader.generation != self._generation:
                self._watch_from(loop, reader)

    # ------------------------------------------------------------------ socket (lock held)

    def open_socket(self) -> None:
        """A fresh DEALER connected to the node, with a disconnect monitor."""
        self._close_socket()
        sock: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Replies queue here instead of backing up into the node's ROUTER, which drops what is
        # over its mark (spec section 14); both ways are bounded by the requests in flight.
        sock.setsockopt(zmq.SNDHWM, _QUEUE_MESSAGES)
        sock.setsockopt(zmq.RCVHWM, _QUEUE_MESSAGES)
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
        self._monitor_fd = self._fds[1]
        self._watch = (*self._fds, self._wakeup.read_fd)
        self._bg_watch = (*self._fds, self._bg_wakeup.read_fd)
        self._generation += 1
        self.lost = False
        self._drain_monitor()  # its descriptor signals only once what is there was read
        self._wake()  # waiters select on the new descriptors
        self._rewatch_loops()

    def _close_socket(self) -> None:
        self._fds = ()
        self._monitor_fd = -1
        self._watch = (self._wakeup.read_fd,)
        self._bg_watch = (self._bg_wakeup.read_fd,)
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

        def on_welcome(msg: Message) -> Welcome:
            if not isinstance(msg, Welcome):
                raise ValueError(f"expected welcome, got {msg.TAG}")
            self.version = msg.version
            self.welcome = msg
            self.connected = True
            self._last_heard = time.monotonic()
            self._next_heartbeat = self._last_heard  # the next turn schedules the first
            return msg

        with self._io:
            self.open_socket()
            if not self._thread.is_alive() and not self._closed:
                self._thread = threading.Thread(target=self._background, name=f"kvcr-io-{self.name}", daemon=True)
                self._thread.start()
            op_id = self.next_id()
            hello = Hello(op_id, self.versions, self.name, self.agent.name, self.agent.metadata(), regions)
            future = _Request(on_welcome, False, None)
            self._send_request(op_id, lambda _: hello, timeout_s, future)
            self._drain_socket()
        return future

    def _send_request(self, op_id: int, build: Callable[[int], Message], timeout_s: float, pending: _Request) -> None:
        """Lock held: encode and send; a request that is not sent settles at once."""
        sock = self._sock
        error: Exception | None = None
        frame = b""
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
            pending.set_exception(error or NodeLostError(f"not connected to {self.endpoint}"))
            self._settle(pending)
            return
        now = time.monotonic()
        pending.deadline = now + timeout_s + _GRACE_S
        self._add_pending(op_id, pending)
        try:
            sock.send(frame, _NOBLOCK)
            self._last_sent = now
        except zmq.Again:
            self._pop_pending(op_id)
            pending.set_exception(NodeLostError(f"the node at {self.endpoint} is not reachable"))
            self._settle(pending)

    @staticmethod
    def _settle(pending: _Request) -> None:
        """The node can no longer touch memory for this request: run its callback, once."""
        callback, pending.on_settled = pending.on_settled, None
        if callback is not None:
            try:
                callback()
            except Exception:
                log.exception("a settle callback failed")

    def _add_pending(self, op_id: int, pending: _Request) -> None:
        """Lock held: the one place requests enter the pending table."""
        self._pending[op_id] = pending
        if pending.deadline < self._nearest:
            self._nearest = pending.deadline
        if pending.touches_memory:
            self._touching += 1
            if self._touching == 1:
                self._pacing_starts()

    def _pacing_starts(self) -> None:
        """The first memory-touching request: whoever reads must now progress the agent at a short interval."""
        if self._leading or self._selecting:
            self._wake()  # a leader or the background thread blocked for longer: pace from now
        if self._loop_waiting:
            self._resume.set()  # event loops cannot pace: the background thread does

    def _pop_pending(self, op_id: int) -> _Request | None:
        """Lock held: the one place a request leaves the pending table (``_fail_all`` empties it)."""
        pending = self._pending.pop(op_id, None)
        if pending is not None and pending.touches_memory:
            self._touching -= 1
        return pending

    def _busy(self) -> bool:
        """Whether requests that may touch client memory are pending (safe without the lock)."""
        return self._touching > 0

    def tables(self) -> dict[str, int]:
        """Sizes of the core's tables: requests pending, timed out awaiting the node, event loops reading."""
        return {"pending": len(self._pending), "timed_out": len(self._timed_out), "loops": len(self._loops)}

    def timed_out_ids(self) -> frozenset[int]:
        """Ids of memory-touching requests the client stopped waiting for and the node has not answered."""
        return frozenset(list(self._timed_out))

    def _select(self, watch: tuple[int, ...], wait_s: float | None, wakeup: WakePipe) -> int:
        """Block in select on ``watch`` (no lock held) up to ``wait_s`` (None: until readable); what
        is readable (``_SOCKET_READY``, ``_MONITOR_READY``)."""
        try:
            readable = select.select(watch, (), (), wait_s)[0]
        except (OSError, ValueError):  # a descriptor closed under us (reconnect, close): look again
            return 0
        if not readable:
            return 0
        if wakeup.read_fd in readable:
            wakeup.drain()
        fds = self._fds
        if not fds:
            return 0
        return (_SOCKET_READY if fds[0] in readable else 0) | (_MONITOR_READY if fds[1] in readable else 0)

    def _turn(self, ready: int = 0) -> None:
        """One turn with the lock held: read what arrived, progress the agent while needed, timers."""
        if ready & _MONITOR_READY:
            self._drain_monitor()
        self._drain_socket(ready & _SOCKET_READY)
        if self._touching or self._timed_out or self.lingering:
            # Progress our agent: the node's transfer into or out of our memory
            # completes only when both ends are progressed.
            self._drain_notifications()
        now = time.monotonic()
        if now >= self._nearest:
            self._expire(now)
        if now >= self._next_heartbeat:
            self._heartbeat(now)

    def _drain_notifications(self) -> None:
        """Lock held: progress the agent and read each kvcr notification that arrived."""
        for payload in self.agent.progress():
            if is_notification(payload):
                self._notified(payload)

    def _notified(self, payload: bytes) -> None:
        """Lock held: hand a kvcr notification to the pending request it names (spec section
        6.10); others are counted and left alone. Notifications are hints: a subclass that
        loses some (a test's) must change no outcome, the control messages complete every group."""
        try:
            note = decode_notification(payload)
        except RemoteProtocolError:
            self.notifications["malformed"] += 1
            return
        pending = self._pending.get(note.request)
        if pending is None or pending.observer is None:
            self.notifications["ignored"] += 1
            return
        self.notifications["matched"] += 1
        pending.observer(note)

    def _heartbeat_s(self) -> float:
        welcome = self.welcome
        return welcome.heartbeat_ms / 1000 if welcome is not None and welcome.heartbeat_ms else 0.0

    def _heartbeat(self, now: float) -> None:
        """Say we are alive when idle; a node silent for three intervals is lost."""
        interval = self._heartbeat_s()
        if not interval or not self.connected or self._sock is None:
            self._next_heartbeat = math.inf
            return
        silence = 3 * interval + _SILENCE_SLACK_S
        if now - self._last_heard > silence:
            self.lost = True
            self.connected = False
            self._next_heartbeat = math.inf
            self._fail_all(NodeLostError(f"the node at {self.endpoint} has been silent for {now - self._last_heard:.1f} s"))
            return
        if now - self._last_sent >= interval:
            try:
                self._heartbeats += 1
                self._sock.send(encode(Heartbeat(self._heartbeats), self.version), _NOBLOCK)
                self._last_sent = now
            except zmq.Again:
                pass
        self._next_heartbeat = min(max(self._last_sent + interval, now + interval / 8), self._last_heard + silence)

    def _background(self) -> None:
        pacer = Pacer()
        park = _PARK_S
        try:
            while not self._closed:
                self._resume.clear()
                now = time.monotonic()
                busy = self._touching > 0
                with self._state:
                    if not self._pending:
                        self._orphaned = False
                    # Park while callers wait (they read and pace), and, unless the agent
                    # needs pacing, while event loops wait and a moment after callers stopped
                    # without leaving requests behind (they usually wait again): a second
                    # thread woken per reply costs a GIL hand-off.
                    parked = bool(self._waiters or (not busy and (
                        self._loop_waiting or (not self._orphaned and now - self._waited_at < park)
                    )))
                    self._parked = parked
                    self._selecting = not parked
                if parked:
                    self._resume.wait(max(0.0, min(park, self._due() - now)))
                    self._parked = False
                    if not self._closed and time.monotonic() >= self._due():
                        with self._io:  # a deadline or heartbeat nobody else is awake for
                            self._turn()
                    park = min(2 * park, _PARK_MAX_S)
                    continue
                park = _PARK_S
                wait_s: float | None
                if busy:
                    wait_s = pacer.next()
                else:
                    pacer.reset()
                    wait_s = self._idle_timeout()
                ready = self._select(self._bg_watch, wait_s, self._bg_wakeup)
                self._selecting = False
                if self._closed:
                    break
                if self._waiters:
                    continue  # a caller leads now: its turns read (the monitor too)
                with self._io:
                    self._turn(ready)
        except Exception as exc:  # the background thread must not die silently
            self._selecting = False
            log.exception("kvcr client background thread failed; the session is lost until reconnect()")
            with self._io:
                # Nobody would read the replies of later requests: refuse them at once
                # (NodeLostError) until reconnect() starts a new thread with a new session.
                self.lost = True
                self.connected = False
                self._fail_all(NodeLostError(f"the client background thread failed: {exc!r}; call reconnect()"))

    def _due(self) -> float:
        """The next time (monotonic) a deadline or the heartbeat needs a turn."""
        due = min(self._nearest, self._next_heartbeat)
        if self._timed_out or self.lingering:
            due = min(due, time.monotonic() + _LATE_PROGRESS_S)  # their transfers need our agent's progress
        return due

    def _idle_timeout(self) -> float | None:
        """How long a reader may block in select with nothing in flight (None: until woken)."""
        wait_s = self._due() - time.monotonic()
        if self._pending and wait_s > _IDLE_S:
            wait_s = _IDLE_S
        return None if wait_s == math.inf else max(0.0, wait_s)

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while cast(int, monitor.getsockopt(_EVENTS)) & _POLLIN:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
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

    def _drain_socket(self, readable: int = 0) -> None:
        """Read until ZeroMQ reports no input: that re-arms the socket's descriptor.

        ``readable``: select saw the descriptor readable, so a frame is most likely in:
        receive at once (a receive looks at ZeroMQ's commands itself) and ask after it.
        """
        sock = self._sock
        if sock is None:
            return
        self._reading += 1
        try:
            if readable:
                try:
                    frame = sock.recv(_NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    self._receive(frame)
            while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                self._receive(sock.recv(_NOBLOCK))
        finally:
            self._reading -= 1

    def _receive(self, frame: bytes) -> None:
        self._last_heard = time.monotonic()
        try:
            msg = decode(frame, self.version or self.versions[-1])
        except RemoteProtocolError as exc:
            log.warning("undecodable frame from the node: %s", exc)
            return
        self._dispatch(msg)

    def _dispatch(self, msg: Message) -> None:
        cls = type(msg)
        if isinstance(msg, CapacityEvent):
            self.capacity_events.append(msg)
            if self.on_capacity is not None:
                try:
                    self.on_capacity(msg)
                except Exception:
                    log.exception("capacity callback failed")
            return
        if cls is Heartbeat:
            return  # its id counts heartbeats, not requests
        if isinstance(msg, LeaseEnded):
            # An event, not a reply: its id counts the session's events (spec section 6.11).
            if self.on_lease_end is not None:
                try:
                    self.on_lease_end(msg)
                except Exception:
                    log.exception("lease end handling failed")
            return
        if isinstance(msg, Progress):
            # Not a reply: the request goes on (spec section 5.1).
            observed = self._pending.get(msg.id)
            if observed is not None and observed.observer is not None:
                observed.observer(msg)
            return
        op_id = getattr(msg, "id", 0)
        pending = self._pending.pop(op_id, None)
        if pending is not None and pending.touches_memory:
            self._touching -= 1
        elif pending is None:
            late = self._timed_out.pop(op_id, None)
            if late is not None:
                # The answer the client stopped waiting for: the node is done with our memory.
                log.debug("late %s for timed-out operation %d", msg.TAG, op_id)
                self._settle(late)
            else:
                log.debug("reply for no pending request: %s", msg.TAG)
            return
        if pending.on_settled is not None:
            self._settle(pending)
        future = pending
        if isinstance(msg, Error):
            future.set_exception(NodeError(msg.code, msg.reason, msg.path))
        else:
            try:
                result = pending.convert(msg)
            except Exception as exc:  # a reply of the wrong type or shape fails that request only
                future.set_exception(
                    exc if isinstance(exc, ProtocolError) else NodeError(ErrorCode.WRONG_TYPE, f"unexpected reply {msg.TAG}: {exc!r}")
                )
            else:
                future.set_result(result)
        if future is self._leader_future and self._leader_thread != threading.get_ident():
            self._wakeup.wake()  # another thread read the leader's result: the leader may be in select

    def _wake_leader(self) -> None:
        """The leader's result came in: wake it if another thread read it (the leader may be in select)."""
        if self._leader_thread != threading.get_ident():
            self._wakeup.wake()

    def _expire(self, now: float) -> None:
        for op_id in [i for i, p in self._pending.items() if p.deadline <= now]:
            pending = self._pop_pending(op_id)
            assert pending is not None
            if pending.touches_memory and pending.on_settled is not None:
                # The node may still move its bytes: keep holding its memory until it answers.
                self._timed_out[op_id] = pending
            else:
                self._settle(pending)
            pending.set_exception(
                OperationTimeout(f"operation {op_id}: no answer from {self.endpoint} within its deadline")
            )
            if pending is self._leader_future:
                self._wake_leader()
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
            if not p.done():
                p.set_exception(exc)
        leader = self._leader_future
        if leader is not None and leader.done():
            self._wake_leader()
