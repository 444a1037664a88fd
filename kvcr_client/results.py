"""Operation handles and per-key results."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvcr_client.errors import GroupFailed
from kvcr_protocol import (
    PRESENCE_BY_CODE,
    ErrorCode,
    GroupEvent,
    GroupState,
    KeyStatus,
    PlanProgress,
    Presence,
    Progress,
    QueryColumns,
    QueryResult,
    code_of,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KeyOutcome:
    """One key's outcome: status, error code (OK when none), reason, release handle."""

    status: KeyStatus
    code: ErrorCode | int = ErrorCode.OK
    reason: str = ""
    handle: int | None = None

    @property
    def ok(self) -> bool:
        return self.status in (KeyStatus.STORED, KeyStatus.DUPLICATE, KeyStatus.OK)


@dataclass(frozen=True, slots=True)
class KeyPresence:
    """A query's answer for one key."""

    presence: Presence
    tier: str = ""


class Presences(Mapping[bytes, KeyPresence]):
    """A query's answers, one per key in request order, each decoded when it is read.

    Reads like ``Results``: ``answers[key]``, iteration over the keys, ``len``. It holds the
    reply's columns (spec section 6.9), or its records in a session below version 3, so a
    thousand-key answer costs nothing per key until a key is read. A key asked twice reads
    its last answer.
    """

    __slots__ = ("_answers", "_index", "_keys", "_made")

    def __init__(self, keys: tuple[bytes, ...], answers: QueryColumns | Sequence[QueryResult]) -> None:
        if len(answers) != len(keys):
            raise ValueError(f"{len(answers)} answers for {len(keys)} keys")
        self._keys = keys
        self._answers = answers
        self._index: dict[bytes, int] | None = None
        self._made: dict[object, KeyPresence] = {}
        """Each distinct answer, made once: a presence code and tier index, or a record."""

    def at(self, i: int) -> KeyPresence:
        """The answer for the ``i``-th key asked."""
        answers = self._answers
        if isinstance(answers, QueryColumns):
            code = answers.presence[i] << 8 | answers.tier[i]
            made = self._made.get(code)
            if made is None:
                made = self._made[code] = KeyPresence(PRESENCE_BY_CODE[code >> 8], answers.tiers[code & 0xFF])
            return made
        record = answers[i]
        made = self._made.get(record)
        if made is None:
            made = self._made[record] = KeyPresence(record.presence, record.tier)
        return made

    def __getitem__(self, key: bytes) -> KeyPresence:
        index = self._index
        if index is None:
            index = self._index = dict(zip(self._keys, range(len(self._keys)), strict=True))
        return self.at(index[key])

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"Presences({dict(self.items())!r})"

    @property
    def all_ok(self) -> bool:
        """Always true, as ``Results.all_ok`` is for answers: a query fails whole (it raises) or not at all."""
        return True


class Results(Mapping[bytes, T]):
    """Per-key results of one operation, in request order."""

    def __init__(self, items: list[tuple[bytes, T]]) -> None:
        self._items = items
        self._map = dict(items)

    def __getitem__(self, key: bytes) -> T:
        return self._map[key]

    def __iter__(self) -> Iterator[bytes]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Results({dict(self._items)!r})"

    @property
    def all_ok(self) -> bool:
        return all(getattr(v, "ok", True) for _, v in self._items)


class OpHandle(Generic[T]):
    """An operation in progress: wait with ``result(timeout)``, ``await`` it, or poll ``done()``."""

    def __init__(
        self,
        op_id: int,
        kind: str,
        future: Future[T],
        abort: Callable[[int], Any] | None = None,
        waiter: Callable[[Future[T], float | None], T] | None = None,
        poll: Callable[[], None] | None = None,
        awaiter: Callable[[Future[T]], Awaitable[T]] | None = None,
    ) -> None:
        self.op_id = op_id
        self.kind = kind
        self.future = future
        self._abort = abort
        self._waiter = waiter
        self._poll = poll
        self._awaiter = awaiter
        self.waited = False
        """Someone waited on (``result``) or awaited this handle: ``poll_completed`` skips it."""

    def done(self) -> bool:
        """Whether the operation completed; reads what has arrived first, without blocking."""
        if not self.future.done() and self._poll is not None:
            self._poll()
        return self.future.done()

    def result(self, timeout: float | None = None) -> T:
        """Block until the operation completes; re-raises its error.

        The waiting thread drives the client's socket itself, so the reply costs no
        thread hand-off. Raises ``TimeoutError`` when ``timeout`` passes first.
        """
        self.waited = True
        if self._waiter is not None and not self.future.done():
            return self._waiter(self.future, timeout)
        return self.future.result(timeout)

    def __await__(self) -> Generator[Any, None, T]:
        """Await the operation; the awaiting event loop reads the client's socket meanwhile, so the
        reply resolves the awaiter in the loop's own thread."""
        self.waited = True
        if self._awaiter is not None:
            return self._awaiter(self.future).__await__()
        return asyncio.wrap_future(self.future).__await__()

    def abort(self) -> None:
        """Best effort: ask the node to abort; the operation then completes (often ABORTED)."""
        if self._abort is not None and not self.future.done():
            self._abort(self.op_id)

    def __repr__(self) -> str:
        return f"OpHandle({self.kind} #{self.op_id}, done={self.future.done()})"


