"""Eviction policies and the two-structure eviction index (architecture §3).

A policy scores an object once, when it becomes evictable; the index keeps every
evictable object twice over, in a global queue and in a queue per pool signature, both
ordered by ``(score, insertion order)``, and picks victims for a deficit of slots. The
index never removes objects on its own: the store does, so that slots and index change
together.

Both queues are binary heaps with lazy deletion: a heap item is ``(score, seq, entry)``
and it is live only while ``entry.index_seq == seq``. One item tuple is shared by the
two heaps. Dead items are dropped when they reach the top, or all at once when they
outnumber the live ones, so every removal costs O(1) amortized and a victim O(log n).
"""

from __future__ import annotations

import heapq
import inspect
import logging
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar, cast

from kvcr_io.plugins import load_class

Layout = tuple[tuple[str, str], ...]
"""An object's spans in order, each ``(span name, pool name)``."""

Signature = tuple[str, ...]
"""The pool names of a layout, in order (architecture §2)."""

log = logging.getLogger("kvcr.node")

_COMPACT_MIN = 64
"""Dead heap items tolerated before a heap is rebuilt, whatever its size."""


class LayoutInfo:
    """What the store and index derive once from a layout; shared by equal layouts."""

    __slots__ = ("grant", "layout", "need", "signature", "users")

    layout: Layout
    signature: Signature
    need: tuple[tuple[str, int], ...]
    """Slots per distinct pool, pools in order of first appearance."""
    users: int
    """Live objects with this layout (the store drops the info at zero)."""
    grant: tuple[str, bytes] | None
    """How a put's grant names the layout: span names joined, pools' indices (filled by
    ``kvcr_node.puts`` the first time a put of this layout is granted)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.signature = tuple(pool for _, pool in layout)
        counts: dict[str, int] = {}
        for pool in self.signature:
            counts[pool] = counts.get(pool, 0) + 1
        self.need = tuple(counts.items())
        self.users = 0
        self.grant = None

    def __repr__(self) -> str:
        return f"LayoutInfo(signature={self.signature!r}, need={dict(self.need)!r})"


class EvictionEntry(Protocol):
    """What a policy and the index read from an object."""

    @property
    def key(self) -> bytes: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def info(self) -> LayoutInfo: ...

    @property
    def last_access(self) -> int: ...

    index_seq: int
    """The index's bookkeeping: 0 when not indexed, else the live heap item's seq."""


E = TypeVar("E", bound=EvictionEntry)


class EvictionPolicy(ABC):
    """A score function, plus an optional admission hook (architecture §3).

    ``score`` runs when an object becomes evictable (commit, or its last claim
    dropped); lower scores are evicted first and ties go in insertion order. Scores
    must be totally ordered among themselves (no NaN).
    """

    name: str = "custom"

    @abstractmethod
    def score(self, entry: EvictionEntry) -> float:
        """The object's place in the eviction order; lower goes first."""

    def admit(self, key: bytes, layout: Layout) -> bool:
        """Whether to store an optional deposit; a ``False`` makes it ``DROPPED``."""
        return True


class FifoPolicy(EvictionPolicy):
    """The order objects became evictable; a release puts an object at the back.

    Every score is equal, so the index's insertion order alone decides.
    """

    name = "fifo"

    def score(self, entry: EvictionEntry) -> float:
        return 0


class LruPolicy(EvictionPolicy):
    """Least recently accessed first: the score is the object's last access tick."""

    name = "lru"

    def score(self, entry: EvictionEntry) -> float:
        return entry.last_access


_POLICIES: dict[str, type[EvictionPolicy]] = {"fifo": FifoPolicy, "lru": LruPolicy}

_LOGGED_FAILURES = 10
"""Plug-in failures logged with their traceback; after that, one line every thousand."""


