"""Reports of keys read from a source's pools, passed on to that source (spec section 6.12,
"Integrity"; section 5.3), in process: ``Suspects`` with a fake store, outbox and source.

A key the node does not store, but whose source's grant one of the reporting session's
leases passed on, is asked of that source, aimed at the incarnation that granted it, and
the report is answered once every such key has the source's verdict, in the order of the
keys. A key neither stored nor so granted is ``NOT_FOUND``, a peer session's reports are
never passed on, no answer is ``PEER_UNREACHABLE``, and how many reports wait on sources
is bounded per session and node-wide (``BUSY`` past it), every count back at zero after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcr_node.counters import Counters
from kvcr_node.records import PeerState, Session
from kvcr_node.suspects import PASSED_ON_MAX, PASSED_ON_PER_SESSION, SOURCE_ANSWER_S, Suspects
from kvcr_protocol import Completion, Error, ErrorCode, KeyResult, KeyStatus, Message, Suspect

SOURCE = ("tcp://127.0.0.1:7001", 99)


class Store:
    def lookup(self, key: bytes) -> None:
        return None  # nothing stored here: every key is a source's or unknown


@dataclass
class Outbox:
    sent: list[tuple[Session, Message]] = field(default_factory=list)

    def settled(self, session: Session, request: str, request_id: int, results: Any) -> None:
        pass

    def reply(self, session: Session, msg: Message) -> None:
        self.sent.append((session, msg))


@dataclass
class Source:
    """The target's links, seen from ``Suspects``: what was asked, and its answers by hand."""

    asked: list[tuple[str, Message, Callable[[Message | None, ErrorCode | None], None], float, int]] = field(
        default_factory=list)

    def ask(self, endpoint: str, build: Callable[[int], Message], answer: Any, wait_s: float, incarnation: int) -> None:
        self.asked.append((endpoint, build(len(self.asked) + 1), answer, wait_s, incarnation))

    def verdict(self, i: int, result: KeyResult) -> None:
        _, msg, answer, _, _ = self.asked[i]
        answer(Completion(msg.id, (result,)), None)  # type: ignore[attr-defined]


def make(granted: dict[bytes, tuple[str, int]]) -> tuple[Suspects, Outbox, Source]:
    outbox, source = Outbox(), Source()
    suspects = Suspects(Store(), None, outbox, Counters(), lambda: 0.0, 1 << 30, {},  # type: ignore[arg-type]
                        lambda session: dict(granted), source.ask)
    return suspects, outbox, source


def client(name: str = "c") -> Session:
    return Session(name.encode(), name, f"agent-{name}", 5)


def codes(msg: Message) -> list[int]:
    assert isinstance(msg, Completion)
    return [r.code for r in msg.results]


def test_a_key_read_from_a_source_is_asked_of_it_and_answered_with_its_verdict() -> None:
    suspects, outbox, source = make({b"remote": SOURCE})
    session = client()
    suspects.on_suspect(session, Suspect(7, (b"nowhere", b"remote", b"remote")))
    assert not outbox.sent, "the report waits for the source's verdict"
    ((endpoint, msg, _, wait_s, incarnation),) = source.asked  # the repeated key is asked once
    assert (endpoint, incarnation) == SOURCE and wait_s == SOURCE_ANSWER_S
    assert isinstance(msg, Suspect) and msg.keys == (b"remote",)
    assert session.suspects_at_sources == 1
    source.verdict(0, KeyResult(KeyStatus.FAILED, ErrorCode.DIGEST_MISMATCH, "keys[0]: dropped"))
    ((to, reply),) = outbox.sent
    assert to is session and isinstance(reply, Completion) and reply.id == 7
    assert codes(reply) == [ErrorCode.NOT_FOUND, ErrorCode.DIGEST_MISMATCH, ErrorCode.DIGEST_MISMATCH]
    assert SOURCE[0] in reply.results[1].reason and reply.results[1].reason.startswith("keys[1]")
    assert session.suspects_at_sources == 0 and suspects.passed_on == 0


