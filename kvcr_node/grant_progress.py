"""When the node's agent is progressed for the read and write grants it has given.

A client that holds a grant moves bytes with its own agent (spec sections 6.12 and 6.13);
the node's agent, the other end, needs progress too: to set up each client's connection at
its first transfer, and over UCX's TCP transport to send a READ's bytes, a socket buffer at
a time, inside its progress calls. Progressing it every turn would cost an idle node a tenth
of a core, so the pace is fast just after a grant or renew (``GRANT_BURST_S``) and while
its progress calls serve READs (each spending ``GRANT_SERVING_CPU_S`` of the loop thread's
CPU), else slow. Sans-I/O: it is given the time, the progress call and when the last grant
was given, and says when it wants the next call (architecture §6).
"""

from __future__ import annotations

import time
from collections.abc import Callable

GRANT_PROGRESS_S = 0.001
"""For ``GRANT_BURST_S`` after a read grant is given or renewed, the agent is progressed at
least this often: a client's first READ of the pools sets up its connection to our agent,
which needs both ends progressed (spec section 6.12, architecture §6)."""
GRANT_BURST_S = 0.5
GRANT_IDLE_PROGRESS_S = 0.05
"""Later, while grants are outstanding, this often: READs over shared memory or CMA need no
progress of ours, and a pace of 1 ms would cost the idle node a tenth of a core."""
GRANT_SERVING_CPU_S = 200e-6
"""A progress call for grants that used this much of the loop thread's CPU served a READ
(over UCX's TCP transport the target sends the READ's bytes inside its progress, a socket
buffer at a time: milliseconds; an idle call costs tens of microseconds): the agent is
progressed at ``GRANT_PROGRESS_S`` again until ``GRANT_SERVING_HOLD_S`` after the last such call."""
GRANT_SERVING_HOLD_S = 0.05


class GrantProgress:
    """The pace of the agent's progress calls while grants are outstanding."""

    def __init__(self, progress: Callable[[], object], granted_at: Callable[[], float],
                 cpu: Callable[[], float] = time.thread_time) -> None:
        self._progress = progress
        self._granted_at = granted_at
        """When the last read or write grant was given or renewed."""
        self._cpu = cpu
        self.next_at = 0.0
        """When the next progress call is due."""
        self._serving_until = 0.0

    def step(self, now: float) -> None:
        """Progress the agent if a call is due, and set when the next one is."""
        if now < self.next_at:
            return
        spent = self._cpu()
        self._progress()
        if self._cpu() - spent >= GRANT_SERVING_CPU_S:
            self._serving_until = now + GRANT_SERVING_HOLD_S
        self.next_at = now + self.pace(now)

    def pace(self, now: float) -> float:
        """How often the agent is progressed now: fast just after a grant or renew, and while
        its progress serves READs (UCX over TCP); else slowly."""
        fast = now - self._granted_at() < GRANT_BURST_S or now < self._serving_until
        return GRANT_PROGRESS_S if fast else GRANT_IDLE_PROGRESS_S
