"""The session rules of the protocol, in one place (spec sections 4 and 5).

A session's life is the same at both ends: the client's session (``kvcr_client.session``)
and the node's router read the rules from here, so a rule is written once.
"""

from __future__ import annotations

import enum


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
