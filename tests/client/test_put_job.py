"""A put after its request went (``PutJob``, spec section 6.13), in process: a fake agent
whose WRITEs end when the test says, replies the test resolves, and time passed in.

What it must do: WRITE once the reply reserved slots, say ``written`` only once no WRITE of
it runs, then commit (or unput a failed WRITE); never send anything for a WRITE let go of
at the deadline (it may still land); hand a late reservation back; deposit ``BUSY`` keys and
keys a node that refuses puts; and leave nothing running at close.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcr_client.errors import ClientClosed, NodeError
from kvcr_client.posted import CLOSE_DRAIN_S
from kvcr_client.put_jobs import PutJob, PutPhase, PutSteps, Runs
from kvcr_client.results import KeyOutcome, Results
from kvcr_io.agent import TransferError, XferStatus
from kvcr_protocol import ErrorCode, KeyResult, KeyStatus, MemoryKind, PutReply

KEYS = [b"a", b"b"]
RUNS: Runs = {(MemoryKind.DRAM, MemoryKind.DRAM): ([(0, 1, 0)], [(0, 1, 0)])}
OK = KeyResult(KeyStatus.OK)
STORED = KeyResult(KeyStatus.STORED)


@dataclass
class Agent:
    """WRITEs that run until ``states`` says otherwise; a post NIXL refuses when ``refuse``."""

    states: list[XferStatus] = field(default_factory=list)
    refuse: bool = False
    released: int = 0

    def start_listed(self, op: str, local_kind: MemoryKind, local: Any, remote_kind: MemoryKind, remote: Any,
                     remote_agent: str) -> tuple[Any, XferStatus]:
        assert op == "WRITE" and remote_agent == "node"
        if self.refuse:
            raise TransferError("refused")
        self.states.append(XferStatus.RUNNING)
        return len(self.states) - 1, XferStatus.RUNNING

    def state(self, handle: Any) -> XferStatus:
        return self.states[handle]

    def drain(self, handles: Sequence[Any], timeout_s: float) -> list[XferStatus]:
        """No waiting here: a test that closes with WRITEs running sees them still running."""
        return [self.states[h] for h in handles]

    def release(self, handle: Any) -> None:
        self.released += 1


@dataclass
class Client:
    """What the job asks of the client, recorded."""

    log: list[str] = field(default_factory=list)
    sent: dict[str, Future[Any]] = field(default_factory=dict)
    deposits: list[tuple[list[int], Future[Results[KeyOutcome]], Future[None]]] = field(default_factory=list)
    settled: list[bool] = field(default_factory=list)
    gate: Callable[[str], Any] | None = None
    fits: bool = True
    """Whether the reply's grant can be used (else ``runs`` answers None)."""
    loading: Future[None] | None = None
    """The node's agent loading: ``runs`` answers this future when it may wait for a load."""
    loaded: bool = True
    """Whether the agent is there once ``loading`` is done (False: NIXL refused it)."""
    waited: list[Future[None]] = field(default_factory=list)
    deferring: bool = False
    """Whether the turns step the job on an event loop's thread (``PutSteps.defer``)."""

    def steps(self) -> PutSteps:
        def send(what: str, put_id: int) -> Future[Any]:
            self.log.append(f"{what} {put_id}")
            future: Future[Any] = Future()
            self.sent[what] = future
            return future

        def deposit(indices: list[int]) -> tuple[Future[Results[KeyOutcome]], Future[None]]:
            self.log.append(f"deposit {indices}")
            results: Future[Results[KeyOutcome]] = Future()
            memory: Future[None] = Future()
            self.deposits.append((indices, results, memory))
            return results, memory

        def runs(reply: PutReply, load: bool) -> Any:
            loading = self.loading
            if load and loading is not None:
                return loading
            return (RUNS, "node") if self.fits and self.loaded else None

        def wait(loading: Future[None], job: PutJob) -> None:
            self.log.append("wait")
            self.waited.append(loading)

        return PutSteps(runs, send, deposit, lambda: self.log.append("refused"),
                        lambda reply: self.log.append("late"), self.settled.append, wait, lambda: self.deferring,
                        self.gate)


def make(client: Client, agent: Agent, give_up: float = 10.0) -> tuple[PutJob, Future[PutReply]]:
    reply: Future[PutReply] = Future()
    job = PutJob(client.steps(), reply, agent, KEYS, give_up, Future(), Future())  # type: ignore[arg-type]
    return job, reply


