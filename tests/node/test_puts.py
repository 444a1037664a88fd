"""The put state machine in process (``kvcr_node.puts``, spec section 6.13), with a fake clock.

A put reserves WRITING slots as a deposit would and answers their pools and slots; a
commit makes them READY, an unput frees them. A put past its time to live is quarantined
until the session names it; the puts of a session that ends stay quarantined until the
client's agent was removed and ``put_quarantine_ms`` passed. Every slot comes back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_node.config import NodeConfig
from kvcr_node.ops.deposit import LAYOUT_KEPT_SPANS, LAYOUTS_KEPT, _ColumnBlock
from kvcr_node.poolspec import PoolSpec
from kvcr_protocol import (
    CURRENT_VERSION,
    DEFAULT_LIMITS,
    Ack,
    Bye,
    Commit,
    Completion,
    DepositItem,
    Error,
    ErrorCode,
    Hello,
    KeyStatus,
    Put,
    PutReply,
    SrcSpan,
    Unput,
)
from kvcr_protocol.columns import deposit_blocks
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/puts.sock", name="puts", pools=(PoolSpec("a", SLOT, 8, "dram"),),
                      log_level="WARNING", client_grace_ms=7_000, heartbeat_ms=2_000, put_ttl_ms=1_000,
                      put_quarantine_ms=5_000, max_puts_per_session=2)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    a = ClientAgent("puts-client", np.zeros(4 * SLOT, np.uint8))
    yield a
    a.close()


def put(request: int, *keys: bytes, spans: int = 2, ttl_ms: int = 0) -> Put:
    items = tuple(DepositItem(k, tuple(SrcSpan(f"L{j}", "a", 1, j * SLOT, SLOT) for j in range(spans))) for k in keys)
    return Put(request, items, ttl_ms=ttl_ms)


def reply_of(replies: list[Any], request: int) -> Any:
    assert len(replies) == 1 and replies[0].id == request, replies
    return replies[0]


def free(d: NodeDriver) -> int:
    return int(d.stats()["pools"]["a"]["free"])


def test_a_put_reserves_slots_and_a_commit_makes_them_ready(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        reply = reply_of(d.receive(b"c", put(2, b"x", b"y")), 2)
        assert isinstance(reply, PutReply) and reply.put and reply.ttl_ms == 1_000
        assert [r.status for r in reply.results] == [KeyStatus.OK, KeyStatus.OK]
        assert reply.grant is not None and reply.grant.node is None
        rows = list(reply.grant.keys(DEFAULT_LIMITS))
        x = d.node.store.lookup(b"x")
        assert x is not None and rows[0][1] == ("L0", "L1") and rows[0][3] == list(x.slots)
        assert free(d) == 4 and d.stats()["writing"] == 2 and d.node.transfers.posted == 0
        done = reply_of(d.receive(b"c", Commit(3, reply.put)), 3)
        assert isinstance(done, Completion) and [r.status for r in done.results] == [KeyStatus.STORED] * 2
        assert d.stats()["ready"] == 2 and d.stats()["puts"]["committed"] == 1
        again = reply_of(d.receive(b"c", Commit(4, reply.put)), 4)
        assert isinstance(again, Error) and again.code == ErrorCode.UNKNOWN_PUT and again.path == "put"
        assert d.stats()["invariants"] == []


def test_an_unput_frees_and_the_session_limit_refuses_busy(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        first = reply_of(d.receive(b"c", put(2, b"x")), 2)
        second = reply_of(d.receive(b"c", put(3, b"y")), 3)
        third = reply_of(d.receive(b"c", put(4, b"z")), 4)
        assert isinstance(third, Error) and third.code == ErrorCode.BUSY
        assert reply_of(d.receive(b"c", Unput(5, first.put)), 5) == Ack(5)
        assert reply_of(d.receive(b"c", Unput(6, second.put)), 6) == Ack(6)
        assert free(d) == 8 and d.stats()["writing"] == 0 and d.stats()["invariants"] == []


def test_an_expired_put_is_quarantined_until_the_session_names_it(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        reply = reply_of(d.receive(b"c", put(2, b"x", ttl_ms=100)), 2)
        d.tick(0.05)
        assert d.stats()["puts"]["open"] == 1
        d.tick(0.1)
        st = d.stats()
        assert st["puts"]["expired"] == 1 and st["puts"]["quarantined_slots"] == 2 and free(d) == 6
        d.tick(4)  # within the quarantine time: the session lives, its WRITE may still come
        assert free(d) == 6 and d.stats()["writing"] == 1
        refused = reply_of(d.receive(b"c", Commit(3, reply.put)), 3)
        assert isinstance(refused, Error) and refused.code == ErrorCode.TIMEOUT and refused.path == "put"
        assert free(d) == 8 and d.stats()["puts"]["quarantined"] == 0 and d.stats()["invariants"] == []
        assert d.node.puts.next_put_event() is None, "nothing timed: the idle node sleeps"


def test_a_session_sitting_on_an_expired_put_past_its_quarantine_is_ended(ipc_dir: Path, agent: ClientAgent) -> None:
    """An uncommitted put held its keys and slots for the putter's whole session: now the
    session that has not named its expired put put_quarantine_ms after expiry is ended, and
    the put freed once its agent is removed, in bounded time."""
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        reply_of(d.receive(b"c", put(2, b"x", ttl_ms=100)), 2)
        d.tick(0.15)
        assert d.stats()["puts"]["expired"] == 1 and free(d) == 6
        d.tick(5)  # past the quarantine: the session is ended, its agent removed, the put freed
        d.tick(0.01)
        st = d.stats()
        assert st["puts"]["sessions_ended"] == 1 and st["puts"]["lost"] == 1 and st["puts"]["freed_late"] == 1, st["puts"]
        assert free(d) == 8 and st["writing"] == 0 and st["tables"]["puts"] == 0 and st["invariants"] == []
        assert d.node.sessions.get(b"c") is None


def test_a_lost_session_frees_its_put_once_its_agent_is_removed_and_the_quarantine_passed(
    ipc_dir: Path, agent: ClientAgent,
) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        d.receive(b"c", put(2, b"x"))
        assert d.receive(b"c", Bye(3)) == [Ack(3)]
        st = d.stats()
        assert st["puts"]["lost"] == 1 and free(d) == 6
        # Nothing else holds the agent: it is removed at once, and the time still runs.
        assert agent.agent.name not in d.node.remote_agents.loaded
        d.tick(4.9)
        assert free(d) == 6 and d.stats()["writing"] == 1
        d.tick(0.2)
        st = d.stats()
        assert free(d) == 8 and st["puts"]["freed_late"] == 1 and st["writing"] == 0 and st["invariants"] == []


def test_a_lost_put_waits_while_another_session_holds_the_agent(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        d.hello(b"c", agent)
        d.hello(b"c2", agent)  # a second session of the same agent (same process)
        d.receive(b"c", put(2, b"x"))
        assert d.receive(b"c", Bye(3)) == [Ack(3)]
        d.tick(5.5)  # past the quarantine time, within c2's grace
        assert free(d) == 6, "the agent is still connected: a late WRITE could land"
        assert d.node.puts.next_put_event() is not None
        assert d.receive(b"c2", Bye(4)) == [Ack(4)]
        d.tick(1.1)  # looked at again once a second
        assert free(d) == 8 and d.stats()["invariants"] == []
        # A new hello from the same identity ends the old session: its agent goes, then comes back.
        d.hello(b"c", agent, request_id=5)
        d.receive(b"c", put(6, b"y"))
        d.hello(b"c", agent, request_id=7)
        d.tick(4.9)
        assert free(d) == 6
        d.tick(0.2)
        assert free(d) == 8 and d.stats()["invariants"] == []


def test_a_clients_puts_hold_at_most_its_share_across_reconnects(ipc_dir: Path, agent: ClientAgent) -> None:
    """One session reserved 253 of 256 slots, evicting every other client's objects, and each
    reconnect kept the old session's puts on top. Now a client's open and quarantined puts,
    its earlier sessions' included, hold at most its share of each pool (here 1/2 of 8
    slots, two clients); past it a put is refused BUSY before anything is placed or evicted."""
    other = ClientAgent("puts-other", np.zeros(4 * SLOT, np.uint8))
    try:
        with node_driver(config(ipc_dir, max_puts_per_session=8, put_pool_fraction=1.0)) as d:
            d.hello(b"o", other)
            kept = reply_of(d.receive(b"o", put(2, b"keep")), 2)
            assert isinstance(reply_of(d.receive(b"o", Commit(3, kept.put)), 3), Completion)
            d.hello(b"c", agent)
            for request, k in ((2, b"x"), (3, b"y")):
                assert reply_of(d.receive(b"c", put(request, k)), request).put  # 2 + 2 slots: its share
            refused = reply_of(d.receive(b"c", put(4, b"z")), 4)
            assert isinstance(refused, Error) and refused.code == ErrorCode.BUSY and "put_session_fraction" in refused.reason
            st = d.stats()
            assert st["puts"]["refused_share"] == 1 and free(d) == 2 and st["ready"] == 1, "nothing was evicted"
            # A reconnect: the old session's puts are lost, and still count for this client.
            d.hello(b"c", agent)
            refused = reply_of(d.receive(b"c", put(2, b"z")), 2)
            assert isinstance(refused, Error) and refused.code == ErrorCode.BUSY
            assert d.stats()["puts"]["lost"] == 2 and free(d) == 2
            # Its last session ends: the agent goes, and after the quarantine every slot is back.
            assert d.receive(b"c", Bye(3)) == [Ack(3)]
            d.tick(5.1)
            st = d.stats()
            assert free(d) == 6 and st["puts"]["freed_late"] == 2 and st["tables"]["puts"] == 0 and st["invariants"] == []
            assert d.node.puts.by_agent == {}
    finally:
        other.close()


def test_a_reconnect_presenting_the_resume_token_frees_the_old_sessions_puts_at_once(
    ipc_dir: Path, agent: ClientAgent,
) -> None:
    """The issue's case: a client with open (and expired) puts reconnects from a new socket.
    Its old session used to hold their slots until it ended by heartbeat silence, counted
    against its share. Presenting the old session's resume token ends it at once, as bye
    would, and frees its puts, as unput would (spec section 5.2): the new session puts again."""
    with node_driver(config(ipc_dir, max_puts_per_session=4, put_pool_fraction=1.0, put_session_fraction=0.5)) as d:
        welcome = d.hello(b"old", agent)
        assert len(welcome.resume) == 16
        reply_of(d.receive(b"old", put(2, b"x")), 2)
        reply_of(d.receive(b"old", put(3, b"y", ttl_ms=100)), 3)
        d.tick(0.2)  # y expired: quarantined, the session still here
        assert free(d) == 4 and d.stats()["puts"]["expired"] == 1
        again = d.hello(b"new", agent, resume=welcome.resume)
        assert again.resume and again.resume != welcome.resume, "each session draws its own token"
        st = d.stats()
        assert free(d) == 8 and st["writing"] == 0, "the old session's puts are free at once"
        assert st["counters"]["sessions_resumed"] == 1 and st["puts"]["freed_on_resume"] == 2
        assert st["tables"]["puts"] == 0 and st["tables"]["sessions"] == 1 and st["invariants"] == []
        assert d.node.puts.by_agent == {}
        # The new session puts the same keys again, up to its share.
        reply = reply_of(d.receive(b"new", put(2, b"x", b"y")), 2)
        assert isinstance(reply, PutReply) and [r.status for r in reply.results] == [KeyStatus.OK] * 2
        # The old identity has no session: it must say hello again.
        gone = reply_of(d.receive(b"old", Unput(4, 1)), 4)
        assert isinstance(gone, Error) and gone.code == ErrorCode.BAD_STATE
        # A token ends one session: presenting it again ends nothing.
        d.hello(b"third", agent, resume=welcome.resume)
        assert d.stats()["counters"]["sessions_resumed"] == 1 and d.stats()["counters"]["resumes_unmatched"] == 1
        assert free(d) == 4


def test_a_socket_resuming_its_own_session_frees_its_puts(ipc_dir: Path, agent: ClientAgent) -> None:
    """A hello from the identity whose session the token names ends that session as any hello
    from it does, and frees its puts at once instead of quarantining them."""
    with node_driver(config(ipc_dir)) as d:
        welcome = d.hello(b"c", agent)
        reply_of(d.receive(b"c", put(2, b"x")), 2)
        d.hello(b"c", agent, request_id=3, resume=welcome.resume)
        st = d.stats()
        assert free(d) == 8 and st["counters"]["sessions_resumed"] == 1 and st["tables"]["puts"] == 0
        assert st["invariants"] == []


def test_a_guessed_or_another_clients_token_ends_nothing(ipc_dir: Path, agent: ClientAgent) -> None:
    """Hostile: a hello presenting a guessed token, or the token of another agent's session
    (learnt somehow), ends no session and frees nothing; it is welcomed as without one."""
    victim = ClientAgent("puts-victim", np.zeros(4 * SLOT, np.uint8))
    try:
        with node_driver(config(ipc_dir, put_pool_fraction=1.0, put_session_fraction=0.5)) as d:
            theirs = d.hello(b"victim", victim)
            reply_of(d.receive(b"victim", put(2, b"v")), 2)
            mine = d.hello(b"me", agent)
            for token in (bytes(16), b"\xff" * 16, mine.resume[:8], theirs.resume[:15] + b"\x00", theirs.resume):
                d.hello(b"me", agent, resume=token)
            st = d.stats()
            assert st["counters"].get("sessions_resumed", 0) == 0 and st["counters"]["resumes_unmatched"] == 5
            assert free(d) == 6 and st["tables"]["sessions"] == 2, "the victim's session and put are untouched"
            # The victim's session still commits its put.
            done = reply_of(d.receive(b"victim", Commit(3, 1)), 3)
            assert isinstance(done, Completion) and done.results[0].status is KeyStatus.STORED
            assert d.stats()["invariants"] == []
    finally:
        victim.close()


def test_a_resume_makes_way_at_max_clients(ipc_dir: Path, agent: ClientAgent) -> None:
    """At max_clients, the session a token names makes way: a reconnect is not one client more."""
    with node_driver(config(ipc_dir, max_clients=1)) as d:
        welcome = d.hello(b"old", agent)
        d.hello(b"new", agent, resume=welcome.resume)
        assert d.stats()["tables"]["sessions"] == 1
        refused = d.receive(b"other", Hello(1, (CURRENT_VERSION,), "x", agent.name, agent.metadata, agent.regions))
        assert isinstance(refused[0], Error) and refused[0].code == ErrorCode.TOO_MANY_CLIENTS


def test_reconnect_churn_with_open_puts_keeps_slots_and_tables_bounded(ipc_dir: Path, agent: ClientAgent) -> None:
    """Churn: a thousand reconnects, each session leaving puts open (one expired), each next
    hello presenting the previous token. Slots and every table come back to their bound."""
    with node_driver(config(ipc_dir, max_puts_per_session=4, put_pool_fraction=1.0, put_session_fraction=0.5)) as d:
        welcome = d.hello(b"c0", agent)
        base = dict(d.stats()["tables"])
        for i in range(1, 1001):
            reply_of(d.receive(b"c%d" % (i - 1), put(2, b"k%d" % i)), 2)
            reply_of(d.receive(b"c%d" % (i - 1), put(3, b"j%d" % i, ttl_ms=100)), 3)
            d.tick(0.15)
            welcome = d.hello(b"c%d" % i, agent, resume=welcome.resume)
            assert free(d) == 8, i
        st = d.stats()
        assert st["counters"]["sessions_resumed"] == 1000 and st["puts"]["freed_on_resume"] == 2000
        assert st["tables"] == base and st["tables"]["sessions"] == 1 and st["invariants"] == []
        assert d.node.puts.by_agent == {} and len(d.node.sessions.table) == 1


class _Pool:
    def __init__(self, slot_size: int) -> None:
        self.spec = type("Spec", (), {"slot_size": slot_size})()


def test_layouts_checked_once_are_kept_within_a_bound_and_a_misfit_is_named() -> None:
    """A column block's layout is checked against the pools once and kept for the next
    block like it; however many layouts a client sends, at most ``LAYOUTS_KEPT`` are kept,
    none over ``LAYOUT_KEPT_SPANS`` spans, and a layout that does not fit is named by its
    first bad span every time, never kept."""
    memories: Any = {"kv": _Pool(64)}
    kept: dict[Any, Any] = {}
    for n in range(3 * LAYOUTS_KEPT):
        items = (DepositItem(b"k", tuple(SrcSpan(f"L{n}.{j}", "kv", 1, 64 * j, 64) for j in range(4))),)
        block = _ColumnBlock(deposit_blocks(items)[0], "columns[0]", memories, kept)
        assert block.failure is None and block.sizes == [64] * 4
        assert 1 <= len(kept) <= LAYOUTS_KEPT
    again = _ColumnBlock(deposit_blocks(items)[0], "columns[0]", memories, kept)
    assert again.layout is block.layout  # the kept check, not a new one
    kept.clear()
    big = (DepositItem(b"k", tuple(SrcSpan(f"L{j}", "kv", 1, 64 * j, 64) for j in range(LAYOUT_KEPT_SPANS + 1))),)
    assert _ColumnBlock(deposit_blocks(big)[0], "columns[0]", memories, kept).failure is None and not kept
    for spans, code, path in (
        ((SrcSpan("a", "kv", 1, 0, 64), SrcSpan("b", "nope", 1, 64, 64)), ErrorCode.UNKNOWN_POOL, "columns[0].pools[1]"),
        ((SrcSpan("a", "kv", 1, 0, 64), SrcSpan("b", "kv", 1, 64, 32)), ErrorCode.SIZE_MISMATCH, "columns[0].lengths[1]"),
    ):
        for _ in range(2):
            block = _ColumnBlock(deposit_blocks((DepositItem(b"k", spans),))[0], "columns[0]", memories, kept)
            assert block.failure is not None and (block.failure.code, block.failure.path) == (code, path)
            assert not kept
