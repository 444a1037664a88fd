"""Client session conformance: one test per MUST the spec's session sections (5.1, 5.2)
put on a client, each against the client's own session (``kvcr_client.session``), in
process and without a node: the frames a node would send are built here and handed to it.

Each test quotes the sentence it checks. The node's side of the same rules is held by
test_session_rules.py; both ends read one table (``kvcr_protocol.session_rules``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgpack
import pytest

import kvcr_protocol as kp
from kvcr_client.errors import ClientClosed, NodeError
from kvcr_client.session import Capacity, ClientSession, Failed, LeaseEnd, Replied, SendFrame, Unmatched
from kvcr_protocol import (
    Ack,
    CapacityEvent,
    ErrorCode,
    Heartbeat,
    Hello,
    LeaseEnded,
    LocalProtocolError,
    Message,
    Progress,
    Query,
    QueryReply,
    RemoteProtocolError,
    Role,
    Welcome,
    decode,
    encode,
    supported_up_to,
)
from kvcr_protocol.session_rules import RULES, SessionState

ROOT = Path(__file__).resolve().parents[2]
V = kp.CURRENT_VERSION
HEARTBEAT_MS = 1000

SAMPLES: dict[str, Message] = {}
"""One message of every tag, from the version-5 vectors (spec section 13)."""
for _vec in json.loads((ROOT / "spec" / "vectors" / "valid-v5.json").read_text())["vectors"]:
    SAMPLES.setdefault(_vec["tag"], decode(bytes.fromhex(_vec["hex"]), V))


def sample(tag: str, request_id: int) -> Message:
    return dataclasses.replace(SAMPLES[tag], id=request_id)  # type: ignore[type-var]


def hello(request_id: int = 1) -> Hello:
    return dataclasses.replace(SAMPLES["hello"], id=request_id, versions=supported_up_to(V))  # type: ignore[type-var]


def welcome(request_id: int, version: int = V) -> Welcome:
    return dataclasses.replace(SAMPLES["welcome"], id=request_id, version=version, heartbeat_ms=HEARTBEAT_MS)  # type: ignore[type-var]


def opened() -> ClientSession[str]:
    s: ClientSession[str] = ClientSession(supported_up_to(V))
    s.send(1, hello(1), 0.0, 10.0, "hello")
    (event,) = s.receive(encode(welcome(1), V), 0.0)
    assert isinstance(event, Replied) and s.state is SessionState.OPEN
    return s


def test_a_client_sends_hello_before_any_other_message() -> None:
    """5.2: "A client MUST send `hello` before any other message." Every other client
    request is refused by the session itself, and nothing is in flight."""
    s: ClientSession[str] = ClientSession(supported_up_to(V))
    for tag in sorted(RULES[Role.CLIENT].requests):
        with pytest.raises(LocalProtocolError) as refused:
            s.send(7, sample(tag, 7), 0.0, 1.0, tag)
        assert refused.value.code == ErrorCode.BAD_STATE, tag
    assert s.pending == {} and s.state is SessionState.IDLE
    frame = s.send(1, hello(1), 0.0, 1.0, "hello")
    assert msgpack.unpackb(frame)["v"] == 1 and s.state is SessionState.HELLO_SENT  # hellos travel at v1 (4.2)
    with pytest.raises(LocalProtocolError):  # and nothing else before its answer
        s.send(2, Query(2, (b"k",)), 0.0, 1.0, "query")


def test_request_ids_are_unique_in_flight_and_never_zero() -> None:
    """5.1: "A sender MUST give each request an `id` that is unique among its requests in
    flight in that session, and MUST NOT use 0 as a request id." """
    s = opened()
    s.send(5, Query(5, (b"k",)), 0.0, 1.0, "first")
    for bad in (5, 0):
        with pytest.raises(LocalProtocolError) as refused:
            s.send(bad, Query(bad, (b"k",)), 0.0, 1.0, "again")
        assert (refused.value.code, refused.value.path) == (ErrorCode.BAD_STATE, "id")
    assert list(s.pending) == [5] and s.pending[5].handle == "first"
    (answer,) = s.receive(encode(QueryReply(5, ()), V), 0.0)
    assert answer == Replied("first", QueryReply(5, ()))
    s.send(5, Query(5, (b"k",)), 0.0, 1.0, "reused")  # free again once answered
    assert s.pending[5].handle == "reused"


