"""Replay answers within byte budgets (spec section 15.4), sans-I/O with a fake clock.

``Replays`` decides what goes to whom; here each requester's ZeroMQ queue is modelled as
what the replay socket gives: ``REPLAY_HWM`` messages, ``FULL`` past them, ``GONE`` once
disconnected. Requesters that read get whole answers over several turns, each turn
bounded; requesters that do not read hold at most their window of bytes, the sum stays
within the node's budget, answers that stall are cut with a reason, and the table of
requesters follows connections.
"""

from __future__ import annotations

import collections

from kvcr_node.counters import Count, Counters
from kvcr_node.eviction import make_policy
from kvcr_node.inventory import BATCH_MAX_BYTES, Inventory
from kvcr_node.replays import (
    REPLAY_HWM,
    REPLAY_RETRY_MAX_S,
    REPLAY_RETRY_S,
    REPLAY_SEND_BYTES_PER_TURN,
    REPLAY_SENDS_PER_TURN,
    REPLAY_STALL_S,
    REQUESTER_BYTES,
    Replays,
    Sent,
)
from kvcr_node.store import PoolSpec, Store
from kvcr_protocol import ErrorCode
from kvcr_protocol.events import END_SEQ_FRAME, ReplayEnd, decode_replay_end, encode_replay_request
from kvcr_testing.nodes import FakeClock

TURNS = 10_000
"""Pump turns a test runs at most before it must have seen what it waits for."""


class Queues:
    """Each requester's queue on the replay socket: at most ``REPLAY_HWM`` messages."""

    def __init__(self) -> None:
        self.queues: dict[bytes, collections.deque[list[bytes]]] = {}
        self.received: dict[bytes, list[list[bytes]]] = collections.defaultdict(list)

    def connect(self, identity: bytes) -> None:
        self.queues[identity] = collections.deque()

    def disconnect(self, identity: bytes) -> None:
        del self.queues[identity]

    def send(self, identity: bytes, message: list[bytes]) -> Sent:
        queue = self.queues.get(identity)
        if queue is None:
            return Sent.GONE
        if len(queue) >= REPLAY_HWM:
            return Sent.FULL
        queue.append(message)
        return Sent.OK

    def read(self, identity: bytes) -> None:
        queue = self.queues[identity]
        self.received[identity].extend(queue)
        queue.clear()

    def held(self, identity: bytes) -> int:
        return sum(len(f) for m in self.queues[identity] for f in m)


def ring(keys_per_turn: int, turns: int, key_bytes: int = 8) -> Inventory:
    store = Store((PoolSpec("kv", 64, 200_000, "dram"),), make_policy("fifo"))
    inventory = Inventory("n", 7, {"kv": "dram"})
    store.listener = inventory
    for t in range(turns):
        for i in range(keys_per_turn):
            key = b"%04d-%06d-" % (t, i)
            key += b"k" * (key_bytes - len(key))
            _, entry = store.begin_deposit(key, (("L0", "kv"),))
            assert entry is not None
            store.commit(entry)
        inventory.take()
    return inventory


def ends(messages: list[list[bytes]]) -> list[ReplayEnd]:
    return [decode_replay_end(m[2]) for m in messages if m[1] == END_SEQ_FRAME]


def due(replays: Replays, clock: FakeClock) -> float:
    """Seconds until an answer in progress is due to be tried again."""
    retry = replays.next_retry()
    assert retry is not None
    return max(0.0, retry - clock())


def make(inventory: Inventory, **kw: int) -> tuple[Replays, Queues, FakeClock, Counters]:
    counters = Counters()
    clock = FakeClock()
    return Replays(inventory, counters, clock, **kw), Queues(), clock, counters