class StoreHandle(OpHandle[Results[KeyOutcome]]):
    """A ``deposit`` or a ``put`` in progress. ``written`` resolves once the client's memory is
    its own again (the node read it, or this client's WRITEs of it are over), whichever path
    stored it; the handle itself once the node answered for every key."""

    def __init__(
        self, op_id: int, kind: str, future: Future[Results[KeyOutcome]], written: OpHandle[None],
        abort: Callable[[int], Any] | None = None, waiter: Callable[[Future[Any], float | None], Any] | None = None,
        poll: Callable[[], None] | None = None, awaiter: Callable[[Future[Any]], Awaitable[Any]] | None = None,
    ) -> None:
        super().__init__(op_id, kind, future, abort, waiter, poll, awaiter)
        self.written = written


class Waiting(Protocol):
    """How a handle waits for its future (``ClientCore``): blocking, polling, awaiting."""

    def wait(self, future: Future[Any], timeout: float | None) -> Any: ...
    def poll(self) -> None: ...
    async def wait_async(self, future: Future[Any]) -> Any: ...


class Completing(Protocol):
    """Where a handle nobody waits on is queued once done (``kvcr_client.completions``)."""

    def when_done(self, fut: Future[Any], handle: OpHandle[Any], planned: bool = ...) -> None: ...


def store_handle(core: Waiting, completions: Completing, op_id: int, kind: str, future: Future[Results[KeyOutcome]],
                 written: Future[None], abort: Callable[[int], Any] | None = None) -> StoreHandle:
    """A deposit's or a put's handle: ``written`` once the memory is free, then the results."""
    handle = StoreHandle(op_id, kind, future, OpHandle(op_id, "written", written, None, core.wait, core.poll,
                                                       core.wait_async), abort, core.wait, core.poll, core.wait_async)
    completions.when_done(future, handle)
    return handle


@dataclass(frozen=True, slots=True)
class GroupDone:
    """``poll_completed``'s report that group ``group`` of a planned deliver is over for
    every key that has it: ``DELIVERED``, or ``FAILED`` with ``code`` (spec section 6.8)."""

    handle: DeliverHandle
    group: int
    state: GroupState
    code: ErrorCode | int = ErrorCode.OK

    @property
    def ok(self) -> bool:
        return self.state is GroupState.DELIVERED


class GroupFuture:
    """One group's completion: ``result(timeout)`` blocks (driving the client), ``await`` it
    in asyncio; it raises ``GroupFailed`` when the group will not be delivered."""

    def __init__(self, future: Future[None], waiter: Callable[[Future[Any], float | None], Any] | None) -> None:
        self.future = future
        self._waiter = waiter

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> None:
        if self._waiter is not None and not self.future.done():
            self._waiter(self.future, timeout)
        self.future.result(0)

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.wrap_future(self.future).__await__()


