"""Client sessions in process (``kvcr_node.sessions``), driven message by message with a fake clock.

No loop and no thread: each test hands the node's router a message and reads what the node
put in its outbox (``kvcr_testing.nodes.NodeDriver``), so hello, limits, hints, withdrawals
and liveness are checked deterministically (spec sections 5.2 and 12). Every test ends with
the node's accounting back at rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import (
    CURRENT_VERSION,
    Abort,
    Ack,
    Bye,
    Completion,
    Deliver,
    DeliverItem,
    DstSpan,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    KeyStatus,
    MemoryKind,
    Query,
    Region,
    RegisterRegions,
    StatsReply,
    StatsRequest,
    SubmitHint,
    UnregisterRegions,
    Welcome,
)
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096
GRACE_MS = 10_000


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/sessions.sock", name="sessions", pools=(PoolSpec("kv", SLOT, 8, "dram"),),
                      log_level="WARNING", client_grace_ms=GRACE_MS, heartbeat_ms=2_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    """The test's own NIXL agent, with one registered buffer (region 1)."""
    a = ClientAgent("test-client", np.zeros(4 * SLOT, np.uint8))
    yield a
    a.close()


def error_of(replies: list[Any], request_id: int) -> Error:
    assert len(replies) == 1 and isinstance(replies[0], Error) and replies[0].id == request_id, replies
    error: Error = replies[0]
    return error


def assert_at_rest(driver: NodeDriver) -> dict[str, Any]:
    st = driver.stats()
    assert st["invariants"] == [], st["invariants"]
    assert st["claims"]["total"] == 0 and st["operations_pending"] == 0, st
    assert st["tables"]["waiters"] == 0 and st["tables"]["withdrawals"] == 0, st["tables"]
    return st


def test_a_request_before_hello_is_refused_and_hello_opens_a_session(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        assert error_of(d.receive(b"c", Query(7, (b"k",))), 7).code == ErrorCode.BAD_STATE
        welcome = d.hello(b"c", agent)
        assert welcome.version == CURRENT_VERSION and [p.name for p in welcome.pools] == ["kv"]
        assert welcome.heartbeat_ms == 2_000
        assert len(d.node.sessions) == 1
        # A frame with no payload, and one that does not decode: refused, the session stays.
        d.receive_frames([b"c"])
        assert error_of(d.sent(b"c"), 0).code == ErrorCode.MALFORMED
        d.receive_frames([b"c", b"\x93garbage"])
        assert len(d.sent(b"c")) == 1 and len(d.node.sessions) == 1
        assert_at_rest(d)


def test_max_clients_refuses_another_client_but_a_new_hello_replaces_its_own(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, max_clients=1)) as d:
        d.hello(b"one", agent)
        hello = Hello(2, (CURRENT_VERSION,), "two", agent.name, agent.metadata)
        assert error_of(d.receive(b"two", hello), 2).code == ErrorCode.TOO_MANY_CLIENTS
        d.hello(b"one", agent, request_id=3)  # the same identity again: its old session closes first
        assert len(d.node.sessions) == 1
        assert d.stats()["counters"]["hellos"] == 2
        assert_at_rest(d)


