"""Remote agents loaded into the client's own, off the threads that take the core's turns.

Loading a node's (or a source's) agent metadata into ours is NIXL's ``add_remote_agent``:
about 10 ms on this class of host, during which NIXL holds its own lock but lets go of the
GIL. Done in a turn, it stalled whoever took that turn: an engine's event loop, for its
first put or lease of every session. ``AgentLoads`` runs the loads one after another in a
thread of its own, which exists only while there is something to load; the client's agent
serializes its NIXL calls (``kvcr_io.agent``), so a turn's own calls meanwhile wait for the
load instead of racing it. A load's ``then`` runs with the I/O lock held once the agent is
loaded (or NIXL refused it), and then the turn-takers are woken to go on with what waited:
a lease's grants, a put's WRITEs.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("kvcr.client")

Loaded = Callable[[str | None], None]
"""Takes the loaded agent's name (None: NIXL refused the metadata), I/O lock held."""


class AgentLoads:
    """The loads asked for and not yet done, and the thread that does them."""

    def __init__(
        self, add_remote: Callable[[bytes], str], locked: Callable[[Callable[[], None]], Future[Any]],
        wake: Callable[[], None],
    ) -> None:
        self._add_remote = add_remote
        """The client agent's ``add_remote`` (NIXL serializes it against the turns' calls)."""
        self._locked = locked
        """Runs a function with the I/O lock held, even once the client closed (``ClientCore.call``):
        its outcome."""
        self._wake = wake
        """Wakes whoever takes the core's turns: what waited on a load goes on."""
        self._queue: collections.deque[tuple[bytes, Loaded]] = collections.deque()
        self._lock = threading.Lock()
        """Guards the queue and whether the thread runs (a leaf lock)."""
        self._running = False
        self.pending = 0
        """Loads asked for whose ``then`` has not run yet."""

    def load(self, metadata: bytes, then: Loaded) -> None:
        """Load ``metadata`` in the loader thread; ``then`` gets the agent's name (lock held)."""
        with self._lock:
            self._queue.append((metadata, then))
            self.pending += 1
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="kvcr-agent-load", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                metadata, then = self._queue.popleft()
            name: str | None
            try:
                name = self._add_remote(metadata)
            except Exception:  # refused (a malformed blob, an unreachable backend): no grants with it
                log.warning("kvcr client: NIXL refused a remote agent's metadata; its keys travel by deliver",
                            exc_info=True)
                name = None
            handled = self._locked(functools.partial(then, name))
            with self._lock:
                self.pending -= 1
            if handled.exception() is not None:  # the queue goes on whatever one ``then`` did
                log.error("kvcr client: handling a loaded agent failed", exc_info=handled.exception())
            self._wake()