def _short_repr(value: object) -> str:
    """A plug-in's answer for a log line: bounded, and safe when its ``repr`` is itself defective."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} with a failing repr>"
    return text if len(text) <= 80 else text[:77] + "..."


class GuardedPolicy(EvictionPolicy):
    """A plug-in policy behind a boundary: its failures are logged and counted, never raised.

    A plug-in runs inside the store's state changes, where an exception would leave the
    index half updated and stop the node. So a ``score`` that raises or is not a number
    (or is NaN) counts as 0, which puts the object early in the eviction order, and an
    ``admit`` that raises or does not return a bool admits, as if there were no hook.
    """

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.failures = 0

    def score(self, entry: EvictionEntry) -> float:
        try:
            value = self.inner.score(entry)
        except Exception:
            self._failed("score", entry.key, "raised")
            return 0.0
        try:
            return self._as_score(value, entry.key)
        except Exception:  # a number type whose comparisons are themselves defective
            self._failed("score", entry.key, "returned a number that cannot be compared")
            return 0.0

    def _as_score(self, value: object, key: bytes) -> float:
        """A plug-in's score as a float: any real number (ints past float range become
        +-inf, so they order last or first); NaN, bools and non-numbers count as 0."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            self._failed("score", key, f"returned {_short_repr(value)}, not a number")
            return 0.0
        try:
            score = float(value)
        except OverflowError:
            return math.inf if cast(float, value) > 0 else -math.inf
        if score != score:
            self._failed("score", key, "returned NaN, not a number")
            return 0.0
        return score

    def admit(self, key: bytes, layout: Layout) -> bool:
        try:
            value = self.inner.admit(key, layout)
        except Exception:
            self._failed("admit", key, "raised")
            return True
        if type(value) is not bool:
            self._failed("admit", key, f"returned {_short_repr(value)}, not a bool")
            return True
        return value

    def _failed(self, hook: str, key: bytes, what: str) -> None:
        self.failures += 1
        if self.failures <= _LOGGED_FAILURES:
            log.error("eviction policy %r: %s(%r) %s; using the default", self.name, hook, key[:64], what,
                      exc_info=what == "raised")
        elif self.failures % 1000 == 0:
            log.error("eviction policy %r: %d failures so far", self.name, self.failures)


def make_policy(name: str) -> EvictionPolicy:
    """A built-in policy by name (``"fifo"``, ``"lru"``), or ``"module:Class"`` for a plug-in.

    A plug-in must name a concrete ``EvictionPolicy`` subclass, checked before anything
    of it runs (``os:getcwd`` names a callable, not a policy: it is refused unrun). The
    class is instantiated without arguments and runs behind a ``GuardedPolicy``.
    """
    if name in _POLICIES:
        return _POLICIES[name]()
    if ":" in name:
        cls = load_class(name, EvictionPolicy, f"eviction policy {name!r}")  # type: ignore[type-abstract]  # checked below
        if inspect.isabstract(cls):
            raise ValueError(f"eviction policy {name!r} is abstract: it must define score()")
        try:
            policy = cls()
        except Exception as exc:
            raise ValueError(f"eviction policy {name!r} cannot be instantiated without arguments: {exc}") from exc
        return GuardedPolicy(policy)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(_POLICIES)} or 'module:Class'")


_Item = tuple[float, int, E]


class _Heap(Generic[E]):
    """A heap of ``(score, seq, entry)`` items with lazy deletion."""

    __slots__ = ("dead", "items", "live")

    def __init__(self) -> None:
        self.items: list[_Item[E]] = []
        self.live = 0
        self.dead = 0

    def push(self, item: _Item[E]) -> None:
        heapq.heappush(self.items, item)
        self.live += 1

    def kill(self) -> None:
        """Account for one item that went dead; rebuild when the dead dominate."""
        self.live -= 1
        self.dead += 1
        if self.dead > _COMPACT_MIN and self.dead > self.live:
            self.items = [it for it in self.items if it[2].index_seq == it[1]]
            heapq.heapify(self.items)
            self.dead = 0

    def live_items(self) -> Iterator[_Item[E]]:
        return (it for it in self.items if it[2].index_seq == it[1])