def test_bad_regions_are_refused_naming_the_field_and_nothing_stays(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        bad = Hello(1, (CURRENT_VERSION,), "c", agent.name, agent.metadata, (Region(1, MemoryKind.DRAM, 0, 0, SLOT),))
        error = error_of(d.receive(b"c", bad), 1)
        assert (error.code, error.path) == (ErrorCode.BAD_DESCRIPTOR, "regions[0]")
        twice = Hello(2, (CURRENT_VERSION,), "c", agent.name, agent.metadata, (*agent.regions, *agent.regions))
        error = error_of(d.receive(b"c", twice), 2)
        assert (error.code, error.path) == (ErrorCode.BAD_DESCRIPTOR, "regions")
        unknown = Hello(3, (CURRENT_VERSION,), "c", agent.name, b"not nixl metadata")
        error = error_of(d.receive(b"c", unknown), 3)
        assert (error.code, error.path) == (ErrorCode.BAD_DESCRIPTOR, "agent_md")
        assert len(d.node.sessions) == 0
        assert d.stats()["tables"]["remote_agents_pending"] == 0
        # Regions announced later: another agent's metadata is refused, the session's own taken.
        d.hello(b"c", agent, request_id=4)
        other = ClientAgent("test-other")
        try:
            error = error_of(d.receive(b"c", RegisterRegions(5, other.metadata, ())), 5)
            assert (error.code, error.path) == (ErrorCode.BAD_DESCRIPTOR, "agent_md")
        finally:
            other.close()
        extra = Region(9, MemoryKind.DRAM, 0, agent.regions[0].address, SLOT)
        assert d.receive(b"c", RegisterRegions(6, agent.metadata, (extra,))) == [Ack(6)]
        assert set(d.node.sessions.get(b"c").regions) == {1, 9}  # type: ignore[union-attr]
        assert_at_rest(d)


def test_hints_are_bounded_per_session(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, max_hints_per_session=2, max_hinted_keys_per_session=3)) as d:
        d.hello(b"c", agent)
        far = f"ipc://{ipc_dir}/far.sock"
        assert d.receive(b"c", SubmitHint(2, "r1", far, (b"a",))) == [Ack(2)]
        assert d.receive(b"c", SubmitHint(3, "r2", far, (b"b",))) == [Ack(3)]
        error = error_of(d.receive(b"c", SubmitHint(4, "r3", far, (b"c",))), 4)
        assert (error.code, error.path) == (ErrorCode.HINT_LIMIT, "request_id")
        assert d.receive(b"c", SubmitHint(5, "r1", far, (b"a", b"x"))) == [Ack(5)]  # a replacement is not one more
        error = error_of(d.receive(b"c", SubmitHint(6, "r2", far, (b"b", b"y", b"z"))), 6)
        assert (error.code, error.path) == (ErrorCode.HINT_LIMIT, "keys")
        error = error_of(d.receive(b"c", SubmitHint(7, "r4", "bogus://x", (b"d",))), 7)
        assert (error.code, error.path) == (ErrorCode.BAD_ENDPOINT, "endpoint")
        assert d.stats()["tables"]["hints"] == 2 and d.stats()["tables"]["hinted_keys"] == 3
        assert d.receive(b"c", Bye(8)) == [Ack(8)]
        assert d.stats()["tables"]["hints"] == 0 and len(d.node.sessions) == 0
        assert_at_rest(d)


def test_a_silent_client_expires_after_its_grace_in_node_time(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"quiet", agent)
        d.hello(b"talking", agent, request_id=2)
        d.tick(GRACE_MS / 1000 - 1)
        assert d.receive(b"talking", Heartbeat(3)) == [Heartbeat(3)]
        d.tick(2)  # past the grace for "quiet", not for "talking"
        assert [s.identity for s in d.node.sessions] == [b"talking"]
        assert d.stats()["counters"]["clients_expired"] == 1
        d.tick(GRACE_MS / 1000)
        assert len(d.node.sessions) == 0
        assert_at_rest(d)


def test_without_heartbeats_silence_ends_nothing(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, heartbeat_ms=0)) as d:
        d.hello(b"c", agent)
        d.tick(100 * GRACE_MS / 1000)
        assert len(d.node.sessions) == 1
        assert_at_rest(d)


