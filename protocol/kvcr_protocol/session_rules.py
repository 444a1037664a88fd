"""The session rules of the protocol, in one place (spec sections 4 and 5).

A session's life is the same at both ends: the client's session (``kvcr_client.session``)
and the node's router read the rules from here, so a rule is written once. One table per
role (``RULES``) says what opens a session, which requests its opener may send once it is
open, what each request is answered with, and what the node may send it; small pure
functions answer the questions both ends ask: may this be sent now (``allowed``), may the
node serve it or how does it refuse it (``refusal``), at which version does a reply travel
(``reply_version``), and do ids repeat (``request_id_conflict``, ``region_conflict``).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass

from kvcr_protocol.errors import ErrorCode, ProtocolError
from kvcr_protocol.versions import BASE_VERSION


class Role(enum.Enum):
    """Who opened a session at a node: an engine's client, or another node (a peer)."""

    CLIENT = "client"
    PEER = "peer"


class SessionState(enum.Enum):
    """Where a session stands (spec section 4).

    IDLE: nothing sent yet. HELLO_SENT: the hello is out, no answer yet (the client's side
    only; a node answers a hello in the turn it reads it). OPEN: welcomed, requests flow.
    CLOSING: ``bye`` sent, its ``ack`` not yet in. CLOSED: over, by ``bye``, refusal or loss.
    """

    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class RoleRules:
    """The rules of one kind of session (spec section 5.2 for clients, 5.3 for peers)."""

    opening: str
    """The request that opens the session (always encoded at version 1, section 4.2)."""
    welcome: str
    """Its answer when the session opens (at the agreed version)."""
    replies: Mapping[str, frozenset[str]]
    """Each request the opener may send on the open session -> the messages that answer it
    besides ``error`` (every request may be refused, section 5.1)."""
    events: frozenset[str]
    """What the node sends on the session unasked, or about a request still in flight."""

    @functools.cached_property
    def requests(self) -> frozenset[str]:
        """What the opener may send once the session is open."""
        return frozenset(self.replies)

    @functools.cached_property
    def node_sends(self) -> frozenset[str]:
        """Every message the node may send on the open session."""
        return frozenset({"error"}).union(*self.replies.values(), self.events)

    @functools.cached_property
    def answering(self) -> Mapping[str, frozenset[str]]:
        """Each message the opener sends -> what answers it, ``error`` included (worked out once:
        the client asks for every reply it reads)."""
        table = {tag: answer | {"error"} for tag, answer in self.replies.items()}
        table[self.opening] = frozenset({self.welcome, "error"})
        return table


def _answers(**replies: str) -> dict[str, frozenset[str]]:
    return {tag: frozenset(answer.split("|")) for tag, answer in replies.items()}


_EITHER = _answers(
    stats="stats_reply", heartbeat="heartbeat", bye="ack", lease="lease_reply", renew="lease_reply", unlease="ack",
)
"""What clients and peers alike may send: a ``heartbeat`` is answered by the node's own
``heartbeat`` with the same id, ``bye`` by ``ack`` before the session ends (section 5.2)."""

RULES: Mapping[Role, RoleRules] = {
    Role.CLIENT: RoleRules(
        opening="hello",
        welcome="welcome",
        replies={
            **_answers(
                regions="ack", unregions="ack", deposit="complete", query="query_reply", deliver="complete",
                fetch="complete", release="complete", abort="ack", hint="ack", unhint="ack",
                put="put_reply", commit="complete", unput="ack", suspect="complete",
            ),
            **_EITHER,
        },
        events=frozenset({"capacity", "progress", "lease_end"}),
    ),
    Role.PEER: RoleRules(
        opening="peer_hello",
        welcome="peer_welcome",
        replies={
            **_answers(peer_client="ack", write="write_done|refuse", probe="probe_reply", peer_forget="ack",
                       suspect="complete"),
            **_EITHER,
        },
        events=frozenset({"progress", "lease_end"}),
    ),
}
"""The session rules by role."""

OPENING: Mapping[str, Role] = {rules.opening: role for role, rules in RULES.items()}
"""The tags that open a session, and the role of the session each opens."""

WHILE_STOPPING: frozenset[str] = frozenset({"release", "unlease", "unput", "commit", "bye", "heartbeat", "stats", "peer_forget"})
"""What a stopping node still serves: requests that end or release things, and stats
(spec section 10.1: every other request, and every hello, is refused ``SHUTTING_DOWN``)."""