@pytest.mark.parametrize(("answer", "code"), [
    ((None, ErrorCode.PEER_UNREACHABLE), ErrorCode.PEER_UNREACHABLE),
    ((None, ErrorCode.PEER_RESTARTED), ErrorCode.PEER_RESTARTED),
    ((None, ErrorCode.PEER_UNSUPPORTED), ErrorCode.PEER_UNSUPPORTED),
    ("error", ErrorCode.PEER_UNREACHABLE),
    ("odd code", ErrorCode.PEER_UNREACHABLE),
    ("ok", 0),
])
def test_what_the_source_says_or_why_it_says_nothing(answer: Any, code: int) -> None:
    suspects, outbox, source = make({b"remote": SOURCE})
    suspects.on_suspect(client(), Suspect(1, (b"remote",)))
    _, msg, callback, _, _ = source.asked[0]
    if answer == "error":
        callback(Error(msg.id, ErrorCode.UNKNOWN_TYPE, "no such message", "t"), None)  # type: ignore[attr-defined]
    elif answer == "odd code":
        source.verdict(0, KeyResult(KeyStatus.FAILED, ErrorCode.INTERNAL, "?"))
    elif answer == "ok":
        source.verdict(0, KeyResult(KeyStatus.OK))
    else:
        callback(*answer)
    assert codes(outbox.sent[0][1]) == [code]


def test_a_key_no_lease_of_the_session_holds_at_a_source_is_not_passed_on() -> None:
    suspects, outbox, source = make({})
    suspects.on_suspect(client(), Suspect(1, (b"remote",)))
    assert not source.asked and codes(outbox.sent[0][1]) == [ErrorCode.NOT_FOUND]


def test_a_peer_sessions_report_is_never_passed_on() -> None:
    suspects, outbox, source = make({b"remote": SOURCE})
    peer = client("peer")
    peer.peer = PeerState()
    suspects.on_suspect(peer, Suspect(1, (b"remote",)))
    assert not source.asked and codes(outbox.sent[0][1]) == [ErrorCode.NOT_FOUND]


def test_reports_waiting_on_sources_are_bounded_per_session_and_node_wide() -> None:
    keys = tuple(b"k%d" % i for i in range(PASSED_ON_MAX + 8))
    suspects, outbox, source = make({k: SOURCE for k in keys})
    one = client("one")
    suspects.on_suspect(one, Suspect(1, keys[:PASSED_ON_PER_SESSION + 2]))
    assert len(source.asked) == PASSED_ON_PER_SESSION and one.suspects_at_sources == PASSED_ON_PER_SESSION
    sessions = [client(f"s{i}") for i in range(PASSED_ON_MAX // PASSED_ON_PER_SESSION + 1)]
    for i, session in enumerate(sessions):
        suspects.on_suspect(session, Suspect(10 + i, keys[:PASSED_ON_PER_SESSION]))
    assert len(source.asked) == PASSED_ON_MAX == suspects.passed_on
    for i in range(len(source.asked)):
        source.verdict(i, KeyResult(KeyStatus.OK))
    assert suspects.passed_on == 0 and all(s.suspects_at_sources == 0 for s in (one, *sessions))
    first = next(msg for session, msg in outbox.sent if session is one)
    assert codes(first)[-2:] == [ErrorCode.BUSY, ErrorCode.BUSY] and codes(first)[0] == 0
    assert len(outbox.sent) == 1 + len(sessions)


def test_a_session_that_ended_meanwhile_gets_nothing_and_its_count_comes_back() -> None:
    suspects, outbox, source = make({b"remote": SOURCE})
    session = client()
    suspects.on_suspect(session, Suspect(1, (b"remote",)))
    session.closing = True
    source.verdict(0, KeyResult(KeyStatus.OK))
    assert not outbox.sent and session.suspects_at_sources == 0 and suspects.passed_on == 0


def test_a_source_answering_at_once_answers_the_report_once() -> None:
    outbox = Outbox()

    def ask(endpoint: str, build: Callable[[int], Message], answer: Any, wait_s: float, incarnation: int) -> None:
        answer(None, ErrorCode.PEER_UNREACHABLE)  # the link could not open: answered inside ask

    suspects = Suspects(Store(), None, outbox, Counters(), lambda: 0.0, 1 << 30, {},  # type: ignore[arg-type]
                        lambda session: {b"a": SOURCE, b"b": SOURCE}, ask)
    suspects.on_suspect(client(), Suspect(1, (b"a", b"b")))
    assert len(outbox.sent) == 1 and codes(outbox.sent[0][1]) == [ErrorCode.PEER_UNREACHABLE] * 2