def test_a_stopping_node_takes_only_what_ends_things(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        d.node.router.stopping = True
        hello = Hello(2, (CURRENT_VERSION,), "late", agent.name, agent.metadata)
        assert error_of(d.receive(b"late", hello), 2).code == ErrorCode.SHUTTING_DOWN
        assert error_of(d.receive(b"c", Query(3, (b"k",))), 3).code == ErrorCode.SHUTTING_DOWN
        assert d.receive(b"c", Heartbeat(4)) == [Heartbeat(4)]
        replies = d.receive(b"c", StatsRequest(5))
        assert len(replies) == 1 and isinstance(replies[0], StatsReply)
        assert d.receive(b"c", Bye(6)) == [Ack(6)]
        d.node.router.stopping = False
        assert_at_rest(d)


def deliver_to_nowhere(d: NodeDriver, ipc_dir: Path, agent: ClientAgent, deadline_ms: int) -> None:
    """A deliver hinted to a source nobody serves: its write waits for a session on the link."""
    assert d.receive(b"c", SubmitHint(2, "r", f"ipc://{ipc_dir}/nobody.sock", (b"k",))) == [Ack(2)]
    item = DeliverItem(b"k", (DstSpan("L0", 1, 0, SLOT),))
    assert d.receive(b"c", Deliver(3, (item,), request_id="r", deadline_ms=deadline_ms)) == []
    assert d.stats()["tables"]["links"] == 1


def test_unregions_waits_while_a_remote_write_may_reach_the_region(ipc_dir: Path, agent: ClientAgent) -> None:
    """Spec section 12: the ack of an ``unregions`` waits until no write can reach its regions."""
    with node_driver(config(ipc_dir, client_grace_ms=600_000)) as d:
        d.hello(b"c", agent)
        deliver_to_nowhere(d, ipc_dir, agent, deadline_ms=5_000)
        assert d.receive(b"c", UnregisterRegions(4, (1,))) == []  # held
        assert d.stats()["tables"]["withdrawals"] == 1 and d.stats()["counters"]["unregions_held"] == 1
        d.tick(4)
        assert d.sent(b"c") == []
        d.tick(2)  # the deadline: the queued write ends (never sent), the region is free
        replies = d.sent(b"c")
        assert replies[0] == Ack(4), replies
        assert isinstance(replies[1], Completion) and replies[1].id == 3
        assert (replies[1].results[0].status, replies[1].results[0].code) == (KeyStatus.FAILED, ErrorCode.PEER_UNREACHABLE)
        assert d.node.sessions.get(b"c").regions == {}  # type: ignore[union-attr]
        d.tick(d.node.config.peer_idle_ms / 1000)
        assert d.stats()["tables"]["links"] == 0
        assert_at_rest(d)


def test_aborting_a_held_unregions_announces_the_regions_again(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir, client_grace_ms=600_000)) as d:
        d.hello(b"c", agent)
        deliver_to_nowhere(d, ipc_dir, agent, deadline_ms=5_000)
        assert d.receive(b"c", UnregisterRegions(4, (1,))) == []
        replies = d.receive(b"c", Abort(5, 4))
        assert replies[0] == Ack(5), replies
        assert (replies[1].id, replies[1].code) == (4, ErrorCode.ABORTED)  # type: ignore[union-attr]
        assert set(d.node.sessions.get(b"c").regions) == {1}  # type: ignore[union-attr]
        assert error_of(d.receive(b"c", Abort(6, 4)), 6).code == ErrorCode.UNKNOWN_OP
        # The client leaves: its deliver is aborted, the write on the link ends at its deadline.
        assert d.receive(b"c", Bye(7)) == [Ack(7)]
        d.tick(6)
        assert_at_rest(d)


def test_a_welcome_comes_at_the_version_both_speak(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        old = Hello(1, (1,), "old", agent.name, agent.metadata)
        replies = d.receive(b"old", old, version=1)
        assert isinstance(replies[0], Welcome) and replies[0].version == 1
        none = Hello(2, (CURRENT_VERSION + 100,), "new", agent.name, agent.metadata)
        assert error_of(d.receive(b"new", none), 2).code == ErrorCode.UNSUPPORTED_VERSION
        assert_at_rest(d)


def test_stats_runs_the_accounting_check_only_when_asked(ipc_dir: Path, agent: ClientAgent) -> None:
    """The check walks every object on the node's loop, so a ``stats`` runs it only with
    ``audit`` (spec section 5.2, "Statistics"); a session below version 5 cannot ask, and
    gets it every time, as before the field."""
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        d.node.outbox.undeclared_codes["planted: error 1"] = 1  # a breach the check must report
        plain = d.receive(b"c", StatsRequest(2))
        assert len(plain) == 1 and isinstance(plain[0], StatsReply)
        assert "invariants" not in plain[0].stats and plain[0].stats["node"] == "sessions"
        audited = d.receive(b"c", StatsRequest(3, audit=True))
        assert len(audited) == 1 and isinstance(audited[0], StatsReply)
        assert audited[0].stats["invariants"] == ["sent a code spec section 10.1 does not list (planted: error 1) 1 times"]
        old = Hello(4, (4,), "old", agent.name, agent.metadata)
        welcome = d.receive(b"old", old, version=4)
        assert isinstance(welcome[0], Welcome) and welcome[0].version == 4
        at_4 = d.receive(b"old", StatsRequest(5), version=4)
        assert len(at_4) == 1 and isinstance(at_4[0], StatsReply) and len(at_4[0].stats["invariants"]) == 1
        del d.node.outbox.undeclared_codes["planted: error 1"]
        assert_at_rest(d)
