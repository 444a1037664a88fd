"""A request's future, and its settling: what the client core hands out for each request it sends."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcr_protocol import Message, Notification, Progress

log = logging.getLogger("kvcr.client")

CONTROL_TIMEOUT_S = 10.0
"""How long a request the node answers at once (or within a source's answer time) waits for
its answer: queries, hints, stats, region announcements, leases, puts, commits."""

_RUNNING = "RUNNING"
_FINISHED = "FINISHED"
_SETTLED = frozenset({"CANCELLED", "CANCELLED_AND_NOTIFIED", _FINISHED})
"""``concurrent.futures.Future``'s state names."""


class Request(Future[Any]):
    """A request's future, carrying what the core needs to finish it (the session's handle).

    It runs from the moment it is made (``cancel`` refuses it: abort the operation instead).
    ``done`` and the result of a finished request are read without the future's lock: its
    state only moves forward, and a finished future never changes again.
    """

    def __init__(
        self,
        convert: Callable[[Message], Any],
        touches_memory: bool,
        on_settled: Callable[[], None] | None,
        observer: Callable[[Progress | Notification], None] | None = None,
    ) -> None:
        super().__init__()
        self._state = _RUNNING  # nobody else holds it yet: no lock needed
        self.convert = convert
        self.touches_memory = touches_memory
        self.on_settled = on_settled
        """Called once, lock held, when the node can no longer touch memory for this request."""
        self.observer = observer
        """Called, lock held, with each ``progress`` event and each NIXL notification for this
        request while it is pending (spec sections 6.8 and 6.10)."""

    def done(self) -> bool:
        return self._state in _SETTLED

    def result(self, timeout: float | None = None) -> Any:
        if self._state == _FINISHED and self._exception is None:
            return self._result
        return super().result(timeout)


def settle(request: Request) -> None:
    """The node can no longer touch memory for this request: run its callback, once."""
    callback, request.on_settled = request.on_settled, None
    if callback is not None:
        try:
            callback()
        except Exception:
            log.exception("a settle callback failed")
