"""The client's session with its node, sans I/O: what is in flight and what the node's frames mean.

Like h11 for HTTP, a ``ClientSession`` owns the session's state and none of its I/O: the
caller hands it the messages it sends and the frames and notifications that arrive, with
the time, and gets back the frames to put on the wire and the events to act on
(architecture §4). It imports no socket, thread or clock, so every rule below runs in
process against the node's router with a fake clock (tests/client/test_session.py):

- the session's state (``SessionState``): hello sent, open once welcomed at the version
  both ends speak (spec section 7), closing once ``bye`` is out, closed; ``lost`` once the
  node disconnected or fell silent for three heartbeat intervals (spec section 14);
- the in-flight table: each request's opaque handle (the caller's future), its deadline
  (its timeout plus a grace), whether it may touch client memory, whether the caller holds
  memory for it until it settles, whether it observes progress and notifications;
- timed-out memory holds: a request that may touch client memory and holds some, and gets
  no answer in time, fails for its waiter but stays held until the node's late answer or
  the session's end (spec section 5.1);
- heartbeats and the node's silence, and the matching of NIXL notifications to the
  requests they name (spec section 6.10).

Whoever drives a session does so from one thread at a time (the client core holds its I/O
lock). The counts the core reads between turns without that lock (``touching``,
``nearest``, ``next_heartbeat``) are plain attributes, kept up to date where the tables change.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

from kvcr_client.errors import ClientClosed, NodeError, NodeLostError, OperationTimeout
from kvcr_protocol import (
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
    RemoteProtocolError,
    Welcome,
    decode,
    decode_notification,
    encode,
    session_rules,
)
from kvcr_protocol.session_rules import Role, SessionState

H = TypeVar("H")
"""The caller's handle for a request (the core's future); the session never looks inside it."""

_GRACE_S = 2.0
"""How long after an operation's deadline the client still waits for the node's answer."""
_SILENCE_SLACK_S = 1.0
"""Beyond three heartbeat intervals of silence, how much longer before the node counts as lost."""
CAPACITY_EVENTS_KEPT = 1024
"""The node's most recent ``capacity`` events the session keeps for the caller to read."""


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Replied(Generic[H]):
    """The node answered the request of ``handle`` with ``message`` (not an ``error``)."""

    handle: H
    message: Message


@dataclass(frozen=True, slots=True)
class Failed(Generic[H]):
    """The request of ``handle`` failed: refused by the node, timed out, or the session is over."""

    handle: H
    error: Exception


@dataclass(frozen=True, slots=True)
class Settled(Generic[H]):
    """The node can no longer touch the memory the request of ``handle`` holds: let it go."""

    handle: H


@dataclass(frozen=True, slots=True)
class Observed(Generic[H]):
    """A ``progress`` event or a NIXL notification for the pending request of ``handle``."""

    handle: H
    message: Progress | Notification


@dataclass(frozen=True, slots=True)
class Capacity:
    """The node's ``capacity`` event (also kept in ``ClientSession.capacity_events``)."""

    event: CapacityEvent


@dataclass(frozen=True, slots=True)
class LeaseEnd:
    """The node ended (part of) a lease (spec section 6.11): an event, not a reply."""

    event: LeaseEnded


@dataclass(frozen=True, slots=True)
class Lost:
    """The session declared the node lost; every request fails after this event."""

    reason: str


@dataclass(frozen=True, slots=True)
class SendFrame:
    """A frame the session itself sends (a heartbeat): put it on the wire."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A frame from the node that does not decode: dropped (the caller may log it)."""

    error: RemoteProtocolError


@dataclass(frozen=True, slots=True)
class Unmatched:
    """A reply for no request in flight (answered already, or its waiter gone): dropped."""

    message: Message


Event: TypeAlias = (
    "Replied[H] | Failed[H] | Settled[H] | Observed[H] | Capacity | LeaseEnd | Lost | SendFrame | Undecodable | Unmatched"
)


# --------------------------------------------------------------------------- the session


