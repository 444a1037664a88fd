"""Event loops that read the socket for their awaiters (architecture §4).

An asyncio caller that awaits a result lets its event loop read: the loop watches the
socket's descriptor while it has awaiters and takes a turn when it is readable, so the reply
resolves the awaiter in the loop's own thread. ``LoopReaders`` owns the loops that watch.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from kvcr_client.driver import MONITOR_READY, SOCKET_READY, Driver, Schedule
from kvcr_client.transport import Transport
from kvcr_client.waiters import _PARK_S, Waiters


class LoopReader:
    """An event loop that reads the socket for its awaiters.

    It watches duplicates of the socket's and the monitor's descriptors: they stay ours until
    the loop lets go of them, so a socket closed or reopened meanwhile never leaves the loop
    watching a number that now names something else.
    """

    __slots__ = ("awaiters", "fds", "generation", "idle_since", "loop", "release_due", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, generation: int, fds: tuple[int, ...]) -> None:
        self.loop = loop
        self.thread = threading.get_ident()
        self.generation = generation
        self.fds = fds
        self.awaiters = 0
        self.idle_since = 0.0
        """When its last awaiter ended (monotonic)."""
        self.release_due = False
        """Whether a timer will look whether the loop may let go of the socket."""


def _copy_outcome(source: Future[Any], target: asyncio.Future[Any]) -> None:
    """Resolve an asyncio future like a finished concurrent one (in the loop's thread)."""
    if target.done():
        return  # the awaiter was cancelled
    if source.cancelled():
        target.cancel()
        return
    exc = source.exception(0)
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result(0))


