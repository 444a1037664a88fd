"""Following a node's inventory events (spec section 15): a subscriber and the index it mirrors.

``EventStream`` connects a SUB to the node's events endpoint and a DEALER to its replay
socket, hands out batches in sequence order, and fills any gap (batches the PUB dropped,
or that were sent before it connected) by replay. ``InventoryMirror`` applies them: a
router's view of which keys the node holds, in which pools and tier.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcr_client.errors import KvcrError, NodeError
from kvcr_protocol import ErrorCode, ProtocolError
from kvcr_protocol.events import (
    END_SEQ,
    EVENTS_TOPIC,
    Cleared,
    EventBatch,
    ReplayEnd,
    Stored,
    decode_batch,
    decode_replay_end,
    decode_seq,
    encode_replay_request,
    replay_endpoint,
)

REPLAY_TIMEOUT_S = 5.0
"""How long one replay answer may take to arrive before the node is taken as unreachable."""
_SYNC_ROUNDS = 64
"""Replay rounds one ``sync`` makes at most (an answer carries a bounded number of batches)."""
SUB_HWM = 100_000
LEFT_INCARNATIONS = 8
"""Incarnations a stream remembers having left (each node start draws a new one at random)."""
"""Batches the SUB queues while the subscriber is busy (a replay); past it ZeroMQ drops, and replay fills in."""


Numbered = tuple[int, EventBatch]
"""A batch and its sequence number."""


class EventStreamError(KvcrError):
    """The event stream cannot go on: a batch that does not decode, or a replay that fails."""


@dataclass(frozen=True, slots=True)
class Held:
    """Where a key is held: the pools of its layout and its tier."""

    pools: tuple[str, ...]
    tier: str


@dataclass(slots=True)
class MirrorChanges:
    """What one batch changed in an ``InventoryMirror``: the node's holdings as a set of
    keys, whatever tier holds them (what a router that places requests by key needs)."""

    restarted: bool = False
    """The mirror was emptied in this batch (a ``cleared`` event, or a new incarnation):
    forget every key of the node; ``held`` then lists what it holds since."""
    held: list[bytes] = field(default_factory=list)
    """Keys held after this batch (in any tier) that were not held before it, in the order
    the batch first named them."""
    gone: list[bytes] = field(default_factory=list)
    """Keys held before this batch that no tier holds after it (empty when ``restarted``)."""


class InventoryMirror:
    """The keys a node holds, as its events say, in each tier (an object of the node's
    memory may also have a copy in its ``disk`` tier, and an event names the tier it
    changed), with the parent each was stored with; a batch of a new incarnation starts afresh."""

    def __init__(self) -> None:
        self.keys: dict[bytes, dict[str, Held]] = {}
        """Key -> tier -> where it is held there."""
        self.parents: dict[bytes, bytes] = {}
        """Key -> the parent key its ``stored`` event named, for held keys that have one."""
        self.node = ""
        self.incarnation: int | None = None

    def apply(self, batch: EventBatch) -> MirrorChanges:
        """Apply ``batch``; returns which keys came to be held and which left (a key stored
        and removed within one batch is in neither)."""
        changes = MirrorChanges()
        keys, parents = self.keys, self.parents
        before: dict[bytes, bool] = {}
        """The keys this batch touched: held before it?"""
        if batch.incarnation != self.incarnation:
            self._clear(changes)
            self.node, self.incarnation = batch.node, batch.incarnation
        for event in batch.events:
            if isinstance(event, Cleared):
                self._clear(changes)
                before.clear()  # the keys touched so far are forgotten with the rest
            elif isinstance(event, Stored):
                held, tier = Held(event.pools, event.tier), event.tier
                for i, key in enumerate(event.keys):
                    tiers = keys.get(key)
                    if key not in before:
                        before[key] = tiers is not None
                    if tiers is None:
                        keys[key] = tiers = {}
                    tiers[tier] = held
                    parent = event.parent_of(i)
                    if parent:
                        parents[key] = parent
            else:
                tier = event.tier
                for key in event.keys:
                    tiers = keys.get(key)
                    if key not in before:
                        before[key] = tiers is not None
                    if tiers is not None:
                        tiers.pop(tier, None)
                        if not tiers:
                            del keys[key]
                            parents.pop(key, None)
        for key, was in before.items():
            now = key in keys
            if now and not was:
                changes.held.append(key)
            elif was and not now:
                changes.gone.append(key)
        return changes

    def _clear(self, changes: MirrorChanges) -> None:
        changes.restarted = True
        self.keys.clear()
        self.parents.clear()


class EventStream:
    """A subscriber to one node's inventory events, in order, with gaps filled by replay.

    Each time the SUB (re)connects (the first time, or to a restarted node) the stream
    asks the replay socket for what was published meanwhile, so an idle node's past is
    not left waiting for its next event; ``from_start`` makes that, and the first batch of
    a new incarnation, ask from seq 0, so a subscriber that connects late still sees the
    incarnation whole (as long as the node's ring holds it). A batch the PUB drops is
    noticed when the next one arrives, or at once with ``sync``. ``lost`` counts batches
    gone from the ring when asked for: a mirror built from this stream is then
    incomplete (``complete`` is False).
    """

    def __init__(
        self, endpoint: str, replay: str | None = None, context: zmq.Context[Any] | None = None,
        from_start: bool = True, replay_timeout: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay or replay_endpoint(endpoint)
        self.from_start = from_start
        self.replay_timeout = replay_timeout
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.sub: zmq.Socket[bytes] = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        self.sub.setsockopt(zmq.SUBSCRIBE, EVENTS_TOPIC)
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self.sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.sub.connect(endpoint)
        self._dealer: zmq.Socket[bytes] | None = None
        self.incarnation: int | None = None
        self._left: collections.deque[int] = collections.deque(maxlen=LEFT_INCARNATIONS)
        """Incarnations the stream has left, or found stale (``_live``): a batch of one still
        queued in the SUB when the stream went on to the node's present incarnation (by
        replay) is never handed out."""
        self.expected = 0
        """The seq of the next batch to hand out."""
        self.lost = 0
        self.replays = 0
        self.last_end: ReplayEnd | None = None
        """The end message of the last replay: the ring's bounds then."""

    @property
    def complete(self) -> bool:
        return self.lost == 0

    @property
    def sockets(self) -> tuple[zmq.Socket[bytes], ...]:
        """What to poll for this stream (its SUB and its connection monitor): one that is
        readable means ``recv`` has something to do. A subscriber of many nodes polls them
        all at once and calls ``recv`` only for those."""
        return (self.sub, self._monitor)

    # -- reading ----------------------------------------------------------------------

    def _published(self, timeout: float) -> tuple[int, bytes] | None:
        """The next published (seq, payload), or None after ``timeout`` seconds."""
        if not self.sub.poll(max(0, int(timeout * 1000))):
            return None
        frames = self.sub.recv_multipart()
        if len(frames) != 3:
            raise EventStreamError(f"a published message of {len(frames)} frames; expected [topic, seq, payload]")
        try:
            return decode_seq(frames[1]), frames[2]
        except ProtocolError as exc:
            raise EventStreamError(f"a published sequence number is invalid: {exc}") from exc

    def recv(self, timeout: float = 0.0) -> list[Numbered]:
        """The (seq, batch) pairs that arrived (waiting up to ``timeout`` for the first), in order, gaps filled."""
        out: list[Numbered] = []
        deadline = time.monotonic() + timeout
        while True:
            if self._connected():
                out.extend(self._resync())
            message = self._published(0.0)
            if message is None:
                left = deadline - time.monotonic()
                if out or left <= 0:
                    return out
                self._poller.poll(max(1, int(left * 1000)))  # a batch, or a (re)connection
                continue
            seq, payload = message
            batch = _decode(payload, seq)
            if batch.incarnation != self.incarnation:
                if batch.incarnation in self._left:
                    continue
                if self.incarnation is not None and not self._live(batch.incarnation):
                    # Stale: queued in the SUB before the stream went on to the node's present
                    # incarnation by replay (one it never followed, so not among those it left).
                    self._left.append(batch.incarnation)
                    continue
                self._switch(batch.incarnation)
                self.expected = 0 if self.from_start else seq
            if seq < self.expected:
                continue  # already had it by replay
            if seq > self.expected:
                out.extend(self._fill(self.expected, seq))
            out.append((seq, batch))
            self.expected = seq + 1

    def _live(self, incarnation: int) -> bool:
        """Whether the node now runs ``incarnation``, as its replay socket says (the PUB may
        still hold an older one's batches); True when it cannot be asked (trust the PUB)."""
        try:
            _, end = self._replay(self.expected)
        except (EventStreamError, NodeError):
            return True
        return end.incarnation == incarnation

    def _switch(self, incarnation: int) -> None:
        """Follow ``incarnation`` of the node from now on; the one followed so far is left."""
        if self.incarnation is not None:
            self._left.append(self.incarnation)
        self.incarnation = incarnation

    def _connected(self) -> bool:
        """Whether the SUB connected (again) since the last look."""
        connected = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            connected = connected or event["event"] == zmq.EVENT_CONNECTED
        return connected

    def _resync(self) -> list[Numbered]:
        """After a (re)connection: what the node published meanwhile, by replay."""
        if not self.from_start and self.incarnation is None:
            return []
        try:
            return self.sync()
        except EventStreamError:
            return []  # not answering yet: its batches will come by the PUB, gaps filled then

    def sync(self) -> list[Numbered]:
        """Catch up with everything the node has published, by replay (asking, not waiting for the PUB)."""
        out: list[Numbered] = []
        for _ in range(_SYNC_ROUNDS):
            start = self.expected if self.incarnation is not None else 0
            batches, end = self._replay(start)
            if end.incarnation != self.incarnation:
                self._switch(end.incarnation)
                self.expected = 0
                if start != 0:
                    continue  # the node restarted: ask the new incarnation from its start
            if end.oldest > self.expected:  # the ring no longer holds them
                self.lost += end.oldest - self.expected
                self.expected = end.oldest
            before = self.expected
            for seq, batch in batches:
                if seq == self.expected and batch.incarnation == self.incarnation:
                    out.append((seq, batch))
                    self.expected += 1
            if self.expected >= end.next or self.expected == before:
                break  # caught up (or the answer brought nothing new: ask again later)
        return out

    def _fill(self, start: int, stop: int) -> list[Numbered]:
        """Batches ``start`` .. ``stop - 1`` of this incarnation by replay; those gone from the ring count as lost."""
        out: list[Numbered] = []
        while start < stop:
            batches, end = self._replay(start)
            if end.incarnation != self.incarnation:
                self.lost += stop - start  # restarted since: the rest of the old incarnation is gone
                break
            if end.oldest > start:
                self.lost += min(end.oldest, stop) - start
                start = min(end.oldest, stop)
            before = start
            for seq, batch in batches:
                if seq == start < stop and batch.incarnation == self.incarnation:
                    out.append((seq, batch))
                    start += 1
            if start == before and start < stop:
                raise EventStreamError(f"replay from {start} brought none of the batches up to {stop} ({end})")
        return out

    def _replay(self, start: int) -> tuple[list[tuple[int, EventBatch]], ReplayEnd]:
        """Ask the replay socket for every held batch from ``start`` on; the batches and the end message.

        A refusal raises ``NodeError``, unless it comes from another incarnation: the
        caller then sees the restart in ``end.incarnation``."""
        dealer = self._dealer
        if dealer is None:
            dealer = self._dealer = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDTIMEO, max(1, int(self.replay_timeout * 1000)))
            dealer.connect(self.replay_endpoint)
        self.replays += 1
        try:
            batches, end = self._ask(dealer, start)
        except EventStreamError:
            # The rest of this answer may still come: a fresh socket cannot mistake it for the next one's.
            dealer.close(0)
            self._dealer = None
            raise
        self.last_end = end
        if not end.ok and end.code != ErrorCode.BUSY and end.incarnation == self.incarnation:
            raise NodeError(end.code, end.reason, end.path)
        # BUSY: the node's replay budgets cut the answer (spec section 15.4); what came is good,
        # and the caller asks again from there. A refusal by a new incarnation (a start past
        # its next) is a restart.
        return batches, end

    def _ask(self, dealer: zmq.Socket[bytes], start: int) -> tuple[list[tuple[int, EventBatch]], ReplayEnd]:
        """Send one replay request and read its whole answer (bounded in time)."""
        try:
            dealer.send_multipart(encode_replay_request(start))
        except zmq.Again:
            raise EventStreamError(f"cannot reach {self.replay_endpoint} within {self.replay_timeout} s") from None
        deadline = time.monotonic() + self.replay_timeout
        batches: list[tuple[int, EventBatch]] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                raise EventStreamError(f"no replay answer from {self.replay_endpoint} within {self.replay_timeout} s")
            frames = dealer.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                raise EventStreamError(f"a replay message of {len(frames)} frames; expected [b'', seq, payload]")
            try:
                seq = decode_seq(frames[1], end=True)
                if seq == END_SEQ:
                    end = decode_replay_end(frames[2])
                    break
            except ProtocolError as exc:
                raise EventStreamError(f"a replay message is invalid: {exc}") from exc
            batches.append((seq, _decode(frames[2], seq)))
        return batches, end

    def close(self) -> None:
        self.sub.disable_monitor()
        self._monitor.close(0)
        self.sub.close(0)
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None
        if self._own_context:
            self.context.term()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(payload: bytes, seq: int) -> EventBatch:
    try:
        return decode_batch(payload)
    except ProtocolError as exc:
        raise EventStreamError(f"batch {seq} does not decode: {exc}") from exc
