"""Reconnecting to a node that went away, sans I/O: when to try again, and what happened.

A long-lived integration (an engine's connector) keeps one session with its node for hours;
the node may restart (a new incarnation) or stall (a paused process, a loaded host) and the
client then declares it lost (disconnected, or silent for three heartbeat intervals; spec
section 14). ``Reconnector`` decides, from the time it is given, when the next hello goes
out: at once after a loss, then with a backoff that grows by ``RECONNECT_FACTOR`` up to
``RECONNECT_MAX_S``, back to the start once a hello is welcomed. It sends nothing itself:
``poll(now)`` returns ``Action.CONNECT`` when the caller should send a hello (without
waiting for it, ``Client.start_reconnect``), and the caller reports how that ended
(``connected``, ``failed``). While it is not ``UP`` the caller treats the node as absent:
lookups are misses at once, loads fail, saves are skipped. ``counts`` say how often the
node went away, how long it stayed away and how many hellos it took.

The hello the caller sends presents the previous session's resume token (version 5: the
``welcome.resume`` that ``ClientSession.resume`` keeps across the loss), unless a WRITE of
one of its puts may still land: the node then ends that session at once and frees its puts,
instead of holding their slots until it finds the session silent (spec section 5.2).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

RECONNECT_FIRST_S = 0.25
"""The wait before the second hello after a loss (the first goes at once)."""
RECONNECT_FACTOR = 2.0
"""Each failed hello multiplies the wait before the next by this."""
RECONNECT_MAX_S = 5.0
"""The longest wait between two hellos: a node back after a restart is in use within it."""
HELLO_TIMEOUT_S = 2.0
"""How long a reconnecting hello may go unanswered before it counts as failed."""


class LinkState(enum.Enum):
    """Where the session with the node is."""

    UP = "a session is open"
    DOWN = "the node is away: waiting until the next hello is due"
    CONNECTING = "a hello is out, not answered yet"


class Action(enum.Enum):
    """What ``Reconnector.poll`` asks the caller to do."""

    NOTHING = "nothing to do now"
    CONNECT = "send a hello (not waited for), then report connected or failed"


@dataclass
class LinkCounts:
    """What a ``Reconnector`` saw, since it was made."""

    outages: int = 0
    """Times the node was found lost."""
    reconnects: int = 0
    """Hellos welcomed after an outage."""
    new_incarnations: int = 0
    """Reconnects that found another incarnation of the node (it restarted: what it held is gone)."""
    attempts: int = 0
    """Hellos sent after an outage."""
    failed_attempts: int = 0
    """Hellos that were refused or unanswered."""
    away_s: float = 0.0
    """Seconds the node was away, over the outages that ended."""


class Reconnector:
    """When to send the next hello to a node that was lost (see the module). Feed it the time
    (any monotonic clock, in seconds); it never reads a clock itself."""

    def __init__(
        self,
        incarnation: int | None = None,
        first_s: float = RECONNECT_FIRST_S,
        factor: float = RECONNECT_FACTOR,
        most_s: float = RECONNECT_MAX_S,
    ) -> None:
        if not (0 < first_s <= most_s) or factor < 1:
            raise ValueError(f"backoff needs 0 < first_s <= most_s and factor >= 1, not {first_s}, {most_s}, {factor}")
        self.first_s, self.factor, self.most_s = first_s, factor, most_s
        self.state = LinkState.UP
        self.incarnation = incarnation
        """The incarnation of the node of the session open now, or of the last one."""
        self.counts = LinkCounts()
        self.lost_at: float | None = None
        """When the current outage began (None: up)."""
        self.next_at = math.inf
        """When the next hello is due (while ``DOWN``)."""
        self.backoff_s = first_s
        """The wait after the next failed hello."""
        self.tries = 0
        """Hellos sent in the current (or the last) outage."""

    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    def lost(self, now: float) -> None:
        """The session was found lost: the next hello is due at once. A loss while a hello is
        out is that hello failing; one while already down changes nothing."""
        if self.state is LinkState.CONNECTING:
            self.failed(now)
            return
        if self.state is LinkState.DOWN:
            return
        self.state = LinkState.DOWN
        self.counts.outages += 1
        self.lost_at, self.next_at, self.backoff_s, self.tries = now, now, self.first_s, 0

    def poll(self, now: float) -> Action:
        """What to do at ``now``: ``CONNECT`` once the next hello is due (the state is then
        ``CONNECTING`` until ``connected`` or ``failed``)."""
        if self.state is LinkState.DOWN and now >= self.next_at:
            self.state = LinkState.CONNECTING
            self.counts.attempts += 1
            self.tries += 1
            return Action.CONNECT
        return Action.NOTHING

    def failed(self, now: float) -> None:
        """The hello out was refused or went unanswered: the next one waits the backoff, which grows."""
        if self.state is not LinkState.CONNECTING:
            return
        self.state = LinkState.DOWN
        self.counts.failed_attempts += 1
        self.next_at = now + self.backoff_s
        self.backoff_s = min(self.backoff_s * self.factor, self.most_s)

    def connected(self, now: float, incarnation: int | None) -> bool:
        """The hello out was welcomed by the node's ``incarnation``; whether that is another
        incarnation than before (the node restarted, and holds nothing of before)."""
        if self.state is not LinkState.CONNECTING:
            raise RuntimeError(f"a welcome while {self.state.name}: no hello was out")
        self.state = LinkState.UP
        self.counts.reconnects += 1
        if self.lost_at is not None:
            self.counts.away_s += max(0.0, now - self.lost_at)
        self.lost_at, self.next_at, self.backoff_s = None, math.inf, self.first_s
        restarted = incarnation != self.incarnation
        if restarted:
            self.counts.new_incarnations += 1
        self.incarnation = incarnation
        return restarted
