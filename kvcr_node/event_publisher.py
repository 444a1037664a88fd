"""The sockets of the inventory event stream: a PUB for batches, a ROUTER for replays (spec section 15).

Owned by the progress thread like the node's other sockets: ``publish`` runs at the end of
each loop turn that changed the store, ``serve`` when the poll reports a replay request
(a bounded number per turn), ``pump`` while answers are being sent (a bounded amount per
turn), ``watch`` when the replay socket's monitor reports a requester that disconnected.
What to send comes from the sans-I/O ``Inventory``, when and to whom from ``Replays``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_node.counters import Count, Counters
from kvcr_node.endpoint import BoundEndpoint
from kvcr_node.inventory import Inventory
from kvcr_node.replays import REPLAY_BYTES, REPLAY_HWM, REPLAY_REQUESTERS, Replays, Sent
from kvcr_protocol.events import EVENTS_TOPIC, encode_seq, replay_endpoint

log = logging.getLogger("kvcr.node")

PUB_HWM = 16384
"""Batches queued per subscriber before the PUB drops them (the subscriber then replays)."""
REPLAY_SNDBUF = 256 << 10
"""The kernel's send buffer per replay connection, bytes: beside its ZeroMQ queue
(``REPLAY_HWM`` messages), the kernel memory a requester that does not read holds."""
REPLAY_MAX_FRAME = 256
"""Bytes of a frame the replay socket takes at most (a request's are 0 and 8): ZeroMQ closes
the connection of a peer that sends a larger one, so requests cannot fill the node's memory."""
REPLAY_REQUESTS_PER_TURN = 8
"""Replay requests served per loop turn at most; the rest wait for the next turn."""
STOP_LINGER_MS = 500
"""How long the last batches (the stop's ``cleared``) may take to leave at shutdown."""


class EventPublisher:
    """The PUB and replay ROUTER sockets, bound, and the ``Inventory`` they send from."""

    def __init__(
        self, context: zmq.Context[Any], endpoint: str, replay: str, inventory: Inventory,
        counters: Counters, clock: Callable[[], float] = time.monotonic,
        replay_bytes: int = REPLAY_BYTES, replay_requesters: int = REPLAY_REQUESTERS,
    ) -> None:
        self.inventory = inventory
        self.counters = counters
        self.replays = Replays(inventory, counters, clock, replay_bytes, replay_requesters)
        self.pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self.pub.setsockopt(zmq.LINGER, STOP_LINGER_MS)
        self.replay: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        # ZeroMQ counts messages, not bytes: a few messages, each at most a batch, bound a
        # requester's queue in bytes (spec section 15.4).
        self.replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self.replay.setsockopt(zmq.SNDBUF, REPLAY_SNDBUF)
        self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME)
        # A full queue raises zmq.Again instead of dropping silently, so the answer waits, and is cut when it stalls.
        self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.monitor: zmq.Socket[bytes] = self.replay.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        """Says which connection closed, so its requester is forgotten."""
        self._bound: list[BoundEndpoint] = []
        try:
            self._bound.append(BoundEndpoint(self.pub, endpoint))
            self._bound.append(BoundEndpoint(self.replay, replay or replay_endpoint(endpoint)))
        except Exception:
            self.close()
            raise
        self.endpoint = self._bound[0].endpoint
        self.replay_endpoint = self._bound[1].endpoint

    def publish(self) -> None:
        """Send the turn's events, numbered. A PUB never blocks nor says what it drops: a subscriber
        too slow to take them loses them to its queue's limit, sees the gap and replays."""
        for seq, payload in self.inventory.take():
            self.pub.send_multipart((EVENTS_TOPIC, encode_seq(seq), payload), _NOBLOCK)
            self.counters.inc(Count.EVENTS_PUBLISHED)

    def serve(self) -> None:
        """Take at most ``REPLAY_REQUESTS_PER_TURN`` replay requests (``pump`` sends the answers)."""
        sock = self.replay
        for _ in range(REPLAY_REQUESTS_PER_TURN):
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                break
            frames = sock.recv_multipart(_NOBLOCK, copy=False)
            fd = _source_fd(frames[0])
            self.replays.request(frames[0].bytes, fd, [f.bytes for f in frames[1:]], self._send)

    def pump(self) -> None:
        """Send what the answers in progress may send this turn."""
        self.replays.pump(self._send)

    def watch(self) -> None:
        """Forget the requesters whose connections closed (the replay socket's monitor)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.replays.disconnected(int(event["value"]))

    def _send(self, identity: bytes, message: list[bytes]) -> Sent:
        try:
            self.replay.send_multipart((identity, *message), _NOBLOCK)
        except zmq.Again:
            return Sent.FULL
        except zmq.ZMQError:  # EHOSTUNREACH: not connected
            return Sent.GONE
        return Sent.OK

    def stop(self) -> None:
        """The node is stopping: publish what is pending, then ``cleared``."""
        try:
            self.publish()
            self.inventory.cleared()
            self.publish()
        except Exception:
            log.exception("the last inventory events could not be published")

    def close(self) -> None:
        """Close both sockets (the PUB lingers briefly) and remove their ipc paths."""
        self.replay.disable_monitor()
        self.monitor.close(0)
        self.replay.close(0)
        self.pub.close()
        for bound in self._bound:
            bound.close()
        self._bound.clear()


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a message came on (ZMQ_SRCFD); -1 where there is none."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1