def opens(tag: str) -> Role | None:
    """The role of the session a message of ``tag`` opens (None: it opens none)."""
    return OPENING.get(tag)


def allowed(role: Role, state: SessionState, tag: str) -> bool:
    """Whether the opener of a ``role`` session may send ``tag`` while the session is ``state``.

    Its hello first and nothing else before the answer (sections 5.2 and 5.3), its role's
    requests while open, and a hello again on an open session (it ends that session and
    opens another, section 5.2); nothing after ``bye`` or once the session is over (a new
    session starts from IDLE).
    """
    rules = RULES[role]
    if state is SessionState.IDLE:
        return tag == rules.opening
    if state is SessionState.OPEN:
        return tag in rules.replies or tag == rules.opening
    return False


def accepts(role: Role, state: SessionState, tag: str) -> bool:
    """Whether the opener of a ``role`` session takes ``tag`` from the node while ``state``:
    the welcome or a refusal after its hello; once open (and while its ``bye`` waits for its
    ``ack``) whatever the node may send on the session."""
    rules = RULES[role]
    if state is SessionState.HELLO_SENT:
        return tag in (rules.welcome, "error")
    if state in (SessionState.OPEN, SessionState.CLOSING):
        return tag in rules.node_sends
    return False


_ERROR_ONLY = frozenset({"error"})


def answers(role: Role, request: str) -> frozenset[str]:
    """What answers ``request`` on a ``role`` session, ``error`` included (section 5.1: exactly one of them)."""
    return RULES[role].answering.get(request, _ERROR_ONLY)


def refusal(role: Role | None, state: SessionState, tag: str, *, stopping: bool = False) -> ProtocolError | None:
    """How a node refuses a message of ``tag`` (None: it serves it).

    ``role`` and ``state`` are the sender's session as the node holds it: OPEN with its role,
    or IDLE (role None) when the identity has none. A hello of either kind is read in any
    state, since it ends the identity's session and opens another (section 5.2), unless the
    node stops; anything else needs an open session of the role it belongs to, and a
    stopping node serves only ``WHILE_STOPPING``.
    """
    if tag in OPENING:
        if stopping:
            return ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping")
        return None
    if role is None or state is not SessionState.OPEN:
        return ProtocolError(ErrorCode.BAD_STATE, "say hello first")
    if tag not in RULES[role].replies:
        return ProtocolError(ErrorCode.BAD_STATE, f"{tag} is not a {role.value} request")
    if stopping and tag not in WHILE_STOPPING:
        return ProtocolError(ErrorCode.SHUTTING_DOWN, "the node is stopping")
    return None


def reply_version(request: str | None, reply: str, session_version: int | None) -> int:
    """The version a node encodes ``reply`` at, answering ``request`` (None: an event, or no
    decoded request) on a session at ``session_version`` (None: the sender has none).

    Before a version is agreed every reply travels at version 1 (section 5.1): a refusal of
    a hello (whatever session its identity had: the hello's versions are not agreed), and
    any answer to a sender without a session. A welcome travels at the version it agrees,
    which is its new session's; everything else at the session's version.
    """
    if session_version is None:
        return BASE_VERSION
    role = OPENING.get(request or "")
    if role is not None and reply != RULES[role].welcome:
        return BASE_VERSION
    return session_version


def request_id_conflict(request_id: int, in_flight: Container[int]) -> ProtocolError | None:
    """A request whose id is one of the session's requests in flight (section 5.1: ids are
    unique among them) is refused ``BAD_STATE`` at path ``id``; None when the id is free."""
    if request_id in in_flight:
        return ProtocolError(ErrorCode.BAD_STATE, f"operation {request_id} is already in progress", "id")
    return None


def region_conflict(held: Collection[int], announced: Sequence[int]) -> ProtocolError | None:
    """A ``hello`` or ``regions`` announcing a region id twice, or one the session holds
    (announced and not withdrawn; section 5.2: ids are unique in a session), is refused
    ``BAD_DESCRIPTOR``, and nothing of it is taken; None when every id is new.

    The path is ``regions`` for an id the message repeats, ``regions[i].region`` for the
    first that repeats one the session holds.
    """
    if len(set(announced)) != len(announced):
        return ProtocolError(ErrorCode.BAD_DESCRIPTOR, "a region id is announced twice", "regions")
    for i, region in enumerate(announced):
        if region in held:
            return ProtocolError(
                ErrorCode.BAD_DESCRIPTOR, f"region {region} is announced already in this session; ids are unique",
                f"regions[{i}].region",
            )
    return None
