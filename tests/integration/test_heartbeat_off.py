"""``heartbeat_ms = 0`` disables heartbeats (spec section 5.2), on both sides of a node.

With heartbeats off, clients send none, so the node must not drop a session for silence
(the spec's Known weaknesses say such a session lingers), and a target node must not
spin sending heartbeats to its peers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvcr_client import Client
from kvcr_testing.health import counter, stats, wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, plain_layout
from kvcr_testing.remote import deliver_checked

GRACE_MS = 300
"""A grace period the idle client outlives many times over."""
IDLE_S = 1.5
"""How long the test leaves the sessions idle: five grace periods."""
IDLE_CPU_S = 0.5
"""CPU seconds a node may spend over ``IDLE_S`` idle; a loop spinning on heartbeats takes them all."""
LAYOUT = plain_layout(2)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (/proc/PID/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_heartbeat_zero_keeps_silent_sessions_and_does_not_spin(sites: Any) -> None:
    off = ("--heartbeat-ms", "0", "--client-grace-ms", str(GRACE_MS))
    a, b = sites.start(("a", {"args": off}), "b")
    assert a.client.node is not None and a.client.node.heartbeat_ms == 0
    src = b.deposit(b"k", LAYOUT, seed=1)
    # A peer link from A to B, ready: with heartbeats on it would send one every interval.
    a.client.submit_hint("r", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=2, request_id="r")
    a.client.discard_hint("r").result(RESULT_TIMEOUT_S)

    pid = a.node.proc.pid
    cpu_before = cpu_seconds(pid)
    # A's client now says nothing for five grace periods (another client watches): the
    # silent session must stay.
    with Client(a.endpoint, name="observer") as observer:
        assert not wait_until(lambda: counter(stats(observer), "clients_expired") > 0, IDLE_S)
        assert cpu_seconds(pid) - cpu_before < IDLE_CPU_S
        st = stats(observer)
    assert counter(st, "clients_expired") == 0, st["counters"]
    assert st["clients"] == 2, st
    assert st["peers"][b.endpoint]["state"] == "ready", st["peers"]
    # The silent client's session still serves it.
    a.client.submit_hint("r", b.endpoint, [b"k"]).result(RESULT_TIMEOUT_S)
    deliver_checked(a, b"k", LAYOUT, src, range(2), seed=3, request_id="r")
    a.client.discard_hint("r").result(RESULT_TIMEOUT_S)
