"""Descriptors, threads and resident memory of a process (this one or a node), from /proc; the client
churn tests' snapshot of this process."""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from dataclasses import dataclass
from typing import Any

FD_SLACK = 4
"""Descriptors a client churn may leave open beyond its start (ZeroMQ reaper and similar lazily made ones)."""
RSS_SLACK_KIB = 4096
"""RSS growth a client churn may leave (allocator arenas, caches warmed once), far below what a leak of
one object per operation costs over thousands of operations."""
INTERN_RESERVE = 32768
"""Strings interned (and held) while a ``Heap`` measures, so that the interpreter's table of
interned strings does not resize in the window."""


NOT_THE_CLIENTS = (
    tracemalloc.Filter(False, "*/kvcr_testing/nodes.py"),
    tracemalloc.Filter(False, "*/_pytest/*"),
    tracemalloc.Filter(False, "*/logging/__init__.py"),
    tracemalloc.Filter(False, tracemalloc.__file__),
)
"""What a heap check leaves out: a node's output, which the test's reader thread collects, and
log records pytest keeps (a loaded machine makes both grow: a late heartbeat is logged)."""


RESIZE_BYTES = 512 * 1024
"""One block this large is an interpreter table that doubled (the interned strings, once large
modules were imported in the same process: more than ``INTERN_RESERVE`` can move past), not
something kept per cycle, which is many small blocks: ``grown`` leaves such blocks out, counted
block by block (the same call site may free other blocks in the window), and ``where`` says so."""
TRACE_FRAMES = 4
"""Frames kept per allocation, so that a heap that grew says through which calls."""
WHERE_LINES = 5


class Heap:
    """The Python heap the code under test holds, for churn tests: ``grown()`` since ``with``.
    ``collect``: run the cyclic collector first at both ends (False: garbage in cycles counts,
    for tests that hold the client to freeing what it made without the collector)."""

    def __init__(self, collect: bool = True) -> None:
        self.collect = collect
        self.before = 0
        self.where: list[str] = []
        self._first: tracemalloc.Snapshot | None = None
        self._reserve: list[str] = []

    def __enter__(self) -> Heap:
        if self.collect:
            gc.collect()
        # The interpreter's table of interned strings (msgpack interns map keys, imports
        # intern names) doubles when it fills: one resize in the window is a block of about
        # 1 MB that is no client's. Room made for it first keeps the window to what the code
        # under test holds.
        self._reserve = [sys.intern(f"kvcr-heap-reserve-{i}") for i in range(INTERN_RESERVE)]
        tracemalloc.start(TRACE_FRAMES)
        self._first = self._snapshot()
        self.before = self.size(self._first)
        return self

    def __exit__(self, *exc: object) -> None:
        tracemalloc.stop()
        self._reserve = []

    @staticmethod
    def _snapshot() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces(NOT_THE_CLIENTS)

    @staticmethod
    def size(snapshot: tracemalloc.Snapshot | None = None) -> int:
        """Bytes traced now (or in ``snapshot``), less what ``NOT_THE_CLIENTS`` leaves out."""
        snapshot = snapshot if snapshot is not None else Heap._snapshot()
        return sum(stat.size for stat in snapshot.statistics("filename"))

    def rebase(self) -> None:
        """Measure from now on (a second window, past what a first one warmed)."""
        if self.collect:
            gc.collect()
        self._first = self._snapshot()
        self.before = self.size(self._first)

    def grown(self) -> int:
        """Bytes more than at ``with``; ``where`` then names the lines that grew most (for the
        assertion's message: a heap that grew says where)."""
        if self.collect:
            gc.collect()
        now = self._snapshot()
        assert self._first is not None
        tables = _large_blocks(now)
        before = _large_blocks(self._first)
        resized = {tb: size - before.get(tb, 0) for tb, size in tables.items() if size > before.get(tb, 0)}
        diffs = now.compare_to(self._first, "traceback")
        self.where = [("(a table resized, not counted) " if stat.traceback in resized else "")
                      + f"+{stat.size_diff} B in {stat.count_diff} blocks at "
                      + " <- ".join(f"{frame.filename}:{frame.lineno}" for frame in reversed(stat.traceback))
                      for stat in diffs[:WHERE_LINES] if stat.size_diff > 0]
        return self.size(now) - self.before - sum(resized.values())


def _large_blocks(snapshot: tracemalloc.Snapshot) -> dict[tracemalloc.Traceback, int]:
    """Bytes in blocks of ``RESIZE_BYTES`` or more, by the call site that allocated them."""
    large: dict[tracemalloc.Traceback, int] = {}
    for trace in snapshot.traces:
        if trace.size >= RESIZE_BYTES:
            large[trace.traceback] = large.get(trace.traceback, 0) + trace.size
    return large


def fd_count(pid: int | None = None) -> int:
    """Open descriptors of process ``pid`` (None: this process)."""
    return len(os.listdir(f"/proc/{'self' if pid is None else pid}/fd"))


def thread_count(pid: int | None = None) -> int:
    """Threads of process ``pid`` (None: this process), every one the kernel knows of (Python's and native)."""
    return len(os.listdir(f"/proc/{'self' if pid is None else pid}/task"))


def rss_kib(pid: int | None = None) -> int:
    """Resident set size (VmRSS) of process ``pid``; of this process (None) after a garbage collection."""
    if pid is None:
        gc.collect()
    path = f"/proc/{'self' if pid is None else pid}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in {path}")


@dataclass(frozen=True)
class Snapshot:
    """Descriptors, RSS and the client's table sizes at one moment."""

    fds: int
    rss_kib: int
    tables: dict[str, int]

    @classmethod
    def take(cls, client: Any) -> Snapshot:
        gc.collect()  # objects in reference cycles hold descriptors until collected
        return cls(fd_count(), rss_kib(), dict(client.tables()))

    def assert_back_within(self, before: Snapshot, what: str, rss_slack_kib: int = RSS_SLACK_KIB) -> None:
        """Descriptors and RSS within the slack of ``before``; every table as small as before."""
        assert self.fds <= before.fds + FD_SLACK, (what, "descriptors", before.fds, self.fds)
        assert self.rss_kib <= before.rss_kib + rss_slack_kib, (what, "RSS KiB", before.rss_kib, self.rss_kib)
        grown = {k: (before.tables.get(k, 0), v) for k, v in self.tables.items() if v > before.tables.get(k, 0)}
        assert not grown, (what, "tables grew", grown)
