"""The source side of cross-node delivery in process (``kvcr_node.source``), with a fake clock.

The test plays the target node: it opens a peer session on a node whose loop never runs
(``kvcr_testing.nodes.NodeDriver``), announces clients, asks for writes and probes them
(spec sections 5.3 and 12). Writes that move bytes run real NIXL transfers into the test's
own buffers, compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvcr_io.agent import TransferError
from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome
from kvcr_protocol import (
    CURRENT_VERSION,
    Ack,
    Bye,
    Completion,
    DeliverItem,
    Deposit,
    DepositItem,
    DstSpan,
    Error,
    ErrorCode,
    KeyStatus,
    Lease,
    LeaseReply,
    Message,
    PeerClient,
    PeerForget,
    PeerHello,
    PeerWelcome,
    Probe,
    ProbeReply,
    Progress,
    Query,
    Refuse,
    ReleaseLease,
    SrcSpan,
    WriteDone,
    WriteNotify,
    WriteRequest,
    WriteState,
    decode_notification,
    deliver_columns,
)
from kvcr_protocol.columns import U32, pack
from kvcr_protocol.twins import MAX_TWIN_PROOFS, TWIN_PROOF_BYTES, proves_twin, twin_proof
from kvcr_protocol.versions import CLIENT_GONE_VERSION, LEASES_VERSION
from kvcr_testing.health import wait_until
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver
from kvcr_testing.patterns import assert_bytes_equal, pattern

SLOT = 4096
SPANS = 2
LAYOUT = tuple((f"L{i}", "kv") for i in range(SPANS))
INCARNATION = 7
"""The incarnation of the target node the test plays."""


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/source.sock", name="source", pools=(PoolSpec("kv", SLOT, 8, "dram"),),
                      log_level="WARNING", client_grace_ms=600_000, heartbeat_ms=2_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def target() -> Iterator[ClientAgent]:
    """The agent of the target node the test plays (its pools are region 1)."""
    a = ClientAgent("test-target", np.zeros(SPANS * SLOT, np.uint8))
    yield a
    a.close()


@pytest.fixture(scope="module")
def client() -> Iterator[ClientAgent]:
    """A client of that target: region 1 holds source bytes, region 2 is where a write lands."""
    a = ClientAgent("test-target-client", pattern(SPANS * SLOT, 21), np.zeros(SPANS * SLOT, np.uint8))
    yield a
    a.close()


def peer_hello(
    d: NodeDriver, identity: bytes, target: ClientAgent, request_id: int = 1, incarnation: int = INCARNATION,
    versions: tuple[int, ...] = (CURRENT_VERSION,), link: bytes = b"",
) -> PeerWelcome:
    hello = PeerHello(request_id, versions, "target", incarnation, target.name, target.metadata, target.regions, link)
    replies = d.receive(identity, hello)
    assert len(replies) == 1 and isinstance(replies[0], PeerWelcome), replies
    assert replies[0].incarnation == d.node.incarnation
    return replies[0]


def announce(d: NodeDriver, identity: bytes, client: ClientAgent, request_id: int) -> None:
    assert d.receive(identity, PeerClient(request_id, client.name, client.metadata, client.regions)) == [Ack(request_id)]


def write(op: int, agent: str, key: bytes = b"k", deadline_ms: int = 5_000) -> WriteRequest:
    item = DeliverItem(key, tuple(DstSpan(name, 2, i * SLOT, SLOT) for i, (name, _) in enumerate(LAYOUT)))
    return WriteRequest(op, agent, (item,), deadline_ms)


def probe(d: NodeDriver, identity: bytes, request_id: int, op: int) -> WriteState:
    replies = d.receive(identity, Probe(request_id, op))
    assert len(replies) == 1 and isinstance(replies[0], ProbeReply) and replies[0].op == op, replies
    assert replies[0].incarnation == d.node.incarnation
    state: WriteState = replies[0].state
    return state


def only(replies: list[Message], kind: type[Message]) -> Any:
    assert len(replies) == 1 and isinstance(replies[0], kind), replies
    return replies[0]


def assert_at_rest(d: NodeDriver) -> None:
    st = d.stats()
    assert st["invariants"] == [] and st["claims"]["total"] == 0 and st["operations_pending"] == 0, st
    assert st["tables"]["retired_sessions"] == 0 and st["tables"]["waiters"] == 0, st["tables"]


def test_peer_and_client_requests_do_not_mix(ipc_dir: Path, target: ClientAgent, client: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target)
        refused = only(d.receive(b"p", write(2, client.name)), Refuse)
        assert refused.code == ErrorCode.BAD_STATE and client.name in refused.reason  # not announced
        assert only(d.receive(b"p", Query(3, (b"k",))), Error).code == ErrorCode.BAD_STATE
        d.hello(b"c", client)
        assert only(d.receive(b"c", write(4, client.name)), Error).code == ErrorCode.BAD_STATE
        assert d.stats()["peer_sessions"] == 1 and d.stats()["clients"] == 1
        assert_at_rest(d)


def test_a_probe_follows_a_write_until_it_is_over(ipc_dir: Path, target: ClientAgent, client: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target)
        announce(d, b"p", client, 2)
        outcome, entry = d.node.store.begin_deposit(b"k", LAYOUT)  # still being written here
        assert outcome is DepositOutcome.NEW and entry is not None
        assert d.receive(b"p", write(3, client.name, deadline_ms=1_000)) == []
        assert probe(d, b"p", 4, 3) is WriteState.WAITING
        assert probe(d, b"p", 5, 99) is WriteState.UNKNOWN
        d.tick(1.1)
        done = only(d.sent(b"p"), WriteDone)
        assert done.id == 3 and (done.results[0].status, done.results[0].code) == (KeyStatus.FAILED, ErrorCode.TIMEOUT)
        assert probe(d, b"p", 6, 3) is WriteState.DONE
        d.node.store.abandon(entry)
        d.node.operations.wake(b"k")
        assert_at_rest(d)


def test_a_reconnecting_target_ends_its_old_session(ipc_dir: Path, target: ClientAgent, client: ClientAgent) -> None:
    """A new peer session of the same incarnation closes the old one: its waiting write is
    aborted (nothing of it ran), so a probe of it finds nothing that can still write."""
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"old", target)
        announce(d, b"old", client, 2)
        outcome, entry = d.node.store.begin_deposit(b"k", LAYOUT)
        assert outcome is DepositOutcome.NEW and entry is not None
        assert d.receive(b"old", write(3, client.name)) == []
        peer_hello(d, b"new", target)
        assert [s.identity for s in d.node.sessions] == [b"new"]
        assert d.sent(b"old") == []  # a closed session gets no write_done
        assert probe(d, b"new", 4, 3) is WriteState.UNKNOWN
        assert d.stats()["tables"]["peer_clients"] == 0  # its announced clients went with it
        d.node.store.abandon(entry)
        d.node.operations.wake(b"k")
        assert_at_rest(d)


def test_knowing_an_incarnation_takes_no_peer_session_over(ipc_dir: Path, target: ClientAgent) -> None:
    """Any client can read a target's incarnation from its stats. A raw peer_hello with it
    (and no link token, or another) opens a session of its own: it neither ends the target's
    session nor takes its leases, which it cannot release. Two links of one target (two
    spellings of this endpoint) coexist; only the same link's reconnect takes the leases over."""
    token, other_spelling = bytes(range(16)), bytes(range(1, 17))
    with node_driver(config(ipc_dir)) as d:
        outcome, entry = d.node.store.begin_deposit(b"k", LAYOUT)
        assert outcome is DepositOutcome.NEW and entry is not None
        d.node.store.commit(entry)
        peer_hello(d, b"target", target, link=token)
        replies = d.receive(b"target", Lease(2, (b"k",), None, 60_000))
        lease = only(replies, LeaseReply).lease
        assert lease and entry.claims == 1
        for intruder, link in ((b"intruder", b""), (b"guesser", bytes(16)), (b"spelling", other_spelling)):
            peer_hello(d, intruder, target, link=link)
            refused = only(d.receive(intruder, ReleaseLease(3, lease)), Error)
            assert refused.code == ErrorCode.UNKNOWN_LEASE
        assert {s.identity for s in d.node.sessions} == {b"target", b"intruder", b"guesser", b"spelling"}
        st = d.stats()
        assert st["leases"]["held"] == 1 and st["leases"].get("carried_over", 0) == 0 and entry.claims == 1
        # The target's own reconnect on that link: the old session goes, its lease with the new one.
        peer_hello(d, b"target-again", target, link=token)
        assert b"target" not in {s.identity for s in d.node.sessions}
        assert d.stats()["leases"]["carried_over"] == 1
        assert d.receive(b"target-again", ReleaseLease(4, lease)) == [Ack(4)]
        assert entry.claims == 0
        for identity in (b"intruder", b"guesser", b"spelling", b"target-again"):
            assert d.receive(identity, Bye(9)) == [Ack(9)]
        assert_at_rest(d)


