"""Raw ZeroMQ anchors shared by the benchmarks: a bare ROUTER process that answers msgpack
requests by their type, and the DEALER that talks to it.

Each benchmark's raw writer registers its handlers with ``serve``; ``echo`` is the round
trip that kvcr's control messages are measured against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import zmq

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def echo(msg: dict[str, Any]) -> dict[str, Any]:
    """The raw echo: the request's id back, with ``pad`` bytes when the request asks for a larger reply."""
    reply: dict[str, Any] = {"t": "echo", "id": msg["id"], "v": 2}
    pad = msg.get("pad")
    if pad:
        reply["r"] = bytes(pad)
    return reply


IDLE_PROGRESS_MS = 1
"""How often a serving process with an agent progresses it between requests: as often as a
kvcr node does while read grants are outstanding, so that a consumer's READ of its memory
(connection set-up included) completes over any transport."""


def serve(endpoint: str, handlers: Mapping[str, Handler], idle: Callable[[], object] | None = None) -> None:
    """Bind a ROUTER at ``endpoint``, say ``ready``, answer each request by its ``t`` until ``quit``.

    ``idle``, when given, runs every ``IDLE_PROGRESS_MS`` while no request is waiting (a
    NIXL agent's progress: the target of a READ needs it too, architecture §6).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    print("ready", flush=True)
    try:
        while True:
            if idle is not None:
                while not sock.poll(IDLE_PROGRESS_MS):
                    idle()
            ident, frame = sock.recv_multipart()
            msg = msgpack.unpackb(frame)
            if msg["t"] == "quit":
                sock.send_multipart([ident, msgpack.packb({"t": "bye"})])
                return
            sock.send_multipart([ident, msgpack.packb(handlers[msg["t"]](msg))])
    finally:
        sock.close(0)
        ctx.term()


class Peer:
    """A DEALER connected to a ``serve`` process."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)

    def call(self, msg: dict[str, Any], progress: Callable[[], object] | None = None) -> dict[str, Any]:
        """Send one request and return its reply, calling ``progress`` while waiting when given.

        A NIXL transfer into this process needs this side's agent progressed too
        (architecture §6): pass its ``get_new_notifs``.
        """
        self.sock.send(msgpack.packb(msg))
        if progress is not None:
            while not self.sock.poll(0):
                progress()
        reply: dict[str, Any] = msgpack.unpackb(self.sock.recv())
        return reply

    def close(self) -> None:
        """Stop the serving process and close the socket."""
        self.call({"t": "quit"})
        self.sock.close(0)
        self.ctx.term()
