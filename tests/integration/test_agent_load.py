"""The node's agent loads into a client's off the turns (``kvcr_client.agent_loads``), against
a real ``kvcr-node``.

The first grant of a session carries the node's agent metadata; loading it is NIXL's
``add_remote_agent`` (milliseconds). It runs in the client's loader thread, never in the
thread that read the reply (an event loop's, a waiting caller's): the lease resolves once
its grants are in place, and a put waits for the agent before it WRITEs. When NIXL refuses
the metadata, the keys travel by the node (delivers read by it, puts deposited), every byte
right, and a later lease asks for the agent again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvcr_client import AsyncClient, Client, KeyStatus, LeaseStatus, Span
from kvcr_io.agent import Agent
from kvcr_testing.health import assert_clean, stats
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, pattern

SLOT = 4 * KiB
LAYERS = 4

pytestmark = pytest.mark.usefixtures("node_left_clean")


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return ("--pool", "kv:4KiB:64", "--lease-pool-fraction", "1")


@dataclass
class Loads:
    """The thread of every ``add_remote`` of clients made while the fixture holds; ``refuse``,
    one boolean per load, consumed in order, makes NIXL refuse that one."""

    threads: list[str] = field(default_factory=list)
    refuse: list[bool] = field(default_factory=list)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Loads:
    seen = Loads()
    real = Agent.add_remote

    def add_remote(self: Agent, metadata: bytes) -> str:
        seen.threads.append(threading.current_thread().name)
        if seen.refuse and seen.refuse.pop(0):
            raise RuntimeError("NIXL refused the metadata (forged by the test)")
        return real(self, metadata)

    monkeypatch.setattr(Agent, "add_remote", add_remote)
    return seen


def layers(region: Any, dst: bool = False) -> list[Span]:
    return [Span(f"L{i}", region, i * SLOT, SLOT, None if dst else "kv") for i in range(LAYERS)]


def test_the_first_lease_of_a_session_is_granted_with_the_agent_loaded_off_the_turn(
        node: NodeProcess, client: Client, key: Callable[[str], bytes], loads: Loads) -> None:
    k = key("obj")
    src = pattern(LAYERS * SLOT, 1)
    with Client(node.endpoint, name="itest-agent-load") as c:
        reg = Registrar(c)
        assert c.deposit({k: layers(reg(src))}).result(RESULT_TIMEOUT_S).all_ok
        lease = c.lease([k]).result(RESULT_TIMEOUT_S)
        assert lease.status(k) is LeaseStatus.LEASED and lease.granted == frozenset({k}), "granted when it resolves"
        assert loads.threads == ["kvcr-agent-load"]
        dst = np.zeros_like(src)
        assert c.deliver({k: layers(reg(dst), dst=True)}).result(RESULT_TIMEOUT_S)[k].ok
        assert np.array_equal(dst, src) and c.counters()["grant_reads"] == 1
        lease.release().result(RESULT_TIMEOUT_S)
        assert c.lease([k]).result(RESULT_TIMEOUT_S).release().result(RESULT_TIMEOUT_S) is None
        assert loads.threads == ["kvcr-agent-load"], "loaded once a session"
        reg.close()
        assert_clean(c)


def test_an_event_loops_first_put_and_lease_never_load_the_agent_in_the_loop(
        node: NodeProcess, client: Client, key: Callable[[str], bytes], loads: Loads) -> None:
    k = key("obj")
    src = pattern(LAYERS * SLOT, 2)
    dst = np.zeros_like(src)
    posted = stats(client)["transfers"]["posted"]

    async def run() -> str:
        async with await AsyncClient.connect(node.endpoint, name="itest-agent-load-async") as c:
            rs, rd = await c.register(src), await c.register(dst)
            put = await c.put({k: layers(rs)})  # the session's first grant: a write grant
            assert put[k].status is KeyStatus.STORED
            lease = await c.lease([k])
            assert lease.granted == frozenset({k})
            assert (await c.deliver({k: layers(rd, dst=True)}))[k].ok
            assert c.counters()["grant_reads"] == 1
            await lease.release()
            await c.unregister(rs)
            await c.unregister(rd)
        return threading.current_thread().name

    loop_thread = asyncio.run(run())
    assert np.array_equal(dst, src)
    assert loads.threads == ["kvcr-agent-load"] and loop_thread not in loads.threads
    assert stats(client)["transfers"]["posted"] == posted, "the put was written by the client, not the node"


def test_metadata_nixl_refuses_leaves_the_keys_to_the_node_and_a_later_lease_asks_again(
        node: NodeProcess, client: Client, key: Callable[[str], bytes], loads: Loads) -> None:
    k, p = key("obj"), key("put")
    src = pattern(LAYERS * SLOT, 3)
    loads.refuse[:] = [True]
    with Client(node.endpoint, name="itest-agent-refused") as c:
        reg = Registrar(c)
        rs = reg(src)
        assert c.deposit({k: layers(rs)}).result(RESULT_TIMEOUT_S).all_ok
        lease = c.lease([k]).result(RESULT_TIMEOUT_S)
        assert lease.status(k) is LeaseStatus.LEASED and lease.granted == frozenset()
        dst = np.zeros_like(src)
        rd = reg(dst)
        assert c.deliver({k: layers(rd, dst=True)}).result(RESULT_TIMEOUT_S)[k].ok
        assert np.array_equal(dst, src) and c.counters()["grant_reads"] == 0, "read by the node"
        lease.release().result(RESULT_TIMEOUT_S)
        assert c.tables()["granted_keys"] == 0
        # The next grant carries the agent again, and this time it loads.
        again = c.lease([k]).result(RESULT_TIMEOUT_S)
        assert again.granted == frozenset({k}) and loads.threads == ["kvcr-agent-load"] * 2
        dst[:] = 0
        assert c.deliver({k: layers(rd, dst=True)}).result(RESULT_TIMEOUT_S)[k].ok
        assert np.array_equal(dst, src) and c.counters()["grant_reads"] == 1
        again.release().result(RESULT_TIMEOUT_S)
        put = c.put({p: layers(rs)})
        assert put.result(RESULT_TIMEOUT_S)[p].status is KeyStatus.STORED
        dst[:] = 0
        assert c.deliver({p: layers(rd, dst=True)}).result(RESULT_TIMEOUT_S)[p].ok and np.array_equal(dst, src)
        reg.close()
        assert_clean(c)


def test_a_put_whose_agent_nixl_refuses_is_deposited_every_byte(
        node: NodeProcess, client: Client, key: Callable[[str], bytes], loads: Loads) -> None:
    p = key("put")
    src = pattern(LAYERS * SLOT, 4)
    loads.refuse[:] = [True]
    posted = stats(client)["transfers"]["posted"]
    with Client(node.endpoint, name="itest-agent-refused-put") as c:
        reg = Registrar(c)
        rs = reg(src)
        put = c.put({p: layers(rs)})  # the session's first grant: its agent is refused
        put.written.result(RESULT_TIMEOUT_S)
        src_copy = src.copy()
        src[:] = 0  # the memory is the caller's again once written
        assert put.result(RESULT_TIMEOUT_S)[p].status is KeyStatus.STORED
        assert stats(client)["transfers"]["posted"] > posted, "deposited: the node read it"
        assert loads.threads == ["kvcr-agent-load"], "a put waits for one load, not a second"
        dst = np.zeros_like(src)
        assert c.deliver({p: layers(reg(dst), dst=True)}).result(RESULT_TIMEOUT_S)[p].ok
        assert np.array_equal(dst, src_copy)
        reg.close()
        assert_clean(c)
