"""The callers blocked on results: one leads (drives the socket), the others follow, asleep.

``Waiters`` owns who waits (architecture §4; the client core's module docstring tells the
whole design): the first caller that blocks on a result leads, selecting on the socket
without the I/O lock and taking short turns with it until its own result is in; callers that
wait meanwhile follow, asleep until their result is in or the leader leaves and wakes one of
them to lead. The counts here also tell the background thread when to stay off the socket:
``serve`` is its loop, which reads only while nobody waits.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvcr_client.driver import Driver, Schedule
from kvcr_io.pacing import Pacer

_IDLE_S = 0.2
"""While requests are pending, the longest a waiter or the background thread blocks before it
looks at deadlines and heartbeats again."""
_PARK_S = 0.005
"""How long the background thread stays off the socket after callers stopped waiting (and an
event loop keeps watching it after its last awaiter)."""
_PARK_MAX_S = 0.02
"""Its longest park while callers keep waiting: each park that finds them still at it doubles. A
request sent within ``_PARK_S`` of a caller's wait that nobody waits on is read within this."""
_CLOSE_TIMEOUT_S = 5.0
"""How long ``close`` waits for the node to acknowledge ``bye`` and for the thread to end."""


class Follower:
    """A caller that waits while another leads: asleep until its result is in or it may lead."""

    __slots__ = ("event", "future")

    def __init__(self, future: Future[Any]) -> None:
        self.future = future
        self.event = threading.Event()

    def wake(self, _: object = None) -> None:
        self.event.set()


