"""Exceptions a client raises; protocol errors are translated here, once."""

from __future__ import annotations

from kvcr_protocol import ErrorCode, LocalProtocolError, ProtocolError, code_of


class KvcrError(Exception):
    """Base of every kvcr client error."""


class ArgumentError(KvcrError, ValueError):
    """A call's argument is wrong; ``field`` names it. Nothing was sent."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class NodeError(KvcrError):
    """The node refused a request whole; ``code`` and ``path`` say why and where."""

    def __init__(self, code: int, reason: str, path: str = "") -> None:
        self.code = code_of(code)
        self.reason = reason
        self.path = path
        name = self.code.name if isinstance(self.code, ErrorCode) else str(code)
        super().__init__(f"{name}{' at ' + path if path else ''}: {reason}")


class NodeLostError(KvcrError, ConnectionError):
    """The connection to the node is gone; pending operations failed. ``reconnect()`` may help."""


class OperationTimeout(KvcrError, TimeoutError):
    """No answer within the operation's deadline (plus a grace).

    For a deposit or deliver, the node may still read or write the memory it names until
    it answers: the client keeps that memory's regions in use (``unregister`` refuses
    them) until the node's late answer arrives or the session is over. Meanwhile a
    deliver into a timed-out deliver's destination, or a deposit or put from it, fails
    ``ArgumentError`` naming the span; a timed-out deposit's memory is free once its
    handle's ``written`` resolves.
    """


class ClientClosed(KvcrError):
    """The client was closed."""


class GroupFailed(NodeError):
    """A group of a layer plan will not be delivered: it, or an earlier group of the same key,
    failed (``code``: the key's code, ``TIMEOUT`` or ``NODE_LOST`` when the client stopped
    waiting). The groups before it stay delivered: their bytes are in place."""


class ClientStateError(KvcrError):
    """The client's session forbids the request now (it is not open, or the request id is in
    flight already); ``code`` and ``path`` as the protocol says. Nothing was sent."""

    def __init__(self, code: int, reason: str, path: str = "") -> None:
        self.code = code_of(code)
        self.reason = reason
        self.path = path
        super().__init__(reason)


def translated(exc: ProtocolError) -> KvcrError:
    """A protocol error as callers see it, translated here once (the core's boundary): what
    this side could not build is the caller's argument (``ArgumentError`` naming the field)
    or its session's state (``ClientStateError``); what the node sent wrong is ``NodeError``."""
    if isinstance(exc, LocalProtocolError):
        if exc.code == ErrorCode.BAD_STATE:
            return ClientStateError(exc.code, exc.reason, exc.path)
        return ArgumentError(exc.path or "request", exc.reason)
    return NodeError(exc.code, exc.reason, exc.path)