class EvictionIndex(Generic[E]):
    """The global queue and the layout index of architecture §3, kept in lockstep."""

    __slots__ = ("_global", "_groups", "_policy", "_pool_sigs", "_seq", "_slots", "visits")

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._seq = 0
        self._global: _Heap[E] = _Heap()
        self._groups: dict[Signature, _Heap[E]] = {}
        # pool -> signatures of the non-empty groups that use it: the fast-path test
        # looks only at the deficit pools' entries here.
        self._pool_sigs: dict[str, set[Signature]] = {}
        # pool -> slots held by evictable objects (architecture §2's "reclaimable" part).
        self._slots: dict[str, int] = {}
        self.visits = 0
        """Candidate objects looked at by ``select_victims``, cumulative."""

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def __len__(self) -> int:
        return self._global.live

    def __contains__(self, entry: E) -> bool:
        return entry.index_seq != 0

    def evictable_slots(self, pool: str) -> int:
        """Slots of ``pool`` held by evictable objects."""
        return self._slots.get(pool, 0)

    def add(self, entry: E) -> None:
        """Make ``entry`` evictable: score it now and append it to both structures."""
        if entry.index_seq != 0:
            raise ValueError(f"object {entry.key!r} is already in the eviction index")
        score = self._policy.score(entry)
        if score != score:  # NaN would silently break the heap order
            raise ValueError(f"policy {self._policy.name!r} scored {entry.key!r} NaN")
        self._seq += 1
        entry.index_seq = self._seq
        item: _Item[E] = (score, self._seq, entry)
        info = entry.info
        self._global.push(item)
        self._group(info.signature).push(item)
        for pool, count in info.need:
            self._slots[pool] = self._slots.get(pool, 0) + count

    def add_all(self, entries: Sequence[E]) -> None:
        """``add`` each of ``entries``, in order (a restarted node adopting many): each heap
        made once, in linear time, instead of an insertion per entry."""
        by_group: dict[Signature, list[_Item[E]]] = {}
        infos: dict[int, tuple[LayoutInfo, int]] = {}
        score_of = self._policy.score
        seq = self._seq
        items: list[_Item[E]] = []
        for entry in entries:
            if entry.index_seq != 0:
                raise ValueError(f"object {entry.key!r} is already in the eviction index")
            score = score_of(entry)
            if score != score:
                raise ValueError(f"policy {self._policy.name!r} scored {entry.key!r} NaN")
            seq += 1
            entry.index_seq = seq
            item: _Item[E] = (score, seq, entry)
            items.append(item)
            info = entry.info
            group = by_group.get(info.signature)
            if group is None:
                group = by_group[info.signature] = []
            group.append(item)
            known = infos.get(id(info))
            infos[id(info)] = (info, 1 if known is None else known[1] + 1)
        self._seq = seq
        for heap, added in ((self._global, items), *((self._group(sig), group) for sig, group in by_group.items())):
            heap.items.extend(added)
            heapq.heapify(heap.items)
            heap.live += len(added)
        for info, count in infos.values():
            for pool, need in info.need:
                self._slots[pool] = self._slots.get(pool, 0) + need * count

    def _group(self, signature: Signature) -> _Heap[E]:
        """The layout index's heap for ``signature``, made (and filed under its pools) if new."""
        group = self._groups.get(signature)
        if group is None:
            group = self._groups[signature] = _Heap()
            for pool in dict.fromkeys(signature):
                self._pool_sigs.setdefault(pool, set()).add(signature)
        return group

    def remove(self, entry: E) -> None:
        """Take ``entry`` out of both structures (claim, removal or eviction)."""
        if entry.index_seq == 0:
            raise ValueError(f"object {entry.key!r} is not in the eviction index")
        entry.index_seq = 0
        info = entry.info
        self._global.kill()
        group = self._groups[info.signature]
        group.kill()
        if group.live == 0:
            # An empty group leaves the layout index, so the fast-path test never
            # sees it: "every non-empty group that uses a deficit pool".
            del self._groups[info.signature]
            for pool, _ in info.need:
                sigs = self._pool_sigs[pool]
                sigs.discard(info.signature)
                if not sigs:
                    del self._pool_sigs[pool]
        for pool, count in info.need:
            self._slots[pool] -= count

    def select_victims(
        self, deficit: dict[str, int], visits: int | None = None, keep: Callable[[E], bool] | None = None,
        most: int | None = None,
    ) -> list[E] | None:
        """Whole objects whose eviction covers ``deficit`` (slots still needed per pool).

        Returns ``[]`` for no deficit, ``None`` when the evictable objects cannot cover
        it (all or nothing), and never removes anything: the caller evicts. With
        ``visits``, the walk looks at that many objects at most and returns what it found
        so far (the disk tier's look at what would go next, ``kvcr_node.disk_tier``), and
        then ``keep`` may leave objects out of what it returns (they still cover the
        deficit) and ``most`` ends the walk once that many are found.
        """
        need = {pool: n for pool, n in deficit.items() if n > 0}
        if not need:
            return []
        # All or nothing (architecture §3: "if the candidates cannot cover the deficit, nothing
        # is evicted"). The walk below takes every candidate that uses a pool still in
        # deficit, so it fails exactly when some pool's evictable slots fall short of
        # its deficit; this test decides in O(deficit pools) without walking.
        for pool, n in need.items():
            if self._slots.get(pool, 0) < n:
                return None
        # architecture §3: "If every non-empty group that uses a deficit pool is one and the
        # same group, take victims from that group's queue (the fast path: no object
        # of an unrelated pool is ever looked at). If several groups overlap the
        # deficit pools, walk the global queue, so the policy's order across layouts
        # holds, skipping objects that use none of the deficit pools."
        only: Signature | None = None
        several = False
        for pool in need:
            for sig in self._pool_sigs.get(pool, ()):
                if only is None:
                    only = sig
                elif sig != only:
                    several = True
                    break
            if several:
                break
        if only is None:  # unreachable after the slot test; kept for safety
            return None
        heap = self._global if several else self._groups[only]
        if visits is None:
            return self._walk(heap, need)
        return self._walk(heap, need, visits, keep, most)

    def _walk(
        self, heap: _Heap[E], need: dict[str, int], limit: int | None = None, keep: Callable[[E], bool] | None = None,
        most: int | None = None,
    ) -> list[E] | None:
        """Pop candidates in order until ``need`` is covered (or ``limit`` live ones were
        looked at, or ``most`` taken: then what was found), then restore the heap.

        A candidate is taken when it uses a pool still in deficit (and ``keep`` says so),
        else skipped. Dead items met on the way are dropped for good (their removal
        already paid for it); live ones are pushed back, so the heap's contents do not change.
        """
        items = heap.items
        popped: list[_Item[E]] = []
        victims: list[E] = []
        visits = 0
        while need and items and (limit is None or visits < limit) and (most is None or len(victims) < most):
            item = heapq.heappop(items)
            entry = item[2]
            if entry.index_seq != item[1]:
                heap.dead -= 1
                continue
            popped.append(item)
            visits += 1
            useful = False
            for pool, count in entry.info.need:
                left = need.get(pool)
                if left is not None:
                    useful = True
                    if left > count:
                        need[pool] = left - count
                    else:
                        del need[pool]
            if useful and (keep is None or keep(entry)):
                victims.append(entry)
        for item in popped:
            heapq.heappush(items, item)
        self.visits += visits
        return None if need and limit is None else victims

    def check(self) -> list[str]:
        """Internal consistency, as human-readable breaches (empty when healthy). O(n)."""
        breaches: list[str] = []
        in_global: dict[int, E] = {}
        for _, _, entry in self._global.live_items():
            if id(entry) in in_global:
                breaches.append(f"{entry.key!r} twice in the global queue")
            in_global[id(entry)] = entry
        if len(in_global) != self._global.live:
            breaches.append(f"global queue holds {len(in_global)} live objects, counted {self._global.live}")
        in_groups: dict[int, E] = {}
        slots: dict[str, int] = {}
        for sig, group in self._groups.items():
            live = 0
            for _, _, entry in group.live_items():
                live += 1
                if entry.info.signature != sig:
                    breaches.append(f"{entry.key!r} filed under the wrong signature {sig!r}")
                if id(entry) in in_groups:
                    breaches.append(f"{entry.key!r} twice in the layout index")
                in_groups[id(entry)] = entry
                for pool, count in entry.info.need:
                    slots[pool] = slots.get(pool, 0) + count
            if live == 0:
                breaches.append(f"empty group {sig!r} kept in the layout index")
            if live != group.live:
                breaches.append(f"group {sig!r} holds {live} live objects, counted {group.live}")
            for pool in set(sig):
                if sig not in self._pool_sigs.get(pool, ()):
                    breaches.append(f"pool {pool!r} does not list group {sig!r}")
        if in_global.keys() != in_groups.keys():
            breaches.append("global queue and layout index hold different objects")
        for pool, sigs in self._pool_sigs.items():
            for sig in sigs:
                if sig not in self._groups:
                    breaches.append(f"pool {pool!r} lists the missing group {sig!r}")
        if {p: n for p, n in self._slots.items() if n} != slots:
            breaches.append(f"evictable slots {self._slots!r}, recounted {slots!r}")
        return breaches

    def members(self) -> tuple[list[E], list[E]]:
        """The live objects of the global queue and of the layout index (for checks)."""
        in_global = [it[2] for it in self._global.live_items()]
        in_groups = [it[2] for g in self._groups.values() for it in g.live_items()]
        return in_global, in_groups

    def order(self) -> list[E]:
        """Every evictable object in policy order (O(n log n); for tests and tools)."""
        return [it[2] for it in sorted(self._global.live_items())]
