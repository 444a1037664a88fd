"""The completion queue ``poll_completed`` drains, for engines that poll once per step.

``Completions`` owns it: what an operation's future does once it is done (a planned
deliver's groups end, the handle is queued), and which handles are queued (only for an
engine that polls, only handles nobody waited on, at most ``max_completed``).
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future
from typing import Any

from kvcr_client.errors import ClientClosed, NodeError, NodeLostError, OperationTimeout
from kvcr_client.results import DeliverHandle, GroupDone, OpHandle
from kvcr_protocol import ErrorCode

log = logging.getLogger("kvcr_client")

Completed = OpHandle[Any] | GroupDone


class Completions:
    """The queue of completed operations (and planned delivers' groups) for ``poll_completed``."""

    def __init__(self, max_completed: int) -> None:
        self.queue: collections.deque[Completed] = collections.deque(maxlen=max_completed)
        self.polling = False
        """Whether the engine polls (it called ``poll_completed``): only then are completions queued."""
        self.dropped = 0
        """Completions dropped from the full queue (``max_completed``)."""

    def when_done(self, fut: Future[Any], handle: OpHandle[Any], planned: bool = False) -> None:
        """Once ``fut`` is done: a planned deliver's groups end, and the handle is queued. The
        callback lets go of the handle once run, so the handle and its future hold no cycle: a
        finished operation is freed as soon as nobody holds its handle."""
        box = [handle]

        def done(f: Future[Any]) -> None:
            if not box:
                return
            h = box.pop()
            if planned and isinstance(h, DeliverHandle):
                end_groups(h, f)
            self.add(h)

        fut.add_done_callback(done)

    def add(self, handle: Completed) -> None:
        """Queue a completion (or a layer group's end): only for a polling engine, only if
        nobody waited on the operation."""
        if not self.polling or _waited(handle):
            return
        queue = self.queue
        if len(queue) == queue.maxlen:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("poll_completed queue full (%d): dropping the oldest completions", queue.maxlen)
        queue.append(handle)  # a full deque drops its oldest entry

    def drain(self) -> list[Completed]:
        """Everything queued, oldest first, but what someone waited on since it was queued (an
        operation may finish before its caller waits on it); from now on the engine polls."""
        self.polling = True
        out = []
        while self.queue:
            handle = self.queue.popleft()
            if not _waited(handle):
                out.append(handle)
        return out

    def __len__(self) -> int:
        return len(self.queue)


def _waited(handle: Completed) -> bool:
    """Whether someone waited on the operation ``handle`` (or its group) belongs to."""
    return (handle.handle if isinstance(handle, GroupDone) else handle).waited


def end_groups(handle: DeliverHandle, future: Future[Any]) -> None:
    """A planned deliver ended without a reply to read (spec section 6.10): its groups not yet
    delivered fail with the reason (the client's deadline, the session's loss, a refusal)."""
    exc = future.exception()
    if exc is None:
        return
    if isinstance(exc, OperationTimeout):
        code = int(ErrorCode.TIMEOUT)
    elif isinstance(exc, (NodeLostError, ClientClosed)):
        code = int(ErrorCode.NODE_LOST)
    elif isinstance(exc, NodeError):
        code = int(exc.code)
    else:
        code = int(ErrorCode.INTERNAL)
    handle.apply(handle.progress.end(code))
