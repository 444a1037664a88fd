"""The client's background thread against callers in many threads (issue #10, defect 5).

The background thread decides each turn whether memory-touching operations are pending
(to progress the NIXL agent) and how long it may sleep. It used to walk the pending table
for that without the lock while callers added and removed entries, and died of
``dictionary changed size during iteration``; every pending operation then failed with
``NodeLostError`` and later ones hung with nobody reading their replies. These tests run
many requesting threads against the background thread with a tiny GIL switch interval,
so an unlocked walk of a shared table is interrupted by a mutation within moments.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcr_client import Client, KeyStatus, NodeLostError, OpHandle, Presence, Span
from kvcr_testing.health import assert_clean, wait_until
from kvcr_testing.layouts import Layout, Registrar
from kvcr_testing.nodes import frozen
from kvcr_testing.patterns import KiB, assert_bytes_equal, pattern

POOL = ("--pool", "kv:4KiB:64")
LAYOUT = Layout([(f"L{i}", "kv", 4 * KiB) for i in range(2)])
THREADS = 4
REQUESTS = 100
"""Requests per thread and round, issued while the node is frozen: the pending table grows large
(the client's socket queues them all: it has no high-water mark)."""
ROUNDS = 4
SETTLE_S = 20.0
SWITCH_S = 1e-6
"""A GIL switch interval that interrupts a Python-level walk of a table after a few items."""


@pytest.fixture
def fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_background_thread_survives_concurrent_requests(node_factory: Callable[..., Any], fast_switching: None) -> None:
    node = node_factory(*POOL)
    with Client(node.endpoint, name="race") as client:
        reg = Registrar(client)
        src = pattern(LAYOUT.nbytes, 1)
        region = reg(src)
        key = b"race/obj"
        assert client.deposit({key: LAYOUT.source_spans(region)}).result(10)[key].status is KeyStatus.STORED
        dst = pattern(LAYOUT.nbytes, 2)
        dregion = reg(dst)
        spans = [Span(n, dregion, o, s) for (n, _, s), o in zip(LAYOUT.spans, LAYOUT.offsets, strict=True)]
        for _ in range(ROUNDS):
            handles = _storm(client, node, key)
            # Nobody drives: the background thread reads every reply.
            assert wait_until(lambda handles=handles: all(h.future.done() for h in handles), SETTLE_S), (
                f"{sum(not h.future.done() for h in handles)} of {len(handles)} requests never completed"
            )
            assert all(h.result(0)[key].presence is Presence.HIT for h in handles)
        assert client.core.driver.thread.is_alive(), "the background thread died"
        assert not client.core.lost
        # Memory-touching requests after the storm: the agent is still progressed.
        assert all(h.result(10).all_ok for h in [client.deliver({key: spans}) for _ in range(8)])
        assert_bytes_equal(dst, src, "deliver after the storm")
        assert client.core.tables()["pending"] == 0
        assert_clean(client)
        reg.close()


def _storm(client: Client, node: Any, key: bytes) -> list[OpHandle[Any]]:
    """Threads issue queries to a frozen node while another does what the background thread does unlocked."""
    issued: list[list[OpHandle[Any]]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []

    def issue(out: list[OpHandle[Any]]) -> None:
        try:
            for _ in range(REQUESTS):
                out.append(client.query([key]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=issue, args=(issued[t],), name=f"issue-{t}") for t in range(THREADS)]

    def probe() -> None:
        # What the background thread does between turns, without the I/O lock: decide
        # whether memory-touching requests are pending and how long it may sleep.
        try:
            while any(t.is_alive() for t in threads):
                client.core.busy()
                client.core.idle_timeout()
        except BaseException as exc:
            errors.append(exc)

    prober = threading.Thread(target=probe, name="probe")
    # The frozen node answers nothing: the pending table grows while the threads add to it,
    # and the background thread wakes (hand-offs through its wake pipe) and looks at it.
    with frozen(node):
        for t in threads:
            t.start()
        prober.start()
        for t in [*threads, prober]:
            t.join(60)
    assert not any(t.is_alive() for t in [*threads, prober])
    assert errors == [], errors[:3]
    return [h for out in issued for h in out]


def test_background_thread_failure_is_logged_and_fails_fast(
    node_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the background thread ever fail: the failure is logged, nothing hangs, reconnect() recovers."""
    node = node_factory(*POOL)
    with Client(node.endpoint, name="bgfail") as client:
        core = client.core
        fired = threading.Event()
        original = core.driver.select_ready

        def broken(wait_s: float | None, background: bool = False) -> int:
            if threading.current_thread() is core.driver.thread and not fired.is_set():
                fired.set()
                raise RuntimeError("injected background failure")
            return original(wait_s, background)

        with caplog.at_level(logging.ERROR, logger="kvcr.client"):
            monkeypatch.setattr(core.driver, "select_ready", broken)
            core.driver.wake()
            assert wait_until(lambda: not core.driver.thread.is_alive(), 10.0)
        assert fired.is_set()
        assert any("background thread failed" in r.getMessage() for r in caplog.records), caplog.records
        # Nothing waits for a reply nobody would read: new work fails at once.
        assert core.lost
        with pytest.raises(NodeLostError):
            client.query([b"k"]).result(5)
        # reconnect() opens a new session with a new background thread.
        client.reconnect()
        assert core.driver.thread.is_alive()
        handle = client.query([b"k"])
        assert wait_until(lambda: handle.future.done(), 10.0)
        assert handle.result(0)[b"k"].presence is Presence.MISS
        assert_clean(client)
