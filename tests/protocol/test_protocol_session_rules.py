"""The session rules table (``kvcr_protocol.session_rules``): what may be sent when, how a
node refuses the rest, at which version replies travel, and which ids may not repeat."""

from __future__ import annotations

import pytest

import kvcr_protocol as kp
from kvcr_protocol import ErrorCode, Role, SessionState, session_rules
from kvcr_protocol.operations import REQUEST_CODES
from kvcr_protocol.session_rules import (
    OPENING,
    RULES,
    WHILE_STOPPING,
    accepts,
    allowed,
    answers,
    opens,
    refusal,
    region_conflict,
    reply_version,
    request_id_conflict,
)

CLIENT_REQUESTS = {
    "regions", "unregions", "deposit", "query", "deliver", "fetch", "release", "abort", "hint", "unhint",
    "stats", "heartbeat", "bye", "lease", "renew", "unlease", "put", "commit", "unput", "suspect",
}
PEER_REQUESTS = {"peer_client", "write", "probe", "peer_forget", "suspect", "stats", "heartbeat", "bye", "lease", "renew", "unlease"}


def test_the_package_exports_the_rules() -> None:
    assert kp.session_rules is session_rules
    assert kp.Role is Role and kp.SessionState is SessionState


def test_each_role_has_its_requests() -> None:
    assert RULES[Role.CLIENT].requests == CLIENT_REQUESTS
    assert RULES[Role.PEER].requests == PEER_REQUESTS
    assert OPENING == {"hello": Role.CLIENT, "peer_hello": Role.PEER}
    assert opens("hello") is Role.CLIENT and opens("peer_hello") is Role.PEER and opens("query") is None


def test_every_tag_names_a_message_and_every_message_has_a_place() -> None:
    """Every message is an opening, a request of a role, an answer or an event, and every
    tag the rules name is one of the catalogue's."""
    named: set[str] = set(OPENING)
    for rules in RULES.values():
        named |= {rules.welcome} | rules.requests | rules.node_sends
    assert named <= set(kp.MESSAGE_BY_TAG), named - set(kp.MESSAGE_BY_TAG)
    assert named == set(kp.MESSAGE_BY_TAG), set(kp.MESSAGE_BY_TAG) - named


def test_the_requests_are_those_with_declared_codes() -> None:
    """Spec section 10.1 lists codes for exactly the requests the rules allow (and the hellos)."""
    requests = set(OPENING).union(*(rules.requests for rules in RULES.values()))
    assert requests == set(REQUEST_CODES)


def test_answers_name_reply_messages() -> None:
    for role, rules in RULES.items():
        for request in rules.requests | {rules.opening}:
            got = answers(role, request)
            assert "error" in got and len(got) >= 2, (request, got)
            for tag in got - {"heartbeat"}:
                assert kp.MESSAGE_BY_TAG[tag].REPLY, (request, tag)
    assert answers(Role.CLIENT, "bye") == {"ack", "error"}
    assert answers(Role.PEER, "bye") == {"ack", "error"}
    assert answers(Role.CLIENT, "heartbeat") == {"heartbeat", "error"}
    assert answers(Role.CLIENT, "hello") == {"welcome", "error"}
    assert answers(Role.PEER, "write") == {"write_done", "refuse", "error"}


@pytest.mark.parametrize("role", list(Role))
def test_what_the_opener_may_send(role: Role) -> None:
    rules = RULES[role]
    assert allowed(role, SessionState.IDLE, rules.opening)
    for tag in rules.requests:
        assert not allowed(role, SessionState.IDLE, tag)
        assert allowed(role, SessionState.OPEN, tag)
        for state in (SessionState.HELLO_SENT, SessionState.CLOSING, SessionState.CLOSED):
            assert not allowed(role, state, tag), (tag, state)
    other = RULES[Role.PEER if role is Role.CLIENT else Role.CLIENT]
    for tag in other.requests - rules.requests:
        assert not allowed(role, SessionState.OPEN, tag), tag
    assert not allowed(role, SessionState.HELLO_SENT, rules.opening)
    assert allowed(role, SessionState.OPEN, rules.opening)  # a hello ends the session and opens another
    assert not allowed(role, SessionState.CLOSING, rules.opening)