def reserved(*results: KeyResult) -> PutReply:
    return PutReply(7, 42, 1000, tuple(results or (OK, OK)))


def test_written_once_the_write_ends_then_stored_with_the_commits_reply() -> None:
    client, agent = Client(), Agent()
    job, reply = make(client, agent)
    assert not job.step(0.0) and job.phase is PutPhase.ASKING and not job.live
    reply.set_result(reserved())
    assert not job.step(0.1) and job.phase is PutPhase.WRITING and job.live
    assert not job.written.done() and client.log == [], "a WRITE runs: the memory is not free"
    agent.states[0] = XferStatus.DONE
    assert job.step(0.2)
    assert job.written.done() and client.settled == [True] and client.log == ["commit 42"] and agent.released == 1
    assert not job.result.done()
    client.sent["commit"].set_result((STORED, STORED))
    assert {k: o.status for k, o in job.result.result(0).items()} == {b"a": KeyStatus.STORED, b"b": KeyStatus.STORED}


def test_a_reply_taken_on_an_event_loops_thread_leaves_the_write_to_the_next_turn_that_may_post() -> None:
    """The copy runs inside the post: on an event loop's thread it would stall the loop. The
    job is live and posting meanwhile (the background thread paces and takes a turn at once);
    a turn that may post posts it."""
    client, agent = Client(deferring=True), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved())
    assert not job.step(0.1) and job.phase is PutPhase.POSTING and job.live and job.posting
    assert agent.states == [] and not job.written.done()
    assert not job.step(0.2) and agent.states == [], "another turn on the loop's thread posts nothing either"
    client.deferring = False
    assert not job.step(0.3) and job.phase is PutPhase.WRITING and not job.posting
    assert agent.states == [XferStatus.RUNNING]
    agent.states[0] = XferStatus.DONE
    assert job.step(0.4) and job.written.done() and client.log == ["commit 42"]


def test_close_before_a_deferred_write_was_posted_fails_the_put_and_posts_nothing() -> None:
    client, agent = Client(deferring=True), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved())
    assert not job.step(0.1) and job.phase is PutPhase.POSTING
    job.close()
    assert agent.states == [] and client.settled == [True] and job.written.done()
    with pytest.raises(ClientClosed):
        job.result.result(0)


def test_a_write_running_at_the_deadline_is_let_go_of_and_nothing_is_sent() -> None:
    client, agent = Client(), Agent()
    job, reply = make(client, agent, give_up=1.0)
    reply.set_result(reserved())
    job.step(0.5)
    assert job.step(1.0)
    assert client.log == [] and client.settled == [False], "it may still land: no commit, no unput"
    assert job.written.done() and all(o.code is ErrorCode.TIMEOUT for o in job.result.result(0).values())


@pytest.mark.parametrize("how", ["failed", "refused"])
def test_a_failed_write_unputs_and_fails_the_keys(how: str) -> None:
    client, agent = Client(), Agent(refuse=how == "refused")
    job, reply = make(client, agent)
    reply.set_result(reserved())
    if how == "failed":
        job.step(0.1)
        agent.states[0] = XferStatus.FAILED
    assert job.step(0.2)
    assert client.log == ["unput 42"] and client.settled == [True]
    assert all(o.code is ErrorCode.TRANSFER_FAILED for o in job.result.result(0).values())


def test_no_reply_by_the_deadline_times_out_and_a_late_reservation_is_handed_back() -> None:
    client, agent = Client(), Agent()
    job, _ = make(client, agent, give_up=1.0)
    assert not job.step(0.9)
    assert job.step(1.0)
    assert client.log == ["late"] and client.settled == [True] and job.written.done()
    assert all(o.code is ErrorCode.TIMEOUT for o in job.result.result(0).values())


def test_a_node_that_refuses_puts_gets_a_deposit_of_every_key() -> None:
    client, agent = Client(), Agent()
    job, reply = make(client, agent)
    reply.set_exception(NodeError(ErrorCode.MUST_UNDERSTAND, "no puts here"))
    assert job.step(0.0)
    assert client.log == ["refused", "deposit [0, 1]"] and client.settled == [True]
    indices, results, memory = client.deposits[0]
    assert indices == [0, 1]
    assert not job.written.done()
    memory.set_result(None)
    results.set_result(Results([(k, KeyOutcome(KeyStatus.STORED)) for k in KEYS]))
    assert job.written.done() and job.result.result(0)[b"b"].status is KeyStatus.STORED