def test_announced_clients_are_bounded(ipc_dir: Path, target: ClientAgent, client: ClientAgent) -> None:
    other = ClientAgent("test-target-client-2", np.zeros(SPANS * SLOT, np.uint8), np.zeros(SPANS * SLOT, np.uint8))
    try:
        with node_driver(config(ipc_dir, max_peer_clients=1)) as d:
            peer_hello(d, b"p", target)
            announce(d, b"p", client, 2)
            announce(d, b"p", other, 3)
            st = d.stats()
            assert st["counters"]["peer_clients_evicted"] == 1 and st["tables"]["peer_clients"] == 1
            # The forgotten client's write is refused: the target announces it again first.
            assert only(d.receive(b"p", write(4, client.name)), Refuse).code == ErrorCode.BAD_STATE
            assert_at_rest(d)
    finally:
        other.close()


def store_object(d: NodeDriver, client: ClientAgent) -> np.ndarray:
    """Deposit region 1 of ``client`` under ``k`` through a client session of its own."""
    d.hello(b"owner", client)
    spans = tuple(SrcSpan(name, pool, 1, i * SLOT, SLOT) for i, (name, pool) in enumerate(LAYOUT))
    replies = d.receive(b"owner", Deposit(9, (DepositItem(b"k", spans),)))
    d.finish_transfers(client)
    stored = only(replies + d.sent(b"owner"), Completion)
    assert stored.results[0].status is KeyStatus.STORED
    src: np.ndarray = client.buffers[0]
    return src