class Waiters:
    """Who waits on the core's results; every field but ``resume`` changes under ``lock`` (a leaf lock)."""

    def __init__(self, driver: Driver, schedule: Schedule) -> None:
        self.driver = driver
        self.schedule = schedule
        self.lock = threading.Lock()
        """Guards who waits: the leader, the followers, the counts below (a leaf lock)."""
        self.count = 0
        """Callers blocked in ``wait`` (the leader and its followers)."""
        self.leading = False
        self.leader_future: Future[Any] | None = None
        self.leader_thread = 0
        self.followers: collections.deque[Follower] = collections.deque()
        self.loop_waiting = 0
        """Event loops with awaiters (they read the socket themselves)."""
        self.waited_at = 0.0
        """When the last caller stopped waiting (monotonic)."""
        self.resume = threading.Event()
        """Wakes a parked background thread: requests are left with nobody waiting for them."""
        self.orphaned = False
        """Requests are pending that nobody waits for: the background thread reads them now."""
        self.parked = False
        self.selecting = False
        """Whether the background thread is (about to be) in select on the socket's descriptor."""

    def wait(self, future: Future[Any], timeout: float | None) -> Any:
        """Block until ``future`` is done, leading or following (see the module)."""
        driver = self.driver
        end = None if timeout is None else time.monotonic() + timeout
        if driver.reading and driver.io_lock._is_owned():  # type: ignore[attr-defined]
            return self._drive_nested(future, end)  # from a callback inside our own read
        follower = None
        with self.lock:
            self.count += 1
            self.orphaned = False
            if self.leading:
                follower = Follower(future)
                self.followers.append(follower)
            else:
                self._lead_as(future)
            selecting = self.selecting
        if selecting:
            driver.bg_wakeup.wake()  # move the background thread off the socket's descriptor
        leading = follower is None
        try:
            if follower is not None:
                leading = self._follow(follower, end)
            if leading:
                self._lead(future, end)
            return future.result(0)
        finally:
            self._stop_waiting(follower, leading)

    def _lead_as(self, future: Future[Any]) -> None:
        """Lock held: the calling thread leads until ``future`` is done."""
        self.leading = True
        self.leader_future = future
        self.leader_thread = threading.get_ident()

    def _follow(self, follower: Follower, end: float | None) -> bool:
        """Sleep until our result is in (False) or nobody leads and we do (True)."""
        future, event = follower.future, follower.event
        future.add_done_callback(follower.wake)
        while not future.done():
            with self.lock:
                if not self.leading:
                    self.followers.remove(follower)
                    self._lead_as(future)
                    return True
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise FutureTimeout()
            event.wait(remaining)
            event.clear()  # whatever woke us is looked at again above
        return False

    def _stop_waiting(self, follower: Follower | None, leading: bool) -> None:
        """A caller stops waiting: a leader hands over to a follower; the last one leaves the rest to the background."""
        with self.lock:
            self.count -= 1
            if leading:
                self.leading = False
                self.leader_future = None
            elif follower is not None and follower in self.followers:
                self.followers.remove(follower)
            successor = self.followers[0] if self.followers and not self.leading else None
            alone = not self.count and not self.loop_waiting
            if alone:
                self.waited_at = time.monotonic()
        if successor is not None:
            successor.wake()
        if alone and self.schedule.pending():
            self.orphan()  # nobody waits for what is left: the background thread reads it
        elif alone and self.schedule.posting():
            # A deliver under grants has groups left to post while the caller computes on
            # the one it waited for: the background thread posts them now, not after a park.
            self.resume.set()

    def orphan(self) -> None:
        """Requests are left that nobody waits for: the background thread reads them from now on."""
        self.orphaned = True
        self.resume.set()

    def pacing_starts(self) -> None:
        """The first memory-touching request: whoever reads must now progress the agent at a short interval."""
        if self.leading or self.selecting:
            self.driver.wake()  # a leader or the background thread blocked for longer: pace from now
        if self.loop_waiting:
            self.resume.set()  # event loops cannot pace: the background thread does

    def wake_leader(self, future: Future[Any]) -> None:
        """``future``'s outcome is in: wake the leader if it is its and another thread read it
        (the leader may be in select)."""
        if future is self.leader_future and self.leader_thread != threading.get_ident():
            self.driver.wakeup.wake()

    def _lead(self, future: Future[Any], end: float | None) -> None:
        """Select on the socket without the lock, then take a turn with it, until ``future`` is done."""
        driver, schedule = self.driver, self.schedule
        pacer: Pacer | None = None
        while not future.done():
            if driver.closed:
                # close() fails every pending request once the background thread has ended.
                future.exception(_CLOSE_TIMEOUT_S if end is None else max(0.0, end - time.monotonic()))
                return
            now = time.monotonic()
            if end is not None and now >= end:
                raise FutureTimeout()
            wait_s: float | None
            if schedule.busy():
                pacer = pacer or Pacer()
                wait_s = 0.0 if schedule.posting() else pacer.next()
            else:
                if pacer is not None:
                    pacer.reset()
                wait_s = schedule.idle_timeout()  # until the next deadline or heartbeat
            if end is not None and (wait_s is None or end - now < wait_s):
                wait_s = end - now
            ready = driver.select_ready(wait_s)
            with driver.io_lock:
                schedule.turn(ready)

    def _drive_nested(self, future: Future[Any], end: float | None) -> Any:
        """Wait from a callback that runs inside this thread's read (lock held): read on, nested."""
        driver, schedule = self.driver, self.schedule
        pacer = Pacer()
        while not future.done():
            now = time.monotonic()
            if end is not None and now >= end:
                raise FutureTimeout()
            wait_s = _IDLE_S if end is None else min(_IDLE_S, end - now)
            if schedule.busy():  # the agent needs pacing (READs under grants among them)
                wait_s = min(wait_s, 0.0 if schedule.posting() else pacer.next())
            schedule.turn(driver.select_ready(wait_s))
        return future.result(0)

    def serve(self) -> None:
        """The background thread's loop (architecture §4): it reads only when nobody waits.

        While callers wait, and for a few milliseconds after they stop (they usually wait
        again), it stays off the socket and asleep, so a reply wakes only the thread that
        waits for it; it still paces the agent while memory-touching requests are pending
        and only event loops wait. Idle, it blocks in ``select`` and costs nothing.
        """
        driver, schedule = self.driver, self.schedule
        pacer = Pacer()
        park = _PARK_S
        while not driver.closed:
            self.resume.clear()
            now = time.monotonic()
            busy = schedule.busy()
            pending = schedule.pending()
            with self.lock:
                if not pending:
                    self.orphaned = False
                # Park while callers wait (they read and pace), and, unless the agent
                # needs pacing, while event loops wait and a moment after callers stopped
                # without leaving requests behind (they usually wait again): a second
                # thread woken per reply costs a GIL hand-off.
                parked = bool(self.count or (not busy and (
                    self.loop_waiting or (not self.orphaned and now - self.waited_at < park)
                )))
                self.parked = parked
                self.selecting = not parked
            if parked:
                self.resume.wait(max(0.0, min(park, schedule.due() - now)))
                self.parked = False
                if not driver.closed and time.monotonic() >= schedule.due():
                    with driver.io_lock:  # a deadline or heartbeat nobody else is awake for
                        schedule.turn(0)
                park = min(2 * park, _PARK_MAX_S)
                continue
            park = _PARK_S
            wait_s: float | None
            if busy:
                wait_s = 0.0 if schedule.posting() else pacer.next()
            else:
                pacer.reset()
                wait_s = schedule.idle_timeout()
            ready = driver.select_ready(wait_s, background=True)
            self.selecting = False
            if driver.closed:
                break
            if self.count:
                continue  # a caller leads now: its turns read (the monitor too)
            with driver.io_lock:
                schedule.turn(ready)
