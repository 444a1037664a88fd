"""``Grants`` with agents still loading (``kvcr_client.agent_loads``), against a fake core whose
agent loads only when the test lets it: what waits, what is bounded, what is dropped.

A node (or a hostile one) may name a new source in every grant: loads queue in the loader
thread, one at a time, so the sources a session waits for are bounded as its loaded ones
are (``MAX_SOURCES``), and a grant past the bound sends those rows by deliver.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import Future
from typing import Any

from kvcr_client.counters import Counters
from kvcr_client.grants import MAX_SOURCES, Grants
from kvcr_client.session_scope import CurrentScope
from kvcr_protocol import GrantNode, GrantSource, LeaseGrant, MemoryKind
from kvcr_protocol.records import PoolInfo, Region
from kvcr_testing.health import wait_until

from .test_agent_loads import call_locked

SLOT = 4096
POOLS = (Region(0, MemoryKind.DRAM, 0, 1 << 20, 16 * SLOT),)


class FakeAgent:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.loaded: list[bytes] = []
        self.removed: list[str] = []

    def add_remote(self, metadata: bytes) -> str:
        assert self.gate.wait(10)
        self.loaded.append(metadata)
        return metadata.decode()

    def remove_remote(self, name: str) -> None:
        self.removed.append(name)

    def prepare(self, local_kind: object, local: object, remote_kind: object, remote: object,
                remote_agent: str) -> tuple[object, object]:
        return local, remote


class FakeReads:
    def remotes(self) -> set[str]:
        return set()


class FakeCore:
    """What ``Grants`` uses of the client core: its agent, lock, wake, welcome and reads."""

    def __init__(self) -> None:
        self.agent = FakeAgent()
        self.lock = threading.RLock()
        self.welcome: Any = type("Welcome", (), {"pools": (PoolInfo("kv", SLOT, 16, "dram"),)})()
        self.reads = FakeReads()

    def call(self, fn: Any, closed: bool = False) -> Future[Any]:
        return call_locked(self.lock, fn)

    def wake(self) -> None:
        pass


def node(name: str) -> GrantNode:
    return GrantNode(name, name.encode(), POOLS, 10_000, struct.pack("<I", SLOT))


def grant(with_node: bool = False, sources: tuple[GrantSource, ...] = ()) -> LeaseGrant:
    return LeaseGrant(b"", (), b"", b"", node("node") if with_node else None, b"", sources)


class Lease:
    keys: tuple[bytes, ...] = ()
    ended = None


def test_grants_wait_for_their_agents_and_sources_waited_for_are_bounded() -> None:
    core = FakeCore()
    scope = CurrentScope()
    grants = Grants(core, Counters(), scope)  # type: ignore[arg-type]
    current = scope()
    first = grants.add(current, Lease(), (), grant(with_node=True))  # type: ignore[arg-type]
    assert not first.done() and not grants.wants_node(), "loading: the next lease does not ask again"
    per_grant = 16
    waiting = [grants.add(current, Lease(), (), grant(sources=tuple(  # type: ignore[arg-type]
        GrantSource(f"tcp://127.0.0.{g}:{i + 1}", 1, node(f"src-{g}-{i}")) for i in range(per_grant))))
        for g in range(2 * MAX_SOURCES // per_grant)]
    assert len(current.sources_loading) == MAX_SOURCES, "past the bound a source's rows go by deliver"
    assert grants.loads.pending == MAX_SOURCES + 1
    core.agent.gate.set()
    assert wait_until(lambda: grants.loads.pending == 0, 30)
    assert first.done() and all(w.done() for w in waiting)
    assert current.node is not None and current.node.name == "node" and len(current.sources) == MAX_SOURCES
    assert current.sources_loading == {} and current.node_loading is None
    assert len(core.agent.loaded) == MAX_SOURCES + 1


def test_an_agent_loaded_after_its_session_ended_goes_with_the_ended_sessions() -> None:
    core = FakeCore()
    scope = CurrentScope()
    grants = Grants(core, Counters(), scope)  # type: ignore[arg-type]
    ended = scope()
    pending = grants.add(ended, Lease(), (), grant(with_node=True))  # type: ignore[arg-type]
    grants.retire(scope.renew())  # a new hello: the session whose grant loads is over
    core.agent.gate.set()
    assert wait_until(lambda: grants.loads.pending == 0, 10)
    assert pending.result(0) == frozenset() and ended.node is None and scope().node is None
    assert core.agent.removed == ["node"], "no READ runs on it: removed from ours at once"
    assert grants.wants_node(), "the new session asks for the node's agent again"
