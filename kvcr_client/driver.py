"""What moves the client core's socket: its I/O lock, the wake pipes, ``select`` and the
background thread (architecture §4).

``Driver`` owns the mechanics every reader of the socket shares: the lock held for short
turns, the pipes that wake a leading caller and the background thread, the descriptors each
of them selects on, and the background thread itself. It knows nothing of requests or
transfers. What a turn does and when one is due belong to the core, which hands the readers
(``kvcr_client.waiters``, ``kvcr_client.loops``) a ``Schedule``: six narrow callables, each
holding the core weakly, so nothing the driver or its readers hold leads back to the core
and a closed core goes without the cyclic collector.
"""

from __future__ import annotations

import math
import select
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvcr_client.transport import Transport
from kvcr_io.wake import WakePipe

SOCKET_READY = 1
MONITOR_READY = 2
"""What ``select`` found readable: the socket's descriptor, the monitor's."""

T = TypeVar("T")


def weakly(method: Callable[..., T], gone: T) -> Callable[..., T]:
    """``method`` (bound) called through a weak reference to its object; ``gone`` once that
    object no longer lives."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> T:
        bound = ref()
        return gone if bound is None else bound(*args)

    return call


@dataclass(frozen=True)
class Schedule:
    """What the socket's readers ask of the core that owns them: a turn, and when one is due."""

    turn: Callable[[int], None]
    """One turn with the I/O lock held, given what ``select`` found readable."""
    busy: Callable[[], bool]
    """Whether the agent needs pacing (memory-touching requests, or transfers, in flight)."""
    posting: Callable[[], bool]
    """Whether a job has a group to post at the next turn (take it at once)."""
    due: Callable[[], float]
    """The next time (monotonic) a deadline, the heartbeat or late progress needs a turn."""
    idle_timeout: Callable[[], float | None]
    """How long a reader may block in ``select`` with nothing to pace (None: until woken)."""
    pending: Callable[[], bool]
    """Whether requests await an answer."""

    @classmethod
    def weak(
        cls, turn: Callable[[int], None], busy: Callable[[], bool], posting: Callable[[], bool],
        due: Callable[[], float], idle_timeout: Callable[[], float | None], pending: Callable[[], bool],
    ) -> Schedule:
        """The schedule of bound methods, each held weakly (see the module)."""
        return cls(weakly(turn, None), weakly(busy, False), weakly(posting, False), weakly(due, math.inf),
                   weakly(idle_timeout, None), weakly(pending, False))


class Driver:
    """The I/O lock, the wake pipes, the descriptors to select on, and the background thread."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.io_lock = threading.RLock()
        """Whoever holds it owns the socket and the agent, for a short turn that never blocks."""
        self.reading = 0
        """How deep the lock holder is in reading replies (read and written with the lock held)."""
        self.closed = False
        self.wakeup = WakePipe()
        """Wakes a leading caller (its result came in on another thread, pacing starts, close)."""
        self.bg_wakeup = WakePipe()
        """Wakes the background thread (callers began waiting, a new socket, close)."""
        self.watch: tuple[int, ...] = (self.wakeup.read_fd,)
        self.bg_watch: tuple[int, ...] = (self.bg_wakeup.read_fd,)
        self.thread: threading.Thread | None = None

    def watch_socket(self) -> None:
        """Lock held, a new socket: readers select on its descriptors from now on (woken to)."""
        fds = self.transport.fds
        self.watch = (*fds, self.wakeup.read_fd)
        self.bg_watch = (*fds, self.bg_wakeup.read_fd)
        self.wake()

    def unwatch_socket(self) -> None:
        """Lock held, the socket closing: readers select on their wake pipes alone."""
        self.watch = (self.wakeup.read_fd,)
        self.bg_watch = (self.bg_wakeup.read_fd,)

    def wake(self) -> None:
        """Wake the background thread and a leading caller to look at the state again."""
        self.bg_wakeup.wake()
        self.wakeup.wake()

    def select_ready(self, wait_s: float | None, background: bool = False) -> int:
        """Block in select (no lock held) up to ``wait_s`` (None: until readable) on the socket
        and the caller's wake pipe (``background``: the background thread's); what is readable
        (``SOCKET_READY``, ``MONITOR_READY``)."""
        wakeup, watch = (self.bg_wakeup, self.bg_watch) if background else (self.wakeup, self.watch)
        try:
            readable = select.select(watch, (), (), wait_s)[0]
        except (OSError, ValueError):  # a descriptor closed under us (reconnect, close): look again
            return 0
        if not readable:
            return 0
        if wakeup.read_fd in readable:
            wakeup.drain()
        fds = self.transport.fds
        if not fds:
            return 0
        return (SOCKET_READY if fds[0] in readable else 0) | (MONITOR_READY if fds[1] in readable else 0)

    def start(self, run: Callable[[], None], name: str) -> None:
        """Start the background thread on ``run`` unless it runs (or the driver is closed)."""
        if self.closed or (self.thread is not None and self.thread.is_alive()):
            return
        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Close: wake every reader and wait (bounded) for the background thread to end."""
        self.closed = True
        self.wake()
        if self.thread is not None:
            self.thread.join(timeout)

    def close_pipes(self) -> None:
        self.wakeup.close()
        self.bg_wakeup.close()
