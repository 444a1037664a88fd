"""The ``suspect`` handler (spec section 6.12, "Integrity"): a reader reports keys whose
bytes did not match their digests, and the node reads each object itself, or has the
source whose pools the reader read check it.

A reader's word alone drops nothing: the node takes the digests of the object's spans
again (``Digests.intact``) and condemns it only when they differ. Reading costs the node's
loop about 40 µs per MiB, so what it reads for reports is bounded twice: node-wide by
``suspect_bytes_per_s`` (the loop's cost), and per session by a quarter of that (so one
client's flood cannot spend every other reader's budget). A key past either budget is
answered ``BUSY`` with nothing read; the budgets refill continuously, at most a second's
worth banked (an object larger than that is checked on a full budget, which it overdraws).

A key this node does not store, but whose source's read grant one of the session's leases
passed on, was read from that source's pools: the report goes on to the source over this
node's peer session there (``suspect`` is a peer request too), and the source's verdict
comes back as the key's result. The source checks it within its own budgets, which count
this node's peer session as one reader; how many reports wait on sources is bounded per
session and node-wide, past that the key is answered ``BUSY``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvcr_node.buckets import TokenBucket
from kvcr_node.counters import Count, Counters
from kvcr_node.digests import Digests
from kvcr_node.objects import ObjectEntry, ObjectState
from kvcr_node.outbox import Outbox
from kvcr_node.peers import Answer
from kvcr_node.records import Session
from kvcr_node.store import Store
from kvcr_protocol import Completion, ErrorCode, KeyResult, KeyStatus, Message, Role, Suspect

BANKED_S = 1.0
"""How many seconds of a budget may be saved up unused."""
SESSION_SHARE = 0.25
"""The share of ``suspect_bytes_per_s`` one session's reports may use."""
SOURCE_ANSWER_S = 5.0
"""How long a report passed on to a source waits for its verdict (a reader waits longer:
``kvcr_client.grants.CONFIRM_TIMEOUT_S``); then the key answers ``PEER_UNREACHABLE``."""
PASSED_ON_PER_SESSION = 16
"""Reports of one session that may wait on sources at once; more answer ``BUSY``."""
PASSED_ON_MAX = 64
"""Reports of all sessions that may wait on sources at once; more answer ``BUSY``."""
SOURCE_VERDICTS = frozenset({ErrorCode.DIGEST_MISMATCH, ErrorCode.NOT_FOUND, ErrorCode.BUSY})
"""A source's per-key codes passed back as they are; any other answers ``PEER_UNREACHABLE``."""

GrantedAt = Callable[[Session], dict[bytes, tuple[str, int]]]
"""Key -> (endpoint, incarnation) of the source whose grant of it a session's leases passed
on (``Leases.granted_at_sources``)."""
AskSource = Callable[[str, Callable[[int], Message], Answer, float, int], None]
"""Sends a source a request once its peer session is up and hands its answer, or None and
why none came, to a callback within a time (``Links.ask``)."""


@dataclass(eq=False)
class _Report:
    """One ``suspect`` request, answered once every key has its verdict."""

    session: Session
    msg: Suspect
    verdicts: dict[bytes, KeyResult] = field(default_factory=dict)
    waiting: int = 0
    """Keys whose source has not answered yet."""
    answered: bool = False


