"""The node's inventory events: what changed in the store this turn, and the recent batches.

Sans-I/O (spec section 15): the store reports each object that becomes READY or leaves
(``InventoryListener``); ``take`` turns the turn's events into numbered, encoded batches
and keeps them in a bounded ring; ``replay`` answers a replay request from that ring. The
node's ``EventPublisher`` owns the sockets and sends what these return.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from kvcr_node.store import ObjectEntry
from kvcr_protocol import ErrorCode, ProtocolError
from kvcr_protocol.events import (
    END_SEQ_FRAME,
    MAX_BATCH_KEYS,
    Cleared,
    Event,
    EventBatch,
    Removed,
    RemovedReason,
    ReplayEnd,
    Stored,
    decode_replay_request,
    encode_batch,
    encode_replay_end,
    encode_seq,
    replay_refusal,
)

RING_BATCHES = 4096
"""Published batches kept for replay; the oldest goes first."""
RING_BYTES = 64 << 20
"""Encoded bytes kept for replay at most, whatever the count (the newest batch always stays)."""
REPLAY_MAX_BATCHES = 512
"""Batches one replay answer carries at most; a subscriber asks again from where it stopped."""
REPLAY_MAX_BYTES = 16 << 20
"""Encoded bytes one replay answer carries at most (its first batch always goes). The node
sends an answer over several turns, a few messages at a time (``EventPublisher``), so this
bounds the work of one request, not what the node queues."""
BATCH_MAX_BYTES = 128 << 10
"""Encoded bytes a batch has at most, unless one key's event alone is larger (it cannot be:
a key and its pools are a few tens of kB): a turn with more is split into further batches,
so that every message of the stream, and what a requester's queue holds, is bounded in bytes."""

_Group = tuple[type[Stored] | type[Removed] | type[Cleared], tuple[str, ...], str, RemovedReason]


