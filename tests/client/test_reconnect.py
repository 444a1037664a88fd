"""Reconnecting to a node that went away: ``Reconnector`` (sans I/O, on a fake clock) and
``NodeLink`` (the engine integrations' session with its node) across a real node killed and
restarted at the same endpoint, and a real node frozen (SIGSTOP) past the heartbeat silence.

The link answers at once while the node is away, sends hellos with the backoff, and once
welcomed the region it registered before is announced again: a deposit from it and a
deliver into it move the patterned bytes, checked byte for byte.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcr_client import Client, RegionHandle, Span
from kvcr_client.integrations.nodelink import NodeLink
from kvcr_client.reconnect import HELLO_TIMEOUT_S, RECONNECT_FIRST_S, RECONNECT_MAX_S, Action, LinkState, Reconnector
from kvcr_testing.health import assert_clean
from kvcr_testing.nodes import NodeProcess, frozen, start_node
from kvcr_testing.patterns import pattern

BOUND_S = 30.0
"""The most any wait here takes (bounded, never a bare sleep)."""
SLOT = 4096
log = logging.getLogger("kvcr.test.reconnect")


# ---------------------------------------------------------------------- the state machine


def test_first_hello_at_once_then_a_growing_backoff_up_to_the_most() -> None:
    r = Reconnector(incarnation=7)
    assert r.up and r.poll(0.0) is Action.NOTHING
    r.lost(100.0)
    assert r.state is LinkState.DOWN and r.counts.outages == 1
    assert r.poll(100.0) is Action.CONNECT and r.state is LinkState.CONNECTING
    assert r.poll(100.0) is Action.NOTHING  # one hello out at a time
    now, waits = 100.0, []
    for _ in range(8):
        r.failed(now)
        wait = r.next_at - now
        waits.append(wait)
        assert r.poll(now + wait * 0.99) is Action.NOTHING
        now += wait
        assert r.poll(now) is Action.CONNECT
    assert waits[0] == RECONNECT_FIRST_S and waits[-1] == RECONNECT_MAX_S, waits
    assert all(b >= a for a, b in itertools.pairwise(waits)), waits
    assert r.counts.attempts == r.tries == 9 and r.counts.failed_attempts == 8
    assert r.connected(now + 0.5, 7) is False  # the same incarnation: a stall, not a restart
    assert r.up and r.counts.reconnects == 1 and r.counts.new_incarnations == 0
    assert r.counts.away_s == pytest.approx(now + 0.5 - 100.0)
    # The next outage starts the backoff afresh.
    r.lost(1000.0)
    assert r.poll(1000.0) is Action.CONNECT
    r.failed(1000.0)
    assert r.next_at == 1000.0 + RECONNECT_FIRST_S and r.counts.outages == 2
    assert r.tries == 1 and r.counts.attempts == 10


def test_a_welcome_from_another_incarnation_is_a_restart() -> None:
    r = Reconnector(incarnation=1)
    r.lost(0.0)
    assert r.poll(0.0) is Action.CONNECT
    assert r.connected(0.1, 2) is True and r.incarnation == 2 and r.counts.new_incarnations == 1


def test_a_loss_while_a_hello_is_out_fails_it_and_a_second_loss_changes_nothing() -> None:
    r = Reconnector()
    r.lost(0.0)
    r.lost(0.05)
    assert r.counts.outages == 1 and r.next_at == 0.0
    assert r.poll(0.1) is Action.CONNECT
    r.lost(0.2)
    assert r.state is LinkState.DOWN and r.counts.failed_attempts == 1 and r.next_at == 0.2 + RECONNECT_FIRST_S


def test_a_welcome_with_no_hello_out_and_a_bad_backoff_are_refused() -> None:
    with pytest.raises(RuntimeError, match="no hello was out"):
        Reconnector().connected(0.0, 1)
    with pytest.raises(ValueError, match="backoff"):
        Reconnector(first_s=2.0, most_s=1.0)
    with pytest.raises(ValueError, match="backoff"):
        Reconnector(factor=0.5)


# ---------------------------------------------------------------------- against real nodes


def until(ready: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``ready()``, looking again every 20 ms."""
    deadline, pause = time.monotonic() + BOUND_S, threading.Event()
    while not ready():
        assert time.monotonic() < deadline, what
        pause.wait(0.02)


def round_trip(link: NodeLink, buf: np.ndarray, region: RegionHandle, key: bytes) -> None:
    """Deposit the region's patterned bytes under ``key``, zero them, deliver them back: every byte
    comes back (the node knows the region of this session)."""
    want = pattern(len(buf), seed=key[0])
    buf[:] = want
    results = link.client.deposit({key: [Span("b", region, 0, SLOT, "kv")]}).result(BOUND_S)
    assert results[key].ok, results
    buf[:] = 0
    got = link.client.deliver({key: [Span("b", region, 0, SLOT)]}).result(BOUND_S)
    assert got[key].ok, got
    assert np.array_equal(buf, want)


