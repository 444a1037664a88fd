"""Replay answers in progress, one per requester, within byte budgets (spec section 15.4).

Sans-I/O: ``Replays`` decides what to send to whom and when; the caller's ``send`` puts
one message on the replay socket and says whether it went (``Sent``). ZeroMQ tells no
sender how many bytes wait in a peer's queue, only that the queue is full (it counts
messages, ``REPLAY_HWM`` of them). So the node bounds bytes by construction:

- a requester's queue holds at most ``REPLAY_HWM`` messages, and ZeroMQ's I/O thread one
  more being written; every message is at most a batch (``BATCH_MAX_BYTES``) or an end
  message. Of what the node sent a requester, only its last ``REPLAY_HWM + 1`` messages can
  still be queued: their sizes are the requester's ``queued`` bytes, an upper bound, and at
  most ``REQUESTER_BYTES``;
- the ``queued`` bytes summed over the requesters tracked stay within the node's budget
  (``events_replay_bytes``): a message that would pass it waits;
- at most ``events_replay_requesters`` requesters are tracked, each until it disconnects;
  another gets only a refusal (``BUSY``), a message of a few bytes;
- a requester has one answer at a time: a request while its answer is being sent is
  refused (``BUSY``); an answer that cannot go on for ``REPLAY_STALL_S`` (the requester
  does not read, or the node's budget stays full) is cut: its end message says ``BUSY``
  and why, when the queue takes it;
- one loop turn sends at most ``REPLAY_SENDS_PER_TURN`` messages and
  ``REPLAY_SEND_BYTES_PER_TURN`` bytes, the requesters taking turns, so that replays cannot
  hold the loop while requests wait.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcr_node.counters import Count, Counters
from kvcr_node.inventory import BATCH_MAX_BYTES, REPLAY_MAX_BYTES, Inventory
from kvcr_protocol import ErrorCode
from kvcr_protocol.events import END_SEQ_FRAME, encode_seq

REPLAY_HWM = 16
"""Messages ZeroMQ queues for one requester (the replay socket's SNDHWM)."""
REQUESTER_BYTES = (REPLAY_HWM + 1) * (BATCH_MAX_BYTES + 64)
"""What one requester's queue can hold at most: ``REPLAY_HWM + 1`` messages of a batch and its frames."""
REPLAY_BYTES = 64 << 20
"""Default budget of the bytes queued for all requesters together (``events_replay_bytes``)."""
REPLAY_REQUESTERS = 64
"""Default number of requesters tracked at once (``events_replay_requesters``)."""
REPLAY_STALL_S = 2.0
"""An answer that cannot go on this long is cut (the reference subscriber waits 5 s for one)."""
REPLAY_SENDS_PER_TURN = 32
"""Replay messages one loop turn sends at most, over every requester."""
REPLAY_SEND_BYTES_PER_TURN = 256 << 10
"""Replay bytes one loop turn sends at most (the first message of a turn always goes)."""
REPLAY_RETRY_S = 0.002
"""An answer that could not go on is tried again after this (the socket has no per-peer
writable event), twice as long after each try that fails, up to ``REPLAY_RETRY_MAX_S``."""
REPLAY_RETRY_MAX_S = 0.064


class Sent(enum.Enum):
    """What the replay socket did with one message."""

    OK = "ok"
    FULL = "full"
    """The requester's queue is full (``zmq.Again`` under ROUTER_MANDATORY)."""
    GONE = "gone"
    """The requester is not connected (EHOSTUNREACH)."""


Send = Callable[[bytes, list[bytes]], Sent]
"""Send one message (frames after the identity) to a requester."""


class Stall(enum.Enum):
    """Why an answer did not go on in a turn."""

    NONE = "none"
    QUEUE = "queue"
    """The requester's queue is full: it does not read."""
    BUDGET = "budget"
    """The node's replay budget is in use by other requesters' queues."""


@dataclass(slots=True)
class Answer:
    """The part of one replay answer not sent yet: batches ``next`` to ``stop - 1``, then the end."""

    next: int
    stop: int
    since: float
    """When it last made progress (or began)."""
    size: int = 0
    """Payload bytes sent so far (at most ``REPLAY_MAX_BYTES``, the first batch always)."""
    stall: Stall = Stall.NONE
    retry_at: float = 0.0
    """When to try again after a stall (not before: a requester that does not read costs little)."""
    backoff: float = 0.0


@dataclass(slots=True)
class Requester:
    """One DEALER connected to the replay socket that asked for a replay."""

    fd: int
    """The connection's descriptor (ZMQ_SRCFD), by which its disconnection is known; -1: unknown."""
    window: collections.deque[int] = field(default_factory=collections.deque)
    """Sizes of the last ``REPLAY_HWM + 1`` messages sent to it: what its queue may still hold."""
    queued: int = 0
    answer: Answer | None = None


class Replays:
    """The requesters tracked, their answers in progress, and the bytes their queues may hold."""

    def __init__(
        self, inventory: Inventory, counters: Counters, clock: Callable[[], float],
        budget: int = REPLAY_BYTES, max_requesters: int = REPLAY_REQUESTERS,
    ) -> None:
        self.inventory = inventory
        self.counters = counters
        self.clock = clock
        self.budget = budget
        self.max_requesters = max_requesters
        self.requesters: dict[bytes, Requester] = {}
        self._by_fd: dict[int, bytes] = {}
        self._unreported: dict[int, int] = {}
        """Descriptor -> disconnections still to be reported of requesters already forgotten."""
        self._turns: collections.deque[bytes] = collections.deque()
        """Requesters with an answer in progress, in the order they take turns."""
        self.queued = 0
        """Bytes the requesters' queues may hold, summed (at most ``budget`` but for refusals)."""

    @property
    def active(self) -> bool:
        """Whether an answer waits to be sent (the loop then comes back soon)."""
        return bool(self._turns)

    def next_retry(self) -> float | None:
        """When the next answer in progress is due to be tried (None: none is in progress)."""
        due = [r.answer.retry_at for i in self._turns if (r := self.requesters.get(i)) is not None and r.answer]
        return min(due) if due else None

    # -- requests ---------------------------------------------------------------------

    def request(self, identity: bytes, fd: int, frames: list[bytes], send: Send) -> None:
        """A replay request from ``identity`` (the frames after it), on connection ``fd``."""
        opened = self.inventory.open(frames)
        if isinstance(opened, bytes):
            self.counters.inc(Count.EVENTS_REPLAYS_REFUSED)
            self._send_end(identity, opened, send)
            return
        requester = self.requesters.get(identity)
        if requester is None:
            old = self._by_fd.get(fd) if fd >= 0 else None
            if old is not None:  # that connection is gone (its descriptor was reused), not yet reported
                self._forget(old, unreported=True)
            if len(self.requesters) >= self.max_requesters:
                self.counters.inc(Count.EVENTS_REPLAYS_BUSY)
                reason = f"the node answers {self.max_requesters} replay requesters at most; ask again later"
                self._send_end(identity, self.inventory.end(ErrorCode.BUSY, reason, "replay"), send)
                return
            requester = self._track(identity, fd)
        if requester.answer is not None:
            self.counters.inc(Count.EVENTS_REPLAYS_BUSY)
            reason = "an answer to this requester is still being sent: read it whole before asking again"
            self._send_end(identity, self.inventory.end(ErrorCode.BUSY, reason, "replay"), send)
            return
        first, stop = opened
        requester.answer = Answer(first, stop, self.clock())
        self._turns.append(identity)

    def _track(self, identity: bytes, fd: int) -> Requester:
        if fd >= 0:
            self._by_fd[fd] = identity
        requester = self.requesters[identity] = Requester(fd)
        return requester

    # -- sending ----------------------------------------------------------------------

    def pump(self, send: Send) -> None:
        """One turn's sends: the requesters with answers take turns, within the turn's bounds."""
        now = self.clock()
        sends = size = 0
        for _ in range(len(self._turns)):
            if sends >= REPLAY_SENDS_PER_TURN or (sends and size >= REPLAY_SEND_BYTES_PER_TURN):
                break
            identity = self._turns.popleft()
            requester = self.requesters.get(identity)
            if requester is None or requester.answer is None:
                continue
            answer = requester.answer
            if answer.retry_at > now:
                self._turns.append(identity)
                continue
            answer.stall = Stall.NONE
            done = False
            while sends < REPLAY_SENDS_PER_TURN and not (sends and size >= REPLAY_SEND_BYTES_PER_TURN):
                message, last = self._next_message(answer)
                nbytes = sum(len(f) for f in message)
                if self.queued - self._leaving(requester) + nbytes > self.budget:
                    answer.stall = Stall.BUDGET
                    break
                result = send(identity, message)
                if result is Sent.GONE:
                    self._forget(identity, unreported=True)
                    done = True
                    break
                if result is Sent.FULL:
                    answer.stall = Stall.QUEUE
                    break
                self._account(requester, nbytes)
                sends, size = sends + 1, size + nbytes
                answer.since, answer.stall, answer.backoff = now, Stall.NONE, 0.0
                if last:
                    self.counters.inc(Count.EVENTS_REPLAYS)
                    requester.answer = None
                    done = True
                    break
                answer.size += len(message[2])
                answer.next += 1
            if done:
                continue
            if answer.stall is not Stall.NONE:
                if now - answer.since >= REPLAY_STALL_S:
                    self._cut(identity, requester, send)
                    continue
                answer.backoff = min(REPLAY_RETRY_MAX_S, max(REPLAY_RETRY_S, 2 * answer.backoff))
                answer.retry_at = min(now + answer.backoff, answer.since + REPLAY_STALL_S)
            self._turns.append(identity)

    def _next_message(self, answer: Answer) -> tuple[list[bytes], bool]:
        """The answer's next message, and whether it is its end."""
        if answer.next < answer.stop:
            payload = self.inventory.batch(answer.next)
            if payload is not None and not (answer.size and answer.size + len(payload) > REPLAY_MAX_BYTES):
                return [b"", encode_seq(answer.next), payload], False
        # Done, at the answer's bounds, or the ring dropped the rest meanwhile: the end says
        # where the ring starts now, and the subscriber asks again from where it stopped.
        return [b"", END_SEQ_FRAME, self.inventory.end()], True

    def _cut(self, identity: bytes, requester: Requester, send: Send) -> None:
        """The answer could not go on for ``REPLAY_STALL_S``: it ends here, counted ``cut``."""
        answer = requester.answer
        assert answer is not None
        requester.answer = None
        self.counters.inc(Count.EVENTS_REPLAY_CUT)
        why = ("the requester's queue stayed full (it does not read)" if answer.stall is Stall.QUEUE
               else "the node's replay budget stayed in use by other requesters")
        reason = f"answer cut before seq {answer.next}, stopped {REPLAY_STALL_S:g} s: {why}; ask again from there"
        self._send_end(identity, self.inventory.end(ErrorCode.BUSY, reason, "replay"), send)

    def _send_end(self, identity: bytes, end: bytes, send: Send) -> None:
        """An end message alone (a refusal, a cut): sent if the queue takes it, else lost (the
        requester times out). It is counted in the requester's bytes when it is tracked."""
        message = [b"", END_SEQ_FRAME, end]
        result = send(identity, message)
        requester = self.requesters.get(identity)
        if requester is None:
            return
        if result is Sent.OK:
            self._account(requester, sum(len(f) for f in message))
        elif result is Sent.GONE:
            self._forget(identity, unreported=True)

    def _leaving(self, requester: Requester) -> int:
        """Bytes that leave the requester's window when one more message is sent to it."""
        return requester.window[0] if len(requester.window) > REPLAY_HWM else 0

    def _account(self, requester: Requester, nbytes: int) -> None:
        gone = self._leaving(requester)
        if gone:
            requester.window.popleft()
        requester.window.append(nbytes)
        requester.queued += nbytes - gone
        self.queued += nbytes - gone

    # -- connections ------------------------------------------------------------------

    def disconnected(self, fd: int) -> None:
        """The connection ``fd`` closed: its requester's queue is gone with it."""
        if self._unreported.get(fd):
            # A requester already forgotten (found gone, or its descriptor reused): this is its
            # report, not one of the connection that may hold the descriptor now.
            self._unreported[fd] -= 1
            if not self._unreported[fd]:
                del self._unreported[fd]
            return
        identity = self._by_fd.get(fd)
        if identity is not None:
            self._forget(identity)

    def _forget(self, identity: bytes, unreported: bool = False) -> None:
        """Drop a requester; ``unreported``: it is gone, and its disconnection will be reported later."""
        requester = self.requesters.pop(identity, None)
        if requester is None:
            return
        if self._by_fd.get(requester.fd) == identity:
            del self._by_fd[requester.fd]
            if unreported and len(self._unreported) < self.max_requesters:
                self._unreported[requester.fd] = self._unreported.get(requester.fd, 0) + 1
        self.queued -= requester.queued
        if requester.answer is not None and identity in self._turns:
            self._turns.remove(identity)

    def sizes(self) -> dict[str, int]:
        """For the node's ``tables``: requesters tracked, answers in progress, bytes their queues may hold."""
        return {
            "events_replay_requesters": len(self.requesters),
            "events_replay_answers": sum(1 for r in self.requesters.values() if r.answer is not None),
            "events_replay_queued_bytes": self.queued,
        }
