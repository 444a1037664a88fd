"""The client's session in process: a ``ClientSession`` and a node driven message by message.

An h11-style pair (architecture §4): the test carries each frame the session gives to the
node's router, and each frame the node puts in its outbox back to the session, with one fake
clock for both. No socket, thread or sleep: hello and its refusal, deadlines and their grace,
memory holds that outlive a timeout (spec section 5.1), notifications against replies
(spec section 6.10), ``lease_end`` events (spec section 6.11), heartbeats and a node that
falls silent (spec section 14) run deterministically.
"""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcr_client.errors import ClientClosed, NodeError, NodeLostError, OperationTimeout
from kvcr_client.session import (
    _GRACE_S,
    Capacity,
    ClientSession,
    Event,
    Failed,
    LeaseEnd,
    Lost,
    Observed,
    Replied,
    SendFrame,
    Settled,
    Undecodable,
    Unmatched,
)
from kvcr_node.config import NodeConfig
from kvcr_node.poolspec import PoolSpec
from kvcr_node.store import DepositOutcome
from kvcr_protocol import (
    CURRENT_VERSION,
    Ack,
    Bye,
    CapacityEvent,
    Completion,
    Deliver,
    DeliverItem,
    DstSpan,
    ErrorCode,
    Heartbeat,
    Hello,
    KeyStatus,
    Lease,
    LeaseReply,
    LocalProtocolError,
    Notification,
    Progress,
    Query,
    QueryReply,
    SubmitHint,
    UnregisterRegions,
    Welcome,
    decode,
    encode,
    encode_notification,
    supported_up_to,
)
from kvcr_protocol.session_rules import SessionState
from kvcr_testing.nodes import ClientAgent, NodeDriver, node_driver

SLOT = 4096
HEARTBEAT_S = 2.0
SILENCE_S = 3 * HEARTBEAT_S + 1.0
"""Three heartbeat intervals and the client's slack (``kvcr_client.session``)."""
ROOT = Path(__file__).resolve().parents[2]


def config(ipc_dir: Path, **changes: Any) -> NodeConfig:
    base = NodeConfig(endpoint=f"ipc://{ipc_dir}/session.sock", name="session", pools=(PoolSpec("kv", SLOT, 8, "dram"),),
                      log_level="WARNING", client_grace_ms=600_000, heartbeat_ms=int(HEARTBEAT_S * 1000),
                      lease_ttl_ms=1_000)
    return NodeConfig(**{**base.__dict__, **changes}).validated()


@pytest.fixture(scope="module")
def agent() -> Iterator[ClientAgent]:
    """The test's own NIXL agent, with one registered buffer (region 1)."""
    a = ClientAgent("session-client", np.zeros(4 * SLOT, np.uint8))
    yield a
    a.close()


class Pair:
    """A client session and a driven node, wired by hand: ``send`` carries a request to the
    node's router, ``flush`` carries what the node sent back to the session."""

    def __init__(self, driver: NodeDriver, agent: ClientAgent, versions: tuple[int, ...] = supported_up_to(CURRENT_VERSION)):
        self.d = driver
        self.agent = agent
        self.session: ClientSession[str] = ClientSession(versions, "ipc://session")
        self.identity = b"client"
        self.ids = itertools.count(1)
        self.ops: dict[str, int] = {}

    def now(self) -> float:
        return self.d.clock()

    def send(self, name: str, build: Any, timeout_s: float = 10.0, **flags: bool) -> int:
        """Send the request ``build(op_id)`` under handle ``name``; the node reads it at once."""
        op_id = next(self.ids)
        self.ops[name] = op_id
        frame = self.session.send(op_id, build(op_id), self.now(), timeout_s, name, **flags)
        self.d.receive_frames([self.identity, frame])
        return op_id

    def flush(self) -> list[Event[str]]:
        """Everything the node sent since, handed to the session in order: the events."""
        events: list[Event[str]] = []
        for to, payload in self.d.node.outbox.take():
            assert to == self.identity
            events.extend(self.session.receive(payload, self.now()))
        return events

    def hello(self, versions: tuple[int, ...] | None = None) -> list[Event[str]]:
        a = self.agent
        offered = self.session.versions if versions is None else versions
        self.send("hello", lambda i: Hello(i, offered, "session-client", a.name, a.metadata, a.regions))
        return self.flush()

    def tick(self, seconds: float, answer: bool = True) -> list[Event[str]]:
        """Move the shared clock: the node's timed steps, then the session's; frames the session
        sends itself (heartbeats) reach the node only while it ``answer``s."""
        self.d.tick(seconds)
        events = self.session.timeouts(self.now())
        for event in events:
            if isinstance(event, SendFrame) and answer:
                self.d.receive_frames([self.identity, event.frame])
        return events + (self.flush() if answer else [])

    def deliver_to_nowhere(self, timeout_s: float, deadline_ms: int) -> int:
        """A deliver into region 1 hinted to a source nobody serves: the node holds it, waiting
        for a link, until its deadline (a request that touches client memory, unanswered)."""
        far = "ipc:///tmp/kvcr-session-nobody.sock"
        self.send("hint", lambda i: SubmitHint(i, "r", far, (b"remote",)))
        assert self.flush() == [Replied("hint", Ack(self.ops["hint"]))]
        item = DeliverItem(b"remote", (DstSpan("L0", 1, 0, SLOT),))
        op_id = self.send("deliver", lambda i: Deliver(i, (item,), request_id="r", deadline_ms=deadline_ms),
                          timeout_s, touches_memory=True, holds=True, observed=True)
        assert self.flush() == []
        return op_id


