"""The sockets of the inventory event stream: a PUB for batches, a ROUTER for replays (spec section 15).

Owned by the progress thread like the node's other sockets: ``publish`` runs at the end of
each loop turn that changed the store, ``serve`` when the poll reports a replay request
(a bounded number per turn). What to send comes from the sans-I/O ``Inventory``.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, cast

import zmq

from kvcr_io.zmq_flags import EVENTS as _EVENTS
from kvcr_io.zmq_flags import NOBLOCK as _NOBLOCK
from kvcr_io.zmq_flags import POLLIN as _POLLIN
from kvcr_node.endpoint import BoundEndpoint
from kvcr_node.inventory import REPLAY_MAX_BATCHES, Inventory
from kvcr_protocol.events import EVENTS_TOPIC, encode_seq, replay_endpoint

log = logging.getLogger("kvcr.node")

PUB_HWM = 16384
"""Batches queued per subscriber before the PUB drops them (the subscriber then replays)."""
REPLAY_HWM = 4 * (REPLAY_MAX_BATCHES + 1)
"""Replay messages queued per subscriber: a few whole answers."""
REPLAY_REQUESTS_PER_TURN = 8
"""Replay requests served per loop turn at most; the rest wait for the next turn."""
STOP_LINGER_MS = 500
"""How long the last batches (the stop's ``cleared``) may take to leave at shutdown."""


class EventPublisher:
    """The PUB and replay ROUTER sockets, bound, and the ``Inventory`` they send from."""

    def __init__(
        self, context: zmq.Context[Any], endpoint: str, replay: str, inventory: Inventory,
        counters: collections.Counter[str],
    ) -> None:
        self.inventory = inventory
        self.counters = counters
        self.pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self.pub.setsockopt(zmq.LINGER, STOP_LINGER_MS)
        self.replay: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        # A full queue raises zmq.Again instead of dropping silently, so a cut answer is counted.
        self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.replay.setsockopt(zmq.LINGER, 0)
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
            self.counters["events_published"] += 1

    def serve(self) -> None:
        """Answer at most ``REPLAY_REQUESTS_PER_TURN`` replay requests from the ring."""
        sock = self.replay
        for _ in range(REPLAY_REQUESTS_PER_TURN):
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                break
            frames = sock.recv_multipart(_NOBLOCK)
            answer, served = self.inventory.replay(frames[1:])
            self.counters["events_replays" if served else "events_replays_refused"] += 1
            for message in answer:
                try:
                    sock.send_multipart((frames[0], *message), _NOBLOCK)
                except zmq.Again:  # the requester's queue is full: the answer is cut short
                    self.counters["events_replay_cut"] += 1
                    break
                except zmq.ZMQError:  # the requester is gone (EHOSTUNREACH)
                    break

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
        self.replay.close(0)
        self.pub.close()
        for bound in self._bound:
            bound.close()
        self._bound.clear()
