"""``AgentLoads``: remote agents load in a thread of their own, one after another, and what
waits on a load goes on with the I/O lock held (``kvcr_client.agent_loads``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcr_client.agent_loads import AgentLoads
from kvcr_testing.health import wait_until


def call_locked(lock: Any, fn: Callable[[], Any]) -> Future[Any]:
    """``fn``'s outcome, run holding ``lock`` (what ``ClientCore.call`` does with its I/O lock)."""
    future: Future[Any] = Future()
    with lock:
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)
    return future


class Fake:
    """The client's side of the loads: an agent that loads when told to, a lock, a wake."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.gate = threading.Event()
        self.loading: list[tuple[bytes, str]] = []
        self.handled: list[tuple[str | None, bool, str]] = []
        self.wakes = 0

    def add_remote(self, metadata: bytes) -> str:
        self.loading.append((metadata, threading.current_thread().name))
        assert self.gate.wait(10)
        if metadata == b"bad":
            raise RuntimeError("NIXL: malformed metadata")
        return "agent-" + metadata.decode()

    def locked(self, fn: Callable[[], None]) -> Future[Any]:
        return call_locked(self.lock, fn)

    def wake(self) -> None:
        self.wakes += 1

    def then(self, name: str | None) -> None:
        self.handled.append((name, self.lock._is_owned(), threading.current_thread().name))  # type: ignore[attr-defined]


def test_loads_run_in_order_off_the_caller_and_hand_over_with_the_lock_held() -> None:
    fake = Fake()
    loads = AgentLoads(fake.add_remote, fake.locked, fake.wake)
    loads.load(b"n", fake.then)
    loads.load(b"bad", fake.then)
    loads.load(b"s", fake.then)
    assert loads.pending == 3 and fake.handled == [], "the caller never waits for a load"
    fake.gate.set()
    assert wait_until(lambda: loads.pending == 0, 10)
    assert [m for m, _ in fake.loading] == [b"n", b"bad", b"s"], "one at a time, in order"
    assert {t for _, t in fake.loading} == {"kvcr-agent-load"}
    assert fake.handled == [("agent-n", True, "kvcr-agent-load"), (None, True, "kvcr-agent-load"),
                            ("agent-s", True, "kvcr-agent-load")], "a refused load hands over None"
    assert fake.wakes == 3


def test_a_failing_handler_does_not_stop_the_loads_after_it_and_the_thread_ends() -> None:
    fake = Fake()
    fake.gate.set()
    loads = AgentLoads(fake.add_remote, fake.locked, fake.wake)

    def broken(name: str | None) -> None:
        raise ValueError("handler")

    loads.load(b"a", broken)
    loads.load(b"b", fake.then)
    assert wait_until(lambda: loads.pending == 0, 10)
    assert fake.handled == [("agent-b", True, "kvcr-agent-load")]
    assert wait_until(lambda: not any(t.name == "kvcr-agent-load" for t in threading.enumerate()), 10), \
        "the thread exists only while there is something to load"
    loads.load(b"c", fake.then)  # a later load starts it again
    assert wait_until(lambda: loads.pending == 0, 10) and fake.handled[-1][0] == "agent-c"