class Suspects:
    """Serves ``suspect``: checks the reported objects within the read budgets, condemns
    those that changed, passes on reports of keys read from sources, and answers a result
    per key."""

    def __init__(self, store: Store, digests: Digests, outbox: Outbox, counters: Counters,
                 clock: Callable[[], float], bytes_per_s: int, slot_sizes: dict[str, int],
                 granted_at: GrantedAt | None = None, ask: AskSource | None = None) -> None:
        self.store = store
        self.digests = digests
        self.outbox = outbox
        self.counters = counters
        self.clock = clock
        self.slot_sizes = slot_sizes
        self.node = TokenBucket(bytes_per_s, bytes_per_s * BANKED_S, clock)
        self.session_rate = bytes_per_s * SESSION_SHARE
        self.granted_at = granted_at
        self.ask = ask
        self.passed_on = 0
        """Reports waiting on sources, all sessions together."""

    def on_suspect(self, session: Session, msg: Suspect) -> None:
        mine = session.suspect_budget
        if mine is None:
            mine = session.suspect_budget = TokenBucket(self.session_rate, self.session_rate * BANKED_S, self.clock)
        report = _Report(session, msg)
        remote: dict[bytes, tuple[str, int]] | None = None
        onward: list[tuple[bytes, str, str, int]] = []
        seen: set[bytes] = set()
        for i, key in enumerate(msg.keys):
            if key in seen:
                continue
            seen.add(key)
            path = f"keys[{i}]"
            entry = self.store.lookup(key)
            if entry is None and self.granted_at is not None and session.role is Role.CLIENT:
                if remote is None:
                    remote = self.granted_at(session)
                source = remote.get(key)
                if source is not None:
                    onward.append((key, path, *source))
                    continue
            report.verdicts[key] = self._check(entry, path, mine)
        report.waiting = len(onward)
        for key, path, endpoint, incarnation in onward:
            self._pass_on(report, key, path, endpoint, incarnation)
        if not report.waiting:
            self._answer_report(report)

    def _check(self, entry: ObjectEntry | None, path: str, mine: TokenBucket) -> KeyResult:
        self.counters.inc(Count.SUSPECTS)
        if entry is None or entry.state is not ObjectState.READY:
            return KeyResult(KeyStatus.FAILED, ErrorCode.NOT_FOUND, f"{path} is not stored on this node")
        cost = self._bytes(entry)
        if not (mine.affords(cost) and self.node.affords(cost)):
            self.counters.inc(Count.SUSPECTS_REFUSED)
            return KeyResult(KeyStatus.FAILED, ErrorCode.BUSY,
                             f"{path}: the node's budget for checking reported objects is spent; report it again later")
        mine.spend(cost)
        self.node.spend(cost)
        if self.digests.intact(entry):
            self.counters.inc(Count.SUSPECTS_UNFOUNDED)
            return KeyResult(KeyStatus.OK)
        self.digests.condemn(entry, Count.SUSPECTS_CONFIRMED)
        return KeyResult(KeyStatus.FAILED, ErrorCode.DIGEST_MISMATCH,
                         f"{path}: its bytes no longer match their digests; the node dropped it")

    def _pass_on(self, report: _Report, key: bytes, path: str, endpoint: str, incarnation: int) -> None:
        """Ask the source at ``endpoint`` to check ``key`` (its incarnation that granted it);
        its verdict becomes the key's."""
        self.counters.inc(Count.SUSPECTS)
        session = report.session
        if self.ask is None or session.suspects_at_sources >= PASSED_ON_PER_SESSION or self.passed_on >= PASSED_ON_MAX:
            self.counters.inc(Count.SUSPECTS_REFUSED)
            self._verdict(report, key, KeyResult(
                KeyStatus.FAILED, ErrorCode.BUSY, f"{path}: too many reports wait on sources; report it again later"))
            return
        self.counters.inc(Count.SUSPECTS_PASSED_ON)
        self.passed_on += 1
        session.suspects_at_sources += 1

        def answered(reply: Message | None, code: ErrorCode | None) -> None:
            self.passed_on -= 1
            session.suspects_at_sources -= 1
            self._verdict(report, key, _source_verdict(reply, code, path, endpoint))

        self.ask(endpoint, lambda i: Suspect(i, (key,)), answered, SOURCE_ANSWER_S, incarnation)

    def _verdict(self, report: _Report, key: bytes, result: KeyResult) -> None:
        report.verdicts[key] = result
        report.waiting -= 1
        if not report.waiting:
            self._answer_report(report)

    def _answer_report(self, report: _Report) -> None:
        if report.answered or report.session.closing:
            return
        report.answered = True
        msg = report.msg
        results = [report.verdicts[key] for key in msg.keys]
        self.outbox.settled(report.session, "suspect", msg.id, results)
        self.outbox.reply(report.session, Completion(msg.id, tuple(results)))

    def _bytes(self, entry: ObjectEntry) -> int:
        sizes = self.slot_sizes
        return sum(count * sizes[pool] for pool, count in entry.info.need)


def _source_verdict(reply: Message | None, code: ErrorCode | None, path: str, endpoint: str) -> KeyResult:
    """A key's result from the source's answer to a report passed on (spec section 6.12)."""
    if isinstance(reply, Completion) and len(reply.results) == 1:
        result = reply.results[0]
        if result.status is KeyStatus.OK:
            return KeyResult(KeyStatus.OK)
        if result.code in SOURCE_VERDICTS:
            return KeyResult(KeyStatus.FAILED, result.code, f"{path}: the source at {endpoint}: {result.reason}")
    if reply is None and code in (ErrorCode.PEER_RESTARTED, ErrorCode.PEER_UNSUPPORTED):
        return KeyResult(KeyStatus.FAILED, code, f"{path}: the source at {endpoint} could not check it")
    return KeyResult(KeyStatus.FAILED, ErrorCode.PEER_UNREACHABLE,
                     f"{path}: the source at {endpoint} did not check it (no verdict came)")