def only(events: list[Event[str]], *kinds: type) -> list[Event[str]]:
    """The events of ``kinds`` (heartbeats and their echoes left out)."""
    return [e for e in events if isinstance(e, kinds)]


def opened(pair: Pair) -> Welcome:
    events = pair.hello()
    assert len(events) == 1 and isinstance(events[0], Replied) and events[0].handle == "hello", events
    welcome = events[0].message
    assert isinstance(welcome, Welcome)
    return welcome


# --------------------------------------------------------------------------- purity


FORBIDDEN_PREFIXES = ("zmq", "nixl", "nixl_cu12", "nixl_cu13", "asyncio", "concurrent", "kvcr_node", "kvcr_io")
FORBIDDEN_EXACT = {"threading", "_thread", "socket", "_socket", "selectors", "select", "time", "multiprocessing", "logging"}

PROBE = """
import json, sys, types
before = set(sys.modules)
package = types.ModuleType("kvcr_client")  # the package without its __init__ (which imports the core)
package.__path__ = [sys.argv[1]]
sys.modules["kvcr_client"] = package
import kvcr_client.session
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def forbidden(names: list[str] | set[str]) -> list[str]:
    return sorted(n for n in names if n in FORBIDDEN_EXACT or any(n == p or n.startswith(p + ".") for p in FORBIDDEN_PREFIXES))


def test_the_session_imports_no_socket_thread_or_clock() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "kvcr_client")],
                         capture_output=True, text=True, timeout=60, check=True)
    added = json.loads(out.stdout)
    assert "kvcr_client.session" in added and "kvcr_protocol" in added
    assert forbidden(added) == [], f"importing kvcr_client.session imported {forbidden(added)}"
    # ``time`` is loaded at interpreter start, so the session's own imports are read too.
    tree = ast.parse((ROOT / "kvcr_client" / "session.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert forbidden(names) == [] and "kvcr_client.errors" in names, names


# --------------------------------------------------------------------------- hello


def test_hello_opens_the_session_at_the_newest_version_both_speak(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent, supported_up_to(2))
        s = pair.session
        assert (s.state, s.version, s.connected) == (SessionState.IDLE, 0, False)
        pair.send("hello", lambda i: Hello(i, s.versions, "old", agent.name, agent.metadata, agent.regions))
        assert s.state is SessionState.HELLO_SENT and s.pending.keys() == {1}
        events = pair.flush()
        assert [type(e) for e in events] == [Replied] and isinstance(events[0].message, Welcome)  # type: ignore[union-attr]
        assert (s.state, s.version, s.connected, s.welcome) == (SessionState.OPEN, 2, True, events[0].message)  # type: ignore[union-attr]
        assert s.heartbeat_s == HEARTBEAT_S and s.pending == {}
        # Requests go out at the agreed version: a v2 query reply comes back and decodes.
        pair.send("query", lambda i: Query(i, (b"absent",)))
        (reply,) = pair.flush()
        assert isinstance(reply, Replied) and isinstance(reply.message, QueryReply)
        assert reply.message.id == pair.ops["query"]


def test_a_hello_with_no_common_version_is_refused_and_a_later_one_opens(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        s = pair.session
        (refused,) = pair.hello(versions=(CURRENT_VERSION + 100,))
        assert isinstance(refused, Failed) and refused.handle == "hello"
        assert isinstance(refused.error, NodeError) and refused.error.code == ErrorCode.UNSUPPORTED_VERSION
        assert (s.state, s.version, s.welcome, s.connected) == (SessionState.IDLE, 0, None, False)
        # Before a welcome only a hello may go (the session rules both ends read): refused here.
        with pytest.raises(LocalProtocolError) as early:
            pair.send("early", lambda i: Query(i, (b"k",)))
        assert early.value.code == ErrorCode.BAD_STATE and early.value.path == "t" and s.pending == {}
        assert opened(pair).version == CURRENT_VERSION and s.state is SessionState.OPEN


def test_a_hello_nobody_answered_lets_the_next_one_go_and_its_late_welcome_is_ignored(
    ipc_dir: Path, agent: ClientAgent,
) -> None:
    """A hello sent while the node was away times out: the session is idle again, so a
    reconnecting client can say hello once more, and the welcome that answers the first one
    late opens nothing."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        s = pair.session
        op_id = next(pair.ids)
        first = s.send(op_id, Hello(op_id, s.versions, "away", agent.name, agent.metadata, agent.regions), pair.now(),
                       1.0, "first")
        assert first and s.state is SessionState.HELLO_SENT
        (gone,) = only(pair.tick(30.0, answer=False), Failed)
        assert gone.handle == "first" and isinstance(gone.error, OperationTimeout)
        assert (s.state, s.pending, s.connected) == (SessionState.IDLE, {}, False)
        # The node is back: it answers the old hello late, and the new one.
        d.receive_frames([pair.identity, first])
        late = pair.flush()
        assert [type(e) for e in late] == [Unmatched] and s.state is SessionState.IDLE, late
        assert opened(pair).version == CURRENT_VERSION and s.state is SessionState.OPEN