def test_busy_keys_are_deposited_and_their_results_joined_with_the_commits() -> None:
    client, agent = Client(), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved(OK, KeyResult(KeyStatus.FAILED, ErrorCode.BUSY)))
    job.step(0.0)
    assert client.log == ["deposit [1]"]
    agent.states[0] = XferStatus.DONE
    job.step(0.1)
    assert not job.written.done(), "the deposit waits for the other writer: the node reads the memory later"
    client.sent["commit"].set_result((STORED, KeyResult(KeyStatus.FAILED, ErrorCode.BUSY)))
    assert not job.result.done(), "the deposit of the busy key has not answered"
    client.deposits[0][2].set_result(None)
    assert job.written.done()
    client.deposits[0][1].set_result(Results([(b"b", KeyOutcome(KeyStatus.DUPLICATE))]))
    out = job.result.result(0)
    assert out[b"a"].status is KeyStatus.STORED and out[b"b"].status is KeyStatus.DUPLICATE


def test_a_grant_that_cannot_be_used_hands_the_reservation_back_and_deposits() -> None:
    client, agent = Client(fits=False), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved(OK, KeyResult(KeyStatus.FAILED, ErrorCode.BUSY)))
    assert job.step(0.0) and agent.states == [], "nothing is written"
    assert client.log == ["deposit [1]", "unput 42", "deposit [0]"]
    assert not job.written.done()
    for indices, results, memory in client.deposits:
        memory.set_result(None)
        results.set_result(Results([(KEYS[i], KeyOutcome(KeyStatus.STORED)) for i in indices]))
    assert job.written.done() and client.settled == [True]
    assert all(o.status is KeyStatus.STORED for o in job.result.result(0).values())


def test_the_gate_holds_the_commit_back_without_holding_the_turn() -> None:
    client, agent = Client(), Agent()
    held = [True]
    client.gate = lambda stage: not held[0]
    job, reply = make(client, agent)
    reply.set_result(reserved())
    job.step(0.0)
    agent.states[0] = XferStatus.DONE
    assert not job.step(0.1) and not job.step(0.2) and client.log == [] and job.live
    held[0] = False
    assert job.step(0.3) and client.log == ["commit 42"]


def test_close_waits_for_a_running_write_then_fails_the_put(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvcr_client.posted.CLOSE_DRAIN_S", 0.05)
    assert CLOSE_DRAIN_S > 0.05
    client, agent = Client(), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved())
    job.step(0.0)
    job.close()  # the WRITE never ends: let go of after the drain
    assert client.settled == [False] and agent.released == 1 and job.written.done()
    with pytest.raises(ClientClosed):
        job.result.result(0)
    job.close()
    assert client.settled == [False], "settled once"


def test_a_put_whose_node_agent_still_loads_waits_for_it_then_writes() -> None:
    client, agent = Client(loading=Future()), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved())
    assert not job.step(0.1) and job.phase is PutPhase.ASKING and not job.live
    assert client.log == ["wait"] and client.waited == [client.loading] and agent.states == [], "nothing posted yet"
    assert not job.step(0.2) and agent.states == [], "still loading: still nothing"
    assert client.loading is not None
    client.loading.set_result(None)
    assert not job.step(0.3) and job.phase is PutPhase.WRITING and agent.states == [XferStatus.RUNNING]
    agent.states[0] = XferStatus.DONE
    assert job.step(0.4) and client.log == ["wait", "commit 42"] and client.settled == [True]


def test_a_node_agent_that_loads_past_the_deadline_hands_the_reservation_back() -> None:
    client, agent = Client(loading=Future()), Agent()
    job, reply = make(client, agent, give_up=1.0)
    reply.set_result(reserved())
    assert not job.step(0.5)
    assert job.step(1.0)
    assert client.log == ["wait", "unput 42"] and agent.states == [] and client.settled == [True]
    assert job.written.done() and all(o.code is ErrorCode.TIMEOUT for o in job.result.result(0).values())


def test_a_put_whose_node_agent_was_refused_after_its_wait_deposits_without_a_second_wait() -> None:
    client, agent = Client(loading=Future(), loaded=False), Agent()
    job, reply = make(client, agent)
    reply.set_result(reserved())
    assert not job.step(0.1) and client.log == ["wait"]
    assert client.loading is not None
    client.loading.set_result(None)
    assert job.step(0.2) and agent.states == []
    assert client.log == ["wait", "unput 42", "deposit [0, 1]"]
