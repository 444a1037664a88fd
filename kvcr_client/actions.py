"""The session's events carried out: futures finished, memory settled, callbacks called, frames sent.

The client core hands every event a ``ClientSession`` returns to ``Actions`` with its I/O
lock held, in the session's order (architecture §4): the session decides, this does.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

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


class Owner(Protocol):
    """What the actions use of the core that owns them (``ClientCore``): its session,
    transport, waiters and callbacks. A protocol, so this module never imports the core."""

    session: ClientSession[Request]
    transport: Transport
    waiters: Waiters
    on_capacity: Callable[[CapacityEvent], None] | None
    on_lease_end: Callable[[LeaseEnded], None] | None


class Actions:
    """Carries out a core's session events (lock held), one handler per event type."""

    def __init__(self, core: Owner) -> None:
        self.core: Owner = weakref.proxy(core)  # the core owns this part: no cycle keeps a closed core alive
        self._by_type: dict[type, Callable[[Any], None]] = {
            Replied: self._replied, Failed: self._failed, Settled: self._settled, Observed: self._observed,
            Capacity: self._capacity, LeaseEnd: self._lease_end, SendFrame: self._send_frame,
            Undecodable: self._undecodable, Unmatched: self._unmatched, Lost: self._lost,
        }

    def __call__(self, events: list[Event[Request]]) -> None:
        """Carry out ``events`` in their order."""
        by_type = self._by_type
        for event in events:
            by_type[type(event)](event)

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
        self.core.waiters.wake_leader(future)

    def _failed(self, event: Failed[Request]) -> None:
        future = event.handle
        if not future.done():
            future.set_exception(event.error)
        self.core.waiters.wake_leader(future)

    @staticmethod
    def _settled(event: Settled[Request]) -> None:
        settle(event.handle)

    @staticmethod
    def _observed(event: Observed[Request]) -> None:
        observer = event.handle.observer
        if observer is not None:
            observer(event.message)

    def _capacity(self, event: Capacity) -> None:
        callback = self.core.on_capacity
        if callback is not None:
            try:
                callback(event.event)
            except Exception:
                log.exception("capacity callback failed")

    def _lease_end(self, event: LeaseEnd) -> None:
        # An event, not a reply: its id counts the session's events (spec section 6.11).
        callback = self.core.on_lease_end
        if callback is not None:
            try:
                callback(event.event)
            except Exception:
                log.exception("lease end handling failed")

    def _send_frame(self, event: SendFrame) -> None:
        core = self.core
        if not core.transport.send(event.frame):
            core.session.heartbeat_unsent(time.monotonic())

    @staticmethod
    def _undecodable(event: Undecodable) -> None:
        log.warning("undecodable frame from the node: %s", event.error)

    @staticmethod
    def _unmatched(event: Unmatched) -> None:
        log.debug("reply for no pending request: %s", event.message.TAG)

    @staticmethod
    def _lost(event: Lost) -> None:
        log.debug("the session is lost: %s", event.reason)
