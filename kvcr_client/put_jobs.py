"""One put after its request went (spec section 6.13), stepped by the client core's turns.

``PutJob`` takes the ``put_reply``, WRITEs every reserved span from the caller's memory into
the slots it names (one transfer per pair of memory kinds), polls its own agent until each
WRITE is terminal, and then sends ``commit`` (or, when a WRITE failed, ``unput``). Nothing
blocks: whoever takes the core's turns (a waiting caller, an event loop, the background
thread, ``poll``) steps it with the I/O lock held, as it steps reads under grants. The
handle's ``written`` resolves once nothing of it reads the caller's memory any more (it is
the caller's again); the handle itself with the commit's reply.

Keys another writer holds (``BUSY``) go by ``deposit``, and so does every reserved key when
the reply's grant cannot be used (the reservation goes back with ``unput``): ``written``
then waits for those deposits too, since the node reads the caller's memory for them only
once the other writer is done. While the node's agent is still loading (the session's
first grant, ``kvcr_client.agent_loads``), the job waits for it without holding the turn.

The deadline bounds the wait for the ``put_reply`` too: a stalled node costs a caller the
deadline, not the control timeout; the keys fail ``TIMEOUT``, and a reservation that
answers later is handed back with ``unput`` (nothing was written into it). A WRITE still
running at the deadline is let go of: it may still land, so nothing is sent and the put is
left to expire into quarantine.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvcr_client.errors import ClientClosed, NodeError
from kvcr_client.posted import Gate, PostedTransfers, Poster
from kvcr_client.results import KeyOutcome, Results, when_all
from kvcr_protocol import ErrorCode, KeyResult, KeyStatus, MemoryKind, PutReply, code_of

Runs = dict[tuple[MemoryKind, MemoryKind], tuple[Any, Any]]
"""Per (local kind, remote kind): the local and remote descriptors of one WRITE."""

_TIMEOUT = KeyResult(KeyStatus.FAILED, ErrorCode.TIMEOUT, "the node did not answer the put within its deadline")


class PutPhase(enum.Enum):
    ASKING = "asking"
    """The ``put`` went; its reply is awaited until the deadline."""
    POSTING = "posting"
    """The WRITEs are planned and left to the next turn that may post them: the reply was
    taken on an event loop's thread (``PutSteps.defer``), whose callbacks stay short."""
    WRITING = "writing"
    """The WRITEs are posted; each turn polls them."""
    OVER = "over"
    """No WRITE runs; the handle resolves from the answers still to come (commit, deposit)."""


@dataclass(frozen=True)
class PutSteps:
    """What a ``PutJob`` asks of the client (``Puts``, which makes it): narrow callables,
    none a way back to the whole client."""

    runs: Callable[[PutReply, bool], tuple[Runs, str] | Future[None] | None]
    """The WRITEs the reply's grant asks for and the agent they go to (the node's, loaded);
    None when the grant does not fit the put; while the node's agent is still loading (and
    the second argument lets it load), a future that resolves once it is (the job is stepped
    again then)."""
    send: Callable[[str, int], Future[Any]]
    """Sends ``commit`` or ``unput`` for a put: its answer (per key results for a commit)."""
    deposit: Callable[[list[int]], tuple[Future[Results[KeyOutcome]], Future[None]]]
    """Deposits the keys at these indices: their results, and when the memory is free."""
    refused: Callable[[], None]
    """The node refuses ``put`` (``MUST_UNDERSTAND``): this session deposits from now on."""
    late: Callable[[Future[PutReply]], None]
    """The reply did not come within the deadline: a reservation it makes after all is to be
    handed back."""
    settle: Callable[[bool], None]
    """No WRITE of the put runs any more (False: one was let go of while it ran): its
    regions are free. Called once."""
    wait: Callable[[Future[None], PutJob], None]
    """The job waits for this future (the node's agent loading): step it again once done."""
    defer: Callable[[], bool]
    """Whether this turn leaves the WRITEs' post to another (it runs on an event loop's
    thread, where the copy inside the post would stall the loop): the job is ``live`` and
    ``posting`` meanwhile, so the background thread paces and takes a turn at once."""
    gate: Gate | None = None
    """Called with ``"written"`` once the WRITEs are terminal, before ``commit``
    (``kvcr_client.posted.Gate``)."""


