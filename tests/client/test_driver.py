"""The client core's driver in process (``kvcr_client.driver``): select over stand-in
descriptors, wakes, the background thread's start and stop, and a schedule that holds the
core weakly."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from kvcr_client.driver import MONITOR_READY, SOCKET_READY, Driver, Schedule, weakly
from kvcr_client.transport import Transport

WAIT_S = 5.0


class Pipes:
    """A transport's two descriptors (the socket's, the monitor's) as pipes a test writes."""

    def __init__(self) -> None:
        self.socket = os.pipe()
        self.monitor = os.pipe()
        self.fds: tuple[int, ...] = (self.socket[0], self.monitor[0])

    def close(self) -> None:
        for fd in (*self.socket, *self.monitor):
            os.close(fd)


@pytest.fixture
def pipes() -> Iterator[Pipes]:
    p = Pipes()
    yield p
    p.close()


@pytest.fixture
def driver(pipes: Pipes) -> Iterator[Driver]:
    d = Driver(cast(Transport, pipes))
    yield d
    d.stop(WAIT_S)
    d.close_pipes()


def test_select_says_which_descriptor_is_readable(driver: Driver, pipes: Pipes) -> None:
    assert driver.select_ready(0.0) == 0, "nothing watched but the wake pipe, nothing readable"
    driver.watch_socket()
    driver.wakeup.drain()
    driver.bg_wakeup.drain()
    assert driver.select_ready(0.0) == 0
    os.write(pipes.socket[1], b"x")
    assert driver.select_ready(0.0) == SOCKET_READY
    assert driver.select_ready(0.0, background=True) == SOCKET_READY, "both readers watch the socket"
    os.write(pipes.monitor[1], b"x")
    assert driver.select_ready(0.0) == SOCKET_READY | MONITOR_READY
    driver.unwatch_socket()
    assert driver.select_ready(0.0) == 0, "a closed socket is watched no more"


def test_a_wake_ends_a_blocked_select_and_is_drained(driver: Driver) -> None:
    seen: list[tuple[int, float]] = []

    def blocked() -> None:
        t0 = time.monotonic()
        seen.append((driver.select_ready(None, background=True), time.monotonic() - t0))

    thread = threading.Thread(target=blocked)
    thread.start()
    driver.wake()
    thread.join(WAIT_S)
    assert not thread.is_alive() and seen and seen[0][0] == 0
    driver.wakeup.drain()
    assert driver.select_ready(0.0, background=True) == 0, "the wake was drained by the select it ended"


def test_the_background_thread_starts_once_and_stops(driver: Driver) -> None:
    running = threading.Event()

    def serve() -> None:
        running.set()
        while not driver.closed:
            driver.select_ready(None, background=True)

    driver.start(serve, "kvcr-io-test")
    first = driver.thread
    assert first is not None and running.wait(WAIT_S)
    driver.start(serve, "kvcr-io-test")
    assert driver.thread is first, "a running thread is not started twice"
    driver.stop(WAIT_S)
    assert not first.is_alive()
    driver.start(serve, "kvcr-io-test")
    assert driver.thread is first, "a closed driver starts nothing"


class Core:
    """What a schedule is made of: bound methods of an object that may go."""

    def __init__(self) -> None:
        self.turns: list[int] = []

    def turn(self, ready: int) -> None:
        self.turns.append(ready)

    def busy(self) -> bool:
        return True

    def due(self) -> float:
        return 1.0

    def idle(self) -> float | None:
        return 0.5


def test_a_schedule_holds_its_core_weakly() -> None:
    core = Core()
    schedule = Schedule.weak(core.turn, core.busy, core.busy, core.due, core.idle, core.busy)
    schedule.turn(SOCKET_READY)
    assert core.turns == [SOCKET_READY] and schedule.busy() and schedule.due() == 1.0 and schedule.idle_timeout() == 0.5
    del core
    gc.collect()
    # The core is gone: the readers' questions get the answers of a core with nothing to do.
    schedule.turn(SOCKET_READY)
    assert not schedule.busy() and not schedule.posting() and not schedule.pending()
    assert schedule.due() == float("inf") and schedule.idle_timeout() is None


def test_weakly_calls_through_while_the_object_lives() -> None:
    core = Core()
    call: Any = weakly(core.due, -1.0)
    assert call() == 1.0
    del core
    gc.collect()
    assert call() == -1.0