@pytest.mark.parametrize("next_turn", [False, True], ids=["inline", "next-turn"])
def test_a_write_lands_every_byte_in_the_client_memory(
    ipc_dir: Path, target: ClientAgent, client: ClientAgent, next_turn: bool
) -> None:
    """A READY object is claimed and written in the turn that decoded the request; with the
    benchmark's hook given to the node, when the hook runs it (bench/deferred_source.py: at
    the end of the turn). The same bytes land."""
    held: list[Callable[[], None]] = []
    dst = client.buffers[1]
    dst[:] = 0
    with node_driver(config(ipc_dir), source_submit=held.append if next_turn else None) as d:
        src = store_object(d, client)
        peer_hello(d, b"p", target)
        announce(d, b"p", client, 2)
        replies = d.receive(b"p", write(3, client.name))
        if next_turn:
            assert replies == [] and d.stats()["transfers"]["in_flight"] == 0
            assert len(held) == 1
            held.pop()()
            replies = d.sent(b"p")
        d.finish_transfers(client)
        done = only(replies + d.sent(b"p"), WriteDone)
        assert done.id == 3 and done.results[0].status is KeyStatus.OK
        assert_bytes_equal(dst, src, "the written object")
        counters = d.stats()["counters"]
        assert counters.get("writes_deferred", 0) == int(next_turn)
        assert counters.get("writes_inline", 0) == int(not next_turn)
        assert probe(d, b"p", 4, 3) is WriteState.DONE
        assert_at_rest(d)


def stored_here(d: NodeDriver, client: ClientAgent, key: bytes) -> None:
    """``key`` deposited at this node by a client session of its own (from region 1)."""
    d.hello(b"c", client)
    item = DepositItem(key, tuple(SrcSpan(name, pool, 1, i * SLOT, SLOT) for i, (name, pool) in enumerate(LAYOUT)))
    d.receive(b"c", Deposit(1, (item,)))
    d.finish_transfers(client)
    assert only(d.sent(b"c"), Completion).results[0].status is KeyStatus.STORED


