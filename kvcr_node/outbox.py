"""What the node sends on its ROUTER socket, and which request it is answering.

The parts of the node that handle requests never touch a socket: they put replies and
refusals here, encoded for the receiver's version, and the loop sends them in order after
each message and each loop step (architecture §4). Every code sent is checked against the
codes spec section 10.1 lists for its request; one out of place is counted, and reported
as a breach of the node's invariants.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvcr_node import logs
from kvcr_node.counters import ProtocolErrors
from kvcr_node.records import Session
from kvcr_protocol import Error, KeyResult, Message, ProtocolError, Role, encode, session_rules
from kvcr_protocol.operations import allowed_refusal, allowed_result

REASON_MAX = 1024
"""Longest reason an ``error`` or a key result carries (spec section 10)."""
PATH_MAX = 256
"""Longest field path an ``error`` carries."""


class Outbox:
    """Encoded frames to send, in order, and the request in hand."""

    def __init__(self, protocol_errors: ProtocolErrors) -> None:
        self.frames: list[tuple[bytes, bytes]] = []
        """(identity, payload) pairs the loop has not sent yet."""
        self.protocol_errors = protocol_errors
        self.undeclared_codes: collections.Counter[str] = collections.Counter()
        """Codes sent that spec section 10.1 does not list for their request (a breach)."""
        self.request: tuple[bytes, int, str] | None = None
        """(identity, id, type tag) of the request being handled, once decoded."""
        self.answered = False
        """Whether something was sent to that request's sender with its id (else a failure
        while handling it still owes an answer)."""

    def begin(self) -> None:
        """A new frame arrived: nothing answered yet, no request decoded yet."""
        self.request = None
        self.answered = False

    def take(self) -> list[tuple[bytes, bytes]]:
        """The frames to send now (the outbox is empty afterwards)."""
        frames, self.frames = self.frames, []
        return frames

    def send(self, identity: bytes, msg: Message, version: int) -> None:
        current = self.request
        if current is not None and current[0] == identity and getattr(msg, "id", None) == current[1]:
            self.answered = True
        self.frames.append((identity, encode(msg, version)))

    def reply(self, session: Session, msg: Message) -> None:
        self.send(session.identity, msg, session.version)

    def refuse(self, to: Session | bytes, request_id: int, exc: ProtocolError, request: str | None = None) -> None:
        """Answer a request with ``error``, at the version the session rules give it (the
        session's; version 1 for a sender without one and for a refused hello, spec section
        5.1); ``request`` names its type when it is not the request in hand."""
        request = request or (self.request[2] if self.request is not None else None)
        self.check_refusal(request, exc.code)
        self.protocol_errors.inc(exc.code)
        identity, session_version = (to, None) if isinstance(to, bytes) else (to.identity, to.version)
        version = session_rules.reply_version(request, Error.TAG, session_version)
        logs.refusal(request, request_id, exc, None if isinstance(to, bytes) else to.name, identity,
                     not isinstance(to, bytes) and to.role is Role.PEER)
        self.send(identity, Error(request_id, int(exc.code), exc.reason[:REASON_MAX], exc.path[:PATH_MAX]), version)

    def check_refusal(self, request: str | None, code: int) -> None:
        """Count a refusal code the spec does not list for the request (section 10.1)."""
        if not allowed_refusal(request, code):
            self.undeclared_codes[f"{request or 'undecoded frame'}: error {code}"] += 1

    def settled(self, session: Session, request: str, request_id: int, results: Sequence[KeyResult]) -> None:
        """An operation's results are about to go out: check their codes, log its failures once."""
        self.check_results(request, results)
        logs.results(request, request_id, results, session.name, session.identity, session.role is Role.PEER)

    def check_results(self, request: str, results: Sequence[KeyResult]) -> None:
        """Count per-key codes the spec does not list for the request (section 10.1)."""
        for r in results:
            if not allowed_result(request, r.code):
                self.undeclared_codes[f"{request}: result {r.code}"] += 1