def test_the_session_rules_the_node_reads_are_the_sessions_too(ipc_dir: Path, agent: ClientAgent) -> None:
    """One table (``kvcr_protocol.session_rules``): what the node would refuse the session does
    not send, and a reply that does not answer its request fails that request alone."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        s = pair.session
        for early in (Query(1, (b"k",)), Bye(1)):
            with pytest.raises(LocalProtocolError):
                s.send(1, early, pair.now(), 1.0, "early")
        opened(pair)
        # A hello again on an open session ends it and opens another (spec section 5.2).
        assert opened(pair).version == CURRENT_VERSION and s.state is SessionState.OPEN
        # The node's answer to a query is a query_reply: an ack in its place fails the query only.
        frame = s.send(70, Query(70, (b"k",)), pair.now(), 1.0, "query")
        assert frame and s.pending.keys() == {70}
        (wrong,) = s.receive(encode(Ack(70), s.version), pair.now())
        assert isinstance(wrong, Failed) and wrong.handle == "query"
        assert isinstance(wrong.error, NodeError) and wrong.error.code == ErrorCode.WRONG_TYPE
        assert s.pending == {} and s.state is SessionState.OPEN
        # Nothing but the bye's answer after a bye.
        pair.send("bye", lambda i: Bye(i))
        with pytest.raises(LocalProtocolError):
            s.send(71, Query(71, (b"k",)), pair.now(), 1.0, "late")
        assert pair.flush() == [Replied("bye", Ack(pair.ops["bye"]))] and s.state is SessionState.CLOSED


def test_a_message_that_does_not_encode_is_never_in_flight(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent, supported_up_to(3))
        assert opened(pair).version == 3
        with pytest.raises(LocalProtocolError):  # leases need version 4
            pair.session.send(99, Lease(99, (b"k",)), pair.now(), 1.0, "lease")
        assert pair.session.pending == {} and pair.session.touching == 0
        # A frame the wire did not take: forgotten, its memory count undone.
        pair.session.send(100, Query(100, (b"k",)), pair.now(), 1.0, "unsent", touches_memory=True)
        assert pair.session.touching == 1
        pair.session.unsent(100)
        assert (pair.session.pending, pair.session.touching) == ({}, 0)
        assert pair.session.receive(b"\x93garbage", pair.now())[0].__class__ is Undecodable


# --------------------------------------------------------------------------- deadlines, grace, memory holds


def test_a_deadline_fails_its_request_after_the_grace_and_a_late_answer_matches_nothing(
    ipc_dir: Path, agent: ClientAgent
) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=5_000)
        sent_at = pair.now()
        held = pair.send("unregions", lambda i: UnregisterRegions(i, (1,)), timeout_s=1.0)
        assert pair.flush() == []  # held while the deliver's write may reach region 1 (spec section 12)
        assert s.nearest == sent_at + 1.0 + _GRACE_S
        assert only(pair.tick(1.0 + _GRACE_S - 0.5), Failed) == []
        expired = only(pair.tick(0.6), Failed, Settled)
        assert len(expired) == 1 and isinstance(expired[0], Failed) and expired[0].handle == "unregions"
        assert isinstance(expired[0].error, OperationTimeout)
        assert held not in s.pending and s.timed_out == {}  # it holds no memory: nothing kept
        # The node ends the deliver at its deadline and acks the held unregions then: the ack
        # finds no request (its waiter is gone), the deliver's completion finds its own.
        events = only(pair.tick(2.5), Replied, Failed, Settled, Unmatched)
        assert [type(e) for e in events] == [Unmatched, Settled, Replied], events
        assert events[0].message == Ack(held)  # type: ignore[union-attr]
        assert events[1] == Settled("deliver") and events[2].handle == "deliver"  # type: ignore[union-attr]
        completion = events[2].message  # type: ignore[union-attr]
        assert isinstance(completion, Completion) and completion.results[0].status is KeyStatus.FAILED
        assert s.pending == {} and s.touching == 0


def test_a_timed_out_memory_hold_is_kept_until_the_nodes_late_answer(ipc_dir: Path, agent: ClientAgent) -> None:
    """Spec section 5.1: the waiter fails at its deadline, the memory stays held until the node answers."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        op_id = pair.deliver_to_nowhere(timeout_s=1.0, deadline_ms=5_000)
        assert s.touching == 1
        events = only(pair.tick(1.0 + _GRACE_S), Failed, Settled)
        assert len(events) == 1 and isinstance(events[0], Failed) and isinstance(events[0].error, OperationTimeout)
        assert events[0].handle == "deliver"
        assert s.timed_out.keys() == {op_id} and s.pending == {} and s.touching == 0
        assert only(pair.tick(1.0), Settled) == []  # the node still runs it: still held
        late = only(pair.tick(1.5), Replied, Failed, Settled, Unmatched)
        assert late == [Settled("deliver")]  # the node's completion: let the memory go, nothing else
        assert s.timed_out == {}


