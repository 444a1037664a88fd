"""A READ past its deadline may still write its destination (``kvcr_client.uncertain``).

In process: ``UncertainDestinations`` refuses a span that overlaps a held one and nothing
else; a ``GrantRead`` whose READ still runs at its deadline holds its key's destination
until the READ is terminal, and lets go then. Against a real node: a held destination
refuses a deliver into it and a deposit or put from it, naming the span, and takes them
again once let go, every byte right.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvcr_client import ArgumentError, Client, KeyStatus, OperationTimeout, Span
from kvcr_client.reads import GrantRead, Reads
from kvcr_client.uncertain import UncertainDestinations
from kvcr_io.agent import XferStatus
from kvcr_protocol import DeliverItem, DepositItem, DstSpan, ErrorCode, KeyResult, MemoryKind, SrcSpan
from kvcr_testing.health import wait_until
from kvcr_testing.layouts import RESULT_TIMEOUT_S, Registrar
from kvcr_testing.nodes import NodeProcess
from kvcr_testing.patterns import KiB, pattern

from .test_grant_read_clock import Clock, Granted, HeldUntil, Lease

SLOT = 4 * KiB


def test_only_spans_that_overlap_a_held_one_are_refused_and_only_while_held() -> None:
    uncertain = UncertainDestinations()
    item = DeliverItem(b"k", (DstSpan("a", 1, 0, 100), DstSpan("b", 2, 100, 100)))
    uncertain.check([item])  # nothing held: nothing to look at
    let_go = uncertain.hold([(2, 150, 10), (3, 0, 1 << 20)])
    with pytest.raises(ArgumentError) as info:
        uncertain.check([item])
    assert info.value.field == "objects[b'k'].spans[1]" and "DESTINATION_UNCERTAIN" in str(info.value)
    uncertain.check([DeliverItem(b"k", (DstSpan("b", 2, 160, 10), DstSpan("c", 2, 0, 150), DstSpan("d", 1, 150, 10)))])
    with pytest.raises(ArgumentError):  # a source span of a deposit too
        uncertain.check([DepositItem(b"d", (SrcSpan("x", "kv", 3, 4096, 1),))], "objects")
    let_go()
    let_go()  # once or more
    assert not uncertain
    uncertain.check([item])


@dataclass
class SlowAgent:
    """READs that run until the test says they are done."""

    states: list[XferStatus] = field(default_factory=list)

    def start_listed(self, op: str, local_kind: MemoryKind, local: Any, remote_kind: MemoryKind, remote: Any,
                     remote_agent: str) -> tuple[Any, XferStatus]:
        self.states.append(XferStatus.RUNNING)
        return len(self.states) - 1, XferStatus.RUNNING

    def state(self, handle: Any) -> XferStatus:
        return self.states[handle]

    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]:
        return [self.states[h] for h in handles]

    def release(self, handle: Any) -> None:
        pass


def test_a_read_running_at_its_deadline_holds_its_destination_until_it_ends() -> None:
    clock, agent, uncertain = Clock(), SlowAgent(), UncertainDestinations()
    spans = (DstSpan("L0", 5, 0, SLOT), DstSpan("L1", 5, SLOT, SLOT))
    posts = [(0, MemoryKind.DRAM, [(0, 1, 0)], MemoryKind.DRAM, [(0, 1, 0)], [0], "node")]
    out: list[list[KeyResult]] = []
    quiet: list[bool] = []

    def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:
        assert isinstance(results, list)
        out.append(results)

    read = GrantRead(HeldUntil(), agent, [DeliverItem(b"k", spans)], [Granted(Lease(100.0))], [1], posts, [0],
                     deadline=1.0, report=None, finished=finished, quiet=lambda: quiet.append(True), clock=clock,
                     hold=uncertain.hold)
    reads = Reads()
    reads.start(read)
    clock.t = 2.0
    reads.step(clock.t)
    assert out and out[0][0].code == ErrorCode.DESTINATION_UNCERTAIN
    with pytest.raises(ArgumentError):
        uncertain.check([DeliverItem(b"again", (DstSpan("L1", 5, SLOT + 8, 8),))])
    assert reads.running == [read] and not quiet, "the READ still runs: the job and the hold stay"
    agent.states[0] = XferStatus.DONE
    reads.step(clock.t)
    assert reads.running == [] and quiet == [True] and not uncertain


@pytest.fixture(scope="module")
def node_args() -> tuple[str, ...]:
    return ("--pool", "kv:4KiB:16", "--lease-pool-fraction", "1")


def test_a_held_destination_refuses_delivers_into_it_and_stores_from_it_until_let_go(
        node: NodeProcess, client: Client, register: Registrar, key: Callable[[str], bytes]) -> None:
    k = key("obj")
    src = pattern(2 * SLOT, 31)
    rs = register(src)
    assert client.deposit({k: [Span("L0", rs, 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
    dst = np.zeros(3 * SLOT, np.uint8)
    rd = register(dst)
    uncertain = client._uncertain
    let_go = uncertain.hold([(rd.region, SLOT // 2, SLOT), (rs.region, SLOT, SLOT)])
    try:
        with pytest.raises(ArgumentError) as info:
            client.deliver({k: [Span("L0", rd, 0, SLOT)]})
        assert info.value.field == f"objects[{k!r}].spans[0]"
        for store in (client.deposit, client.put):
            with pytest.raises(ArgumentError):
                store({key("from"): [Span("L0", rs, SLOT, SLOT, "kv")]})
        # Memory clear of the held spans is used as ever.
        assert client.deliver({k: [Span("L0", rd, 2 * SLOT, SLOT)]}).result(RESULT_TIMEOUT_S)[k].ok
        assert np.array_equal(dst[2 * SLOT:], src[:SLOT])
    finally:
        let_go()
    assert client.deliver({k: [Span("L0", rd, 0, SLOT)]}).result(RESULT_TIMEOUT_S)[k].ok
    assert np.array_equal(dst[:SLOT], src[:SLOT])
    assert client.put({key("from"): [Span("L0", rs, SLOT, SLOT, "kv")]}).result(RESULT_TIMEOUT_S)[key("from")].status \
        is KeyStatus.STORED


def test_a_deliver_the_caller_stopped_waiting_for_holds_its_destination_until_the_node_answers(
        node_factory: Callable[..., NodeProcess]) -> None:
    """Spec section 5.1: a deliver whose answer did not come by its deadline (and a grace)
    fails ``OperationTimeout`` for the caller, but the node may still write the destination
    until it answers. Until then a deliver into that memory, or a put from it, is refused
    naming the span; the late answer frees it. (A long heartbeat keeps the frozen node from
    counting as lost, which would end the session and free the memory for that reason.)"""
    node = node_factory("--pool", "kv:4KiB:16", "--heartbeat-ms", "60000")
    with Client(node.endpoint, name="timed-out") as c:
        src = pattern(SLOT, 41)
        assert c.deposit({b"k": [Span("L0", c.register(src), 0, SLOT, "kv")]}).result(RESULT_TIMEOUT_S).all_ok
        dst = np.zeros(2 * SLOT, np.uint8)
        rd = c.register(dst)
        node.proc.send_signal(signal.SIGSTOP)
        try:
            late = c.deliver({b"k": [Span("L0", rd, 0, SLOT)]}, deadline_ms=100)
            with pytest.raises(OperationTimeout):
                late.result(RESULT_TIMEOUT_S)
            assert c.tables()["uncertain_held"] == 1
            with pytest.raises(ArgumentError) as info:
                c.deliver({b"k": [Span("L0", rd, SLOT // 2, SLOT)]})
            assert info.value.field == "objects[b'k'].spans[0]" and "timed out" in str(info.value)
            with pytest.raises(ArgumentError):
                c.put({b"from": [Span("L0", rd, 0, SLOT, "kv")]})
        finally:
            node.proc.send_signal(signal.SIGCONT)
        # The node answers late: the memory is free again.
        assert wait_until(lambda: c.tables()["uncertain_held"] == 0, RESULT_TIMEOUT_S)
        assert c.deliver({b"k": [Span("L0", rd, SLOT, SLOT)]}).result(RESULT_TIMEOUT_S)[b"k"].ok
        assert np.array_equal(dst[:SLOT], src) and np.array_equal(dst[SLOT:], src)
