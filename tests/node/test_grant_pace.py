"""The node's progress pace for outstanding read grants (spec section 6.12), with a fake clock.

Fast for ``GRANT_BURST_S`` after a grant, then slow; a progress call that spent the loop's
CPU serving a READ (UCX over TCP sends the READ's bytes inside the target's progress)
brings the fast pace back until ``GRANT_SERVING_HOLD_S`` after the last such call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.grant_progress import (
    GRANT_BURST_S,
    GRANT_IDLE_PROGRESS_S,
    GRANT_PROGRESS_S,
    GRANT_SERVING_CPU_S,
    GRANT_SERVING_HOLD_S,
)
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome
from kvcr_protocol import Lease, LeaseReply
from kvcr_testing.nodes import ClientAgent, node_driver


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("pace-client")
    yield a
    a.close()


def test_a_serving_progress_brings_the_fast_pace_back(ipc_dir: Path, agent: ClientAgent) -> None:
    config = NodeConfig(endpoint=f"ipc://{ipc_dir}/pace.sock", name="pace", pools=(PoolSpec("a", 4096, 8, "dram"),),
                        log_level="WARNING", lease_ttl_ms=60_000).validated()
    with node_driver(config) as d:
        d.hello(b"c", agent)
        outcome, entry = d.node.store.begin_deposit(b"x", (("k", "a"),))
        assert outcome is DepositOutcome.NEW and entry is not None
        d.node.store.commit(entry)
        reply = d.receive(b"c", Lease(2, (b"x",), read=True, node_md=True))
        assert isinstance(reply[0], LeaseReply) and reply[0].grant is not None
        node = d.node
        assert node.grant_progress.pace(d.clock()) == GRANT_PROGRESS_S
        d.tick(GRANT_BURST_S + 0.01)
        assert node.grant_progress.pace(d.clock()) == GRANT_IDLE_PROGRESS_S

        real = node.agent.progress
        served: list[int] = []

        def serving() -> list[bytes]:
            # As a progress that sends a READ's bytes over TCP: the loop thread's CPU, spent.
            end = time.thread_time() + 2 * GRANT_SERVING_CPU_S
            while time.thread_time() < end:
                pass
            served.append(1)
            return real()

        node.agent.progress = serving  # type: ignore[method-assign]
        try:
            d.tick(GRANT_IDLE_PROGRESS_S)
            node.grant_progress.step(d.clock())
        finally:
            node.agent.progress = real  # type: ignore[method-assign]
        assert served and node.grant_progress.pace(d.clock()) == GRANT_PROGRESS_S
        # An idle call keeps the hold; past the hold the slow pace is back.
        d.tick(GRANT_PROGRESS_S)
        node.grant_progress.step(d.clock())
        assert node.grant_progress.pace(d.clock()) == GRANT_PROGRESS_S
        d.tick(GRANT_SERVING_HOLD_S)
        assert node.grant_progress.pace(d.clock()) == GRANT_IDLE_PROGRESS_S