class PutJob:
    """One put: its reply, its WRITEs, its commit (I/O lock held throughout).

    It lets go of the reply once taken and of the answers once resolved: what waits on a
    future holds no cycle back to the job, so a closed client goes without the collector."""

    def __init__(
        self, steps: PutSteps, reply: Future[PutReply], agent: Poster, keys: Sequence[bytes], give_up: float,
        result: Future[Results[KeyOutcome]], written: Future[None],
    ) -> None:
        self.steps = steps
        self.reply: Future[PutReply] | None = reply
        """The ``put``'s reply, or its error; None once taken."""
        self.agent = agent
        self.keys = list(keys)
        self.give_up = give_up
        self.result = result
        self.written = written
        self.phase = PutPhase.ASKING
        self.writes: PostedTransfers | None = None
        """The WRITEs, once the reply's grant was taken (one group)."""
        self.refused_post = False
        """NIXL refused to post one of the WRITEs: the put fails (those posted still run)."""
        self.results: list[KeyResult] = []
        self.put_id = 0
        self.peer = ""
        """The agent the WRITEs go to (the node's), once posted."""
        self.busy: dict[int, Future[Results[KeyOutcome]]] = {}
        """Keys the node moves after all (another writer holds them, or the grant could not be
        used), deposited: their results."""
        self.reading: list[Future[None]] = []
        """Those deposits' ``written``: the node may read the caller's memory until each is done."""
        self.loading: tuple[Future[None], PutReply] | None = None
        """The node's agent loads before the WRITEs can be planned: what to wait for, and the reply."""
        self.waited = False
        """It waited for a load once: a put does not wait for another."""

    @property
    def posting(self) -> bool:
        """Whether WRITEs wait for the next turn to be posted (``Reads``' question to its jobs)."""
        return self.phase is PutPhase.POSTING

    @property
    def live(self) -> bool:
        """Whether WRITEs run or wait to be posted (whoever reads paces the agent)."""
        return self.phase is PutPhase.WRITING or self.phase is PutPhase.POSTING

    @property
    def remotes(self) -> set[str]:
        """The remote agent the WRITEs go to (it stays loaded while they run)."""
        return {self.peer} if self.peer else set()

    def step(self, now: float) -> bool:
        """One turn: take the reply, poll the WRITEs; True once none runs (the table drops it)."""
        reply = self.reply
        loading = self.loading
        if loading is not None:
            if loading[0].done():
                self.loading = None
                self._plan(loading[1])
            elif now >= self.give_up:  # nothing was written: the reservation goes back
                self.loading = None
                self.steps.send("unput", self.put_id)
                self._over([_TIMEOUT if r.status is KeyStatus.OK else r for r in self.results], None)
        elif self.phase is PutPhase.ASKING and reply is not None:
            if reply.done():
                self.reply = None
                self._replied(reply)
            elif now >= self.give_up:
                self.reply = None
                self.steps.late(reply)
                self._over([_TIMEOUT] * len(self.keys), None)
        if self.phase is PutPhase.POSTING and not self.steps.defer():
            self._post()
        if self.phase is PutPhase.WRITING:
            self._poll(now)
        return self.phase is PutPhase.OVER

    def _replied(self, asked: Future[PutReply]) -> None:
        error = asked.exception()
        if isinstance(error, NodeError) and error.code is ErrorCode.MUST_UNDERSTAND:
            self.steps.refused()
            self._end(True)
            results, memory = self.steps.deposit(list(range(len(self.keys))))
            _chain(results, self.result)
            _chain(memory, self.written)
            return
        if error is not None:
            self._end(True)
            self.written.set_result(None)
            self.result.set_exception(error)
            return
        reply = asked.result()
        self.results = list(reply.results)
        # Keys another writer holds go by a deposit, which waits for that writer (spec section 9).
        self._deposit([i for i, r in enumerate(self.results) if r.code == ErrorCode.BUSY])
        self.put_id = reply.put
        if not reply.put:
            self._over(self.results, None)
            return
        self._plan(reply)

    def _plan(self, reply: PutReply) -> None:
        """Post the WRITEs the reply's grant asks for (or wait for the node's agent to load)."""
        planned = self.steps.runs(reply, not self.waited)
        if isinstance(planned, Future):
            self.loading = (planned, reply)
            self.waited = True
            self.steps.wait(planned, self)
            return
        if planned is None:
            # The grant cannot be used here (the node's agent could not be loaded, the session
            # ended): the reservation goes back and the node moves those keys.
            self.steps.send("unput", self.put_id)
            self._deposit([i for i, r in enumerate(self.results) if r.status is KeyStatus.OK])
            self._over(self.results, None)
            return
        runs, peer = planned
        self.peer = peer
        every = list(range(len(self.keys)))
        self.writes = PostedTransfers(self.agent, "WRITE", [
            (0, local_kind, local, remote_kind, remote, every, peer)
            for (local_kind, remote_kind), (local, remote) in runs.items()], 1)
        if self.steps.defer():
            self.phase = PutPhase.POSTING
            return
        self._post()

    def _post(self) -> None:
        assert self.writes is not None
        self.refused_post = bool(self.writes.post_group())
        self.phase = PutPhase.WRITING

    def _deposit(self, indices: list[int]) -> None:
        """Deposit the keys at ``indices`` instead: their results join the put's, and the
        memory stays the node's until that deposit read it."""
        if indices:
            deposited, reading = self.steps.deposit(indices)
            self.busy.update(dict.fromkeys(indices, deposited))
            self.reading.append(reading)

    def _poll(self, now: float) -> None:
        writes = self.writes
        if writes is not None:
            writes.poll()
        running = writes is not None and bool(writes.running)
        if running and now < self.give_up:
            return
        gate = self.steps.gate
        if not running and gate is not None and gate("written") is False:
            return
        landed = writes is None or writes.landed(0)
        if writes is not None:
            writes.release()
        if running:  # past the deadline: it may still land, so nothing is sent
            self._over([KeyResult(KeyStatus.FAILED, ErrorCode.TIMEOUT, "the WRITE outlived the deadline; left to expire")
                        if r.status is KeyStatus.OK else r for r in self.results], None, let_go=True)
        elif self.refused_post or not landed:
            self.steps.send("unput", self.put_id)
            self._over([KeyResult(KeyStatus.FAILED, ErrorCode.TRANSFER_FAILED, "writing the reserved slots failed")
                        if r.status is KeyStatus.OK else r for r in self.results], None)
        else:
            self._over(self.results, self.steps.send("commit", self.put_id))

    def _end(self, clean: bool) -> None:
        self.phase = PutPhase.OVER
        self.steps.settle(clean)

    def _over(self, results: list[KeyResult], committed: Future[Any] | None, let_go: bool = False) -> None:
        """No WRITE runs any more: the memory is free; the handle resolves once the commit
        (which answers for the reserved keys) and the deposit of ``BUSY`` keys answered."""
        self._end(not let_go)
        written = self.written
        when_all(self.reading, lambda: None if written.done() else written.set_result(None))
        self.reading = []
        pending = [f for f in (committed, *set(self.busy.values())) if f is not None]
        keys, busy, out = self.keys, dict(self.busy), self.result
        self.busy = {}

        def resolve(_: Future[Any] | None = None) -> None:
            if out.done() or not all(f.done() for f in pending):
                return
            error = next((f.exception() for f in pending if f.exception() is not None), None)
            if error is not None:
                out.set_exception(error)
            else:
                answered: Sequence[KeyResult] = committed.result() if committed is not None else results
                out.set_result(Results([
                    (k, busy[i].result()[k] if i in busy else _outcome(r))
                    for i, (k, r) in enumerate(zip(keys, answered, strict=True))]))
            pending.clear()  # the answers' callbacks lead back here: no cycle once resolved
            busy.clear()

        for f in pending:
            f.add_done_callback(resolve)
        resolve()

    def close(self) -> None:
        """The client closes (lock held): WRITEs still running are waited for (bounded), then
        let go of; an unresolved put fails ``ClientClosed``."""
        if self.phase is PutPhase.OVER:
            return
        self._end(self.writes is None or self.phase is PutPhase.POSTING or self.writes.drain())
        if not self.written.done():
            self.written.set_result(None)
        if not self.result.done():
            self.result.set_exception(ClientClosed("the client is closed"))


def _outcome(r: KeyResult) -> KeyOutcome:
    return KeyOutcome(r.status, code_of(r.code), r.reason, r.handle)


def _chain(source: Future[Any], target: Future[Any]) -> None:
    """``target`` resolves as ``source`` does."""
    def settle(done: Future[Any]) -> None:
        if target.done():
            return
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())
    source.add_done_callback(settle)