class Inventory:
    """The current turn's events, the next sequence number, and the ring of recent batches."""

    def __init__(
        self, node: str, incarnation: int, tiers: Mapping[str, str], wall: Callable[[], float] = time.time,
        ring_batches: int = RING_BATCHES, ring_bytes: int = RING_BYTES,
    ) -> None:
        self.node = node
        self.incarnation = incarnation
        self.tiers = dict(tiers)
        """Pool name -> its memory (``dram``, ``hbm:N``): an object's tier is its first span's pool's."""
        self.wall = wall
        self.ring_batches = ring_batches
        self.ring_bytes = ring_bytes
        self.next_seq = 0
        self.ring: collections.deque[tuple[int, bytes]] = collections.deque()
        self.ring_size = 0
        """Encoded bytes in the ring."""
        self._groups: list[_Group] = []
        self._keys: list[list[bytes]] = []
        self._parents: list[list[bytes]] = []
        """Per group, its keys' parents (b"": none named); empty for a group of removals."""
        self.cleared()  # a fresh incarnation says so first

    # -- what the store reports (InventoryListener) -----------------------------------

    def stored(self, entry: ObjectEntry) -> None:
        self._add(Stored, entry, RemovedReason.EVICTED)

    def removed(self, entry: ObjectEntry, evicted: bool) -> None:
        self._add(Removed, entry, RemovedReason.EVICTED if evicted else RemovedReason.REMOVED)

    def cleared(self) -> None:
        """Everything is gone: drop what is pending (it no longer matters) and say so."""
        self._groups = [(Cleared, (), "", RemovedReason.EVICTED)]
        self._keys = [[]]
        self._parents = [[]]

    def _add(self, kind: type[Stored] | type[Removed], entry: ObjectEntry, reason: RemovedReason) -> None:
        info = entry.info
        group: _Group = (kind, tuple(pool for pool, _ in info.need), self.tiers[info.layout[0][1]], reason)
        # Adjacent changes of one kind and layout share an event; order is never changed.
        if not (self._groups and self._groups[-1] == group):
            self._groups.append(group)
            self._keys.append([])
            self._parents.append([])
        self._keys[-1].append(entry.key)
        if kind is Stored:
            self._parents[-1].append(entry.parent)

    @property
    def pending(self) -> bool:
        return bool(self._groups)

    # -- publishing -------------------------------------------------------------------

    def take(self) -> list[tuple[int, bytes]]:
        """The pending events as (seq, payload) batches of at most ``MAX_BATCH_KEYS`` keys, kept in the ring.

        The pending events are taken first: should encoding fail, they are not tried again
        (and published twice) every turn after."""
        if not self._groups:
            return []
        groups, pending, parents_of = self._groups, self._keys, self._parents
        self._groups, self._keys, self._parents = [], [], []
        ts = self.wall()
        out: list[tuple[int, bytes]] = []
        events: list[Event] = []
        room = MAX_BATCH_KEYS
        for (kind, pools, tier, reason), keys, parents in zip(groups, pending, parents_of, strict=True):
            if kind is Cleared:
                events.append(Cleared())
                room -= 1
            named = any(parents)
            while keys:
                if room <= 0:
                    self._emit(events, ts, out)
                    events, room = [], MAX_BATCH_KEYS
                part, keys = keys[:room], keys[room:]
                if kind is Stored:
                    events.append(Stored(tuple(part), pools, tier, tuple(parents[:room]) if named else ()))
                    parents = parents[room:]
                else:
                    events.append(Removed(tuple(part), pools, tier, reason))
                room -= len(part)
        if events:
            self._emit(events, ts, out)
        return out

    def _emit(self, events: list[Event], ts: float, out: list[tuple[int, bytes]]) -> None:
        """Publish ``events`` as one batch, or as consecutive batches of at most ``BATCH_MAX_BYTES``."""
        payload = encode_batch(EventBatch(self.node, self.incarnation, ts, tuple(events)))
        if len(payload) > BATCH_MAX_BYTES and (len(events) > 1 or _keys_of(events[0]) > 1):
            first, second = _halves(events)
            self._emit(first, ts, out)
            self._emit(second, ts, out)
            return
        out.append(self._publish(payload))

    def _publish(self, payload: bytes) -> tuple[int, bytes]:
        seq = self.next_seq
        self.next_seq += 1
        self.ring.append((seq, payload))
        self.ring_size += len(payload)
        while len(self.ring) > 1 and (len(self.ring) > self.ring_batches or self.ring_size > self.ring_bytes):
            self.ring_size -= len(self.ring.popleft()[1])
        return seq, payload

    # -- replay -----------------------------------------------------------------------

    @property
    def oldest(self) -> int:
        """The seq of the oldest batch held (``next_seq`` when none is)."""
        return self.ring[0][0] if self.ring else self.next_seq

    def replay(self, frames: list[bytes]) -> tuple[list[list[bytes]], bool]:
        """The whole answer to a replay request (the frames after the sender's identity), and whether it was served.

        Held batches from the start on, at most ``REPLAY_MAX_BATCHES`` and ``REPLAY_MAX_BYTES``, then the end
        message with the ring's bounds; a request that is not one, or that starts past
        the next seq, gets only the end message, naming the field. (The node sends an
        answer over several turns, from ``open`` and ``batch``; this is the same answer at once.)
        """
        opened = self.open(frames)
        if isinstance(opened, bytes):
            return [[b"", END_SEQ_FRAME, opened]], False
        seq, stop = opened
        answer: list[list[bytes]] = []
        size = 0
        while seq < stop and (payload := self.batch(seq)) is not None:
            size += len(payload)
            if answer and size > REPLAY_MAX_BYTES:
                break
            answer.append([b"", encode_seq(seq), payload])
            seq += 1
        answer.append([b"", END_SEQ_FRAME, self.end()])
        return answer, True

    def open(self, frames: list[bytes]) -> tuple[int, int] | bytes:
        """A replay request's range of seqs to send, ``(first, stop)``, or its refusal (an encoded end message).

        The range starts at the request's start or at ``oldest`` if that is later, and holds at
        most ``REPLAY_MAX_BATCHES`` batches (the answer's bytes are counted as it is sent)."""
        oldest, next_seq = self.oldest, self.next_seq
        try:
            start = decode_replay_request(frames)
            if start > next_seq:
                raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"start {start} is past the next seq {next_seq}", "replay.start")
        except ProtocolError as exc:
            return encode_replay_end(replay_refusal(exc, oldest, next_seq, self.incarnation))
        first = max(start, oldest)
        return first, min(next_seq, first + REPLAY_MAX_BATCHES)

    def batch(self, seq: int) -> bytes | None:
        """The held payload of batch ``seq``; None once the ring dropped it (or before it exists)."""
        i = seq - self.oldest  # the ring's seqs are consecutive
        return self.ring[i][1] if 0 <= i < len(self.ring) else None

    def end(self, code: int = 0, reason: str = "", path: str = "") -> bytes:
        """An encoded end message with the ring's bounds now: served (code 0), or why not."""
        return encode_replay_end(ReplayEnd(self.oldest, self.next_seq, self.incarnation, code, reason, path))

    def sizes(self) -> dict[str, int]:
        """For the node's ``tables``: batches and bytes in the ring, events pending."""
        return {"events_ring": len(self.ring), "events_ring_bytes": self.ring_size, "events_pending": len(self._groups)}


def _keys_of(event: Event) -> int:
    return 0 if isinstance(event, Cleared) else len(event.keys)


def _part(event: Stored | Removed, start: int, stop: int) -> Stored | Removed:
    """``event`` with its keys ``start:stop`` (and their parents)."""
    if isinstance(event, Stored) and event.parents:
        return replace(event, keys=event.keys[start:stop], parents=event.parents[start:stop])
    return replace(event, keys=event.keys[start:stop])


def _halves(events: list[Event]) -> tuple[list[Event], list[Event]]:
    """``events`` cut in two, order kept, both non-empty: by keys (an event may be cut in two),
    or by events when they hold fewer than two keys."""
    total = sum(_keys_of(e) for e in events)
    if total < 2:
        return events[: len(events) // 2], events[len(events) // 2:]
    left = total // 2  # keys the first half takes
    first: list[Event] = []
    for i, event in enumerate(events):
        n = _keys_of(event)
        if n <= left:
            first.append(event)
            left -= n
            if left == 0:
                return first, events[i + 1:]
            continue
        assert not isinstance(event, Cleared)  # n > left >= 1
        return [*first, _part(event, 0, left)], [_part(event, left, n), *events[i + 1:]]
    raise AssertionError("the keys ran out before half of them")