@pytest.mark.parametrize("fail_group", [None, 1])
def test_a_planned_write_with_notify_serves_and_reports_each_group(
    ipc_dir: Path, target: ClientAgent, client: ClientAgent, monkeypatch: pytest.MonkeyPatch, fail_group: int | None
) -> None:
    """Spec sections 6.8, 6.10 and 12: the target forwards the client's rows with their plan
    and ``WriteNotify``; the source writes group by group, each WRITE notifying the client's
    agent under the client's request id and item index; a failed group fails the later ones."""
    source, dest = client.buffers
    dest[:] = 0
    with node_driver(config(ipc_dir)) as d:
        stored_here(d, client, b"k")
        peer_hello(d, b"p", target)
        announce(d, b"p", client, 2)
        client.notifications.clear()
        if fail_group is not None:
            real, calls = d.node.transfers.start_prepared, []  # a plan's groups post from lists prepared once

            def start(*args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                if len(calls) == fail_group + 1:
                    raise TransferError("refused for the test")
                return real(*args, **kwargs)

            monkeypatch.setattr(d.node.transfers, "start_prepared", start)
        block = deliver_columns(write(0, client.name).items, groups=range(SPANS))
        notify = WriteNotify(0xC0FFEE, 41, pack([5], U32))  # the client's deliver 41, its item 5
        first = d.receive(b"p", WriteRequest(3, client.name, (), 5_000, columns=(block,), notify=notify))
        d.finish_transfers(client)
        sent = first + d.sent(b"p")
        done = only([m for m in sent if isinstance(m, WriteDone)], WriteDone)
        landed = SPANS if fail_group is None else fail_group
        assert list(done.done_counts()) == [landed]
        status = KeyStatus.OK if fail_group is None else KeyStatus.FAILED
        assert done.results[0].status is status
        # A notification may reach the client's agent a moment after the initiator saw DONE.
        assert wait_until(lambda: bool(client.notifications.extend(client.agent.progress())) or len(client.notifications) >= landed, 5.0)
        notes = sorted((n.token, n.request, n.key, n.group) for n in map(decode_notification, client.notifications))
        assert notes == [(0xC0FFEE, 41, 5, g) for g in range(landed)]
        assert_bytes_equal(dest[: landed * SLOT], source[: landed * SLOT], "groups that landed")
        assert not dest[landed * SLOT :].any(), "groups after the failed one are never written"
        for msg in sent:
            if isinstance(msg, Progress):
                assert msg.id == 3 and all(k == 0 and 0 < n <= landed for k, n in msg.pairs())
        assert_at_rest(d)


# --------------------------------------------------------------------------- a client left (version 5)


@pytest.fixture(scope="module")
def owner() -> Iterator[ClientAgent]:
    """A client of the source itself, that deposits the objects the writes read (region 1)."""
    a = ClientAgent("test-source-owner", pattern(SPANS * SLOT, 33))
    yield a
    a.close()


@pytest.fixture(scope="module")
def other_target() -> Iterator[ClientAgent]:
    """The agent of a second target node (another incarnation, another peer session)."""
    a = ClientAgent("test-target-2", np.zeros(SPANS * SLOT, np.uint8))
    yield a
    a.close()


def deposit_here(d: NodeDriver, owner: ClientAgent, key: bytes) -> np.ndarray:
    d.hello(b"owner", owner)
    item = DepositItem(key, tuple(SrcSpan(name, pool, 1, i * SLOT, SLOT) for i, (name, pool) in enumerate(LAYOUT)))
    d.receive(b"owner", Deposit(1, (item,)))
    d.finish_transfers(owner)
    assert only(d.sent(b"owner"), Completion).results[0].status is KeyStatus.STORED
    src: np.ndarray = owner.buffers[0]
    return src


def forget(d: NodeDriver, identity: bytes, request_id: int, agent: str) -> None:
    assert d.receive(identity, PeerForget(request_id, agent)) == [Ack(request_id)]


def test_a_forgotten_client_leaves_the_table_and_its_agent_is_removed(
    ipc_dir: Path, target: ClientAgent, client: ClientAgent,
) -> None:
    """Spec section 5.3 (version 5): the target says its client left; the source forgets it
    in that peer session at once, removes its agent, and refuses a later write naming it."""
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target)
        agents_before = d.stats()["tables"]["remote_agents"]
        announce(d, b"p", client, 2)
        st = d.stats()
        assert st["tables"]["peer_clients"] == 1 and st["tables"]["remote_agents"] == agents_before + 1
        forget(d, b"p", 3, client.name)
        st = d.stats()
        assert st["tables"]["peer_clients"] == 0, st["tables"]
        assert st["tables"]["remote_agents"] == agents_before and st["tables"]["remote_agents_departed"] == 0, st["tables"]
        assert client.name not in d.node.remote_agents.loaded
        assert st["counters"]["peer_clients_forgotten"] == 1
        refused = only(d.receive(b"p", write(4, client.name)), Refuse)
        assert refused.code == ErrorCode.BAD_STATE and client.name in refused.reason
        # Announced again (the client came back): served as before.
        announce(d, b"p", client, 5)
        assert d.stats()["tables"]["peer_clients"] == 1 and client.name in d.node.remote_agents.loaded
        forget(d, b"p", 6, client.name)
        assert d.stats()["tables"]["peer_clients"] == 0
        assert_at_rest(d)


