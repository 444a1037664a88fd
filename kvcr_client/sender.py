"""How an operation goes out and how its answer comes back to the caller.

``Sender`` owns the mechanics every operation shares (``kvcr_client.operations`` builds the
requests): the handle a request returns and its place in the completion queue, the regions
it names held until the node can no longer touch them (spec section 5.1), its abort, a
deliver with layer plans fed group by group (``PlanProgress``), and a deliver served by
READs under grants (``Grants.deliver``), whose handle is the same kind as the node's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcr_client.completions import Completions
from kvcr_client.core import ClientCore
from kvcr_client.errors import OperationTimeout
from kvcr_client.grants import Grants
from kvcr_client.regions import RegionHandle, RegionTable
from kvcr_client.results import DeliverHandle, KeyOutcome, OpHandle, Results, StoreHandle, store_handle
from kvcr_client.session_scope import GrantedKey
from kvcr_protocol import (
    Abort,
    Completion,
    DeliverItem,
    ErrorCode,
    GroupEvent,
    GroupLedger,
    KeyResult,
    Message,
    code_of,
)

ABORT_TIMEOUT_S = 5.0
"""How long an abort request waits for its acknowledgement (the operation completes on its own)."""


class Sender:
    """Sends operations of one client and gives back their handles."""

    def __init__(self, core: ClientCore, regions: RegionTable, completions: Completions, grants: Grants) -> None:
        self.core = core
        self.regions = regions
        self.completions = completions
        self.grants = grants

    def handle(self, op_id: int, kind: str, fut: Future[Any], abort: Any = None) -> OpHandle[Any]:
        """The handle of a request sent as ``op_id``; ``poll_completed`` reports it once done."""
        core = self.core
        handle: OpHandle[Any] = OpHandle(op_id, kind, fut, abort, core.wait, core.poll, core.wait_async)
        self.completions.when_done(fut, handle)
        return handle

    def store_handle(self, op_id: int, kind: str, fut: Future[Any], written: Future[None],
                     abort: Any = None) -> StoreHandle:
        """A deposit's handle: ``written`` once the memory is free, then the results."""
        return store_handle(self.core, self.completions, op_id, kind, fut, written, abort)

    def op(self, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool,
           regions: set[RegionHandle], on_reply: Callable[[Message], None] | None = None,
           hold: Callable[[], Callable[[], None]] | None = None) -> OpHandle[Any]:
        """Send one operation; its handle resolves to per-key results (``send``)."""
        op_id = self.core.next_id()
        fut = self.send(op_id, kind, keys, build, deadline_ms, touches, regions, on_reply, hold=hold)
        return self.handle(op_id, kind, fut, self.abort)

    def send(
        self, op_id: int, kind: str, keys: list[bytes], build: Any, deadline_ms: int, touches: bool,
        regions: set[RegionHandle], on_reply: Callable[[Message], None] | None = None,
        observer: Callable[[Any], None] | None = None, written: Future[None] | None = None,
        hold: Callable[[], Callable[[], None]] | None = None,
    ) -> Future[Any]:
        """Send one operation. Its regions stay in use until the node can no longer touch them.

        That is when the node answered, or the session is over (closed, or the node lost);
        not when the client merely stopped waiting (spec section 5.1). ``deadline_ms`` 0
        is the node's default, which the client does not know: it waits for the answer.
        ``on_reply`` sees the reply first, ``observer`` the request's events (lock held);
        ``written`` resolves when the regions are free. ``hold`` holds the memory the
        request names (``kvcr_client.uncertain``) when the client stops waiting before
        the node can no longer touch it, and returns what lets go of it then.
        """
        table = self.regions
        if regions:
            table.hold(op_id, kind, regions)
        elif written is not None:
            written.set_result(None)
        let_go: list[Callable[[], None]] = []
        over: list[bool] = []

        def settled() -> None:
            over.append(True)
            table.settle(op_id, regions)
            for release in let_go:
                release()
            if written is not None and not written.done():
                written.set_result(None)

        def convert(msg: Message) -> Results[Any]:
            assert isinstance(msg, Completion)
            if len(msg.results) != len(keys):
                raise ValueError(f"{len(msg.results)} results for {len(keys)} keys")
            if on_reply is not None:
                on_reply(msg)
            return Results([
                (k, KeyOutcome(r.status, code_of(r.code), r.reason, r.handle))
                for k, r in zip(keys, msg.results, strict=True)
            ])

        timeout_s = deadline_ms / 1000 if deadline_ms else math.inf
        _, fut = self.core.request(build, convert, timeout_s, touches, op_id, settled if regions else None, observer)
        if hold is not None and regions:

            def timed_out(done: Future[Any]) -> None:
                # The node may still write the memory after the caller saw OperationTimeout.
                if not over and isinstance(done.exception(), OperationTimeout):
                    let_go.append(hold())

            fut.add_done_callback(timed_out)
        return fut

    def abort(self, op_id: int) -> None:
        self.core.request(lambda i: Abort(i, op_id), lambda m: None, ABORT_TIMEOUT_S)

    def planned(
        self, keys: list[bytes], build: Any, deadline_ms: int, regions: set[RegionHandle], counts: list[int], token: int,
        on_reply: Callable[[Message], None] | None = None, hold: Callable[[], Callable[[], None]] | None = None,
    ) -> DeliverHandle:
        """Send a deliver with layer plans: a ``DeliverHandle`` fed by notifications, progress
        and the reply (``PlanProgress``), whose groups fail when the request ends without a
        reply (spec section 6.10)."""
        core = self.core
        op_id = core.next_id()
        handle = DeliverHandle(op_id, Future(), keys, counts, token, self.abort, core.wait, core.poll)
        handle.on_group = self.completions.add

        def reply(msg: Message) -> None:
            assert isinstance(msg, Completion)
            handle.apply(handle.progress.on_reply(msg))
            if on_reply is not None:
                on_reply(msg)
            if token and regions and any(r.code == ErrorCode.DESTINATION_UNCERTAIN for r in msg.results):
                self.regions.linger(op_id, regions)

        fut = self.send(op_id, "deliver", keys, build, deadline_ms, True, regions, reply, handle.observe, hold=hold)
        handle.future = fut
        self.completions.when_done(fut, handle, planned=True)
        return handle

    def read_granted(
        self, items: tuple[DeliverItem, ...], keys: list[bytes], granted: list[GrantedKey],
        groups: list[tuple[int, ...]] | None, deadline_ms: int, regions: set[RegionHandle],
    ) -> OpHandle[Results[KeyOutcome]] | DeliverHandle:
        """A deliver served by READs under grants (``Grants.deliver``): its handle returns once
        group 0 is posted; the core's turns post the rest, report each group as it lands and
        passes the lease check, and resolve the handle after the last."""
        core = self.core
        op_id = core.next_id()
        fut: Future[Results[KeyOutcome]] = Future()
        handle: OpHandle[Results[KeyOutcome]] | DeliverHandle
        ledger: GroupLedger | None = None
        report: Callable[[list[GroupEvent]], None] | None = None
        if groups is None:
            handle = self.handle(op_id, "deliver", fut)
        else:
            planned = DeliverHandle(op_id, fut, keys, [max(g, default=0) + 1 for g in groups], 0, None, core.wait,
                                    core.poll)
            planned.on_group = self.completions.add
            self.completions.when_done(fut, planned, planned=True)
            handle = planned
            # The READs move the handle's own ledger, and tell it each turn what moved.
            ledger, report = planned.progress.ledger, planned.apply

        def finished(results: list[KeyResult] | BaseException, done: list[int]) -> None:  # lock held
            if isinstance(results, BaseException):
                fut.set_exception(results)
                return
            if isinstance(handle, DeliverHandle):
                handle.apply(handle.progress.on_results(results, done))
            fut.set_result(Results([
                (k, KeyOutcome(r.status, code_of(r.code), r.reason, None)) for k, r in zip(keys, results, strict=True)
            ]))

        table = self.regions
        table.hold(op_id, "deliver", regions)
        try:
            self.grants.deliver(items, granted, groups, table.by_id, deadline_ms, ledger, report, finished,
                                lambda: table.settle(op_id, regions))
        except BaseException as exc:
            table.settle(op_id, regions)
            if not fut.done():
                fut.set_exception(exc)
            raise
        return handle
