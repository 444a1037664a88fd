"""Descriptors and resident memory of this (the client's) process, for the client churn tests."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

FD_SLACK = 4
"""Descriptors a client churn may leave open beyond its start (ZeroMQ reaper and similar lazily made ones)."""
RSS_SLACK_KIB = 4096
"""RSS growth a client churn may leave (allocator arenas, caches warmed once), far below what a leak of
one object per operation costs over thousands of operations."""


def fd_count() -> int:
    """Open descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def rss_kib() -> int:
    """Resident set size of this process (VmRSS), after a garbage collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


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

    def assert_back_within(self, before: Snapshot, what: str) -> None:
        """Descriptors and RSS within the slack of ``before``; every table as small as before."""
        assert self.fds <= before.fds + FD_SLACK, (what, "descriptors", before.fds, self.fds)
        assert self.rss_kib <= before.rss_kib + RSS_SLACK_KIB, (what, "RSS KiB", before.rss_kib, self.rss_kib)
        grown = {k: (before.tables.get(k, 0), v) for k, v in self.tables.items() if v > before.tables.get(k, 0)}
        assert not grown, (what, "tables grew", grown)