def test_a_reader_gets_the_whole_answer_over_turns_each_bounded() -> None:
    inventory = ring(1, 600)
    replays, q, clock, counters = make(inventory)
    q.connect(b"a")
    replays.request(b"a", 5, encode_replay_request(3), q.send)
    turns = 0
    while replays.active:
        clock.advance(due(replays, clock))  # the loop sleeps until then
        before = len(q.queues[b"a"])
        replays.pump(q.send)
        assert len(q.queues[b"a"]) - before <= REPLAY_SENDS_PER_TURN
        q.read(b"a")
        turns += 1
        assert turns < TURNS
    whole, served = inventory.replay(encode_replay_request(3))
    assert served and q.received[b"a"] == whole and turns > 1
    assert counters[Count.EVENTS_REPLAYS] == 1 and counters[Count.EVENTS_REPLAY_CUT] == 0
    assert replays.sizes()["events_replay_answers"] == 0 and replays.sizes()["events_replay_requesters"] == 1


def test_one_turn_sends_a_bounded_number_of_bytes() -> None:
    inventory = ring(2000, 12, key_bytes=250)  # batches of about BATCH_MAX_BYTES
    replays, q, _, _ = make(inventory)
    for n in range(4):
        q.connect(b"r%d" % n)
        replays.request(b"r%d" % n, n, encode_replay_request(0), q.send)
    replays.pump(q.send)
    sent = sum(q.held(b"r%d" % n) for n in range(4))
    assert 0 < sent <= REPLAY_SEND_BYTES_PER_TURN + BATCH_MAX_BYTES + 64


def test_a_requester_that_does_not_read_holds_its_window_then_is_cut() -> None:
    inventory = ring(2000, 12, key_bytes=250)
    assert all(len(p) <= BATCH_MAX_BYTES for _, p in inventory.ring) and len(inventory.ring) > 2 * REPLAY_HWM
    replays, q, clock, counters = make(inventory)
    q.connect(b"hog")
    replays.request(b"hog", 9, encode_replay_request(0), q.send)
    for _ in range(50):
        replays.pump(q.send)
        # What the node counts is an upper bound of what is queued, and within one requester's bytes.
        assert q.held(b"hog") <= replays.queued <= REQUESTER_BYTES
    assert len(q.queues[b"hog"]) == REPLAY_HWM and counters[Count.EVENTS_REPLAY_CUT] == 0
    # Stalled, it is tried again later and later, not every turn.
    assert due(replays, clock) >= REPLAY_RETRY_S
    for _ in range(5):
        clock.advance(due(replays, clock))
        replays.pump(q.send)
    assert due(replays, clock) > 8 * REPLAY_RETRY_S
    # Asking again while the answer is being sent: refused BUSY (here the full queue loses the refusal).
    replays.request(b"hog", 9, encode_replay_request(0), q.send)
    assert counters[Count.EVENTS_REPLAYS_BUSY] == 1
    clock.advance(REPLAY_STALL_S)
    replays.pump(q.send)
    assert counters[Count.EVENTS_REPLAY_CUT] == 1 and not replays.active
    assert replays.sizes() == {"events_replay_requesters": 1, "events_replay_answers": 0,
                               "events_replay_queued_bytes": replays.queued}
    # Reading at last, it asks again and gets the whole answer.
    q.read(b"hog")
    q.received.clear()
    replays.request(b"hog", 9, encode_replay_request(0), q.send)
    for _ in range(TURNS):
        if not replays.active:
            break
        clock.advance(REPLAY_RETRY_MAX_S)
        replays.pump(q.send)
        q.read(b"hog")
    whole, _ = inventory.replay(encode_replay_request(0))
    assert q.received[b"hog"] == whole and counters[Count.EVENTS_REPLAYS] == 1


