"""Operation handles and per-key results."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvcr_protocol import PRESENCE_BY_CODE, ErrorCode, KeyStatus, Presence, QueryColumns, QueryResult

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