def test_a_write_accepted_before_the_forget_runs_to_the_end(
    ipc_dir: Path, target: ClientAgent, client: ClientAgent, owner: ClientAgent,
) -> None:
    """A write in flight when its client is forgotten keeps the regions it was accepted with:
    every byte lands, write_done says OK, and only then is the client's agent removed."""
    dst = client.buffers[1]
    dst[:] = 0
    with node_driver(config(ipc_dir)) as d:
        src = deposit_here(d, owner, b"k")
        peer_hello(d, b"p", target)
        announce(d, b"p", client, 2)
        assert d.receive(b"p", write(3, client.name)) == []  # claimed and submitted in this turn
        assert d.stats()["transfers"]["in_flight"] == 1
        forget(d, b"p", 4, client.name)
        st = d.stats()
        assert st["tables"]["peer_clients"] == 0 and client.name in d.node.remote_agents.loaded, st["tables"]
        assert st["tables"]["remote_agents_gone"] == 1, st["tables"]
        d.finish_transfers(client)
        done = only(d.sent(b"p"), WriteDone)
        assert done.id == 3 and done.results[0].status is KeyStatus.OK
        assert_bytes_equal(dst, src, "the write of a forgotten client")
        st = d.stats()
        assert client.name not in d.node.remote_agents.loaded, st["tables"]
        assert (st["tables"]["remote_agents_gone"], st["tables"]["remote_agents_pending"]) == (0, 0), st["tables"]
        assert probe(d, b"p", 5, 3) is WriteState.DONE
        assert_at_rest(d)


def test_a_waiting_write_of_a_forgotten_client_is_still_served(
    ipc_dir: Path, target: ClientAgent, client: ClientAgent, owner: ClientAgent,
) -> None:
    """A write waiting on a WRITING key when the forget arrives: the key becomes READY, the
    write lands byte for byte, and the agent goes after it."""
    dst = client.buffers[1]
    dst[:] = 0
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target)
        announce(d, b"p", client, 2)
        d.hello(b"owner", owner)
        item = DepositItem(b"k", tuple(SrcSpan(name, pool, 1, i * SLOT, SLOT) for i, (name, pool) in enumerate(LAYOUT)))
        d.receive(b"owner", Deposit(1, (item,)))  # WRITING until its transfer ends
        assert d.receive(b"p", write(3, client.name)) == []
        assert probe(d, b"p", 4, 3) is WriteState.WAITING
        forget(d, b"p", 5, client.name)
        assert client.name in d.node.remote_agents.loaded
        d.finish_transfers(owner, client)
        d.finish_transfers(owner, client)
        assert only(d.sent(b"owner"), Completion).results[0].status is KeyStatus.STORED
        done = only(d.sent(b"p"), WriteDone)
        assert done.results[0].status is KeyStatus.OK
        assert_bytes_equal(dst, owner.buffers[0], "the write that waited")
        assert client.name not in d.node.remote_agents.loaded
        assert_at_rest(d)