def test_a_link_reconnects_to_a_restarted_node_and_announces_its_region_again(ipc_dir: Path) -> None:
    endpoint = f"ipc://{ipc_dir}/restart.sock"
    node: NodeProcess | None = start_node(endpoint, "--pool", f"kv:{SLOT}:16")
    counts: Counter[str] = Counter()
    restarts: list[int] = []
    try:
        link = NodeLink(
            endpoint, "link-test", lambda name, n: counts.update({name: n}), log, lambda: restarts.append(1)
        )
        try:
            buf = np.zeros(SLOT, dtype=np.uint8)
            region = link.client.register(buf)
            assert link.ready()
            round_trip(link, buf, region, b"\x01" * 16)
            first = link.reconnector.incarnation
            assert node is not None
            node.kill()
            until(lambda: not link.ready(), "the link saw the node gone")
            assert counts["node_outages"] == 1 and link.reconnector.state is not LinkState.UP
            assert not link.ready()  # away: answered at once, a hello at most in flight
            node = start_node(endpoint, "--pool", f"kv:{SLOT}:16")
            until(lambda: link.ready(0.05), "the link reconnected")
            assert restarts == [1] and link.reconnector.incarnation != first
            assert counts["reconnects"] == 1 and counts["node_outages"] == 1, counts
            round_trip(link, buf, region, b"\x02" * 16)  # the region is the new node's too
        finally:
            link.close()
        with Client(endpoint, name="check") as c:
            assert_clean(c)
    finally:
        if node is not None:
            node.stop()


def test_a_link_whose_hellos_went_unanswered_while_the_node_was_dead_reconnects_once_it_is_back(
    ipc_dir: Path,
) -> None:
    """The node stays dead long enough for a hello to time out unanswered (two servers sharing
    a node met this): the next hello still goes, and the new node's welcome opens the link."""
    endpoint = f"ipc://{ipc_dir}/dead.sock"
    node = start_node(endpoint, "--pool", f"kv:{SLOT}:16")
    counts: Counter[str] = Counter()
    try:
        link = NodeLink(endpoint, "link-test", lambda name, n: counts.update({name: n}), log)
        try:
            buf = np.zeros(SLOT, dtype=np.uint8)
            region = link.client.register(buf)
            node.kill()
            until(lambda: not link.ready(), "the link saw the node gone")
            # Past a hello's timeout and the client's grace: at least one went unanswered.
            dead_until, pause = time.monotonic() + HELLO_TIMEOUT_S + 3.0, threading.Event()
            while time.monotonic() < dead_until:
                assert not link.ready()
                pause.wait(0.05)
            assert link.reconnector.tries >= 2, link.reconnector.tries
            node = start_node(endpoint, "--pool", f"kv:{SLOT}:16")
            until(lambda: link.ready(0.05), "the link reconnected to the new node")
            assert counts["reconnects"] == 1, counts
            round_trip(link, buf, region, b"\x04" * 16)
        finally:
            link.close()
        with Client(endpoint, name="check") as c:
            assert_clean(c)
    finally:
        node.stop()


def test_a_link_reconnects_to_a_node_frozen_past_the_heartbeat_silence(ipc_dir: Path) -> None:
    endpoint = f"ipc://{ipc_dir}/frozen.sock"
    node = start_node(endpoint, "--pool", f"kv:{SLOT}:16", "--heartbeat-ms", "200")
    counts: Counter[str] = Counter()
    restarts: list[int] = []
    try:
        link = NodeLink(
            endpoint, "link-test", lambda name, n: counts.update({name: n}), log, lambda: restarts.append(1)
        )
        try:
            buf = np.zeros(SLOT, dtype=np.uint8)
            region = link.client.register(buf)
            with frozen(node):
                until(lambda: not link.ready(), "the link found the frozen node lost")
                longest = 0.0
                for _ in range(20):  # hellos go unanswered; every call answers without waiting for them
                    began = time.perf_counter()
                    assert not link.ready()
                    longest = max(longest, time.perf_counter() - began)
                print(f"ready() while frozen: longest call {longest * 1000:.1f} ms")
            until(lambda: link.ready(0.05), "the link reconnected after SIGCONT")
            assert restarts == [] and counts["reconnects"] == 1 and counts["node_outages"] == 1, counts
            round_trip(link, buf, region, b"\x03" * 16)
        finally:
            link.close()
        with Client(endpoint, name="check") as c:
            assert_clean(c)
    finally:
        node.stop()


def test_a_frozen_node_leaves_a_probe_unanswered_and_is_stalled_until_it_speaks(ipc_dir: Path) -> None:
    """``probe`` and ``stalled``: a live node answers the heartbeat at once; a frozen one leaves
    it unanswered, so the link is stalled past the bound while the session still stands (far
    short of the heartbeat silence), and is not once the node speaks again."""
    endpoint = f"ipc://{ipc_dir}/stalled.sock"
    node = start_node(endpoint, "--pool", f"kv:{SLOT}:16")
    counts: Counter[str] = Counter()
    try:
        link = NodeLink(endpoint, "link-test", lambda name, n: counts.update({name: n}), log)
        try:
            buf = np.zeros(SLOT, dtype=np.uint8)
            region = link.client.register(buf)
            assert link.ready()
            link.probe()
            until(lambda: link.client.core.unanswered_s() == 0.0, "the live node answered the probe")
            assert not link.stalled(0.0)
            with frozen(node):
                link.probe()
                link.probe()  # one at a time: counted from the first
                until(lambda: link.stalled(0.3), "the probe went unanswered for 0.3 s")
                assert link.ready() and link.up  # stalled, not lost: the session stands
            until(lambda: not link.stalled(0.3), "the node answered once thawed")
            assert counts["node_outages"] == 0, counts
            round_trip(link, buf, region, b"\x05" * 16)
        finally:
            link.close()
        with Client(endpoint, name="check") as c:
            assert_clean(c)
    finally:
        node.stop()
