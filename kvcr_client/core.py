"""The client core: one I/O thread that owns the DEALER socket and the NIXL agent.

Callers on any thread (or an asyncio loop) hand work to the I/O thread through a queue
and get ``concurrent.futures.Future`` objects back. While any operation that may touch
client memory is pending, the I/O thread progresses the NIXL agent at a short interval:
both ends of a NIXL transfer need progress (DESIGN 9). Idle, it blocks in a ZeroMQ poll.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcr_client.agent import Agent
from kvcr_client.errors import ClientClosed, NodeError, NodeLostError, OperationTimeout
from kvcr_protocol import (
    CURRENT_VERSION,
    Bye,
    CapacityEvent,
    Error,
    Heartbeat,
    Hello,
    LocalProtocolError,
    Message,
    ProtocolError,
    Region,
    RemoteProtocolError,
    Welcome,
    decode,
    encode,
    supported_up_to,
)

log = logging.getLogger("kvcr.client")

_IDLE_POLL_MS = 200
_GRACE_S = 2.0


@dataclass
class _Pending:
    future: Future[Any]
    deadline: float
    touches_memory: bool
    convert: Callable[[Message], Any]


class ClientCore:
    """Socket, agent and pending requests, owned by one I/O thread."""

    def __init__(
        self,
        endpoint: str,
        name: str | None = None,
        max_version: int = CURRENT_VERSION,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name or f"kvcr-client-{os.getpid()}"
        self.versions = supported_up_to(max_version)
        self.agent = Agent(f"{self.name}.{os.getpid()}.{secrets.token_hex(4)}")
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self.connected = False
        self.lost = False
        self.version = 0
        self.welcome: Welcome | None = None
        self.capacity_events: collections.deque[CapacityEvent] = collections.deque(maxlen=1024)
        self.on_capacity: Callable[[CapacityEvent], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvcr-io-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the I/O thread; its return value (or exception) lands in the future."""
        future: Future[Any] = Future()
        if self._closed:
            future.set_exception(ClientClosed("the client is closed"))
            return future

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, not swallowed
                future.set_exception(exc)

        self._commands.append(run)
        self._wake()
        return future

    def request(
        self,
        build: Callable[[int], Message],
        convert: Callable[[Message], Any],
        timeout_s: float,
        touches_memory: bool = False,
        future: Future[Any] | None = None,
    ) -> tuple[int, Future[Any]]:
        """Send a request built for a fresh id; the reply passes through ``convert``."""
        op_id = next(self._ids)
        fut: Future[Any] = future or Future()

        def send() -> None:
            self._send_request(op_id, build(op_id), convert, timeout_s, touches_memory, fut)

        if self._closed:
            fut.set_exception(ClientClosed("the client is closed"))
        else:
            self._commands.append(send)
            self._wake()
        return op_id, fut

    def close(self, timeout: float = 5.0) -> None:
        """Say bye (best effort), stop the I/O thread and release the socket."""
        if self._closed:
            return
        if self.connected and not self.lost:
            _, fut = self.request(lambda i: Bye(i), lambda m: None, min(timeout, 2.0))
            try:
                fut.result(timeout)
            except Exception:
                log.debug("bye was not acknowledged", exc_info=True)
        self._closed = True
        self._wake()
        self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if self._own_context:
            self.context.term()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------------ I/O thread

    def open_socket(self) -> None:
        """(I/O thread) A fresh DEALER connected to the node, with a disconnect monitor."""
        self._close_socket()
        sock: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sock.connect(self.endpoint)
        self._sock = sock
        self.lost = False

    def _close_socket(self) -> None:
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

    def hello(self, regions: tuple[Region, ...], future: Future[Any], timeout_s: float) -> None:
        """(I/O thread) Open the session: version agreement, our metadata and regions."""
        self.open_socket()
        md = self.agent.metadata()

        def on_welcome(msg: Message) -> Welcome:
            assert isinstance(msg, Welcome)
            self.version = msg.version
            self.welcome = msg
            self.connected = True
            return msg

        op_id = next(self._ids)
        self._send_request(
            op_id, Hello(op_id, self.versions, self.name, self.agent.name, md, regions), on_welcome, timeout_s, False, future
        )

    def _send_request(
        self, op_id: int, msg: Message, convert: Callable[[Message], Any], timeout_s: float, touches: bool, fut: Future[Any]
    ) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if self._sock is None or self.lost:
            fut.set_exception(NodeLostError(f"not connected to {self.endpoint}; call reconnect()"))
            return
        try:
            frame = encode(msg, self.version or self.versions[0])
        except LocalProtocolError as exc:
            fut.set_exception(exc)
            return
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            fut.set_exception(NodeLostError(f"the node at {self.endpoint} is not reachable"))
            return
        self._pending[op_id] = _Pending(fut, time.monotonic() + timeout_s + _GRACE_S, touches, convert)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        registered: tuple[Any, Any] = (None, None)
        spins = 0
        try:
            while not self._closed:
                if registered != (self._sock, self._monitor):
                    for s in registered:
                        if s is not None:
                            poller.unregister(s)
                    registered = (self._sock, self._monitor)
                    for s in registered:
                        if s is not None:
                            poller.register(s, zmq.POLLIN)
                busy = any(p.touches_memory for p in self._pending.values())
                if busy:
                    events = dict(poller.poll(0))
                    if not events:
                        # Progress our agent: the node's transfer into or out of our
                        # memory completes only when both ends are progressed.
                        self.agent.progress()
                        time.sleep(min(0.001, 10e-6 * (1 << min(spins, 7))))
                        spins += 1
                else:
                    spins = 0
                    events = dict(poller.poll(self._idle_timeout_ms()))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                while self._commands:
                    self._commands.popleft()()
                if self._monitor is not None and self._monitor in events:
                    self._drain_monitor()
                if self._sock is not None and self._sock in events:
                    self._drain_socket()
                if busy:
                    self.agent.progress()
                self._expire()
        except Exception:  # the I/O thread must not die silently
            log.exception("kvcr client I/O thread failed")
            self._fail_all(NodeLostError("the client I/O thread failed"))
        finally:
            self._fail_all(ClientClosed("the client is closed"))
            while self._commands:
                self._commands.popleft()()
            self._close_socket()

    def _idle_timeout_ms(self) -> int:
        if not self._pending:
            return _IDLE_POLL_MS
        nearest = min(p.deadline for p in self._pending.values())
        return max(0, min(_IDLE_POLL_MS, int((nearest - time.monotonic()) * 1000) + 1))

    def _drain_monitor(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost = True
                self.connected = False
                self._fail_all(NodeLostError(f"lost the node at {self.endpoint}"))

    def _drain_socket(self) -> None:
        assert self._sock is not None
        for _ in range(1024):
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame, self.version or self.versions[-1])
            except RemoteProtocolError as exc:
                log.warning("undecodable frame from the node: %s", exc)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, CapacityEvent):
            self.capacity_events.append(msg)
            if self.on_capacity is not None:
                try:
                    self.on_capacity(msg)
                except Exception:
                    log.exception("capacity callback failed")
            return
        pending = self._pending.pop(getattr(msg, "id", 0), None)
        if pending is None:
            if not isinstance(msg, Heartbeat):
                log.debug("reply for no pending request: %s", msg.TAG)
            return
        if isinstance(msg, Error):
            pending.future.set_exception(NodeError(msg.code, msg.reason, msg.path))
            return
        try:
            pending.future.set_result(pending.convert(msg))
        except (ProtocolError, AssertionError, KeyError, ValueError) as exc:
            pending.future.set_exception(exc)

    def _expire(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        for op_id in [i for i, p in self._pending.items() if p.deadline <= now]:
            pending = self._pending.pop(op_id)
            pending.future.set_exception(
                OperationTimeout(f"operation {op_id}: no answer from {self.endpoint} within its deadline")
            )

    def _fail_all(self, exc: Exception) -> None:
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(exc)