def test_hostile_forgets_change_nothing_but_their_own_session(
    ipc_dir: Path, target: ClientAgent, other_target: ClientAgent, client: ClientAgent, owner: ClientAgent,
) -> None:
    """Announced clients are per peer session: another target's forget of our client, of an
    unknown agent, of its own agent, repeated or flooded, is answered ack and changes
    nothing; a malformed one is refused naming the field; the innocent client's write still
    lands byte for byte, and every table is where it was."""
    dst = client.buffers[1]
    dst[:] = 0
    with node_driver(config(ipc_dir)) as d:
        src = deposit_here(d, owner, b"k")
        peer_hello(d, b"p", target)
        peer_hello(d, b"q", other_target, incarnation=INCARNATION + 1)
        announce(d, b"p", client, 2)
        before = d.stats()
        assert before["peer_sessions"] == 2 and before["tables"]["peer_clients"] == 1
        forget(d, b"q", 3, client.name)  # another target's client
        forget(d, b"q", 4, other_target.name)  # the session's own agent
        forget(d, b"q", 5, target.name)  # the other session's agent
        for n in range(500):  # a flood of names nobody announced
            forget(d, b"q", 100 + n, f"nobody-{n}")
        forget(d, b"p", 6, "nobody")
        # Malformed: refused with the field named, nothing acted on.
        error = only(_raw(d, b"q", {"v": CLIENT_GONE_VERSION, "t": "peer_forget", "id": 7, "agent": "x" * 129}), Error)
        assert (error.code, error.path) == (ErrorCode.TOO_LARGE, "agent")
        error = only(_raw(d, b"q", {"v": CLIENT_GONE_VERSION, "t": "peer_forget", "id": 8}), Error)
        assert (error.code, error.path) == (ErrorCode.MISSING_FIELD, "agent")
        error = only(_raw(d, b"q", {"v": CLIENT_GONE_VERSION, "t": "peer_forget", "id": 9, "agent": 7}), Error)
        assert (error.code, error.path) == (ErrorCode.WRONG_TYPE, "agent")
        # A client session cannot send it.
        d.hello(b"c", other_target)
        assert only(d.receive(b"c", PeerForget(10, client.name)), Error).code == ErrorCode.BAD_STATE
        after = d.stats()
        assert after["tables"]["peer_clients"] == 1 and client.name in d.node.remote_agents.loaded
        assert after["counters"]["peer_forgets_unknown"] == 504 and "peer_clients_forgotten" not in after["counters"]
        assert {k: v for k, v in after["tables"].items() if k != "sessions"} == {
            k: v for k, v in before["tables"].items() if k != "sessions"}, (before["tables"], after["tables"])
        # The innocent target's client is served, byte for byte.
        assert d.receive(b"p", write(11, client.name)) == []
        d.finish_transfers(client)
        assert only(d.sent(b"p"), WriteDone).results[0].status is KeyStatus.OK
        assert_bytes_equal(dst, src, "the innocent client's write")
        # Its own forget, twice: the second is a no-op.
        forget(d, b"p", 12, client.name)
        forget(d, b"p", 13, client.name)
        st = d.stats()
        assert st["tables"]["peer_clients"] == 0 and client.name not in d.node.remote_agents.loaded, st["tables"]
        assert st["counters"]["peer_clients_forgotten"] == 1 and st["counters"]["peer_forgets_unknown"] == 505
        assert_at_rest(d)


def test_one_client_announced_by_two_targets_stays_while_either_holds_it(
    ipc_dir: Path, target: ClientAgent, other_target: ClientAgent, client: ClientAgent,
) -> None:
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target)
        peer_hello(d, b"q", other_target, incarnation=INCARNATION + 1)
        announce(d, b"p", client, 2)
        announce(d, b"q", client, 3)
        forget(d, b"q", 4, client.name)
        assert d.stats()["tables"]["peer_clients"] == 1 and client.name in d.node.remote_agents.loaded
        forget(d, b"p", 5, client.name)
        assert d.stats()["tables"]["peer_clients"] == 0 and client.name not in d.node.remote_agents.loaded
        assert_at_rest(d)


