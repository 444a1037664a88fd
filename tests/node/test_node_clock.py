"""The node's protocol time is its clock: an in-process node driven by a fake one.

The test moves time forward and the node acts at its next loop turn (the loop wakes at
least every second, and every 50 ms while writes are outstanding), so liveness expiry and
remote-write deadlines are checked without waiting for them in real time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvcr_client import Client, ErrorCode, KeyStatus, Span
from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_testing.health import wait_until
from kvcr_testing.nodes import FakeClock, inprocess_node

SLOT = 4096
WAIT_S = 10.0
"""Bounded waits for the node's next loop turns (it wakes at least once a second)."""


def config(ipc_dir: Path, **changes: object) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/clock.sock", name="clock", pools=(PoolSpec("kv", SLOT, 16, "dram"),),
                      log_level="WARNING", client_grace_ms=10_000, heartbeat_ms=2_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()  # type: ignore[arg-type]


def test_a_silent_client_expires_when_the_clock_passes_its_grace(ipc_dir: Path) -> None:
    clock = FakeClock()
    with inprocess_node(config(ipc_dir), clock) as (node, _), Client(node.endpoint, name="quiet") as client:
        client.submit_hint("r", "ipc:///nowhere/n.sock", [b"k"]).result(WAIT_S)
        assert len(node.sessions) == 1 and node.snapshot()["tables"]["hints"] == 1
        clock.advance(9.0)  # within the grace: nothing happens
        clock.advance(2.0)  # past it (10 s without a word, in the node's time)
        assert wait_until(lambda: not node.sessions, WAIT_S)
        st = node.snapshot(audit=True)
        assert st["counters"]["clients_expired"] == 1
        assert st["tables"]["hints"] == 0 and st["tables"]["sessions"] == 0
        assert st["invariants"] == []


def test_a_remote_write_with_no_session_fails_at_its_deadline_in_node_time(ipc_dir: Path) -> None:
    """A deliver hinted to a source nobody serves waits for the link's session until its
    deadline: 60 s in node time, reached by moving the clock, not by waiting a minute."""
    clock = FakeClock()
    # A grace longer than the jump in time: the client itself must not expire meanwhile.
    with inprocess_node(config(ipc_dir, client_grace_ms=600_000), clock) as (node, _), \
            Client(node.endpoint, name="far") as client:
        dst = np.zeros(SLOT, np.uint8)
        region = client.register(dst)
        client.submit_hint("r", f"ipc://{ipc_dir}/nobody.sock", [b"k"]).result(WAIT_S)
        handle = client.deliver({b"k": [Span("L0", region, 0, SLOT)]}, request_id="r", deadline_ms=60_000)
        assert wait_until(lambda: node.snapshot()["tables"]["links"] == 1, WAIT_S)
        assert not handle.done()
        clock.advance(60.0)
        out = handle.result(WAIT_S)[b"k"]
        assert out.status is KeyStatus.FAILED and out.code is ErrorCode.PEER_UNREACHABLE, out
        assert (dst == 0).all()
        st = node.snapshot(audit=True)
        assert st["operations_pending"] == 0 and st["invariants"] == []
        # The link has no work left: it closes once idle for peer_idle_ms of node time.
        clock.advance(node.config.peer_idle_ms / 1000)
        assert wait_until(lambda: node.snapshot()["tables"]["links"] == 0, WAIT_S)
        client.unregister(region)