def test_the_sessions_end_settles_every_hold_and_fails_every_request(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        pair.deliver_to_nowhere(timeout_s=1.0, deadline_ms=60_000)
        pair.tick(1.0 + _GRACE_S)
        assert s.timed_out.keys() == {pair.ops["deliver"]}
        pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=60_000)
        s.lingering.add(77)
        events = s.close()
        assert [type(e) for e in events] == [Settled, Settled, Failed]
        assert isinstance(events[2], Failed) and isinstance(events[2].error, ClientClosed)
        assert (s.pending, s.timed_out, s.lingering, s.touching, s.state) == ({}, {}, set(), 0, SessionState.CLOSED)
        with pytest.raises(ClientClosed):
            s.send(500, Query(500, (b"k",)), pair.now(), 1.0, "after")


# --------------------------------------------------------------------------- notifications, progress, events


def test_notifications_reach_a_pending_request_until_its_reply(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        op_id = pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=3_000)
        note = Notification(token=7, request=op_id, key=0, group=0)
        assert s.notified(encode_notification(note)) == [Observed("deliver", note)]
        other = Notification(token=7, request=op_id + 50, key=0, group=0)
        assert s.notified(encode_notification(other)) == []
        assert s.notified(b"KV\x03garbage") == []
        assert s.notifications == {"matched": 1, "ignored": 1, "malformed": 1}
        # Its reply ends it: a notification that arrives after the reply is a hint for nobody.
        replies = only(pair.tick(3.5), Replied)
        assert [e.handle for e in replies] == ["deliver"]  # type: ignore[union-attr]
        assert s.notified(encode_notification(note)) == []
        assert s.notifications["ignored"] == 2 and s.notifications["matched"] == 1
        # A request that does not observe gets no notifications either.
        pair.send("query", lambda i: Query(i, (b"k",)))
        assert s.notified(encode_notification(Notification(7, pair.ops["query"], 0, 0))) == []


