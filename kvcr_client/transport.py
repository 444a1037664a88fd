"""The client's connection to its node: one DEALER socket and the monitor that reports its drops.

``Transport`` opens, closes and reads the monitor; the client core reads and writes the
socket itself, holding its I/O lock (architecture §4). Nothing here knows the protocol.
"""

from __future__ import annotations

import enum
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN

_QUEUE_MESSAGES = 1 << 17
"""Frames ZeroMQ may queue each way between the client and its node (its high-water marks):
thousands of small requests in flight must queue here, not fail, while the node reads them
a batch at a time, and their replies must find room even when the caller reads them late."""
_WATCHED = (
    zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Link(enum.Enum):
    """What the monitor reported about the connection."""

    DISCONNECTED = "disconnected"
    REFUSED = "refused"
    """The node refused the handshake (CurveZMQ keys, or a plain client at a CURVE node)."""


class Transport:
    """A DEALER socket connected to ``endpoint`` with a disconnect monitor; reopened per session."""

    def __init__(self, endpoint: str, context: zmq.Context[Any], curve: tuple[bytes, bytes, bytes] | None) -> None:
        self.endpoint = endpoint
        self.context = context
        self.curve = curve
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.fds: tuple[int, ...] = ()
        """The socket's and the monitor's descriptors (empty: no socket)."""
        self.generation = 0
        """Counts the sockets opened: an event loop's descriptors belong to one of them."""

    def open(self) -> None:
        """A fresh DEALER connected to the node (the old one closed first)."""
        self.close()
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
        self.monitor = sock.get_monitor_socket(_WATCHED)
        sock.connect(self.endpoint)
        self.sock = sock
        self.fds = (int(sock.getsockopt(zmq.FD)), int(self.monitor.getsockopt(zmq.FD)))
        self.generation += 1

    def close(self) -> None:
        self.fds = ()
        if self.sock is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.sock.close(0)
            self.sock = None
        if self.monitor is not None:
            self.monitor.close(0)
            self.monitor = None

    def send(self, frame: bytes) -> bool:
        """Queue ``frame`` without blocking; False when there is no socket or its queue is full."""
        sock = self.sock
        if sock is None:
            return False
        try:
            sock.send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def monitor_events(self) -> list[Link]:
        """Read every monitor event that arrived (that re-arms its descriptor); what they say."""
        monitor = self.monitor
        found: list[Link] = []
        if monitor is None:
            return found
        while cast(int, monitor.getsockopt(_EVENTS)) & _POLLIN:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_DISCONNECTED:
                found.append(Link.DISCONNECTED)
            elif event["event"] in _REFUSED:
                found.append(Link.REFUSED)
        return found
