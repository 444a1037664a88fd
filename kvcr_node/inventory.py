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
"""Encoded bytes one replay answer carries at most (its first batch always goes): what a
request can make the node queue for one subscriber."""

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

    def _add(self, kind: type[Stored] | type[Removed], entry: ObjectEntry, reason: RemovedReason) -> None:
        info = entry.info
        group: _Group = (kind, tuple(pool for pool, _ in info.need), self.tiers[info.layout[0][1]], reason)
        # Adjacent changes of one kind and layout share an event; order is never changed.
        if self._groups and self._groups[-1] == group:
            self._keys[-1].append(entry.key)
        else:
            self._groups.append(group)
            self._keys.append([entry.key])

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
        groups, pending = self._groups, self._keys
        self._groups, self._keys = [], []
        ts = self.wall()
        out: list[tuple[int, bytes]] = []
        events: list[Event] = []
        room = MAX_BATCH_KEYS
        for (kind, pools, tier, reason), keys in zip(groups, pending, strict=True):
            if kind is Cleared:
                events.append(Cleared())
                room -= 1
            while keys:
                if room <= 0:
                    out.append(self._publish(EventBatch(self.node, self.incarnation, ts, tuple(events))))
                    events, room = [], MAX_BATCH_KEYS
                part, keys = keys[:room], keys[room:]
                room -= len(part)
                if kind is Stored:
                    events.append(Stored(tuple(part), pools, tier))
                else:
                    events.append(Removed(tuple(part), pools, tier, reason))
        if events:
            out.append(self._publish(EventBatch(self.node, self.incarnation, ts, tuple(events))))
        return out

    def _publish(self, batch: EventBatch) -> tuple[int, bytes]:
        seq, payload = self.next_seq, encode_batch(batch)
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
        """The answer to a replay request (the frames after the sender's identity), and whether it was served.

        Held batches from the start on, at most ``REPLAY_MAX_BATCHES`` and ``REPLAY_MAX_BYTES``, then the end
        message with the ring's bounds; a request that is not one, or that starts past
        the next seq, gets only the end message, naming the field.
        """
        oldest, next_seq = self.oldest, self.next_seq
        try:
            start = decode_replay_request(frames)
            if start > next_seq:
                raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"start {start} is past the next seq {next_seq}", "replay.start")
        except ProtocolError as exc:
            end = replay_refusal(exc, oldest, next_seq, self.incarnation)
            return [[b"", END_SEQ_FRAME, encode_replay_end(end)]], False
        answer: list[list[bytes]] = []
        if start < next_seq:
            first = max(0, start - oldest)  # the ring's seqs are consecutive
            size = 0
            for i in range(first, min(len(self.ring), first + REPLAY_MAX_BATCHES)):
                seq, payload = self.ring[i]
                size += len(payload)
                if answer and size > REPLAY_MAX_BYTES:
                    break
                answer.append([b"", encode_seq(seq), payload])
        answer.append([b"", END_SEQ_FRAME, encode_replay_end(ReplayEnd(oldest, next_seq, self.incarnation))])
        return answer, True

    def sizes(self) -> dict[str, int]:
        """For the node's ``tables``: batches and bytes in the ring, events pending."""
        return {"events_ring": len(self.ring), "events_ring_bytes": self.ring_size, "events_pending": len(self._groups)}