@pytest.mark.parametrize("role", list(Role))
def test_what_the_opener_accepts(role: Role) -> None:
    rules = RULES[role]
    assert accepts(role, SessionState.HELLO_SENT, rules.welcome) and accepts(role, SessionState.HELLO_SENT, "error")
    assert not accepts(role, SessionState.HELLO_SENT, "ack")
    for state in (SessionState.OPEN, SessionState.CLOSING):
        assert accepts(role, state, "ack") and accepts(role, state, "heartbeat") and accepts(role, state, "lease_end")
    assert not accepts(role, SessionState.IDLE, "ack") and not accepts(role, SessionState.CLOSED, "ack")
    assert accepts(Role.CLIENT, SessionState.OPEN, "capacity") and not accepts(Role.PEER, SessionState.OPEN, "capacity")


def test_refusal_before_hello_is_bad_state_for_everything_but_a_hello() -> None:
    for tag in CLIENT_REQUESTS | PEER_REQUESTS:
        refused = refusal(None, SessionState.IDLE, tag)
        assert refused is not None and refused.code is ErrorCode.BAD_STATE, tag
    assert refusal(None, SessionState.IDLE, "hello") is None
    assert refusal(None, SessionState.IDLE, "peer_hello") is None


def test_refusal_of_the_other_roles_requests() -> None:
    for tag in PEER_REQUESTS - CLIENT_REQUESTS:
        refused = refusal(Role.CLIENT, SessionState.OPEN, tag)
        assert refused is not None and refused.code is ErrorCode.BAD_STATE and "client request" in refused.reason
    for tag in CLIENT_REQUESTS - PEER_REQUESTS:
        refused = refusal(Role.PEER, SessionState.OPEN, tag)
        assert refused is not None and refused.code is ErrorCode.BAD_STATE and "peer request" in refused.reason
    for tag in CLIENT_REQUESTS:
        assert refusal(Role.CLIENT, SessionState.OPEN, tag) is None
    # A hello on an open session is read: it ends the session and opens another.
    assert refusal(Role.CLIENT, SessionState.OPEN, "hello") is None
    assert refusal(Role.PEER, SessionState.OPEN, "hello") is None


def test_a_stopping_node_serves_only_what_ends_things() -> None:
    assert WHILE_STOPPING == {"release", "unlease", "bye", "heartbeat", "stats", "peer_forget", "commit", "unput"}
    for role, rules in RULES.items():
        for tag in rules.requests:
            refused = refusal(role, SessionState.OPEN, tag, stopping=True)
            if tag in WHILE_STOPPING:
                assert refused is None, tag
            else:
                assert refused is not None and refused.code is ErrorCode.SHUTTING_DOWN, tag
    for tag in OPENING:
        refused = refusal(None, SessionState.IDLE, tag, stopping=True)
        assert refused is not None and refused.code is ErrorCode.SHUTTING_DOWN
    # Without a session it is still BAD_STATE: the sender must say hello (and then hears SHUTTING_DOWN).
    refused = refusal(None, SessionState.IDLE, "bye", stopping=True)
    assert refused is not None and refused.code is ErrorCode.BAD_STATE


def test_reply_versions() -> None:
    assert reply_version("hello", "error", 4) == 1  # a refused hello: no version agreed
    assert reply_version("peer_hello", "error", 5) == 1
    assert reply_version("hello", "welcome", 4) == 4  # the welcome travels at the agreed version
    assert reply_version("peer_hello", "peer_welcome", 3) == 3
    assert reply_version("query", "error", None) == 1  # no session: version 1
    assert reply_version(None, "error", None) == 1  # an undecoded frame
    assert reply_version("query", "error", 4) == 4
    assert reply_version("deliver", "complete", 3) == 3
    assert reply_version(None, "capacity", 2) == 2


def test_request_ids_in_flight_do_not_repeat() -> None:
    assert request_id_conflict(7, {1, 2}) is None
    refused = request_id_conflict(2, {1, 2})
    assert refused is not None and (refused.code, refused.path) == (ErrorCode.BAD_STATE, "id")


def test_region_ids_are_unique_in_a_session() -> None:
    assert region_conflict(set(), [1, 2]) is None
    assert region_conflict({1}, [2, 3]) is None
    twice = region_conflict(set(), [1, 2, 1])
    assert twice is not None and (twice.code, twice.path) == (ErrorCode.BAD_DESCRIPTOR, "regions")
    held = region_conflict({1, 5}, [9, 5])
    assert held is not None and (held.code, held.path) == (ErrorCode.BAD_DESCRIPTOR, "regions[1].region")