def test_the_total_budget_holds_and_an_answer_waiting_on_it_is_cut_saying_why() -> None:
    inventory = ring(2000, 12, key_bytes=250)
    replays, q, clock, counters = make(inventory, budget=2 * REQUESTER_BYTES)
    hogs = [b"h%d" % n for n in range(4)]
    for n, hog in enumerate(hogs):
        q.connect(hog)
        replays.request(hog, n, encode_replay_request(0), q.send)
    for _ in range(50):
        replays.pump(q.send)
        assert sum(q.held(h) for h in hogs) <= replays.queued <= 2 * REQUESTER_BYTES
    clock.advance(REPLAY_STALL_S)
    replays.pump(q.send)
    assert counters[Count.EVENTS_REPLAY_CUT] == 4 and not replays.active
    reasons = [end.reason for h in hogs for end in ends(list(q.queues[h]))]
    assert reasons and all(end.code == ErrorCode.BUSY for h in hogs for end in ends(list(q.queues[h])))
    assert any("budget" in r for r in reasons), reasons
    # Disconnected, the hogs take their bytes with them.
    for n, hog in enumerate(hogs):
        q.disconnect(hog)
        replays.disconnected(n)
    assert replays.sizes() == {"events_replay_requesters": 0, "events_replay_answers": 0, "events_replay_queued_bytes": 0}


def test_requesters_past_the_bound_are_refused_and_the_table_follows_connections() -> None:
    inventory = ring(1, 20)
    replays, q, clock, counters = make(inventory, max_requesters=2)
    for n, who in enumerate((b"a", b"b", b"c")):
        q.connect(who)
        replays.request(who, 10 + n, encode_replay_request(0), q.send)
    [refusal] = ends(list(q.queues[b"c"]))
    assert (refusal.code, refusal.path) == (ErrorCode.BUSY, "replay") and "2 replay requesters" in refusal.reason
    assert counters[Count.EVENTS_REPLAYS_BUSY] == 1 and replays.sizes()["events_replay_requesters"] == 2
    # a leaves (its descriptor closed): c is answered when it asks again.
    q.disconnect(b"a")
    replays.disconnected(10)
    q.read(b"c")
    replays.request(b"c", 12, encode_replay_request(0), q.send)
    # A new connection on b's descriptor: b is gone (the descriptor was reused).
    q.connect(b"d")
    replays.request(b"d", 11, encode_replay_request(0), q.send)
    assert set(replays.requesters) == {b"c", b"d"}
    for _ in range(TURNS):
        if not replays.active:
            break
        clock.advance(REPLAY_RETRY_MAX_S)
        replays.pump(q.send)
        q.read(b"c")
        q.read(b"d")
    assert ends(q.received[b"c"])[-1].ok and ends(q.received[b"d"])[-1].ok
    # b's disconnection, reported late, is b's, not d's (which now has the descriptor).
    replays.disconnected(11)
    assert set(replays.requesters) == {b"c", b"d"}
    for fd in (11, 12):
        replays.disconnected(fd)
    assert replays.sizes() == {"events_replay_requesters": 0, "events_replay_answers": 0, "events_replay_queued_bytes": 0}


def test_hostile_requests_are_refused_and_not_tracked() -> None:
    inventory = ring(1, 3)
    replays, q, _, counters = make(inventory)
    q.connect(b"x")
    for frames in ([b"", b"\x01"], [b"\x00" * 8], [], [b"", (10**6).to_bytes(8, "big")]):
        replays.request(b"x", 3, frames, q.send)
    assert [e.code for e in ends(list(q.queues[b"x"]))] == [ErrorCode.MALFORMED] * 3 + [ErrorCode.OUT_OF_RANGE]
    assert counters[Count.EVENTS_REPLAYS_REFUSED] == 4 and replays.requesters == {} and not replays.active


def test_a_requester_that_left_mid_answer_is_forgotten() -> None:
    inventory = ring(1, 300)
    replays, q, clock, _ = make(inventory)
    q.connect(b"a")
    replays.request(b"a", 4, encode_replay_request(0), q.send)
    replays.pump(q.send)
    q.disconnect(b"a")  # its disconnection not reported yet: the next send finds it gone
    clock.advance(due(replays, clock))
    replays.pump(q.send)
    assert replays.requesters == {} and replays.queued == 0 and not replays.active
    # Its disconnection, reported later, does not forget the next connection on its descriptor.
    q.connect(b"b")
    replays.request(b"b", 4, encode_replay_request(0), q.send)
    replays.disconnected(4)
    assert set(replays.requesters) == {b"b"}
    replays.disconnected(4)
    assert replays.requesters == {}