class DeliverHandle(OpHandle[Results[KeyOutcome]]):
    """A deliver with layer plans: completion per group, as well as for the whole request.

    Group ``g`` of a key is delivered once groups 0 to ``g`` of that key are known landed,
    from a NIXL notification, a ``progress`` event or the reply, whichever comes first
    (spec section 6.10); ``key=None`` means every key that has group ``g``. The state is
    kept by ``PlanProgress``, fed under the client's I/O lock.
    """

    def __init__(
        self, op_id: int, future: Future[Results[KeyOutcome]], keys: Sequence[bytes], groups: Sequence[int],
        token: int, abort: Callable[[int], Any] | None = None,
        waiter: Callable[[Future[Any], float | None], Any] | None = None, poll: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(op_id, "deliver", future, abort, waiter, poll)
        self.keys = tuple(keys)
        self._index = {key: i for i, key in enumerate(self.keys)}
        self.groups = tuple(groups)
        """Groups per key, in request order."""
        self.progress = PlanProgress(op_id, groups, token)
        self._ledger = self.progress.ledger
        """Where every group stands, per key and for the whole request (``GroupLedger``)."""
        self._over: set[int] = set()
        """Groups reported over for the whole request."""
        self._futures: dict[tuple[int, int | None], Future[None]] = {}
        self.on_group: Callable[[GroupDone], None] | None = None
        """Called (lock held) when a group is over for every key (``poll_completed``'s queue)."""

    @property
    def group_count(self) -> int:
        """The most groups any key has."""
        return self._ledger.group_count

    @property
    def disagreements(self) -> int:
        """Keys whose reply reported fewer groups than notifications proved (spec section 6.10)."""
        return self.progress.disagreements

    def state(self, group: int, key: bytes | None = None) -> GroupState:
        """Where group ``group`` stands (reads what has arrived first, without blocking)."""
        if self._poll is not None:
            self._poll()
        return self._state(group, self._item(key))

    def group(self, group: int, key: bytes | None = None) -> GroupFuture:
        """The completion of group ``group`` (of ``key``, or of every key that has it)."""
        item = self._item(key)
        if not 0 <= group < self._group_count(item):
            raise IndexError(f"group {group}: the plan has {self._group_count(item)}")
        future = self._futures.get((group, item))
        if future is None:
            future = Future()
            self._futures[(group, item)] = future
            self._resolve(group, item)
        return GroupFuture(future, self._waiter)

    def wait(self, group: int, timeout: float | None = None, key: bytes | None = None) -> None:
        """Block until group ``group`` is delivered (driving the client's socket and agent);
        ``GroupFailed`` when it will not be, ``TimeoutError`` when ``timeout`` passes first."""
        item = self._item(key)
        if 0 <= group < self._group_count(item) and self._state(group, item) is GroupState.DELIVERED:
            # Read without the lock: a delivered group stays delivered, so what this sees
            # can only be late (then the future below waits), never wrong.
            return
        self.group(group, key).result(timeout)

    # -- fed by the client (I/O lock held)

    def observe(self, event: Any) -> None:
        """A ``progress`` event or a notification of this request."""
        if isinstance(event, Progress):
            self.apply(self.progress.on_progress(event))
        else:
            self.apply(self.progress.on_notification(event))

    def apply(self, events: Sequence[GroupEvent]) -> None:
        """Events ``progress`` returned (its ledger already moved): resolve what waits on them,
        and report each group once it is over for the whole request (the first failure of
        group g ends it)."""
        ledger = self._ledger
        for event in events:
            g = event.group
            state = ledger.group_state(g)
            if state is not GroupState.PENDING:
                self._group_over(g, state, ledger.group_codes.get(g, 0))
            self._resolve(g, event.item)
            self._resolve(g, None)

    def _group_over(self, group: int, state: GroupState, code: int) -> None:
        if group in self._over:
            return
        self._over.add(group)
        if self.on_group is not None:
            self.on_group(GroupDone(self, group, state, code_of(code) if code else ErrorCode.OK))

    # -- internals

    def _item(self, key: bytes | None) -> int | None:
        if key is None:
            return None
        item = self._index.get(key)
        if item is None:
            raise KeyError(key)
        return item

    def _group_count(self, item: int | None) -> int:
        """Groups of ``item`` (None: the most any key has)."""
        return self.group_count if item is None else self.groups[item]

    def _state(self, group: int, item: int | None) -> GroupState:
        if item is not None:
            return self._ledger.state(item, group)
        return self._ledger.group_state(group)

    def _resolve(self, group: int, item: int | None) -> None:
        future = self._futures.get((group, item))
        if future is None or future.done():
            return
        state = self._state(group, item)
        if state is GroupState.DELIVERED:
            future.set_result(None)
        elif state is GroupState.FAILED:
            code = self._ledger.group_codes.get(group, 0) if item is None else self._ledger.code(item)
            future.set_exception(GroupFailed(code, f"group {group} will not be delivered"))


def when_all(futures: Sequence[Future[Any]], then: Callable[[], None]) -> None:
    """Run ``then`` once every one of ``futures`` is done: now when they all are (or there are
    none), else in the thread that resolves the last of them."""
    left = [f for f in futures if not f.done()]
    if not left:
        then()
        return
    count = [len(left)]

    def one(_: Future[Any]) -> None:
        count[0] -= 1
        if not count[0]:
            then()

    for f in left:
        f.add_done_callback(one)
