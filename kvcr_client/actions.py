"""The session's events carried out: futures finished, memory settled, callbacks called, frames sent.

The client core hands every event a ``ClientSession`` returns to ``Actions`` with its I/O
lock held, in the session's order (architecture §4): the session decides, this does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcr_client.errors import NodeError, translated
from kvcr_client.requests import Request, settle
from kvcr_client.session import (
    Capacity,
    ClientSession,
    Event,
    Failed,
    LeaseEnd,
    Lost,
    Observed,
    Replied,
    SendFrame,
    Settled,
    Undecodable,
    Unmatched,
)
from kvcr_client.transport import Transport
from kvcr_client.waiters import Waiters
from kvcr_protocol import CapacityEvent, ErrorCode, LeaseEnded, ProtocolError

log = logging.getLogger("kvcr.client")


@dataclass
class Hooks:
    """Where the node's events go, set by the client above the core (lock held when called)."""

    on_capacity: Callable[[CapacityEvent], None] | None = None
    on_lease_end: Callable[[LeaseEnded], None] | None = None
    """Takes the node's ``lease_end`` events."""


class Actions:
    """Carries out a core's session events (lock held), one handler per event type."""

    def __init__(self, session: ClientSession[Request], transport: Transport, waiters: Waiters, hooks: Hooks) -> None:
        self.session = session
        self.transport = transport
        self.waiters = waiters
        self.hooks = hooks

    def __call__(self, events: list[Event[Request]]) -> None:
        """Carry out ``events`` in their order."""
        by_type = _BY_TYPE
        for event in events:
            by_type[type(event)](self, event)

    def _replied(self, event: Replied[Request]) -> None:
        future = event.handle
        msg = event.message
        try:
            result = future.convert(msg)
        except Exception as exc:  # a reply of the wrong type or shape fails that request only
            future.set_exception(
                translated(exc) if isinstance(exc, ProtocolError)
                else NodeError(ErrorCode.WRONG_TYPE, f"unexpected reply {msg.TAG}: {exc!r}")
            )
        else:
            future.set_result(result)
        self.waiters.wake_leader(future)

    def _failed(self, event: Failed[Request]) -> None:
        future = event.handle
        if not future.done():
            future.set_exception(event.error)
        self.waiters.wake_leader(future)

    def _settled(self, event: Settled[Request]) -> None:
        settle(event.handle)

    def _observed(self, event: Observed[Request]) -> None:
        observer = event.handle.observer
        if observer is not None:
            observer(event.message)

    def _capacity(self, event: Capacity) -> None:
        callback = self.hooks.on_capacity
        if callback is not None:
            try:
                callback(event.event)
            except Exception:
                log.exception("capacity callback failed")

    def _lease_end(self, event: LeaseEnd) -> None:
        # An event, not a reply: its id counts the session's events (spec section 6.11).
        callback = self.hooks.on_lease_end
        if callback is not None:
            try:
                callback(event.event)
            except Exception:
                log.exception("lease end handling failed")

    def _send_frame(self, event: SendFrame) -> None:
        if not self.transport.send(event.frame):
            self.session.heartbeat_unsent(time.monotonic())

    def _undecodable(self, event: Undecodable) -> None:
        log.warning("undecodable frame from the node: %s", event.error)

    def _unmatched(self, event: Unmatched) -> None:
        log.debug("reply for no pending request: %s", event.message.TAG)

    def _lost(self, event: Lost) -> None:
        log.debug("the session is lost: %s", event.reason)


_BY_TYPE: dict[type, Callable[[Actions, Any], None]] = {
    Replied: Actions._replied, Failed: Actions._failed, Settled: Actions._settled, Observed: Actions._observed,
    Capacity: Actions._capacity, LeaseEnd: Actions._lease_end, SendFrame: Actions._send_frame,
    Undecodable: Actions._undecodable, Unmatched: Actions._unmatched, Lost: Actions._lost,
}
"""One handler per event type, unbound: the actions hold no cycle through their own methods."""