def test_a_client_closes_a_session_welcomed_at_a_version_it_did_not_offer() -> None:
    """5.2: "A client MUST close the session if `welcome.version` is not one it offered."
    The hello fails with the problem, and nothing more is sent on the session."""
    s: ClientSession[str] = ClientSession(supported_up_to(3))
    s.send(1, hello(1), 0.0, 10.0, "hello")
    (failed,) = s.receive(encode(welcome(1, version=4), 3), 0.0)  # a v3 envelope naming version 4
    assert isinstance(failed, Failed) and failed.handle == "hello"
    assert isinstance(failed.error, RemoteProtocolError) and failed.error.code == ErrorCode.UNSUPPORTED_VERSION
    assert (s.state, s.connected, s.version, s.welcome) == (SessionState.CLOSED, False, 0, None)
    assert s.timeouts(100.0) == []  # no heartbeat goes on a closed session
    with pytest.raises(ClientClosed):
        s.send(2, Query(2, (b"k",)), 0.0, 1.0, "query")
    s.reopen()  # a new connection starts from IDLE
    assert s.state is SessionState.IDLE


def test_a_reply_naming_no_request_in_flight_is_ignored() -> None:
    """5.1: "An endpoint MUST ignore a reply whose `id` names no request of its in flight."
    Nothing in flight changes and no frame is sent."""
    s = opened()
    s.send(2, Query(2, (b"k",)), 0.0, 1.0, "query")
    events = s.receive(encode(QueryReply(99, ()), V), 0.0)
    assert events == [Unmatched(QueryReply(99, ()))]
    assert list(s.pending) == [2]


def test_a_progress_naming_no_request_in_flight_is_ignored() -> None:
    """5.1: "an endpoint MUST ignore a `progress` whose `id` names no request of its in
    flight." """
    s = opened()
    s.send(2, Query(2, (b"k",)), 0.0, 1.0, "query", observed=True)
    progress = dataclasses.replace(SAMPLES["progress"], id=77)  # type: ignore[type-var]
    assert isinstance(progress, Progress)
    assert s.receive(encode(progress, V), 0.0) == [] and list(s.pending) == [2]


def test_a_client_replies_to_no_event_and_answers_no_heartbeat() -> None:
    """5.2: of `lease_end` and `capacity`, "A client MUST NOT reply"; "A client MUST NOT
    answer a heartbeat." The session hands the events on and sends nothing for them."""
    s = opened()
    capacity = CapacityEvent(1, "kv", 2, 8)
    ended = dataclasses.replace(SAMPLES["lease_end"], id=2)  # type: ignore[type-var]
    assert isinstance(ended, LeaseEnded)
    assert s.receive(encode(capacity, V), 0.5) == [Capacity(capacity)]
    assert s.receive(encode(ended, V), 0.5) == [LeaseEnd(ended)]
    assert s.receive(encode(Heartbeat(9), V), 0.5) == []
    # Its own heartbeats are requests, sent when idle; an echo of one is never answered.
    events = s.timeouts(0.5 + HEARTBEAT_MS / 1000)
    assert [type(e) for e in events] == [SendFrame]
    assert s.pending == {} and s.receive(encode(Heartbeat(1), V), 2.0) == []


def test_a_reply_that_does_not_answer_its_request_fails_that_request() -> None:
    """5.1: a reply carries "the `id` of the request it answers", and each request has one
    kind of answer (or `error`; the rules table's ``answers``). Another kind fails that
    request alone; the session goes on."""
    s = opened()
    s.send(3, Query(3, (b"k",)), 0.0, 1.0, "query")
    s.send(4, Query(4, (b"k",)), 0.0, 1.0, "other")
    (wrong,) = s.receive(encode(Ack(3), V), 0.0)
    assert isinstance(wrong, Failed) and isinstance(wrong.error, NodeError)
    assert wrong.error.code == ErrorCode.WRONG_TYPE and list(s.pending) == [4]
    assert s.state is SessionState.OPEN
