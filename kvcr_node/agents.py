"""The remote NIXL agents a node has loaded: clients', peers' and their clients'.

Loading an agent's metadata opens a UCX connection to it, and UCX closes that connection
only when our agent is progressed after the agent at the other end went away; removing
an agent whose process still lives leaves its connection open. So agents that nothing
holds any more are kept loaded ("departed", least recently released first) and reused
when they come back (a reconnecting client), and only those beyond ``DEPARTED_AGENTS``
are removed. An agent whose owner is known to be gone for good (``forget``: a target said
its client left, spec section 5.3) is removed as soon as nothing holds or runs on it,
instead of departing: removing it costs at most a connection until that process leaves,
and keeping it would hold the table at its bound. One that is announced again after that
(a live process cycling its sessions) departs the next time, like any other: removing it
on every cycle would cost a connection each time. An idle node still progresses its
agent every ``IDLE_PROGRESS_S``, so connections to agents that went away free their
descriptors (architecture §6).
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable

from kvcr_io.agent import Agent

log = logging.getLogger("kvcr.node")

DEPARTED_AGENTS = 64
"""Remote agents nothing holds that stay loaded, least recently released out first."""
FORGOTTEN_NAMES = 4096
"""Names of agents removed after a ``forget``, remembered (least recent out first) so that
one announced again is kept departed, not removed, when it is forgotten again."""
IDLE_PROGRESS_S = 1.0
"""With no transfer running, the agent is still progressed this often (on turns the loop makes anyway)."""


class AgentUse(enum.Enum):
    """Why a remote agent cannot be let go yet."""

    HELD = "held"
    """A session, a peer's announced client or a link names it; each releases it when it goes."""
    RUNNING = "running"
    """An operation or a transfer that may touch its memory is still running."""


class RemoteAgents:
    """Loads, holds and removes remote agents; ``use`` says who still needs one (the node knows)."""

    def __init__(self, agent: Agent, use: Callable[[str], AgentUse | None], clock: Callable[[], float]) -> None:
        self.agent = agent
        self.use = use
        self.clock = clock
        self.loaded: set[str] = set()
        self.pending: set[str] = set()
        """Released while still running: let go once nothing runs on them."""
        self.departed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.gone: set[str] = set()
        """Forgotten while still running: removed (not departed) once nothing runs on them."""
        self.forgotten: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Names removed after a forget (bounded by ``FORGOTTEN_NAMES``)."""
        self._next_progress = 0.0
        self.on_removed: Callable[[str], None] | None = None
        """Told the name of each agent removed from ours (puts wait for it, spec section 6.13)."""

    def add(self, metadata: bytes) -> str:
        """Load (or refresh) a remote agent's metadata; returns its name. Raises what NIXL raises."""
        name = self.agent.add_remote(metadata)
        self.loaded.add(name)
        self.pending.discard(name)
        self.gone.discard(name)  # announced again: it is someone's again
        self.departed.pop(name, None)
        return name

    def release(self, name: str) -> None:
        """A holder of ``name`` let go: once nothing holds or runs on it, it departs."""
        if name not in self.loaded or name in self.departed:
            return
        use = self.use(name)
        if use is not None:
            if use is AgentUse.RUNNING:
                self.pending.add(name)  # retried by release_pending as operations finish
            else:
                self.gone.discard(name)  # another holder has it: its own release decides
            return
        self.pending.discard(name)
        if name in self.gone:
            self._remove_forgotten(name)
            return
        self.departed[name] = None
        while len(self.departed) > DEPARTED_AGENTS:
            oldest, _ = self.departed.popitem(last=False)
            self._remove(oldest)

    def forget(self, name: str) -> None:
        """A holder of ``name`` let go and knows its owner left for good (a target's
        ``peer_forget``, spec section 5.3): once nothing else holds it and nothing runs on
        it, it is removed from NIXL rather than kept departed."""
        if name not in self.loaded:
            return
        if name in self.forgotten:
            # Removed after a forget before and announced again: its process lives and
            # cycles its sessions; keep it departed (reused when it returns).
            self.forgotten.move_to_end(name)
            self.release(name)
            return
        if self.departed.pop(name, None) is not None:
            self._remove_forgotten(name)
            return
        self.gone.add(name)
        self.release(name)

    def release_pending(self) -> None:
        for name in list(self.pending):
            self.release(name)

    def progress_idle(self) -> None:
        """Progress the agent at most every ``IDLE_PROGRESS_S``."""
        now = self.clock()
        if now >= self._next_progress:
            self._next_progress = now + IDLE_PROGRESS_S
            self.agent.progress()

    def sizes(self) -> dict[str, int]:
        return {
            "remote_agents": len(self.loaded),
            "remote_agents_departed": len(self.departed),
            "remote_agents_pending": len(self.pending),
            "remote_agents_gone": len(self.gone),
        }

    def _remove_forgotten(self, name: str) -> None:
        self._remove(name)
        self.forgotten[name] = None
        while len(self.forgotten) > FORGOTTEN_NAMES:
            self.forgotten.popitem(last=False)

    def remove_unused(self, name: str) -> bool:
        """Remove ``name`` now if it is loaded and nothing holds or runs on it; whether it is
        no longer loaded."""
        if name not in self.loaded:
            return True
        if self.use(name) is not None:
            return False
        self.departed.pop(name, None)
        self._remove(name)
        return True

    def _remove(self, name: str) -> None:
        if self.on_removed is not None:
            self.on_removed(name)
        self.loaded.discard(name)
        self.pending.discard(name)
        self.gone.discard(name)
        try:
            self.agent.remove_remote(name)
        except Exception:
            log.debug("removing remote agent %s failed", name, exc_info=True)