class LoopReaders:
    """The event loops that watch the core's socket (changed with the I/O lock held)."""

    def __init__(self, driver: Driver, transport: Transport, waiters: Waiters, schedule: Schedule) -> None:
        self.driver = driver
        self.transport = transport
        self.waiters = waiters
        self.schedule = schedule
        self.loops: dict[asyncio.AbstractEventLoop, LoopReader] = {}

    def __len__(self) -> int:
        return len(self.loops)

    def reading_here(self) -> bool:
        """Whether the calling thread runs an event loop that reads the socket, and no caller
        is blocked in a wait: the loop's turns are its callbacks, which must stay short (a
        put's WRITE is left to the background thread, ``kvcr_client.put_jobs``). While a
        caller waits the background thread parks and that caller's turns post, so a caller
        blocked on the loop's own thread (a handle's ``result()`` there) posts itself."""
        if self.waiters.count:
            return False
        here = threading.get_ident()
        return any(reader.thread == here for reader in self.loops.values())

    async def wait(self, future: Future[Any]) -> Any:
        """Await ``future`` with this event loop reading the socket meanwhile."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        thread = threading.get_ident()

        def resolved(done: Future[Any]) -> None:
            if threading.get_ident() == thread:
                _copy_outcome(done, waiter)  # read by this loop: no hand-off
                return
            try:
                loop.call_soon_threadsafe(_copy_outcome, done, waiter)
            except RuntimeError:
                pass  # the loop is closed: nobody awaits any more

        future.add_done_callback(resolved)
        reader = self._attach(loop)
        try:
            return await waiter
        finally:
            if reader is not None:
                self._detach(reader)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> LoopReader | None:
        """An awaiter of ``loop`` begins: the loop watches the current socket (None: no socket)."""
        reader = self.loops.get(loop)
        if reader is None or reader.generation != self.transport.generation:
            with self.driver.io_lock:
                reader = self._watch_from(loop, reader)
            if reader is None:
                return None
        reader.awaiters += 1
        if reader.awaiters == 1:
            waiters = self.waiters
            with waiters.lock:
                waiters.loop_waiting += 1
                waiters.orphaned = False
            if self.schedule.busy():
                waiters.resume.set()  # the loop cannot pace the agent: the background thread does
            elif waiters.selecting:
                self.driver.bg_wakeup.wake()  # move the background thread off the socket: the loop reads
        return reader

    def _watch_from(self, loop: asyncio.AbstractEventLoop, reader: LoopReader | None) -> LoopReader | None:
        """I/O lock held, in the loop's thread: make the loop watch the current socket."""
        if reader is not None:
            self._unwatch(reader)
        transport = self.transport
        if not transport.fds:
            return None
        fds = tuple(os.dup(fd) for fd in transport.fds)
        loop.add_reader(fds[0], self._loop_turn, False)
        loop.add_reader(fds[1], self._loop_turn, True)
        fresh = LoopReader(loop, transport.generation, fds)
        if reader is not None:
            fresh.awaiters = reader.awaiters
        self.loops[loop] = fresh
        return fresh

    def _detach(self, reader: LoopReader) -> None:
        """An awaiter of ``reader``'s loop ends; the loop lets go of the socket soon after its last."""
        reader.awaiters -= 1
        if reader.awaiters:
            return
        now = time.monotonic()
        waiters = self.waiters
        with waiters.lock:
            waiters.loop_waiting -= 1
            alone = not waiters.count and not waiters.loop_waiting
            if alone:
                waiters.waited_at = now
        if alone and self.schedule.pending():
            waiters.orphan()
        # Not at once: an awaiter usually follows soon (the next request's). One timer looks
        # after a while, however many awaiters come and go meanwhile.
        reader.idle_since = now
        if not reader.release_due:
            reader.release_due = True
            reader.loop.call_later(_PARK_S, self._release_idle, reader)

    def _release_idle(self, reader: LoopReader) -> None:
        """In the loop's thread: let go of the socket once the loop has had no awaiter for a while."""
        reader.release_due = False
        if reader.awaiters:
            return  # the next detach looks again
        later = reader.idle_since + _PARK_S - time.monotonic()
        if later > 0:
            reader.release_due = True
            reader.loop.call_later(later, self._release_idle, reader)
            return
        with self.driver.io_lock:
            self.release(reader)

    def release(self, reader: LoopReader) -> None:
        """I/O lock held: the loop stops watching; from another thread, in the loop's thread soon."""
        if self.loops.get(reader.loop) is reader:
            del self.loops[reader.loop]
        if not reader.fds:
            return
        if reader.loop.is_closed() or reader.thread == threading.get_ident():
            self._unwatch(reader)
            return
        try:
            reader.loop.call_soon_threadsafe(self._release_later, reader)
        except RuntimeError:  # closed meanwhile
            self._unwatch(reader)

    def release_all(self) -> None:
        """I/O lock held, the core closing: every loop stops watching."""
        for reader in list(self.loops.values()):
            self.release(reader)

    def _release_later(self, reader: LoopReader) -> None:
        with self.driver.io_lock:
            self._unwatch(reader)

    @staticmethod
    def _unwatch(reader: LoopReader) -> None:
        """In the loop's thread (or with the loop closed): stop watching and close the duplicates."""
        fds, reader.fds = reader.fds, ()
        for fd in fds:
            if not reader.loop.is_closed():
                reader.loop.remove_reader(fd)
            os.close(fd)

    def _loop_turn(self, monitor: bool) -> None:
        """The socket (or its monitor) is readable in a loop with awaiters: read, in the loop's thread."""
        driver = self.driver
        with driver.io_lock:
            # A closed core let go of every loop (``release_all``); a callback queued before may still run.
            if not driver.closed and not driver.reading and self.transport.sock is not None:
                self.schedule.turn(MONITOR_READY if monitor else SOCKET_READY)

    def rewatch(self) -> None:
        """I/O lock held, a new socket: each loop that reads watches it from now on."""
        for loop, reader in list(self.loops.items()):
            if reader.thread == threading.get_ident():
                self._watch_from(loop, reader)
                continue
            try:
                loop.call_soon_threadsafe(self._rewatch_later, loop)
            except RuntimeError:  # closed
                del self.loops[loop]
                self._unwatch(reader)

    def _rewatch_later(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.driver.io_lock:
            reader = self.loops.get(loop)
            if reader is not None and reader.generation != self.transport.generation:
                self._watch_from(loop, reader)