class InFlight(Generic[H]):
    """What the session keeps for one request it sent."""

    __slots__ = ("deadline", "handle", "holds", "observed", "tag", "touches_memory")

    def __init__(self, handle: H, tag: str, deadline: float, touches_memory: bool, holds: bool, observed: bool) -> None:
        self.handle = handle
        self.tag = tag
        """The request's type: what may answer it is the session rules' (``session_rules.answers``)."""
        self.deadline = deadline
        """When the client stops waiting (caller's clock); infinite for a deadline left to the node."""
        self.touches_memory = touches_memory
        self.holds = holds
        """The caller holds memory for it until ``Settled`` (kept past a timeout until the node answers)."""
        self.observed = observed
        """Its ``progress`` events and notifications are wanted (``Observed``)."""


class ClientSession(Generic[H]):
    """One client's session with its node, sans I/O (see the module)."""

    def __init__(self, versions: tuple[int, ...], endpoint: str = "the node") -> None:
        self.versions = versions
        """The versions offered in hello, lowest first."""
        self.endpoint = endpoint
        """The node's endpoint, for error messages only."""
        self.state = SessionState.IDLE
        self.lost = False
        """The node disconnected or fell silent: requests fail ``NodeLostError`` until ``reopen``."""
        self.version = 0
        """The version agreed in the welcome (0 before any)."""
        self.welcome: Welcome | None = None
        self.resume = b""
        """The resume token of the latest session the node welcomed (version 5): the next
        ``hello`` may present it, so that the node ends that session at once and frees its
        puts (spec section 5.2). Kept across a loss; dropped by ``bye``."""
        self.pending: dict[int, InFlight[H]] = {}
        self.timed_out: dict[int, InFlight[H]] = {}
        """Memory-holding requests the client stopped waiting for, until the node answers."""
        self.lingering: set[int] = set()
        """Answered operations whose writes may still land with notifications (a key failed
        ``DESTINATION_UNCERTAIN``, spec section 12); the caller adds and discards them, the
        session's end empties it."""
        self.touching = 0
        """Pending requests that may touch client memory."""
        self.nearest = math.inf
        """No pending deadline is earlier (may be early, never late)."""
        self.next_heartbeat = math.inf
        """When the heartbeat and the node's silence are next looked at."""
        self.last_sent = 0.0
        self.last_heard = 0.0
        self.probed_at: float | None = None
        """When the oldest heartbeat the node has not answered went (None: the node spoke since
        the last one): ``unanswered_s``."""
        self._probed_before: float | None = None
        self.heartbeats = 0
        self.notifications: collections.Counter[str] = collections.Counter()
        """NIXL notifications seen: matched to a pending request, ignored, malformed."""
        self.capacity_events: collections.deque[CapacityEvent] = collections.deque(maxlen=CAPACITY_EVENTS_KEPT)
        self._hello_id = 0
        self._bye_id = 0
        self._sent_before = 0.0
        """``last_sent`` before the latest send, for a send the wire did not take (``unsent``)."""

    # ------------------------------------------------------------------ state

    @property
    def connected(self) -> bool:
        """Welcomed and neither closed nor lost."""
        return self.state is SessionState.OPEN or self.state is SessionState.CLOSING

    @property
    def heartbeat_s(self) -> float:
        """The node's heartbeat interval from the welcome (0: no heartbeats)."""
        welcome = self.welcome
        return welcome.heartbeat_ms / 1000 if welcome is not None and welcome.heartbeat_ms else 0.0

    def unanswered_s(self, now: float) -> float:
        """How long the oldest heartbeat the node has not answered has waited, with not a word
        from the node since (0: none, or not connected). The node's loop answers a heartbeat
        in its next turn, whatever its other requests wait for (a source's dial, a transfer),
        so this grows past a turn only when the node or the path to it stalls (frozen,
        swapping), long before three heartbeat intervals of silence declare it lost. A
        caller that cannot wait on a stalled node ``probe``s as it sends (an engine's lookup)
        and treats the node as away past a bound of its own (``NodeLink.stalled``)."""
        if not self.connected or self.probed_at is None:
            return 0.0
        return max(0.0, now - self.probed_at)

    def refusal(self) -> Exception | None:
        """Why no request may be sent now (None: it may). Before the welcome requests go out:
        the node answers what its own rules forbid (spec section 4), so those errors come from one place."""
        if self.lost:
            return NodeLostError(f"not connected to {self.endpoint}; call reconnect()")
        if self.state is SessionState.CLOSED:
            return ClientClosed("the client is closed")
        return None

    def reopen(self) -> None:
        """A fresh connection to the node: a loss is over, a hello may follow."""
        self.lost = False
        if self.state is SessionState.CLOSED:
            self.state = SessionState.IDLE

    def next_due(self) -> float:
        """The earliest time ``timeouts`` has something to do (caller's clock)."""
        return min(self.nearest, self.next_heartbeat)

    # ------------------------------------------------------------------ sending

    def send(
        self, op_id: int, message: Message, now: float, timeout_s: float, handle: H,
        touches_memory: bool = False, holds: bool = False, observed: bool = False,
    ) -> bytes:
        """Take request ``message`` into the in-flight table under ``op_id``; the frame to send.

        Raises ``NodeLostError`` or ``ClientClosed`` when the session forbids sending, and
        ``LocalProtocolError`` when the message does not encode; nothing is kept then. A
        ``hello`` opens the session when it is welcomed, a ``bye`` closes it when answered.
        """
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        kind = type(message)
        if not session_rules.allowed(Role.CLIENT, self.state, kind.TAG):
            raise LocalProtocolError(
                ErrorCode.BAD_STATE, f"{kind.TAG} may not be sent while the session is {self.state.value} (spec section 5.2)", "t",
            )
        conflict = session_rules.request_id_conflict(op_id, self.pending)
        if conflict is not None or op_id <= 0:
            # Ids are unique among the requests in flight and never 0 (spec section 5.1).
            raise LocalProtocolError(ErrorCode.BAD_STATE, conflict.reason if conflict else f"request id {op_id} is not positive", "id")
        frame = encode(message, self.version or self.versions[0])
        if kind is Hello:
            self._hello_id = op_id
            if not self.connected:
                self.state = SessionState.HELLO_SENT
        elif kind is Bye and self.connected:
            self._bye_id = op_id
            self.resume = b""  # the session ends by bye: nothing to resume
            self.state = SessionState.CLOSING
        entry = InFlight(handle, kind.TAG, now + timeout_s + _GRACE_S, touches_memory, holds, observed)
        self.pending[op_id] = entry
        if entry.deadline < self.nearest:
            self.nearest = entry.deadline
        if touches_memory:
            self.touching += 1
        self._sent(now)
        return frame

    def _sent(self, now: float) -> None:
        self._sent_before, self.last_sent = self.last_sent, now

    def _beat(self, now: float) -> list[Event[H]]:
        """A heartbeat sent now: the frame, and the node owes its answer (``unanswered_s``)."""
        self.heartbeats += 1
        self._sent(now)
        self._probed_before = self.probed_at
        if self.probed_at is None:
            self.probed_at = now
        return [SendFrame(encode(Heartbeat(self.heartbeats), self.version))]

    def probe(self, now: float) -> list[Event[H]]:
        """A heartbeat now, unless one is unanswered already or the session is not open: the
        node's loop answers it in its next turn whatever its other requests wait for, so a
        caller learns within its own bound whether the node stalled (``unanswered_s``)."""
        if not self.connected or self.probed_at is not None:
            return []
        return self._beat(now)

    def unsent(self, op_id: int) -> None:
        """The wire did not take the frame of ``op_id`` (the socket's queue is full): forget it."""
        entry = self.pending.pop(op_id, None)
        if entry is not None and entry.touches_memory:
            self.touching -= 1
        self.last_sent = self._sent_before

    def heartbeat_unsent(self, now: float) -> None:
        """The wire did not take the heartbeat ``timeouts`` gave: try again soon."""
        self.last_sent, self.probed_at = self._sent_before, self._probed_before
        self._schedule_heartbeat(now)

    # ------------------------------------------------------------------ receiving

    def receive(self, frame: bytes, now: float) -> list[Event[H]]:
        """A frame from the node: what it means for the requests in flight."""
        self.last_heard, self.probed_at = now, None
        try:
            msg = decode(frame, self.version or self.versions[-1])
        except RemoteProtocolError as exc:
            return [Undecodable(exc)]
        kind = type(msg)
        if kind is Heartbeat:
            return []  # its id counts heartbeats, not requests
        if kind is Progress:
            assert isinstance(msg, Progress)
            # Not a reply: the request goes on (spec section 5.1).
            observed = self.pending.get(msg.id)
            return [Observed(observed.handle, msg)] if observed is not None and observed.observed else []
        if kind is CapacityEvent:
            assert isinstance(msg, CapacityEvent)
            self.capacity_events.append(msg)
            return [Capacity(msg)]
        if kind is LeaseEnded:
            assert isinstance(msg, LeaseEnded)
            return [LeaseEnd(msg)]  # its id counts the session's events (spec section 6.11)
        return self._reply(msg, now)

    def _reply(self, msg: Message, now: float) -> list[Event[H]]:
        op_id: int = getattr(msg, "id", 0)
        entry = self.pending.pop(op_id, None)
        if entry is None:
            late = self.timed_out.pop(op_id, None)
            if late is not None:
                # The answer the client stopped waiting for: the node is done with its memory.
                return [Settled(late.handle)]
            return [Unmatched(msg)]
        if entry.touches_memory:
            self.touching -= 1
        problem: ProtocolError | None = None
        if op_id == self._hello_id:
            problem = self._hello_answered(msg, now)
        elif op_id == self._bye_id and self.state is SessionState.CLOSING:
            self.state = SessionState.CLOSED
        handle = entry.handle
        events: list[Event[H]] = [Settled(handle)] if entry.holds else []
        if problem is not None:
            events.append(Failed(handle, problem))
        elif isinstance(msg, Error):
            events.append(Failed(handle, NodeError(msg.code, msg.reason, msg.path)))
        elif msg.TAG not in session_rules.answers(Role.CLIENT, entry.tag):
            # Not what answers that request (spec section 5.1): it fails, the session goes on.
            events.append(Failed(handle, NodeError(ErrorCode.WRONG_TYPE, f"{msg.TAG} does not answer {entry.tag}", "t")))
        else:
            events.append(Replied(handle, msg))
        return events

    def _hello_answered(self, msg: Message, now: float) -> ProtocolError | None:
        """Welcomed: the session is open at the version agreed; refused: no session yet. A
        welcome at a version the client did not offer closes the session (spec section 5.2):
        nothing more goes on it, and the hello fails with that problem."""
        self._hello_id = 0
        if isinstance(msg, Welcome) and msg.version not in self.versions:
            self.state = SessionState.CLOSED
            return RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"the node chose version {msg.version}, which is not one offered ({list(self.versions)})", "version",
            )
        if isinstance(msg, Welcome):
            self.version = msg.version
            self.welcome = msg
            self.resume = msg.resume
            self.state = SessionState.OPEN
            self.last_heard = now
            self.next_heartbeat = now  # the next ``timeouts`` schedules the first
        elif self.state is SessionState.HELLO_SENT:
            self.state = SessionState.IDLE
        return None

    def notified(self, payload: bytes) -> list[Event[H]]:
        """A kvcr notification drained from the client's agent: to the pending request it names
        (spec section 6.10); others are counted and left alone. Notifications are hints: the
        control messages alone complete every group."""
        try:
            note = decode_notification(payload)
        except RemoteProtocolError:
            self.notifications["malformed"] += 1
            return []
        entry = self.pending.get(note.request)
        if entry is None or not entry.observed:
            self.notifications["ignored"] += 1
            return []
        self.notifications["matched"] += 1
        return [Observed(entry.handle, note)]

    # ------------------------------------------------------------------ time

    def timeouts(self, now: float) -> list[Event[H]]:
        """Deadlines past ``now`` fail; the heartbeat due is sent; a node silent too long is lost."""
        events: list[Event[H]] = []
        if now >= self.nearest:
            self._expire(now, events)
        if now >= self.next_heartbeat:
            self._heartbeat(now, events)
        return events

    def _expire(self, now: float, events: list[Event[H]]) -> None:
        for op_id in [i for i, e in self.pending.items() if e.deadline <= now]:
            entry = self.pending.pop(op_id)
            if entry.touches_memory:
                self.touching -= 1
                if entry.holds:
                    # The node may still move its bytes: keep holding its memory until it answers.
                    self.timed_out[op_id] = entry
            elif entry.holds:
                events.append(Settled(entry.handle))
            if op_id == self._hello_id:
                # Unanswered (the node was away): a later hello may go, and a late welcome
                # of this one matches nothing.
                self._hello_id = 0
                if self.state is SessionState.HELLO_SENT:
                    self.state = SessionState.IDLE
            error = OperationTimeout(f"operation {op_id}: no answer from {self.endpoint} within its deadline")
            events.append(Failed(entry.handle, error))
        self.nearest = min((e.deadline for e in self.pending.values()), default=math.inf)

    def _heartbeat(self, now: float, events: list[Event[H]]) -> None:
        """Say we are alive when idle; a node silent for three intervals is lost."""
        interval = self.heartbeat_s
        if not interval or not self.connected:
            self.next_heartbeat = math.inf
            return
        if now - self.last_heard > 3 * interval + _SILENCE_SLACK_S:
            silent = f"the node at {self.endpoint} has been silent for {now - self.last_heard:.1f} s"
            events.extend(self.lose(NodeLostError(silent)))
            return
        if now - self.last_sent >= interval:
            events.extend(self._beat(now))
        self._schedule_heartbeat(now)

    def _schedule_heartbeat(self, now: float) -> None:
        interval = self.heartbeat_s
        if not interval or not self.connected:
            self.next_heartbeat = math.inf
            return
        silence = 3 * interval + _SILENCE_SLACK_S
        self.next_heartbeat = min(max(self.last_sent + interval, now + interval / 8), self.last_heard + silence)

    # ------------------------------------------------------------------ the end

    def disconnected(self, reason: str) -> list[Event[H]]:
        """The connection to the node dropped: an open session is lost (spec section 14)."""
        if not self.connected:
            return []
        return self.lose(NodeLostError(reason))

    def lose(self, error: Exception) -> list[Event[H]]:
        """Declare the node lost: the session is over, every request fails with ``error`` and settles."""
        self.lost = True
        self.state = SessionState.CLOSED
        self.next_heartbeat = math.inf
        return [Lost(str(error)), *self.fail_all(error)]

    def close(self) -> list[Event[H]]:
        """The client closes: the session is over, every request fails ``ClientClosed`` and settles."""
        self.state = SessionState.CLOSED
        self.next_heartbeat = math.inf
        return self.fail_all(ClientClosed("the client is closed"))

    def fail_all(self, error: Exception) -> list[Event[H]]:
        """Every request fails with ``error`` and everything held settles (the session is over,
        or the node refused the connection itself)."""
        pending, self.pending = self.pending, {}
        late, self.timed_out = self.timed_out, {}
        if self._hello_id in pending:
            # The hello failed with the rest (the handshake refused, or broken as a restarting
            # node died under it): a later hello may go, as after a hello that timed out.
            self._hello_id = 0
            if self.state is SessionState.HELLO_SENT:
                self.state = SessionState.IDLE
        self.lingering.clear()
        self.touching = 0
        self.nearest = math.inf
        events: list[Event[H]] = [Settled(e.handle) for e in late.values()]
        for entry in pending.values():
            if entry.holds:
                events.append(Settled(entry.handle))
            events.append(Failed(entry.handle, error))
        return events