def test_lease_end_is_an_event_not_a_reply(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        outcome, entry = d.node.store.begin_deposit(b"k", (("L0", "kv"),))
        assert outcome is DepositOutcome.NEW and entry is not None
        d.node.store.commit(entry)
        pair.send("lease", lambda i: Lease(i, (b"k",), None, 500))
        (reply,) = pair.flush()
        assert isinstance(reply, Replied) and isinstance(reply.message, LeaseReply)
        lease = reply.message.lease
        waiting = pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=60_000)
        ended = only(pair.tick(0.6), LeaseEnd, Replied, Failed)
        assert len(ended) == 1 and isinstance(ended[0], LeaseEnd), ended
        assert (ended[0].event.lease, ended[0].event.code) == (lease, ErrorCode.LEASE_EXPIRED)
        assert waiting in pair.session.pending and entry.claims == 0  # no request ends with it


def test_heartbeats_keep_the_session_and_a_silent_node_is_lost(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        assert s.next_heartbeat == pair.now()  # looked at on the next turn
        assert pair.tick(0.0) == [] and s.next_heartbeat == pair.now() + HEARTBEAT_S
        beat = pair.tick(HEARTBEAT_S)
        assert [type(e) for e in beat] == [SendFrame]  # the node's echo means nothing more
        assert isinstance(beat[0], SendFrame) and decode(beat[0].frame, s.version) == Heartbeat(1)
        assert s.last_heard == pair.now()
        # From here the node answers nothing: three intervals and the slack later it is lost.
        op_id = pair.deliver_to_nowhere(timeout_s=600.0, deadline_ms=600_000)
        heard = s.last_heard
        for _ in range(3):
            events = pair.tick(HEARTBEAT_S, answer=False)
            assert only(events, Lost, Failed) == [] and all(isinstance(e, SendFrame) for e in events)
        assert s.next_heartbeat == heard + SILENCE_S
        lost = pair.tick(SILENCE_S - 3 * HEARTBEAT_S + 0.01, answer=False)
        assert [type(e) for e in lost] == [Lost, Settled, Failed], lost
        assert isinstance(lost[2], Failed) and isinstance(lost[2].error, NodeLostError) and lost[2].handle == "deliver"
        assert "silent" in lost[0].reason  # type: ignore[union-attr]
        assert (s.state, s.lost, s.connected, s.pending, s.next_heartbeat) == (SessionState.CLOSED, True, False, {}, float("inf"))
        assert op_id not in s.pending
        with pytest.raises(NodeLostError):
            s.send(900, Query(900, (b"k",)), pair.now(), 1.0, "refused")
        # A new connection: the loss is over and a hello opens a new session.
        s.reopen()
        assert (s.state, s.lost) == (SessionState.IDLE, False)
        d.node.outbox.take()
        assert opened(pair).version == CURRENT_VERSION and s.connected


def test_a_probe_is_a_heartbeat_the_node_answers_at_once_and_unanswered_counts_until_it_speaks(
        ipc_dir: Path, agent: ClientAgent) -> None:
    """``probe``: one heartbeat at a time; ``unanswered_s`` counts from it until the node says
    anything, while a request the node holds (a deliver waiting on a source) does not count."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        s = pair.session
        assert s.probe(pair.now()) == [] and s.unanswered_s(pair.now()) == 0.0  # not connected
        opened(pair)
        pair.tick(0.0)
        # The node holds a deliver (no source answers): nothing unanswered while it speaks.
        pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=60_000)
        beat = s.probe(pair.now())
        assert [type(e) for e in beat] == [SendFrame] and decode(beat[0].frame, s.version) == Heartbeat(1)  # type: ignore[union-attr]
        assert s.probe(pair.now()) == []  # one at a time
        d.tick(0.3)
        assert s.unanswered_s(pair.now()) == pytest.approx(0.3)  # not carried yet: no word
        pair.d.receive_frames([pair.identity, beat[0].frame])  # type: ignore[union-attr]
        assert pair.flush() == [] and s.unanswered_s(pair.now() + 5) == 0.0
        # The node stops answering: counted from the probe, through the session's own
        # heartbeats, until it speaks; the session is not lost meanwhile.
        probed = pair.now()
        assert len(s.probe(probed)) == 1
        for _ in range(2):
            events = pair.tick(HEARTBEAT_S, answer=False)
            assert any(isinstance(e, SendFrame) for e in events) and only(events, Lost) == []
            assert s.unanswered_s(pair.now()) == pytest.approx(pair.now() - probed)
        assert s.connected and s.probe(pair.now()) == []
        pair.d.receive_frames([pair.identity, encode(Heartbeat(99), s.version)])
        pair.flush()
        assert s.unanswered_s(pair.now()) == 0.0
        # A probe the wire did not take is not owed.
        beat = s.probe(pair.now())
        s.heartbeat_unsent(pair.now())
        assert s.unanswered_s(pair.now() + 1) == 0.0 and len(s.probe(pair.now())) == 1


def test_a_hello_failed_by_a_refused_handshake_leaves_the_session_open_to_another(ipc_dir: Path, agent: ClientAgent) -> None:
    """The handshake refused (or broken by a node dying under it) fails the hello with every
    request: the session goes back to idle, so the next hello may go (it once stayed
    ``hello_sent`` for good, and every later hello was refused locally)."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        s = pair.session
        a = pair.agent
        op_id = next(pair.ids)
        s.send(op_id, Hello(op_id, s.versions, "session-client", a.name, a.metadata, a.regions), pair.now(), 2.0, "hello")
        assert s.state is SessionState.HELLO_SENT
        events = s.fail_all(NodeError(ErrorCode.UNAUTHORIZED, "refused"))
        assert [type(e) for e in events] == [Failed] and s.state is SessionState.IDLE
        d.node.outbox.take()
        assert opened(pair).version == CURRENT_VERSION and s.connected


def test_a_disconnect_loses_an_open_session_only(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        assert pair.session.disconnected("dropped") == []  # nothing open: nothing lost
        assert not pair.session.lost
        opened(pair)
        pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=60_000)
        events = pair.session.disconnected("lost the node")
        assert events[0] == Lost("lost the node") and [type(e) for e in events[1:]] == [Settled, Failed]
        assert pair.session.lost and pair.session.state is SessionState.CLOSED


def test_bye_closes_the_session_when_the_node_answers(ipc_dir: Path, agent: ClientAgent) -> None:
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        pair.send("bye", lambda i: Bye(i))
        assert s.state is SessionState.CLOSING and s.connected
        assert pair.flush() == [Replied("bye", Ack(pair.ops["bye"]))]
        assert (s.state, s.connected, len(d.node.sessions)) == (SessionState.CLOSED, False, 0)
        assert s.timeouts(pair.now() + 100) == []  # no heartbeats for a closed session
        with pytest.raises(ClientClosed):
            s.send(50, Query(50, (b"k",)), pair.now(), 1.0, "late")


def test_the_session_keeps_the_welcomes_resume_token_until_bye(ipc_dir: Path, agent: ClientAgent) -> None:
    """The token the node gave this session (``welcome.resume``, spec section 5.2) stays
    across a loss, for the next hello to present; a bye ends the session: none is kept."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        welcome = opened(pair)
        s = pair.session
        assert len(welcome.resume) == 16 and s.resume == welcome.resume
        s.disconnected("lost the node")
        assert s.resume == welcome.resume
        s.reopen()
        assert s.resume == welcome.resume
        again = opened(pair)
        assert s.resume == again.resume != welcome.resume
        pair.send("bye", lambda i: Bye(i))
        assert s.resume == b""


def test_capacity_events_are_kept_and_reported(agent: ClientAgent) -> None:
    """A ``capacity`` event from the node (spec section 6.9) is kept and handed on, matching no request."""
    s: ClientSession[str] = ClientSession(supported_up_to(CURRENT_VERSION))
    event = CapacityEvent(3, "kv", 2, 8)
    frame = encode(event, CURRENT_VERSION)
    assert s.receive(frame, 1.0) == [Capacity(event)]
    assert list(s.capacity_events) == [event] and s.last_heard == 1.0


def test_progress_reaches_an_observing_request_and_goes_on(ipc_dir: Path, agent: ClientAgent) -> None:
    """A ``progress`` event is not a reply (spec section 5.1): its request stays in flight."""
    with node_driver(config(ipc_dir)) as d:
        pair = Pair(d, agent)
        opened(pair)
        s = pair.session
        op_id = pair.deliver_to_nowhere(timeout_s=60.0, deadline_ms=60_000)
        pair.send("query", lambda i: Query(i, (b"k",)))
        pair.flush()
        one = array("I", [0]).tobytes()
        progress = Progress(op_id, one, array("I", [1]).tobytes())
        assert s.receive(encode(progress, s.version), pair.now()) == [Observed("deliver", progress)]
        assert op_id in s.pending and s.touching == 1
        unobserved = Progress(pair.ops["query"], one, one)  # answered already: nobody to tell
        assert s.receive(encode(unobserved, s.version), pair.now()) == []