def test_a_peer_session_below_version_5_cannot_forget(ipc_dir: Path, target: ClientAgent, client: ClientAgent) -> None:
    """Spec section 7: a session that agreed on 4 carries no peer_forget (UNKNOWN_TYPE); its
    clients stay until max_peer_clients or the session's end, as before."""
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target, versions=tuple(range(1, LEASES_VERSION + 1)))
        assert d.node.sessions.get(b"p") is not None and d.node.sessions.get(b"p").version == LEASES_VERSION  # type: ignore[union-attr]
        assert d.receive(b"p", PeerClient(2, client.name, client.metadata, client.regions), LEASES_VERSION) == [Ack(2)]
        for v in (LEASES_VERSION, CLIENT_GONE_VERSION):
            error = only(_raw(d, b"p", {"v": v, "t": "peer_forget", "id": 3, "agent": client.name}, LEASES_VERSION), Error)
            assert (error.code, error.path) == (ErrorCode.UNKNOWN_TYPE, "t"), error
        assert d.stats()["tables"]["peer_clients"] == 1 and client.name in d.node.remote_agents.loaded
        assert_at_rest(d)


def _raw(d: NodeDriver, identity: bytes, obj: dict[str, Any], version: int = CURRENT_VERSION) -> list[Message]:
    """Hand the node a hand-built frame from ``identity``; what it answered."""
    d.receive_frames([identity, msgpack.packb(obj, use_bin_type=True)])
    return d.sent(identity, version)


def test_a_stopping_source_still_forgets(ipc_dir: Path, target: ClientAgent, client: ClientAgent) -> None:
    """Spec section 10.1: peer_forget only lets go of things, so a stopping node serves it."""
    with node_driver(config(ipc_dir)) as d:
        peer_hello(d, b"p", target)
        announce(d, b"p", client, 2)
        d.node.router.stopping = True
        assert only(d.receive(b"p", PeerClient(3, client.name, client.metadata, client.regions)), Error).code == ErrorCode.SHUTTING_DOWN
        forget(d, b"p", 4, client.name)
        assert d.stats()["tables"]["peer_clients"] == 0 and client.name not in d.node.remote_agents.loaded
        assert_at_rest(d)


def test_a_welcome_proves_the_targets_other_links_here(ipc_dir: Path, target: ClientAgent) -> None:
    """Spec section 5.3, "Twin links": a peer_welcome proves, per other live session of the
    same target incarnation, that this node received that session's token and this one's;
    another incarnation's sessions, a session below version 5 and a hello without a token
    get none, and a welcome carries at most MAX_TWIN_PROOFS."""
    tokens = [bytes([i]) * 16 for i in range(1, 20)]
    with node_driver(config(ipc_dir)) as d:
        assert peer_hello(d, b"t1", target, link=tokens[0]).twins == b""
        second = peer_hello(d, b"t2", target, link=tokens[1])
        assert second.twins == twin_proof(tokens[0], tokens[1])
        assert proves_twin(second.twins, tokens[0], tokens[1]) and not proves_twin(second.twins, tokens[1], tokens[0])
        assert peer_hello(d, b"other", target, incarnation=INCARNATION + 1, link=tokens[2]).twins == b""
        assert peer_hello(d, b"old", target, versions=(1, 2, 3, 4), link=tokens[3]).twins == b""
        assert peer_hello(d, b"blank", target).twins == b""
        # A reconnect of the first link (same token) takes its session over: no proof of itself.
        again = peer_hello(d, b"t1-again", target, link=tokens[0])
        assert again.twins == twin_proof(tokens[1], tokens[0]) + twin_proof(tokens[3], tokens[0])
        for i, token in enumerate(tokens[4:]):
            peer_hello(d, b"t%d" % (i + 4), target, link=token)
        last = peer_hello(d, b"last", target, link=b"\xee" * 16)
        assert len(last.twins) == MAX_TWIN_PROOFS * TWIN_PROOF_BYTES
